"""`kvtier bench`: the CPU smoke run through the real console script (a fresh process,
so it must choose Triton's interpreter itself), and flag handling in-process."""
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
    cmd = [str(KVTIER)] if KVTIER.exists() else [sys.executable, "-m", "kvtier.cli.main"]
    t0 = time.monotonic()
    r = subprocess.run(cmd + ["bench", "--out", str(tmp_path), "--quiet"], env=env,
                       capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "NOT hardware figures" in r.stdout
    assert "host time before launch" in r.stdout
    run = json.loads((tmp_path / "bench.json").read_text())
    assert run["environment"]["interpreter"] is True
    assert run["points"] and not [p for p in run["points"] if "error" in p]
    assert {p["op"] for p in run["points"]} == {"backup", "load_layer", "load", "gather", "scatter"}
    assert {p["engine"] for p in run["points"]} >= {"pool", "copy_rows", "torch"}
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
        ["copy_rows/kernel/1", "copy_rows/kernel/2", "pool/dma/0", "torch/-/0"]
    assert all(p["layout"] == "page_first" and p["row_bytes"] == 256 and p["tokens"] == 16 for p in pts)
    assert not (tmp_path / "bench.png").exists()


def test_bad_flag_value_names_the_flag():
    with pytest.raises(SystemExit, match="--rows='12x'"):
        main(["bench", "--rows", "12x", "--out", "/nonexistent"])


@pytest.mark.parametrize("ops", ["backup,swap", "load,", "gather_layer"])
def test_ops_are_the_autotune_names_and_a_bad_one_exits_2(ops, capsys, tmp_path):
    assert main(["bench", "--ops", ops, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("--ops=")
    assert not (tmp_path / "never").exists()
    assert main(["autotune", "--ops", ops]) == 2
    assert capsys.readouterr().err.startswith("--ops=")
