"""Index checks that never wait for the device.

An index list that lives where the copy runs (device indices on a GPU or NPU) is checked
there: one small kernel walks it before the copies, on the same stream, and writes a
verdict word that every program of those copies reads first; a bad list makes the copies
move nothing. The first failure is also written to a record the host reads without a
sync, and the guard that launched the check raises `KvtierError` naming the argument and
the value as soon as it sees it: in the same call where the check has already run (the
CPU interpreter runs kernels at once), else at its next call or at its `synchronize()`. An index list on the host (HiCache's host indices) is checked
on the host at once: reading host memory costs nothing.

Each pool, and the adapters, own one `IndexGuard`. Verdict words are per stream: calls on
one stream are ordered, calls on different streams must not share a word.

``KVTIER_CHECK=0`` turns value checks off process-wide (for engine call sites that cannot
pass ``check=False``); shape, dtype and device checks always run.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import kvtier.platforms as platforms

from . import direct_launch
from .errors import KvtierError, fail
from .index_memo import facts
from .validate import check_pages_in_range

CHECK_ENV = "KVTIER_CHECK"
_REASONS = {1: "negative index", 2: "index out of range for {limit} rows",
            3: "not a whole page: runs of {page} consecutive slots from a page boundary"}


def checks_on(check: Optional[bool] = None) -> bool:
    """``check`` where the caller gave it, else the process-wide ``KVTIER_CHECK`` (on),
    read on every call (so a change of the environment applies at once)."""
    if check is not None:
        return bool(check)
    return _env_value() != _OFF


def _environ_reader():
    """A reader of ``KVTIER_CHECK`` for the hot path: ``os.environ``'s own mapping read by
    its encoded key (what ``os.environ.get`` does, without re-encoding the key per call),
    falling back to ``os.environ.get`` where that mapping is not there."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        key, off = encode(CHECK_ENV), os.environ.encodevalue("0")
        return functools.partial(data.get, key), off     # a C call, no Python frame
    return (lambda: os.environ.get(CHECK_ENV)), "0"


_env_value, _OFF = _environ_reader()


# One index list to check: (argument name, indices, exclusive limit, page size or 1), and
# optionally its `kvtier.kernels.index_memo.facts` where the caller has them already.
IndexList = Tuple


@dataclass
class _Slot:
    verdict: torch.Tensor        # int32 [1] on the device: 0, or the failure code
    record: torch.Tensor         # int64 [4]: code, argument id, position, value
    host_visible: bool           # the record is host memory the kernel writes (no copy needed)
    host: Optional[object] = None    # memoryview of a host-visible record (read per call)
    # What the verdict word holds the answer for: the last check's lists (their index
    # facts, limits, pages) on this slot. A call with the same unchanged index tensors
    # reuses the word instead of checking again (`kvtier.kernels.index_memo`).
    last: Optional[tuple] = None


