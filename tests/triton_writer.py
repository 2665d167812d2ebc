"""An engine's own Triton kernel writing into an index list (what kvtier cannot see:
vLLM computes slot mappings in Triton kernels). Imported by the tests that need it, so
that collecting the suite does not import Triton."""
import triton
import triton.language as tl


@triton.jit
def _store_one(ptr, pos, value):
    tl.store(ptr + pos, value)


def triton_write(t, pos: int, value: int) -> None:
    """``t[pos] = value`` by a Triton kernel (``t``: a contiguous 1-D int tensor)."""
    _store_one[(1,)](t, pos, value)
