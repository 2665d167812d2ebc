"""Where index checks report, per thread: failure records and verdict.

Every check of a call's index lists (inline in a copy launch, or a check launch of the
call's own, `kvtier.kernels.index_check`) writes its first failure to the *record* of
the thread that enqueued the call: (code, argument id, position, value, limit, page),
in host memory the device writes and the host reads without a sync where the platform
allows (pinned and mapped on CUDA/ROCm; a plain tensor on the CPU, where the kernel has
run by the time the launch returns), else in device memory read at `synchronize`. The
thread raises it as a `KvtierError` naming the argument, the position and the value:
at once where the check has run already, else at its next kvtier call or its
`synchronize()`. A thread never sees another thread's failure.

A check launch hands its verdict to the copies of the same call through the calling
thread's *verdict* on the current stream: word 0 is 0 or the failure's code (the
copies move nothing unless it is 0), word 1 its negation. A thread enqueues one call at a
time, so on one stream its calls' checks and copies are ordered and no call reads
another's verdict; other threads, and other streams, have words of their own.

Records and words are made once per thread and device (and stream) and kept for the
process: a thread that ends may still have a launch in flight that writes its record.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional

import torch

import kvtier.platforms as platforms

from kvtier.errors import fail
from kvtier import caches

RECORD_WORDS = 8        # code, argument id, position, value, limit, page, (spare)

_REASONS = {1: "negative index", 2: "index out of range for {limit} rows",
            3: "not a whole page: runs of {page} consecutive slots from a page boundary",
            4: "{which} table entry {pos} is not a live buffer's address (null, or not a multiple of {limit} "
               "bytes): every base a table lists must stay a live buffer while the call's copies run"}

# Argument names by id: the kernels record an id, the host names the argument. Only the
# names used in kvtier's own calls are ever added (a few dozen at most).
MAX_NAMES = 4096         # argument names interned at most; past it a name reads as "an argument"
_NAMES: List[str] = caches.table("kernels.faults._NAMES", factory=list, key="argument id", value="argument name",
                                 bound=str(MAX_NAMES), stale="not happen: an id names one argument for the process")
_IDS: Dict[str, int] = caches.table("kernels.faults._IDS", key="argument name", value="its id (index in _NAMES)",
                                    bound=str(MAX_NAMES), stale="-")
_NAMES_LOCK = threading.Lock()


def arg_id(name: str) -> int:
    """The id a check records for the argument called ``name``."""
    i = _IDS.get(name)
    if i is None:
        with _NAMES_LOCK:
            i = _IDS.get(name)
            if i is None:
                if len(_NAMES) >= MAX_NAMES - 1:        # full: one catch-all name from here on
                    name = "an argument"
                    i = _IDS.get(name)
                    if i is not None:
                        return i
                i = _IDS[name] = len(_NAMES)
                _NAMES.append(name)
    return i


class Record:
    """One thread's failure record on one device: ``tensor`` (int64[8]) as the kernels
    write it, ``view`` its host memory as Python ints where the host reads it without a
    sync (None where it lives in device memory)."""

    __slots__ = ("tensor", "view", "device")

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            t = torch.zeros(RECORD_WORDS, dtype=torch.int64)
            view = memoryview(t.numpy())
        else:
            t = torch.zeros(RECORD_WORDS, dtype=torch.int64, pin_memory=True)
            if platforms.host_device_address(t, platforms.platform_of(device)) is None:
                t, view = torch.zeros(RECORD_WORDS, dtype=torch.int64, device=device), None
            else:
                view = memoryview(t.numpy())
        self.tensor, self.view = t, view


_local = threading.local()
_KEEP: List[object] = caches.table(     # accelerator records and words: never freed (see the module doc)
    "kernels.faults._KEEP", factory=list, kind="state", key="-", value="accelerator failure records and verdict",
    bound="one per thread, device and stream that launched", rule="never freed: a launch of an ended thread may still write it")
_KEEP_LOCK = threading.Lock()


def _mine() -> dict:
    d = getattr(_local, "records", None)
    if d is None:
        d = _local.records = {}
        _local.words = {}
    return d


def record(device: torch.device) -> Record:
    """This thread's record on ``device``."""
    d = getattr(_local, "records", None) or _mine()
    r = d.get(device)
    if r is None:
        r = d[device] = Record(device)
        if r.view is not None:
            _local.visible = getattr(_local, "visible", ()) + (r,)
        if device.type != "cpu":
            with _KEEP_LOCK:
                _KEEP.append(r)
    return r


def call_record(device: torch.device) -> Record:
    """This thread's record on ``device`` for the call about to launch, after raising the
    failure an earlier call left in any of this thread's records (`raise_pending`): what
    every launching call asks first."""
    for r in getattr(_local, "visible", ()):
        if r.view[0]:
            _raise(r, tuple(r.view[:6]), False)
    d = getattr(_local, "records", None)
    r = d.get(device) if d is not None else None
    return r if r is not None else record(device)


def verdicts(device: torch.device) -> torch.Tensor:
    """This thread's verdict (int32[2]) on ``device``'s current stream."""
    _mine()
    key = (device, None if device.type == "cpu" else platforms.stream_key(device))
    w = _local.words.get(key)
    if w is None:
        w = _local.words[key] = torch.zeros(2, dtype=torch.int32, device=device)
        if device.type != "cpu":
            with _KEEP_LOCK:
                _KEEP.append(w)
    return w


def raise_pending(this_call: bool = False) -> None:
    """Raise the failure a check of this thread's calls has recorded in host-visible
    memory (no sync), if any. ``this_call``: the check of the call just enqueued has run
    (the message says nothing moved)."""
    for r in getattr(_local, "visible", ()):       # (one read per record: every call asks)
        if r.view[0]:
            _raise(r, tuple(r.view[:6]), this_call)


def synchronize(device=None) -> None:
    """Wait for ``device`` and raise the first failure any check of this thread's calls
    recorded (after it, every earlier call's verdict is known)."""
    platforms.synchronize(device)
    d = getattr(_local, "records", None)
    if d:
        for r in list(d.values()):
            values = tuple(r.view[:6]) if r.view is not None else tuple(r.tensor[:6].cpu().tolist())
            if values[0]:
                _raise(r, values, False)


def pending() -> Optional[str]:
    """The failure this thread's records hold in host-visible memory, as the message it
    would raise, or None (what a test harness checks between tests)."""
    try:
        raise_pending()
    except Exception as e:      # noqa: BLE001  (a KvtierError: the record is cleared)
        return str(e)
    return None


def _raise(r: Record, values: tuple, this_call: bool) -> None:
    code, arg, pos, value, limit, page = (int(v) for v in values)
    r.tensor.zero_()
    name = _NAMES[arg] if 0 <= arg < len(_NAMES) else f"argument {arg}"
    why = _REASONS.get(code, "failed check {code}").format(
        limit=limit, page=page, pos=pos, code=code, which=("source", "destination")[page] if code == 4 else "")
    when = ("nothing was enqueued" if this_call else
            "found on the device after an earlier call was enqueued: that call moved no bytes")
    if code == 4:
        raise fail(name, hex(value), f"{why} ({when})")
    raise fail(name, value, f"{why} (at position {pos}; {when})")
