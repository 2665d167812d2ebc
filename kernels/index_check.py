"""Index checks: every launch checks the index values it copies with.

A call's index lists are checked by the device that copies with them, through the same
pointers and strides the copies read, before any byte of the call moves: inline in the
copy launch where the call is one launch of few programs (every program reads the lists
whole, then copies or not), else by a check launch of the call's own, one program whose
verdict every launch of the call reads (`check_launch`; a gather's thousands of
programs would each re-read the lists otherwise, several launches must agree, and
Ascend lowers the inline compares element by element). Nothing about a list's values
is kept between calls, and no verdict is shared between calls, threads or streams
(`kvtier.kernels.faults`). Where Triton cannot run, the torch reference checks the
lists on the host first (`check_on_host`).

What is checked (`Checks`): every index in ``0 <= i < limit`` of its side; where a side
moves whole pages, every run of ``page`` indices one page (a page-boundary start, then
consecutive slots); a negative index passes where the call skips negative pairs (the
engines' convention), else it is refused. Tables an engine made (pointer arrays such as
SGLang's ``k_data_ptrs``) are read by every launch as they are then, and every entry
a launch reads must be a non-null address aligned as the kernel's accesses assume.

``KVTIER_CHECK=0`` turns value checks off process-wide (for engine call sites that
cannot pass ``check=False``); shape, dtype and device checks always run.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Sequence

import torch

from . import direct_launch, faults
from kvtier.errors import fail
from .validate import check_pages_in_range

CHECK_ENV = "KVTIER_CHECK"


def checks_on(check: Optional[bool] = None) -> bool:
    """``check`` where the caller gave it, else the process-wide ``KVTIER_CHECK`` (on),
    read on every call (so a change of the environment applies at once)."""
    return bool(check) if check is not None else env_value() != CHECKS_OFF


def environ_reader():
    """A reader of ``KVTIER_CHECK`` for the hot path: ``os.environ``'s own mapping read by
    its encoded key (what ``os.environ.get`` does, without re-encoding the key per call),
    falling back to ``os.environ.get`` where that mapping is not there."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        key, off = encode(CHECK_ENV), os.environ.encodevalue("0")
        return functools.partial(data.get, key), off     # a C call, no Python frame
    return (lambda: os.environ.get(CHECK_ENV)), "0"


env_value, CHECKS_OFF = environ_reader()


class Checks:
    """What a call's two index lists must satisfy: each side's argument name (as the
    caller named it) and its id in failure records, its exclusive limit and the page size
    its list comes in whole runs of (1: none), whether negative pairs are skipped, and
    the argument ids of each side's engine tables. Made once by whoever owns the lists'
    transfer (`kvtier.kernels.transfer.Transfer`)."""

    __slots__ = ("src_name", "dst_name", "src_arg", "dst_arg", "src_limit", "dst_limit", "src_page", "dst_page",
                 "skip_negative", "src_targ", "dst_targ", "launch_args", "paged")

    def __init__(self, src: tuple, dst: tuple, skip_negative: bool = False,
                 tables: tuple = ("src table", "dst table")):
        self.src_name, self.src_limit, self.src_page = src
        self.dst_name, self.dst_limit, self.dst_page = dst
        self.src_arg, self.dst_arg = faults.arg_id(src[0]), faults.arg_id(dst[0])
        self.src_targ, self.dst_targ = faults.arg_id(tables[0]), faults.arg_id(tables[1])
        self.skip_negative = bool(skip_negative)
        # What an inline-checking launch passes (the row copy's limits and ids, in order).
        self.launch_args = (self.src_limit, self.dst_limit, self.src_arg, self.dst_arg, self.src_targ, self.dst_targ)
        self.paged = self.src_page > 1 or self.dst_page > 1

    def count(self, n: int) -> None:
        """A page-granular list's count must be whole pages (metadata: checked here)."""
        for name, page in ((self.src_name, self.src_page), (self.dst_name, self.dst_page)):
            if n % page:
                raise fail(f"len({name})", n, f"page-granular copy needs a multiple of page_size={page}")


