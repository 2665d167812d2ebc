"""The row-copy kernel family and its launcher.

One kernel copies rows from one row map to another at given source and destination
indices, over a range of layers and every component of the maps. Backup (device ->
host), load (host -> device), gather (scattered rows -> contiguous buffer) and scatter
are all this copy with different maps. Each side is addressed either as a stacked
buffer (base address + strides, Ascend style) or through int64 tables of per-layer base
addresses (CUDA style); the choice is a compile-time constant per side.

A `BoundCopy` is everything a launch between two maps' *layouts* needs but the
addresses: it holds no tensor and is a pure function of the layouts, the layer range,
the page mode, the configuration and the device, so bound copies are kept for the
process (`bind`). Each call passes its own addresses (a `Side` per map: a base, or the
tables) and its own index lists, which every launch checks before it moves a byte
(`run`, `kvtier.kernels.index_check`).
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import replace
from typing import NamedTuple, Optional, Sequence

import torch

import kvtier.platforms as platforms

from . import direct_launch, faults
from kvtier.bounded import Bounded
from .config import CopyConfig
from .errors import KvtierError, fail
from .index_check import Checks, check_launch, check_on_host, checks_on
from .tiling import kernel_constants, tile_copy  # noqa: F401  (tile_copy: tests and tools)
from .rowmap import RowMap
from .storage_watch import Watch, check_storage, watch  # noqa: F401  (Watch: callers' type)
from .validate import check_copy

__all__ = ["copy_rows", "synchronize", "KvtierError", "interpreter_active", "triton_available", "tile_copy",
           "BoundCopy", "Side", "Checks", "bind", "run"]

# What every program of a launch does before it moves a byte (the kernel's CHECK).
UNCHECKED, BY_VERDICT, INLINE = 0, 1, 2
CHECK_BLOCK = 1024          # index or table entries a program reads per step of a check


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
        logging.getLogger("kvtier").warning("%s", msg)
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
    return replace(contig, n_chunks=other.n_chunks, chunk_bytes=other.chunk_bytes, chunk_stride=other.chunk_bytes)


def _split_chunks(m: RowMap, c: int) -> RowMap:
    # Only contiguous chunk sub-splits are representable with one chunk stride.
    if m.n_chunks == 1 or m.chunk_stride == m.chunk_bytes:
        return replace(m, n_chunks=m.row_bytes // c, chunk_bytes=c, chunk_stride=c)
    raise KvtierError(f"cannot pair {m.describe()} with a map chunked in {c}-byte pieces")


# ---------------------------------------------------------------------- one copy
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
    """
    device, num_layers = check_copy(src, src_indices, dst, dst_indices, src_layer, dst_layer,
                                    num_layers, by_page, check_values=False)
    if config is not None and not isinstance(config, CopyConfig):
        raise fail("config", type(config).__name__, "must be a kvtier CopyConfig (or None for the default)")
    if src_indices.numel() == 0 or num_layers == 0:
        return
    page = (src.page_size, dst.page_size) if by_page else (1, 1)
    bound = bind(src, dst, src_layer=src_layer, dst_layer=dst_layer, num_layers=num_layers, by_page=by_page,
                 config=config, device=device, n_rows=src_indices.numel(), skip_negative=skip_negative,
                 whole=page, tables=(not src.table_trusted, not dst.table_trusted))
    checks = Checks.of(("src_indices", src.num_rows, page[0]), ("dst_indices", dst.num_rows, page[1]),
                       skip_negative) if checks_on(check) else None
    check_storage(bound_watch(src, dst, src_layer, dst_layer, num_layers))
    run((bound,), (bound.sides(src, dst),), src_indices, dst_indices, checks, device, ((src, dst),))


def bound_watch(src: RowMap, dst: RowMap, src_layer: int, dst_layer: int, num_layers: int) -> Watch:
    """The storage watch of a copy between ``src`` and ``dst`` over a layer range."""
    return watch(src, src_layer, num_layers) + watch(dst, dst_layer, num_layers)


