"""The row-copy kernel's launcher.

One kernel copies rows from one row map to another at given source and destination
indices, over a range of layers and every component of the maps. Backup (device ->
host), load (host -> device), gather (scattered rows -> contiguous buffer) and scatter
are all this copy with different maps. Each side is addressed either as a stacked
buffer (base address + strides, Ascend style) or through int64 tables of per-layer base
addresses (CUDA style); the choice is a compile-time constant per side.

A `CopyLaunch` is everything one launch between two maps' *layouts* needs but the
addresses and the indices: the kernel's compile-time constants, the strides in the
copy's units, the grid rule. It holds no tensor and is a pure function of the layouts,
the layer range, the page mode, the configuration and the device (`copy_launch` keeps
them for the process by exactly that). The addresses of the maps it copies between
(`Addresses`, one per side) are worked out once by whoever holds the maps
(`kvtier.kernels.transfer.Transfer`), and every call passes its index lists, which
every launch checks before it moves a byte (`kvtier.kernels.index_check`).
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import replace
from typing import NamedTuple, Optional

import torch

import kvtier.platforms as platforms

from . import direct_launch, faults
from kvtier.config import CopyConfig
from kvtier.errors import KvtierError
from .tiling import kernel_constants, tile_copy  # noqa: F401  (tile_copy: tests and tools)
from .rowmap import RowMap
from kvtier import caches
from kvtier.warn_once import warn_once

__all__ = ["synchronize", "interpreter_active", "triton_available", "tile_copy", "CopyLaunch", "Addresses",
           "copy_launch", "UNCHECKED", "BY_VERDICT", "INLINE"]

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
        from .copy_rows_kernel import copy_rows_jit
        # The launch passes the compile-time constants by position (cheaper than by
        # keyword), in the order the kernel declares them.
        params = inspect.signature(copy_rows_jit.fn).parameters.values()
        constants = tuple(p.name for p in params if "constexpr" in str(p.annotation))
        _kernel_loaded.extend((copy_rows_jit, constants))
    return _kernel_loaded


_kernel_loaded = caches.table("kernels.launcher._kernel_loaded", factory=list, key="-",
                              value="[kernel, its constexpr parameter names], once loaded", bound="1", stale="-")


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


_FALLBACK = {
    "no-triton": "kvtier: Triton is not installed; copies run the torch reference",
    "cpu": "kvtier: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before importing "
           "triton); copies run the torch reference",
}
_RUNNERS = caches.table("kernels.launcher._RUNNERS", key="device type", value='"kernel" or "reference"',
                        bound="device types (3)", stale="not happen: decided once per process (Triton present, interpreter on)")


def runner_for(device_type: str) -> str:
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


_interpreter_problem = caches.table("kernels.launcher._interpreter_problem", factory=list, key="-",
                                    value="why Triton's interpreter cannot run here, once checked", bound="1", stale="-")


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


# ---------------------------------------------------------------------- launches
class Addresses(NamedTuple):
    """What a launch passes for one side of its copy: the base address of a stacked side
    (as the kernel addresses it; a table side: bytes added to every entry), the side's
    address tables (the first for components below the map's ``table_split``, the second
    for the rest; a stacked side passes any int64 tensor on the device) and the component
    stride in the copy's units."""

    base: int
    table: torch.Tensor
    table2: torch.Tensor
    comp_stride: int


_LAUNCHES = caches.bounded(
    "kernels.launcher._LAUNCHES", 1024,
    key="both maps' layout_key() (strides, sizes, page size, components, table form, alignment), layer range, "
        "page mode, configuration, device, rows bucket, negative skip, whole pages, table checks, runner",
    value="CopyLaunch (no tensor)", rule="nothing to invalidate (the key is everything the value reads)",
    stale="not happen: no address or tensor in it")


