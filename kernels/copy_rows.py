"""The row-copy kernel family and its launcher.

One kernel copies rows from one row map to another at given source and destination
indices, over a range of layers and every component of the maps. Backup (device ->
host), load (host -> device), gather (scattered rows -> contiguous buffer) and scatter
are all this copy with different maps. Each side is addressed either as a stacked
buffer (base pointer + strides, Ascend style) or through an int64 table of per-layer
base addresses (CUDA style); the choice is a compile-time constant per side.
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

import kvtier.platforms as platforms

from . import direct_launch
from .config import CopyConfig
from .errors import KvtierError, fail
from .index_check import IndexGuard, checks_on
from .index_memo import page_starts
from .plan import kernel_constants, plan_copy  # noqa: F401  (plan_copy: tests and tools)
from .rowmap import _WORD_DTYPES, RowMap
from .storage_watch import Watch, check_storage, watch  # noqa: F401  (Watch: callers' type)
from .validate import check_copy

__all__ = ["copy_rows", "synchronize", "KvtierError", "interpreter_active", "triton_available", "plan_copy"]


def _triton():
    """Triton, or None where it is not installed (then copies run the reference)."""
    try:
        import triton
        return triton
    except ImportError:
        return None


def _kernel():
    """The row-copy kernel (a seam: launch probes and test spies stand in for it here)."""
    return (_kernel_loaded or _load_kernel())[0]


def _load_kernel() -> list:
    if not _kernel_loaded:
        conflict = platforms.triton_conflict()
        if conflict:
            logging.getLogger("kvtier").warning("kvtier: %s", conflict)
        import inspect
        from .copy_rows_kernel import _copy_rows_kernel
        # The launch passes the compile-time constants by position (cheaper than by
        # keyword), in the order the kernel declares them.
        params = inspect.signature(_copy_rows_kernel.fn).parameters.values()
        constants = tuple(p.name for p in params if "constexpr" in str(p.annotation))
        _kernel_loaded.extend((_copy_rows_kernel, constants))
    return _kernel_loaded


_kernel_loaded = []     # [kernel, its constexpr parameter names], once loaded


def constexpr_names() -> tuple:
    """The kernel's compile-time parameters, in launch order."""
    return (_kernel_loaded or _load_kernel())[1]


def launch_arguments(args: tuple, kwargs: dict) -> dict:
    """A recorded row-copy launch's arguments by parameter name (for tools and tests that
    stand in for the kernel; launch options such as ``num_warps`` included)."""
    return dict(zip((_kernel_loaded or _load_kernel())[0].arg_names, args), **kwargs)


def triton_available() -> bool:
    return _triton() is not None


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 before import)."""
    triton = _triton()
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_warned = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _unify_chunks(src: RowMap, dst: RowMap):
    """Both sides must split a row into the same chunks; a contiguous row (one chunk)
    is re-described as the other side's chunks, which changes no byte it addresses."""
    if src.n_chunks == dst.n_chunks:
        return src, dst
    if src.n_chunks == 1:
        return _chunked_like(src, dst), dst
    if dst.n_chunks == 1:
        return src, _chunked_like(dst, src)
    # Both chunked differently: split both down to their common chunk size.
    from math import gcd
    c = gcd(src.chunk_bytes, dst.chunk_bytes)
    return _split_chunks(src, c), _split_chunks(dst, c)


def _chunked_like(contig: RowMap, other: RowMap) -> RowMap:
    from dataclasses import replace
    return replace(contig, n_chunks=other.n_chunks, chunk_bytes=other.chunk_bytes,
                   chunk_stride=other.chunk_bytes).sharing_anchors(contig)


