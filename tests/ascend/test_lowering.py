"""Every configuration the launcher produces lowers through triton-ascend 3.2 for
Ascend910B3, and moves each row as contiguous copies, with no masks, in tiles that fit
the Unified Buffer. Rows (chunks) of at least 32 bytes are contiguous copies throughout:
a row tail under 32 bytes is copied as one overlapping 32-byte window. Only rows under
32 bytes keep element-wise pieces.

The launches are recorded from the real launcher (`copy_rows`) over the layouts, row sizes,
addressing modes, component counts, index types and configurations pools use; each
distinct one is lowered once. Runs only where triton-ascend is the installed Triton
(.ci/ascend.sh); skipped elsewhere.
"""
import pytest

pytest.importorskip("triton.backends.ascend", reason="needs triton-ascend (run .ci/ascend.sh)")

import torch  # noqa: E402

import lowering  # noqa: E402  (tests/ascend is on sys.path through conftest)

if lowering.interpreter_patched():
    pytest.skip("the interpreter ran earlier in this process (Triton 3.2 leaves triton.language "
                "patched); .ci/ascend.sh runs the lowering in its own pytest", allow_module_level=True)

from kvtier.kernels import CopyConfig, RowMap, copy_rows, default_config  # noqa: E402
from kvtier.platforms import npu_launch_limits  # noqa: E402

L, N, P = 2, 8, 4
# (name, dtype, row shape): MHA K/V rows, MLA latent (bf16 576; fp8 656 moved as bytes),
# an indexer scale row, odd-sized byte rows, a wide row; 40 and 33 bytes end in a window
# over most of the row (33: byte words, the window starts at an odd offset).
ROWS = [
    ("mha_bf16_2x64", torch.bfloat16, (2, 64)),
    ("mla_fp8_656", torch.float8_e4m3fn, (656,)),
    ("mla_bf16_576", torch.bfloat16, (576,)),
    ("scale_fp32", torch.float32, (1,)),
    ("bytes_6", torch.uint8, (6,)),
    ("bytes_3", torch.uint8, (3,)),
    ("bytes_40", torch.uint8, (40,)),
    ("bytes_33", torch.uint8, (33,)),
    ("mha_bf16_8x128", torch.bfloat16, (8, 128)),
]
HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
CONFIGS = [default_config("npu"),
           CopyConfig(num_programs=40, rows=4, block_bytes=16384, num_warps=1),
           CopyConfig(num_programs=40, rows=8, block_bytes=512, num_warps=1)]
LIMITS = npu_launch_limits(props={"name": lowering.TARGET[1], "num_vectorcore": 40})
# What the launcher applies on an NPU (kvtier.kernels.launcher._platform), from the limits;
# and, as the NPU record says, index lists checked by a check launch, never inline.
NPU_FLOORS = dict(min_rows=LIMITS["min_rows"], min_piece_bytes=LIMITS["min_piece_bytes"], inline_check_programs=0)


def _components(C, make):
    maps = [make(c) for c in range(C)]
    return maps[0] if C == 1 else RowMap.stack(maps)


def device_map(dtype, row, mode, C):
    t = torch.empty((C, L, N) + row, dtype=dtype)
    if mode == "stacked":
        return _components(C, lambda c: RowMap.from_stacked(t[c], page_size=P))
    return _components(C, lambda c: RowMap.from_layers([t[c, l] for l in range(L)], page_size=P))


