"""kvtier.bench: throughput of kvtier's transfers against the link ceiling and the
baselines engines use today, measured in one run (kernel-only device time, host time per
call beside it), the host-side cost of a call, and what a transfer costs a concurrent
GEMM (`interference`).

`kvtier bench` (cli/bench_cmd.py) drives it; `run_sweep` measures, `report` prints,
writes JSON and plots, `results_readme` writes a hardware run's README. On a CPU it runs a small smoke sweep whose figures are not
hardware figures (and says so).
"""
from .sweep import FULL, HARDWARE, SMOKE, Grid, Sweep
from .runner import run_sweep

__all__ = ["Grid", "Sweep", "SMOKE", "HARDWARE", "FULL", "run_sweep"]
