"""The configurations the autotuner times, per platform and operation.

Spaces are data: one table entry per platform lists the values each launch parameter
may take. Candidates are the product of those values, capped by the number of programs
the user lets a transfer take from the model, with duplicates (settings the launcher
would clamp to the same kernel) and tiles that cannot fit removed.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import List, Optional

from kvtier.kernels.config import CopyConfig, default_config

from .key import DeviceId

MAX_PROGRAMS_ENV = "KVTIER_MAX_PROGRAMS"


@dataclass(frozen=True)
class Space:
    """Values per launch parameter; ``tile_limit`` bounds rows x block bytes (registers
    on GPUs, the Unified Buffer on Ascend); ``warp`` is threads per warp (0: no warps)."""
    rows: tuple
    block_bytes: tuple
    num_warps: tuple
    tile_limit: int
    warp: int


# Full and quick spaces per platform.
#  - cuda/rocm: a tile is held in registers; 16 KiB per program at most.
#  - npu: no warps; wide tiles within half the Unified Buffer (double buffering), set
#    from the device's figure by `space_for` (96 KiB: half the smallest, 192 KB).
#  - cpu: the interpreter runs programs in turn; few wide tiles keep the search short.
_SPACES = {
    "cuda": Space((1, 2, 4, 8, 16), (256, 512, 1024, 2048, 4096), (1, 2, 4, 8), 16384, 32),
    "rocm": Space((1, 2, 4, 8, 16), (256, 512, 1024, 2048, 4096), (1, 2, 4, 8), 16384, 64),
    "npu": Space((1, 2, 4, 8), (4096, 8192, 16384, 32768), (1,), 96 * 1024, 0),
    "cpu": Space((16, 64), (1024, 4096), (1,), 1 << 20, 0),
}
_QUICK = {
    "cuda": Space((1, 4, 16), (512, 2048), (4, 8), 16384, 32),
    "rocm": Space((1, 4, 16), (512, 2048), (4, 8), 16384, 64),
    "npu": Space((1, 4), (8192, 16384), (1,), 96 * 1024, 0),
    "cpu": Space((16,), (1024, 4096), (1,), 1 << 20, 0),
}


def default_max_programs(device: DeviceId, crosses_link: bool) -> int:
    """Programs one transfer may take, unless the user sets a cap (``KVTIER_MAX_PROGRAMS``
    or ``--max-programs``): a link is saturated by a few programs, so link transfers take
    an eighth of the compute units (at least 2); device-local copies may take them all.
    Ascend launches about one program per vector core in every case."""
    env = os.environ.get(MAX_PROGRAMS_ENV)
    if env:
        return max(1, int(env))
    units = device.units or default_config(device.platform, crosses_link).num_programs
    if device.platform in ("cuda", "rocm"):
        return max(2, units // 8) if crosses_link else units
    if device.platform == "npu":
        return units
    return 2   # the interpreter: more programs only add Python overhead


def program_counts(cap: int) -> List[int]:
    """Powers of two below ``cap``, and ``cap`` itself."""
    out, p = [], 1
    while p < cap:
        out.append(p)
        p *= 2
    return out + [cap]


def strategies(device: DeviceId, crosses_link: bool) -> tuple:
    """Device-local copies are kernels. Across the link both are timed, except on Ascend,
    where a kernel can reach only registered host memory, which pools do not allocate."""
    if not crosses_link:
        return ("kernel",)
    if device.platform == "npu":
        return ("dma",)
    return ("kernel", "dma")


def space_for(device: DeviceId, quick: bool = False) -> Space:
    table = _QUICK if quick else _SPACES
    space = table.get(device.platform, table["cpu"])
    if device.platform == "npu" and device.ub_bytes:
        from kvtier.platforms import npu_launch_limits
        tile = npu_launch_limits(props={"ub_bytes": device.ub_bytes, "compute_units": device.units})
        space = dataclasses.replace(space, tile_limit=tile["max_tile_bytes"])
    return space


def candidates(device: DeviceId, *, chunk_bytes: int, crosses_link: bool,
               max_programs: Optional[int] = None, quick: bool = False) -> List[CopyConfig]:
    """Every configuration worth timing for rows made of ``chunk_bytes`` chunks."""
    cap = max_programs or default_max_programs(device, crosses_link)
    space = space_for(device, quick)
    widest = 1 << (max(chunk_bytes, 1).bit_length() - 1)   # the launcher's block clamp
    programs = program_counts(cap)
    out, seen = [], set()
    for strategy in strategies(device, crosses_link):
        for num_programs in programs:
            for tile in _tiles(space, widest, strategy, device.platform):
                cfg = CopyConfig(num_programs=num_programs, strategy=strategy, **tile)
                if cfg not in seen:
                    seen.add(cfg)
                    out.append(cfg)
    return out


def _tiles(space: Space, widest: int, strategy: str, platform: str):
    """(rows, block_bytes, num_warps) choices. The dma strategy's kernel is a device-local
    gather into staging; its tile is the platform default (programs are still searched)."""
    if strategy == "dma":
        d = default_config(platform, crosses_link=False)
        yield dict(rows=d.rows, block_bytes=min(d.block_bytes, widest), num_warps=d.num_warps)
        return
    for rows in space.rows:
        for block in sorted({min(b, widest) for b in space.block_bytes}):
            if rows * block > space.tile_limit:
                continue
            for warps in space.num_warps:
                # More warps than the tile feeds with 16 bytes per thread only idle threads.
                if space.warp and warps > space.num_warps[0] and rows * block < warps * space.warp * 16:
                    continue
                yield dict(rows=rows, block_bytes=block, num_warps=warps)
