"""The record every platform fills in: what differs between CUDA, ROCm, Ascend and the CPU,
as data and a few functions, so that no other module branches on a platform's name.

One module per platform family builds its records (`cuda`: CUDA and ROCm, `ascend`,
`cpu`); `kvtier.platforms` keeps the registry and `platform_of(device)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from kvtier.config import CopyConfig, Space

# (warmup calls, repeats) -> timer(fn, **_) -> seconds for one call of fn
TimerFactory = Callable[[int, int], Callable[..., float]]


class PlatformUnavailable(RuntimeError):
    """The platform asked for cannot be used here; the message says why."""


def _pinned_address(t) -> Optional[int]:
    """UVA: pinned host memory is addressed by kernels at its host address."""
    return t.data_ptr() if t.is_pinned() else None


def _pinned_reaches(m) -> bool:
    """UVA: a kernel addresses pinned host memory at its host address."""
    return all(t.is_pinned() for t, _ in m.segments)


@dataclass(frozen=True)
class Platform:
    """One accelerator family as kvtier sees it.

    name, device_type: "cuda" / "rocm" / "npu" / "cpu" and the torch device type.
    link_config, device_config: shipped launch defaults across the device-host link and
        on one device (gather, scatter), until the autotuner measures the device.
    space, quick_space: what the autotuner searches (the defaults are always added).
    max_programs: ``(compute_units, crosses_link) -> int``: programs one transfer may take
        unless the user caps it (a link is saturated by a few programs; the rest belong
        to the model).
    warp_threads: GPU threads per warp (0: no warps); the launcher sizes tiles from it.
    min_rows, min_piece_bytes: launch floors (rows per tile; narrowest row piece).
    timer: device timer factory (autotune and bench).
    dma_runtime: ``() -> (Runtime or None, why not)``: the runtime's bulk copy calls for
        the dma strategy (`kvtier.platforms.runtime_libs.Runtime`).
    kernel_reaches: ``(host RowMap) -> bool``: whether a kernel can address that host memory.
    host_address: ``(host tensor) -> address or None``: where a kernel addresses its first
        byte (None: out of a kernel's reach).
    kernel_view: ``(RowMap, device) -> RowMap``: a map as a kernel on ``device`` addresses
        it (Ascend: registered host memory through its device addresses).
    unreachable: why a host map is out of a kernel's reach, and what to do.
    register_host: ``(tensor) -> finalizer or None``: make a host buffer reachable by
        kernels (Ascend); None where pinned memory already is.
    codegen_target: ``(arch) -> target or None`` for `kvtier codegen` / spill pruning.
    properties: ``(device, torch properties) -> dict`` of platform-specific figures.
    fit_space: ``(space, device figures) -> space`` bounded by the device (Ascend: its
        Unified Buffer).
    inline_check_programs: the most programs a copy launch may have and still check its
        index lists inline (each program reads them whole before it copies); a launch
        with more, or a call of several launches, checks them in a check launch of its
        own first (`kvtier.kernels.index_check`). 0: never inline.
    """

    name: str
    device_type: str
    link_config: CopyConfig
    device_config: CopyConfig
    space: Space
    quick_space: Space
    max_programs: Callable[[int, bool], int]
    timer: TimerFactory
    warp_threads: int = 0
    min_rows: int = 1
    min_piece_bytes: int = 1
    dma_runtime: Callable[[], tuple] = lambda: (None, "")
    kernel_reaches: Callable = _pinned_reaches
    host_address: Callable = _pinned_address
    kernel_view: Callable = lambda m, device: m
    unreachable: str = "host memory is not pinned, so the device cannot address it; pin it or use the dma strategy"
    register_host: Optional[Callable] = None
    codegen_target: Callable[[str], Optional[str]] = field(default=lambda arch: None)
    properties: Callable[[torch.device, object], dict] = field(default=lambda device, p: {})
    fit_space: Callable[[Space, dict], Space] = field(default=lambda space, figures: space)
    inline_check_programs: int = 64

    def default_config(self, crosses_link: bool = True) -> CopyConfig:
        return self.link_config if crosses_link else self.device_config

    def tuning_space(self, quick: bool = False, **device_figures) -> Space:
        return self.fit_space(self.quick_space if quick else self.space, device_figures)
