"""Pruning before timing: configurations whose compiled kernel spills registers are
dropped (a spilling copy is slow and its timing would only confirm it).

The compiler's report comes from `kvtier.kernels.codegen.compile_report`; it needs
community Triton and a named target, so `codegen_report` returns None wherever it
cannot run, and the configuration is then kept.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

from kvtier.config import CopyConfig

ReportFn = Callable[..., object]


def codegen_target(device) -> Optional[str]:
    """The codegen target for a device (a `key.DeviceId`), or None where none exists."""
    import kvtier.platforms as platforms
    return platforms.get(device.platform).codegen_target(device.arch)


def codegen_report(target: str, *, config: CopyConfig, row_bytes: int, **shape):
    """The codegen report for one configuration, or None when it is unavailable."""
    try:
        from kvtier.kernels.codegen import compile_report
        rep = compile_report(target, config=config, row_bytes=row_bytes, **shape)
    except Exception:
        return None
    return None if getattr(rep, "error", None) else rep


def prune_spilling(configs: Iterable[CopyConfig], *, target: Optional[str], row_bytes: int,
                   report: ReportFn = codegen_report, **shape) -> Tuple[List[CopyConfig], List[CopyConfig]]:
    """(kept, pruned): a configuration is pruned when its report says spills > 0.

    One compile per distinct kernel (the program count is a launch setting, not part of
    the compiled code). Without a target nothing is pruned."""
    configs = list(configs)
    if not target:
        return configs, []
    spills: Dict[tuple, bool] = {}
    kept, pruned = [], []
    for cfg in configs:
        kernel = (cfg.rows, cfg.block_bytes, cfg.num_warps)
        if kernel not in spills:
            rep = report(target, config=cfg, row_bytes=row_bytes, **shape)
            spills[kernel] = bool(rep is not None and (getattr(rep, "spills", None) or 0) > 0)
        (pruned if spills[kernel] else kept).append(cfg)
    return kept, pruned
