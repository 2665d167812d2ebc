"""Host pages <-> the canonical payload (`kvtier.store.page`), for any host layout.

Each component of a host pool is moved one of three ways, read off its row map:

- "whole": the host holds all of a page's layers of the component in canonical order,
  contiguously (``page_first_direct``; ``page_first`` with one-token pages): the host
  memory itself is the payload piece (no copy).
- "layers": the host holds each layer's page rows contiguously (``layer_first``): one
  piece per layer, in place, where a piece is at least `LAYER_PIECE_MIN` bytes.
- "staged": anything else (``page_first``, ``page_head``, small layer pieces): a row
  copy between the host pool's row maps and row maps over a staging buffer in
  canonical order, for a whole batch of pages per component group. Where every
  component is staged, a slot also holds the page's header just before its payload,
  so the engine moves the object as one buffer (`CanonicalPages.object_view`).

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
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from kvtier.kernels import RowMap

from .page import Geometry, as_bytes_view, header_len

LAYER_PIECE_MIN = 16 * 1024     # smaller per-layer pieces are staged (docs/store.md)
HEADER_KEY_ROOM = 512           # key bytes a staging slot's header room holds (`object_view`)


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
        for s in plan.staged:
            c = plan.component(s.name)
            maps[s.name] = RowMap.from_strides(
                self.tensor, num_layers=c.num_layers, num_rows=capacity * P, page_size=P,
                row_bytes=c.row_bytes, token_stride=c.row_bytes, page_stride=stride,
                layer_stride=P * c.row_bytes, offset=s.offset)
        # One map per copy group (the host group's components stacked where they can be),
        # and the page views `copy_pages` moves between.
        self.maps, self.views = [], []
        for names, host_map in plan.copy_groups:
            smap = maps[names[0]] if len(names) == 1 else RowMap.stack([maps[n] for n in names])
            self.maps.append(smap)
            self.views.append(tuple(_as_chunks(v.numpy()) for v in page_views(host_map, smap)))


class CanonicalPages:
    """How one `HostPool`'s pages become payloads and back (module doc)."""

    def __init__(self, host, layer_piece_min: int = LAYER_PIECE_MIN):
        self.host = host
        self.geometry = Geometry.of(host)
        self.page_size = host.page_size
        self.payload_bytes = self.geometry.payload_bytes
        group_of = {}
        for names, gmap, buf in host.groups:
            view = as_bytes_view(buf)
            for n in names:
                group_of[n] = (names, gmap, buf, view)
        self.parts: List[object] = []         # Direct or Staged, in payload order
        self.staged: List[Staged] = []
        # A page staged whole has room for its header just before its payload in its
        # slot, so that header and payload are one buffer for the engine (`object_view`).
        self.header_room = 0
        P = self.page_size
        hows = [self._moves_in_place(c, host.maps[c.name], layer_piece_min) for c in self.geometry.components]
        if not any(hows):
            text_bytes = len(self.geometry.text.encode())
            self.header_room = -(-header_len(text_bytes, HEADER_KEY_ROOM) // 64) * 64
        staged_off = self.header_room
        for c, how in zip(self.geometry.components, hows):
            m = host.maps[c.name]
            _, _, buf, view = group_of[c.name]
            offset = m.base - buf.data_ptr()
            rows = P * c.row_bytes
            if how == "whole":
                part = Direct(c.name, view, offset, m.page_stride, 0, 1, c.num_layers * rows)
            elif how == "layers":
                part = Direct(c.name, view, offset, m.page_stride, m.layer_stride, c.num_layers, rows)
            else:
                part = Staged(c.name, staged_off, c.num_layers * rows)
                staged_off += part.length
                self.staged.append(part)
            self.parts.append(part)
        self.slot_bytes = staged_off if self.staged else 0
        # Copy groups: a host group's staged components, stacked in one map where the
        # staging buffer holds them at equal steps (K then V), else one per component.
        staged_names = {s.name for s in self.staged}
        self.copy_groups: List[Tuple[Tuple[str, ...], RowMap]] = []
        for names, gmap, _ in host.groups:
            mine = tuple(n for n in names if n in staged_names)
            if not mine:
                continue
            if mine == names and len(names) > 1 and self._stackable(names):
                self.copy_groups.append((names, gmap))
            else:
                self.copy_groups.extend(((n,), host.maps[n]) for n in mine)
        self._free: List[Staging] = []
        self._lock = threading.Lock()

    def component(self, name: str):
        return next(c for c in self.geometry.components if c.name == name)

    def _moves_in_place(self, c, m: RowMap, layer_piece_min: int) -> Optional[str]:
        """"whole" or "layers" where component ``c`` (host map ``m``) moves in place
        (module doc), None where it is staged."""
        rows = self.page_size * c.row_bytes
        if m.page_contiguous and (c.num_layers == 1 or m.layer_stride == rows):
            return "whole"
        if m.page_contiguous and rows >= layer_piece_min:
            return "layers"
        return None

    def _stackable(self, names: Sequence[str]) -> bool:
        """Whether the staging buffer holds ``names`` at one step apart, in host order."""
        offs = {s.name: s.offset for s in self.staged}
        steps = {offs[b] - offs[a] for a, b in zip(names, names[1:])}
        return len(steps) == 1 and steps.pop() > 0

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
    def pieces(self, page: int, staging: Optional[Staging], slot: int) -> List[memoryview]:
        """The payload of host page number ``page`` (slot // page_size) as pieces in
        canonical order: host memory for direct components, staging slot ``slot`` for
        staged ones."""
        out = []
        for part in self.parts:
            if type(part) is Direct:
                base = part.offset + page * part.page_stride
                for i in range(part.count):
                    a = base + i * part.layer_stride
                    out.append(part.view[a:a + part.length])
            else:
                a = slot * self.slot_bytes + part.offset
                out.append(staging.view[a:a + part.length])
        return out

    def object_view(self, staging: Optional[Staging], slot: int, header_bytes: int) -> Optional[memoryview]:
        """Staging slot ``slot`` as one buffer of a header of ``header_bytes`` followed by
        the page's payload, where the page is staged whole and its header fits the
        slot's room; else None. Engines move a value in one buffer faster than in two
        (Mooncake sends each buffer as a transfer of its own, so it would gather them)."""
        if staging is None or header_bytes > self.header_room:
            return None
        a = slot * self.slot_bytes + self.header_room
        return staging.view[a - header_bytes:a + self.payload_bytes]

    # ------------------------------------------------------------------ staged copies
    def to_staging(self, host_pages: Sequence[int], staging: Staging, first_slot: int = 0) -> None:
        """Staged components of host page numbers ``host_pages`` into staging slots
        ``first_slot``, ``first_slot + 1``, ... (one copy per copy group and run of pages)."""
        if self.staged:
            slots = range(first_slot, first_slot + len(host_pages))
            for host_v, staging_v in staging.views:
                copy_pages(host_v, host_pages, staging_v, slots)

    def from_staging(self, staging: Staging, host_pages: Sequence[int], first_slot: int = 0) -> None:
        """Staging slots ``first_slot``, ``first_slot + 1``, ... into the staged
        components of host pages ``host_pages``."""
        if self.staged:
            slots = range(first_slot, first_slot + len(host_pages))
            for host_v, staging_v in staging.views:
                copy_pages(staging_v, slots, host_v, host_pages)


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
    """How each component moves: "whole", "layers" or "staged" (for docs and tests)."""
    return {p.name: ("staged" if isinstance(p, Staged) else "whole" if p.count == 1 else "layers")
            for p in plan.parts}
