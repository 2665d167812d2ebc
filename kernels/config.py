"""`CopyConfig`, `Space` and `STRATEGIES`, defined in `kvtier.config` (below every
subpackage: the platform records hold their defaults); named here where kernels' users
look for them."""
from kvtier.config import STRATEGIES, CopyConfig, Space

__all__ = ["STRATEGIES", "CopyConfig", "Space"]
