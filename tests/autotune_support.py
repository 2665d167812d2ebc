"""Shared by the autotune tests (no tests here): run a pool transfer through the pools'
dispatch and record the configuration each launch was given."""
import pytest


def dispatch_backup(monkeypatch, t, num_layers):
    """Poisons the destination of transfer ``t``, runs it as a pool backup (whole pages) through
    ``kvtier.pool.dispatch`` and returns the configs its ``copy_rows`` launches received;
    the caller checks them and ``t.verify()``. Skips where the pools are absent."""
    dispatch = pytest.importorskip("kvtier.pool.dispatch")
    launched = []
    real = dispatch.copy_rows
    monkeypatch.setattr(dispatch, "copy_rows", lambda *a, **k: launched.append(k["config"]) or real(*a, **k))
    t.poison()
    dispatch.run_copy("backup", t.src, t.src_idx, t.dst, t.dst_idx, num_layers=num_layers, by_page=True)
    return launched