def check_on_host(checks: Checks, si: torch.Tensor, di: torch.Tensor) -> None:
    """Both lists checked on the host (a device list is read there: the reference path
    only), raising `KvtierError` naming the first bad one."""
    for name, idx, limit, page in ((checks.src_name, si, checks.src_limit, checks.src_page),
                                   (checks.dst_name, di, checks.dst_limit, checks.dst_page)):
        check_list_on_host(name, idx, limit, page, checks.skip_negative)


def check_list_on_host(name: str, idx: torch.Tensor, limit: int, page: int, skip_negative: bool) -> None:
    """One list checked on the host (`kvtier.kernels.validate.check_pages_in_range`)."""
    if skip_negative:
        idx = idx[idx >= 0]
    check_pages_in_range(name, idx, limit, page)


def check_launch(device: torch.device, checks: Checks, si: torch.Tensor, di: torch.Tensor,
                 bounds: Sequence = (), sides: Sequence[tuple] = (),
                 record: Optional[faults.Record] = None, verdict: Optional[torch.Tensor] = None,
                 two: bool = True, direct: bool = False) -> torch.Tensor:
    """Launch the check of one call's lists (and of the engine tables its ``bounds`` read
    through ``sides``) on ``device``'s current stream: returns this thread's verdict
    there (or ``verdict``, int32[2] the caller owns: a batch plan's), which the call's copies read
    (word 0) or, for a copy that must run only when the call is refused, word 1.
    ``two=False``: only ``si`` is checked (against the source side's limit and page).
    ``direct``: the check kernel is compiled, and kept for direct launches
    (`kvtier.kernels.launcher.direct_launches`)."""
    words = faults.verdicts(device) if verdict is None else verdict
    record = record or faults.record(device)
    tables = _tables(bounds, sides, (checks.src_targ, checks.dst_targ))
    ta, tb = (tables + [(words, 0, 0), (words, 0, 0)])[:2]
    align = min((b.unit for b in bounds if any(b.check_tables)), default=8)
    args = (si, si.numel(), si.stride(0), checks.src_limit, checks.src_arg,
            di, di.numel(), di.stride(0), checks.dst_limit, checks.dst_arg,
            ta[0], ta[1], ta[2], tb[0], tb[1], tb[2], words, record.tensor,
            checks.src_page, checks.dst_page, two, checks.skip_negative, len(tables), align, 1024)
    kernel = (_CHECK_MODULE or _check_module()).check_indices_jit
    if direct:                  # compiled: kept and launched directly once checked
        _CHECK_LAUNCHES.launch(kernel, 1, args, direct_launch.check_spec(args))
    else:
        direct_launch.through_triton(kernel, 1, args)
    return words


def _tables(bounds, sides, args) -> list:
    """(table span, entries, argument id) of every engine table the copies read, at most
    two: the entries from the first a copy reads to the last."""
    out, seen = [], set()
    for b, s in zip(bounds, sides):
        for which in (0, 1):
            if not b.check_tables[which]:
                continue
            layout = b.layouts[which]
            first_layer = b.layers[which]
            for k, table in enumerate((s[4 * which + 1], s[4 * which + 2])):
                comps = layout.entry_split if k == 0 else layout.num_components - layout.entry_split
                if comps <= 0 or id(table) in seen:
                    continue
                seen.add(id(table))
                start = first_layer * layout.table_layer
                end = (comps - 1) * layout.entry_comp + (first_layer + b.num_layers - 1) * layout.table_layer + 1
                out.append((table[start:end], end - start, args[which]))
    if len(out) > 2:
        raise RuntimeError("internal: a call reads more than two engine tables")
    return out


def _check_module():
    """The check kernel's module, imported on first use (it needs Triton). Launches read
    the kernel from the module each time, so a stand-in put there (a launch probe, a test
    spy) is what runs."""
    global _CHECK_MODULE
    if _CHECK_MODULE is None:
        from . import index_check_kernel
        _CHECK_MODULE = index_check_kernel
    return _CHECK_MODULE


_CHECK_MODULE = None
_CHECK_LAUNCHES = direct_launch.Launches()     # the check's compiled kernels (Triton's default warps)
