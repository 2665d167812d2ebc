"""Buffer sets an engine registers, and the prepared calls kept for them.

An engine adapter's functions take the engine's own arguments on every call (SGLang's
``kvcacheio`` calls get new views of the same buffers and the same pointer tables each
time). Where those buffers belong to a registered buffer set (`register`; SGLang's host
pools are registered as they are built, `kvtier.adapters.sglang_install.install`), a
call's `EngineCall` is prepared on its first call and kept by the registration; later
calls of that kind on those buffers find it by the call's kind, scalars and every
tensor's address (`call`) and only launch. The registration holds the buffers, so an
address in a key stands for that memory while the entry lives, and every hit compares
the call's tensors with the ones the call was prepared from (shape, strides, dtype) and
those with where their maps were built (the storage watch): a view of other geometry,
or a buffer resized or moved in place, is prepared again.

Buffers no registration holds take the slow path: an `EngineCall` for that call, kept
nowhere. A buffer set that changes (the engine reallocates its KV) is registered again
by the engine (`register` replaces the owner's registration); until then its new
buffers take the slow path.

A registration lives as long as its owner (the engine's pool object, weakly
referenced): once the owner is gone, so are its prepared calls and their index entries.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import torch

from kvtier.errors import fail

from .maps import UNCACHED, EngineCall
from kvtier import caches

_TENSOR = torch.Tensor
_DATA_PTR = torch.Tensor.data_ptr
CALLS_PER_REGISTRATION = 4096   # prepared calls one registration keeps at most (the oldest go first)


class PreparedCall:
    """An `EngineCall` kept for one call kind on registered buffers, with the tensors it was
    prepared from and their geometry as the call passed them."""

    __slots__ = ("call", "tensors", "ptrs", "geometry", "__weakref__")

    def __init__(self, call: EngineCall, tensors: Sequence[torch.Tensor]):
        self.call, self.tensors = call, tuple(tensors)
        self.ptrs = tuple(t.data_ptr() for t in tensors)
        self.geometry = tuple((t.shape, t.stride(), t.dtype) for t in tensors)

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` (at this call's addresses: the key says so) have the geometry
        it was prepared for, and its own tensors are still where its maps were built."""
        for t, held, ptr, (shape, stride, dtype) in zip(tensors, self.tensors, self.ptrs, self.geometry):
            if t.shape != shape or t.dtype != dtype or held.data_ptr() != ptr or t.stride() != stride:
                return False
        return True


class Registration:
    """One buffer set of an engine: its tensors (held), their storages by address, and the
    calls prepared on them (at most `CALLS_PER_REGISTRATION`)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = tuple(tensors)
        self.storages = {}
        for t in self.tensors:
            st = t.untyped_storage()
            self.storages[st.data_ptr()] = st
        self.calls: Dict[tuple, PreparedCall] = {}

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of one of this set's storages (the storage object itself)."""
        st = t.untyped_storage()
        return self.storages.get(st.data_ptr()) is st


# The index of the live registrations and their prepared calls (docs/design.md, "Caches").
_STORAGES: Dict[int, List[weakref.ref]] = caches.table(
    "adapters.registry._STORAGES", key="a registered storage's start address", value="weak references to the "
    "registrations holding it", bound="registered storages alive", rule="the registration dropped or replaced",
    stale="not happen: a registration holds its storages, so the address stands for that memory")
_CALLS: Dict[tuple, weakref.ref] = caches.table(
    "adapters.registry._CALLS", key="call kind, exact scalars, every tensor's data_ptr()",
    value="weak reference to the PreparedCall its registration keeps",
    bound=f"{CALLS_PER_REGISTRATION} per registration", rule="the registration dropped, replaced or full (oldest first)",
    stale="not happen: a hit compares every tensor's geometry and its held tensors' addresses")
_OWNERS: "weakref.WeakKeyDictionary[object, Registration]" = caches.table(
    "adapters.registry._OWNERS", factory=weakref.WeakKeyDictionary, kind="state", key="the engine's owner object (weak)",
    value="its Registration", bound="owners alive", rule="the owner collected, unregister(), or a new register()")
_LOCK = threading.RLock()     # (reentrant: a registration collected under it drops its entries)


