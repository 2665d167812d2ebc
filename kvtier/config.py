"""Launch configuration of the row-copy kernel, and the space the autotuner searches
(below every subpackage: each platform record holds its shipped defaults and spaces).

The autotuner (kvtier.autotune) measures configurations per device and size bucket;
until a device is tuned, each platform's shipped defaults apply (`kvtier.platforms`).
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

from .errors import KvtierError

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
    stages: software-pipeline depth of the kernel's persistent loop: up to ``stages``
        tiles in flight per program (1: one at a time; sm_90 issues the loads ahead as
        cp.async into shared memory, ``stages - 1`` tiles of it).
    tile_bytes: bytes a tile should hold (0: ``rows`` rows); rows are raised to fill it,
        so narrow rows get more rows per tile. A power of two.
    """

    num_programs: int = 8
    rows: int = 1
    block_bytes: int = 1024
    num_warps: int = 4
    strategy: str = "kernel"
    stages: int = 1
    tile_bytes: int = 0

    def __post_init__(self):
        for name in ("num_programs", "rows", "block_bytes", "num_warps", "stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise KvtierError(f"CopyConfig.{name}={v!r}: must be a positive int")
        t = self.tile_bytes
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t & (t - 1):
            raise KvtierError(f"CopyConfig.tile_bytes={t!r}: must be 0 or a power of two")
        for name in ("rows", "block_bytes", "num_warps"):
            v = getattr(self, name)
            if v & (v - 1):
                raise KvtierError(f"CopyConfig.{name}={v!r}: must be a power of two")
        if self.strategy not in STRATEGIES:
            raise KvtierError(f"CopyConfig.strategy={self.strategy!r}: must be one of {STRATEGIES}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CopyConfig":
        """The configuration `to_dict` wrote, each field checked as on construction. The
        first five fields must be present (a missing one is an error, not a default); the
        pipelining fields, added later, default to one stage and tiles of ``rows`` rows:
        the kernel that entries written without them were measured with."""
        fields = ("num_programs", "rows", "block_bytes", "num_warps", "strategy")
        if not isinstance(d, dict) or any(k not in d for k in fields):
            raise KvtierError(f"CopyConfig.from_dict({d!r}): needs every field of {fields}")
        known = fields + ("stages", "tile_bytes")
        if any(isinstance(d[k], bool) for k in known if k in d):
            raise KvtierError(f"CopyConfig.from_dict({d!r}): a bool is not a count")
        return cls(**{k: d[k] for k in known if k in d})


@dataclass(frozen=True)
class Space:
    """The values the autotuner tries per launch parameter on one platform (each
    platform's record in `kvtier.platforms` holds a full and a quick one).

    tile_limit bounds rows x block bytes (registers on GPUs, the Unified Buffer on
    Ascend); warp is threads per warp (0: no warps). stages and tile_bytes are the
    pipeline depths and tile sizes tried (see `CopyConfig`); stages x tile bytes is
    bounded by stage_limit (shared memory on GPUs; 0: no bound).
    """

    rows: tuple
    block_bytes: tuple
    num_warps: tuple
    tile_limit: int
    warp: int
    stages: tuple = (1,)
    tile_bytes: tuple = (0,)
    stage_limit: int = 0
