"""Tiling one launch: from the two sides' geometry and a configuration to the row-copy
kernel's compile-time constants. The launcher tiles from row maps; `kvtier codegen`
tiles from a `Geometry` (no tensors), through the same function."""
from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import CopyConfig


@dataclass(frozen=True)
class Geometry:
    """What the constants depend on, for one side of a copy (a `RowMap` has these too)."""

    is_table: bool
    page_size: int = 1
    num_components: int = 1
    n_chunks: int = 1
    chunk_bytes: int = 1024
    align: int = 16
    span: int = 1 << 30     # bytes from a layer base to the end of its last row

    def layer_span(self) -> int:
        return self.span


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def tile_copy(src, dst, n_rows: int, config: CopyConfig, threads: int = 0,
              min_rows: int = 1, min_piece_bytes: int = 1) -> dict:
    """Compile-time constants for one copy (no tensors touched).

    word: the widest integer (<= 8 bytes) that divides every address and stride.
    split: column blocks are work items of their own and a partial last block is masked
    (see the kernel); chosen where the platform has no floor on a contiguous copy
    (``min_piece_bytes`` 1: GPUs, the CPU). With a floor (Ascend lowers a masked or narrow
    column element by element) a chunk's tail moves as unmasked pieces instead.
    block: the column tile width in words, a power of two: at most ``config.block_bytes``
    and, without split, at most one chunk; with split, a chunk narrower than that is one
    block of the next power of two (its end masked).
    rows: rows per tile, at least ``config.rows``, raised to fill ``config.tile_bytes``
    (tiles sized in bytes: narrow rows get more of them); with ``threads`` (GPU threads
    per program) it is raised until the smallest access of a tile gives every thread 16
    bytes, so that non-power-of-two rows (576 B, 656 B) keep 16-byte accesses, within a
    16 KiB tile. ``min_rows`` is a floor set by the platform (triton-ascend 3.2 cannot
    lower a one-row tile).
    min_piece: the narrowest tail piece in words (without split); the part of the tail
    below it is copied as one window of min_piece words ending at the chunk's end. It is
    ``min_piece_bytes // word`` (a platform floor: triton-ascend 3.2 copies a piece under
    32 bytes element by element) where the chunk has that many words and the tail leaves
    such a part, else 1 (no window).
    stages: software-pipeline depth of the persistent loop (``config.stages``).
    src_i32, dst_i32: a side's row offsets within a layer fit 32 bits (its layer spans
    under 2 GiB and no stride is negative); layer and component bases stay 64-bit.
    """
    word = min(src.align, dst.align, 8)
    while src.chunk_bytes % word or dst.chunk_bytes % word:
        word //= 2
    align = max(min(src.align, dst.align) // word, 1)
    chunk_words = src.chunk_bytes // word
    split = min_piece_bytes <= 1
    cap = _pow2_floor(config.block_bytes // word)
    block = min(cap, _pow2_ceil(chunk_words) if split else _pow2_floor(chunk_words))
    rows = max(config.rows, min_rows)
    if config.tile_bytes:
        rows = max(rows, _pow2_floor(config.tile_bytes // (block * word)))
    if threads:
        tail = chunk_words % block
        smallest = block if split or not tail else tail & -tail   # words in the smallest access
        want = _pow2_ceil(-(-threads * 16 // (smallest * word)))
        fit = _pow2_floor(max(16384 // (block * word), 1))
        rows = max(rows, min(want, fit))
    rows = max(min(rows, _pow2_ceil(n_rows)), min_rows)
    piece = _pow2_floor(max(min_piece_bytes // word, 1))
    if split or chunk_words < piece or not (chunk_words % block) % piece:
        piece = 1
    return dict(word=word, align=align, chunk_words=chunk_words, block=block, rows=rows,
                log_block=block.bit_length() - 1, min_piece=piece, split=split,
                stages=config.stages, src_i32=_fits_i32(src), dst_i32=_fits_i32(dst))


def _fits_i32(side) -> bool:
    """Whether every row offset within one of ``side``'s layers fits a signed 32-bit int."""
    if not hasattr(side, "layer_span"):     # a side that does not say: 64-bit
        return False
    strides = [getattr(side, k, 0) for k in ("page_stride", "token_stride", "chunk_stride")]
    return min(strides) >= 0 and side.layer_span() < (1 << 31)


def _pow2_ceil(x: int) -> int:
    return 1 << (max(int(x), 1) - 1).bit_length()


def kernel_constants(src, dst, n_rows: int, config: CopyConfig, *, threads: int = 0,
                     min_rows: int = 1, min_piece_bytes: int = 1) -> dict:
    """The kernel's constexpr arguments for copying ``n_rows`` rows from ``src`` to ``dst``
    (row maps or `Geometry`; chunks already unified) under ``config``."""
    tiles = tile_copy(src, dst, n_rows, config, threads, min_rows, min_piece_bytes)
    return dict(SRC_TABLE=src.is_table, DST_TABLE=dst.is_table, WORD=tiles["word"],
                SRC_PAGE=src.page_size, DST_PAGE=dst.page_size,
                N_COMP=src.num_components, N_CHUNKS=src.n_chunks, CHUNK_WORDS=tiles["chunk_words"],
                ROWS=tiles["rows"], BLOCK=tiles["block"], LOG_BLOCK=tiles["log_block"],
                ALIGN=tiles["align"], MIN_PIECE=tiles["min_piece"], STAGES=tiles["stages"],
                SPLIT=tiles["split"], SRC_I32=tiles["src_i32"], DST_I32=tiles["dst_i32"], IDX_STEP=1)