def copy_launch(src: RowMap, dst: RowMap, *, src_layer: int, dst_layer: int, num_layers: int, by_page: bool,
                config: Optional[CopyConfig], device: torch.device, n_rows: int, skip_negative: bool = False,
                whole: tuple = (1, 1), tables: tuple = (False, False)) -> "CopyLaunch":
    """The `CopyLaunch` for copying about ``n_rows`` index pairs (its size class: the power
    of two at or above it) between maps of ``src``'s and ``dst``'s layouts
    (`RowMap.layout_key`). ``whole``: the page size each side's list must come in whole
    runs of (1: none); ``tables``: whether each side's tables are checked for null or
    misaligned entries (tables an engine made; kvtier's own are right by construction).
    A pure function of its arguments' layouts, kept for the process (`_LAUNCHES`); it holds
    no tensor."""
    if config is None:
        config = platforms.of(device).default_config(crosses_link=src.device.type != dst.device.type)
    key = (src.layout_key(), dst.layout_key(), src_layer, dst_layer, num_layers, by_page, config, device,
           1 << (max(n_rows, 1) - 1).bit_length(), bool(skip_negative), whole, tables, runner_for(device.type))
    return _LAUNCHES.get_or_make(key, lambda: CopyLaunch(src, dst, src_layer, dst_layer, num_layers, by_page, config,
                                                         device, key[8], bool(skip_negative), whole, tables))


