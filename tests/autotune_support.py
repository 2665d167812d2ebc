"""Shared by the autotune tests (no tests here): run a tuning transfer as production runs
it (the pools' own call, their own lookup) and record the configuration each launch got."""
import importlib

launch = importlib.import_module("kvtier.pool.launch")


def spy_launches(monkeypatch):
    """Every configuration `kvtier.pool.launch` hands to ``copy_rows`` from now on, in order
    (the copies still run)."""
    launched = []
    real = launch.run_bound
    monkeypatch.setattr(launch, "run_bound",
                        lambda op, bound, *a, **k: launched.append(bound.config) or real(op, bound, *a, **k))
    return launched


def pool_call(monkeypatch, t):
    """Poisons the destination of transfer ``t``, runs the pools' call under their own
    lookup and returns the configs its launches received; the caller checks them and
    ``t.verify()``."""
    launched = spy_launches(monkeypatch)
    t.poison()
    t.runner()()
    return launched
