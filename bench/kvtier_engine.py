"""kvtier points: the transfer as one `kvtier.kernels.copy_rows` call on the workload's
row maps, with the configuration the pools would look up, capped to a program count."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from kvtier.autotune import config_for as lookup
from kvtier.kernels import copy_rows

from .probe import LaunchProbe, NoKernel
from .workload import Prepared, Unsupported, Workload


def config_for(w: Workload, op: str, num_programs: Optional[int] = None, strategy: str = "kernel"):
    """What the pools would look up for this transfer; ``num_programs`` caps its grid."""
    t = w.copy(op)
    cfg = lookup(op, w.device, row_bytes=w.pool_shape.row_bytes, page_size=w.pool_shape.page_size,
                 num_rows=t.src_indices.numel(), num_layers=t.num_layers)
    cfg = replace(cfg, strategy=strategy)
    return replace(cfg, num_programs=num_programs) if num_programs else cfg


def prepare(w: Workload, op: str, *, num_programs: Optional[int] = None, strategy: str = "kernel") -> Prepared:
    if strategy != "kernel":
        raise Unsupported(f"strategy {strategy!r} runs through the pools, not one copy_rows call")
    t = w.copy(op)
    kw = dict(src_layer=t.src_layer, dst_layer=t.dst_layer, num_layers=t.num_layers,
              by_page=w.shape.page_size > 1, config=config_for(w, op, num_programs, strategy))
    programs = None
    try:
        with LaunchProbe() as probe:   # every check once, and the grid it would launch
            copy_rows(t.src, t.src_indices, t.dst, t.dst_indices, **kw)
        programs = probe.programs()
    except NoKernel:                   # no Triton: copies run the torch reference
        copy_rows(t.src, t.src_indices, t.dst, t.dst_indices, **kw)

    def run():
        copy_rows(t.src, t.src_indices, t.dst, t.dst_indices, check=False, **kw)

    return Prepared(run, programs=programs)