def register(owner, tensors: Sequence) -> Registration:
    """Register the buffer set ``tensors`` (tensors, or lists and tuples of them) of
    ``owner`` (the engine's object that holds them, e.g. its host pool): calls on them
    keep their prepared transfers from now on, for as long as ``owner`` lives. A second
    registration of the same owner replaces the first (the engine reallocated its KV)."""
    flat = [t for t in _flatten(tensors) if isinstance(t, _TENSOR)]
    if not flat:
        raise fail("tensors", type(tensors).__name__, "must hold at least one tensor")
    reg = Registration(flat)
    with _LOCK:
        old = _OWNERS.get(owner)
        if old is not None:
            _forget(old)
        _OWNERS[owner] = reg
        ref = weakref.ref(reg, _dropped)
        for ptr in reg.storages:
            _STORAGES.setdefault(ptr, []).append(ref)
    return reg


def unregister(owner) -> None:
    """Forget ``owner``'s registration (its calls take the slow path again)."""
    with _LOCK:
        reg = _OWNERS.pop(owner, None)
        if reg is not None:
            _forget(reg)


def sizes() -> Dict[str, int]:
    """How many registrations, registered storages and prepared calls the index holds
    (for diagnostics: each falls back to 0 once its owners are gone)."""
    with _LOCK:
        return {"registrations": len(_OWNERS), "storages": len(_STORAGES), "calls": len(_CALLS)}


def call(kind, scalars: tuple, tensors: Sequence[torch.Tensor], src_indices, dst_indices, check,
         build: Callable[[], EngineCall]) -> None:
    """One adapter call: ``kind`` and ``scalars`` (exact ints, None or configs: `plain`)
    name what it does, ``tensors`` are its tensor arguments (flattened). The `EngineCall`
    kept under that key launches where its tensors match these, else ``build()``'s (`prepare`)."""
    try:
        key = (kind, *scalars, *map(_DATA_PTR, tensors))
    except TypeError:                       # lists of tensors among them, or not tensors
        tensors = _flatten(tensors)
        try:
            key = (kind, *scalars, *map(_DATA_PTR, tensors))
        except (TypeError, RuntimeError):
            key = (UNCACHED,)
    except RuntimeError:                    # a tensor without storage: the build names it
        key = (UNCACHED,)
    r = _CALLS.get(key)
    prepared = r() if r is not None else None
    if prepared is not None and prepared.matches(tensors):
        prepared.call.launch(src_indices, dst_indices, check)
        return
    prepare(key, tensors, build).launch(src_indices, dst_indices, check)


def prepare(key: tuple, tensors: Sequence[torch.Tensor], build: Callable[[], EngineCall]) -> EngineCall:
    """The call for ``key`` that `call` did not find: ``build()``'s `EngineCall`, kept by
    the registration that holds every one of ``tensors`` (if one does, and the key can be
    kept), else kept nowhere."""
    call = build()
    if UNCACHED in key:
        return call
    reg = _holder(tensors)
    if reg is not None:
        prepared = PreparedCall(call, tensors)
        with _LOCK:
            if len(reg.calls) >= CALLS_PER_REGISTRATION:
                old = next(iter(reg.calls))
                del reg.calls[old]
                _CALLS.pop(old, None)
            reg.calls[key] = prepared
            _CALLS[key] = weakref.ref(prepared, lambda r, key=key: _drop_call(key, r))
    return call


def _holder(tensors: Sequence[torch.Tensor]) -> Optional[Registration]:
    """The live registration that holds every one of ``tensors``' storages, or None."""
    try:
        st = tensors[0].untyped_storage()
    except (RuntimeError, IndexError):
        return None
    for ref in _STORAGES.get(st.data_ptr(), ()):
        reg = ref()
        if reg is not None and all(reg.holds(t) for t in tensors):
            return reg
    return None


def _flatten(tensors) -> list:
    """``tensors`` with lists and tuples of tensors spread out (anything else kept as it is)."""
    out = []
    for t in tensors:
        if isinstance(t, (list, tuple)):
            out.extend(_flatten(t))
        else:
            out.append(t)
    return out


def _forget(reg: Registration) -> None:
    """Drop ``reg``'s prepared calls and storage entries (under the lock)."""
    for key in reg.calls:
        _CALLS.pop(key, None)
    reg.calls.clear()
    for ptr in reg.storages:
        refs = _STORAGES.get(ptr)
        if refs is not None:
            refs[:] = [r for r in refs if r() is not None and r() is not reg]
            if not refs:
                del _STORAGES[ptr]


def _dropped(ref: weakref.ref) -> None:
    """A registration was collected: its storage entries go."""
    with _LOCK:
        for ptr in [p for p, refs in _STORAGES.items() if ref in refs]:
            refs = _STORAGES[ptr]
            refs.remove(ref)
            if not refs:
                del _STORAGES[ptr]


def _drop_call(key: tuple, ref: weakref.ref) -> None:
    """A prepared call was collected: its index entry goes (unless another took the key)."""
    if _CALLS.get(key) is ref:
        del _CALLS[key]
