"""A sweep run end to end on the CPU: every point verified, the outputs (table, JSON,
PNG) written, the figures labelled as not hardware figures; the launch probe (the host
overhead measurement: test_overhead.py)."""
import json

import pytest
import torch

from bench_support import bench, guarded_workload
from kvtier.bench import Grid, Sweep, run_sweep
from kvtier.bench import report, sgl_baseline
from kvtier.bench.goals import evaluate, grade
from kvtier.bench.probe import LaunchProbe
from kvtier.bench.pools import POISON
from kvtier.bench.workload import Shape, Unsupported
from kvtier.kernels import copy_rows

TINY = Sweep(grids=(Grid(ops=("backup", "load_layer", "gather"), row_bytes=(128,), page_sizes=(4,),
                         tokens=(8, 16), program_caps=(1,)),),
             max_layers=2, max_bytes=1 << 20, ceiling_bytes=1 << 20, warmup=0, iters=2, min_iters=2,
             baselines=("torch", "sgl_kernel"), hardware=False)


@pytest.fixture(scope="module")
def run():
    return run_sweep(TINY, torch.device("cpu"), log=None)


def test_every_point_measured_and_verified(run):
    pts = run["points"]
    # 3 ops x 2 sizes; engines: pool kernel + dma (not for gather), copy_rows p<=1, torch.
    assert len(pts) == 2 * (4 + 4 + 3)
    assert not [p for p in pts if "error" in p or "skipped" in p]
    assert all(p["gbps"] > 0 and p["host_us"] > 0 for p in pts)
    assert {p["engine"] for p in pts} == {"pool", "copy_rows", "torch"}
    capped = [p for p in pts if p["engine"] == "copy_rows"]
    assert all(p["programs"] == 1 for p in capped)
    assert run["environment"]["hardware_figures"] is False
    assert "NOT hardware figures" in run["environment"]["note"]


