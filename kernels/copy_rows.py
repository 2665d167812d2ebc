"""The row-copy kernel family and its launcher.

One kernel copies rows from one row map to another at given source and destination
indices, over a range of layers and every component of the maps. Backup (device ->
host), load (host -> device), gather (scattered rows -> contiguous buffer) and scatter
are all this copy with different maps. Each side is addressed either as a stacked
buffer (base pointer + strides, Ascend style) or through an int64 table of per-layer
base addresses (CUDA style); the choice is a compile-time constant per side.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from .config import CopyConfig, default_config
from .errors import KvtierError
from .rowmap import RowMap
from .validate import check_copy

try:  # Triton is optional: without it every copy runs the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

__all__ = ["copy_rows", "KvtierError", "interpreter_active", "triton_available", "plan_copy"]


if triton is not None:

    @triton.jit
    def _copy_rows_kernel(
        src_ptr, src_table, src_idx, dst_ptr, dst_table, dst_idx,
        n_rows, n_layers, src_layer0, dst_layer0, src_table_layers, dst_table_layers,
        src_comp_stride, src_layer_stride, src_page_stride, src_token_stride, src_chunk_stride,
        dst_comp_stride, dst_layer_stride, dst_page_stride, dst_token_stride, dst_chunk_stride,
        SRC_TABLE: tl.constexpr, DST_TABLE: tl.constexpr, WORD: tl.constexpr,
        SRC_PAGE: tl.constexpr, DST_PAGE: tl.constexpr,
        N_COMP: tl.constexpr, N_CHUNKS: tl.constexpr, CHUNK_WORDS: tl.constexpr,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, ALIGN: tl.constexpr,
    ):
        """Persistent copy of ``ROWS x CHUNK_WORDS`` word tiles.

        Work items are (component, layer, tile of ROWS indices); program p takes items
        p, p + grid, p + 2 * grid, ... Each item loads ROWS source and destination
        indices (a tail tile repeats its last row, which rewrites the same bytes, so no
        row mask is needed), turns them into word offsets by the row-map formula, then
        copies every chunk of the rows in [ROWS, BLOCK] tiles. The row tail that does not
        fill a BLOCK is copied as power-of-two pieces, so no copy carries a mask. Strides
        arrive in units of ALIGN words, so the compiler sees the alignment of every offset and
        may use 16-byte accesses, even through pointers loaded from a table.
        """
        pid = tl.program_id(0)
        grid = tl.num_programs(0)
        tiles = (n_rows + ROWS - 1) // ROWS
        total = N_COMP * n_layers * tiles
        MAIN: tl.constexpr = (CHUNK_WORDS // BLOCK) * BLOCK
        TAIL: tl.constexpr = CHUNK_WORDS - MAIN
        for w in range(pid, total, grid):
            tile = w % tiles
            cl = w // tiles
            layer = (cl % n_layers).to(tl.int64)
            comp = (cl // n_layers).to(tl.int64)
            r = tile * ROWS + tl.arange(0, ROWS)
            r = tl.minimum(r, n_rows - 1)
            si = tl.load(src_idx + r).to(tl.int64)
            di = tl.load(dst_idx + r).to(tl.int64)
            # Strides arrive in units of ALIGN words; multiplying by the constant ALIGN
            # tells the compiler every offset's alignment (a multiple_of hint on a sum can
            # be folded away with the sum).
            s_off = ((si // SRC_PAGE) * src_page_stride + (si % SRC_PAGE) * src_token_stride) * ALIGN
            d_off = ((di // DST_PAGE) * dst_page_stride + (di % DST_PAGE) * dst_token_stride) * ALIGN
            if SRC_TABLE:
                s_addr = tl.load(src_table + comp * src_table_layers + src_layer0 + layer)
                s_base = tl.multiple_of(s_addr.to(tl.pointer_type(src_ptr.dtype.element_ty)), ALIGN * WORD)
            else:
                s_base = src_ptr + (comp * src_comp_stride + (src_layer0 + layer) * src_layer_stride) * ALIGN
            if DST_TABLE:
                d_addr = tl.load(dst_table + comp * dst_table_layers + dst_layer0 + layer)
                d_base = tl.multiple_of(d_addr.to(tl.pointer_type(dst_ptr.dtype.element_ty)), ALIGN * WORD)
            else:
                d_base = dst_ptr + (comp * dst_comp_stride + (dst_layer0 + layer) * dst_layer_stride) * ALIGN
            for ch in range(N_CHUNKS):
                sp = s_base + (s_off + ch * src_chunk_stride * ALIGN)[:, None]
                dp = d_base + (d_off + ch * dst_chunk_stride * ALIGN)[:, None]
                for b in range(0, MAIN, BLOCK):
                    cols = b + tl.arange(0, BLOCK)[None, :]
                    tl.store(dp + cols, tl.load(sp + cols))
                for k in tl.static_range(LOG_BLOCK):
                    if (TAIL >> k) & 1:
                        cols = (MAIN + ((TAIL >> (k + 1)) << (k + 1))) + tl.arange(0, 1 << k)[None, :]
                        tl.store(dp + cols, tl.load(sp + cols))


def triton_available() -> bool:
    return triton is not None


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 before import)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_warned = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _platform_of(device: torch.device) -> str:
    if device.type == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return device.type  # "npu", "cpu"


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def plan_copy(src: RowMap, dst: RowMap, n_rows: int, config: CopyConfig) -> dict:
    """Compile-time constants and grid for one copy (no tensors touched)."""
    word = min(src.align, dst.align, 8)
    while src.chunk_bytes % word or dst.chunk_bytes % word:
        word //= 2
    align = max(min(src.align, dst.align) // word, 1)
    chunk_words = src.chunk_bytes // word
    block = min(_pow2_floor(config.block_bytes // word), _pow2_floor(chunk_words))
    rows = min(config.rows, _pow2_floor(2 * n_rows - 1) if n_rows > 1 else 1)
    return dict(word=word, align=align, chunk_words=chunk_words, block=block, rows=rows,
                log_block=block.bit_length() - 1)


def _unify_chunks(src: RowMap, dst: RowMap):
    """Both sides must split a row into the same chunks; a contiguous row (one chunk)
    is re-described as the other side's chunks, which changes no byte it addresses."""
    if src.n_chunks == dst.n_chunks:
        return src, dst
    if src.n_chunks == 1:
        return _chunked_like(src, dst), dst
    if dst.n_chunks == 1:
        return src, _chunked_like(dst, src)
    # Both chunked differently: split both down to their common chunk size.
    from math import gcd
    c = gcd(src.chunk_bytes, dst.chunk_bytes)
    return _split_chunks(src, c), _split_chunks(dst, c)


