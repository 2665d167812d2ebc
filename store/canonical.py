"""Host pages <-> the canonical payloads of their stored objects (`kvtier.store.page`),
for any host layout.

A page is one or more objects (`kvtier.store.split.Part`): each holds some of the
components, and of the head-split ones (K, V) a slice of heads of every row. Each
component of an object is read off a row map over the host memory it holds (the host
pool's map, cut to the object's heads), and moved one of three ways:

- "whole": the host holds all of a page's layers of the component in canonical order,
  contiguously (``page_first_direct``; ``page_first`` with one-token pages): the host
  memory itself is the payload piece (no copy).
- "layers": the host holds each layer's page rows contiguously (``layer_first``): one
  piece per layer, in place, where a piece is at least `LAYER_PIECE_MIN` bytes.
- "staged": anything else (``page_first``, ``page_head``, small layer pieces): a row
  copy between the host pool's row maps and row maps over a staging buffer in
  canonical order, for a whole batch of pages per component group. Where every
  component of an object is staged, a slot also holds the object's header just before
  its payload, so the engine moves the object as one buffer (`CanonicalPages.framed`).
  Rows cut to a head slice are staged (their pieces are one head group per token).

Both sides of a staged copy are host memory, so it runs on the CPU: the bytes never
cross a link. It runs as `copy_pages`, the row copy of whole pages read off the same
row maps (the address formula of `kvtier.kernels.rowmap`) as strided copies of machine
words, one per page (or run of pages) per component group, by numpy (one thread, the
GIL released): 5-17 GB/s on a 2-core CPU where `copy_rows` reaches 0.2 GB/s through its
torch reference (byte-wise indexing) and under 0.02 GB/s through Triton's interpreter,
and where torch's own parallel copy fell under 1 GB/s whenever the other core was busy
(docs/store.md).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from kvtier import caches
from kvtier.errors import fail
from kvtier.kernels import RowMap

from .page import HEAD_SPLIT, ComponentShape, Geometry, as_bytes_view, header_len

LAYER_PIECE_MIN = 16 * 1024     # smaller per-layer pieces are staged (docs/store.md)
HEADER_KEY_ROOM = 512           # key bytes a staging slot's header room holds (`framed`)
FRAME_LENGTHS = 8               # header lengths per object a staging buffer keeps its frames for
caches.declare(
    "store.canonical.Staging.frames", key="object, header length",
    value="per slot of this staging buffer: views of the object's header and of header and payload as one buffer",
    bound=f"{FRAME_LENGTHS} per object of a page, per staging buffer (keys of one length: one per object)",
    rule="never (views of this buffer's fixed slots)", stale="not happen: a pure function of the slot layout")


@dataclass(frozen=True)
class Direct:
    """A component read and written in place: ``count`` pieces of ``length`` bytes per
    page, piece i of page p at ``offset + p * page_stride + i * layer_stride`` of the
    host group's flat view ``view``."""

    name: str
    view: memoryview
    offset: int
    page_stride: int
    layer_stride: int
    count: int
    length: int


@dataclass(frozen=True)
class Staged:
    """A component moved through the staging buffer: ``length`` bytes at ``offset`` of
    each staging slot."""

    name: str
    offset: int
    length: int


@dataclass(frozen=True)
class PageObject:
    """One stored object of each page: its key suffix (`kvtier.store.split.Part`), its
    geometry (the header's), and how each of its components moves (Direct or Staged),
    in payload order.
    ``header_room``: bytes of its staging slot region before its payload that hold its
    header, where every component is staged (`CanonicalPages.framed`), else 0."""

    name: str
    geometry: Geometry
    components: Tuple[object, ...]
    header_room: int
    start: int              # the first byte of its staged region in a slot
    # derived once: its payload's length, and the bytes of it that move through the staging buffer
    payload_bytes: int = field(init=False, repr=False, compare=False)
    staged_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "payload_bytes", self.geometry.payload_bytes)
        object.__setattr__(self, "staged_bytes", sum(p.length for p in self.components if type(p) is Staged))


