"""The row-copy Triton kernel (its launcher is kvtier.kernels.copy_rows).

Kept in its own module so that importing kvtier does not import Triton: Triton decides
at import time whether kernels run compiled or in its CPU interpreter.
"""
import triton
import triton.language as tl

# The rows and start layers change from call to call (a layer loop passes every layer,
# batches bring every count) and nothing in the code gains from knowing that one is 1 or
# a multiple of 16: Triton would compile a variant for each such class as it first
# meets it (a stall of a second or more in the middle of serving), so they are not
# specialized on. (Tools that compile the kernel from its source pass this on.)
NOT_SPECIALIZED = ("n_rows", "src_layer0", "dst_layer0")


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _copy_rows_kernel(
    # What changes from call to call first, then what a bound copy keeps (the launcher
    # passes the rest as one prebuilt tuple), then the compile-time constants.
    src_idx, dst_idx, n_rows, verdict, dst_ptr, dst_table, src_ptr, src_table,
    n_layers, src_layer0, dst_layer0, src_table_layers, dst_table_layers,
    src_comp_stride, src_layer_stride, src_page_stride, src_token_stride, src_chunk_stride,
    dst_comp_stride, dst_layer_stride, dst_page_stride, dst_token_stride, dst_chunk_stride,
    SRC_TABLE: tl.constexpr, DST_TABLE: tl.constexpr, WORD: tl.constexpr,
    SRC_PAGE: tl.constexpr, DST_PAGE: tl.constexpr,
    N_COMP: tl.constexpr, N_CHUNKS: tl.constexpr, CHUNK_WORDS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, ALIGN: tl.constexpr,
    MIN_PIECE: tl.constexpr, CHECKED: tl.constexpr, SKIP_NEG: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr, SRC_I32: tl.constexpr, DST_I32: tl.constexpr,
    IDX_STEP: tl.constexpr,
):
    """Persistent copy of ``[ROWS, BLOCK]`` word tiles.

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

    A tail tile of rows repeats its last row, which rewrites the same bytes, so no row
    mask is needed. Row offsets follow the row-map formula; SRC_I32 / DST_I32 compute a
    side's offsets within a layer in 32 bits (the plan sets them where a layer spans
    under 2 GiB), layer and component bases stay 64-bit. Strides arrive in units of ALIGN
    words, so the compiler sees the alignment of every offset and may use 16-byte
    accesses, even through pointers loaded from a table. With CHECKED, every program
    first reads the verdict word an index check wrote on the same stream and copies
    nothing unless it is 0. With SKIP_NEG (the engines' convention) a row whose source or
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
    total = N_COMP * n_layers * tiles * PER_TILE
    if CHECKED:
        total = tl.where(tl.load(verdict) == 0, total, 0)
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
            si = tl.load(src_idx + r * IDX_STEP).to(tl.int32)
        else:
            si = tl.load(src_idx + r * IDX_STEP).to(tl.int64)
        if DST_I32:
            di = tl.load(dst_idx + r * IDX_STEP).to(tl.int32)
        else:
            di = tl.load(dst_idx + r * IDX_STEP).to(tl.int64)
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
            s_addr = tl.load(src_table + comp * src_table_layers + src_layer0 + layer)
            s_base = tl.multiple_of(s_addr.to(tl.pointer_type(src_ptr.dtype.element_ty)), ALIGN * WORD)
        else:
            s_base = src_ptr + (comp * src_comp_stride + (src_layer0 + layer) * src_layer_stride) * ALIGN
        if DST_TABLE:
            d_addr = tl.load(dst_table + comp * dst_table_layers + dst_layer0 + layer)
            d_base = tl.multiple_of(d_addr.to(tl.pointer_type(dst_ptr.dtype.element_ty)), ALIGN * WORD)
        else:
            d_base = dst_ptr + (comp * dst_comp_stride + (dst_layer0 + layer) * dst_layer_stride) * ALIGN
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
