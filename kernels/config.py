"""Launch configuration of the row-copy kernel, and the space the autotuner searches.

The autotuner (kvtier.autotune) measures configurations per device and size bucket;
until a device is tuned, each platform's shipped defaults apply (`kvtier.platforms`).
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

STRATEGIES = ("kernel", "dma")   # how a transfer crosses the link (docs/design.md)


@dataclass(frozen=True)
class CopyConfig:
    """How one copy is launched.

    num_programs: persistent grid size (a cap: never more programs than work items).
        Programs taken by a transfer are compute units taken from the model.
    rows: rows per tile; each program iteration copies ``rows`` rows of one layer.
    block_bytes: width of the inner copy tile in bytes (rounded down to a power of two
        number of words and to the row size).
    num_warps: warps per program (CUDA/ROCm; ignored on Ascend).
    strategy: "kernel" (one launch through device-addressable host memory) or "dma"
        (device gather into a staging buffer plus bulk copies); read by the pools.
    """

    num_programs: int = 8
    rows: int = 1
    block_bytes: int = 1024
    num_warps: int = 4
    strategy: str = "kernel"

    def __post_init__(self):
        for name in ("num_programs", "rows", "block_bytes", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"CopyConfig.{name}={v!r}: must be a positive int")
        for name in ("rows", "block_bytes", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"CopyConfig.{name}={v!r}: must be a power of two")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"CopyConfig.strategy={self.strategy!r}: must be one of {STRATEGIES}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CopyConfig":
        """The configuration `to_dict` wrote: every field present (a missing one is an
        error, not a default), each checked as on construction."""
        fields = ("num_programs", "rows", "block_bytes", "num_warps", "strategy")
        if not isinstance(d, dict) or any(k not in d for k in fields):
            raise ValueError(f"CopyConfig.from_dict({d!r}): needs every field of {fields}")
        if any(isinstance(d[k], bool) for k in fields):
            raise ValueError(f"CopyConfig.from_dict({d!r}): a bool is not a count")
        return cls(**{k: d[k] for k in fields})


@dataclass(frozen=True)
class Space:
    """The values the autotuner tries per launch parameter on one platform (each
    platform's record in `kvtier.platforms` holds a full and a quick one).

    tile_limit bounds rows x block bytes (registers on GPUs, the Unified Buffer on
    Ascend); warp is threads per warp (0: no warps).
    """

    rows: tuple
    block_bytes: tuple
    num_warps: tuple
    tile_limit: int
    warp: int
