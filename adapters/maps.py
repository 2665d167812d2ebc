"""Engine arguments as row maps, and the one copy every engine adapter ends in.

The engine adapters (`kvtier.adapters`) take an engine's own arguments: tensors
addressed by byte arithmetic from ``item_size`` and ``layout_dim``, per-layer pointer
tables, lists of per-layer tensors, token indices wherever they live. This module turns
each of those into a `RowMap` (the layouts stay data: strides, not branches), and
`run_copy` validates every component of a transfer before the first byte moves, then
copies them, in one launch where the components can share it.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from kvtier.kernels.config import CopyConfig
import kvtier.platforms as platforms
from kvtier.kernels.copy_rows import GUARD, interpreter_active, triton_available
from kvtier.kernels.index_check import checks_on
from kvtier.kernels.index_memo import LastPair, facts, last_pair, on_device
from kvtier.kernels.ops import BACKUP, LOAD, Op
from kvtier.kernels.errors import KvtierError, fail
from kvtier.kernels.rowmap import RowMap, keep as _keep, kept as _kept, tensor_key as _tensor_key
from kvtier.kernels.validate import check_copy, check_dense, check_index, compute_device, index_ok
from kvtier.autotune.key import rows_bucket
from kvtier.pool import launch as launcher
from kvtier.pool.launch import bind_launch, lookup, lookup_state

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
    _positive("item_size", item_size)   # before the lookup: 32.0 == 32 would find an int's map
    check_dense(arg, t, "bytes")
    return _kept(("lf", arg, item_size, *_tensor_key(t)), lambda: _lf_buffer(arg, t, item_size))


def _lf_buffer(arg: str, t: torch.Tensor, item_size: int) -> RowMap:
    _positive("item_size", item_size)
    rows = _dense_bytes(arg, t, item_size) // item_size
    page = _page_of(t, item_size)
    rows -= rows % page
    return RowMap.from_strides(t, num_layers=1, num_rows=rows, page_size=page, row_bytes=item_size,
                               token_stride=item_size, page_stride=item_size * page, layer_stride=0)


def pf_buffer(arg: str, t: torch.Tensor, item_size: int, layout_dim: int) -> RowMap:
    """All layers of a token together: row (i, l) at ``base + i * layout_dim + l * item_size``
    (SGLang's ``pf``; ``layout_dim`` = layers x item_size bytes)."""
    _positive("item_size", item_size)   # before the lookup, as in lf_buffer
    _layers_in(layout_dim, item_size)
    check_dense(arg, t, "bytes")
    return _kept(("pf", arg, item_size, layout_dim, *_tensor_key(t)),
                 lambda: _pf_buffer(arg, t, item_size, layout_dim))


def _pf_buffer(arg: str, t: torch.Tensor, item_size: int, layout_dim: int) -> RowMap:
    _positive("item_size", item_size)
    layers = _layers_in(layout_dim, item_size)
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
    buffers). A table is read once per version of its tensor (`_table_map`): a write
    through torch is seen at the next call; a write that bypasses torch's version counter
    (a numpy view, DLPack, a raw pointer; any write to an inference-mode table) is not,
    and the map kept from the earlier read is used as it was."""
    _positive("item_size", item_size)
    _positive("num_layers", num_layers)
    count = layers.numel() if isinstance(layers, torch.Tensor) and layers.dim() == 1 else (
        len(layers) if isinstance(layers, (list, tuple)) else None)
    if count is not None and (count < num_layers or (exact and count != num_layers)):
        raise fail(f"{arg}.size(0)", count, f"does not match num_layers={num_layers}")
    if isinstance(layers, torch.Tensor):
        try:
            return _table_map(layers, item_size)
        except KvtierError as e:
            raise KvtierError(f"{arg}: {e}") from None
    m = per_layer_list(arg, layers)
    if m.row_bytes != item_size:
        raise fail("item_size", item_size, f"the rows of {arg} are {m.row_bytes} bytes")
    return m


def _table_map(table: torch.Tensor, item_size: int) -> RowMap:
    """`RowMap.from_table`, kept for the table tensor (`kvtier.kernels.index_memo`):
    reading a table costs a device sync, and an engine passes the same tables on every
    call. Built again when the table has been written through torch since (its version
    changed). Kept by address too, for what has no version to go by: a table made in
    inference mode (trusted not to be rewritten in place: pass a new table instead), and
    any table while a graph is being captured (the map made before the capture is used;
    reading a table there would sync)."""
    known = facts(table)
    m = known.get(("table", item_size)) if known is not None else None
    if m is not None:
        return m
    by_address = ("table", item_size, *_tensor_key(table))
    if known is None:
        return _kept(by_address, lambda: RowMap.from_table(table, row_bytes=item_size, num_rows=UNSIZED_ROWS))
    m = known[("table", item_size)] = _keep(
        by_address, RowMap.from_table(table, row_bytes=item_size, num_rows=UNSIZED_ROWS))
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


# ---------------------------------------------------------------- indices
def indices(src_indices, dst_indices, device: torch.device, keep: bool = True) -> tuple:
    """Both index lists checked for shape (tensor, int32/int64, 1-D, equal lengths) and
    moved to the device where the copy runs (asynchronously, once per unchanged list:
    `kvtier.kernels.index_memo.on_device`): (src, dst, their facts) where the facts are
    the `kvtier.kernels.index_memo.facts` dicts (None where nothing is kept). Where a
    checked list lives is kept in its facts per device, so a per-layer loop checks it
    once; ``keep=False`` (an all-layer call's lists, seen once) keeps nothing."""
    if keep:
        fs = facts(src_indices) if type(src_indices) is torch.Tensor else None
        fd = facts(dst_indices) if type(dst_indices) is torch.Tensor else None
    else:
        fs = fd = None
    if fs is None or fs.get(device) is not _HERE:
        src_indices, fs = _index("src_indices", src_indices, fs, device, keep)
    if fd is None or fd.get(device) is not _HERE:
        dst_indices, fd = _index("dst_indices", dst_indices, fd, device, keep)
    if src_indices.numel() != dst_indices.numel():
        raise fail("dst_indices", f"{dst_indices.numel()} indices",
                   f"src_indices has {src_indices.numel()}; counts must match")
    return src_indices, dst_indices, fs, fd


_HERE, _STAGED = "here", "staged"     # where a checked list lives, kept in its facts per device


def _index(arg: str, idx, known: Optional[dict], device: torch.device, keep: bool = True):
    """(``idx`` checked and on ``device``, its facts) for a list not yet known to be
    there."""
    where = known.get(device) if known is not None else None
    if where is None:
        if index_ok(idx, device):
            where = _HERE
        else:
            check_index(arg, idx, idx.device if isinstance(idx, torch.Tensor) else device)
            where = _HERE if idx.device == device else _STAGED
        if known is not None:
            known[device] = where
    if where is _HERE:
        return idx, known
    staged = on_device(idx, device, keep, arg)
    return staged, facts(staged) if keep else None


def page_count(indices_numel: int, page_size: int, arg: str = "src_indices") -> None:
    """The direct and Ascend calls move whole pages: the index count must be a multiple."""
    _positive("page_size", page_size)
    if indices_numel % page_size:
        raise fail(f"len({arg})", indices_numel, f"must be a multiple of page_size={page_size}")


# ---------------------------------------------------------------- the copy
Pair = Tuple[RowMap, RowMap]
# One layer map over some component pairs: (pairs, src_layer, dst_layer, num_layers).
Job = Tuple[Sequence[Pair], int, int, Optional[int]]


def run_copy(pairs: Sequence[Pair], src_indices, dst_indices, *, src_layer: int = 0,
             dst_layer: int = 0, num_layers: Optional[int] = None, **kw) -> "Lane":
    """Copy every (src, dst) component pair over one layer map at the same indices."""
    return run_jobs([(pairs, src_layer, dst_layer, num_layers)], src_indices, dst_indices, **kw)


def run_jobs(jobs: Sequence[Job], src_indices, dst_indices, *, op: Op, by_page: bool = False,
             skip_negative: bool = False, config=None, block_quota: Optional[int] = None,
             check: Optional[bool] = None, index_names: Tuple[str, str] = ("src_indices", "dst_indices")) -> "Lane":
    """Copy several jobs (each its own layer map, as the Ascend indexer cache has) at the
    same indices. Within a job, components that can share a launch (equal geometry, one
    allocation or address tables) are stacked into one. Every copy is validated before
    the first one runs, so a bad argument moves no byte; errors about the indices name
    them as the caller does (``index_names``). Index values are checked without a device
    sync (`kvtier.kernels.index_check`: at once for host indices; for device indices
    the copies read the check's verdict and the error comes at the next call or at
    `kvtier.kernels.synchronize()`). ``skip_negative``: pairs holding a negative index
    are skipped, as SGLang's kernels skip them. What depends only on the maps and the
    call's shape (stacking, layer checks, configurations, bound copies) is worked out
    once per call shape and kept (`_Route`). Returns the call's `Lane`."""
    if config is not None and not isinstance(config, CopyConfig):
        raise fail("config", type(config).__name__, "must be a kvtier CopyConfig (or None for the tuned one)")
    key = (tuple((tuple(pairs), sl, dl, nl) for pairs, sl, dl, nl in jobs), op, by_page, skip_negative,
           config, block_quota)
    try:
        route = _ROUTES.get(key)
        if route is None:
            route = _Route(jobs, src_indices, dst_indices, op, by_page, config, block_quota)
            if len(_ROUTES) >= _KEEP_ROUTES:
                _ROUTES.clear()
            _ROUTES[key] = route
    except KvtierError as e:
        raise _renamed(e, index_names) from None
    lane = Lane(route, bool(skip_negative), index_names)
    _run(lane, src_indices, dst_indices, check)
    return lane


class Lane(NamedTuple):
    """A call shape as run: its route, whether negative pairs are skipped, and the
    caller's names for its index arguments."""

    route: "_Route"
    skip_negative: bool
    index_names: Tuple[str, str]


def _run(lane: Lane, src_indices, dst_indices, check: Optional[bool], watched: bool = False) -> None:
    """One call on ``lane``: the indices checked (shape at once, values without a device
    sync), then the route's bound copies launched. The same two index tensors as the
    last call's, unchanged, are not prepared or checked again (`_LAST`). ``watched``: the
    caller vouches for the storage of the maps' tensors (`run_keyed`'s ``by_address``)."""
    global _LAST
    route, skip_negative, names = lane
    checking = checks_on(check)
    flags = (route.limits, skip_negative, checking)     # by value: each layer has a route of its own
    try:
        r, stream = _LAST, route.stream_key()
        if r is not None and r.matches(src_indices, dst_indices, route.device, flags, stream, GUARD):
            (si, di, n), verdict = r.prepared, r.verdict
        else:
            si, di, fs, fd = indices(src_indices, dst_indices, route.device, route.keeps_lists)
            n = si.numel()
            verdict, ticket = None, []
            if n and checking:
                verdict = GUARD.check_pair(route.device, route.check_plans[skip_negative], si, di, fs, fd, ticket)
            if fs is not None and fd is not None:
                _LAST = last_pair(src_indices, dst_indices, route.device, flags, stream, ticket, verdict, (si, di, n))
    except KvtierError as e:
        raise _renamed(e, names) from None
    if n:
        bounds = route.bound(n, skip_negative)
        if len(bounds) == 1 or watched:     # run_bound checks its copy's storage unless watched
            for bound in bounds:
                launcher.run_bound(route.op, bound, si, di, verdict, None, watched)
        else:
            launcher.run_all(route.op, bounds, si, di, verdict)


# The last call's index lists as prepared and checked (`kvtier.kernels.index_memo.LastPair`;
# its ``prepared``: the lists on the device and their count). One record, replaced whole
# (threads see a whole record or the next one).
_LAST: Optional[LastPair] = None


def _renamed(e: KvtierError, names: Tuple[str, str]) -> KvtierError:
    """``e`` with the index arguments named as the caller names them."""
    if names == ("src_indices", "dst_indices"):
        return e
    mapping = dict(zip(("src_indices", "dst_indices"), names))
    return KvtierError(re.sub(r"\b(src|dst)_indices\b", lambda m: mapping[m.group(0)], str(e)))


# ---------------------------------------------------------------- call shapes by argument keys
# An engine calls with the same buffers (often as new views of them), scalars and tables
# on every batch. `run_keyed` finds the call's `Lane` by a key made from those arguments
# alone, so a repeated call builds no map and looks none up.
UNCACHED = object()     # in a key: an argument that cannot be keyed; the call takes the slow path
_PLAIN = (int, type(None), CopyConfig)
_LANES = {}
_KEEP_LANES = 1024      # cleared past this (a model's per-layer calls are a few keys per layer)


_TENSOR = torch.Tensor


def arg_keys(tensors: tuple) -> tuple:
    """What the maps built from ``tensors`` depend on, as one flat tuple: each one's first
    byte, shape, contiguity, dtype and device index. The buffers an engine addresses by
    byte arithmetic must be contiguous, so a map exists only for contiguous ones, whose
    strides follow from their shape. Where the key matches, the maps built from earlier
    tensors with the same key address exactly the bytes the call's own tensors hold, the
    same way (so no storage watch is needed for them: `run_keyed`'s ``by_address``).
    ``(UNCACHED,)`` where one is not a tensor with storage."""
    key = ()
    try:
        for t in tensors:       # (one loop of bound calls: cheaper than a map per attribute)
            if not isinstance(t, _TENSOR):
                return (UNCACHED,)
            key += (t.data_ptr(), t.shape, t.is_contiguous(), t.dtype, t.get_device())
    except RuntimeError:        # no storage (sparse and such): the full path names it
        return (UNCACHED,)
    return key


def arg_key(t) -> object:
    """`arg_keys` of the one tensor ``t``; `UNCACHED` for anything that is not a tensor
    with storage."""
    key = arg_keys((t,))
    return UNCACHED if key[0] is UNCACHED else key


def table_key(t) -> object:
    """A key for an address table: the tensor object at its version (torch bumps it on
    every in-place write through torch, so a rewritten table gets a new key). The lane
    kept under it pins the tensor (`run_keyed`'s ``pins``), so no other object takes its
    id while the key is kept. `UNCACHED` for a list of tensors and for an inference
    tensor (no version counter: its writes would not be seen)."""
    if not isinstance(t, torch.Tensor):
        return UNCACHED
    try:
        return id(t), t._version
    except RuntimeError:            # an inference tensor
        return UNCACHED


def plain(*values) -> tuple:
    """``values`` for a key where each is an exact int, None or a `CopyConfig`; else a
    key part that is never kept (True == 1 and 1.0 == 1 must not find an int's lane)."""
    for v in values:
        if type(v) not in _PLAIN:
            return (UNCACHED,)
    return values


def run_keyed(key: tuple, src_indices, dst_indices, check: Optional[bool], full: Callable[[], Lane],
              pins: tuple = (), by_address: bool = False) -> None:
    """One adapter call whose maps and options depend on nothing but ``key`` (the call's
    kind, its `plain` scalars, the `arg_key` / `table_key` of its tensors): a call whose
    key was seen runs the lane kept under it, building no map; otherwise ``full()`` runs
    the call through `run_jobs` and returns its lane, kept unless the key holds
    `UNCACHED`. ``pins``: objects the key names by id (tables), kept alive with the lane.
    ``by_address``: every tensor is in the key by `arg_keys`, so a found lane's maps
    address the call's own tensors' bytes, which are theirs while the call holds them:
    the storage watch of the lane's tensors is left out."""
    try:
        found = _LANES.get(key)
    except TypeError:                 # an unhashable argument: the full path names it
        found, key = None, (UNCACHED,)
    if found is not None:
        _run(found[0], src_indices, dst_indices, check, by_address)
        return
    lane = full()
    if UNCACHED not in key:
        if len(_LANES) >= _KEEP_LANES:
            _LANES.clear()
        _LANES[key] = (lane, pins)


class _Route:
    """One adapter call shape: its jobs' component pairs stacked into launches and
    validated (layers, rows, reachability), the index limits, and per rows bucket the
    bound copies with their tuned configurations. Built on the first call of the shape
    (whose indices validate the pairs), kept in `_ROUTES`."""

    def __init__(self, jobs, src_indices, dst_indices, op: Op, by_page: bool, config, block_quota):
        maps = [m for pairs, *_ in jobs for p in pairs for m in p]
        # One object per device, so calls on different routes compare devices by identity.
        device = compute_device(*maps)
        self.device = _DEVICES.setdefault(device, device)
        si, di, _, _ = indices(src_indices, dst_indices, self.device, keep=False)
        self.plans = []
        for pairs, src_layer, dst_layer, num_layers in jobs:
            for s, d in _stacked(list(pairs)):
                _, n_layers = check_copy(s, si, d, di, src_layer, dst_layer, num_layers, by_page,
                                         check_values=False)
                self.plans.append((s, d, src_layer, dst_layer, n_layers))
        srcs, dsts = [p[0] for p in self.plans], [p[1] for p in self.plans]
        self.src_limit = (min(m.num_rows for m in srcs), _whole_pages(srcs[0], by_page))
        self.dst_limit = (min(m.num_rows for m in dsts), _whole_pages(dsts[0], by_page))
        self.limits = (self.src_limit, self.dst_limit)
        # The guard's plan of the pair's value check, without and with negatives skipped.
        self.check_plans = tuple(GUARD.pair(("src_indices", *self.src_limit), ("dst_indices", *self.dst_limit), neg)
                                 for neg in (False, True))
        # A per-layer call's lists come again for the next layer; an all-layer call's
        # do not: what is learnt about them is kept for the former only.
        self.keeps_lists = op.scope != "all"
        self._on_cpu = self.device.type == "cpu"
        self.quota = None if block_quota is None else _positive("block_quota", block_quota)
        _require_runnable(maps, self.device)
        self.op, self.by_page, self.config = op, by_page, config
        self.bounds = {}
        self.last = None        # (n, lookup state, bound copies) of the last call

    def stream_key(self):
        """The device's current stream (`kvtier.platforms.stream_key`); None on the CPU."""
        return None if self._on_cpu else platforms.stream_key(self.device)

    def bound(self, n: int, skip_negative: bool) -> list:
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
                                         by_page=self.by_page, config=cfg, skip_negative=skip_negative))
            if len(self.bounds) >= _KEEP_ROUTES:
                self.bounds.clear()
            self.bounds[key] = found
        self.last = (n, state, found)
        return found


_DEVICES = {}

# Adapter call shapes kept (cleared, not evicted one by one, past the bound): each holds
# its maps, so their tensors stay alive while kept (as kept maps do).
_ROUTES = {}
_KEEP_ROUTES = 256


def _stacked(pairs: List[Pair]) -> List[Pair]:
    """Components that can share a launch as one pair of maps (kept across calls)."""
    if len(pairs) > 1:
        return _kept(("stack", *pairs), lambda: _stack(pairs))
    return pairs


def _stack(pairs: List[Pair]) -> List[Pair]:
    """One pair of maps for all components where both sides can be joined: in one
    allocation by a component stride, else (separate allocations, as SGLang's per-layer
    device tensors) by a table of their bases."""
    src, dst = (_join([p[i] for p in pairs]) for i in (0, 1))
    return [(src, dst)] if src is not None and dst is not None else pairs


def _join(maps: List[RowMap]) -> Optional[RowMap]:
    return RowMap.stack(maps) or RowMap.stack_as_table(maps)


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