def _chunked_like(contig: RowMap, other: RowMap) -> RowMap:
    from dataclasses import replace
    return replace(contig, n_chunks=other.n_chunks, chunk_bytes=other.chunk_bytes,
                   chunk_stride=other.chunk_bytes, _anchors=contig._anchors)


def _split_chunks(m: RowMap, c: int) -> RowMap:
    # Only contiguous chunk sub-splits are representable with one chunk stride.
    if m.n_chunks == 1 or m.chunk_stride == m.chunk_bytes:
        from dataclasses import replace
        return replace(m, n_chunks=m.row_bytes // c, chunk_bytes=c, chunk_stride=c, _anchors=m._anchors)
    raise KvtierError(f"cannot pair {m.describe()} with a map chunked in {c}-byte pieces")


def _table_on(m: RowMap, device: torch.device) -> torch.Tensor:
    key = ("table", str(device))
    t = m._anchors.get(key)
    if t is None:
        t = m.table if m.table.device == device else m.table.to(device)
        m._anchors[key] = t
    return t


def _pages_of(m: RowMap) -> RowMap:
    p = m._anchors.get("as_pages")
    if p is None:
        p = m._anchors["as_pages"] = m.as_pages()
    return p


def copy_rows(src: RowMap, src_indices: torch.Tensor, dst: RowMap, dst_indices: torch.Tensor,
              *, src_layer: int = 0, dst_layer: int = 0, num_layers: Optional[int] = None,
              by_page: bool = False, config: Optional[CopyConfig] = None, check: bool = True) -> None:
    """Copy rows: for every component c and layer l < num_layers,
    ``dst[c, dst_layer + l, dst_indices[j]] = src[c, src_layer + l, src_indices[j]]``.

    Indices are token slots (int32/int64, 1-D, on the device where the copy runs: the
    maps' accelerator, else the CPU). ``by_page=True`` asserts that the indices are whole
    pages (runs of page_size slots from a page boundary, checked): where both sides store
    a page contiguously, each page then moves as one row. ``num_layers`` defaults to all
    layers both sides have from their start layers. ``check=False`` skips the value checks
    (range, page alignment), which cost a device sync; the shape checks always run.
    The copy is enqueued on the current stream; nothing moves if a check fails.
    """
    device, num_layers = check_copy(src, src_indices, dst, dst_indices, src_layer, dst_layer,
                                    num_layers, by_page, check_values=check)
    n = src_indices.numel()
    if n == 0 or num_layers == 0:
        return
    platform = _platform_of(device)
    if config is None:
        config = default_config(platform, crosses_link=(src.device.type != dst.device.type))
    if by_page and src.page_size > 1 and src.page_contiguous and dst.page_contiguous:
        p = src.page_size
        src, dst = _pages_of(src), _pages_of(dst)
        src_indices, dst_indices = src_indices[::p] // p, dst_indices[::p] // p
        n = src_indices.numel()
    if triton is None:
        _warn_once("no-triton", "kvtier: Triton is not installed; copies run the torch reference")
        return _reference(src, src_indices, dst, dst_indices, src_layer, dst_layer, num_layers)
    if device.type == "cpu" and not interpreter_active():
        _warn_once("cpu", "kvtier: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before "
                   "importing triton); copies run the torch reference")
        return _reference(src, src_indices, dst, dst_indices, src_layer, dst_layer, num_layers)
    launch(src, src_indices, dst, dst_indices, src_layer, dst_layer, num_layers, config, device)


def _reference(src, si, dst, di, src_layer, dst_layer, num_layers):
    from .reference import copy_rows_reference
    copy_rows_reference(src, si, dst, di, src_layer=src_layer, dst_layer=dst_layer,
                        num_layers=num_layers, check=False)


def launch(src: RowMap, src_indices, dst: RowMap, dst_indices, src_layer: int, dst_layer: int,
           num_layers: int, config: CopyConfig, device: torch.device) -> None:
    """Launch the kernel on already-validated arguments (the pools' hot path)."""
    src, dst = _unify_chunks(src, dst)
    n = src_indices.numel()
    plan = plan_copy(src, dst, n, config)
    word = plan["word"]
    unit = word * plan["align"]
    tiles = -(-n // plan["rows"])
    grid = max(1, min(config.num_programs, src.num_components * num_layers * tiles))
    args = []
    for m in (src, dst):
        if m.is_table:
            table = _table_on(m, device)
            # The pointer argument of a table side is unused; its dtype names the word type.
            other = dst if m is src else src
            ptr = other.anchor(word) if not other.is_table else _word_view(table, word)
            args.append((ptr, table))
        else:
            a = m.anchor(word)
            args.append((a, a))
    (sp, st), (dp, dt) = args
    _copy_rows_kernel[(grid,)](
        sp, st, src_indices, dp, dt, dst_indices,
        n, num_layers, src_layer, dst_layer, src.num_layers, dst.num_layers,
        *_units(src, unit), *_units(dst, unit),
        SRC_TABLE=src.is_table, DST_TABLE=dst.is_table, WORD=word,
        SRC_PAGE=src.page_size, DST_PAGE=dst.page_size,
        N_COMP=src.num_components, N_CHUNKS=src.n_chunks, CHUNK_WORDS=plan["chunk_words"],
        ROWS=plan["rows"], BLOCK=plan["block"], LOG_BLOCK=plan["log_block"], ALIGN=plan["align"],
        num_warps=config.num_warps,
    )


def _units(m: RowMap, unit: int):
    """The map's strides in units of ``unit`` bytes (comp, layer, page, token, chunk)."""
    return (m.comp_stride // unit, m.layer_stride // unit, m.page_stride // unit,
            m.token_stride // unit, m.chunk_stride // unit)


def _word_view(t: torch.Tensor, word: int) -> torch.Tensor:
    from .rowmap import _WORD_DTYPES
    return t.view(torch.uint8)[: (t.numel() * 8 // word) * word].view(_WORD_DTYPES[word])
