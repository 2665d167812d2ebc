"""`KvtierError` and `fail`, defined in `kvtier.errors` (below every subpackage, so that
`kvtier.platforms` can raise it too); named here where kernels' users look for it."""
from kvtier.errors import KvtierError, fail

__all__ = ["KvtierError", "fail"]
