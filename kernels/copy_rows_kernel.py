"""The row-copy Triton kernel (its launcher is kvtier.kernels.launcher).

Kept in its own module so that importing kvtier does not import Triton: Triton decides
at import time whether kernels run compiled or in its CPU interpreter.
"""
import triton
import triton.language as tl

from kvtier.kernels.index_check_kernel import check_list, keep_failure, no_failure, note_first

# What changes from call to call (a layer loop passes every layer, batches bring every
# count, the index lists and a layout's buffers are the caller's) is not specialized on:
# Triton would compile a variant for each class of value it first meets (a stall of a
# second or more in the middle of serving). (Tools that compile the kernel from its
# source pass this on.)
NOT_SPECIALIZED = ("n_idx", "n_rows", "src_limit", "dst_limit", "src_arg", "dst_arg", "src_targ", "dst_targ",
                   "src_base", "dst_base", "src_comp_stride", "dst_comp_stride", "src_layer0", "dst_layer0")

# Check modes (CHECK): what every program does before it moves a byte.
UNCHECKED, BY_VERDICT, INLINE = 0, 1, 2
# Failure codes written to the record (kvtier.kernels.faults names them).
NEGATIVE, OUT_OF_RANGE, NOT_WHOLE_PAGES, BAD_ADDRESS = 1, 2, 3, 4