class Staging:
    """A staging buffer for ``capacity`` pages, one slot of `CanonicalPages.slot_bytes`
    each, with its row maps (one per copy group) and a flat byte view; reused across
    calls (`CanonicalPages.take_staging`)."""

    def __init__(self, plan: "CanonicalPages", capacity: int):
        self.capacity = capacity
        self.tensor = torch.empty((capacity, max(plan.slot_bytes, 1)), dtype=torch.uint8)
        self.view = as_bytes_view(self.tensor)
        P, stride = plan.page_size, plan.slot_bytes
        maps = {}
        for s, (c, _) in plan.staged.items():
            maps[s] = RowMap.from_strides(
                self.tensor, num_layers=c.num_layers, num_rows=capacity * P, page_size=P,
                row_bytes=c.row_bytes, token_stride=c.row_bytes, page_stride=stride,
                layer_stride=P * c.row_bytes, offset=s.offset)
        # One map per copy group (a host group's components stacked where they can be),
        # and the page views `copy_pages` moves between.
        self.maps, self.views = [], []
        for parts, host_map in plan.copy_groups:
            smap = maps[parts[0]] if len(parts) == 1 else RowMap.stack([maps[p] for p in parts])
            self.maps.append(smap)
            self.views.append(tuple(_as_chunks(v.numpy()) for v in page_views(host_map, smap)))
        # every object's copy groups in one copy each, where the objects allow (`_fused`)
        self.fused = _fused(self.views, plan.object_groups)
        # Per object staged whole (its components lie in payload order in a slot), its
        # payload in each slot as one buffer, made once: `pieces` of such an object is
        # this one buffer (one checksum call, one buffer for the engine). None for the
        # other objects.
        # (A 1-tuple: buffers made once per call would each be a tracked object living
        # through the call, and a call's thousands of them feed the collector's full
        # passes over the whole process.)
        self.payloads = [None if not o.header_room else
                         [(self.view[a:a + o.payload_bytes],) for a in _payload_starts(o, capacity, stride)]
                         for o in plan.objects]
        # (object, header length) -> its frames by slot (`CanonicalPages.framed`)
        self.frames = caches.bounded("store.canonical.Staging.frames", FRAME_LENGTHS * len(plan.objects))


def _payload_starts(o: "PageObject", capacity: int, slot_bytes: int) -> range:
    """Where object ``o``'s payload starts in each slot of a staging buffer (staged whole:
    just after its header room)."""
    return range(o.start + o.header_room, capacity * slot_bytes, slot_bytes)


