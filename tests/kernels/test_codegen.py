"""Codegen report: compiled for sm_90 and gfx942 without a GPU (community Triton only)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")
from kvtier.kernels.codegen import compile_report, compile_reports, default_sweep  # noqa: E402
from kvtier.kernels import CopyConfig, default_config  # noqa: E402

if not hasattr(triton, "knobs"):  # triton-ascend 3.2 has no GPU backends to compile for
    pytest.skip("codegen needs community Triton", allow_module_level=True)

MODES = [(True, False), (False, True), (True, True), (False, False)]


# Every shipped configuration, every row size `kvtier codegen` reports, all four
# addressing-mode pairs, plus one pipelined neighbour, compiled for sm_90 in a process of
# its own without TRITON_INTERPRET (as `kvtier codegen` runs); the reports come back as
# JSON. int32 indices, so that every 8-byte load left is an address-table entry. The
# copies alone (check 0): what the index check adds is compared in a test of its own.
SWEEP = textwrap.dedent("""
    import json, sys
    from kvtier.kernels import CopyConfig
    from kvtier.kernels.codegen import SWEEP_ROWS, compile_report, shipped_configs
    MODES = [(False, False), (True, False), (False, True), (True, True)]
    configs = shipped_configs("sm90") + [CopyConfig(num_programs=4, rows=8, block_bytes=512, num_warps=4, stages=2)]
    out = []
    for cfg in configs:
        for row in SWEEP_ROWS:
            for st, dt in MODES:
                r = compile_report("sm90", config=cfg, row_bytes=row, src_table=st, dst_table=dt, index_bits=32,
                                   check=0)
                out.append(r.to_dict())
    json.dump(out, sys.stdout)
