"""Launching a kept compiled kernel again without Triton's Python launch path.

On every launch Triton's `JITFunction.run` works out the specialization of every
argument, a cache key, its knobs and hooks, then calls the compiled kernel's launcher.
For the row copy's 43 arguments that is about 17 µs of host time per launch on the
development CPU (`bench/scripts/launch_binding.py` times its largest part), more than
the rest of a pool call. A copy launch passes the same arguments every time but its
indices, row count and verdict word (and a gather's new buffer), so once Triton has
launched it, its compiled kernel is kept per specialization of those (the current
device, each tensor's dtype and 16-byte alignment, the row count's integer width), and
later launches with that specialization call the kernel's launcher directly, with the
arguments Triton would pass.

Nothing is assumed about Triton's launch: a kept kernel is used directly only after a
launch through Triton was seen to call it with exactly those arguments (`Launches`:
each kernel is kept, then checked on its next launch, then used). A Triton whose
launch differs keeps every launch on its own path. Where Triton's interpreter runs the
kernels nothing is kept (it returns no compiled kernel). ``KVTIER_DIRECT_LAUNCH=0``
turns it off for the copies bound after it is set.

Every launch through Triton goes through `through_triton`, which runs interpreted
launches one at a time: Triton's interpreter keeps a launch's state in the process (it
patches ``triton.language`` and sets the program ids globally while a kernel runs), so
two threads interpreting at once raise or run each other's programs.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

DIRECT_ENV = "KVTIER_DIRECT_LAUNCH"
_REFUSED = object()      # a kernel whose launch through Triton differed from a direct one


class _Pending:
    """A compiled kernel Triton returned for ``jit_fn``, not yet seen launched with our
    arguments."""
    __slots__ = ("kernel", "jit_fn")

    def __init__(self, kernel, jit_fn):
        self.kernel, self.jit_fn = kernel, jit_fn


class _Checked(_Pending):
    """A compiled kernel whose launch through Triton matched a direct launch."""
    __slots__ = ()


def enabled() -> bool:
    """Whether copies bound now keep their compiled kernels (``KVTIER_DIRECT_LAUNCH``)."""
    return os.environ.get(DIRECT_ENV, "1") != "0"


class Launches:
    """Compiled kernels of one kernel by specialization (see the module doc): a bound
    copy keeps its own; the index check keeps one for all its launches."""

    __slots__ = ("kernels", "num_warps")

    def __init__(self, num_warps: Optional[int] = None):
        self.kernels = {}
        self.num_warps = num_warps      # None: Triton's default

    def launch(self, jit_fn, grid: int, args: tuple, spec: tuple) -> None:
        """Launch ``jit_fn`` over ``grid`` programs with ``args`` (every parameter, in
        order), whose specialization ``spec`` spells out (`copy_spec`, `check_spec`):
        directly where a checked kernel of this ``jit_fn`` and specialization is kept on
        the current device, else through Triton (keeping or checking the kernel it
        launches)."""
        drv = (_DRIVER or _load())[0].active
        device = drv.get_current_device()
        key = (id(jit_fn), device, spec)    # a kernel put in its place (a spy) gets its own
        kept = self.kernels.get(key)
        if kept is not None and kept is not _REFUSED and kept.jit_fn is not jit_fn:
            kept = None                 # another function at a freed one's address
        if kept.__class__ is _Checked:
            stream = drv.get_current_stream(device)
            k = kept.kernel
            k.run(*_arguments(k, grid, stream, args))
        elif kept.__class__ is _Pending:
            self.kernels[key] = self._check(jit_fn, grid, args, kept.kernel, drv, device)
        else:
            kernel = through_triton(jit_fn, grid, args, self.num_warps)
            if kept is None and kernel is not None and hasattr(kernel, "packed_metadata"):
                self.kernels[key] = _Pending(kernel, jit_fn)

    def _check(self, jit_fn, grid: int, args: tuple, kernel, drv, device):
        """Launch through Triton once more, seeing what it passes to ``kernel``'s
        launcher; the kernel is used directly from now on only if that is what a direct
        launch passes."""
        stream = drv.get_current_stream(device)
        slot = _launcher_slot(kernel)
        if slot is None:            # nowhere to watch the launcher from: never direct
            through_triton(jit_fn, grid, args, self.num_warps)
            return _REFUSED
        seen = []
        real = kernel.run

        def watched(*a):
            seen.append(a)
            return real(*a)
        setattr(kernel, slot, watched)
        try:
            through_triton(jit_fn, grid, args, self.num_warps)
        finally:
            setattr(kernel, slot, real)
        try:
            ours = _arguments(kernel, grid, stream, args)
        except Exception:           # a Triton whose kernels read otherwise: never direct
            return _REFUSED
        return _Checked(kernel, jit_fn) if len(seen) == 1 and _same(seen[0], ours) else _REFUSED


def _launcher_slot(kernel) -> Optional[str]:
    """The instance attribute a compiled kernel's ``run`` (its launcher) is read from:
    ``run`` itself where Triton sets it on the kernel, ``_run`` behind Triton's ``run``
    property (3.9); None where neither holds it (the launch cannot be watched)."""
    if "run" in vars(kernel):
        return "run"
    prop = getattr(type(kernel), "run", None)
    if isinstance(prop, property) and "_run" in vars(kernel) and kernel.run is vars(kernel)["_run"]:
        return "_run"
    return None


def _arguments(k, grid: int, stream, args: tuple) -> tuple:
    """What Triton's `JITFunction.run` passes to compiled kernel ``k``'s launcher for a
    one-dimensional ``grid`` and ``args`` (every kernel parameter, in order)."""
    runtime = (_DRIVER or _load())[1].runtime
    return (grid, 1, 1, stream, k.function, k.packed_metadata, k.launch_metadata((grid,), stream, *args),
            runtime.launch_enter_hook, runtime.launch_exit_hook, *args)


_METADATA = 6            # the position of the launch metadata: a new object per launch


def _same(theirs: tuple, ours: tuple) -> bool:
    """Whether two launcher argument lists are the same: the same objects (tensors,
    hooks, the kernel's handles) or equal plain values, and launch metadata of one type."""
    if len(theirs) != len(ours):
        return False
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if i == _METADATA:
            if type(a) is not type(b):
                return False
        elif a is not b and (type(a) is not type(b) or not isinstance(a, (int, float, str, tuple, type(None)))
                             or a != b):
            return False
    return True


COPY_CALL_ARGS = 22     # the row copy's per-call arguments come first (kvtier.kernels.launcher)
CHECK_CALL_ARGS = 18    # the index check's (kvtier.kernels.index_check)


def _spec(args) -> tuple:
    """What Triton may specialize on among per-call arguments: a tensor's dtype and 16-byte
    alignment, an int's being 1, a multiple of 16, and its width."""
    spec = ()
    for a in args:
        if a.__class__ is int:
            spec += (a == 1, not a % 16, -2147483648 <= a <= 2147483647)
        else:
            spec += (a.dtype, a.data_ptr() & 15)
    return spec


def copy_spec(args: tuple) -> tuple:
    """The row copy's specialization among the arguments that change from call to call
    (the lists, their strides, limits and names, the verdict or record, each side's base
    or tables; the rest are a copy launch's own)."""
    return _spec(args[:COPY_CALL_ARGS])


def check_spec(args: tuple) -> tuple:
    """The index check's specialization: its per-call arguments' and its compile-time
    constants."""
    return _spec(args[:CHECK_CALL_ARGS]) + tuple(args[CHECK_CALL_ARGS:])


_DRIVER: Optional[tuple] = None     # (Triton's driver config, its knobs), once imported


def _load() -> tuple:
    """Triton's driver config (its current device and stream, as its launch reads them)
    and its knobs (the launch hooks), imported on first use."""
    global _DRIVER
    from triton import knobs
    from triton.runtime import driver
    _DRIVER = (driver, knobs)
    return _DRIVER


_INTERPRETER = threading.Lock()     # held while Triton's interpreter runs one of kvtier's kernels


def interpreted(fn) -> bool:
    """Whether ``fn`` is a jitted function as Triton's interpreter wraps it (community
    Triton and triton-ascend name the wrapper alike)."""
    return type(fn).__name__ == "InterpretedFunction"


def through_triton(jit_fn, grid: int, args: tuple, num_warps: Optional[int] = None):
    """Launch ``jit_fn`` over ``grid`` programs through Triton (``num_warps`` None:
    Triton's default); an interpreted kernel runs only while no other thread's does."""
    kw = {} if num_warps is None else {"num_warps": num_warps}
    if type(jit_fn).__name__ == "InterpretedFunction":      # (`interpreted`, without its frame)
        with _INTERPRETER:
            return jit_fn[(grid,)](*args, **kw)
    return jit_fn[(grid,)](*args, **kw)