class CanonicalPages:
    """How one `HostPool`'s pages become stored objects' payloads and back (module doc).

    parts: the objects of each page (`kvtier.store.split.Part`: a key suffix and the
    heads of the head-split components' rows it holds); default one object of whole
    rows. scope: the text each object's geometry starts with (the identity)."""

    def __init__(self, host, layer_piece_min: int = LAYER_PIECE_MIN, parts: Sequence = (),
                 scope: str = ""):
        self.host = host
        self.page_size = P = host.page_size
        whole = Geometry.of(host)
        part_specs = list(parts) or [_WholeRows()]
        group_of = {}           # component -> its host group's buffer and flat byte view
        for names, _, buf in host.groups:
            view = as_bytes_view(buf)
            group_of.update((n, (buf, view)) for n in names)
        self.objects: List[PageObject] = []
        self.staged: Dict[Staged, Tuple[ComponentShape, RowMap]] = {}
        self.copy_groups: List[Tuple[Tuple[Staged, ...], RowMap]] = []
        self.object_groups: List[Tuple[int, ...]] = []     # per object: its copy groups' indices
        off = 0
        for spec in part_specs:
            comps = [_sliced(host, c, spec.heads, spec.layers) for c in whole.components
                     if spec.components is None or c.name in spec.components]
            geometry = Geometry(P, tuple(c for c, _ in comps), f"{scope};part={spec.name}" if scope else "")
            hows = [_moves_in_place(P, c, m, layer_piece_min) for c, m in comps]
            room = 0
            if not any(hows):
                text_bytes = len(geometry.text.encode())
                room = -(-header_len(text_bytes, HEADER_KEY_ROOM) // 64) * 64
            start, off = off, off + room
            moves = []
            for (c, m), how in zip(comps, hows):
                buf, view = group_of[c.name]
                offset = m.base - buf.data_ptr()
                rows = P * c.row_bytes
                if how == "whole":
                    part = Direct(c.name, view, offset, m.page_stride, 0, 1, c.num_layers * rows)
                elif how == "layers":
                    part = Direct(c.name, view, offset, m.page_stride, m.layer_stride, c.num_layers, rows)
                else:
                    part = Staged(f"{spec.name}/{c.name}" if spec.name else c.name, off, c.num_layers * rows)
                    off += part.length
                    self.staged[part] = (c, m)
                moves.append(part)
            self.objects.append(PageObject(spec.name, geometry, tuple(moves), room, start))
            # Copy groups: a host group's staged components of this object, stacked in
            # one map where the staging slot holds them at equal steps (K then V), else
            # one per component.
            first_group = len(self.copy_groups)
            for names, _, _ in host.groups:
                mine = [(p, self.staged[p][1]) for p, (c, _) in zip(moves, comps)
                        if c.name in names and type(p) is Staged]
                stacked = RowMap.stack([m for _, m in mine]) if len(mine) > 1 and _even([p for p, _ in mine]) else None
                if stacked is not None:
                    self.copy_groups.append((tuple(p for p, _ in mine), stacked))
                else:
                    self.copy_groups.extend(((p,), m) for p, m in mine)
            self.object_groups.append(tuple(range(first_group, len(self.copy_groups))))
        self.slot_bytes = off if self.staged else 0
        self.payload_bytes = sum(o.payload_bytes for o in self.objects)
        self._free: List[Staging] = []
        self._lock = threading.Lock()

    @property
    def in_place(self) -> bool:
        """Whether every component moves in place (no staging copy)."""
        return not self.staged

    # ------------------------------------------------------------------ staging buffers
    def take_staging(self, pages: int) -> Optional[Staging]:
        """A staging buffer for ``pages`` pages (None where nothing is staged); give it
        back with `give_staging`. Buffers are reused, so a call allocates none."""
        if not self.staged:
            return None
        with self._lock:
            for i, s in enumerate(self._free):
                if s.capacity >= pages:
                    return self._free.pop(i)
        return Staging(self, max(pages, 1))

    def give_staging(self, s: Optional[Staging]) -> None:
        if s is not None:
            with self._lock:
                self._free.append(s)
                self._free.sort(key=lambda x: x.capacity)
                del self._free[4:]      # a backup and a prefetch thread keep two at most in use

    # ------------------------------------------------------------------ pieces
    def pieces(self, page: int, staging: Optional[Staging], slot: int, obj: int = 0) -> List[memoryview]:
        """The payload of object ``obj`` of host page number ``page`` (slot // page_size)
        as pieces in canonical order: host memory for direct components, staging slot
        ``slot`` for staged ones (one piece where every component is staged)."""
        if staging is not None and staging.payloads[obj] is not None:
            return staging.payloads[obj][slot]
        out = []
        for part in self.objects[obj].components:
            if type(part) is Direct:
                base = part.offset + page * part.page_stride
                for i in range(part.count):
                    a = base + i * part.layer_stride
                    out.append(part.view[a:a + part.length])
            else:
                a = slot * self.slot_bytes + part.offset
                out.append(staging.view[a:a + part.length])
        return out

    def framed(self, staging: Optional[Staging], slot: int, header_bytes: int,
               obj: int = 0) -> Optional[Tuple[memoryview, Tuple[memoryview]]]:
        """Object ``obj`` of staging slot ``slot`` framed by a header of ``header_bytes``:
        a view of the header, and the header followed by the payload as one buffer (a
        1-tuple, what the engine moves), where the object is staged whole and its header
        fits its room; else None. Engines move a value in one buffer faster than in two
        (Mooncake sends each buffer as a transfer of its own, so it would gather them).
        The views are made once per staging buffer, object and header length
        (`Staging.frames`), so a call makes none."""
        o = self.objects[obj]
        if staging is None or header_bytes > o.header_room:
            return None
        frames = staging.frames.get((obj, header_bytes))
        if frames is None:
            frames = staging.frames.put((obj, header_bytes), self._frames(staging, header_bytes, o))
        return frames[slot]

    def _frames(self, staging: Staging, header_bytes: int, o: PageObject) -> list:
        out = []
        for a in _payload_starts(o, staging.capacity, self.slot_bytes):
            whole = staging.view[a - header_bytes:a + o.payload_bytes]
            out.append((whole[:header_bytes], (whole,)))
        return out

    # ------------------------------------------------------------------ staged copies
    def to_staging(self, host_pages: Sequence[int], staging: Staging, first_slot: int = 0) -> None:
        """Staged components of host page numbers ``host_pages`` into staging slots
        ``first_slot``, ``first_slot + 1``, ... (one copy per copy group and run of pages)."""
        if self.staged:
            slots = range(first_slot, first_slot + len(host_pages))
            for host_v, staging_v in staging.fused:
                copy_pages(host_v, host_pages, staging_v, slots)

    def from_staging(self, staging: Staging, host_pages: Sequence[int], first_slot: int = 0,
                     obj: Optional[int] = None) -> None:
        """Staging slots ``first_slot``, ``first_slot + 1``, ... into the staged
        components of host pages ``host_pages``: of object ``obj`` alone where given
        (objects hold disjoint host bytes, so each can be placed as it lands), else of
        every object."""
        if self.staged:
            slots = range(first_slot, first_slot + len(host_pages))
            if obj is None:
                for host_v, staging_v in staging.fused:
                    copy_pages(staging_v, slots, host_v, host_pages)
                return
            for g in self.object_groups[obj]:
                host_v, staging_v = staging.views[g]
                copy_pages(staging_v, slots, host_v, host_pages)


@dataclass(frozen=True)
class _WholeRows:
    name: str = ""
    components: Optional[Tuple[str, ...]] = None
    heads: Optional[Tuple[int, int]] = None
    layers: Optional[Tuple[int, int]] = None


def _sliced(host, c: ComponentShape, heads: Optional[Tuple[int, int]],
            layers: Optional[Tuple[int, int]] = None) -> Tuple[ComponentShape, RowMap]:
    """Component ``c`` of ``host`` as an object holds it: its rows' heads ``heads``
    (first, count) of a head-split component, else whole rows; its layers ``layers``
    (first, count) of the pool's, else all; with its host map."""
    m = host.maps[c.name]
    cut_heads = heads is not None and c.name in HEAD_SPLIT
    if not cut_heads and layers is None:
        return c, m
    buf = host.buffers[c.name]
    offset = m.base - buf.data_ptr()
    num_layers, row_bytes, n_chunks, shape = c.num_layers, c.row_bytes, m.n_chunks, c.row_shape
    if layers is not None:
        offset += layers[0] * m.layer_stride
        num_layers = layers[1]
    if cut_heads:
        first, count = heads
        local = c.row_shape[0] if len(c.row_shape) > 1 else 1
        head_bytes = c.row_bytes // local
        if m.n_chunks == local and local > 1:          # page_head: one chunk per head
            offset += first * m.chunk_stride
            n_chunks = count
        elif m.n_chunks == 1:
            offset += first * head_bytes
        else:
            raise fail("host", c.name, f"rows of {m.n_chunks} chunks cannot be split into {local} heads")
        row_bytes = count * head_bytes
        shape = (count, *c.row_shape[1:]) if len(c.row_shape) > 1 else c.row_shape
    sub = RowMap.from_strides(buf, num_layers=num_layers, num_rows=m.num_rows, page_size=m.page_size,
                              row_bytes=row_bytes, token_stride=m.token_stride, page_stride=m.page_stride,
                              layer_stride=m.layer_stride, offset=offset, n_chunks=n_chunks,
                              chunk_stride=m.chunk_stride)
    return ComponentShape(c.name, num_layers, tuple(shape), c.dtype, row_bytes), sub


def _moves_in_place(P: int, c: ComponentShape, m: RowMap, layer_piece_min: int) -> Optional[str]:
    """"whole" or "layers" where component ``c`` (host map ``m``) moves in place
    (module doc), None where it is staged."""
    rows = P * c.row_bytes
    if m.page_contiguous and (c.num_layers == 1 or m.layer_stride == rows):
        return "whole"
    if m.page_contiguous and rows >= layer_piece_min:
        return "layers"
    return None


def _even(parts: Sequence[Staged]) -> bool:
    """Whether the staging slot holds ``parts`` one step apart, in order."""
    steps = {b.offset - a.offset for a, b in zip(parts, parts[1:])}
    return len(steps) == 1 and steps.pop() > 0


# ---------------------------------------------------------------------- the page copy
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def page_views(a: RowMap, b: RowMap) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two stacked maps of equal rows as tensors ``(components, pages, layers, P,
    chunks, words)`` over their memory, in the largest machine word both maps' addresses
    and strides allow, split into the same chunks (a contiguous row is re-described as
    the other side's chunks, which changes no byte it addresses)."""
    if a.is_table or b.is_table:
        raise ValueError("page_views: stacked maps only (host and staging memory)")
    if a.n_chunks == b.n_chunks:
        n_chunks, chunk_bytes, a_chunk, b_chunk = a.n_chunks, a.chunk_bytes, a.chunk_stride, b.chunk_stride
    elif a.n_chunks == 1:
        n_chunks, chunk_bytes, a_chunk, b_chunk = b.n_chunks, b.chunk_bytes, b.chunk_bytes, b.chunk_stride
    elif b.n_chunks == 1:
        n_chunks, chunk_bytes, a_chunk, b_chunk = a.n_chunks, a.chunk_bytes, a.chunk_stride, a.chunk_bytes
    else:
        raise ValueError(f"page_views: {a.describe()} and {b.describe()} split rows differently")
    word = next(w for w in (8, 4, 2, 1) if a.align % w == 0 and b.align % w == 0 and chunk_bytes % w == 0)
    return _view(a, word, n_chunks, chunk_bytes, a_chunk), _view(b, word, n_chunks, chunk_bytes, b_chunk)


def _view(m: RowMap, word: int, n_chunks: int, chunk_bytes: int, chunk_stride: int) -> torch.Tensor:
    owner = m.segments[0][0]
    st = owner.untyped_storage()
    offset = m.base - st.data_ptr()
    shape = (m.num_components, m.num_pages, m.num_layers, m.page_size, n_chunks, chunk_bytes // word)
    strides = (m.comp_stride, m.page_stride, m.layer_stride, m.token_stride, chunk_stride, word)
    return torch.empty(0, dtype=_WORDS[word]).set_(st, offset // word, shape, tuple(x // word for x in strides))


def _as_chunks(words: np.ndarray) -> np.ndarray:
    """A page view's last axis (one chunk's machine words, contiguous) as one element
    of the chunk's size, so that numpy copies each chunk with one memmove rather than
    word by word (512 B rows: 2.1 GB/s against 1.2 per page on a 2-core CPU)."""
    if words.shape[-1] <= 1 or words.strides[-1] != words.itemsize:
        return words
    return words.view(np.dtype((np.void, words.shape[-1] * words.itemsize)))


def _fused(views: List[Tuple[np.ndarray, np.ndarray]], object_groups: Sequence[Tuple[int, ...]]
           ) -> List[Tuple[np.ndarray, np.ndarray]]:
    """The copy groups' page views (host, staging), with alike objects' groups folded
    into one view pair each: objects whose copy group k has the same shape and strides
    on both sides, each starting one fixed step after the one before on each side (a
    page's head groups: equal in size, held one after another by the staging slot).
    A folded pair has an objects axis before the chunks, so one copy writes each host
    row's head groups in address order rather than one 256 B slice a row per object
    (placing 16 MiB of pages of four head groups: 0.55 ms against 1.5, 2-core CPU;
    results/2026-12-07_cpu_store_reshard_folded). Groups of
    objects unlike the others are kept as they are."""
    def signature(groups):
        return tuple((v.shape, v.strides, v.dtype) for g in groups for v in views[g])

    classes: Dict[tuple, List[Tuple[int, ...]]] = {}
    for groups in object_groups:
        classes.setdefault(signature(groups), []).append(groups)
    out = []
    for members in classes.values():
        folded = _fold([[views[g] for g in groups] for groups in members]) if len(members) > 1 else None
        out.extend(folded if folded is not None else (views[g] for groups in members for g in groups))
    return out


def _fold(pairs_by_object: List[List[Tuple[np.ndarray, np.ndarray]]]) -> Optional[List[Tuple[np.ndarray, np.ndarray]]]:
    """Alike objects' view pairs (same shapes and strides) as one pair per copy group
    with an objects axis, where each group starts a fixed non-zero step after the
    previous object's on both sides; else None. Slice o of a folded view is exactly
    object o's view (same address, shape and strides), so it addresses no other byte."""
    m, folded = len(pairs_by_object), []
    for k in range(len(pairs_by_object[0])):
        sides = []
        for side in range(2):
            arrays = [pairs[k][side] for pairs in pairs_by_object]
            addr = [a.__array_interface__["data"][0] for a in arrays]
            step, a0 = addr[1] - addr[0], arrays[0]
            if not step or any(addr[o] != addr[0] + o * step for o in range(m)):
                return None
            # the objects axis goes before the chunks: `page_views`' axis 4
            sides.append(np.lib.stride_tricks.as_strided(
                a0, a0.shape[:4] + (m,) + a0.shape[4:], a0.strides[:4] + (step,) + a0.strides[4:]))
        folded.append(tuple(sides))
    return folded


def copy_pages(src, src_pages: Sequence[int], dst, dst_pages: Sequence[int]) -> None:
    """``dst[:, dst_pages[j]] = src[:, src_pages[j]]`` for page views (`page_views`, as
    numpy arrays): one strided copy per run of pages consecutive on both sides."""
    j, n = 0, len(src_pages)
    while j < n:
        s0, d0, k = src_pages[j], dst_pages[j], 1
        while j + k < n and src_pages[j + k] == s0 + k and dst_pages[j + k] == d0 + k:
            k += 1
        np.copyto(dst[:, d0:d0 + k], src[:, s0:s0 + k])
        j += k


def modes(plan: CanonicalPages) -> Dict[str, str]:
    """How each component of a page's first object moves: "whole", "layers" or "staged"
    (for docs and tests)."""
    return {c.name: ("staged" if isinstance(p, Staged) else "whole" if p.count == 1 else "layers")
            for c, p in zip(plan.objects[0].geometry.components, plan.objects[0].components)}
