"""The index-check Triton kernel (its launcher is kvtier.kernels.index_check).

Kept apart from the launcher so that importing kvtier does not import Triton.
"""
import triton
import triton.language as tl


@triton.jit
def _first_bad(idx, n, limit, PAGE: tl.constexpr, NEG_SKIPS: tl.constexpr, BLOCK: tl.constexpr):
    """(code, position, value) of the first bad index of one list; code 0 when none."""
    bad_code = tl.full([], 0, tl.int64)
    bad_pos = tl.full([], 0, tl.int64)
    bad_val = tl.full([], 0, tl.int64)
    for start in range(0, n, BLOCK):
        j = start + tl.arange(0, BLOCK)
        live = j < n
        v = tl.load(idx + j, mask=live, other=0).to(tl.int64)
        code = tl.where(v < 0, 0 if NEG_SKIPS else 1, tl.where(v >= limit, 2, 0)).to(tl.int64)
        if PAGE > 1:
            first = tl.load(idx + (j - j % PAGE), mask=live, other=0).to(tl.int64)
            whole = (first % PAGE == 0) & (v == first + (j % PAGE))
            code = tl.where((code == 0) & (~whole), 3, code)
        code = tl.where(live, code, 0)
        pos = tl.min(tl.where(code != 0, j, n), axis=0).to(tl.int64)
        found = (pos < n) & (bad_code == 0)
        hit = j == pos
        bad_val = tl.where(found, tl.sum(tl.where(hit, v, 0), axis=0), bad_val)
        bad_code = tl.where(found, tl.sum(tl.where(hit, code, 0), axis=0), bad_code)
        bad_pos = tl.where(found, pos, bad_pos)
    return bad_code, bad_pos, bad_val


@triton.jit
def _check_indices_kernel(
    a_idx, a_n, a_limit, a_id, b_idx, b_n, b_limit, b_id, verdict, record,
    A_PAGE: tl.constexpr, B_PAGE: tl.constexpr, TWO: tl.constexpr, NEG_SKIPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program checks one or two index lists before a copy reads them.

    For list a (and b when TWO): every index in 0 <= i < limit and, with PAGE > 1, every
    run of PAGE indices one whole page (a page-boundary start, then consecutive slots).
    The verdict word (device memory, read by every program of the copies that follow on
    the stream) becomes 0 or the first failure's code; the first failure is also kept in
    ``record`` (code, argument id, position, value) unless an earlier one is still there,
    for the host to read without a sync. Codes: 1 negative, 2 out of range, 3 not a whole
    page; with NEG_SKIPS a negative index passes (the copy skips its pair, the engines'
    convention).
    Lists are walked in BLOCK-wide tiles; no index is written.
    """
    code, pos, val = _first_bad(a_idx, a_n, a_limit, A_PAGE, NEG_SKIPS, BLOCK)
    arg = tl.full([], 0, tl.int64) + a_id
    if TWO:
        b_code, b_pos, b_val = _first_bad(b_idx, b_n, b_limit, B_PAGE, NEG_SKIPS, BLOCK)
        use_b = (code == 0) & (b_code != 0)
        arg = tl.where(use_b, b_id, arg)
        pos = tl.where(use_b, b_pos, pos)
        val = tl.where(use_b, b_val, val)
        code = tl.where(use_b, b_code, code)
    tl.store(verdict, code.to(tl.int32))
    if code != 0:
        if tl.load(record) == 0:
            tl.store(record + 1, arg)
            tl.store(record + 2, pos)
            tl.store(record + 3, val)
            tl.store(record, code)