""")


@pytest.fixture(scope="module")
def sm90_sweep():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SWEEP], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    reports = json.loads(r.stdout)
    assert all(rep["error"] is None for rep in reports), [rep["error"] for rep in reports if rep["error"]]
    return reports


def _keyed(reports):
    return {(json.dumps(r["config"], sort_keys=True), r["shape"]["row_bytes"],
             r["shape"]["src_table"], r["shape"]["dst_table"]): r for r in reports}


def test_sweep_covers_shipped_configs_rows_and_modes(sm90_sweep):
    shipped = [c.to_dict() for c in (default_config("cuda"), default_config("cuda", crosses_link=False))]
    seen = {(json.dumps(r["config"], sort_keys=True), r["shape"]["row_bytes"]) for r in sm90_sweep}
    for c in shipped:
        for row in (128, 256, 576, 656, 1024, 4096):
            assert (json.dumps(c, sort_keys=True), row) in seen


def test_sm90_every_16_byte_aligned_row_moves_in_16_byte_accesses(sm90_sweep):
    """Stores are all 16-byte vectors, and so is every data load: ld.global.v4 with one
    stage, 16-byte cp.async with several. The data loads do not depend on how a side is
    addressed, so every mode has the stacked pair's count of 16-byte loads, and a stacked
    pair (no table entries to read) loads nothing else wider than its 4-byte indices."""
    by = _keyed(sm90_sweep)
    for r in sm90_sweep:
        what = f"{r['config']} {r['shape']}"
        stores = {int(k): v for k, v in r["store_widths"].items()}
        loads = {int(k): v for k, v in r["load_widths"].items()}
        cp = {int(k): v for k, v in r["cp_async_widths"].items()}
        n = sum(stores.values())
        assert n and stores == {16: n}, f"stores not all 16 B: {what}"
        data = loads.get(16, 0) + cp.get(16, 0)
        assert data >= n, f"data loads not all 16 B: {what}"
        plain = by[(json.dumps(r["config"], sort_keys=True), r["shape"]["row_bytes"], False, False)]
        plain_data = plain["load_widths"].get("16", 0) + plain["cp_async_widths"].get("16", 0)
        assert data == plain_data, what
        if not (r["shape"]["src_table"] or r["shape"]["dst_table"]):
            assert max(list(loads) + list(cp)) == 16 and not loads.get(8) and not cp.get(8), what


def test_sm90_shipped_configs_do_not_spill_and_fit_shared_memory(sm90_sweep):
    for r in sm90_sweep:
        assert r["registers"] is not None and r["registers"] > 0
        assert r["spills"] == 0, f"{r['config']} {r['shape']} spills {r['spills']}"
        assert r["shared"] is not None and r["shared"] <= 227 * 1024   # sm_90's per-block limit


def test_sm90_pipelined_configs_issue_cp_async(sm90_sweep):
    """With stages > 1 the persistent loop is software-pipelined: its loads are cp.async
    into shared memory, committed in groups and waited on with a depth; one stage has
    none."""
    assert any(r["config"]["stages"] > 1 for r in sm90_sweep)
    for r in sm90_sweep:
        stages = r["config"]["stages"]
        assert r["pipeline"]["stages"] == stages
        if stages > 1:
            assert r["cp_async"] > 0 and r["cp_async_widths"].get("16", 0) > 0, r["shape"]
            assert r["pipeline"]["commit_groups"] > 0 and r["pipeline"]["wait_groups"]
            assert r["shared"] > 0
        else:
            assert r["cp_async"] == 0


@pytest.mark.parametrize("row_bytes", [256, 656, 1024])
def test_default_configs_do_not_spill_on_gfx942(row_bytes):
    reports = compile_reports([("gfx942", cfg, dict(row_bytes=row_bytes, src_table=st, dst_table=dt))
                               for cfg in (default_config("rocm"), default_config("rocm", crosses_link=False))
                               for st, dt in MODES[:2]])
    assert len(reports) == 4
    for r in reports:
        assert r.error is None, r.error
        assert r.registers is not None and r.registers > 0
        assert r.spills == 0, r.row()


def test_reports_compile_after_interpreted_kernels_with_reductions(monkeypatch, tmp_path):
    """Triton's interpreter leaves triton.language patched once a kernel that calls a
    jitted helper (the index check's reductions) has run in the process; with nothing in
    Triton's cache to fall back on, a compile in that process then fails. compile_report
    compiles in a process of its own there."""
    import torch
    from kvtier.kernels import RowMap, copy_rows
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))       # nothing cached: a real compile
    src = RowMap.from_stacked(torch.arange(64 * 16, dtype=torch.int32).view(1, 64, 16), 1)
    dst = RowMap.from_stacked(torch.zeros(64, 16, dtype=torch.int32).view(1, 64, 16), 1)
    copy_rows(src, torch.tensor([3, 1]), dst, torch.tensor([0, 5]), check=True)   # runs the check kernel
    r = compile_report("sm90", config=CopyConfig(num_programs=4, rows=4, block_bytes=1024, num_warps=1),
                       row_bytes=656)
    assert r.error is None, r.error
    assert r.store_widths and all(isinstance(w, int) for w in r.store_widths)


def test_one_stage_config_uses_16_byte_loads_under_the_interpreter():
    """Asked for in this process, where the interpreter is on: 656-byte rows in one stage."""
    cfg = CopyConfig(num_programs=4, rows=4, block_bytes=1024, num_warps=1)
    r = compile_report("sm90", config=cfg, row_bytes=656, check=0)
    assert r.error is None, r.error
    stores = sum(r.store_widths.values())
    assert stores and r.store_widths == {16: stores} and r.load_widths.get(16, 0) == stores, r.row()
    assert r.cp_async == 0


# The index check inline (link copies) and by a check launch's verdict (device copies):
# the copies' own accesses as without it, plus the check's reads of the lists (and of an
# engine table's entries) and its six 8-byte stores of a failure record.
CHECK_SHAPES = [dict(row_bytes=656, src_table=True, dst_table=False),
                dict(row_bytes=1024, src_table=False, dst_table=True, check_tables=True),
                dict(row_bytes=128, src_table=False, dst_table=False, page_size=16, whole=16)]


@pytest.mark.parametrize("shape", CHECK_SHAPES, ids=lambda s: f"{s['row_bytes']}B")
def test_sm90_checked_copies_keep_their_16_byte_accesses(shape):
    cfg = default_config("cuda")
    plain, inline, verdict = compile_reports([("sm90", cfg, dict(shape, index_bits=32, check=c)) for c in (0, 2, 1)])
    for r in (plain, inline, verdict):
        assert r.error is None, r.error
        assert r.spills == 0, r.row()
    n = plain.store_widths.get(16, 0)
    assert n and plain.store_widths == {16: n}, plain.row()
    data = lambda r: r.load_widths.get(16, 0) + r.cp_async_widths.get(16, 0)   # noqa: E731
    # Inline: every data store still 16 bytes; the only other stores are the record's.
    assert inline.store_widths.get(16) == n and inline.store_widths.get(8) == 6 and len(inline.store_widths) == 2, \
        inline.row()
    assert data(inline) >= data(plain), inline.row()
    # By verdict: the copy's accesses unchanged, plus the verdict word's one 4-byte load.
    assert verdict.store_widths == plain.store_widths, verdict.row()
    assert data(verdict) == data(plain) and verdict.load_widths.get(4, 0) >= 1, verdict.row()


def test_offsets_64_bit_compile_too():
    cfg = default_config("cuda")
    r32 = compile_report("sm90", config=cfg, row_bytes=576, offset_bits=32)
    r64 = compile_report("sm90", config=cfg, row_bytes=576, offset_bits=64)
    assert r32.pipeline["offsets_32bit"] and not r64.pipeline["offsets_32bit"]
    assert r64.error is None and r64.spills == 0
    assert r64.store_widths == r32.store_widths


def test_unaligned_rows_fall_back_to_narrow_accesses():
    r = compile_report("sm90", config=default_config("cuda"), row_bytes=40, align=8)
    assert r.error is None
    assert max(r.store_widths) <= 8


def test_spilling_config_is_reported():
    cfg = CopyConfig(num_programs=4, rows=64, block_bytes=4096, num_warps=4)
    r = compile_report("sm90", config=cfg, row_bytes=4096)
    assert r.spills and r.spills > 0


def test_unknown_target_is_an_error_not_a_crash():
    r = compile_report("sm12345")
    assert r.error and "unknown target" in r.error


def test_sweep_covers_modes_and_rows():
    items = list(default_sweep("sm90"))
    rows = {s["row_bytes"] for _, s in items}
    assert {128, 256, 576, 656, 1024, 4096}.issubset(rows)
    assert {s.get("offset_bits", 32) for _, s in items} == {32, 64}
    assert {(s["src_table"], s["dst_table"]) for _, s in items} == set(MODES)
