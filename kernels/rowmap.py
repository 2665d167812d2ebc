"""Row maps: where row ``i`` of layer ``l`` of a component lives, as data.

Every KV layout in use is one address formula with different strides (bytes)::

    row_address(c, l, i, k) = layer_base(c, l)
                              + (i // P) * page_stride + (i % P) * token_stride
                              + k * chunk_stride                  (k < n_chunks)
    layer_base(c, l) = base + c * comp_stride + l * layer_stride  (stacked buffer)
                     = table[c * num_layers + l]                  (int64 address table)

A row is ``n_chunks`` chunks of ``chunk_bytes`` (one chunk when it is contiguous; the
page_head host layout splits a row into one chunk per head). A map can hold several
components with equal rows (K and V) so that one kernel launch moves them all.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

from kvtier.address import pow2_align as _pow2_align

from kvtier.errors import KvtierError, fail
from .layouts import host_layout


def _storage_span(t: torch.Tensor):
    """(first, end) byte addresses of the storage behind tensor ``t``."""
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes()


def owned_span(t: torch.Tensor, arg: str = "t"):
    """(first, end) byte addresses of the elements of tensor ``t`` (not of its storage),
    which its storage must hold (``arg`` names ``t`` where it does not: a storage freed or
    shrunk in place, as an engine releasing its KV memory does, leaves the tensor's shape
    as it was)."""
    first = t.data_ptr()
    if t.numel() == 0:
        return first, first
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    end = first + (last + 1) * t.element_size()
    owned = _storage_span(t)
    if first < owned[0] or end > owned[1]:
        raise fail(arg, tuple(t.shape), f"its elements need {end - first} bytes but its storage holds "
                   f"{owned[1] - owned[0]} (freed or shrunk in place)")
    return first, end


def _geometry(m: "RowMap", layer_stride: bool = True) -> tuple:
    """What maps joined into one must share: rows, pages, chunks, strides and device."""
    return (m.num_layers, m.num_rows, m.page_size, m.row_bytes, m.chunk_bytes, m.n_chunks, m.chunk_stride,
            m.token_stride, m.page_stride, m.device) + ((m.layer_stride,) if layer_stride else ())


def _dense_row(shape: Sequence[int], strides: Sequence[int], itemsize: int, arg: str, value):
    """Bytes of a row made of trailing dims that must be dense (C-contiguous)."""
    expect = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expect:
            raise fail(arg, value, "the row dims (after the layer and token dims) must be contiguous")
        expect *= size
    return expect * itemsize


@dataclass(eq=False)
class Derived:
    """What a `RowMap` works out from itself once and keeps, so that a launch does not
    redo it: pure functions of the map (which never changes), never part of its identity,
    and new for every map (`dataclasses.replace` makes a new map with an empty one).
    Filled only by the RowMap methods named here.

    tables: the address table as read on each device (`RowMap.table_on`).
    pages: the map with a whole page as one row (`RowMap.pages_as_rows`).
    reachable: platform names whose kernels reach this host map (`RowMap.reachable_by`);
        only a yes is kept, since memory may be registered later.
    views: the map as a kernel on each device addresses it (`RowMap.kernel_view`).
    """

    tables: dict = field(default_factory=dict)
    pages: Optional["RowMap"] = None
    reachable: set = field(default_factory=set)
    views: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class RowMap:
    """Descriptor of one or more KV components' rows across layers (see module doc).

    All sizes and strides are bytes. Build one with a constructor (`from_stacked`,
    `from_layers`, `from_host_layout`, `stack`) rather than by hand: they check the
    strides against the tensors and keep the tensors alive as long as the map lives.
    """

    num_components: int
    num_layers: int
    num_rows: int          # token slots per layer (a multiple of page_size)
    page_size: int
    row_bytes: int
    chunk_bytes: int
    n_chunks: int
    chunk_stride: int
    token_stride: int
    page_stride: int
    layer_stride: int      # stacked only
    comp_stride: int       # between components' bases (stacked), or added per component to a table's entries
    base: int              # stacked: address of component 0, layer 0, row 0; table: bytes added to every entry
    table: Optional[torch.Tensor]   # int64 [num_components * num_layers] layer bases
    device: torch.device
    align: int             # power of two (<= 16) dividing every address and stride
    # (tensor, first byte address used) per layer base, for the reference and the checks
    segments: tuple = field(repr=False, default=())
    # data_ptr() of each segment's tensor when the map was first built (kept by the maps
    # derived from it): a launch compares it with the tensor's own (`watch`).
    built_ptrs: Optional[tuple] = field(repr=False, default=None)
    # Table maps: component c's layer l base is entry ``c * entry_comp + l * table_layer``
    # of ``table`` (components below ``entry_split``) or of ``table2`` (the rest, counted
    # from 0), plus ``base + c * comp_stride`` (LMCache's K and V planes behind one
    # address). -1 (the usual table, ``c * num_layers + l`` of one table) follows the
    # map's own counts through `dataclasses.replace`.
    table2: Optional[torch.Tensor] = field(repr=False, default=None)
    table_comp: int = -1
    table_layer: int = 1
    table_split: int = -1
    # Whether kvtier made the table from tensors it holds (False: an engine's pointer
    # array, read by every launch as it is then, whose entries the launch checks).
    table_trusted: bool = True
    derived: Derived = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "derived", Derived())
        if self.built_ptrs is None:
            object.__setattr__(self, "built_ptrs", tuple(t.data_ptr() for t, _ in self.segments))

    # ------------------------------------------------------------------ properties
    @property
    def is_table(self) -> bool:
        return self.table is not None

    @property
    def entry_comp(self) -> int:
        """Table entries between one component's layer 0 and the next one's."""
        return self.num_layers if self.table_comp < 0 else self.table_comp

    @property
    def entry_split(self) -> int:
        """The components read from ``table``; the rest read ``table2``."""
        return self.num_components if self.table_split < 0 else self.table_split

    @property
    def num_pages(self) -> int:
        return self.num_rows // self.page_size

    @property
    def page_contiguous(self) -> bool:
        """True when a page's rows form one contiguous run of page_size * row_bytes."""
        return self.n_chunks == 1 and (self.page_size == 1 or self.token_stride == self.row_bytes)

    def layer_span(self) -> int:
        """Bytes from a layer base to one past the last byte of that layer's rows."""
        return ((self.num_pages - 1) * self.page_stride + (self.page_size - 1) * self.token_stride
                + (self.n_chunks - 1) * self.chunk_stride + self.chunk_bytes)

    def describe(self) -> str:
        mode = "table" if self.is_table else "stacked"
        return (f"RowMap({mode}, C={self.num_components}, L={self.num_layers}, rows={self.num_rows}, "
                f"P={self.page_size}, row={self.row_bytes}B"
                + (f" as {self.n_chunks}x{self.chunk_bytes}B" if self.n_chunks > 1 else "")
                + f", align={self.align}, {self.device})")

    __repr__ = describe

    # ------------------------------------------------------------ derived maps
    def as_pages(self) -> "RowMap":
        """The same memory seen with a whole page as one row (page_contiguous maps only)."""
        if not self.page_contiguous:
            raise KvtierError(f"{self.describe()} does not store a page contiguously")
        return replace(self, num_rows=self.num_pages, page_size=1,
                       row_bytes=self.row_bytes * self.page_size,
                       chunk_bytes=self.row_bytes * self.page_size, chunk_stride=0,
                       token_stride=self.page_stride)

    def pages_as_rows(self) -> "RowMap":
        """`as_pages`, worked out once per map."""
        if self.derived.pages is None:
            self.derived.pages = self.as_pages()
        return self.derived.pages

    def table_on(self, device: torch.device) -> torch.Tensor:
        """The address table on ``device`` (copied there once)."""
        t = self.derived.tables.get(device)
        if t is None:
            t = self.derived.tables[device] = self.table if self.table.device == device else self.table.to(device)
        return t

    def reachable_by(self, platform) -> bool:
        """Whether kernels of ``platform`` (a `kvtier.platforms.Platform`) address this
        host map (pinned under UVA, registered on Ascend)."""
        if platform.name not in self.derived.reachable:
            if not platform.kernel_reaches(self):
                return False
            self.derived.reachable.add(platform.name)
        return True

    def kernel_view(self, platform, device: torch.device) -> "RowMap":
        """This map as a kernel of ``platform`` on ``device`` addresses it (once per device)."""
        v = self.derived.views.get(device)
        if v is None:
            v = self.derived.views[device] = platform.kernel_view(self, device)
        return v

    def layout_key(self) -> tuple:
        """Everything a copy launch depends on in this map but its addresses: the
        geometry, the strides, the alignment, how a table is read and the device type. Two
        maps with equal keys share one `CopyLaunch`, each passing its own
        base or tables (`kvtier.kernels.launcher.Addresses`)."""
        return (self.num_components, self.num_layers, self.num_rows, self.page_size, self.row_bytes,
                self.chunk_bytes, self.n_chunks, self.chunk_stride, self.token_stride, self.page_stride,
                self.layer_stride, self.is_table, self.align, self.device.type, self.entry_comp,
                self.table_layer, self.entry_split)

    def select_layers(self, start: int, count: int) -> "RowMap":
        """A map of layers start .. start+count (a pipeline stage's slice)."""
        if start < 0 or count < 0 or start + count > self.num_layers:
            raise fail("layers", (start, count), f"outside the map's {self.num_layers} layers")
        if self.is_table:
            rows = [self.table[c * self.num_layers + start:c * self.num_layers + start + count]
                    for c in range(self.num_components)]
            keep = [i for c in range(self.num_components)
                    for i in range(c * self.num_layers + start, c * self.num_layers + start + count)
                    if i < len(self.segments)]
            return replace(self, num_layers=count, table=torch.cat(rows),
                           segments=tuple(self.segments[i] for i in keep),
                           built_ptrs=tuple(self.built_ptrs[i] for i in keep))
        return replace(self, num_layers=count, base=self.base + start * self.layer_stride)

    def watch(self, start: int, count: int) -> tuple:
        """(tensor, its data_ptr() when the map was built, name) for every tensor that
        layers start .. start+count-1 of this map rest on: what a launch compares, so
        that a tensor resized, ``set_`` to other memory or whose storage was freed since
        is named instead of written through a stale address. A table built from bare
        addresses (no owners) has nothing to watch."""
        if self.is_table and len(self.segments) == self.num_components * self.num_layers:
            picked = [c * self.num_layers + layer for c in range(self.num_components)
                      for layer in range(start, start + count)]
            name = "layers[{}]"
        else:
            picked = range(len(self.segments))
            name = "layers[{}]" if self.is_table else "component {} buffer"
        return tuple((self.segments[i][0], self.built_ptrs[i], name.format(i)) for i in picked)

    # ------------------------------------------------------------ constructors
    @classmethod
    def from_strides(cls, buffer: torch.Tensor, *, num_layers: int, num_rows: int, page_size: int,
                     row_bytes: int, token_stride: int, page_stride: int, layer_stride: int,
                     offset: int = 0, n_chunks: int = 1, chunk_stride: int = 0) -> "RowMap":
        """A stacked map over ``buffer``: layer 0 row 0 at ``buffer.data_ptr() + offset``.
        Every stride is in bytes; the map is checked to stay inside ``buffer``."""
        if not isinstance(buffer, torch.Tensor):
            raise fail("buffer", type(buffer).__name__, "must be a torch.Tensor")
        if n_chunks < 1 or row_bytes % n_chunks:
            raise fail("n_chunks", n_chunks, f"must be >= 1 and divide row_bytes={row_bytes}")
        base = buffer.data_ptr() + offset
        m = cls(num_components=1, num_layers=num_layers, num_rows=num_rows, page_size=page_size,
                row_bytes=row_bytes, chunk_bytes=row_bytes // n_chunks, n_chunks=n_chunks,
                chunk_stride=chunk_stride if n_chunks > 1 else 0, token_stride=token_stride,
                page_stride=page_stride, layer_stride=layer_stride, comp_stride=0, base=base,
                table=None, device=buffer.device,
                align=_pow2_align(base, row_bytes // n_chunks, token_stride, page_stride, layer_stride,
                                  chunk_stride if n_chunks > 1 else 0),
                segments=((buffer, base),))
        m._check_bounds()
        return m

    @classmethod
    def from_stacked(cls, t: torch.Tensor, page_size: int = 1, paged_dims: bool = False) -> "RowMap":
        """A contiguous multi-layer buffer (Ascend style): ``t`` is ``(L, N, *row)``, or
        ``(L, pages, P, *row)`` with ``paged_dims=True``."""
        tok_dims = 2 if paged_dims else 1
        _check_tensor("t", t, min_dim=1 + tok_dims + 1)
        shape, st, item = t.shape, t.stride(), t.element_size()
        row = _dense_row(shape[1 + tok_dims:], st[1 + tok_dims:], item, "t", tuple(shape))
        if paged_dims:
            _check_page_dim("t", t, 2, page_size)
            num_rows, token, page = shape[1] * shape[2], st[2] * item, st[1] * item
        else:
            num_rows, token, page = shape[1], st[1] * item, st[1] * item * page_size
        return cls.from_strides(t, num_layers=shape[0], num_rows=num_rows, page_size=page_size,
                                row_bytes=row, token_stride=token, page_stride=page,
                                layer_stride=st[0] * item)

    @classmethod
    def from_layers(cls, layers: Sequence[torch.Tensor], page_size: int = 1,
                    paged_dims: bool = False, table_device: Optional[torch.device] = None) -> "RowMap":
        """One tensor per layer (CUDA style): each ``(N, *row)`` or ``(pages, P, *row)``;
        builds the int64 table of per-layer base addresses on the tensors' device."""
        if isinstance(layers, torch.Tensor) or not len(layers):
            raise fail("layers", type(layers).__name__, "must be a non-empty list of per-layer tensors")
        first = layers[0]
        tok_dims = 2 if paged_dims else 1
        for i, t in enumerate(layers):
            _check_tensor(f"layers[{i}]", t, min_dim=tok_dims + 1)
            if (t.shape, t.stride(), t.dtype, t.device) != (first.shape, first.stride(), first.dtype, first.device):
                raise fail(f"layers[{i}]", (tuple(t.shape), t.dtype, str(t.device)),
                           f"differs from layers[0]={(tuple(first.shape), first.dtype, str(first.device))}")
        shape, st, item = first.shape, first.stride(), first.element_size()
        row = _dense_row(shape[tok_dims:], st[tok_dims:], item, "layers[0]", tuple(shape))
        if paged_dims:
            _check_page_dim("layers[0]", first, 1, page_size)
            num_rows, token, page = shape[0] * shape[1], st[1] * item, st[0] * item
        else:
            num_rows, token, page = shape[0], st[0] * item, st[0] * item * page_size
        addrs = [t.data_ptr() for t in layers]
        table = torch.tensor(addrs, dtype=torch.int64, device=table_device or first.device)
        m = cls(num_components=1, num_layers=len(layers), num_rows=num_rows, page_size=page_size,
                row_bytes=row, chunk_bytes=row, n_chunks=1, chunk_stride=0, token_stride=token,
                page_stride=page, layer_stride=0, comp_stride=0, base=0, table=table,
                device=first.device, align=_pow2_align(row, token, page, *addrs),
                segments=tuple((t, t.data_ptr()) for t in layers))
        m._check_bounds()
        return m

    @classmethod
    def from_table(cls, table: torch.Tensor, *, row_bytes: int, num_rows: int, page_size: int = 1,
                   token_stride: Optional[int] = None, page_stride: Optional[int] = None,
                   owners: Optional[Sequence[torch.Tensor]] = None) -> "RowMap":
        """Layers known only by a table of base addresses (an engine's per-layer pointer
        array, such as SGLang's ``k_data_ptrs``): ``table`` is 1-D int64 or uint64, one
        address per layer, on the device whose kernels read it. Row ``i`` of layer ``l`` is
        at ``table[l] + (i // P) * page_stride + (i % P) * token_stride`` (default: rows
        packed). A table carries no sizes, so ``num_rows`` is the caller's word; ``owners``
        (the tensor each address points into) lets the rows be checked to stay inside them
        and lets the torch reference read them. Reads the table once (a device sync) for
        the addresses' alignment."""
        if (not isinstance(table, torch.Tensor) or table.dtype not in _ADDRESS_DTYPES
                or table.dim() != 1 or table.numel() == 0):
            raise fail("table", getattr(table, "dtype", type(table).__name__),
                       "must be a non-empty 1-D int64 or uint64 tensor of addresses")
        table = table.contiguous().view(torch.int64)  # same bytes; the kernel reads int64
        addrs = table.tolist()
        if min(addrs) <= 0:
            raise fail("table", min(addrs), "holds a null or negative address")
        token_stride = row_bytes if token_stride is None else token_stride
        page_stride = token_stride * page_size if page_stride is None else page_stride
        if owners is not None and len(owners) != len(addrs):
            raise fail("owners", len(owners), f"must name one tensor per table entry ({len(addrs)})")
        m = cls(num_components=1, num_layers=len(addrs), num_rows=num_rows, page_size=page_size,
                row_bytes=row_bytes, chunk_bytes=row_bytes, n_chunks=1, chunk_stride=0,
                token_stride=token_stride, page_stride=page_stride, layer_stride=0, comp_stride=0,
                base=0, table=table, device=table.device,
                align=_pow2_align(row_bytes, token_stride, page_stride, *addrs),
                segments=tuple(zip(owners, addrs)) if owners is not None else (), table_trusted=False)
        m._check_bounds()
        return m

    @classmethod
    def engine_table(cls, table: torch.Tensor, *, row_bytes: int, num_rows: int, page_size: int = 1,
                     token_stride: Optional[int] = None, page_stride: Optional[int] = None,
                     num_layers: Optional[int] = None, table_comp: int = -1, table_layer: int = 1,
                     num_components: int = 1, comp_stride: int = 0, table2: Optional[torch.Tensor] = None,
                     table_split: int = -1, offset: int = 0) -> "RowMap":
        """Layers known by an engine's pointer array that kvtier does not read: every
        launch reads ``table`` (1-D int64 or uint64 on the device whose kernels read it) as
        it is then and checks every entry it uses (not null, a multiple of the map's
        ``align``, which assumes 16-byte aligned bases, as allocators give). Component
        ``c``'s layer ``l`` is at entry ``c * table_comp + l * table_layer`` (default: one
        entry per layer, components one after another) of ``table``, or of ``table2`` for
        components from ``table_split`` on, plus ``offset + c * comp_stride`` bytes. No host
        read, so no sync; ``num_layers`` defaults to the entries over ``table_layer``."""
        if (not isinstance(table, torch.Tensor) or table.dtype not in _ADDRESS_DTYPES
                or table.dim() != 1 or table.numel() == 0 or not table.is_contiguous()):
            raise fail("table", getattr(table, "dtype", type(table).__name__),
                       "must be a non-empty contiguous 1-D int64 or uint64 tensor of addresses")
        token_stride = row_bytes if token_stride is None else token_stride
        page_stride = token_stride * page_size if page_stride is None else page_stride
        if num_layers is None:
            num_layers = -(-table.numel() // table_layer)
        m = cls(num_components=num_components, num_layers=num_layers, num_rows=num_rows, page_size=page_size,
                row_bytes=row_bytes, chunk_bytes=row_bytes, n_chunks=1, chunk_stride=0,
                token_stride=token_stride, page_stride=page_stride, layer_stride=0, comp_stride=comp_stride,
                base=offset, table=table, device=table.device,
                align=_pow2_align(row_bytes, token_stride, page_stride, comp_stride, offset, 16), segments=(),
                table2=table2, table_comp=table_comp, table_layer=table_layer, table_split=table_split,
                table_trusted=False)
        m._check_bounds()
        return m

    @classmethod
    def from_host_layout(cls, t: torch.Tensor, layout, page_size: int) -> "RowMap":
        """One component of a host pool buffer in a named layout (`kvtier.kernels.layouts`):

        - ``layer_first``       ``(L, N, *row)``
        - ``page_first``        ``(N, L, *row)``
        - ``page_first_direct`` ``(pages, L, P, *row)``
        - ``page_head``         ``(pages, H, P, L, D)``: a row is H chunks of D elements

        The strides are read off the tensor by the layout's dim names, so every layout is
        the same code."""
        lay = host_layout(layout)
        pos = {d: i for i, d in enumerate(lay.dims)}
        _check_tensor("t", t, min_dim=len(lay.dims))
        shape, st = t.shape, t.stride()
        item = t.element_size()
        if "H" in pos and (t.dim() != len(lay.dims) or st[pos["D"]] != 1):
            raise fail("t", tuple(shape), f"{lay.name} needs a {lay.dims} tensor with contiguous D")
        if lay.paged:
            _check_page_dim("t", t, pos["P"], page_size)
            num_rows, token, page = shape[pos["pages"]] * page_size, st[pos["P"]] * item, st[pos["pages"]] * item
        else:
            num_rows, token = shape[pos["N"]], st[pos["N"]] * item
            page = token * page_size
        if "H" in pos:
            n_chunks, chunk_stride = shape[pos["H"]], st[pos["H"]] * item
            row = n_chunks * shape[pos["D"]] * item
        else:
            n_chunks, chunk_stride = 1, 0
            row = _dense_row(shape[pos["row"]:], st[pos["row"]:], item, "t", tuple(shape))
        return cls.from_strides(t, num_layers=shape[pos["L"]], num_rows=num_rows, page_size=page_size,
                                row_bytes=row, n_chunks=n_chunks, chunk_stride=chunk_stride,
                                token_stride=token, page_stride=page, layer_stride=st[pos["L"]] * item)

    @classmethod
    def stack(cls, maps: Sequence["RowMap"]) -> Optional["RowMap"]:
        """Several single-component maps with equal rows as one multi-component map (one
        kernel launch moves them all). Returns None where they cannot share a launch:
        different geometry, or stacked buffers in different allocations."""
        maps = list(maps)
        if len(maps) == 1:
            return maps[0]
        m0 = maps[0]
        if any(_geometry(m) != _geometry(m0) or m.is_table != m0.is_table or m.num_components != 1 for m in maps):
            return None
        if m0.is_table:
            if any(m.table2 is not None or m.entry_comp != m.num_layers or m.table_layer != 1 for m in maps):
                return None
            segs = tuple(s for m in maps for s in m.segments)
            built_ptrs = tuple(b for m in maps for b in m.built_ptrs)
            if all(m.table_trusted for m in maps):      # kvtier's own tables: joined in one
                return replace(m0, num_components=len(maps), table=torch.cat([m.table for m in maps]),
                               segments=segs, built_ptrs=built_ptrs, align=min(m.align for m in maps), table_split=-1)
            if len(maps) != 2:
                return None     # an engine's tables are read as they are: two per launch at most
            step = maps[1].base - maps[0].base      # (each entry's offset, per component)
            return replace(m0, num_components=2, table=maps[0].table, table2=maps[1].table, table_split=1,
                           comp_stride=step, segments=segs, built_ptrs=built_ptrs, table_trusted=False,
                           align=min(_pow2_align(step), *(m.align for m in maps)))
        # Stacked: equal distance between consecutive bases inside one allocation.
        if len({_storage_span(m.segments[0][0]) for m in maps}) != 1 or maps[1].base <= maps[0].base:
            return None
        return cls.join(maps)

    @classmethod
    def join(cls, maps: Sequence["RowMap"]) -> Optional["RowMap"]:
        """Single-component stacked maps of equal geometry, in any allocations, as one map
        whose components are ``comp_stride`` bytes apart (the step between consecutive
        bases, which may be negative): one launch moves them all, each call passing its
        own bases (`kvtier.kernels.launcher.Addresses`). None where the steps differ or the
        maps cannot be joined."""
        maps = list(maps)
        if len(maps) == 1:
            return maps[0]
        m0 = maps[0]
        if any(m.is_table or m.num_components != 1 or _geometry(m) != _geometry(m0) for m in maps):
            return None
        steps = {maps[i + 1].base - maps[i].base for i in range(len(maps) - 1)}
        if len(steps) != 1:
            return None
        step = steps.pop()
        out = replace(m0, num_components=len(maps), comp_stride=step,
                      segments=tuple(s for m in maps for s in m.segments),
                      built_ptrs=tuple(b for m in maps for b in m.built_ptrs),
                      align=min(_pow2_align(step), *(m.align for m in maps)))
        out._check_bounds()
        return out

    @classmethod
    def stack_as_table(cls, maps: Sequence["RowMap"]) -> Optional["RowMap"]:
        """Single-component stacked maps with equal rows in separate allocations (which
        `stack` cannot join) as one table map: entry ``c * L + l`` is map c's layer l base,
        so one launch moves them all. The table is made on the maps' device once (a
        host map's is copied to the device that reads it at its first launch). None where
        the maps' geometry differs or a map is a table already."""
        maps = list(maps)
        m0 = maps[0]
        if len(maps) < 2 or any(m.is_table or m.num_components != 1 or _geometry(m, False) != _geometry(m0, False)
                                for m in maps):
            return None
        addrs = [m.base + layer * m.layer_stride for m in maps for layer in range(m.num_layers)]
        segments = tuple((m.segments[0][0], a) for m, a in
                         zip((m for m in maps for _ in range(m.num_layers)), addrs))
        built_ptrs = tuple(m.built_ptrs[0] for m in maps for _ in range(m.num_layers))
        out = replace(m0, num_components=len(maps), table=torch.tensor(addrs, dtype=torch.int64, device=m0.device),
                      base=0, layer_stride=0, comp_stride=0, segments=segments, built_ptrs=built_ptrs,
                      align=min(_pow2_align(*addrs), *(m.align for m in maps)))
        out._check_bounds()
        return out

    # ------------------------------------------------------------ checks
    def _check_bounds(self) -> None:
        """Every row of every layer stays inside the tensor(s) the map came from."""
        for name, v in (("num_layers", self.num_layers), ("num_rows", self.num_rows),
                        ("page_size", self.page_size), ("row_bytes", self.row_bytes)):
            if v <= 0:
                raise fail(name, v, "must be positive")
        if self.num_rows % self.page_size:
            raise fail("num_rows", self.num_rows, f"must be a multiple of page_size={self.page_size}")
        for name in ("token_stride", "page_stride", "layer_stride", "chunk_stride"):    # (components: any)
            if getattr(self, name) < 0:
                raise fail(name, getattr(self, name), "negative strides are not supported")
        if self.n_chunks > 1 and self.chunk_stride < self.chunk_bytes:
            raise fail("chunk_stride", self.chunk_stride, f"chunks of {self.chunk_bytes} B overlap")
        # Bounds are the tensors' own bytes, not their storages: a view's neighbours in
        # the same allocation (other layers, other components) are not the map's to touch.
        span = self.layer_span()
        if self.is_table:
            for i, (t, start) in enumerate(self.segments):
                first, end = owned_span(t, f"layers[{i}]")
                if start < first or start + span > end:
                    raise fail(f"layers[{i}]", tuple(t.shape),
                               f"rows need {span} bytes from the layer base; the tensor has {end - start}")
            return
        reach = (self.num_layers - 1) * self.layer_stride + span
        for c, (t, _) in enumerate(self.segments):       # one tensor per component
            first, end = owned_span(t, f"component {c} buffer")
            start = self.base + c * self.comp_stride
            if start < first or start + reach > end:
                raise fail("strides", (self.layer_stride, self.page_stride, self.token_stride),
                           f"the map reaches byte {start + reach - first} of a {end - first}-byte tensor")


# ---------------------------------------------------------------- maps kept across calls
# Address tables: int64, or uint64 as engines build them (torch.uint64 needs torch >= 2.3).
_ADDRESS_DTYPES = tuple(d for d in (torch.int64, getattr(torch, "uint64", None)) if d is not None)


def _check_tensor(arg: str, t, min_dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise fail(arg, type(t).__name__, "must be a torch.Tensor")
    if t.dim() < min_dim:
        raise fail(arg, tuple(t.shape), f"needs at least {min_dim} dims for this layout")
    if t.numel() == 0:
        raise fail(arg, tuple(t.shape), "is empty")


def _check_page_dim(arg: str, t: torch.Tensor, dim: int, page_size: int) -> None:
    if t.shape[dim] != page_size:
        raise fail(arg, tuple(t.shape), f"dim {dim} must be page_size={page_size}")
