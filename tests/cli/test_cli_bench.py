"""`kvtier bench`: the CPU smoke run and the `--overhead` run through the real console
script (a fresh process, so it must choose Triton's interpreter itself), and flag
handling in-process."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench_support import bench  # noqa: F401  (kvtier.bench importable in this process)
from kvtier.cli.main import main

KVTIER = Path(sys.executable).with_name("kvtier")


def test_default_smoke_run_writes_table_json_and_plot(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    t0 = time.monotonic()
    r = subprocess.run(_command() + ["bench", "--out", str(tmp_path), "--quiet"], env=env,
                       capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "NOT hardware figures" in r.stdout
    assert "host time per call" in r.stdout and "cpu: host time up to the launch; kernels not run" in r.stdout
    run = json.loads((tmp_path / "bench.json").read_text())
    assert set(run["overhead"]["calls"]) >= {"HostPool.load_to_device_per_layer", "DevicePool.gather"}
    assert run["environment"]["interpreter"] is True
    assert run["points"] and not [p for p in run["points"] if "error" in p]
    assert {p["op"] for p in run["points"]} == {"backup", "load_layer", "load", "gather", "scatter"}
    assert {p["engine"] for p in run["points"]} >= {"pool", "copy_rows", "torch", "torch copy_"}
    assert all({"device_us", "host_us", "device_p10_us", "device_p90_us", "iters", "kernel_only"} <= set(p)
               for p in run["points"])
    assert set(run["baselines"]) == {"torch", "torch copy_"} and run["method"]["min_iters"] >= 1
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "bench.txt").read_text().startswith("op ")
    assert len((tmp_path / "points.jsonl").read_text().splitlines()) == len(run["points"])
    print(f"kvtier bench smoke run: {took:.1f} s")


def test_flags_select_the_sweep(tmp_path, capsys):
    rc = main(["bench", "--smoke", "--ops", "load_layer", "--layouts", "page_first", "--rows", "256",
               "--pages", "4", "--tokens", "16", "--strategies", "dma", "--caps", "1,2",
               "--no-plot", "--no-overhead", "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    pts = json.loads((tmp_path / "bench.json").read_text())["points"]
    assert sorted(p["engine"] + "/" + p["strategy"] + "/" + str(p["cap"]) for p in pts) == \
        ["copy_rows/kernel/1", "copy_rows/kernel/2", "pool/dma/0", "torch copy_/-/0", "torch/-/0"]
    assert all(p["layout"] == "page_first" and p["row_bytes"] == 256 and p["tokens"] == 16 for p in pts)
    assert not (tmp_path / "bench.png").exists()
    assert "overhead" not in json.loads((tmp_path / "bench.json").read_text())


def _command():
    return [str(KVTIER)] if KVTIER.exists() else [sys.executable, "-m", "kvtier.cli.main"]


def test_overhead_only_writes_json_and_runs_no_sweep(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "overhead.json"
    t0 = time.monotonic()
    r = subprocess.run(_command() + ["bench", "--overhead", "--json", str(out)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    o = json.loads(out.read_text())
    assert o["note"] == "cpu: host time up to the launch; kernels not run" and o["note"] in r.stdout
    assert len(o["calls"]) == 9 and set(o["torch"]) == {"torch.index_select", "Tensor.index_copy_"}
    for c in o["calls"].values():
        assert {"median_us", "p10_us", "p90_us", "ratio", "goal"} <= set(c) and c["goal"] in r.stdout
    assert o["launches_recorded"]["copy"] > 0 and o["kernels_run"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overhead.json"]     # no sweep outputs
    assert took < 20, f"kvtier bench --overhead took {took:.1f} s"


@pytest.mark.parametrize("bad", ["missing/dir/o.json", "."])
def test_overhead_on_a_bad_json_path_exits_2_with_one_line(bad, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--overhead", "--json", bad]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"--json={bad!r}") and not out
    assert main(["bench", "--json", bad, "--out", "never"]) == 2     # before any sweep
    assert capsys.readouterr().err.startswith("--json=") and not (tmp_path / "never").exists()


@pytest.mark.parametrize("argv, flag", [
    (["--rows", "12x"], "--rows='12x'"), (["--iters", "0"], "--iters='0'"),
    (["--time-budget", "soon"], "--time-budget='soon'"), (["--overhead", "--ops", "load"], "--ops:"),
    (["--overhead", "--no-overhead"], "--no-overhead:"), (["--json", "o.json", "--no-overhead"], "--no-overhead:"),
])
def test_bad_flag_value_prints_one_line_and_exits_2(argv, flag, capsys, tmp_path):
    assert main(["bench", *argv, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(flag)
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("ops", ["backup,swap", "load,", "gather_layer"])
def test_ops_are_the_autotune_names_and_a_bad_one_exits_2(ops, capsys, tmp_path):
    assert main(["bench", "--ops", ops, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("--ops=")
    assert not (tmp_path / "never").exists()
    assert main(["autotune", "--ops", ops]) == 2
    assert capsys.readouterr().err.startswith("--ops=")
