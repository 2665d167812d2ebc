"""`kvtier bench --interference` on the CPU: skipped in one line, and the tiny structural
run (lanes one after the other) with the JSON and plot structure a CUDA run has: per
operation and engine the transfer alone (kernel-only and host time separate, >= 20
calls) and beside the GEMM, the GEMM's slowdown, caps in numeric order, colours shared
with the benchmark's plot. No timed assertions."""
import json

import pytest
import torch

from bench_support import bench  # noqa: F401  (kvtier.bench importable)
from kvtier.bench import interference, report
from kvtier.cli.main import main

SETUP = interference.with_caps(interference.TINY, (2, 1), ("load", "backup"))


@pytest.fixture(scope="module")
def result():
    return interference.measure(torch.device("cpu"), SETUP, allow_cpu=True, log=None)


def test_cpu_without_allow_is_skipped_in_one_line():
    out = interference.measure(torch.device("cpu"), SETUP, log=None)
    assert list(out) == ["skipped"] and "\n" not in out["skipped"] and "CUDA" in out["skipped"]
    assert interference.format_text(out) == out["skipped"]


def test_rows_per_operation_and_engine(result):
    rows = result["rows"]
    assert not [r for r in rows if "error" in r]
    want = ["kvtier pool kernel", f"{interference.CAPPED} p<=2", f"{interference.CAPPED} p<=1",
            "kvtier pool dma", "torch copy_"]
    for op in ("load", "backup"):
        assert [r["series"] for r in rows if r["op"] == op] == want
    for r in rows:
        assert {"gbps_alone", "gbps_concurrent", "gemm_us_alone", "gemm_us_concurrent", "gemm_slowdown_pct",
                "overlap", "calls", "gemms", "kernel_only", "programs", "bytes"} <= set(r)
        a = r["alone"]
        assert {"device_us", "host_us", "device_p10_us", "device_p90_us", "host_p90_us"} <= set(a)
        assert a["iters"] >= 20 and a["timing"] == "wall clock"
        assert r["gemms"] == SETUP.gemms and r["calls"] >= 1 and r["overlap"] == 0.0
    capped = {r["cap"]: r["programs"] for r in rows if r["series"].startswith(interference.CAPPED)}
    assert capped == {1: 1, 2: 2}
    assert result["gemm"]["iters"] >= 20 and "device_us" in result["gemm"] and "host_us" in result["gemm"]
    assert result["goal"]["graded"] is False and result["goal"]["ops"] == {}
    assert "NOT interference" in result["note"] and result["environment"]["hardware_figures"] is False
    json.dumps(result)


def test_plot_spec_orders_caps_and_shares_colours(result, tmp_path):
    spec = interference.plot_spec(result)
    assert [(p["op"], p["metric"]) for p in spec["panels"]] == [
        ("load", "gemm_slowdown_pct"), ("load", "gbps_concurrent"),
        ("backup", "gemm_slowdown_pct"), ("backup", "gbps_concurrent")]
    for p in spec["panels"]:
        (line,) = p["lines"]
        assert [x for x, _ in line["xy"]] == [1, 2]
        assert line["color"] == report.colour(interference.CAPPED)
        assert {lv["label"]: lv["color"] for lv in p["levels"]} == {
            name: report.colour(name) for name in ("kvtier pool kernel", "kvtier pool dma", "torch copy_")}
        assert (p["goal"] is not None) == (p["metric"] == "gemm_slowdown_pct")
    png = interference.plot(result, tmp_path / "i.png").read_bytes()
    assert png[:4] == b"\x89PNG"
    text = interference.format_text(result)
    assert len(text.splitlines()) == 1 + len(result["rows"]) + 1 and "goal:" not in text


def test_default_caps_are_the_autotuners():
    from kvtier.autotune.space import program_counts
    assert interference.default_caps(torch.device("cpu")) == tuple(program_counts(2))


def test_cli_skips_off_cuda_in_one_line(tmp_path, capsys):
    assert main(["bench", "--interference", "--out", str(tmp_path / "o")]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1 and "skipped on cpu" in out and not err
    assert not (tmp_path / "o").exists()


def test_cli_smoke_writes_json_text_and_plot(tmp_path, capsys):
    assert main(["bench", "--interference", "--smoke", "--caps", "1", "--ops", "load", "--quiet",
                 "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "interference.json").read_text())
    assert [r["series"] for r in got["rows"]] == ["kvtier pool kernel", f"{interference.CAPPED} p<=1",
                                                  "kvtier pool dma", "torch copy_"]
    assert (tmp_path / "interference.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "interference.txt").read_text().startswith("interference on cpu")


@pytest.mark.parametrize("argv, start", [
    (["--interference", "--iters", "3"], "--iters:"), (["--interference", "--overhead"], "--overhead:"),
    (["--interference", "--caps", "0"], "--caps='0'"), (["--interference", "--caps", "x"], "--caps='x'"),
    (["--interference", "--ops", "swap"], "--ops="), (["--interference", "--full"], "--full:"),
])
def test_cli_bad_flags_one_line_exit_2(argv, start, capsys, tmp_path):
    assert main(["bench", *argv, "--smoke"] if "--full" not in argv else ["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(start), err
