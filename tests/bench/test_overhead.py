"""The host-overhead measurement on the CPU: every hot-path call and both torch ops timed
(median, p10, p90) with ratios and verdicts, the CPU note, and no kernel run (the probe
records the row-copy and index-check launches instead)."""
import importlib
import json

import pytest
import torch

from bench_support import bench  # noqa: F401  (kvtier.bench importable in this process)
from bench_support import guarded_workload
from kvtier.bench import overhead
from kvtier.bench.overhead import CALLS, CPU_NOTE, TORCH_OPS, format_overhead, measure_overhead, time_series
from kvtier.bench.probe import LaunchProbe
from kvtier.bench.workload import Shape
from kvtier.kernels import copy_rows
from kvtier.errors import KvtierError


class _Counting:
    """Stands in for a real kernel: counts launches that reach it (none may, in a probe)."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
        return launch


@pytest.fixture
def real_kernels(monkeypatch):
    """The row-copy and index-check kernels, replaced by counters: a launch that got past
    the probe would be counted here."""
    core = importlib.import_module("kvtier.kernels.launcher")
    check = importlib.import_module("kvtier.kernels.index_check_kernel")
    copies, checks = _Counting(), _Counting()
    monkeypatch.setattr(core, "_kernel", lambda: copies)
    monkeypatch.setattr(check, "check_indices_jit", checks)
    return copies, checks


@pytest.fixture(scope="module")
def measured():
    return measure_overhead(torch.device("cpu"), calls=30, warmup=3, batch=10)


def test_every_call_and_both_torch_ops_with_spread_and_ratios(measured, tmp_path):
    o = json.loads(overhead.write_json(measured, tmp_path / "o.json").read_text())
    assert set(o["calls"]) == set(CALLS) and len(CALLS) == 9
    assert set(o["torch"]) == set(TORCH_OPS) == {"torch.index_select", "Tensor.index_copy_"}
    for name, r in {**o["calls"], **o["torch"]}.items():
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"] < 1e6, name
        assert r["calls"] == 30
    for name, r in o["calls"].items():
        assert set(r["ratio"]) == set(TORCH_OPS)
        for t in TORCH_OPS:
            assert r["ratio"][t] == pytest.approx(r["median_us"] / o["torch"][t]["median_us"], rel=1e-2)
        assert r["goal"] in ("meets", "misses")
        assert (r["goal"] == "misses") == any(v > 2.0 for v in r["ratio"].values())
        # Up to the launch (the CPU's mode) the goal is one index_select at most (a plan's
        # layer load: half of one).
        limit = 0.5 if name == "TransferPlan.load_layer" else 1.0
        assert (r["prelaunch_goal"] == "meets") == (r["ratio"]["torch.index_select"] <= limit)
        assert r["frames"] > 0
    assert o["goal"]["ratio_max"] == 2.0 and o["goal"]["host_us_graded"] is False   # not an H200
    assert o["goal"]["prelaunch_met"] == sum(r["prelaunch_goal"] == "meets" for r in o["calls"].values())
    assert o["shape"]["layers"] == 16 and o["shape"]["row_bytes"] == 1024 and o["shape"]["page_size"] == 16
    assert o["strategy"] == "kernel" and o["checks"].startswith("default (check=None")


def test_cpu_note_in_json_text_and_summary(measured):
    assert measured["note"] == CPU_NOTE == "cpu: host time up to the launch; kernels not run"
    assert measured["mode"] == "pre-launch" and measured["kernels_run"] is False
    text = format_overhead(measured)
    assert CPU_NOTE in text and CPU_NOTE in measured["summary"]
    for name in CALLS + TORCH_OPS:
        assert name in text
    # Two grades per call up to the launch: the 2x goal and at most one index_select.
    assert text.count("meets") + text.count("misses") == 2 * len(CALLS)


def test_the_probe_recorded_every_launch(measured):
    per = {n: r["launches_per_call"] for n, r in {**measured["calls"], **measured["torch"]}.items()}
    for n in CALLS:
        # Every call is one launch here, which checks its lists inline: no check launch.
        assert per[n] == {"copy": 1.0, "check": 0.0}, (n, per[n])
    assert all(per[n] == {"copy": 0.0, "check": 0.0} for n in TORCH_OPS)
    rec = measured["launches_recorded"]
    assert rec["copy"] >= len(CALLS) * (30 + 3 + 10) and rec["check"] == 0   # timed + warm-up + estimate


def test_every_call_checks_its_lists_in_its_launch():
    """Under the probe too, each call's launch carries its lists' checks (``CHECK`` inline,
    the lists' limits), so the timed host work is what a checked call does; a batch plan's
    layer load launches unchecked: its plan copied and checked the lists when it was made
    (a bad list there raises at plan time, tests/pool)."""
    from kvtier.bench.overhead import PLAN_CALL, build_calls
    from kvtier.kernels.launcher import INLINE, UNCHECKED, launch_arguments
    fns, _ = build_calls(torch.device("cpu"), lists=4)
    with LaunchProbe(keep_args=True) as probe:
        for name in CALLS:
            fns[name]()
            a = launch_arguments(*probe.last_launches()["copy"])
            if name == PLAN_CALL:
                assert a["CHECK"] == UNCHECKED, name
                continue
            assert a["CHECK"] == INLINE and a["src_limit"] > 0 and a["dst_limit"] > 0, name


def test_no_kernel_runs(real_kernels):
    copies, checks = real_kernels
    o = measure_overhead(torch.device("cpu"), calls=4, warmup=1, batch=2)
    assert o["launches_recorded"]["copy"] > 0
    assert copies.launches == 0 and checks.launches == 0


def test_probe_stubs_the_row_copy_kernel_and_its_check():
    s = Shape(components=2, layers=1, row_bytes=128, page_size=1, tokens=16, layout="layer_first")
    w, _ = guarded_workload(s)
    t = w.copy("load")
    bad = t.dst_indices.clone()
    bad[3] = 10 ** 6                                  # out of range: the launch's check would say so
    with LaunchProbe() as probe:
        copy_rows(t.src, t.src_indices, t.dst, bad)   # recorded, not checked, not copied
    assert len(probe.check_grids) == 0 and len(probe.grids) == 1
    with pytest.raises(KvtierError, match="dst_indices"):
        copy_rows(t.src, t.src_indices, t.dst, bad)   # the real kernel and its check are back


class _FakeKeeper:
    """A device sleep that ends early on its first batch only."""

    def __init__(self):
        self.asked, self.answers = [], iter([False] + [True] * 100)

    def start(self, seconds):
        self.asked.append(seconds)

    def still_busy(self):
        return next(self.answers)


def test_busy_batches_are_counted_and_a_short_sleep_doubles():
    keeper = _FakeKeeper()
    out = time_series({"f": lambda: None}, torch.device("cpu"), calls=6, warmup=1, batch=2, keeper=keeper)
    assert len(out["f"]["ns"]) == 6 and out["f"]["batches"] == 3 and out["f"]["busy_batches"] == 2
    assert keeper.asked[0] >= overhead.MIN_BUSY_S
    assert keeper.asked[1] == pytest.approx(2 * keeper.asked[0]) and keeper.asked[2] == keeper.asked[1]


def test_full_call_mode_runs_the_kernels():
    """The GPU mode's path (no probe: every call launches its kernels), here under the
    interpreter on a tiny shape."""
    tiny = dict(layers=2, heads=1, head_dim=64, page_size=4, tokens=8)
    o = measure_overhead(torch.device("cpu"), calls=2, warmup=1, batch=1, shape=tiny, prelaunch=False)
    assert o["mode"] == "full call" and o["kernels_run"] is True and o["note"] == overhead.FULL_NOTE
    assert "launches_recorded" not in o and set(o["calls"]) == set(CALLS)
    assert all(r["median_us"] > 0 for r in o["calls"].values())


def test_floor_script_times_every_piece_of_the_calls():
    """`bench/scripts/overhead_floor.py` runs here and prints each piece it times, the two
    sums and the torch op, all positive."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "overhead_floor.py"
    r = subprocess.run([sys.executable, str(script), "200"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    figures = dict(re.findall(r"^(.+?)\s+(\d+\.\d+) us", r.stdout, re.M))
    for name in ("storage watch (34 tensors)", "shape checks of two new lists",
                 "one recorded copy launch, checking its lists",
                 "allocation of the gather's result", "every all-layer call and gather",
                 "a gather into new buffers", "torch.index_select", "host check of CPU host indices"):
        assert float(figures[name]) > 0, r.stdout
    assert float(figures["a gather into new buffers"]) > float(figures["every all-layer call and gather"])


def test_launch_binding_script_binds_every_calls_launches():
    """`bench/scripts/launch_binding.py` binds each call's recorded launches with Triton's
    own binder: every call launches one row copy, which checks its lists inline (no check
    launch on this CPU), and each binding takes time."""
    pytest.importorskip("triton.backends.nvidia", reason="needs community Triton's CUDA backend")
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "launch_binding.py"
    r = subprocess.run([sys.executable, str(script), "20"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {line[:40].strip(): line[40:].split() for line in r.stdout.splitlines()[1:] if line[:40].strip() in CALLS}
    assert set(rows) == set(CALLS)
    for name, (copies, checks, per_copy, per_check, total) in rows.items():
        assert int(copies) == 1 and float(per_copy) > 0 and float(total) >= float(per_copy), (name, r.stdout)
        assert int(checks) == 0, (name, r.stdout)


def test_dma_layer_loop_script_times_first_and_later_layers():
    """`bench/scripts/dma_layer_loop.py` runs a dma layer loop per layout and prints the
    mean host time per layer call, its first layer's and the others', all positive."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "dma_layer_loop.py"
    r = subprocess.run([sys.executable, str(script), "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = re.findall(r"^(\S+)\s+(\d+\.\d) us per layer call; first layer\s+(\d+\.\d) us, the other 15\s+(\d+\.\d) us",
                      r.stdout, re.M)
    assert [row[0] for row in rows] == ["layer_first", "page_first_direct"], r.stdout
    assert all(float(x) > 0 for row in rows for x in row[1:]), r.stdout