class CopyLaunch:
    """One row copy between two map layouts over a layer range, with everything but the
    addresses and the indices worked out once: the page view, the kernel's constants, the
    strides in units, how each side's tables are read. Calling it with (source indices,
    destination indices, both sides' `Addresses`, check mode, word) enqueues the copy.
    It holds no tensor.
    """

    __slots__ = ("config", "num_layers", "skip_negative", "page", "runner", "rest", "items", "layers", "direct",
                 "rows", "unit", "device", "op_bytes", "inline_programs", "whole", "layouts", "check_tables",
                 "dummy", "on_cpu")

    def __init__(self, src: RowMap, dst: RowMap, src_layer: int, dst_layer: int, num_layers: int,
                 by_page: bool, config: CopyConfig, device: torch.device, size_class: int, skip_negative: bool,
                 whole: tuple, tables: tuple):
        self.config, self.num_layers, self.device = config, num_layers, device
        self.dummy = _dummy(device)     # what stands in for a stacked side's tables
        self.on_cpu = device.type == "cpu"
        self.skip_negative, self.layers, self.whole = skip_negative, (src_layer, dst_layer), whole
        self.op_bytes = src.row_bytes * src.num_components * num_layers     # per index pair, for logs
        self.page = 0
        if by_page and src.page_size > 1 and src.page_contiguous and dst.page_contiguous:
            self.page = src.page_size
            src, dst = src.pages_as_rows(), dst.pages_as_rows()
            size_class = max(size_class // self.page, 1)
        plat = _platform(device)
        s, d = _unify_chunks(src.kernel_view(plat, device), dst.kernel_view(plat, device))
        self.layouts = (layout_of(s), layout_of(d))
        self.check_tables = (bool(tables[0] and s.is_table), bool(tables[1] and d.is_table))
        self.runner = runner_for(device.type)
        self.inline_programs = plat.inline_check_programs
        self.direct = None
        const = kernel_constants(s, d, size_class, config, threads=config.num_warps * plat.warp_threads,
                                 min_rows=plat.min_rows, min_piece_bytes=plat.min_piece_bytes)
        self.unit = const["WORD"] * const["ALIGN"]
        self.rows = const["ROWS"]
        c = const   # work items per tile of rows: one per (component, layer), and with SPLIT
        blocks = c["N_CHUNKS"] * -(-c["CHUNK_WORDS"] // c["BLOCK"]) if c.get("SPLIT") else 1
        self.items = s.num_components * num_layers * blocks
        if self.runner != "kernel":
            return
        if direct_launches():
            self.direct = direct_launch.Launches(config.num_warps)
        u = self.unit
        scalars = (num_layers, src_layer, dst_layer, s.entry_comp, s.table_layer, d.entry_comp, d.table_layer,
                   s.layer_stride // u, s.page_stride // u, s.token_stride // u, s.chunk_stride // u,
                   d.layer_stride // u, d.page_stride // u, d.token_stride // u, d.chunk_stride // u)
        base = dict(const, SRC_TSPLIT=s.entry_split, DST_TSPLIT=d.entry_split, SKIP_NEG=skip_negative,
                    IDX_STEP=max(self.page, 1), SRC_WHOLE=whole[0], DST_WHOLE=whole[1],
                    CHECK_TABLES=any(self.check_tables), CHECK_BLOCK=CHECK_BLOCK)
        names = (_kernel_loaded or _load_kernel())[1]      # the kernel's constexprs, in launch order
        # The launch arguments after the addresses, per check mode.
        self.rest = tuple((*scalars, *(dict(base, CHECK=mode)[k] for k in names))
                          for mode in (UNCHECKED, BY_VERDICT, INLINE))

    # -- what a launch passes
    def addresses(self, src: RowMap, dst: RowMap) -> tuple:
        """Both sides' `Addresses` for maps ``src`` and ``dst`` (of this launch's layouts),
        flattened as the kernel takes them."""
        if self.page:
            src, dst = src.pages_as_rows(), dst.pages_as_rows()
        plat = _platform(self.device)
        return (*self._addresses_of(src.kernel_view(plat, self.device)),
                *self._addresses_of(dst.kernel_view(plat, self.device)))

    def _addresses_of(self, m: RowMap) -> Addresses:
        t = m.table_on(self.device) if m.is_table else self.dummy      # (a stacked map has no table2)
        return Addresses(m.base, t, m.table2 if m.table2 is not None else t, m.comp_stride // self.unit)

    def grid(self, n: int) -> int:
        """The programs of a launch for ``n`` indices: the configuration's cap, or fewer
        where there are fewer work items."""
        rows = n // self.page if self.page else n
        return max(1, min(self.config.num_programs, self.items * -(-rows // self.rows)))

    # -- the launch
    def __call__(self, si: torch.Tensor, di: torch.Tensor, addresses: tuple, mode: int, word: torch.Tensor,
                 checks: Optional["object"] = None, grid: int = 0) -> None:
        """Enqueue the copy at index lists ``si``, ``di`` (1-D, any strides) with both
        sides' ``addresses``; ``mode`` UNCHECKED (``word`` any tensor), BY_VERDICT
        (``word``: the verdict the call's check launch writes) or INLINE (``word``: the
        calling thread's failure record; ``checks``: the lists' limits and names); ``grid``:
        the programs, where the caller worked them out."""
        n = si.numel()
        rows = n // self.page if self.page else n
        if mode == INLINE:
            args = (si, di, n, rows, si.stride(0), di.stride(0), *checks.launch_args, word, word, *addresses,
                    *self.rest[2])
        else:
            args = (si, di, n, rows, si.stride(0), di.stride(0), 0, 0, 0, 0, 0, 0, word, word, *addresses,
                    *self.rest[mode])
        if not grid:
            grid = self.grid(n)
        direct = self.direct
        if direct is not None:      # a compiled kernel: kept and launched directly once checked
            direct.launch(_kernel(), grid, args, direct_launch.copy_spec(args))
        else:
            direct_launch.through_triton(_kernel(), grid, args, self.config.num_warps)


def reference_copy(si: torch.Tensor, di: torch.Tensor, src: RowMap, dst: RowMap, src_layer: int, dst_layer: int,
                   num_layers: int, page: int, skip_negative: bool, runner: str) -> None:
    """One copy between maps ``src`` and ``dst`` on the torch reference, where Triton
    cannot run (``runner`` says why: one warning); ``page``: the copy moves whole pages of
    that many rows (the reference reads page numbers)."""
    warn_once(runner, "%s", _FALLBACK[runner], python_warning=True)
    from .reference import copy_rows_reference
    if page:
        src, dst = src.pages_as_rows(), dst.pages_as_rows()
        si, di = (si[::page] // page), (di[::page] // page)
    if skip_negative:
        keep = (si >= 0) & (di >= 0)
        si, di = si[keep], di[keep]
    copy_rows_reference(src, si, dst, di, src_layer=src_layer, dst_layer=dst_layer, num_layers=num_layers,
                        check=False)


def layout_of(m: RowMap) -> RowMap:
    """``m`` without its tensors: the geometry a launch keeps (a table map keeps a
    placeholder table, so it still reads as one)."""
    return replace(m, segments=(), built_ptrs=(), table=_PLACEHOLDER if m.is_table else None, table2=None,
                   table_comp=m.entry_comp, table_split=m.entry_split)


_PLACEHOLDER = torch.zeros(1, dtype=torch.int64)


def _platform(device: torch.device):
    """The platform record whose launch floors, thread counts and map views apply (a seam:
    tests and the Ascend lowering checks launch as another platform here)."""
    return platforms.of(device)


_DUMMIES = caches.table("kernels.launcher._DUMMIES", key="device", value="an int64[1] tensor the kernel never reads",
                        bound="devices present", stale="-")


def _dummy(device: torch.device) -> torch.Tensor:
    """An int64 tensor on ``device`` for a pointer argument the kernel does not read."""
    t = _DUMMIES.get(device)
    if t is None:
        t = _DUMMIES[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return t
