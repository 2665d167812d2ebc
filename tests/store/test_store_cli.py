"""`kvtier demo` through the store tier and `kvtier bench --store` (throughput and
latency, `--latency` alone): what they print, the JSON, and bad flags answered with one
line and exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier.cli.main import main

DEMO = ["demo", "--layers", "2", "--pages", "8", "--page-size", "4", "--heads", "2", "--head-dim", "16",
        "--moved-pages", "3"]


def test_demo_moves_pages_through_a_temporary_file_store(capsys, tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(DEMO) == 0
    out = capsys.readouterr().out
    for line in ("store put host->store", "store get store->host", "every byte checked: OK", "FileEngine"):
        assert line in out
    assert os.listdir(tmp_path) == []           # the temporary store is removed


def test_demo_with_a_store_url_keeps_it(capsys, tmp_path):
    url = f"file://{tmp_path}/kept"
    assert main([*DEMO, "--store", url]) == 0
    out = capsys.readouterr().out
    assert url in out and ", 2 per page" in out              # 2 KV heads: two head-group objects
    objects = [f for d in os.listdir(tmp_path / "kept") if len(d) == 2 for f in os.listdir(tmp_path / "kept" / d)]
    assert len(objects) == 3 * 2


def test_demo_fails_when_the_store_loses_pages(capsys, monkeypatch):
    from kvtier.store.tier import StoreTier
    monkeypatch.setattr(StoreTier, "prefetch", lambda self, keys, idx: 0)
    assert main(DEMO) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "0 read back" in out


def test_bench_store_prints_and_writes_json(capsys, tmp_path, monkeypatch):
    from kvtier.store import bench
    monkeypatch.setattr(bench, "PAGE_BYTES", (64 << 10, 256 << 10))
    monkeypatch.setattr(bench, "RESHARD_PAGE_BYTES", (256 << 10,))
    monkeypatch.setattr(bench, "TOTAL_BYTES", 1 << 20)
    monkeypatch.setattr(bench, "ROUNDS", 1)
    monkeypatch.setattr(bench, "LATENCY_REPEATS", 3)
    monkeypatch.setattr(bench, "LATENCY_WARMUP", 1)
    out_json = tmp_path / "store.json"
    assert main(["bench", "--store", f"file://{tmp_path}/s?threads=2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "raw GET" in out and "goal (pages >= 256 KiB)" in out
    assert "latency goal (1 page, p50)" in out          # the latency part follows
    assert out.count("raw on the engine's threads") == 4 and "again on 2 threads" in out
    result = json.loads(out_json.read_text())
    assert result["engine"] == "FileEngine" and result["checksum"] in ("xxh3_64", "crc32")
    points = result["points"]
    assert [(p["page_bytes"], p["layout"]) for p in points] == [
        (64 << 10, "page_first_direct"), (64 << 10, "page_first"),
        (256 << 10, "page_first_direct"), (256 << 10, "page_first")]
    for p in points:
        assert p["pages"] == 16 and p["moves"] == (["whole"] if p["layout"] == "page_first_direct" else ["staged"])
        for k in ("prefetch_gbps", "backup_gbps", "raw_get_gbps", "raw_set_gbps"):
            assert p[k] > 0
        assert 0 <= p["checksum_share"] < 1
        assert p["prefetch_vs_raw_get"] == pytest.approx(p["prefetch_gbps"] / p["raw_get_gbps"])
        assert p["raw_get_threads_gbps"] > 0 and p["raw_set_threads_gbps"] > 0
    assert [(r["layout"], r["pages"]) for r in result["latency"]["rows"]] == LATENCY_ROWS
    assert "reshard goal: >= 0.8x the one-object read" in out
    assert [(r["page_bytes"], r["layout"], r["objects_per_page"]) for r in result["reshard"]] == [
        (256 << 10, "page_first_direct", 4), (256 << 10, "page_first", 4)]
    assert os.listdir(tmp_path / "s" / "tmp") == []


def test_bench_store_reshard_only(capsys, tmp_path, monkeypatch):
    from kvtier.store import bench
    monkeypatch.setattr(bench, "TOTAL_BYTES", 1 << 20)
    monkeypatch.setattr(bench, "ROUNDS", 1)
    out_json, store = tmp_path / "reshard.json", tmp_path / "s"
    assert main(["bench", "--store", f"file://{store}", "--reshard", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "reshard: TP 8 -> TP 2 read of a model of 8 KV heads of 128" in out
    assert "raw GET" not in out and "latency goal" not in out
    result = json.loads(out_json.read_text())
    assert result["points"] == [] and "latency" not in result
    rows = result["reshard"]
    assert [(r["page_bytes"], r["layout"]) for r in rows] == [
        (s, l) for s in (256 << 10, 1 << 20, 4 << 20, 16 << 20) for l in ("page_first_direct", "page_first")]
    for r in rows:
        assert r["objects_per_page"] == 4 and r["pages"] == max(4, (1 << 20) // r["page_bytes"])
        assert r["reshard_gbps"] > 0 and r["one_object_gbps"] > 0
        assert r["reshard_cpu_s"] > 0 and r["one_object_cpu_s"] > 0
        assert r["reshard_vs_one_object"] == pytest.approx(r["reshard_gbps"] / r["one_object_gbps"])
        assert r["raw_reshard_gbps"] > 0 and r["raw_one_object_gbps"] > 0
        assert r["raw_reshard_vs_one_object"] == pytest.approx(r["raw_reshard_gbps"] / r["raw_one_object_gbps"])
    assert "engine alone: the engine's get_into of as many values as each side's objects" in out
    assert [f for d in os.listdir(store) if len(d) == 2 for f in os.listdir(store / d)] == []


LATENCY_ROWS = [("page_first_direct", 1), ("page_first_direct", 4), ("page_first", 1), ("page_first", 4)]
LATENCY_TIMES = [f"{call}_{at}_us" for call in ("backup", "prefetch", "raw_set", "raw_get") for at in ("p50", "p99")]


def test_bench_store_latency_only(capsys, tmp_path, monkeypatch):
    from kvtier.store import bench
    monkeypatch.setattr(bench, "LATENCY_REPEATS", 4)
    monkeypatch.setattr(bench, "LATENCY_WARMUP", 1)
    timed = []
    real = bench._timed
    monkeypatch.setattr(bench, "_timed", lambda fn: timed.append(fn) or real(fn))
    out_json = tmp_path / "latency.json"
    store = tmp_path / "s"
    assert main(["bench", "--store", f"file://{store}", "--latency", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "latency only" in out and "GB/s" not in out           # no throughput part
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("pages layout"))
    rows = lines[head + 1:head + 5]
    assert [(r.split()[1], int(r.split()[0])) for r in rows] == [(l, n) for l, n in LATENCY_ROWS]
    assert all(r.split()[-1] in ("met", "below") for r in rows if r.split()[0] == "1")
    assert "latency goal (1 page, p50): prefetch <= 1.5x raw GET, backup <= 2.0x raw SET" in out
    assert "raw: plain writes then reads" in out
    result = json.loads(out_json.read_text())
    assert result["points"] == [] and result["engine"] == "FileEngine"
    lat = result["latency"]
    assert lat["goal"] == {"pages": 1, "at": "p50", "prefetch_vs_raw_get": 1.5, "backup_vs_raw_set": 2.0}
    assert lat["repeats"] == 4 and lat["page_bytes"] == 256 << 10
    assert lat["object_bytes"] > lat["page_bytes"]              # the header rides along
    assert [(r["layout"], r["pages"]) for r in lat["rows"]] == LATENCY_ROWS
    for r in lat["rows"]:
        for k in LATENCY_TIMES:
            assert isinstance(r[k], float) and r[k] > 0, (k, r)
        assert r["backup_p99_us"] >= r["backup_p50_us"] and r["raw_get_p99_us"] >= r["raw_get_p50_us"]
        for at in ("p50", "p99"):
            assert r[f"prefetch_vs_raw_get_{at}"] == pytest.approx(r[f"prefetch_{at}_us"] / r[f"raw_get_{at}_us"])
            assert r[f"backup_vs_raw_set_{at}"] == pytest.approx(r[f"backup_{at}_us"] / r[f"raw_set_{at}_us"])
        assert r["moves"] == (["whole"] if r["layout"] == "page_first_direct" else ["staged"])
    assert len(timed) == 4 * len(LATENCY_ROWS) * (4 + 1)       # backup, prefetch, SET, GET per repeat
    # every key written is removed: no object, no temporary file, no raw file left
    assert [f for d in os.listdir(store) if len(d) == 2 for f in os.listdir(store / d)] == []
    assert os.listdir(store / "tmp") == [] and not [n for n in os.listdir(store) if n.startswith("raw.")]


def test_percentile_is_the_nearest_rank():
    from kvtier.store.bench import _percentile
    xs = [float(i) for i in range(1, 101)]
    assert _percentile(xs, 0.5) == 50.0 and _percentile(xs, 0.99) == 99.0 and _percentile(xs[:3], 0.99) == 3.0
    assert _percentile([7.0], 0.5) == 7.0


CASES = [
    (["bench", "--store", "file:///x", "--full"], "--full"),
    (["bench", "--store", "file:///x", "--overhead"], "--overhead"),
    (["bench", "--store", "file:///x", "--interference"], "--interference"),
    (["bench", "--interference", "--store", "file:///x"], "--store"),
    (["bench", "--latency"], "--latency"),
    (["bench", "--reshard"], "--reshard"),
    (["bench", "--store", "file:///x", "--reshard", "--latency"], "--reshard"),
    (["bench", "--latency", "--overhead"], "--latency"),
    (["bench", "--store", "file:///x", "--latency", "--full"], "--full"),
    (["bench", "--store", "file:///x", "--latency", "--iters", "3"], "--iters"),
    (["bench", "--store", "nonsense"], "--store"),
    (["bench", "--store", "nonsense", "--latency"], "--store"),
    (["bench", "--store", "file://relative"], "--store"),
    (["bench", "--store", "file:///proc/kvtier-no"], "--store"),
    (["demo", "--store", "gopher://x"], "--store"),
    (["demo", "--store", "file:///proc/kvtier-no"], "--store"),
]


@pytest.mark.parametrize("argv,flag", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_store_flags_exit_2_with_one_line(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and flag in lines[0], lines


@pytest.mark.parametrize("argv,flag", [(["--store", "file:///proc/kvtier-no"], "--store"),
                                       (["--latency"], "--latency")])
def test_a_bad_store_flag_as_a_user_runs_it(argv, flag):
    """A fresh process: one line, exit 2, no traceback."""
    env = dict(os.environ, KVTIER_PLATFORM="cpu")
    r = subprocess.run([sys.executable, "-m", "kvtier", "bench", *argv],
                       capture_output=True, text=True, timeout=120, env=env)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-800:]
    assert len(lines) == 1 and flag in lines[0], lines


def test_the_engine_alone_reads_values_as_long_as_the_objects_stored(tmp_path):
    """The bench's engine-alone reads move values of the length each side's objects have
    in the store (header and payload): the file the tier wrote is that long."""
    import torch
    from kvtier.store import bench
    from kvtier.store.engine import open_store
    from kvtier.store.tier import StoreTier
    engine = open_store(f"file://{tmp_path}/s")
    try:
        for heads in (1, 4):            # the bench's head-group writer, then its one-object tier
            host = bench.bench_host(256 << 10, 2, "page_first", heads=heads, head_dim=128)
            tier = StoreTier(host, engine, model="m", tp=(3, 8), heads=8) if heads == 1 else \
                bench.one_object_tier(host, engine)
            key = bench._fresh()                           # a bench key: its header's length
            assert tier.backup([key], torch.arange(host.page_size, dtype=torch.int64)) == [True]
            (stored,) = tier.written_keys(key)
            assert bench._object_bytes(tier) == os.path.getsize(engine._path(stored))
            tier.close()
    finally:
        engine.close()
