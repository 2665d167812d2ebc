"""The configurations the autotuner times, per platform and operation.

Spaces are data in each platform's record (`kvtier.platforms`): the values each launch
parameter may take. Candidates are the product of those values, capped by the number of
programs the user lets a transfer take from the model, with duplicates (settings the
launcher would clamp to the same kernel) and tiles that cannot fit removed. The shipped
default is always a candidate, so tuning can only keep it or find better.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import List, Optional

import kvtier.platforms as platforms
from kvtier.config import STRATEGIES, CopyConfig, Space
from kvtier.errors import fail

from .key import DeviceId

MAX_PROGRAMS_ENV = "KVTIER_MAX_PROGRAMS"


def default_max_programs(device: DeviceId, crosses_link: bool) -> int:
    """Programs one transfer may take, unless the user sets a cap (``KVTIER_MAX_PROGRAMS``
    or ``--max-programs``); otherwise the platform's rule (a link is saturated by a few
    programs; device-local copies may take the whole device)."""
    cap = max_programs_from_env()
    if cap is not None:
        return cap
    return platforms.get(device.platform).max_programs(device.units, crosses_link)


def max_programs_from_env() -> Optional[int]:
    """``KVTIER_MAX_PROGRAMS`` (None when unset or empty); anything but a positive int
    raises `KvtierError` naming it."""
    env = os.environ.get(MAX_PROGRAMS_ENV)
    if not env:
        return None
    try:
        cap = int(env)
    except ValueError:
        cap = 0
    if cap < 1:
        raise fail(MAX_PROGRAMS_ENV, env, "must be a positive int")
    return cap


def program_counts(cap: int) -> List[int]:
    """Powers of two below ``cap``, and ``cap`` itself."""
    out, p = [], 1
    while p < cap:
        out.append(p)
        p *= 2
    return out + [cap]


def strategies(device: DeviceId, crosses_link: bool) -> tuple:
    """Device-local copies are kernels; across the link both strategies are timed (the
    tuning workload makes its host memory reachable by kernels, as pools can)."""
    return STRATEGIES if crosses_link else ("kernel",)


def space_for(device: DeviceId, quick: bool = False) -> Space:
    return platforms.get(device.platform).tuning_space(quick, ub_bytes=device.ub_bytes, units=device.units)


def candidates(device: DeviceId, *, chunk_bytes: int, crosses_link: bool,
               max_programs: Optional[int] = None, quick: bool = False) -> List[CopyConfig]:
    """Every configuration worth timing for rows made of ``chunk_bytes`` chunks, the
    platform's shipped default first."""
    cap = max_programs or default_max_programs(device, crosses_link)
    space = space_for(device, quick)
    default = platforms.get(device.platform).default_config(crosses_link)
    widest = 1 << (max(chunk_bytes, 1).bit_length() - 1)   # the launcher's block clamp
    programs = program_counts(cap)
    out, seen = [], set()

    def add(cfg: CopyConfig) -> None:
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)

    for strategy in strategies(device, crosses_link):
        # The shipped default as the launcher would run it (block clamped to the row), within
        # a user's program cap; its stages and tile bytes as shipped.
        add(replace(default, num_programs=min(default.num_programs, cap) if max_programs else default.num_programs,
                    block_bytes=min(default.block_bytes, widest), strategy=strategy))
        # A dma transfer's gather and copies run with their own settings (`pool/dma.py`);
        # its program count reaches only the rare fill after a bad index check, so one
        # dma candidate per tile is enough.
        for num_programs in (programs if strategy == "kernel" else programs[-1:]):
            for tile in _tiles(space, widest, strategy, default):
                add(CopyConfig(num_programs=num_programs, strategy=strategy, **tile))
    return out


def _tiles(space: Space, widest: int, strategy: str, default: CopyConfig):
    """(rows, block_bytes, num_warps, stages, tile_bytes) choices. A tile is ``rows`` rows
    (tile_bytes 0) or sized in bytes (rows the space's fewest, raised by the launcher to
    fill tile_bytes); stages - 1 tiles wait in shared memory, within the space's
    stage_limit. The dma strategy's tile is the platform default (its gather runs with
    the gather op's own configuration)."""
    if strategy == "dma":
        yield dict(rows=default.rows, block_bytes=min(default.block_bytes, widest), num_warps=default.num_warps,
                   stages=default.stages, tile_bytes=default.tile_bytes)
        return
    shapes = [(rows, 0) for rows in space.rows] + [(space.rows[0], t) for t in space.tile_bytes if t]
    for rows, tile_bytes in shapes:
        for block in sorted({min(b, widest) for b in space.block_bytes}):
            tile = max(rows * block, tile_bytes)
            if tile > space.tile_limit:
                continue
            for warps in space.num_warps:
                # More warps than the tile feeds with 16 bytes per thread only idle threads.
                if space.warp and warps > space.num_warps[0] and tile < warps * space.warp * 16:
                    continue
                for stages in space.stages:
                    if space.stage_limit and (stages - 1) * tile > space.stage_limit:
                        continue
                    yield dict(rows=rows, block_bytes=block, num_warps=warps, stages=stages,
                               tile_bytes=tile_bytes)