def host_map(dtype, row, layout, C):
    shapes = {"layer_first": (L, N) + row, "page_first": (N, L) + row,
              "page_first_direct": (N // P, L, P) + row}
    if layout == "page_head":
        heads, d = (row[0], row[1]) if len(row) == 2 else (1, row[0])
        shape = (N // P, heads, P, L, d)
    else:
        shape = shapes[layout]
    t = torch.empty((C,) + shape, dtype=dtype)
    return _components(C, lambda c: RowMap.from_host_layout(t[c], layout, P))


def scenarios():
    """(id, src map, dst map, index dtype, by_page) over what the pools do."""
    for rname, dtype, row in ROWS:
        for mode in ("stacked", "table"):
            for C in (1, 2):
                for layout in HOST_LAYOUTS:
                    if layout == "page_head" and len(row) != 2 and mode == "table":
                        continue
                    idx = torch.int64 if C == 1 else torch.int32
                    d, h = device_map(dtype, row, mode, C), host_map(dtype, row, layout, C)
                    yield f"{rname}-{mode}-C{C}-{layout}-backup", d, h, idx, False
                    yield f"{rname}-{mode}-C{C}-{layout}-load", h, d, idx, False
                    yield f"{rname}-{mode}-C{C}-{layout}-pages", d, h, torch.int64, True
            # index-gather: scattered device rows into a contiguous device buffer and back
            d, flat = device_map(dtype, row, mode, 1), device_map(dtype, row, "stacked", 1)
            yield f"{rname}-{mode}-gather", d, flat, torch.int64, False
            yield f"{rname}-{mode}-scatter", flat, d, torch.int32, False


CHECKS = []     # index-check launches copy_rows made on the way (recorded, not run)


def record_all():
    launches, ids = {}, {}
    with lowering.recorded_launches(NPU_FLOORS, CHECKS) as rec:
        for name, src, dst, idx_dtype, by_page in scenarios():
            if by_page:
                si = torch.arange(P, 2 * P, dtype=idx_dtype)
                di = torch.arange(0, P, dtype=idx_dtype)
            else:
                si = torch.tensor([5, 0, 3], dtype=idx_dtype)
                di = torch.tensor([1, 7, 2], dtype=idx_dtype)
            for cfg in CONFIGS:
                rec.clear()
                copy_rows(src, si, dst, di, by_page=by_page, config=cfg)
                assert len(rec) == 1, f"{name}: expected one launch, got {len(rec)}"
                launch = rec[0]
                key = launch.key()
                if key not in launches:
                    launches[key], ids[key] = launch, f"{name}-r{cfg.rows}b{cfg.block_bytes}"
    return [pytest.param(l, id=ids[k]) for k, l in launches.items()]


LAUNCHES = record_all()


def test_the_sweep_covers_the_kernel_space():
    """The recorded launches reach every addressing mode pair, word size, index type,
    component count, paging and chunking the kernel specialises on."""
    seen = lambda key: {l.values[0].constants[key] for l in LAUNCHES}
    assert seen("SRC_TABLE") == seen("DST_TABLE") == {False, True}
    assert {(l.values[0].constants["SRC_TABLE"], l.values[0].constants["DST_TABLE"]) for l in LAUNCHES} \
        >= {(False, False), (True, False), (False, True)}
    assert seen("WORD") == {1, 2, 4, 8}
    assert seen("N_COMP") == {1, 2}
    assert {1, P} <= seen("SRC_PAGE") and max(seen("N_CHUNKS")) > 1
    assert {l.values[0].args["src_idx"].dtype for l in LAUNCHES} == {torch.int32, torch.int64}
    assert any(lowering.expected_widths(l.values[0].constants)[1:] for l in LAUNCHES), "no row tail case"
    assert min(seen("ROWS")) >= LIMITS["min_rows"], "NPU launches have tiles of at least min_rows rows"
    assert {1, 4, 32} <= seen("MIN_PIECE"), "windows of 8- and 1-byte words, and launches without"
    assert len(LAUNCHES) >= 40


# triton-ascend 3.2 moves a row piece as one contiguous copy only from 32 bytes (the
# Unified Buffer block) up; a smaller piece becomes a loop of scalar loads and stores.
CONTIGUOUS_FROM = 32


def test_launcher_floor_is_the_lowering_threshold():
    """The launcher's window size (npu_launch_limits) is the size lowered contiguously."""
    assert LIMITS["min_piece_bytes"] == CONTIGUOUS_FROM


def split_pieces(k):
    want = lowering.expected_widths(k)
    big = [w for w in want if w * k["WORD"] >= CONTIGUOUS_FROM]
    return big, [w for w in want if w * k["WORD"] < CONTIGUOUS_FROM]


@pytest.mark.parametrize("launch", LAUNCHES)
def test_lowers_to_contiguous_row_copies(launch):
    low = lowering.lower(launch)
    c = lowering.copies(low)
    k = low.constants
    big, small = split_pieces(k)
    assert [b for b in c.bad_shapes if b != (["1"], ["1"])] == [], f"non-row data views: {c.bad_shapes[:3]}"
    assert sorted(c.loads) == sorted(big), ("contiguous loads", c.loads, big)
    assert sorted(w for w in c.stores if w > 0) == sorted(big), ("contiguous stores", c.stores, big)
    # Only pieces under 32 bytes are element-wise: one scalar load and store loop each.
    assert len(c.scalar_data) == c.stores.count(-1) == len(small), (c.scalar_data[:3], small)
    assert c.elem_types == {f"i{8 * k['WORD']}"}, c.elem_types
    # No masks in the copy: the only compare/select is the verdict gate (once per program).
    assert c.masks == (2 if k["CHECK"] == 1 else 0), "integer compares/selects (masks) in the kernel"
    if big:
        assert max(c.tile_bytes) <= LIMITS["max_tile_bytes"], (c.tile_bytes, LIMITS)
        assert max(c.tile_bytes) == k["ROWS"] * max(big) * k["WORD"]


def test_fp8_mla_rows_are_whole_contiguous_copies():
    """656-byte fp8 MLA rows (82 words: 64 + 16 + 2) end in a 4-word (32-byte) window
    instead of a 2-word element-wise piece."""
    launch = next(p.values[0] for p in LAUNCHES
                  if p.id.startswith("mla_fp8_656-stacked-C1-layer_first-backup"))
    k = launch.constants
    assert (k["WORD"], k["CHUNK_WORDS"], k["BLOCK"], k["MIN_PIECE"]) == (8, 82, 64, 4)
    c = lowering.copies(lowering.lower(launch))
    assert not c.scalar_data and c.stores.count(-1) == 0
    assert sorted(c.loads) == sorted(w for w in c.stores if w > 0) == [4, 16, 64]


def test_rows_of_at_least_32_bytes_have_no_element_wise_piece():
    """The model behind test_lowers_to_contiguous_row_copies: every chunk of 32 bytes or
    more is copied in pieces of at least 32 bytes."""
    for p in LAUNCHES:
        k = p.values[0].constants
        if k["CHUNK_WORDS"] * k["WORD"] >= CONTIGUOUS_FROM:
            assert split_pieces(k)[1] == [], (p.id, k)


def _one_per_chunk_shape(keep):
    """One launch per (WORD, CHUNK_WORDS) among those whose constants satisfy ``keep``."""
    picked = {}
    for p in LAUNCHES:
        k = p.values[0].constants
        if keep(k):
            picked.setdefault((k["WORD"], k["CHUNK_WORDS"]), p)
    return list(picked.values())


UNDER_32 = _one_per_chunk_shape(lambda k: k["CHUNK_WORDS"] * k["WORD"] < CONTIGUOUS_FROM)


def test_sweep_has_rows_under_32_bytes():
    # the fp32 scale row, 6-byte and 3-byte rows, and (by page) 4-slot pages of each
    assert {(p.values[0].constants["WORD"], p.values[0].constants["CHUNK_WORDS"]) for p in UNDER_32} \
        == {(4, 1), (2, 3), (1, 3), (4, 4), (2, 12), (1, 12)}


@pytest.mark.parametrize("launch", UNDER_32)
def test_rows_under_32_bytes_stay_element_wise(launch):
    """A row under 32 bytes has no room for a 32-byte window: MIN_PIECE stays 1 and its
    pieces are element-wise loops, as lowered (a known triton-ascend 3.2 cost)."""
    k = launch.constants
    assert k["MIN_PIECE"] == 1
    big, small = split_pieces(k)
    assert not big and small
    c = lowering.copies(lowering.lower(launch))
    assert not c.loads and len(c.scalar_data) == c.stores.count(-1) == len(small)


@pytest.mark.xfail(strict=True, raises=lowering.LoweringError,
                   reason="triton-ascend 3.2 cannot lower a one-row gather tile; NPU launches use min_rows=2")
def test_single_row_tiles_do_not_lower():
    launch = LAUNCHES[0].values[0]
    one = lowering.Launch(launch.grid, launch.args, dict(launch.constants, ROWS=1))
    lowering.lower(one)


def test_checker_rejects_element_wise_copies():
    """The checks can fail: a kernel that copies one element at a time is flagged."""
    text = """
    func.func @k(%arg0: memref<?xi8>, %arg1: memref<?xi8>, %arg2: memref<?xi64>, %arg3: memref<?xi64>) attributes {SyncBlockLockArgIdx = 0 : i64, WorkspaceArgIdx = 1 : i64} {
      %rc = memref.reinterpret_cast %arg2 to offset: [%0], sizes: [1], strides: [1] : memref<?xi64> to memref<1xi64>
      %v = memref.load %rc[%c0] : memref<1xi64>
      %rd = memref.reinterpret_cast %arg3 to offset: [%1], sizes: [1], strides: [1] : memref<?xi64> to memref<1xi64>
      memref.store %v, %rd[%c0] : memref<1xi64>
      %m = arith.cmpi slt, %a, %b : i64
    }"""
    low = lowering.Lowered(text, {"src_ptr": "*i64", "dst_ptr": "*i64"}, {})
    c = lowering.copies(low)
    assert c.scalar_data and c.masks == 1 and not c.loads


def _distinct_checks():
    picked = {}
    for launch in CHECKS:
        picked.setdefault(launch.key(), launch)
    return list(picked.values())


def test_copies_are_checked_by_default():
    """On an NPU every copy reads the verdict of the check launch before it (none checks
    inline: the compares would lower element by element)."""
    assert CHECKS and all(p.values[0].constants["CHECK"] == 1 for p in LAUNCHES)


@pytest.mark.parametrize("launch", _distinct_checks(), ids=lambda l: "-".join(
    f"{k}{v}" for k, v in sorted(l.constants.items())))
def test_index_check_lowers(launch):
    """The index check that precedes copies (kvtier.kernels.index_check) lowers for
    Ascend910B3 in every form the launcher uses (one or two lists, whole pages or not).
    Lowered in a process of its own: it uses Triton's reductions, which do not compile
    where the interpreter is on."""
    assert "lowered check" in lowering.lower_apart(launch)