# ---------------------------------------------------------------------- running a call
def run(bounds: Sequence["BoundCopy"], sides: Sequence[tuple], si: torch.Tensor, di: torch.Tensor,
        checks: Optional["Checks"], device: torch.device, maps=None) -> None:
    """Enqueue one call: its bound copies (``sides``: each one's `BoundCopy.sides`) at
    index lists ``si``, ``di`` (shapes validated by the caller), all of them or none.

    With ``checks`` (`kvtier.kernels.index_check.Checks`: the lists' names, limits, pages)
    every launch checks the lists before it moves a byte: inline, where the call is one
    launch of few programs (each program reads the lists whole; `Platform.inline_check`),
    else by one check launch of the call's own whose verdict every launch reads (the
    calling thread's words on this stream, `kvtier.kernels.faults`). A failure recorded
    by an earlier call of this thread is raised first; a failure of this call is raised
    at once where the check has run by the time the launches are enqueued (the CPU).
    ``maps``: the (source, destination) maps of each copy, or a function that makes them:
    what the torch reference copies with where Triton cannot run."""
    record = faults.ready(device)       # (a failure an earlier call left is raised here)
    n = si.numel()
    if checks is not None and checks.paged:
        checks.count(n)
    b = bounds[0]
    if b.runner != "kernel":
        return _reference_call(bounds, maps() if callable(maps) else maps, si, di, checks)
    if not n:
        return
    if checks is None:
        for b, s in zip(bounds, sides):
            b(si, di, s, UNCHECKED, si)
        return
    if len(bounds) == 1:
        grid = b.grid(n)
        if grid <= b.inline_programs:
            b(si, di, sides[0], INLINE, record.tensor, checks, grid)
            if device.type == "cpu" and record.view[0]:       # the check has run already
                faults.raise_pending(this_call=True)
            return
    words = check_launch(device, checks, si, di, bounds, sides, record, direct=b.direct is not None)
    for b, s in zip(bounds, sides):
        b(si, di, s, BY_VERDICT, words)
    if device.type == "cpu" and record.view[0]:
        faults.raise_pending(this_call=True)


def run_one(b: "BoundCopy", side: tuple, si: torch.Tensor, di: torch.Tensor, n: int, checks: "Checks",
            device: torch.device) -> None:
    """`run` of one bound copy that runs the kernel, ``n`` indices (not 0), with checks
    (the adapters' usual call, in fewer steps)."""
    record = faults.ready(device)
    if checks.paged:
        checks.count(n)
    last = b.last_grid
    grid = last[1] if last[0] == n else b.grid(n)
    if grid > b.inline_programs:
        return run((b,), (side,), si, di, checks, device)
    b(si, di, side, INLINE, record.tensor, checks, grid)
    if b.on_cpu and record.view[0]:       # the check has run already
        faults.raise_pending(this_call=True)


def _reference_call(bounds, maps, si, di, checks) -> None:
    """The call on the torch reference (no Triton, or CPU tensors without the
    interpreter): the lists checked on the host first, then every copy."""
    if checks is not None:
        check_on_host(checks, si, di)
    for b, (src, dst) in zip(bounds, maps):
        b.reference(si, di, src, dst)


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


def direct_launches() -> bool:
    """Whether kernels run compiled here and compiled kernels are kept for direct launches
    (`kvtier.kernels.direct_launch`): what a check launch asks (`check_launch`'s ``direct``)."""
    return not interpreter_active() and direct_launch.enabled()


def synchronize(device=None) -> None:
    """Wait for ``device`` and raise the first index failure a device-side check of one of
    this thread's calls found (the check point for callers that do not call again)."""
    faults.synchronize(device)


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


# ---------------------------------------------------------------------- bound copies
class Side(NamedTuple):
    """What one call passes for one side of a bound copy: the base address of a stacked
    side (as the kernel addresses it; a table side: bytes added to every entry), its
    component stride in the copy's units, and a table side's tables (the first for
    components below the map's ``table_split``, the second for the rest; unused ones are
    any int64 tensor on the device)."""

    base: int
    table: torch.Tensor
    table2: torch.Tensor
    comp_stride: int


_BOUND = Bounded(1024)      # bound copies by their layouts (docs/design.md, "Caches")


def bind(src: RowMap, dst: RowMap, *, src_layer: int, dst_layer: int, num_layers: int, by_page: bool,
         config: Optional[CopyConfig], device: torch.device, n_rows: int, skip_negative: bool = False,
         whole: tuple = (1, 1), tables: tuple = (False, False)) -> "BoundCopy":
    """The `BoundCopy` for copying about ``n_rows`` index pairs (its power-of-two bucket)
    between maps of ``src``'s and ``dst``'s layouts (`RowMap.layout_key`). ``whole``: the
    page size each side's list must come in whole runs of (1: none); ``tables``: whether
    each side's tables are checked for null or misaligned entries (tables an engine made;
    kvtier's own are right by construction). A pure function of its arguments' layouts,
    kept for the process in a bounded table (`_BOUND`); it holds no tensor."""
    if config is None:
        config = platforms.of(device).default_config(crosses_link=src.device.type != dst.device.type)
    key = (src.layout_key(), dst.layout_key(), src_layer, dst_layer, num_layers, by_page, config, device,
           1 << (max(n_rows, 1) - 1).bit_length(), bool(skip_negative), whole, tables, _runner(device.type))
    b = _BOUND.get(key)
    if b is None:
        b = _BOUND.put(key, BoundCopy(src, dst, src_layer, dst_layer, num_layers, by_page, config, device, key[8],
                                      bool(skip_negative), whole, tables))
    return b