class IndexGuard:
    """The index checks of one pool or adapter family (see the module doc)."""

    def __init__(self):
        self._slots: Dict[tuple, _Slot] = {}
        self._devices: Dict[int, tuple] = {}        # see _device_facts
        self._cpu: Optional[_Slot] = None
        self._args: List[Tuple[str, int, int]] = []     # argument id -> (name, limit, page)
        self._ids: Dict[Tuple[str, int, int], int] = {}
        self._pair_ids: Dict[tuple, Tuple[int, int]] = {}     # check signature -> both ids
        self._hosts: tuple = ()         # the host-visible records' memoryviews, one per slot
        # Pair plans its owner keeps, under the owner's own keys (`keep_plan`).
        self.plans: Dict[object, tuple] = {}

    # ------------------------------------------------------------------ checking
    def check(self, device: torch.device, lists: Sequence[IndexList], *,
              negatives_skip: bool = False, ticket: Optional[list] = None) -> Optional[torch.Tensor]:
        """Check ``lists`` for a copy on ``device``: host-resident lists here (raising at
        once), device-resident ones on the device. Returns the verdict word the copies
        must read, or None when nothing was left to the device. At most two lists go to
        the device per call. ``ticket``: a list that receives, with a returned word, what
        `holds` asks later to reuse that word's verdict."""
        for h in self._hosts:           # raise_pending, inline: one memoryview read per slot
            if h[0]:
                self.raise_pending()
        # Index lists live on the host or where the copy runs (their callers checked that):
        # those on the compute device are checked there, where the check kernel runs.
        known_device = self._devices.get(id(device))     # kept per device object
        if known_device is None or known_device[0] is not device:
            known_device = self._device_facts(device)
        on_cpu, kernel_runs = known_device[1], known_device[2]
        a = b = None                    # the (at most two) lists left to the device
        for lst in lists:
            idx, page = lst[1], lst[3]
            n = idx.numel()
            if page > 1 and n % page:        # a count is metadata: checked here
                raise fail(f"len({lst[0]})", n, f"page-granular copy needs a multiple of page_size={page}")
            if n == 0:
                continue
            if kernel_runs and idx.is_cpu == on_cpu:
                if a is None:
                    a, na = lst, n
                elif b is None:
                    b, nb = lst, n
                else:
                    raise KvtierError("internal: more than 2 device index lists in one check")
                continue
            arg, limit = lst[0], lst[2]
            known = lst[4] if len(lst) > 4 else facts(idx)
            key = ("host", limit, page, negatives_skip)
            if known is None or key not in known:    # checked once while the tensor is unchanged
                _check_on_host(arg, idx, limit, page, negatives_skip)
                if known is not None:
                    known[key] = True
        if a is None:
            return None
        two = b is not None
        if not two:
            b, nb = a, na
        fa = a[4] if len(a) > 4 else facts(a[1])
        fb = fa if not two else b[4] if len(b) > 4 else facts(b[1])
        signature = (a[0], a[2], a[3], b[0], b[2], b[3], two, negatives_skip)
        return self._on_device(device, known_device, a[1], na, fa, b[1], nb, fb, signature, None, ticket)

    def pair(self, a: Tuple[str, int, int], b: Optional[Tuple[str, int, int]] = None,
             negatives_skip: bool = False) -> tuple:
        """The plan of a check of two lists, ``a`` and ``b`` each (argument name, exclusive
        limit, page size or 1), or of ``a`` alone (``b`` None: `check_pair` is then given
        the one list twice), for a caller that checks such lists on every call
        (`check_pair`): worked out once, it spares each call building the lists'
        description and looking it up."""
        signature = (*a, *(b or a), b is not None, bool(negatives_skip))
        return signature, (self._arg_id(a), self._arg_id(b or a))

    def keep_plan(self, key, a: Tuple[str, int, int], b: Optional[Tuple[str, int, int]] = None,
                  negatives_skip: bool = False) -> tuple:
        """`pair` of ``a`` and ``b``, kept in `plans` under ``key`` (the owner's: a pool
        keys its plans by what sets the limits), where the owner's next calls find it."""
        plan = self.plans[key] = self.pair(a, b, negatives_skip)
        return plan

    def check_pair(self, device: torch.device, plan: tuple, a: torch.Tensor, b: torch.Tensor,
                   fa: Optional[dict] = None, fb: Optional[dict] = None,
                   ticket: Optional[list] = None) -> Optional[torch.Tensor]:
        """`check` of the two lists a `pair` plan describes (``fa`` / ``fb``: their
        `kvtier.kernels.index_memo.facts`, or None). Two non-empty whole-page lists where
        the copy runs go straight to the device check; any other pair takes `check`."""
        for h in self._hosts:           # raise_pending, inline: one memoryview read per slot
            if h[0]:
                self.raise_pending()
        known_device = self._devices.get(id(device))
        if known_device is None or known_device[0] is not device:
            known_device = self._device_facts(device)
        signature, on_cpu = plan[0], known_device[1]
        na, nb = a.numel(), b.numel()
        if not (known_device[2] and na and nb and a.is_cpu == on_cpu and b.is_cpu == on_cpu
                and not na % signature[2] and not nb % signature[5]):
            both = [(signature[0], a, signature[1], signature[2], fa),
                    (signature[3], b, signature[4], signature[5], fb)]
            return self.check(device, both if signature[6] else both[:1], negatives_skip=signature[7], ticket=ticket)
        return self._on_device(device, known_device, a, na, fa, b, nb, fb, signature, plan[1], ticket)

    def _on_device(self, device: torch.device, known_device: tuple, a: torch.Tensor, na: int, fa, b: torch.Tensor,
                   nb: int, fb, signature: tuple, ids: Optional[tuple], ticket: Optional[list]) -> torch.Tensor:
        """The device check of lists ``a`` and ``b`` (the same list twice for one), as
        ``signature`` describes them (names, limits, pages, two, negatives_skip; ``ids``:
        their argument ids where the caller has them): the verdict word, reused where it
        already holds these lists' verdict."""
        slot = (self._cpu or self._cpu_slot(device)) if known_device[1] else self._slot(device)
        last = slot.last
        if last is not None and last[0] is fa and last[1] is fb and last[2] == signature:
            if ticket is not None:
                ticket.append((slot, last))
            return slot.verdict             # the word already holds these lists' verdict
        slot.last = None
        if ids is None:
            ids = self._pair_ids.get(signature)
            if ids is None:
                ids = self._pair_ids[signature] = (self._arg_id(signature[:3]), self._arg_id(signature[3:6]))
        # (compile-time A_PAGE, B_PAGE, TWO, NEG_SKIPS, BLOCK by position: cheaper to pass)
        args = (a, na, signature[1], ids[0], b, nb, signature[4], ids[1], slot.verdict, slot.record,
                signature[2], signature[5], signature[6], signature[7], 1024)
        kernel = (_CHECK_MODULE or _check_module())._check_indices_kernel
        if known_device[3]:         # compiled: kept and launched directly once checked
            _CHECK_LAUNCHES.launch(kernel, 1, args, direct_launch.check_spec(args))
        else:
            kernel[(1,)](*args)
        # Where the check has already run (the interpreter runs kernels at once; a fast
        # device may have), its failure is raised before the copies are enqueued.
        for h in self._hosts:
            if h[0]:
                self.raise_pending(this_call=True)
        if fa is not None and fb is not None:     # inference tensors are checked every time
            slot.last = (fa, fb, signature)
        if ticket is not None:
            ticket.append((slot, slot.last))
        return slot.verdict

    def holds(self, ticket: Optional[tuple]) -> bool:
        """Whether the verdict word of ``ticket`` (what a `check` put in its ``ticket``)
        still holds that check's verdict: no other list was checked on it since, and no
        failure reset it. None (a check that left nothing to the device): always.
        Pending failures are raised first (`raise_pending`)."""
        for h in self._hosts:           # raise_pending, inline: one memoryview read per slot
            if h[0]:
                self.raise_pending()
        if ticket is None:
            return True
        slot, last = ticket
        return last is not None and slot.last is last

    def raise_pending(self, this_call: bool = False) -> None:
        """Raise the first failure a device check has recorded (host memory: no sync).
        ``this_call``: the check just launched has already run (the message says so)."""
        for slot in self._slots.values():
            if slot.host is not None and slot.host[0]:      # a memoryview: reads a Python int
                self._raise(slot, this_call=this_call)

    def synchronize(self, device=None) -> None:
        """Wait for ``device`` and raise any failure its checks recorded (the documented
        check point: after it, every earlier call's verdict is known)."""
        platforms.synchronize(device)
        for slot in self._slots.values():
            record = slot.record if slot.host_visible else slot.record.cpu()
            if int(record[0]) != 0:
                self._raise(slot, record)

    # ------------------------------------------------------------------ internals
    def _raise(self, slot: _Slot, record: Optional[torch.Tensor] = None, this_call: bool = False) -> None:
        code, arg_id, pos, value = (int(v) for v in (record if record is not None else slot.record).tolist())
        slot.record.zero_()
        for s in self._slots.values():      # a failed word is never reused: check afresh
            s.last = None
        name, limit, page = self._args[arg_id]
        why = _REASONS.get(code, f"failed check {code}").format(limit=limit, page=page)
        when = ("nothing was enqueued" if this_call else
                "found on the device after an earlier call was enqueued: that call moved no bytes")
        raise fail(name, value, f"{why} (at position {pos}; {when})")

    def _arg_id(self, key: Tuple[str, int, int]) -> int:
        """The id the check kernel records for the list ``key`` describes (argument name,
        limit, page), by which a failure is named."""
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self._args)
            self._args.append(key)
        return i

    def _device_facts(self, device: torch.device) -> tuple:
        """(device, on the CPU, the check kernel runs there, its compiled kernel is
        launched directly once kept: `kvtier.kernels.direct_launch`), worked out for a
        device object `check` does not know yet and kept per object (reading a
        torch.device's type or hash costs more than the rest of a check)."""
        runs = _runner()(device.type) == "kernel"
        direct = runs and not _compiled_off() and direct_launch.enabled()
        facts_ = self._devices[id(device)] = (device, device.type == "cpu", runs, direct)
        return facts_

    def _cpu_slot(self, device: torch.device) -> _Slot:
        if self._cpu is None:
            self._cpu = self._slot(device)
        return self._cpu

    def _slot(self, device: torch.device) -> _Slot:
        stream = platforms.stream_key(device) if device.type != "cpu" else None
        key = (device, stream)
        slot = self._slots.get(key)
        if slot is None:
            verdict = torch.zeros(1, dtype=torch.int32, device=device)
            record = torch.zeros(4, dtype=torch.int64, pin_memory=device.type != "cpu")
            visible = platforms.host_device_address(record, platforms.platform_of(device)) is not None
            if not visible:
                record = torch.zeros(4, dtype=torch.int64, device=device)
            slot = self._slots[key] = _Slot(verdict, record, visible,
                                            memoryview(record.numpy()) if visible else None)
            if visible:
                self._hosts += (slot.host,)
        return slot


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


def _runner():
    global _RUNNER
    if _RUNNER is None:
        from .copy_rows import _runner as runner
        _RUNNER = runner
    return _RUNNER


_RUNNER = None


def _compiled_off() -> bool:
    """Whether Triton's interpreter runs the kernels here (nothing compiled to keep)."""
    from .copy_rows import interpreter_active
    return interpreter_active()


_CHECK_LAUNCHES = direct_launch.Launches()     # the check's compiled kernels (Triton's default warps)


def _check_on_host(arg: str, idx: torch.Tensor, limit: int, page: int, negatives_skip: bool) -> None:
    if negatives_skip:
        idx = idx[idx >= 0]
    check_pages_in_range(arg, idx, limit, page)