@triton.jit
def table_base(table, table2, comp, e, t_comp, base, comp_stride, TSPLIT: tl.constexpr, N_COMP: tl.constexpr,
               WT: tl.constexpr, ALIGN: tl.constexpr, WORD: tl.constexpr):
    """Component ``comp``'s base on a table side as a word pointer: table entry
    ``comp * t_comp + e`` (of ``table2``, counted from TSPLIT, for components from TSPLIT
    on), plus ``base`` bytes and ``comp * comp_stride`` units, aligned as the map says."""
    if TSPLIT < N_COMP:
        addr = (tl.load(table + comp * t_comp + e, mask=comp < TSPLIT, other=0)
                + tl.load(table2 + (comp - TSPLIT) * t_comp + e, mask=comp >= TSPLIT, other=0))
    else:
        addr = tl.load(table + comp * t_comp + e)
    return (tl.multiple_of((addr.to(tl.int64) + base).to(tl.pointer_type(WT)), ALIGN * WORD)
            + comp * comp_stride * ALIGN)


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def copy_rows_jit(
    # What changes from call to call first (the lists and their checks, each side's buffer
    # or tables, the layer range), then what a copy launch keeps (passed as one prebuilt
    # tuple), then the compile-time constants.
    src_idx, dst_idx, n_idx, n_rows, src_idx_stride, dst_idx_stride,
    src_limit, dst_limit, src_arg, dst_arg, src_targ, dst_targ, verdict, record,
    src_base, src_table, src_table2, src_comp_stride, dst_base, dst_table, dst_table2, dst_comp_stride,
    n_layers, src_layer0, dst_layer0,
    src_t_comp, src_t_layer, dst_t_comp, dst_t_layer,
    src_layer_stride, src_page_stride, src_token_stride, src_chunk_stride,
    dst_layer_stride, dst_page_stride, dst_token_stride, dst_chunk_stride,
    SRC_TABLE: tl.constexpr, DST_TABLE: tl.constexpr, SRC_TSPLIT: tl.constexpr, DST_TSPLIT: tl.constexpr,
    WORD: tl.constexpr, SRC_PAGE: tl.constexpr, DST_PAGE: tl.constexpr,
    N_COMP: tl.constexpr, N_CHUNKS: tl.constexpr, CHUNK_WORDS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, ALIGN: tl.constexpr,
    MIN_PIECE: tl.constexpr, CHECK: tl.constexpr, SKIP_NEG: tl.constexpr,
    SRC_WHOLE: tl.constexpr, DST_WHOLE: tl.constexpr, CHECK_TABLES: tl.constexpr, CHECK_BLOCK: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr, SRC_I32: tl.constexpr, DST_I32: tl.constexpr,
    IDX_STEP: tl.constexpr,
):
    """Persistent copy of ``[ROWS, BLOCK]`` word tiles: ``n_rows`` rows from lists of
    ``n_idx`` indices (``n_idx / IDX_STEP`` rows).

    Check first (CHECK). INLINE: every program reads both index lists whole, through the
    same pointers and strides its copies read them with, and, with CHECK_TABLES, every
    table entry its copies will read; one bad value (negative without SKIP_NEG, at or past
    the side's limit, a run of SRC_WHOLE / DST_WHOLE slots that is not one whole page, a
    null or misaligned table entry) and no program moves a byte. Program 0 writes the
    first failure (code, argument id, position, value, limit, page) to ``record`` unless
    one is already there, for the host to read without a sync. BY_VERDICT: every program
    reads the word an earlier check launch of the same call wrote, and moves nothing
    unless it is 0. The lists are read in CHECK_BLOCK-wide tiles; nothing is written but
    the record.

    Work items: program p takes items p, p + grid, p + 2 * grid, ... of a loop that
    Triton software-pipelines over STAGES stages (on sm_90 the loads of the next
    STAGES - 1 items are issued as cp.async into shared memory while this item stores):
    several tiles are in flight per program, and an item's index loads are issued a stage
    before its data loads.

    With SPLIT (GPUs), an item is (component, layer, tile of ROWS indices, chunk, column
    block of BLOCK words): one load and one store, no branch, so the loop pipelines. A
    chunk that BLOCK does not divide ends in a block masked by ``column < CHUNK_WORDS``;
    since every chunk is a multiple of 16 bytes where the rows allow it, the mask is
    constant over 16 bytes and every access stays a 16-byte vector (576 B, 656 B rows).

    Without SPLIT (Ascend, which lowers a masked or narrow column as element copies), an
    item is (component, layer, tile): it copies every chunk in BLOCK-word columns, the
    row tail that does not fill a BLOCK as power-of-two pieces, no copy carrying a mask.
    Pieces narrower than MIN_PIECE words (a power of two, at most CHUNK_WORDS) are
    replaced by one MIN_PIECE-word window ending at the chunk's end: it rewrites bytes of
    the same row already copied, with the same values, and keeps every copy at least
    MIN_PIECE wide (triton-ascend lowers a piece under 32 bytes element by element);
    MIN_PIECE = 1 compiles the window out.

    Addresses. A stacked side is a base address (an int, the layer and component strides
    from it); a table side reads each (component, layer) base from an int64 table: entry
    ``c * t_comp + l * t_layer`` of ``table`` for components below TSPLIT, of ``table2``
    (components from TSPLIT on, counted from 0) for the rest, plus ``base`` bytes and
    ``c * comp_stride``.
    Row offsets follow the row-map formula; SRC_I32 / DST_I32 compute a side's offsets
    within a layer in 32 bits (the launch sets them where a layer spans under 2 GiB), layer
    and component bases stay 64-bit. Strides arrive in units of ALIGN words, so the
    compiler sees the alignment of every offset and may use 16-byte accesses, even
    through addresses loaded from a table.

    A tail tile of rows repeats its last row, which rewrites the same bytes, so no row
    mask is needed. With SKIP_NEG (the engines' convention) a row whose source or
    destination index is negative is skipped: the copies are masked by row, which only
    these calls pay for. With IDX_STEP > 1 the index lists are whole pages of IDX_STEP
    slots and a row is a page: row r reads the slot at ``r * IDX_STEP`` and takes its
    page, ``slot // IDX_STEP`` (with SKIP_NEG a negative slot stays negative), so no page
    list is made on the host.
    """
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    tiles = (n_rows + ROWS - 1) // ROWS
    MAIN: tl.constexpr = (CHUNK_WORDS // BLOCK) * BLOCK
    TAIL: tl.constexpr = CHUNK_WORDS - MAIN
    WINDOW: tl.constexpr = (TAIL % MIN_PIECE) != 0      # tail words below MIN_PIECE remain
    # Column blocks per chunk when they are work items (the last one masked if partial).
    COLS: tl.constexpr = (CHUNK_WORDS + BLOCK - 1) // BLOCK
    PER_TILE: tl.constexpr = N_CHUNKS * COLS if SPLIT else 1
    WT: tl.constexpr = tl.int8 if WORD == 1 else (tl.int16 if WORD == 2 else (tl.int32 if WORD == 4 else tl.int64))
    total = N_COMP * n_layers * tiles * PER_TILE
    if CHECK == 1:
        total = tl.where(tl.load(verdict) == 0, total, 0)
    if CHECK == 2:
        bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page = no_failure()
        for which in tl.static_range(2):
            bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page = check_list(
                src_idx if which == 0 else dst_idx, n_idx, src_idx_stride if which == 0 else dst_idx_stride,
                src_limit if which == 0 else dst_limit, src_arg if which == 0 else dst_arg,
                SRC_WHOLE if which == 0 else DST_WHOLE, SKIP_NEG, CHECK_BLOCK,
                bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page)
        if CHECK_TABLES:
            # Every (component, layer) base the copies will read from a table: not null,
            # aligned as the kernel's accesses assume.
            for which in tl.static_range(2):
                IS_TABLE = SRC_TABLE if which == 0 else DST_TABLE
                if IS_TABLE:
                    ta = src_table if which == 0 else dst_table
                    tb = src_table2 if which == 0 else dst_table2
                    t_comp = src_t_comp if which == 0 else dst_t_comp
                    t_layer = src_t_layer if which == 0 else dst_t_layer
                    layer0 = src_layer0 if which == 0 else dst_layer0
                    arg = src_targ if which == 0 else dst_targ
                    TSPLIT = SRC_TSPLIT if which == 0 else DST_TSPLIT
                    n_entries = N_COMP * n_layers
                    for start in range(0, n_entries, CHECK_BLOCK):
                        k = start + tl.arange(0, CHECK_BLOCK)
                        live = k < n_entries
                        c = k // n_layers
                        e = (layer0 + k % n_layers).to(tl.int64) * t_layer
                        addr = tl.load(ta + c.to(tl.int64) * t_comp + e, mask=live & (c < TSPLIT), other=0)
                        if TSPLIT < N_COMP:
                            addr += tl.load(tb + (c - TSPLIT).to(tl.int64) * t_comp + e,
                                            mask=live & (c >= TSPLIT), other=0)
                        addr = addr.to(tl.int64)
                        wrong = live & ((addr == 0) | (addr % (ALIGN * WORD) != 0))
                        bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page = note_first(
                            tl.where(wrong, 4, 0).to(tl.int64), k, addr, n_entries, arg, ALIGN * WORD, which,
                            bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page)
        total = tl.where(bad_code == 0, total, 0)
        if (bad_code != 0) & (pid == 0):
            keep_failure(record, bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page)
    if not SRC_TABLE:
        s_root = tl.multiple_of(src_base.to(tl.int64).to(tl.pointer_type(WT)), ALIGN * WORD)
    if not DST_TABLE:
        d_root = tl.multiple_of(dst_base.to(tl.int64).to(tl.pointer_type(WT)), ALIGN * WORD)
    for w in tl.range(pid, total, grid, num_stages=STAGES):
        part = w % PER_TILE
        item = w // PER_TILE
        tile = item % tiles
        cl = item // tiles
        layer = (cl % n_layers).to(tl.int64)
        comp = (cl // n_layers).to(tl.int64)
        r = tile * ROWS + tl.arange(0, ROWS)
        r = tl.minimum(r, n_rows - 1)
        if SRC_I32:
            si = tl.load(src_idx + r * (IDX_STEP * src_idx_stride)).to(tl.int32)
        else:
            si = tl.load(src_idx + r * (IDX_STEP * src_idx_stride)).to(tl.int64)
        if DST_I32:
            di = tl.load(dst_idx + r * (IDX_STEP * dst_idx_stride)).to(tl.int32)
        else:
            di = tl.load(dst_idx + r * (IDX_STEP * dst_idx_stride)).to(tl.int64)
        if IDX_STEP > 1:    # a page's first slot -> the page
            if SKIP_NEG:    # C division would send -1 to page 0: keep negatives negative
                si = tl.where(si < 0, si, si // IDX_STEP)
                di = tl.where(di < 0, di, di // IDX_STEP)
            else:           # checked whole pages (or the caller's word): never negative
                si = si // IDX_STEP
                di = di // IDX_STEP
        # Rows the copy writes: all, or (SKIP_NEG) those whose two indices are not negative.
        keep = ((si >= 0) & (di >= 0))[:, None] if SKIP_NEG else None
        # Strides arrive in units of ALIGN words; multiplying by the constant ALIGN
        # tells the compiler every offset's alignment (a multiple_of hint on a sum can
        # be folded away with the sum).
        if SRC_I32:
            s_off = ((si // SRC_PAGE) * tl.cast(src_page_stride, tl.int32)
                     + (si % SRC_PAGE) * tl.cast(src_token_stride, tl.int32)) * ALIGN
        else:
            s_off = ((si // SRC_PAGE) * src_page_stride + (si % SRC_PAGE) * src_token_stride) * ALIGN
        if DST_I32:
            d_off = ((di // DST_PAGE) * tl.cast(dst_page_stride, tl.int32)
                     + (di % DST_PAGE) * tl.cast(dst_token_stride, tl.int32)) * ALIGN
        else:
            d_off = ((di // DST_PAGE) * dst_page_stride + (di % DST_PAGE) * dst_token_stride) * ALIGN
        if SRC_TABLE:
            s_base = table_base(src_table, src_table2, comp, (src_layer0 + layer) * src_t_layer, src_t_comp, src_base,
                                src_comp_stride, SRC_TSPLIT, N_COMP, WT, ALIGN, WORD)
        else:
            s_base = s_root + (comp * src_comp_stride + (src_layer0 + layer) * src_layer_stride) * ALIGN
        if DST_TABLE:
            d_base = table_base(dst_table, dst_table2, comp, (dst_layer0 + layer) * dst_t_layer, dst_t_comp, dst_base,
                                dst_comp_stride, DST_TSPLIT, N_COMP, WT, ALIGN, WORD)
        else:
            d_base = d_root + (comp * dst_comp_stride + (dst_layer0 + layer) * dst_layer_stride) * ALIGN
        if SPLIT:
            ch = part // COLS
            cols = (part % COLS) * BLOCK + tl.arange(0, BLOCK)[None, :]
            # The chunk's offset joins the 64-bit base: row offsets keep their width.
            sp = (s_base + ch * src_chunk_stride * ALIGN) + s_off[:, None] + cols
            dp = (d_base + ch * dst_chunk_stride * ALIGN) + d_off[:, None] + cols
            if TAIL:
                # Constant over 16 bytes: CHUNK_WORDS is a multiple of 16 // WORD where rows allow.
                m = (cols < CHUNK_WORDS) & keep if SKIP_NEG else cols < CHUNK_WORDS
            else:
                m = keep
            tl.store(dp, tl.load(sp, mask=m), mask=m)
        else:
            for ch in range(N_CHUNKS):
                sp = (s_base + ch * src_chunk_stride * ALIGN) + s_off[:, None]
                dp = (d_base + ch * dst_chunk_stride * ALIGN) + d_off[:, None]
                for b in range(0, MAIN, BLOCK):
                    cols = b + tl.arange(0, BLOCK)[None, :]
                    tl.store(dp + cols, tl.load(sp + cols, mask=keep), mask=keep)
                for k in tl.static_range(LOG_BLOCK):
                    if ((TAIL >> k) & 1) and (1 << k) >= MIN_PIECE:
                        cols = (MAIN + ((TAIL >> (k + 1)) << (k + 1))) + tl.arange(0, 1 << k)[None, :]
                        tl.store(dp + cols, tl.load(sp + cols, mask=keep), mask=keep)
                if WINDOW:
                    cols = (CHUNK_WORDS - MIN_PIECE) + tl.arange(0, MIN_PIECE)[None, :]
                    tl.store(dp + cols, tl.load(sp + cols, mask=keep), mask=keep)
