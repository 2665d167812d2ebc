"""Pool points: the transfer as an engine makes it, through kvtier's pools.

The workload's pools are the ones the autotuner times (`kvtier.bench.pools`):
device tensors adopted by an MHA (K, V) or MLA (one row) device pool and a `HostPool`
in the workload's layout. Backup and loads go through HiCache's method names with the
configuration the pools look up and the strategy asked for ("kernel" or "dma"); gather
and scatter are the device pool's own (gather returns a new buffer per call, as engines
use it).
"""
from __future__ import annotations

from .kvtier_engine import config_for
from .probe import LaunchProbe, NoKernel
from .workload import Prepared, Workload


def prepare(w: Workload, op: str, *, strategy: str = "kernel", num_programs=None) -> Prepared:
    """The pools' call for ``op``; across the link with ``strategy`` forced and the grid
    capped at ``num_programs`` (None: the looked-up configuration's)."""
    t = w.call(op)
    fn = t.runner(config_for(w, op, num_programs, strategy=strategy) if t.crosses_link else None)
    return Prepared(fn, programs=_programs(fn), written=t.written if t.op.name == "gather" else None)


def _programs(fn):
    """Largest grid the call launches (a dry run: nothing is copied)."""
    try:
        with LaunchProbe() as probe:
            fn()
        return probe.programs()
    except NoKernel:
        return None
