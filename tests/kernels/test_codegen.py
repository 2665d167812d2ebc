"""Codegen report: compiled for sm_90 and gfx942 without a GPU (community Triton only)."""
import pytest

triton = pytest.importorskip("triton")
from kvtier.kernels.codegen import compile_report, default_sweep  # noqa: E402
from kvtier.kernels import CopyConfig, default_config  # noqa: E402

if not hasattr(triton, "knobs"):  # triton-ascend 3.2 has no GPU backends to compile for
    pytest.skip("codegen needs community Triton", allow_module_level=True)

MODES = [(True, False), (False, True), (True, True), (False, False)]


def _assert_all_16_bytes(r):
    assert r.error is None, r.error
    stores = sum(r.store_widths.values())
    assert stores and r.store_widths == {16: stores}, f"stores not all 16 B: {r.row()}"
    # The kernel stores only row data, and each stored vector was loaded as one: every
    # data load is 16 B too; narrower loads are the index and address-table loads.
    assert r.load_widths.get(16, 0) == stores, f"data loads not all 16 B: {r.row()}"


@pytest.mark.parametrize("src_table,dst_table", MODES)
@pytest.mark.parametrize("row_bytes", [256, 576, 1024, 1152, 4096])
def test_sm90_hot_accesses_are_16_bytes(row_bytes, src_table, dst_table):
    r = compile_report("sm90", config=default_config("cuda"), row_bytes=row_bytes,
                       src_table=src_table, dst_table=dst_table)
    _assert_all_16_bytes(r)


@pytest.mark.parametrize("src_table,dst_table", MODES)
def test_sm90_656_byte_rows_16_bytes_with_one_warp(src_table, dst_table):
    # 656 = 512 + 128 + 16 bytes: the 16-byte piece fills 16-byte accesses only when a
    # tile has 16 bytes per thread, which a single warp reaches within the 16 KiB tile.
    cfg = CopyConfig(num_programs=4, rows=4, block_bytes=1024, num_warps=1)
    _assert_all_16_bytes(compile_report("sm90", config=cfg, row_bytes=656,
                                        src_table=src_table, dst_table=dst_table))


def test_unaligned_rows_fall_back_to_narrow_accesses():
    r = compile_report("sm90", config=default_config("cuda"), row_bytes=40, align=8)
    assert r.error is None
    assert max(r.store_widths) <= 8


@pytest.mark.parametrize("target,platform", [("sm90", "cuda"), ("gfx942", "rocm")])
@pytest.mark.parametrize("row_bytes", [256, 576, 656, 1024, 4096])
def test_default_configs_do_not_spill(target, platform, row_bytes):
    for cfg in (default_config(platform), default_config(platform, crosses_link=False)):
        for st, dt in MODES[:2]:
            r = compile_report(target, config=cfg, row_bytes=row_bytes, src_table=st, dst_table=dt)
            assert r.error is None, r.error
            assert r.registers is not None and r.registers > 0
            assert r.spills == 0, r.row()


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
    assert {576, 656, 1024}.issubset(rows)
    assert {(s["src_table"], s["dst_table"]) for _, s in items} == set(MODES)
