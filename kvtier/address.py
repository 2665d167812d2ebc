"""Address arithmetic shared by the row maps (`kvtier.kernels.rowmap`) and the platforms
that re-address host memory for their kernels (`kvtier.platforms.ascend`)."""
from __future__ import annotations

import math
from functools import reduce


def pow2_align(*values: int, cap: int = 16) -> int:
    """The largest power of two, at most ``cap``, dividing every value (0 divides by any)."""
    g = reduce(math.gcd, (abs(int(v)) for v in values), 0)
    a = cap
    while g % a:
        a //= 2
    return a
