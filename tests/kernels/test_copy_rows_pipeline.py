"""The pipelined kernel's compile-time paths under the interpreter, bit for bit against
the torch oracle with poisoned, margined destinations: pipeline stages, tiles sized in
bytes, masked column blocks (rows that no power-of-two block divides), 32-bit and 64-bit
row offsets, negative-index skipping; and the plan's choices between them."""
from __future__ import annotations

import importlib

import pytest
import torch

from copy_rows_support import Side, make_indices, oracle, run_and_check
from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from helpers import assert_bytes_equal
from kvtier.kernels import CopyConfig

copy_rows_module = importlib.import_module("kvtier.kernels.launcher")
plan_module = importlib.import_module("kvtier.kernels.tiling")
from kvtier.kernels import copy_rows  # noqa: E402

ROWS = [  # (id, dtype, (H, D)): rows no power-of-two block divides, and narrow ones
    ("e4m3-656B", torch.float8_e4m3fn, (1, 656)),
    ("bf16-576B", torch.bfloat16, (1, 288)),
    ("fp16-128B", torch.float16, (2, 32)),
    ("fp16-6B", torch.float16, (1, 3)),
]
CONFIGS = [
    CopyConfig(num_programs=3, rows=2, block_bytes=256, num_warps=4, stages=3),
    CopyConfig(num_programs=2, rows=1, block_bytes=1024, num_warps=8, stages=2, tile_bytes=4096),
    CopyConfig(num_programs=1, rows=4, block_bytes=64, num_warps=1, stages=4, tile_bytes=512),
]


@pytest.fixture(params=[True, False], ids=["off32", "off64"])
def offsets(request, monkeypatch):
    """Both widths of the row offsets on the same buffers (the plan picks 32 bits for
    layers under 2 GiB, so 64 is forced here)."""
    if not request.param:
        monkeypatch.setattr(plan_module, "_fits_i32", lambda side: False)
    return request.param


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"s{c.stages}-t{c.tile_bytes}-b{c.block_bytes}")
@pytest.mark.parametrize("rid,dtype,row", ROWS, ids=[r[0] for r in ROWS])
@pytest.mark.parametrize("src_form,dst_form", [("table", "page_first"), ("page_head", "stacked_paged")])
def test_stages_tiles_and_offsets_bit_exact(cfg, rid, dtype, row, src_form, dst_form, offsets):
    P = 4
    src = Side(src_form, L=3, N=24, P=P, row=row, dtype=dtype, C=2 if src_form == "table" else 1, seed=11)
    dst = Side(dst_form, L=3, N=16, P=P, row=row, dtype=dtype, C=src.C, fill="poison", seed=12)
    si, di = make_indices("perm", 24, 16, seed=13)
    run_and_check(src, si, dst, di, config=cfg, src_layer=1, dst_layer=0, num_layers=2)
    plan = copy_rows_module.tile_copy(src.map, dst.map, si.numel(), cfg)
    assert (plan["src_i32"], plan["dst_i32"], plan["stages"]) == (offsets, offsets, cfg.stages)


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=["s3", "s2-t4096"])
def test_negative_indices_skipped_in_masked_blocks(cfg):
    """SKIP_NEG with a masked last column block: rows with a negative index keep their
    poison, the others are copied."""
    src = Side("table", L=2, N=32, row=(1, 656), dtype=torch.float8_e4m3fn, seed=21)
    dst = Side("layer_first", L=2, N=32, row=(1, 656), dtype=torch.float8_e4m3fn, fill="poison", seed=22)
    si, di = make_indices("perm", 32, 32, seed=23)
    si[::3] = -1
    di[1::4] = -1
    keep = (si >= 0) & (di >= 0)
    want, _ = oracle(src, si[keep], dst, di[keep])
    src_before = src.logical()
    copy_rows(src.map, si, dst.map, di, config=cfg, skip_negative=True)
    assert_bytes_equal(dst.logical(), want, "destination")
    assert_bytes_equal(src.logical(), src_before, "source")
    src.check_margins()
    dst.check_margins()


def test_plan_offsets_32_bits_only_under_2_gib():
    from kvtier.kernels.tiling import Geometry, tile_copy
    cfg = CopyConfig()
    small, big = Geometry(True, span=(1 << 31) - 1), Geometry(False, span=1 << 31)
    p = tile_copy(small, big, 64, cfg)
    assert p["src_i32"] and not p["dst_i32"]
    src = Side("page_first", L=2, N=8, row=(1, 8), seed=1)
    assert copy_rows_module.tile_copy(src.map, src.map, 8, cfg)["src_i32"]


def test_plan_tiles_in_bytes_and_masked_blocks():
    from kvtier.kernels.tiling import Geometry, tile_copy
    cfg = CopyConfig(rows=1, block_bytes=1024, num_warps=8, tile_bytes=65536)
    g = lambda chunk: Geometry(True, chunk_bytes=chunk)
    p = tile_copy(g(128), g(128), 1 << 20, cfg)
    assert (p["block"] * p["word"], p["rows"], p["split"]) == (128, 512, True)
    p = tile_copy(g(656), g(656), 1 << 20, cfg)        # one masked 1 KiB block per row
    assert (p["block"] * p["word"], p["rows"], p["min_piece"]) == (1024, 64, 1)
    p = tile_copy(g(656), g(656), 1 << 20, cfg, min_rows=2, min_piece_bytes=32)   # Ascend: pieces
    assert (p["split"], p["block"] * p["word"], p["min_piece"]) == (False, 512, 4)
    assert tile_copy(g(4096), g(4096), 40, cfg)["rows"] == 64   # at most the rows there are


def test_config_checks_new_fields():
    for bad in (dict(stages=0), dict(stages=True), dict(tile_bytes=3000), dict(tile_bytes=-1)):
        with pytest.raises(ValueError):
            CopyConfig(**bad)