class BoundCopy:
    """One row copy between two map layouts over a layer range, with everything but the
    addresses and the indices worked out once: the page view, the kernel's constants, the
    strides in units, how each side's tables are read. Calling it with (source indices,
    destination indices, the call's `Side` pair, check mode, word) enqueues the copy:
    the hot path of every pool and adapter. It holds no tensor.
    """

    __slots__ = ("config", "num_layers", "skip_negative", "page", "runner", "constants", "rest", "items",
                 "layers", "direct", "rows", "unit", "device", "op_bytes", "inline_programs", "whole",
                 "layouts", "check_tables", "dummy", "last_grid", "on_cpu")

    def __init__(self, src: RowMap, dst: RowMap, src_layer: int, dst_layer: int, num_layers: int,
                 by_page: bool, config: CopyConfig, device: torch.device, n_bucket: int, skip_negative: bool,
                 whole: tuple, tables: tuple):
        self.config, self.num_layers, self.device = config, num_layers, device
        self.dummy = _dummy(device)     # what stands in for a stacked side's tables
        self.last_grid = (0, 1)         # (index count, its grid) of the last launch (a layer loop's next)
        self.on_cpu = device.type == "cpu"
        self.skip_negative, self.layers, self.whole = skip_negative, (src_layer, dst_layer), whole
        self.op_bytes = src.row_bytes * src.num_components * num_layers     # per index pair, for logs
        self.page = 0
        if by_page and src.page_size > 1 and src.page_contiguous and dst.page_contiguous:
            self.page = src.page_size
            src, dst = src.pages_as_rows(), dst.pages_as_rows()
            n_bucket = max(n_bucket // self.page, 1)
        plat = _platform(device)
        s, d = _unify_chunks(src.kernel_view(plat, device), dst.kernel_view(plat, device))
        self.layouts = (layout_of(s), layout_of(d))
        self.check_tables = (bool(tables[0] and s.is_table), bool(tables[1] and d.is_table))
        self.runner = _runner(device.type)
        self.inline_programs = plat.inline_check_programs
        self.direct = None
        const = kernel_constants(s, d, n_bucket, config, threads=config.num_warps * plat.warp_threads,
                                 min_rows=plat.min_rows, min_piece_bytes=plat.min_piece_bytes)
        self.unit = const["WORD"] * const["ALIGN"]
        self.rows = const["ROWS"]
        c = const   # work items per tile of rows: one per (component, layer), and with SPLIT
        blocks = c["N_CHUNKS"] * -(-c["CHUNK_WORDS"] // c["BLOCK"]) if c.get("SPLIT") else 1
        self.items = s.num_components * num_layers * blocks
        if self.runner != "kernel":
            return
        if not interpreter_active() and direct_launch.enabled():
            self.direct = direct_launch.Launches(config.num_warps)
        u = self.unit
        scalars = (num_layers, src_layer, dst_layer, s.entry_comp, s.table_layer, d.entry_comp, d.table_layer,
                   s.layer_stride // u, s.page_stride // u, s.token_stride // u, s.chunk_stride // u,
                   d.layer_stride // u, d.page_stride // u, d.token_stride // u, d.chunk_stride // u)
        base = dict(const, SRC_TSPLIT=s.entry_split, DST_TSPLIT=d.entry_split, SKIP_NEG=skip_negative,
                    IDX_STEP=max(self.page, 1), SRC_WHOLE=whole[0], DST_WHOLE=whole[1],
                    CHECK_TABLES=any(self.check_tables), CHECK_BLOCK=CHECK_BLOCK)
        names = constexpr_names()
        # The launch arguments after the sides, per check mode.
        self.rest = tuple((*scalars, *(dict(base, CHECK=mode)[k] for k in names))
                          for mode in (UNCHECKED, BY_VERDICT, INLINE))

    # -- what a call passes
    def sides(self, src: RowMap, dst: RowMap) -> tuple:
        """The call arguments for maps ``src`` and ``dst`` (of this copy's layouts): both
        sides' `Side`, flattened as the kernel takes them."""
        if self.page:
            src, dst = src.pages_as_rows(), dst.pages_as_rows()
        plat = _platform(self.device)
        return (*self.side(src.kernel_view(plat, self.device)), *self.side(dst.kernel_view(plat, self.device)))

    def side(self, m: RowMap) -> Side:
        """`Side` of map ``m`` (as a kernel addresses it) for this copy."""
        if m.is_table:
            t = m.table_on(self.device)
            t2 = m.table2 if m.table2 is not None else t
            return Side(m.base, t, t2, m.comp_stride // self.unit)
        dummy = _dummy(self.device)
        return Side(m.base, dummy, dummy, m.comp_stride // self.unit)

    def inline_ok(self, n: int) -> bool:
        """Whether a launch for ``n`` indices checks them inline: few enough programs that
        each reading the lists whole costs less than a check launch."""
        return self.grid(n) <= self.inline_programs

    def grid(self, n: int) -> int:
        """The programs of a launch for ``n`` indices: the configuration's cap, or fewer
        where there are fewer work items."""
        last = self.last_grid
        if last[0] == n:
            return last[1]
        rows = n // self.page if self.page else n
        grid = max(1, min(self.config.num_programs, self.items * -(-rows // self.rows)))
        self.last_grid = (n, grid)
        return grid

    # -- the launch
    def __call__(self, si: torch.Tensor, di: torch.Tensor, sides: tuple, mode: int, word: torch.Tensor,
                 checks: Optional["object"] = None, grid: int = 0) -> None:
        """Enqueue the copy at index lists ``si``, ``di`` (1-D, any strides) with the
        call's ``sides``; ``mode`` UNCHECKED (``word`` any tensor), BY_VERDICT (``word``:
        the verdict the call's check launch writes) or INLINE (``word``: this thread's
        failure record; ``checks``: the lists' limits and names); ``grid``: the programs,
        where the caller worked them out. One frame from here to the launch: every pool
        and adapter call passes it."""
        n = si.numel()
        rows = n // self.page if self.page else n
        if mode == INLINE:
            args = (si, di, n, rows, si.stride(0), di.stride(0), *checks.launch_args, word, word, *sides,
                    *self.rest[2])
        else:
            args = (si, di, n, rows, si.stride(0), di.stride(0), 0, 0, 0, 0, 0, 0, word, word, *sides,
                    *self.rest[mode])
        if not grid:
            grid = self.grid(n)
        direct = self.direct
        if direct is not None:      # a compiled kernel: kept and launched directly once checked
            direct.launch(_kernel(), grid, args, direct_launch.copy_spec(args))
        else:
            direct_launch.through_triton(_kernel(), grid, args, self.config.num_warps)

    def reference(self, si: torch.Tensor, di: torch.Tensor, src: RowMap, dst: RowMap) -> None:
        """The copy between maps ``src`` and ``dst`` (of this copy's layouts) on the torch
        reference, where Triton cannot run (one warning)."""
        _warn_once(self.runner, _FALLBACK[self.runner])
        from .reference import copy_rows_reference
        if self.page:       # the reference reads page numbers
            src, dst = src.pages_as_rows(), dst.pages_as_rows()
            si, di = (si[::self.page] // self.page), (di[::self.page] // self.page)
        if self.skip_negative:
            keep = (si >= 0) & (di >= 0)
            si, di = si[keep], di[keep]
        copy_rows_reference(src, si, dst, di, src_layer=self.layers[0], dst_layer=self.layers[1],
                            num_layers=self.num_layers, check=False)


def layout_of(m: RowMap) -> RowMap:
    """``m`` without its tensors: the geometry a bound copy keeps (a table map keeps a
    placeholder table, so it still reads as one)."""
    return replace(m, segments=(), built_ptrs=(), table=_PLACEHOLDER if m.is_table else None, table2=None,
                   table_comp=m.entry_comp, table_split=m.entry_split)


_PLACEHOLDER = torch.zeros(1, dtype=torch.int64)


def _platform(device: torch.device):
    """The platform record whose launch floors, thread counts and map views apply (a seam:
    tests and the Ascend lowering checks plan as another platform here)."""
    return platforms.of(device)


_DUMMIES = {}


def _dummy(device: torch.device) -> torch.Tensor:
    """An int64 tensor on ``device`` for a pointer argument the kernel does not read."""
    t = _DUMMIES.get(device)
    if t is None:
        t = _DUMMIES[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return t
