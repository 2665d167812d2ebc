"""Shared by the autotune tests (no tests here): run a tuning transfer as production runs
it (the pools' own call, their own lookup) and record the configuration each launch got."""
import contextlib
import importlib
import logging
import re

core = importlib.import_module("kvtier.kernels.launcher")


def spy_launches(monkeypatch):
    """Every configuration a launch runs with from now on, in order (every launch passes
    `CopyLaunch.__call__`; the copies still run)."""
    launched = []
    real = core.CopyLaunch.__call__
    monkeypatch.setattr(core.CopyLaunch, "__call__",
                        lambda bound, *a, **k: launched.append(bound.config) or real(bound, *a, **k))
    return launched


def pool_call(monkeypatch, t):
    """Poisons the destination of transfer ``t``, runs the pools' call under their own
    lookup and returns the configs its launches received; the caller checks them and
    ``t.verify()``."""
    launched = spy_launches(monkeypatch)
    t.poison()
    t.runner()()
    return launched


@contextlib.contextmanager
def logs_warning(caplog, pattern: str):
    """The block logs a WARNING on the ``kvtier`` logger whose message matches ``pattern``."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        yield
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "kvtier"]
    assert any(re.search(pattern, m) for m in said), said
