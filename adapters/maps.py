"""Engine arguments as row maps, and the one copy every engine adapter ends in.

The engine adapters (`kvtier.adapters`) take an engine's own arguments: tensors
addressed by byte arithmetic from ``item_size`` and ``layout_dim``, per-layer pointer
tables, lists of per-layer tensors, token indices wherever they live. This module turns
each of those into a `RowMap` (the layouts stay data: strides, not branches), and a
`CallShape` validates every component of a transfer before the first byte moves, then
copies them, in one launch where the components can share it.

An engine calls with the same *kind* of arguments on every batch, often new tensors
(new views of its buffers, new staging buffers). What a call works out that depends on
its arguments' layouts only (the maps' geometry, the stacking, the checks, the bound
copies) is a `CallShape`, kept for the process under a key made of the call's kind, its
scalars and its tensors' layouts (`layout_keys`: shape, strides, dtype, device, address
alignment). Each call then reads its own tensors' addresses (`Source`) and its own index
lists, which every launch checks (`kvtier.kernels.index_check`). A kept call shape holds
no tensor, so nothing an engine drops stays alive.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

import kvtier.platforms as platforms
from kvtier.bounded import Bounded
from kvtier.kernels.config import CopyConfig
from kvtier.kernels.copy_rows import _runner, interpreter_active, run, run_one, triton_available
from kvtier.kernels.errors import KvtierError, fail
from kvtier.kernels.index_check import _OFF, Checks, _env_value, checks_on
from kvtier.kernels.ops import BACKUP, LOAD, Op
from kvtier.kernels.rowmap import RowMap
from kvtier.kernels.staging import on_device
from kvtier.kernels.validate import INDEX_DTYPES, check_copy, check_dense, check_index, compute_device, index_ok
from kvtier.autotune.key import rows_bucket
from kvtier.pool.launch import DEBUG, bind_launch, log, log_launch, lookup, lookup_state

# Rows assumed behind a raw address table: it carries no size, so indices into a table
# side are checked for sign only (as the engines' own kernels do not check them at all).
UNSIZED_ROWS = 1 << 40


# ---------------------------------------------------------------- tensors by byte arithmetic
def _dense_bytes(arg: str, t, outer: int) -> int:
    """Bytes of dense tensor ``t`` (`check_dense`), which an engine kernel addresses as
    ``base + i * outer + ...``: it must be contiguous (byte arithmetic ignores strides)
    and hold at least one ``outer`` run; where it has a leading dim, that dim's stride
    must be ``outer`` (which catches an ``item_size`` given in elements rather than
    bytes), or, for a page-major buffer of 4 or more dims (see `_page_of`), a whole
    number of ``outer`` runs."""
    if not t.is_contiguous():
        raise fail(arg, tuple(t.stride()), "must be contiguous: the call addresses it by byte offsets")
    nbytes = t.numel() * t.element_size()
    if nbytes < outer:
        raise fail(arg, tuple(t.shape), f"holds {nbytes} bytes, less than one {outer}-byte row run")
    step = t.stride(0) * t.element_size() if t.dim() >= 2 and t.shape[0] > 1 else outer
    if step != outer and (t.dim() < 4 or step % outer):
        raise fail(arg, tuple(t.shape), f"rows {t.stride(0) * t.element_size()} bytes apart along dim 0; "
                   f"the call implies {outer} (item_size and layout_dim are in bytes)")
    return nbytes


def _page_of(t: torch.Tensor, item_size: int) -> int:
    """Token slots per dim-0 step of a one-layer buffer: 1 for token-major ``(N, ...)``;
    P for a page-major one whose dim 0 is the page, with the page's tokens inside it in
    another order (SGLang's HND ``(pages, H, P, D)``, ROCm's vectorized 5-D layout).
    Row ``i`` is still the bytes at ``base + i * item_size`` (SGLang's semantics), which
    move a whole page byte-exact, so such a buffer takes whole pages only."""
    if t.dim() < 4 or t.shape[0] <= 1:
        return 1
    return t.stride(0) * t.element_size() // item_size


def _positive(arg: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise fail(arg, v, "must be a positive int")
    return v


def _layers_in(layout_dim: int, item_size: int, arg: str = "layout_dim") -> int:
    _positive(arg, layout_dim)
    if layout_dim % item_size:
        raise fail(arg, layout_dim, f"must be a whole number of item_size={item_size}-byte rows")
    return layout_dim // item_size


def lf_buffer(arg: str, t: torch.Tensor, item_size: int) -> RowMap:
    """One layer, rows packed: row i at ``base + i * item_size`` (SGLang's ``lf``)."""
    _positive("item_size", item_size)
    check_dense(arg, t, "bytes")
    rows = _dense_bytes(arg, t, item_size) // item_size
    page = _page_of(t, item_size)
    rows -= rows % page
    return RowMap.from_strides(t, num_layers=1, num_rows=rows, page_size=page, row_bytes=item_size,
                               token_stride=item_size, page_stride=item_size * page, layer_stride=0)


def pf_buffer(arg: str, t: torch.Tensor, item_size: int, layout_dim: int) -> RowMap:
    """All layers of a token together: row (i, l) at ``base + i * layout_dim + l * item_size``
    (SGLang's ``pf``; ``layout_dim`` = layers x item_size bytes)."""
    _positive("item_size", item_size)
    layers = _layers_in(layout_dim, item_size)
    check_dense(arg, t, "bytes")
    rows = _dense_bytes(arg, t, layout_dim) // layout_dim
    return RowMap.from_strides(t, num_layers=layers, num_rows=rows, page_size=1, row_bytes=item_size,
                               token_stride=layout_dim, page_stride=layout_dim, layer_stride=item_size)


def ph_buffer(arg: str, t: torch.Tensor, item_size: int, layout_dim: int, page_size: int,
              head_num: int) -> RowMap:
    """The page_head layout (pages, heads, page_size, layers, head bytes): a row is
    ``head_num`` chunks, one per head (SGLang's ``ph``)."""
    _positive("item_size", item_size)
    _positive("page_size", page_size)
    _positive("head_num", head_num)
    check_dense(arg, t, "bytes")
    if item_size % head_num:
        raise fail("head_num", head_num, f"must divide item_size={item_size}")
    layers = _layers_in(layout_dim, item_size)
    head_bytes, page_bytes = item_size // head_num, page_size * layout_dim
    pages = _dense_bytes(arg, t, page_bytes) // page_bytes
    return RowMap.from_strides(t, num_layers=layers, num_rows=pages * page_size, page_size=page_size,
                               row_bytes=item_size, token_stride=layout_dim // head_num,
                               page_stride=page_bytes, layer_stride=head_bytes, n_chunks=head_num,
                               chunk_stride=page_size * layout_dim // head_num)


def layer_table(arg: str, layers, item_size: int, num_layers: int, exact: bool = True) -> RowMap:
    """Per-layer bases: a uint64/int64 address table (rows packed, ``item_size`` apart, no
    size known) or, as an extension, a list of per-layer tensors (sizes checked). The
    source table must list exactly ``num_layers`` layers (SGLang checks that too); a
    destination (``exact=False``) may list more.

    What a table is trusted with (docs/adapters.md, "What kvtier trusts about pointer
    tables"): every address stays a live buffer of at least (largest index + 1) x
    ``item_size`` bytes until the call's copies have run (kvtier holds the table, not the
    buffers). Every launch reads the table as it is then (kvtier keeps no copy of it) and
    refuses a null or misaligned entry before it moves a byte."""
    _positive("item_size", item_size)
    _positive("num_layers", num_layers)
    count = layers.numel() if isinstance(layers, torch.Tensor) and layers.dim() == 1 else (
        len(layers) if isinstance(layers, (list, tuple)) else None)
    if count is not None and (count < num_layers or (exact and count != num_layers)):
        raise fail(f"{arg}.size(0)", count, f"does not match num_layers={num_layers}")
    if isinstance(layers, torch.Tensor):
        try:
            return RowMap.engine_table(layers, row_bytes=item_size, num_rows=UNSIZED_ROWS)
        except KvtierError as e:
            raise KvtierError(f"{arg}: {e}") from None
    m = per_layer_list(arg, layers)
    if m.row_bytes != item_size:
        raise fail("item_size", item_size, f"the rows of {arg} are {m.row_bytes} bytes")
    return m


def per_layer_list(arg: str, layers: Sequence[torch.Tensor], page_size: int = 1) -> RowMap:
    """A list of per-layer tensors ``(N, *row)``; with ``page_size`` > 1 only whole pages
    are mapped (a trailing partial page cannot hold a page)."""
    if isinstance(layers, torch.Tensor) or not isinstance(layers, (list, tuple)) or not layers:
        raise fail(arg, type(layers).__name__, "must be a non-empty list of per-layer tensors")
    if page_size > 1:
        layers = [t[: t.shape[0] // page_size * page_size] if isinstance(t, torch.Tensor) and t.dim() else t
                  for t in layers]
    try:
        return RowMap.from_layers(list(layers), page_size=page_size)
    except KvtierError as e:
        raise KvtierError(f"{arg}: {e}") from None


def page_count(indices_numel: int, page_size: int, arg: str = "src_indices") -> None:
    """The direct and Ascend calls move whole pages: the index count must be a multiple."""
    _positive("page_size", page_size)
    if indices_numel % page_size:
        raise fail(f"len({arg})", indices_numel, f"must be a multiple of page_size={page_size}")


# ---------------------------------------------------------------- indices
def _index(arg: str, idx, device: torch.device) -> torch.Tensor:
    """``idx`` checked for shape (a tensor, int32/int64, 1-D, strided) and on ``device``
    (staged there from another device without waiting, `kvtier.kernels.staging`)."""
    if index_ok(idx, device):
        return idx
    check_index(arg, idx, idx.device if isinstance(idx, torch.Tensor) else device)
    return on_device(idx, device, arg)


def indices(src_indices, dst_indices, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both index lists checked for shape and on ``device`` (`_index`), of equal counts."""
    si, di = _index("src_indices", src_indices, device), _index("dst_indices", dst_indices, device)
    if si.numel() != di.numel():
        raise fail("dst_indices", f"{di.numel()} indices", f"src_indices has {si.numel()}; counts must match")
    return si, di


# ---------------------------------------------------------------- the copy
Pair = Tuple[RowMap, RowMap]
# One layer map over some component pairs: (pairs, src_layer, dst_layer, num_layers).
Job = Tuple[Sequence[Pair], int, int, Optional[int]]


def run_copy(pairs: Sequence[Pair], src_indices, dst_indices, *, src_layer: int = 0,
             dst_layer: int = 0, num_layers: Optional[int] = None, **kw) -> "CallShape":
    """Copy every (src, dst) component pair over one layer map at the same indices."""
    return run_jobs([(pairs, src_layer, dst_layer, num_layers)], src_indices, dst_indices, **kw)


def run_jobs(jobs: Sequence[Job], src_indices, dst_indices, *, op: Op, by_page: bool = False,
             skip_negative: bool = False, config=None, block_quota: Optional[int] = None,
             check: Optional[bool] = None, index_names: Tuple[str, str] = ("src_indices", "dst_indices"),
             table_names: Tuple[str, str] = ("src table", "dst table"), args: tuple = (),
             arg_names: tuple = ()) -> "CallShape":
    """Copy several jobs (each its own layer map, as the Ascend indexer cache has) at the
    same indices, validated as one `CallShape` and run; returns the call shape. ``args``:
    the call's tensors (and lists of tensors) the maps were built from (``arg_names``:
    how the caller names them): the call shape learns where each map's addresses come
    from in them, so a later call with arguments of the same layouts runs it again without
    building a map (`call`)."""
    shape = CallShape(jobs, src_indices, dst_indices, op, by_page, skip_negative, config, block_quota,
                      index_names, table_names, args, arg_names)
    shape.run(args, src_indices, dst_indices, check, lambda: jobs)
    return shape


class Source(NamedTuple):
    """Where one side's addresses come from in a call's arguments (flattened: lists of
    tensors count element by element): a stacked side's first component base is
    ``flat[base].data_ptr() + base_offset`` and its second ``flat[second].data_ptr() +
    second_offset`` (the component stride is their difference; ``second`` -1: the map's
    own stride); a table side reads ``flat[base]`` (from entry ``base_offset`` on) and,
    past its split, ``flat[second]``; a side whose table kvtier made from per-layer
    tensors takes their addresses (``layers``: their positions and byte offsets)."""

    kind: str                    # "stacked", "table" or "layers"
    base: int = -1
    base_offset: int = 0
    second: int = -1
    second_offset: int = 0
    comp_stride: int = 0
    layers: tuple = ()
    entry_offset: int = 0       # a table side: bytes added to every entry
    translate: bool = False     # a stacked side in host memory a device kernel reads (by its kernel address)


def _flat(args) -> list:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _flat_names(args, names) -> list:
    """``names`` (one per argument) as `_flat` lays the arguments out: a list's elements
    named by their index."""
    out = []
    for i, a in enumerate(args):
        name = names[i] if i < len(names) else f"argument {i}"
        if isinstance(a, (list, tuple)):
            out.extend(f"{name}[{j}]" for j in range(len(a)))
        else:
            out.append(name)
    return out


def _position(flat: list, t: torch.Tensor, addr: int) -> Tuple[int, int]:
    """(position in ``flat``, byte offset) of the argument a map's address ``addr`` (in
    tensor ``t``) comes from: the argument itself, else one starting at ``addr``, else one
    holding it in the same storage; (-1, 0) where none does."""
    for i, a in enumerate(flat):
        if a is t:
            return i, addr - a.data_ptr()
    tensors = [(i, a) for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    for i, a in tensors:
        if a.data_ptr() == addr:
            return i, 0
    try:
        storage = t.untyped_storage().data_ptr()
    except (RuntimeError, AttributeError):
        return -1, 0
    for i, a in tensors:
        try:
            same = a.untyped_storage().data_ptr() == storage
        except RuntimeError:
            continue
        if same and a.data_ptr() <= addr < a.data_ptr() + max(a.numel() * a.element_size(), 1):
            return i, addr - a.data_ptr()
    return -1, 0


def _source(m: RowMap, flat: list) -> Optional[Source]:
    """Where ``m``'s addresses come from in the arguments ``flat``; None where they do
    not (a map of memory no argument holds: the call shape is then not kept)."""
    if m.is_table and not m.table_trusted:
        first, off = _position(flat, m.table, m.table.data_ptr())
        second, off2 = -1, 0
        if m.table2 is not None:
            second, off2 = _position(flat, m.table2, m.table2.data_ptr())
            if second < 0 or off2 % 8:
                return None
        if first < 0 or off % 8:
            return None
        return Source("table", first, off // 8, second, off2 // 8, m.comp_stride, entry_offset=m.base)
    if m.is_table:      # kvtier's own table of per-layer tensors' bases
        if len(m.segments) != m.num_components * m.num_layers:
            return None
        layers = []
        for t, addr in m.segments:
            pos, off = _position(flat, t, addr)
            if pos < 0:
                return None
            layers.append((pos, off))
        return Source("layers", layers=tuple(layers), comp_stride=m.comp_stride)
    if not m.segments:
        return None
    t0, a0 = m.segments[0]
    first, off = _position(flat, t0, m.base)
    if first < 0:
        return None
    if m.num_components == 1:
        return Source("stacked", first, off, comp_stride=m.comp_stride)
    if len(m.segments) != m.num_components or m.num_components != 2:
        # Components in one allocation at a fixed stride: the first one's base says it all.
        return Source("stacked", first, off, comp_stride=m.comp_stride) if _one_storage(m) else None
    t1, _ = m.segments[1]
    second, off1 = _position(flat, t1, m.base + m.comp_stride)
    if second < 0:
        return None
    return Source("stacked", first, off, second, off1)


def _translated(src: Optional[Source], flat: list, device: torch.device) -> Optional[Source]:
    """``src``, marked where its stacked base is host memory a device kernel reads (its
    address is then the one the platform gives kernels, checked per call)."""
    if src is None or src.kind != "stacked" or device.type == "cpu" or flat[src.base].device.type != "cpu":
        return src
    return src._replace(translate=True)


def _one_storage(m: RowMap) -> bool:
    try:
        return len({t.untyped_storage().data_ptr() for t, _ in m.segments}) == 1
    except RuntimeError:
        return False


class CallShape:
    """One adapter call shape: its jobs' component pairs stacked into launches and
    validated (layers, rows, reachability), the index checks (names, limits, whole
    pages, negatives), where each launch's addresses come from in the call's arguments
    (`Source`), and per rows bucket the bound copies with their tuned configurations.
    Built from the first call of the shape (whose indices validate the pairs); holds no
    tensor."""

    def __init__(self, jobs, src_indices, dst_indices, op: Op, by_page: bool, skip_negative: bool, config,
                 block_quota, index_names: Tuple[str, str], table_names: Tuple[str, str], args: tuple,
                 arg_names: tuple = ()):
        if config is not None and not isinstance(config, CopyConfig):
            raise fail("config", type(config).__name__, "must be a kvtier CopyConfig (or None for the tuned one)")
        try:
            maps = [m for pairs, *_ in jobs for p in pairs for m in p]
            self.device = _DEVICES.setdefault(compute_device(*maps), compute_device(*maps))
            si, di = indices(src_indices, dst_indices, self.device)
            plans = []
            for pairs, src_layer, dst_layer, num_layers in jobs:
                for s, d in _stacked(list(pairs)):
                    _, n_layers = check_copy(s, si, d, di, src_layer, dst_layer, num_layers, by_page,
                                             check_values=False)
                    plans.append((s, d, src_layer, dst_layer, n_layers))
        except KvtierError as e:
            raise _renamed(e, index_names) from None
        srcs, dsts = [p[0] for p in plans], [p[1] for p in plans]
        self.whole = (_whole_pages(srcs[0], by_page), _whole_pages(dsts[0], by_page))
        self.checks = Checks.of((index_names[0], min(m.num_rows for m in srcs), self.whole[0]),
                                (index_names[1], min(m.num_rows for m in dsts), self.whole[1]),
                                skip_negative, table_names)
        self.quota = None if block_quota is None else _positive("block_quota", block_quota)
        _require_runnable(maps, self.device)
        self.op, self.by_page, self.config, self.skip_negative = op, by_page, config, bool(skip_negative)
        self.index_names = index_names
        flat = _flat(args)
        self.flat_args = not any(isinstance(a, (list, tuple)) for a in args)     # no list among the arguments
        self.sources = [(_translated(_source(p[0], flat), flat, self.device),
                         _translated(_source(p[1], flat), flat, self.device)) for p in plans]
        self.keepable = all(s is not None and d is not None for s, d in self.sources)
        # Both sides of every launch stacked in the call's own tensors, no address to
        # translate: each side's (position, offset, second position, its offset, stride).
        self.stacked = [(s.base, s.base_offset, s.second, s.second_offset, s.comp_stride,
                         d.base, d.base_offset, d.second, d.second_offset, d.comp_stride)
                        for s, d in self.sources] if self.keepable and all(
            x.kind == "stacked" and not x.translate for pair in self.sources for x in pair) else None
        # The one launch of such a call, read off arguments that are all tensors (`run`'s
        # fewest steps), else None.
        self.single = self.stacked[0] if self.stacked is not None and len(plans) == 1 and self.flat_args else None
        # The bytes each argument the addresses come from must own from its first byte
        # (a storage freed, shrunk or moved in place under the same shape is refused).
        names = _flat_names(args, arg_names)
        used = sorted({p for src in self.sources if src is not None for side in src if side is not None
                       for p in _positions(side)})
        self.spans = tuple((p, _span(flat[p]), names[p] if p < len(names) else f"argument {p}") for p in used)
        self.plans = plans          # (maps: dropped by `forget_maps` once the shape is kept)
        self.layouts = [(p[0].layout_key(), p[1].layout_key()) for p in plans]
        self.bounds = Bounded(64)   # bound copies by rows bucket and lookup state
        self.last = None        # (n, lookup state, bound copies) of the last call

    def forget_maps(self) -> None:
        """Drop the maps the shape was built from (and the tensors they hold): a kept shape
        takes every address from its call's arguments."""
        self.plans = [(_layout_only(s), _layout_only(d), sl, dl, nl) for s, d, sl, dl, nl in self.plans]

    def bound(self, n: int) -> list:
        """The bound copies for ``n`` index pairs (per rows bucket, under the current
        lookup state)."""
        state = lookup_state()
        last = self.last
        if last is not None and last[0] == n and last[1] == state:    # a per-layer loop's next call
            return last[2]
        key = (rows_bucket(n), *state)
        found = self.bounds.get(key)
        if found is None:
            found = []
            for s, d, sl, dl, nl in self.plans:
                cfg = self.config or lookup(self.op, s, d, n, nl)
                if self.quota is not None:
                    cfg = replace(cfg, num_programs=self.quota)
                found.append(bind_launch(self.op, s, d, src_layer=sl, dst_layer=dl, num_layers=nl, n_rows=n,
                                         by_page=self.by_page, config=cfg, skip_negative=self.skip_negative,
                                         whole=self.whole, tables=(not s.table_trusted, not d.table_trusted)))
            self.bounds.put(key, found)
        self.last = (n, state, found)
        return found

    def run(self, args: tuple, src_indices, dst_indices, check: Optional[bool], rebuild: Callable,
            ptrs: Optional[list] = None) -> None:
        """One call: the lists checked for shape and put where the copy runs, each launch's
        addresses read off ``args`` (``ptrs``: their tensors' first bytes, flattened,
        where the caller read them already), every launch enqueued with the value checks
        (or none, with checks off). ``rebuild()``: the call's jobs, for the torch
        reference. A layer loop's next call (one launch, both sides in the call's own
        tensors, the lists where the copy runs) takes the fewest steps; `_run` does the
        rest."""
        si, di, last, device = src_indices, dst_indices, self.last, self.device
        # (`index_ok` of both, and the kept bound copy of this count: `bound`, inline)
        if (ptrs is None or self.single is None or last is None or type(si) is not _TENSOR
                or type(di) is not _TENSOR or si.device != device or di.device != device
                or si.dtype not in INDEX_DTYPES or di.dtype not in INDEX_DTYPES or si.dim() != 1 or di.dim() != 1
                or si.layout is not _STRIDED or di.layout is not _STRIDED or last[0] != si.numel()
                or last[0] != di.numel() or last[1] != lookup_state() or log.isEnabledFor(DEBUG)
                or not (check if check is not None else _env_value() != _OFF)):
            return self._run(args, si, di, check, rebuild, ptrs)
        b = last[2][0]
        for p, span, name in self.spans:       # (a tensor's first byte is never below its storage's)
            st = args[p].untyped_storage()
            first = ptrs[p]
            if first + span > st.data_ptr() + st.nbytes() or not first:
                _owns(args[p], span, name)        # (names what is wrong)
        sp, so, sp2, so2, sc, dp, do, dp2, do2, dc = self.single
        u, dummy, sb, db = b.unit, b.dummy, ptrs[sp] + so, ptrs[dp] + do
        side = (sb, dummy, dummy, (ptrs[sp2] + so2 - sb) // u if sp2 >= 0 else sc // u,
                db, dummy, dummy, (ptrs[dp2] + do2 - db) // u if dp2 >= 0 else dc // u)
        try:
            run_one(b, side, si, di, last[0], self.checks, device)
        except KvtierError as e:
            raise _renamed(e, self.index_names) from None

    def _run(self, args: tuple, si, di, check: Optional[bool], rebuild: Callable, ptrs: Optional[list]) -> None:
        """`run`, every case."""
        device = self.device
        if not (index_ok(si, device) and index_ok(di, device) and si.numel() == di.numel()):
            try:
                si, di = indices(si, di, device)
            except KvtierError as e:
                raise _renamed(e, self.index_names) from None
        n = si.numel()
        if not n:
            return
        bounds = self.bound(n)
        if bounds[0].runner != "kernel":
            sides = [()] * len(bounds)
        elif self.keepable:         # every address from the call's own arguments
            flat = args if self.flat_args else _flat(args)
            if ptrs is None:
                ptrs = [t.data_ptr() if isinstance(t, _TENSOR) else 0 for t in flat]
            for p, span, name in self.spans:
                _owns(flat[p], span, name)
            if self.stacked is not None:    # both sides stacked, in the call's own tensors (SGLang's buffers)
                sides = []
                for b, (sp, so, sp2, so2, sc, dp, do, dp2, do2, dc) in zip(bounds, self.stacked):
                    u, dummy, sb, db = b.unit, b.dummy, ptrs[sp] + so, ptrs[dp] + do
                    sides.append((sb, dummy, dummy, (ptrs[sp2] + so2 - sb) // u if sp2 >= 0 else sc // u,
                                  db, dummy, dummy, (ptrs[dp2] + do2 - db) // u if dp2 >= 0 else dc // u))
            else:
                sides = [(*_side(b, src, flat, ptrs), *_side(b, dst, flat, ptrs))
                         for b, (src, dst) in zip(bounds, self.sources)]
        else:                       # a shape made for this call alone: its own maps'
            sides = [b.sides(p[0], p[1]) for b, p in zip(bounds, self.plans)]
        if log.isEnabledFor(DEBUG):
            for b in bounds:
                log_launch(self.op, b.config.strategy, b.config, n, n * b.op_bytes)
        try:
            run(bounds, sides, si, di, self.checks if checks_on(check) else None, device,
                None if bounds[0].runner == "kernel" else _stacked_pairs(rebuild()))
        except KvtierError as e:
            raise _renamed(e, self.index_names) from None


def _positions(src: Source) -> tuple:
    """The argument positions ``src`` reads addresses from."""
    if src.kind == "layers":
        return tuple(p for p, _ in src.layers)
    return tuple(p for p in (src.base, src.second) if p >= 0)


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last (its strides followed)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _owns(t: torch.Tensor, span: int, name: str) -> None:
    """``t``'s storage holds the ``span`` bytes from its first, or `KvtierError` names it
    (one storage read: a tensor whose storage was freed, shrunk or moved in place keeps
    its shape)."""
    st = t.untyped_storage()
    first, start = t.data_ptr(), st.data_ptr()
    if first < start or first + span > start + st.nbytes() or not first:
        raise fail(name, tuple(t.shape), f"its elements need {span} bytes but its storage holds "
                   f"{st.nbytes()} from {start:#x} (freed or shrunk in place)")


def _stacked_pairs(jobs) -> List[Pair]:
    return [pair for pairs, *_ in jobs for pair in _stacked(list(pairs))]


def _side(bound, src: Source, flat: list, ptrs: list) -> tuple:
    """One side's launch arguments (`kvtier.kernels.copy_rows.Side`) from the call's
    arguments (``ptrs``: their first bytes)."""
    kind = src.kind
    if kind == "stacked":
        base = ptrs[src.base] + src.base_offset
        if src.second >= 0:
            comp = (ptrs[src.second] + src.second_offset - base) // bound.unit
        else:
            comp = src.comp_stride // bound.unit
        if src.translate:
            base = _kernel_address(bound, flat[src.base], base)
        return base, bound.dummy, bound.dummy, comp
    if kind == "table":
        t = flat[src.base]
        if src.base_offset:
            t = t[src.base_offset:]
        t2 = flat[src.second] if src.second >= 0 else t
        if src.second_offset:
            t2 = t2[src.second_offset:]
        return src.entry_offset, t, t2, src.comp_stride // bound.unit
    # kvtier's table of per-layer tensors' bases, made for these addresses (kept by them)
    addrs = tuple(ptrs[p] + off for p, off in src.layers)
    return 0, _table_of(addrs, bound.device), bound.dummy, src.comp_stride // bound.unit


def _kernel_address(bound, t: torch.Tensor, addr: int) -> int:
    """``addr`` (in ``t``) as the copy's kernel addresses it: host memory through its
    registered device address where the platform needs one (Ascend)."""
    if t.device.type == "cpu" and bound.device.type != "cpu":
        plat = platforms.of(bound.device)
        kernel = plat.host_address(t)
        if kernel is None:
            raise KvtierError(f"host buffer {tuple(t.shape)}: {plat.unreachable}")
        return kernel + (addr - t.data_ptr())
    return addr


_TABLES = Bounded(256)      # int64 tables by their addresses (docs/design.md, "Caches")


def _table_of(addrs: tuple, device: torch.device) -> torch.Tensor:
    """An int64 table of ``addrs`` on ``device``: made once per addresses (a pure function
    of them)."""
    key = (addrs, device)
    t = _TABLES.get(key)
    if t is None:
        t = torch.tensor(addrs, dtype=torch.int64)
        if device.type != "cpu":
            t = t.pin_memory().to(device, non_blocking=True)
        _TABLES.put(key, t)
    return t


def _layout_only(m: RowMap) -> RowMap:
    from kvtier.kernels.copy_rows import layout_of
    return layout_of(m)


_DEVICES = {}


def _renamed(e: KvtierError, names: Tuple[str, str]) -> KvtierError:
    """``e`` with the index arguments named as the caller names them."""
    if names == ("src_indices", "dst_indices"):
        return e
    mapping = dict(zip(("src_indices", "dst_indices"), names))
    return KvtierError(re.sub(r"\b(src|dst)_indices\b", lambda m: mapping[m.group(0)], str(e)))


# ---------------------------------------------------------------- call shapes by argument layouts
# An engine calls with the same kind of buffers, scalars and tables on every batch. `call`
# finds the call's `CallShape` by a key made from those arguments' layouts alone, so a
# repeated call builds no map and looks none up.
UNCACHED = object()     # in a key: an argument that cannot be keyed; the call takes the slow path
_PLAIN = (int, type(None), CopyConfig)
_SHAPES = Bounded(1024)     # call shapes by their arguments' layouts (docs/design.md, "Caches")
_TENSOR = torch.Tensor
_STRIDED = torch.strided


def dense_keys(tensors: tuple, ptrs: list) -> tuple:
    """`layout_keys` of tensors the call addresses by byte offsets, which must be
    contiguous (their strides follow from their shapes; a strided one is named by the
    full path and never kept): each one's shape, contiguity, dtype, device (index, and
    whether it is the CPU's: cheaper to read and hash than a torch.device) and first
    byte's alignment. ``ptrs`` receives each one's first byte."""
    key = ()
    try:
        for t in tensors:
            if type(t) is not _TENSOR and not isinstance(t, _TENSOR):
                return (UNCACHED,)
            p = t.data_ptr()
            key += (t.shape, t.is_contiguous(), t.dtype, t.get_device(), t.is_cpu, p & 15)
            ptrs.append(p)
    except RuntimeError:        # no storage (sparse and such): the full path names it
        return (UNCACHED,)
    return key


def layout_keys(tensors: tuple, ptrs: Optional[list] = None) -> tuple:
    """What the maps built from ``tensors`` depend on, as one flat tuple: each one's shape,
    strides, dtype, device and first byte's alignment (its address modulo 16: the copy's
    accesses assume it). Lists of tensors count element by element. ``(UNCACHED,)``
    where one is not a tensor with storage. ``ptrs``: a list that receives each tensor's
    first byte, flattened as `_flat` lays them out (what the call passes `CallShape.run`)."""
    key = ()
    try:
        for t in tensors:       # (one loop of bound calls: cheaper than a map per attribute)
            if type(t) is _TENSOR or isinstance(t, _TENSOR):
                p = t.data_ptr()
                key += (t.shape, t.stride(), t.dtype, t.device, p & 15)
                if ptrs is not None:
                    ptrs.append(p)
            elif isinstance(t, (list, tuple)):
                inner = layout_keys(t, ptrs)
                if inner[:1] == (UNCACHED,):
                    return (UNCACHED,)
                key += (len(t), *inner)
            else:
                return (UNCACHED,)
    except RuntimeError:        # no storage (sparse and such): the full path names it
        return (UNCACHED,)
    return key


def plain(*values) -> tuple:
    """``values`` for a key where each is an exact int, None or a `CopyConfig`; else a
    key part that is never kept (True == 1 and 1.0 == 1 must not find an int's shape)."""
    for v in values:
        if type(v) not in _PLAIN:
            return (UNCACHED,)
    return values


def call(key: tuple, args: tuple, src_indices, dst_indices, check: Optional[bool],
         build: Callable[[], "CallShape"], ptrs: Optional[list] = None) -> None:
    """One adapter call whose maps and options depend on nothing but ``key`` (the call's
    kind, its `plain` scalars, the `layout_keys` of ``args``, its tensors): a call whose
    key was seen runs the `CallShape` kept under it, building no map; otherwise
    ``build()`` runs the call through `run_jobs` (with ``args``) and returns its shape,
    kept unless the key holds `UNCACHED` or its addresses cannot be read off the
    arguments. ``ptrs``: the arguments' first bytes as `layout_keys` gave them."""
    try:
        found = _SHAPES.get(key)
    except TypeError:                 # an unhashable argument: the full path names it
        found, key = None, (UNCACHED,)
    if found is not None:
        found.run(args, src_indices, dst_indices, check, _rebuild, ptrs)
        return
    shape = build()
    if UNCACHED not in key and shape.keepable and _runner(shape.device.type) == "kernel":
        shape.forget_maps()
        _SHAPES.put(key, shape)


def _rebuild():
    raise KvtierError("internal: a kept call shape on the torch reference")


def _stacked(pairs: List[Pair]) -> List[Pair]:
    """One pair of maps for all components where both sides can be joined: in one
    allocation by a component stride, else by the step between their bases (stacked) or
    as two tables (an engine's), else by a table of their bases; else the pairs as
    they are."""
    if len(pairs) == 1:
        return pairs
    src, dst = (_join([p[i] for p in pairs]) for i in (0, 1))
    return [(src, dst)] if src is not None and dst is not None else pairs


def _join(maps: List[RowMap]) -> Optional[RowMap]:
    return RowMap.stack(maps) or RowMap.join(maps) or RowMap.stack_as_table(maps)


def _whole_pages(m: RowMap, by_page: bool) -> int:
    """The page size a side's indices must come in whole runs of: the map's where the call
    moves pages, or where the side is a one-layer packed-rows map over a page-major buffer
    (its page's tokens in another order, see `_page_of`); else 1."""
    paged_lf = m.num_layers == 1 and m.n_chunks == 1 and m.page_size > 1 and m.token_stride == m.row_bytes
    return m.page_size if by_page or paged_lf else 1


def direction(pairs: Sequence[Pair]) -> Op:
    """A call that moves either way (the direct calls): backup when the destination is
    host memory and the source is not, else load."""
    src, dst = pairs[0]
    return BACKUP if dst.device.type == "cpu" and src.device.type != "cpu" else LOAD


def _require_runnable(maps: Sequence[RowMap], device: torch.device) -> None:
    """A map built from a bare address table has no tensors for the torch reference to
    read; say so (before any byte moves) where the reference would have to run."""
    kernel_runs = triton_available() and (device.type != "cpu" or interpreter_active())
    if not kernel_runs and any(m.is_table and not m.segments for m in maps):
        raise KvtierError("a pointer table side needs the Triton kernel (the torch reference "
                          "cannot read raw addresses); install Triton, or pass per-layer tensors")
