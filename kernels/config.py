"""Launch configuration of the row-copy kernel, with per-platform defaults.

The autotuner (kvtier.autotune) measures these per device and size bucket; until a
device is tuned, `default_config` gives settings that are safe everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

STRATEGIES = ("kernel", "dma")


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
        return cls(**{k: d[k] for k in ("num_programs", "rows", "block_bytes", "num_warps", "strategy") if k in d})


# Defaults per platform, until the autotuner has measured the device.
#  - cuda: measured on an H200 (bench/results/2026-11-29_h200/defaults, 1 KiB rows,
#    8192 random tokens x 8 layers x K,V): 4 programs of 64-row tiles move 50.9 GB/s
#    device->host and 49.6 GB/s host->device against a 55.2 GB/s pinned copy; 4-row
#    tiles reach only 10-26 GB/s (too few bytes in flight across PCIe).
#    On the device, 2112 programs (16 per SM) of 16-row tiles gather at 1166 GB/s.
#  - rocm: the CUDA values, not yet measured on AMD hardware.
#  - npu: about one program per vector core, looping inside (the launcher clamps to the
#    core count it reads); at least 2 rows, since triton-ascend 3.2 cannot lower a
#    one-row tile; tiles well inside the 192 KB Unified Buffer.
#  - cpu: the interpreter runs programs one after another; few, wide programs are fastest.
_DEFAULTS = {
    "cuda": CopyConfig(num_programs=4, rows=64, block_bytes=1024, num_warps=8),
    "rocm": CopyConfig(num_programs=4, rows=64, block_bytes=1024, num_warps=8),
    "npu": CopyConfig(num_programs=40, rows=2, block_bytes=16384, num_warps=1),
    "cpu": CopyConfig(num_programs=1, rows=64, block_bytes=4096, num_warps=1),
}
# Device-to-device copies (gather/scatter on one device) want the whole device.
_DEVICE_COPY = {
    "cuda": CopyConfig(num_programs=2112, rows=16, block_bytes=1024, num_warps=16),
    "rocm": CopyConfig(num_programs=2112, rows=16, block_bytes=1024, num_warps=16),
}


def default_config(platform: str = "cpu", crosses_link: bool = True) -> CopyConfig:
    """The shipped configuration for ``platform`` ("cuda", "rocm", "npu", "cpu")."""
    if not crosses_link and platform in _DEVICE_COPY:
        return _DEVICE_COPY[platform]
    return _DEFAULTS.get(platform, _DEFAULTS["cpu"])