def _split_chunks(m: RowMap, c: int) -> RowMap:
    # Only contiguous chunk sub-splits are representable with one chunk stride.
    if m.n_chunks == 1 or m.chunk_stride == m.chunk_bytes:
        from dataclasses import replace
        return replace(m, n_chunks=m.row_bytes // c, chunk_bytes=c, chunk_stride=c).sharing_anchors(m)
    raise KvtierError(f"cannot pair {m.describe()} with a map chunked in {c}-byte pieces")


def copy_rows(src: RowMap, src_indices: torch.Tensor, dst: RowMap, dst_indices: torch.Tensor,
              *, src_layer: int = 0, dst_layer: int = 0, num_layers: Optional[int] = None,
              by_page: bool = False, config: Optional[CopyConfig] = None, check: Optional[bool] = None,
              verdict: Optional[torch.Tensor] = None, skip_negative: bool = False) -> None:
    """Copy rows: for every component c and layer l < num_layers,
    ``dst[c, dst_layer + l, dst_indices[j]] = src[c, src_layer + l, src_indices[j]]``.

    Indices are token slots (int32/int64, 1-D, on the device where the copy runs: the
    maps' accelerator, else the CPU). ``by_page=True`` asserts that the indices are whole
    pages (runs of page_size slots from a page boundary, checked): where both sides store
    a page contiguously, each page then moves as one row. ``num_layers`` defaults to all
    layers both sides have from their start layers.

    Value checks (range, whole pages) never wait for the device: indices on the host are
    checked at once, indices on the device by a check kernel whose verdict the copy reads,
    so a bad list moves nothing and raises `KvtierError` at the next `copy_rows` call or at
    `kvtier.kernels.synchronize()` (`kvtier.kernels.index_check`). ``check=False`` (or
    ``KVTIER_CHECK=0``) skips them; the shape checks always run. ``verdict``: a verdict
    word from the caller's own `IndexGuard` (the copy moves nothing unless it is 0).
    ``skip_negative``: a pair holding a negative index is skipped, not refused (the
    engines' convention). The copy is enqueued on the current stream.
    """
    device, num_layers = check_copy(src, src_indices, dst, dst_indices, src_layer, dst_layer,
                                    num_layers, by_page, check_values=False)
    if config is not None and not isinstance(config, CopyConfig):
        raise fail("config", type(config).__name__, "must be a kvtier CopyConfig (or None for the default)")
    n = src_indices.numel()
    if n == 0 or num_layers == 0:
        return
    if verdict is None and checks_on(check):
        verdict = GUARD.check(device, [
            ("src_indices", src_indices, src.num_rows, src.page_size if by_page else 1),
            ("dst_indices", dst_indices, dst.num_rows, dst.page_size if by_page else 1)],
            negatives_skip=skip_negative)
    copy_validated(src, src_indices, dst, dst_indices, src_layer, dst_layer, num_layers, by_page,
                   config, device, verdict, skip_negative)


def copy_validated(src: RowMap, src_indices, dst: RowMap, dst_indices, src_layer: int = 0, dst_layer: int = 0,
                   num_layers: int = 1, by_page: bool = False, config: Optional[CopyConfig] = None,
                   device: Optional[torch.device] = None, verdict: Optional[torch.Tensor] = None,
                   skip_negative: bool = False, bound: Optional["BoundCopy"] = None) -> None:
    """`copy_rows` after its checks: the pools' and adapters' hot path, for arguments they
    have validated themselves (shapes here are not checked again). ``bound``: the
    `BoundCopy` these arguments make, where the caller keeps it (then only the indices
    and the verdict are read from the call)."""
    if bound is None:
        if src_indices.numel() == 0 or num_layers == 0:
            return
        bound = bind(src, dst, src_layer=src_layer, dst_layer=dst_layer, num_layers=num_layers,
                     by_page=by_page, config=config, device=device, n_rows=src_indices.numel(),
                     skip_negative=skip_negative)
    bound(src_indices, dst_indices, verdict)


_FALLBACK = {
    "no-triton": "kvtier: Triton is not installed; copies run the torch reference",
    "cpu": "kvtier: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before importing "
           "triton); copies run the torch reference",
}
_RUNNERS = {}


def _runner(device_type: str) -> str:
    """"kernel", or why copies on this device type run the torch reference (decided once:
    Triton chooses its interpreter when it is imported)."""
    r = _RUNNERS.get(device_type)
    if r is None:
        if _triton() is None:
            r = "no-triton"
        elif device_type == "cpu" and not interpreter_active():
            r = "cpu"
        else:
            if device_type == "cpu":
                check_interpreter()
            r = "kernel"
        _RUNNERS[device_type] = r
    return r


# The checks of plain copy_rows calls (pools and adapters keep their own).
GUARD = IndexGuard()


def synchronize(device=None) -> None:
    """Wait for ``device`` and raise the first index failure a device-side check of a
    `copy_rows` call found (the check point for callers that do not call again)."""
    GUARD.synchronize(device)


_interpreter_problem = []


def check_interpreter() -> None:
    """Raise a clear error where Triton's interpreter cannot run the kernel: Triton < 3.7
    turns a loop bound tensor into an int with ``int(array)``, which numpy >= 2.4 refuses
    for 1-element arrays ("only 0-dimensional arrays can be converted")."""
    if not _interpreter_problem:
        import numpy as np
        triton = _triton()
        version = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())
        try:
            with warnings.catch_warnings():     # numpy 1.25-2.3 warn where 2.4 refuses
                warnings.simplefilter("ignore", DeprecationWarning)
                int(np.ones(1, dtype=np.int64))
            numpy_ok = True
        except TypeError:
            numpy_ok = False
        _interpreter_problem.append(
            None if numpy_ok or version >= (3, 7) else
            f"Triton {triton.__version__}'s interpreter cannot run kernels with numpy {np.__version__} "
            "(int() of a 1-element array); install 'numpy<2.4' or Triton >= 3.7")
    if _interpreter_problem[0]:
        raise KvtierError(_interpreter_problem[0])


