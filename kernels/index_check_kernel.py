"""The index-check Triton kernel (its launcher is kvtier.kernels.index_check).

Kept apart from the launcher so that importing kvtier does not import Triton. The
checking steps (`no_failure`, `check_list`, `note_first`, `keep_failure`) are jitted
functions of their own: the row-copy kernel's inline check calls the same ones.
"""
import triton
import triton.language as tl


# Counts, limits and argument ids change from call to call: not specialized on (see the
# row-copy kernel).
NOT_SPECIALIZED = ("a_n", "a_limit", "a_id", "b_n", "b_limit", "b_id", "ta_n", "ta_id", "tb_n", "tb_id")


@triton.jit
def no_failure():
    """No failure kept yet: (code, argument id, position, value, limit, page), all 0."""
    z = tl.full([], 0, tl.int64)
    return z, z, z, z, z, z


@triton.jit
def note_first(code, k, value, n, arg, limit, page, bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page):
    """The first failure of one tile (``code``: 0, or a failure code, per entry ``k`` of
    ``n``; ``value`` the entries), kept in ``bad_*`` (code, argument id, position, value,
    limit, page) unless an earlier failure is kept already."""
    pos = tl.min(tl.where(code != 0, k, n), axis=0).to(tl.int64)
    found = (pos < n) & (bad_code == 0)
    hit = k == pos
    bad_val = tl.where(found, tl.sum(tl.where(hit, value, 0), axis=0), bad_val)
    bad_arg = tl.where(found, arg, bad_arg)
    bad_pos = tl.where(found, pos, bad_pos)
    bad_lim = tl.where(found, limit, bad_lim)
    bad_page = tl.where(found, page, bad_page)
    bad_code = tl.where(found, tl.sum(tl.where(hit, code, 0), axis=0), bad_code)
    return bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page


@triton.jit
def check_list(idx, n, stride, limit, arg, PAGE: tl.constexpr, NEG_SKIPS: tl.constexpr, BLOCK: tl.constexpr,
               bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page):
    """One index list of ``n`` entries, read with its ``stride`` as the copies read it, in
    BLOCK-wide tiles: every index in 0 <= i < limit (a negative one passes with
    NEG_SKIPS) and, with PAGE > 1, every run of PAGE indices one whole page (a
    page-boundary start, then consecutive slots). Its first failure is kept in ``bad_*``
    (`note_first`). Codes: 1 negative, 2 out of range, 3 not a whole page."""
    for start in range(0, n, BLOCK):
        j = start + tl.arange(0, BLOCK)
        live = j < n
        v = tl.load(idx + j * stride, mask=live, other=0).to(tl.int64)
        code = tl.where(v < 0, 0 if NEG_SKIPS else 1, tl.where(v >= limit, 2, 0)).to(tl.int64)
        if PAGE > 1:
            first = tl.load(idx + (j - j % PAGE) * stride, mask=live, other=0).to(tl.int64)
            broken = (first % PAGE != 0) | (v != first + (j % PAGE))
            code = tl.where((code == 0) & broken, 3, code)
        code = tl.where(live, code, 0)
        bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page = note_first(
            code, j, v, n, arg, limit, PAGE, bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page)
    return bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page


@triton.jit
def keep_failure(record, bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page):
    """Write a failure to ``record`` (code last) unless one is there already, for the host
    to read without a sync."""
    if tl.load(record) == 0:
        tl.store(record + 1, bad_arg)
        tl.store(record + 2, bad_pos)
        tl.store(record + 3, bad_val)
        tl.store(record + 4, bad_lim)
        tl.store(record + 5, bad_page)
        tl.store(record, bad_code)


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def check_indices_jit(
    a_idx, a_n, a_stride, a_limit, a_id, b_idx, b_n, b_stride, b_limit, b_id,
    ta, ta_n, ta_id, tb, tb_n, tb_id, verdict, record,
    A_PAGE: tl.constexpr, B_PAGE: tl.constexpr, TWO: tl.constexpr, NEG_SKIPS: tl.constexpr,
    TABLES: tl.constexpr, T_ALIGN: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program checks the index lists (one or two) and the address tables (none, one
    or two) of one call before its copies read them: the call's own check launch, for
    copies that do not check inline (many programs, several launches, Ascend).

    For list a (and b when TWO), read with its stride as the copies read it: every index
    in 0 <= i < limit and, with PAGE > 1, every run of PAGE indices one whole page (a
    page-boundary start, then consecutive slots); with NEG_SKIPS a negative index passes
    (the copy skips its pair, the engines' convention). For the first TABLES tables (ta,
    tb; ``*_n`` entries each): every entry a non-null address that is a multiple of
    T_ALIGN bytes. ``verdict`` is the calling thread's pair of words on this stream:
    word 0 becomes 0 or the first failure's code (the copies of the call read it first),
    word 1 its negation (1 exactly when word 0 is 0; a copy gated by word 1 runs only for
    a bad call). The first failure is also kept in ``record`` (code, argument id,
    position, value, limit, page) unless an earlier one is still there, for the host to
    read without a sync. Codes: 1 negative, 2 out of range, 3 not a whole page, 4 a bad
    table address. Lists and tables are walked in BLOCK-wide tiles; nothing else is
    written.
    """
    bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page = no_failure()
    for which in tl.static_range(2 if TWO else 1):
        bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page = check_list(
            a_idx if which == 0 else b_idx, a_n if which == 0 else b_n, a_stride if which == 0 else b_stride,
            a_limit if which == 0 else b_limit, a_id if which == 0 else b_id, A_PAGE if which == 0 else B_PAGE,
            NEG_SKIPS, BLOCK, bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page)
    for which in tl.static_range(TABLES):
        table = ta if which == 0 else tb
        n = ta_n if which == 0 else tb_n
        arg = ta_id if which == 0 else tb_id
        for start in range(0, n, BLOCK):
            k = start + tl.arange(0, BLOCK)
            live = k < n
            addr = tl.load(table + k, mask=live, other=0).to(tl.int64)
            wrong = live & ((addr == 0) | (addr % T_ALIGN != 0))
            bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page = note_first(
                tl.where(wrong, 4, 0).to(tl.int64), k, addr, n, arg, T_ALIGN, which,
                bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page)
    tl.store(verdict, bad_code.to(tl.int32))
    tl.store(verdict + 1, (bad_code == 0).to(tl.int32))
    if bad_code != 0:
        keep_failure(record, bad_code, bad_arg, bad_pos, bad_val, bad_lim, bad_page)