def test_outputs(run, tmp_path):
    table = report.format_table(run)
    assert len(table.splitlines()) == 2 + len(run["points"])
    assert "kvtier pool dma" in table and "torch" in table
    summary = report.format_summary(run)
    assert "NOT hardware figures" in summary and "goals are not graded" in summary
    back = json.loads(report.write_json(run, tmp_path / "b.json").read_text())
    assert back["points"] == json.loads(json.dumps(run["points"]))
    png = report.plot(run, tmp_path / "b.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_a_failing_engine_is_recorded_not_fatal(monkeypatch):
    from kvtier.bench import torch_baseline

    def broken(w, op):
        class P:
            fn = staticmethod(lambda: None)   # moves nothing
            programs, written = None, None
        return P()
    monkeypatch.setattr(torch_baseline, "prepare", broken)
    sweep = Sweep(grids=(Grid(ops=("load",), row_bytes=(128,), page_sizes=(1,), tokens=(8,),
                              strategies=("kernel",)),), max_layers=1, warmup=0, iters=2,
                  ceiling_bytes=1 << 20, min_iters=2, baselines=("torch",), hardware=False)
    pts = run_sweep(sweep, torch.device("cpu"), log=None)["points"]
    by = {p["engine"]: p for p in pts}
    assert "gbps" in by["pool"]
    assert by["torch"]["error"].startswith("wrong bytes")


def test_kernel_only_and_host_time_are_separate_fields(run):
    for p in run["points"]:
        assert {"device_us", "device_p10_us", "device_p90_us", "device_min_us", "host_us", "host_p10_us",
                "host_p90_us", "iters", "timing", "kernel_only"} <= set(p)
        assert p["device_p10_us"] <= p["device_us"] <= p["device_p90_us"]
        assert p["timing"] == "wall clock" and p["kernel_only"] is False      # CPU: no device stream
        assert p["iters"] >= TINY.min_iters
    m = run["method"]
    assert m["min_iters"] == TINY.min_iters and m["warmup_calls"] == TINY.warmup and "separately" in m["host_time"]
    assert run["baselines"]["sgl_kernel"] == sgl_baseline.ABSENT
    table = report.format_table(run).splitlines()[0].split()
    assert {"dev", "host", "p10-p90", "n"} <= set(table)


def test_configured_iterations_are_at_least_twenty():
    sweep = Sweep(grids=(Grid(ops=("load_layer", "gather"), row_bytes=(128,), page_sizes=(4,), tokens=(8,),
                              strategies=("kernel",)),), max_layers=1, ceiling_bytes=1 << 16, warmup=1,
                  iters=25, min_iters=20, baselines=("torch", "torch copy_", "vllm"), hardware=False)
    out = run_sweep(sweep, torch.device("cpu"), log=None)
    pts = out["points"]
    assert {p["engine"] for p in pts} == {"pool", "torch", "torch copy_"}   # vllm: CUDA only
    assert all(20 <= p["iters"] <= 25 for p in pts) and not [p for p in pts if "error" in p]
    assert "CUDA only" in out["baselines"]["vllm"] and out["baselines"]["torch copy_"] == "runs"
    copy = [p for p in pts if p["engine"] == "torch copy_"]
    assert all(p["programs"] is None and p["bytes"] > 0 for p in copy)


def test_time_budget_truncates():
    out = run_sweep(TINY, torch.device("cpu"), log=None, time_budget_s=0.0)
    assert out["truncated"] and out["points"] == []


def test_goals_graded_on_hardware_figures():
    mk = lambda **kw: {"op": "load", "layout": "layer_first", "row_bytes": 1024, "page_size": 16,
                       "tokens": 4096, "bytes": 8 << 20, "strategy": "kernel", "programs": 4, **kw}
    run = {"points": [mk(engine="pool", gbps=50.0, pct_ceiling=96.0),
                      mk(engine="pool", strategy="dma", gbps=5.0, pct_ceiling=9.0),
                      mk(engine="torch", strategy="-", gbps=20.0, pct_ceiling=40.0, programs=None)]}
    goals = dict(evaluate(run))
    assert goals["link >= 95% of pinned copy with <= 4 programs"].startswith("1/1")
    pages = [v for k, v in goals.items() if k.startswith("4-24 KiB")][0]
    assert pages.startswith("1/1") and "10.00x" in pages         # 50 / 5 (same-run dma)
    assert goals["never slower than plain torch"].startswith("1/1 points; worst 2.50x")
    met = {g["goal"]: g["met"] for g in grade(run)}
    assert met["link >= 95% of pinned copy with <= 4 programs"] is True
    assert met["dma strategy >= 85% of pinned copy (pages >= 16 tokens)"] is False
    run["points"][0].update(gbps=10.0, pct_ceiling=19.0)
    goals = dict(evaluate(run))
    assert goals["never slower than plain torch"].startswith("0/1")
    assert goals["link >= 95% of pinned copy with <= 4 programs"].startswith("0/1")


def test_probe_records_the_grid_and_moves_nothing():
    s = Shape(components=2, layers=2, row_bytes=128, page_size=1, tokens=32, layout="layer_first")
    w, alloc = guarded_workload(s)
    t = w.copy("load")
    w.poison("load")
    cfg = bench.kvtier_engine.config_for(w, "load", num_programs=3)
    with LaunchProbe() as probe:
        copy_rows(t.src, t.src_indices, t.dst, t.dst_indices, config=cfg)
    assert probe.programs() == 3 and len(probe.grids) == 1
    assert all((x == POISON).all() for x in w.tensors("load")[1])
    copy_rows(t.src, t.src_indices, t.dst, t.dst_indices, config=cfg)   # the kernel is back
    assert not all((x == POISON).all() for x in w.tensors("load")[1])
    alloc.check()


def test_indices_seen_inside_the_probe_are_checked_again_after_it():
    from kvtier.kernels import KvtierError
    s = Shape(components=2, layers=1, row_bytes=128, page_size=1, tokens=16, layout="layer_first")
    w, alloc = guarded_workload(s)
    t = w.copy("load")
    bad = t.dst_indices.clone()
    bad[5] = 10 ** 6
    with LaunchProbe():
        copy_rows(t.src, t.src_indices, t.dst, bad)       # recorded: no check ran
    with pytest.raises(KvtierError, match="dst_indices"):
        copy_rows(t.src, t.src_indices, t.dst, bad)       # so the real call checks
    alloc.check()


def test_sgl_kernel_baseline_absent_here():
    assert sgl_baseline.load_kvcacheio() is None
    s = Shape(components=2, layers=1, row_bytes=128, page_size=1, tokens=8, layout="layer_first")
    w, _ = guarded_workload(s)
    with pytest.raises(Unsupported, match="sgl_kernel is not importable"):
        sgl_baseline.prepare(w, "load")


def test_scatter_is_measured_against_the_device_copy():
    sweep = Sweep(grids=(Grid(ops=("scatter", "gather"), layouts=("layer_first", "page_first"), row_bytes=(128,),
                              page_sizes=(4,), tokens=(16,), program_caps=(2,)),),
                  max_layers=2, ceiling_bytes=1 << 20, warmup=0, iters=2, min_iters=2, baselines=("torch",), hardware=False)
    run = run_sweep(sweep, torch.device("cpu"), log=None)
    pts = run["points"]
    assert not [p for p in pts if "error" in p or "skipped" in p]
    scatter = [p for p in pts if p["op"] == "scatter"]
    # Device-only: one layout, the pool without a strategy, copy_rows, torch.
    assert sorted((p["engine"], p["strategy"]) for p in scatter) == [("copy_rows", "kernel"), ("pool", "-"),
                                                                     ("torch", "-")]
    assert all(p["layout"] == "layer_first" and p["layers"] == 2 for p in scatter)
    d2d = run["ceilings"]["d2d"]
    assert all(p["pct_ceiling"] == pytest.approx(100.0 * p["gbps"] / d2d) for p in scatter)
    assert len([line for line in report.format_table(run).splitlines() if line.startswith("scatter")]) == 3


def test_sgl_kernel_baseline_has_no_device_copies():
    s = Shape(components=2, layers=1, row_bytes=128, page_size=1, tokens=8, layout="layer_first")
    w, _ = guarded_workload(s)
    for op in ("gather", "scatter"):
        with pytest.raises(Unsupported, match=f"no sgl_kernel function for {op}"):
            sgl_baseline.prepare(w, op, kvio=object())


def test_a_huge_iteration_count_is_bounded_by_the_point_budget(monkeypatch):
    """`--iters 99999999999` once made the ceilings time that many copies: they follow the
    points' rule now (as many calls as fit the point budget, within the sweep's bounds)."""
    from kvtier.bench import ceiling, runner
    huge = Sweep(grids=(Grid(ops=("load",), row_bytes=(128,), page_sizes=(1,), tokens=(8,), strategies=("kernel",)),),
                 max_layers=1, ceiling_bytes=1 << 16, warmup=0, iters=10 ** 11, min_iters=3,
                 baselines=("torch",), hardware=False)
    assert runner.point_iters(huge, 1.0) == 3 and runner.point_iters(huge, 0.01) == 25
    assert runner.point_iters(TINY, 1e-9) == TINY.iters
    counts = []
    for module in (ceiling, runner):
        real = module.time_calls
        def timed(fn, device, real=real, **kw):   # a regression fails here instead of hanging
            counts.append(kw["iters"])
            return real(fn, device, **{**kw, "iters": min(kw["iters"], 3)})
        monkeypatch.setattr(module, "time_calls", timed)
    monkeypatch.setattr(runner, "POINT_BUDGET_S", 1e-9)       # every call "slow": the minimum
    out = run_sweep(huge, torch.device("cpu"), log=None)
    assert counts == [3] * (3 + 2)                             # three ceilings, two points
    assert len(out["points"]) == 2 and not [p for p in out["points"] if "error" in p]
