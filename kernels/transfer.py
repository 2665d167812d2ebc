"""Prepared transfers: the one way from a caller to the row-copy kernel.

A `Transfer` is a copy between fixed buffers, worked out once by whoever owns those
buffers (a host pool for each device pool it serves, an adapter for each buffer set an
engine registers, a call of the bare API for itself): its copies (`Copy`: a map pair over
a layer range), the checks of its index lists, the watch of the tensors its maps rest
on, and, per size class of the lists it is called with, its launches with their
configurations and both sides' addresses. `Transfer.launch(src_indices, dst_indices)`
then checks the storage watch and enqueues the launches, with the in-kernel index check
(`kvtier.kernels.index_check`); nothing else runs per call.

What a transfer resolves per size class (`Steps`: the power of two at or above the index
count) depends on its owner's configuration choice (`resolve`, e.g. the tuned
configuration: `kvtier.pool.tuning`) and is made again when the tuning epoch its owner
gives (``epoch``, a one-element list) moves on. A step may run another strategy than the
kernel (the pools' ``dma``): its owner's ``bulk`` makes the callable that moves it.

`copy_rows` is the bare API's call: a transfer made for that call alone, kept nowhere.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from kvtier import caches
from kvtier.config import CopyConfig
from kvtier.errors import fail

from . import faults, launcher
from .index_check import CHECKS_OFF, Checks, env_value, check_launch, check_on_host, checks_on
from .launcher import BY_VERDICT, INLINE, UNCHECKED, CopyLaunch, copy_launch, direct_launches, runner_for
from .rowmap import RowMap
from .storage_watch import Watch, check_storage, watch
from .validate import check_copy

log = logging.getLogger("kvtier")
DEBUG = logging.DEBUG
_DATA_PTR = torch.Tensor.data_ptr
SIZE_CLASSES = 64           # index counts up to 2**63


class Copy(NamedTuple):
    """One copy of a transfer: for every component c and layer l < ``num_layers``,
    ``dst[c, dst_layer + l, dst_indices[j]] = src[c, src_layer + l, src_indices[j]]``;
    ``by_page``: the lists are whole pages, moved as one row each where both sides store
    a page contiguously."""

    src: RowMap
    dst: RowMap
    src_layer: int
    dst_layer: int
    num_layers: int
    by_page: bool = False


class Step(NamedTuple):
    """One copy of a transfer resolved for a size class: its configuration and strategy,
    and either its kernel launch with both sides' addresses or (another strategy) the
    mover its owner made for it (``bulk``): ``bulk.host_side(host_list, checked)`` works
    out on the host what it moves (raising for a bad host list before any byte of the
    call moves; ``checked``: the values are to be checked), then ``bulk(si, di, that,
    verdict)`` enqueues it behind the call's check launch's ``verdict`` (None: none)."""

    copy: Copy
    config: CopyConfig
    strategy: str
    launch: Optional[CopyLaunch]
    addresses: tuple
    bulk: Optional[Callable]


class Steps:
    """A transfer's steps for one size class, resolved under one tuning epoch: all of
    them, the kernel ones' launches and addresses (in step order), the bulk ones, and
    the only launch where there is exactly one (the layer loop's usual call)."""

    __slots__ = ("epoch", "all", "launches", "addresses", "bulk", "single")

    def __init__(self, epoch: int, steps: Sequence[Step]):
        self.epoch, self.all = epoch, tuple(steps)
        kernel = [s for s in steps if s.launch is not None]
        self.launches = tuple(s.launch for s in kernel)
        self.addresses = tuple(s.addresses for s in kernel)
        self.bulk = tuple(s for s in steps if s.launch is None)
        self.single = self.launches[0] if len(kernel) == 1 and not self.bulk else None


def default_resolve(copy: Copy, n: int) -> Tuple[CopyConfig, str]:
    """The platform's shipped configuration, the kernel strategy (the bare API's choice)."""
    return None, "kernel"


caches.declare("kernels.transfer.Transfer.size_classes", key="size class of the index count (power of two)",
               value="Steps: each copy's configuration, strategy, launch and addresses, under one tuning epoch",
               bound=f"{SIZE_CLASSES} per Transfer", rule="the owner's tuning epoch moves on (resolved again)",
               stale="not happen: the storage watch refuses a call whose tensors moved")

_NO_EPOCH = [0]
_NO_GRIDS = (0,) * 64        # (0: the launch works its programs out)


class Transfer:
    """A prepared copy between fixed buffers (see the module doc).

    copies: the `Copy` list; components of a copy share its launches.
    device: where the copies run (the maps' accelerator, else the CPU).
    checks: what the index lists must satisfy (`Checks`); ``check``: None follows
        ``KVTIER_CHECK`` per call, False skips the value checks.
    skip_negative: pairs holding a negative index are skipped (the engines' convention).
        A side whose address tables are an engine's (``RowMap.table_trusted`` False) has
        each entry a launch reads checked by that launch.
    resolve: ``(copy, n) -> (config, strategy)`` for a size class of ``n`` (None config:
        the platform default); ``bulk(i, config, strategy)`` makes the mover of copy ``i``
        where its strategy is not the kernel.
    epoch: the owner's tuning epoch (a one-element list): steps resolved under an older
        one are resolved again.
    watched: whether `launch` compares the watch of the maps' tensors first (a batch plan,
        checked when it was made, launches without it).
    call_side: 0 or 1 where that side of every copy is a buffer each call brings (a
        gather's output, a scatter's input): its maps are templates of the buffers'
        geometry, holding no tensor, and `launch` takes the buffers (one per copy).
    op: the operation for the launch log; ``strategy``: the strategy its lines name where
        the transfer is part of another's (the dma path's staging copies), else each
        step's own.
    """

    def __init__(self, copies: Sequence[Copy], *, device: torch.device, checks: Checks,
                 check: Optional[bool] = None, skip_negative: bool = False, resolve: Callable = default_resolve, bulk: Optional[Callable] = None, epoch: list = _NO_EPOCH,
                 watched: bool = True, call_side: Optional[int] = None, op=None, strategy: Optional[str] = None):
        self.copies = tuple(copies)
        self.device, self.checks, self.check = device, checks, check
        self.skip_negative = bool(skip_negative)
        self.whole = (checks.src_page, checks.dst_page)
        self.resolve, self.make_bulk, self.epoch, self.op = resolve, bulk, epoch, op
        self.call_side, self.log_strategy = call_side, strategy
        self.runner = runner_for(device.type)
        w = Watch((), (), ())
        for c in self.copies:
            w = w + watch(c.src, c.src_layer, c.num_layers) + watch(c.dst, c.dst_layer, c.num_layers)
        self.watch = w if watched and w.tensors else None
        self.size_classes: List[Optional[Steps]] = [None] * SIZE_CLASSES

    # ------------------------------------------------------------------ resolution
    def steps(self, n: int) -> Steps:
        """The steps for ``n`` index pairs (``n`` > 0), resolved once per size class and
        tuning epoch."""
        k = (n - 1).bit_length()
        steps = self.size_classes[k]
        if steps is None or steps.epoch != self.epoch[0]:
            steps = self.size_classes[k] = self._resolve(n)
        return steps

    def _resolve(self, n: int) -> Steps:
        epoch, out = self.epoch[0], []
        for i, c in enumerate(self.copies):
            config, strategy = self.resolve(c, n)
            if strategy != "kernel":
                out.append(Step(c, config, strategy, None, (), self.make_bulk(i, config, strategy)))
                continue
            launch = copy_launch(c.src, c.dst, src_layer=c.src_layer, dst_layer=c.dst_layer,
                                 num_layers=c.num_layers, by_page=c.by_page, config=config, device=self.device,
                                 n_rows=n, skip_negative=self.skip_negative, whole=self.whole,
                                 tables=(not c.src.table_trusted, not c.dst.table_trusted))
            out.append(Step(c, launch.config, strategy, launch, launch.addresses(c.src, c.dst), None))
        return Steps(epoch, out)

    # ------------------------------------------------------------------ the call
    def launch(self, si: torch.Tensor, di: torch.Tensor, host_list: Optional[torch.Tensor] = None,
               buffers: Optional[Sequence[torch.Tensor]] = None, check: Optional[bool] = None) -> None:
        """Enqueue the transfer at index lists ``si``, ``di`` (shapes checked by the caller:
        1-D int32/int64 on the device, equal counts), all of it or none: the watched
        tensors must be where the maps were built, a failure an earlier call of this thread
        left is raised first, and every launch checks the lists (inline where the call is
        one launch of few programs, else behind one check launch whose verdict every
        launch reads). ``host_list``: the host list on the host, for bulk steps;
        ``buffers``: the call side's buffers (``call_side``), checked by the caller;
        ``check``: this call's value-check setting (None: the transfer's own)."""
        n = si.numel()
        if not n:
            faults.raise_pending()
            return
        k = (n - 1).bit_length()
        steps = self.size_classes[k]
        if steps is None or steps.epoch != self.epoch[0]:
            steps = self.size_classes[k] = self._resolve(n)
        w = self.watch
        if w is not None and (w.lists is not None or tuple(map(_DATA_PTR, w.tensors)) != w.ptrs):
            check_storage(w)
        record = faults.call_record(self.device)
        if check is None:
            check = self.check
        checks = self.checks if (check if check is not None else env_value() != CHECKS_OFF) else None
        if checks is not None and checks.paged:
            checks.count(n)
        if log.isEnabledFor(DEBUG):
            self._log(steps, n)
        if self.runner != "kernel":
            return self._reference(si, di, checks, buffers)
        addresses = steps.addresses if buffers is None else self._rebased(steps.addresses, buffers)
        b = steps.single
        if b is not None:
            if checks is None:
                b(si, di, addresses[0], UNCHECKED, si)
                return
            rows = n // b.page if b.page else n
            grid = min(b.config.num_programs, b.items * -(-rows // b.rows)) or 1
            if grid <= b.inline_programs:
                b(si, di, addresses[0], INLINE, record.tensor, checks, grid)
                if b.on_cpu and record.view[0]:       # the check has run already
                    faults.raise_pending(this_call=True)
                return
        bulk = [s.bulk.host_side(host_list, checks is not None) for s in steps.bulk] if steps.bulk else ()
        if checks is None:
            verdict = None
            for b, a in zip(steps.launches, addresses):
                b(si, di, a, UNCHECKED, si)
        else:
            verdict = check_launch(self.device, checks, si, di, steps.launches, addresses, record,
                                   direct=direct_launches())
            for b, a in zip(steps.launches, addresses):
                b(si, di, a, BY_VERDICT, verdict)
        for s, moved in zip(steps.bulk, bulk):
            s.bulk(si, di, moved, verdict)
        if self.device.type == "cpu" and record.view[0]:
            faults.raise_pending(this_call=True)

    def launch_checked(self, steps: Steps, si: torch.Tensor, di: torch.Tensor, host_list, verdict,
                       checked: bool, buffers: Optional[Sequence[torch.Tensor]] = None,
                       grids: Optional[Sequence[int]] = None) -> None:
        """Enqueue ``steps`` (of this transfer) at lists checked already: ``verdict`` the
        words a check launch of theirs wrote (every launch moves nothing unless it is good),
        or None where they were checked on the host (``checked``) or checks are off. What
        a batch plan and a call of several steps run; ``grids``: each launch's programs,
        where the caller worked them out for this count (a batch plan does, once)."""
        if log.isEnabledFor(DEBUG):
            self._log(steps, si.numel())
        if self.runner != "kernel":
            return self._reference(si, di, None, buffers, verdict)
        bulk = [s.bulk.host_side(host_list, checked) for s in steps.bulk] if steps.bulk else ()
        addresses = steps.addresses if buffers is None else self._rebased(steps.addresses, buffers)
        mode, word = (BY_VERDICT, verdict) if verdict is not None else (UNCHECKED, si)
        for b, a, g in zip(steps.launches, addresses, grids or _NO_GRIDS):
            b(si, di, a, mode, word, None, g)
        for s, moved in zip(steps.bulk, bulk):
            s.bulk(si, di, moved, verdict)

    def _rebased(self, addresses: tuple, buffers) -> list:
        """``addresses`` with the call side's base taken from each copy's buffer."""
        out, at = [], 4 * self.call_side
        for a, buf in zip(addresses, buffers):
            out.append((*a[:at], buf.data_ptr(), *a[at + 1:]))
        return out

    def _reference(self, si, di, checks, buffers=None, verdict=None) -> None:
        """The call on the torch reference (no Triton, or CPU tensors without the
        interpreter): the lists checked on the host first, then every copy (none where
        the ``verdict`` a check of theirs wrote is bad)."""
        if checks is not None:
            check_on_host(checks, si, di)
        if verdict is not None and int(verdict[0]):
            return
        for i, c in enumerate(self.copies):
            src, dst = c.src, c.dst
            if buffers is not None:
                src, dst = (rebased(src, buffers[i]), dst) if self.call_side == 0 else (src, rebased(dst, buffers[i]))
            page = src.page_size if c.by_page and src.page_contiguous and dst.page_contiguous else 0
            launcher.reference_copy(si, di, src, dst, c.src_layer, c.dst_layer, c.num_layers,
                                    page if page > 1 else 0, self.skip_negative, self.runner)

    def _log(self, steps: Steps, n: int) -> None:
        """One DEBUG line per kernel launch (a dma step's staging copies log their own)."""
        for s in steps.all:
            if s.launch is not None:
                log_launch(self.op, self.log_strategy or s.strategy, s.config, n, n * s.launch.op_bytes)


def rebased(template: RowMap, buf: torch.Tensor) -> RowMap:
    """A stacked map of ``template``'s geometry over buffer ``buf`` (its first byte)."""
    p = buf.data_ptr()
    return replace(template, base=p, segments=((buf, p),), built_ptrs=None)


def log_launch(op, strategy: str, config, rows: int, nbytes: int) -> None:
    """The launch log: one DEBUG line on the ``kvtier`` logger per launch."""
    name, scope = (op.name, op.scope) if op is not None else ("copy", "all")
    log.debug("launch op=%s scope=%s strategy=%s config=%s rows=%d bytes=%d", name, scope, strategy,
              config.to_dict() if config is not None else None, rows, nbytes)


# ---------------------------------------------------------------------- the bare API
def copy_rows(src: RowMap, src_indices: torch.Tensor, dst: RowMap, dst_indices: torch.Tensor,
              *, src_layer: int = 0, dst_layer: int = 0, num_layers: Optional[int] = None,
              by_page: bool = False, config: Optional[CopyConfig] = None, check: Optional[bool] = None,
              skip_negative: bool = False) -> None:
    """Copy rows: for every component c and layer l < num_layers,
    ``dst[c, dst_layer + l, dst_indices[j]] = src[c, src_layer + l, src_indices[j]]``.

    Indices are token slots (int32/int64, 1-D, any strides, on the device where the copy
    runs: the maps' accelerator, else the CPU). ``by_page=True`` asserts that the indices
    are whole pages (runs of page_size slots from a page boundary, checked): where both
    sides store a page contiguously, each page then moves as one row. ``num_layers``
    defaults to all layers both maps have from the start layers. ``skip_negative``: a
    pair holding a negative index is skipped (the engines' convention) instead of refused.

    Every launch checks the index values it copies with before it moves a byte (range,
    whole pages; `kvtier.kernels.index_check`), on the device, without a sync: a bad
    list moves nothing and raises `KvtierError` here where the check has run already
    (the CPU), else at this thread's next call or `synchronize()`. ``check=False`` (or
    ``KVTIER_CHECK=0``) skips the value checks; shape checks always run. ``config`` sets
    the launch configuration (`CopyConfig`), else the platform default applies.

    The call prepares a `Transfer` for these maps and keeps nothing: a caller that copies
    between the same maps again holds a `Transfer` of its own.
    """
    device, num_layers = check_copy(src, src_indices, dst, dst_indices, src_layer, dst_layer,
                                    num_layers, by_page, check_values=False)
    if config is not None and not isinstance(config, CopyConfig):
        raise fail("config", type(config).__name__, "must be a kvtier CopyConfig (or None for the default)")
    if src_indices.numel() == 0 or num_layers == 0:
        return
    page = (src.page_size, dst.page_size) if by_page else (1, 1)
    checks = Checks(("src_indices", src.num_rows, page[0]), ("dst_indices", dst.num_rows, page[1]),
                    skip_negative)
    Transfer([Copy(src, dst, src_layer, dst_layer, num_layers, by_page)], device=device, checks=checks,
             check=checks_on(check), skip_negative=skip_negative,
             resolve=lambda c, n: (config, "kernel")).launch(src_indices, dst_indices)
