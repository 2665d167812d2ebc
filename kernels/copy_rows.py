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

import kvtier.platforms as platforms

from .config import CopyConfig
from .errors import KvtierError
from .rowmap import RowMap
from .validate import check_copy

__all__ = ["copy_rows", "KvtierError", "interpreter_active", "triton_available", "plan_copy"]


def _triton():
    """Triton, or None where it is not installed (then copies run the reference)."""
    try:
        import triton
        return triton
    except ImportError:
        return None


def _kernel():
    from .copy_rows_kernel import _copy_rows_kernel
    return _copy_rows_kernel


def triton_available() -> bool:
    return _triton() is not None


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 before import)."""
    triton = _triton()
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


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def plan_copy(src: RowMap, dst: RowMap, n_rows: int, config: CopyConfig, threads: int = 0,
              min_rows: int = 1, min_piece_bytes: int = 1) -> dict:
    """Compile-time constants for one copy (no tensors touched).

    word: the widest integer (<= 8 bytes) that divides every address and stride.
    block: the inner tile width in words (a power of two, at most one chunk).
    rows: rows per tile, at least ``config.rows``; with ``threads`` (GPU threads per
    program) it is raised until the smallest tail piece of a tile gives every thread
    16 bytes, so that non-power-of-two rows (576 B, 656 B) keep 16-byte accesses,
    within a 16 KiB tile. ``min_rows`` is a floor set by the platform (triton-ascend
    3.2 cannot lower a one-row tile).
    min_piece: the narrowest tail piece in words; the part of the tail below it is copied
    as one window of min_piece words ending at the chunk's end. It is
    ``min_piece_bytes // word`` (a platform floor: triton-ascend 3.2 copies a piece under
    32 bytes element by element) where the chunk has that many words and the tail leaves
    such a part, else 1 (no window).
    """
    word = min(src.align, dst.align, 8)
    while src.chunk_bytes % word or dst.chunk_bytes % word:
        word //= 2
    align = max(min(src.align, dst.align) // word, 1)
    chunk_words = src.chunk_bytes // word
    block = min(_pow2_floor(config.block_bytes // word), _pow2_floor(chunk_words))
    rows = max(config.rows, min_rows)
    if threads:
        tail = chunk_words % block
        smallest = (tail & -tail) if tail else block           # words in the smallest piece
        want = _pow2_ceil(-(-threads * 16 // (smallest * word)))
        fit = _pow2_floor(max(16384 // (block * word), 1))
        rows = max(rows, min(want, fit))
    rows = max(min(rows, _pow2_ceil(n_rows)), min_rows)
    piece = _pow2_floor(max(min_piece_bytes // word, 1))
    if chunk_words < piece or not (chunk_words % block) % piece:
        piece = 1
    return dict(word=word, align=align, chunk_words=chunk_words, block=block, rows=rows,
                log_block=block.bit_length() - 1, min_piece=piece)


def _pow2_ceil(x: int) -> int:
    return 1 << (max(int(x), 1) - 1).bit_length()


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
                   chunk_stride=other.chunk_bytes).sharing_anchors(contig)


def _split_chunks(m: RowMap, c: int) -> RowMap:
    # Only contiguous chunk sub-splits are representable with one chunk stride.
    if m.n_chunks == 1 or m.chunk_stride == m.chunk_bytes:
        from dataclasses import replace
        return replace(m, n_chunks=m.row_bytes // c, chunk_bytes=c, chunk_stride=c).sharing_anchors(m)
    raise KvtierError(f"cannot pair {m.describe()} with a map chunked in {c}-byte pieces")


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
    if config is None:
        config = platforms.of(device).default_config(crosses_link=src.device.type != dst.device.type)
    if by_page and src.page_size > 1 and src.page_contiguous and dst.page_contiguous:
        p = src.page_size
        src, dst = src.pages_as_rows(), dst.pages_as_rows()
        src_indices, dst_indices = src_indices[::p] // p, dst_indices[::p] // p
        n = src_indices.numel()
    if _triton() is None:
        _warn_once("no-triton", "kvtier: Triton is not installed; copies run the torch reference")
        return _reference(src, src_indices, dst, dst_indices, src_layer, dst_layer, num_layers)
    if device.type == "cpu" and not interpreter_active():
        _warn_once("cpu", "kvtier: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before "
                   "importing triton); copies run the torch reference")
        return _reference(src, src_indices, dst, dst_indices, src_layer, dst_layer, num_layers)
    if device.type == "cpu":
        check_interpreter()
    launch(src, src_indices, dst, dst_indices, src_layer, dst_layer, num_layers, config, device)


_interpreter_problem = []


def check_interpreter() -> None:
    """Raise a clear error where Triton's interpreter cannot run the kernel: Triton < 3.7
    turns a loop bound tensor into an int with ``int(array)``, which numpy >= 2.4 refuses
    for 1-element arrays ("only 0-dimensional arrays can be converted")."""
    if not _interpreter_problem:
        import numpy as np
        triton = _triton()
        version = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())
        try:
            int(np.ones(1, dtype=np.int64))
            numpy_ok = True
        except TypeError:
            numpy_ok = False
        _interpreter_problem.append(
            None if numpy_ok or version >= (3, 7) else
            f"Triton {triton.__version__}'s interpreter cannot run kernels with numpy {np.__version__} "
            "(int() of a 1-element array); install 'numpy<2.4' or Triton >= 3.7")
    if _interpreter_problem[0]:
        raise KvtierError(_interpreter_problem[0])


def _reference(src, si, dst, di, src_layer, dst_layer, num_layers):
    from .reference import copy_rows_reference
    copy_rows_reference(src, si, dst, di, src_layer=src_layer, dst_layer=dst_layer,
                        num_layers=num_layers, check=False)


def launch(src: RowMap, src_indices, dst: RowMap, dst_indices, src_layer: int, dst_layer: int,
           num_layers: int, config: CopyConfig, device: torch.device) -> None:
    """Launch the kernel on already-validated arguments (the pools' hot path)."""
    plat = _platform(device)
    # A map as the kernel addresses it (Ascend: registered host memory by device address).
    src, dst = src.kernel_view(plat, device), dst.kernel_view(plat, device)
    src, dst = _unify_chunks(src, dst)
    # The kernel reads indices as dense arrays: a strided view would address other rows.
    src_indices, dst_indices = src_indices.contiguous(), dst_indices.contiguous()
    n = src_indices.numel()
    plan = plan_copy(src, dst, n, config, threads=config.num_warps * plat.warp_threads,
                     min_rows=plat.min_rows, min_piece_bytes=plat.min_piece_bytes)
    word = plan["word"]
    unit = word * plan["align"]
    tiles = -(-n // plan["rows"])
    grid = max(1, min(config.num_programs, src.num_components * num_layers * tiles))
    args = []
    for m in (src, dst):
        if m.is_table:
            table = m.table_on(device)
            # The pointer argument of a table side is unused; its dtype names the word type.
            other = dst if m is src else src
            ptr = other.anchor(word) if not other.is_table else _word_view(table, word)
            args.append((ptr, table))
        else:
            a = m.anchor(word)
            args.append((a, a))
    (sp, st), (dp, dt) = args
    _kernel()[(grid,)](
        sp, st, src_indices, dp, dt, dst_indices,
        n, num_layers, src_layer, dst_layer, src.num_layers, dst.num_layers,
        *_units(src, unit), *_units(dst, unit),
        SRC_TABLE=src.is_table, DST_TABLE=dst.is_table, WORD=word,
        SRC_PAGE=src.page_size, DST_PAGE=dst.page_size,
        N_COMP=src.num_components, N_CHUNKS=src.n_chunks, CHUNK_WORDS=plan["chunk_words"],
        ROWS=plan["rows"], BLOCK=plan["block"], LOG_BLOCK=plan["log_block"], ALIGN=plan["align"],
        MIN_PIECE=plan["min_piece"], num_warps=config.num_warps,
    )


def _platform(device: torch.device):
    """The platform record whose launch floors, thread counts and map views apply."""
    return platforms.of(device)


def _units(m: RowMap, unit: int):
    """The map's strides in units of ``unit`` bytes (comp, layer, page, token, chunk)."""
    return (m.comp_stride // unit, m.layer_stride // unit, m.page_stride // unit,
            m.token_stride // unit, m.chunk_stride // unit)


def _word_view(t: torch.Tensor, word: int) -> torch.Tensor:
    from .rowmap import _WORD_DTYPES
    return t.view(torch.uint8)[: (t.numel() * 8 // word) * word].view(_WORD_DTYPES[word])
