"""The Ascend row tail: pieces under 32 bytes become one overlapping 32-byte window.

triton-ascend 3.2 copies a row piece under 32 bytes element by element, so on an NPU the
launcher sets MIN_PIECE (words) and the kernel copies the part of a row tail below it as
one MIN_PIECE-word window ending at the chunk's end, rewriting bytes already copied. Here
the NPU floors are forced on CPU (the launcher's `_platform` seam) and the kernel runs under
the interpreter; every copy is checked bit for bit against the torch oracle over the whole
poisoned, guarded destination (copy_rows_support.py), and every launch must carry the
MIN_PIECE the case expects, so the window branch really runs (or really is compiled out
for rows and chunks under 32 bytes).
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import dataclasses

import pytest
import torch

from copy_rows_support import Side, kernel_really_runs, make_indices, run_and_check  # noqa: F401
from kvtier.kernels import CopyConfig
import kvtier.platforms as platforms
from kvtier.platforms import NPU_MIN_PIECE_BYTES, NPU_MIN_ROWS, npu_launch_limits

copy_rows_module = importlib.import_module("kvtier.kernels.launcher")

NPU_FLOORS = dict(min_rows=NPU_MIN_ROWS, min_piece_bytes=NPU_MIN_PIECE_BYTES)
NPU = CopyConfig(num_programs=3, rows=2, block_bytes=16384, num_warps=1)   # few programs: interpreted
BLOCK64 = CopyConfig(num_programs=2, rows=4, block_bytes=64, num_warps=1)
BLOCK16 = CopyConfig(num_programs=2, rows=2, block_bytes=16, num_warps=1)
BLOCK8 = CopyConfig(num_programs=1, rows=2, block_bytes=8, num_warps=1)

# (id, dtype, (H, D), config, MIN_PIECE the launch must carry). Words: [..] is the tail
# part under 32 bytes, which the window covers.
CASES = [
    ("e4m3-656B", torch.float8_e4m3fn, (1, 656), NPU, 4),       # 82 words = 64 + 16 + [2]
    ("e4m3-656B-block64", torch.float8_e4m3fn, (1, 656), BLOCK64, 4),   # 10 x 8 + [2]
    ("u8-656B", torch.uint8, (1, 656), NPU, 4),
    ("bf16-592B", torch.bfloat16, (1, 296), NPU, 4),              # 576 + 16: 74 = 64 + 8 + [2]
    ("u8-40B", torch.uint8, (1, 40), NPU, 4),                     # 5 = 4 + [1]
    ("fp32-40B", torch.float32, (2, 5), NPU, 4),
    ("u8-40B-block16", torch.uint8, (1, 40), BLOCK16, 4),         # window wider than a block
    ("u8-48B", torch.uint8, (1, 48), NPU, 4),                     # 6 = 4 + [2]
    ("u8-33B", torch.uint8, (1, 33), NPU, 32),                    # bytes: 33 = 32 + [1]
    ("u8-33B-block8", torch.uint8, (1, 33), BLOCK8, 32),          # window over four blocks
    ("u8-63B", torch.uint8, (1, 63), NPU, 32),                    # 32 + [16 + 8 + 4 + 2 + 1]
    ("fp16-34B", torch.float16, (1, 17), NPU, 16),                # 2-byte words: 16 + [1]
    # under 32 bytes, or no tail part under 32 bytes: today's pieces, window compiled out
    ("fp32-4B", torch.float32, (1, 1), NPU, 1),
    ("fp16-6B", torch.float16, (1, 3), NPU, 1),
    ("u8-24B", torch.uint8, (1, 24), NPU, 1),                     # 3 words, under one window
    ("u8-31B", torch.uint8, (1, 31), NPU, 1),
    ("fp16-32B", torch.float16, (2, 8), NPU, 1),                  # 4 words, no tail
    ("u8-640B", torch.uint8, (1, 640), NPU, 1),                   # 80 = 64 + 16: no part under 4
]
# (src form, dst form, components): stacked and table sides both ways, and a paged host
# layout with two components; each keeps a row in one chunk.
PAIRS = [("stacked", "table", 1), ("table", "stacked", 1), ("page_first_direct", "stacked_paged", 2)]


@pytest.fixture
def npu_launches(monkeypatch):
    """Launches plan as on an NPU (its floors, through the launcher's seam); returns the
    MIN_PIECE of every kernel launch, which still runs the real (interpreted) kernel."""
    npu_like = dataclasses.replace(platforms.get("cpu"), **NPU_FLOORS)
    monkeypatch.setattr(copy_rows_module, "_platform", lambda device: npu_like)
    real, seen = copy_rows_module._kernel(), []

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.append(copy_rows_module.launch_arguments(args, kw)["MIN_PIECE"])
                return real[grid](*args, **kw)
            return run
    monkeypatch.setattr(copy_rows_module, "_kernel", lambda: Spy())
    return seen


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}-C{p[2]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_npu_plan_copies_bit_exact(case, pair, npu_launches):
    _, dtype, row, cfg, min_piece = case
    src_form, dst_form, C = pair
    src = Side(src_form, C=C, L=2, N=8, P=4, row=row, dtype=dtype, seed=60)
    dst = Side(dst_form, C=C, L=2, N=12, P=4, row=row, dtype=dtype, fill="poison", seed=61)
    si, di = make_indices("perm", 8, 12, seed=62)          # 4 rows; 2-row tiles and a 4-row tile
    run_and_check(src, si, dst, di, config=cfg)
    assert npu_launches == [min_piece], npu_launches


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("e4m3-656B", "u8-33B")], ids=lambda c: c[0])
def test_npu_plan_single_row(case, npu_launches):
    """One row in a two-row tile (the tile repeats it): the window rewrites only that row."""
    _, dtype, row, cfg, min_piece = case
    src = Side("table", L=2, N=8, row=row, dtype=dtype, seed=63)
    dst = Side("stacked", L=2, N=8, row=row, dtype=dtype, fill="poison", seed=64)
    si, di = make_indices("single", 8, 8, seed=65)
    run_and_check(src, si, dst, di, config=cfg)
    assert npu_launches == [min_piece], npu_launches


def _side(chunk_bytes, align):
    return SimpleNamespace(chunk_bytes=chunk_bytes, align=align)


# (chunk bytes, alignment, block_bytes, word, block, MIN_PIECE with the NPU's 32-byte floor)
PLANS = [
    (656, 16, 16384, 8, 64, 4),
    (656, 16, 64, 8, 8, 4),
    (592, 16, 16384, 8, 64, 4),
    (640, 16, 16384, 8, 64, 1),      # tail 16 words: every piece is at least 32 bytes
    (40, 8, 16384, 8, 4, 4),
    (40, 8, 16, 8, 2, 4),            # the window is wider than the blocks
    (48, 16, 16384, 8, 4, 4),
    (36, 4, 16384, 4, 8, 8),
    (34, 2, 16384, 2, 16, 16),
    (33, 1, 16384, 1, 32, 32),
    (64, 16, 16384, 8, 8, 1),        # no tail
    (32, 16, 16384, 8, 4, 1),
    (31, 1, 16384, 1, 16, 1),        # chunks under 32 bytes keep today's pieces
    (24, 8, 16384, 8, 2, 1),
    (6, 2, 16384, 2, 2, 1),
    (4, 4, 16384, 4, 1, 1),
]


@pytest.mark.parametrize("chunk,align,block_bytes,word,block,min_piece", PLANS)
def test_plan_min_piece(chunk, align, block_bytes, word, block, min_piece):
    cfg = CopyConfig(num_programs=1, rows=2, block_bytes=block_bytes, num_warps=1)
    s = _side(chunk, align)
    npu = copy_rows_module.tile_copy(s, s, 16, cfg, min_rows=2, min_piece_bytes=32)
    assert (npu["word"], npu["block"], npu["min_piece"]) == (word, block, min_piece)
    if min_piece > 1:   # the window fits in the chunk and covers the tail part under 32 bytes
        tail = npu["chunk_words"] % npu["block"]
        assert min_piece * word == 32 <= chunk and 0 < tail % min_piece < min_piece
    # Every other platform: no window; masked column blocks (split) instead of pieces,
    # and otherwise the plan as with the NPU floor.
    other = copy_rows_module.tile_copy(s, s, 16, cfg, min_rows=2)
    assert other["min_piece"] == 1 and other["split"] and not npu["split"]
    same = ("word", "align", "chunk_words", "rows", "stages", "src_i32", "dst_i32")
    assert {k: other[k] for k in same} == {k: npu[k] for k in same}


def test_floors_apply_on_npu_only():
    """The launcher asks for the 32-byte floor (and two-row tiles) on an NPU only; the
    figures are the ones npu_launch_limits reports."""
    lim = npu_launch_limits(props={"name": "Ascend910B3", "num_vectorcore": 40})
    floors = lambda p: dict(min_rows=p.min_rows, min_piece_bytes=p.min_piece_bytes)
    npu = floors(platforms.get("npu"))
    assert npu == dict(min_rows=lim["min_rows"], min_piece_bytes=lim["min_piece_bytes"])
    assert npu == dict(min_rows=2, min_piece_bytes=32)
    for kind in ("cpu", "cuda", "rocm"):
        assert floors(platforms.get(kind)) == dict(min_rows=1, min_piece_bytes=1)