def _reference(src, si, dst, di, src_layer, dst_layer, num_layers, skip_negative=False):
    from .reference import copy_rows_reference
    if skip_negative:
        keep = (si >= 0) & (di >= 0)
        si, di = si[keep], di[keep]
    copy_rows_reference(src, si, dst, di, src_layer=src_layer, dst_layer=dst_layer,
                        num_layers=num_layers, check=False)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch between two maps passes that does not depend on the indices or
    the layer range (a `BoundCopy` holds one)."""

    sp: torch.Tensor
    st: torch.Tensor
    dp: torch.Tensor
    dt: torch.Tensor
    strides: tuple
    const: dict
    rows: int
    n_comp: int
    src_layers: int
    dst_layers: int
    dp_dtype: torch.dtype       # the word type a rebased destination is viewed as


def bind(src: RowMap, dst: RowMap, *, src_layer: int, dst_layer: int, num_layers: int, by_page: bool,
         config: Optional[CopyConfig], device: torch.device, n_rows: int,
         skip_negative: bool = False, keep: bool = True) -> "BoundCopy":
    """The `BoundCopy` for copying about ``n_rows`` index pairs (its power-of-two bucket)
    between validated maps: made once and kept in the source map's derived record (the
    last `KEEP_BOUND` per source map). ``keep=False`` for a destination the caller will
    not pass again (a new result buffer): kept, it would keep that buffer alive."""
    if config is None:
        config = platforms.of(device).default_config(crosses_link=src.device.type != dst.device.type)
    key = (dst, src_layer, dst_layer, num_layers, by_page, config, device,
           1 << (max(n_rows, 1) - 1).bit_length(), skip_negative)
    plans = src.derived.plans
    b = plans.get(key)
    if b is None:
        b = BoundCopy(src, dst, src_layer, dst_layer, num_layers, by_page, config, device, key[7], skip_negative)
        if keep:
            if len(plans) >= KEEP_BOUND:
                try:                             # the oldest (another thread may be here too)
                    del plans[next(iter(plans))]
                except (StopIteration, KeyError, RuntimeError):
                    pass
            plans[key] = b
    return b


KEEP_BOUND = 64


class BoundCopy:
    """One row copy between two validated maps over a layer range, with everything but
    the indices and the verdict worked out once: the launch plan (kernel constants,
    pointer and table arguments, strides in units), the page view, and the tensors to
    watch. Calling it with (source indices, destination indices, verdict) enqueues the
    copy: the pools' and adapters' hot path.

    Before each launch it checks, on the host, that every tensor the maps were built on
    still has, in the layers it touches, the storage it had then (after ``resize_``,
    ``set_`` or a freed storage the map's addresses point at memory the tensor no longer
    owns): a `KvtierError` names the tensor instead of a write into freed memory.
    """

    __slots__ = ("config", "num_layers", "skip_negative", "page", "runner", "plan", "maps", "origin",
                 "constants", "rest", "items", "watch", "layers", "direct")

    def __init__(self, src: RowMap, dst: RowMap, src_layer: int, dst_layer: int, num_layers: int,
                 by_page: bool, config: CopyConfig, device: torch.device, n_bucket: int, skip_negative: bool):
        self.config, self.num_layers, self.origin = config, num_layers, (src, dst)
        self.skip_negative, self.layers = skip_negative, (src_layer, dst_layer)
        self.watch = watch(src, src_layer, num_layers) + watch(dst, dst_layer, num_layers)
        self.page = 0
        if by_page and src.page_size > 1 and src.page_contiguous and dst.page_contiguous:
            self.page = src.page_size
            src, dst = src.pages_as_rows(), dst.pages_as_rows()
            n_bucket = max(n_bucket // self.page, 1)
        self.maps = (src, dst)
        self.runner = _runner(device.type)
        self.direct = None
        if self.runner != "kernel":
            return
        if not interpreter_active() and direct_launch.enabled():
            self.direct = direct_launch.Launches(config.num_warps)
        p = self.plan = _make_plan(src, dst, n_bucket, config, device)
        scalars = (num_layers, src_layer, dst_layer, p.src_layers, p.dst_layers, *p.strides)
        base = dict(p.const, SKIP_NEG=skip_negative, IDX_STEP=max(self.page, 1))
        self.constants = dict(base, CHECKED=False)
        names = constexpr_names()
        # The launch arguments after the verdict, as one tuple: (unchecked, checked).
        self.rest = tuple((p.dp, p.dt, p.sp, p.st, *scalars, *(dict(base, CHECKED=c)[k] for k in names))
                          for c in (False, True))
        c = p.const   # work items per tile of rows: one per (component, layer), and with SPLIT
        blocks = c["N_CHUNKS"] * -(-c["CHUNK_WORDS"] // c["BLOCK"]) if c.get("SPLIT") else 1
        self.items = p.n_comp * num_layers * blocks          # per chunk and column block

    def __call__(self, si: torch.Tensor, di: torch.Tensor, verdict: Optional[torch.Tensor] = None,
                 watched: bool = False, dst_buffer: Optional[torch.Tensor] = None,
                 src_buffer: Optional[torch.Tensor] = None) -> None:
        """Enqueue the copy at dense indices; with a ``verdict`` word, its programs copy
        nothing unless it is 0. ``watched``: the caller has run `check_storage` on this
        copy's watch already (a call of several launches checks them all before the
        first). ``dst_buffer`` (``src_buffer``): for a copy bound to a destination (source)
        *layout* (a stacked map without tensors, see `rebased`), the contiguous buffer this
        call writes (reads), laid out as it (already viewed as the kernel's word type, or
        it is viewed here). Where the copy moves pages, the indices are whole pages of
        slots and the kernel reads each page's first (``IDX_STEP``).

        One frame from here to the launch: every pool and adapter call passes it."""
        if not watched:
            check_storage(self.watch)
        if not si.is_contiguous():      # the kernel reads indices as dense arrays
            si = si.contiguous()
        if not di.is_contiguous():
            di = di.contiguous()
        if self.runner != "kernel":
            _warn_once(self.runner, _FALLBACK[self.runner])
            if self.page:           # the reference reads page numbers
                si, di = page_starts(si, self.page), page_starts(di, self.page)
            src, dst = self.maps
            return _reference(src, si, dst, di, *self.layers, self.num_layers, self.skip_negative)
        p, n = self.plan, si.numel()
        if self.page:
            n //= self.page
        if not n:
            return
        config = self.config
        grid = min(config.num_programs, self.items * -(-n // p.rows))
        if verdict is None:         # unchecked: any tensor stands in for the unread word
            verdict, rest = si, self.rest[0]
        else:
            rest = self.rest[1]
        # (the launch arguments after the verdict: destination pointer and table, source
        # pointer and table, then the bound copy's own)
        if dst_buffer is not None:
            if dst_buffer.dtype is not p.dp_dtype:
                dst_buffer = dst_buffer.view(-1).view(p.dp_dtype)
            args, varying = (si, di, n, verdict, dst_buffer, dst_buffer, *rest[2:]), _DST_WORDS
        elif src_buffer is not None:
            if src_buffer.dtype is not p.dp_dtype:
                src_buffer = src_buffer.view(-1).view(p.dp_dtype)
            args, varying = (si, di, n, verdict, rest[0], rest[1], src_buffer, src_buffer, *rest[4:]), _SRC_WORDS
        else:
            args, varying = (si, di, n, verdict, *rest), ()
        direct = self.direct
        if direct is not None:      # a compiled kernel: kept and launched directly once checked
            direct.launch(_kernel(), grid, args, direct_launch.copy_spec(args, varying))
        else:
            _kernel()[(grid,)](*args, num_warps=config.num_warps)


def rebased(m: RowMap) -> RowMap:
    """Stacked map ``m`` as a layout only (no tensors, nothing kept alive): a copy bound to
    it is given its buffer per call (`BoundCopy.__call__`'s ``dst_buffer`` or
    ``src_buffer``), contiguous from the map's base and aligned as ``m``'s base was."""
    from dataclasses import replace
    if m.is_table:
        raise KvtierError(f"{m.describe()}: only a stacked map can be a layout")
    return replace(m, segments=(), born=())


_DST_WORDS, _SRC_WORDS = (4, 5), (6, 7)        # where a call's own buffer goes in the arguments


def _make_plan(src: RowMap, dst: RowMap, n_bucket: int, config: CopyConfig, device: torch.device) -> LaunchPlan:
    plat = _platform(device)
    # A map as the kernel addresses it (Ascend: registered host memory by device address).
    src, dst = src.kernel_view(plat, device), dst.kernel_view(plat, device)
    src, dst = _unify_chunks(src, dst)
    const = kernel_constants(src, dst, n_bucket, config, threads=config.num_warps * plat.warp_threads,
                             min_rows=plat.min_rows, min_piece_bytes=plat.min_piece_bytes)
    word = const["WORD"]
    unit = word * const["ALIGN"]
    args = []
    for m in (src, dst):
        if m.is_table:
            table = m.table_on(device)
            # The pointer argument of a table side is unused; its dtype names the word type.
            other = dst if m is src else src
            ptr = other.anchor(word) if not other.is_table and other.segments else _word_view(table, word)
            args.append((ptr, table))
        else:
            # A stacked map without tensors is a layout: each call brings its buffer.
            a = m.anchor(word) if m.segments else None
            args.append((a, a))
    (sp, st), (dp, dt) = args
    return LaunchPlan(sp, st, dp, dt, (*_units(src, unit), *_units(dst, unit)), const, const["ROWS"],
                      src.num_components, src.num_layers, dst.num_layers, _WORD_DTYPES[word])


def _platform(device: torch.device):
    """The platform record whose launch floors, thread counts and map views apply."""
    return platforms.of(device)


def _units(m: RowMap, unit: int):
    """The map's strides in units of ``unit`` bytes (comp, layer, page, token, chunk)."""
    return (m.comp_stride // unit, m.layer_stride // unit, m.page_stride // unit,
            m.token_stride // unit, m.chunk_stride // unit)


def _word_view(t: torch.Tensor, word: int) -> torch.Tensor:
    return t.view(torch.uint8)[: (t.numel() * 8 // word) * word].view(_WORD_DTYPES[word])
