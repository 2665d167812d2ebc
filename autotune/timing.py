"""Timers: ``timer(fn, config=...) -> seconds`` for one call of ``fn`` (the median of
repeats after a warm-up), from the platform's record: CUDA events through
triton.testing.do_bench on CUDA and ROCm, torch.npu events on Ascend, the wall clock on
the CPU. Tests pass their own timer; ``config`` tells it what is being timed.
"""
from __future__ import annotations

from typing import Callable

import kvtier.platforms as platforms

Timer = Callable[..., float]


def default_timer(platform: str, warmup: int = 0, repeats: int = 0) -> Timer:
    """The timer for ``platform``. ``warmup``/``repeats`` are call counts (0: the
    timer's default); on CUDA/ROCm do_bench sizes its runs from time budgets instead."""
    return platforms.get(platform).timer(warmup, repeats)
