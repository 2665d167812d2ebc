"""Spill pruning with an injected codegen report (and the real one where it can run)."""
from types import SimpleNamespace

import pytest

from kvtier.autotune.key import DeviceId
from kvtier.autotune.prune import codegen_report, codegen_target, prune_spilling
from kvtier.config import CopyConfig


def _configs():
    return [CopyConfig(num_programs=p, rows=r, block_bytes=b, num_warps=w)
            for p in (1, 4) for r in (1, 16) for b in (512, 4096) for w in (4, 8)]


def test_configs_whose_report_spills_are_pruned_with_one_compile_per_kernel():
    calls = []

    def report(target, *, config, row_bytes, **shape):
        calls.append((target, config, row_bytes, shape))
        return SimpleNamespace(spills=64 if config.rows * config.block_bytes >= 65536 else 0, registers=40)

    cfgs = _configs()
    kept, pruned = prune_spilling(cfgs, target="sm90", row_bytes=4096, report=report, src_table=True)
    assert pruned and kept
    assert set(pruned) == {c for c in cfgs if c.rows == 16 and c.block_bytes == 4096}
    assert sorted(kept + pruned, key=cfgs.index) == cfgs
    # the program count is not compiled: one report per (rows, block, warps)
    assert len(calls) == len({(c.rows, c.block_bytes, c.num_warps) for c in cfgs})
    assert all(t == "sm90" and rb == 4096 and s == {"src_table": True} for t, _, rb, s in calls)


def test_no_report_keeps_everything():
    cfgs = _configs()
    assert prune_spilling(cfgs, target="sm90", row_bytes=1024, report=lambda *a, **k: None) == (cfgs, [])
    assert prune_spilling(cfgs, target=None, row_bytes=1024,
                          report=lambda *a, **k: pytest.fail("no target: nothing compiles")) == (cfgs, [])


def test_codegen_report_is_none_when_compiling_fails_or_reports_an_error(monkeypatch):
    import kvtier.kernels.codegen as codegen

    def boom(*a, **k):
        raise RuntimeError("no backend")

    monkeypatch.setattr(codegen, "compile_report", boom)
    assert codegen_report("sm90", config=CopyConfig(), row_bytes=1024) is None
    monkeypatch.setattr(codegen, "compile_report", lambda *a, **k: SimpleNamespace(error="x", spills=None))
    assert codegen_report("sm90", config=CopyConfig(), row_bytes=1024) is None
    good = SimpleNamespace(error=None, spills=0)
    monkeypatch.setattr(codegen, "compile_report", lambda *a, **k: good)
    assert codegen_report("sm90", config=CopyConfig(), row_bytes=1024) is good


def test_codegen_report_is_none_without_the_codegen_module(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "kvtier.kernels.codegen", None)   # import fails
    assert codegen_report("sm90", config=CopyConfig(), row_bytes=1024) is None


def test_codegen_target_per_device():
    assert codegen_target(DeviceId("cuda", "H200", "sm_90", 132)) == "sm90"
    assert codegen_target(DeviceId("rocm", "MI300X", "gfx942:sramecc+:xnack-", 304)) == "gfx942"
    assert codegen_target(DeviceId("npu", "Ascend910B4", "Ascend910B4", 40)) is None
    assert codegen_target(DeviceId("cpu", "x86_64", "x86_64", 2)) is None


def test_real_report_prunes_a_tile_that_spills():
    """With community Triton and its cuobjdump: a 64-row x 16 KiB tile spills on sm90."""
    spilling = CopyConfig(num_programs=4, rows=64, block_bytes=16384, num_warps=4)
    rep = codegen_report("sm90", config=spilling, row_bytes=16384)
    if rep is None or rep.spills is None:
        pytest.skip("sm90 codegen with cuobjdump is not available here")
    kept, pruned = prune_spilling([spilling, CopyConfig()], target="sm90", row_bytes=16384)
    assert pruned == [spilling] and kept == [CopyConfig()]
