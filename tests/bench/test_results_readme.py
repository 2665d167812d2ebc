"""A hardware run's README (`bench/results_readme.py`): steps and test counts, the same-run
ceilings, every goal marked met or not, the largest transfer per operation with every
series in legend order, the interference table, and how to reproduce it."""
import json

from bench_support import bench  # noqa: F401  (kvtier.bench importable)
from kvtier.bench import results_readme

XML = ('<testsuites><testsuite name="pytest" tests="24" failures="1" errors="0" skipped="2">'
       '</testsuite></testsuites>')


def _point(engine, cap, gbps, op="load", tokens=16384, strategy="kernel"):
    return {"op": op, "layout": "layer_first", "row_bytes": 1024, "page_size": 64, "tokens": tokens,
            "bytes": tokens * 1024 * 32, "engine": engine, "strategy": strategy, "cap": cap,
            "programs": cap or 4, "gbps": gbps, "pct_ceiling": gbps / 55 * 100, "kernel_only": True,
            "timing": "busy-stream events"}


def _folder(tmp_path):
    run = {"environment": {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "hardware_figures": True},
           "ceilings": {"h2d": 55.0, "d2h": 54.0, "d2d": 2100.0, "nbytes": 256 << 20},
           "baselines": {"torch": "runs", "vllm": "runs", "sgl_kernel": "absent"},
           "points": [_point("pool", 0, 53.0), _point("copy_rows", 8, 40.0), _point("copy_rows", 2, 30.0),
                      _point("torch", 0, 20.0), _point("vllm", 0, 45.0), _point("pool", 0, 10.0, tokens=64)]}
    (tmp_path / "bench.json").write_text(json.dumps(run))
    inter = {"goal": {"text": "a concurrent GEMM slows by <= 5% beside the default transfer", "graded": True,
                      "ops": {"load": {"slowdown_pct": 7.5, "met": False}}},
             "rows": [{"op": "load", "series": "kvtier pool kernel", "programs": 4, "gbps_alone": 50.0,
                       "gbps_concurrent": 45.0, "gemm_slowdown_pct": 7.5, "overlap": 1.0}]}
    (tmp_path / "interference.json").write_text(json.dumps(inter))
    (tmp_path / "steps.txt").write_text("env 0\ncuda-tests 1\nbench 0\n")
    (tmp_path / "cuda-tests.xml").write_text(XML)
    return tmp_path


def test_readme_tables(tmp_path):
    folder = _folder(tmp_path)
    assert results_readme.main([str(folder)]) == 0
    text = (folder / "README.md").read_text()
    assert "| cuda-tests | 1 |" in text and "21 passed, 1 failed, 0 errors, 2 skipped" in text
    assert "| 55.0 GB/s | 54.0 GB/s | 2100.0 GB/s | 256 MiB |" in text
    assert "| link >= 95% of pinned copy with <= 4 programs | **no** |" in text
    assert "| never slower than plain torch | yes |" in text
    assert "(load) | **no** | +7.5% |" in text
    line = [x for x in text.splitlines() if x.startswith("- **load**")][0]
    order = [line.index(s) for s in ("kvtier pool kernel 53", "copy_rows p<=2 30", "copy_rows p<=8 40",
                                     "torch 20", "vllm 45")]
    assert order == sorted(order) and "n 16384" in line
    assert "| load | kvtier pool kernel | 4 | 50.0 | 45.0 | +7.5% | 100% |" in text
    assert "bash bench/h200.sh" in text


def test_bad_usage_exits_2(tmp_path, capsys):
    assert results_readme.main([str(tmp_path / "missing")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
