"""The "dma" way across the link: a gather kernel packs device rows into a contiguous
device staging buffer laid out in the host's order, and bulk asynchronous copies move
each contiguous run between staging and host memory (loads run it in reverse).

Staging has the host buffer's layout with only the moved slots (or pages) and layers,
so a run of consecutive host slots is a run of consecutive staging slots. A run's
pieces (one per layer and component in layer_first) repeat at one stride in both
buffers, so each run is one or a few 2-D copies (`dma_copies`), issued by the runtime's
2-D copy (`link_copy`).

Overlap. A transfer moves in chunks of at most `DmaConfig.chunk_bytes` through a ring of
`DmaConfig.slots` staging slots. The gather (or, for loads, the scatter) runs on the
caller's current stream with the device-local configuration of its own operation
(``gather`` / ``scatter``, many programs: it is not bounded by the link's program cap);
the bulk copies run on a side stream. Events order them per slot, so chunk k's copies
run while chunk k+1 is gathered (loads: chunk k's upload while chunk k-1 scatters).
The call ends with the caller's stream waiting for the side stream, so every rule of
docs/pools.md ("Ordering rules") holds as if all work ran on the caller's stream.

Reuse. One `StreamStaging` per (device, caller stream) keeps the staging ring (grown when a
transfer needs larger slots, never per call), its row maps (and with them the kernel's
launch plans), the side stream and the events. Runs and chunks are kept by the
values of the host indices (`dma_copies.runs_of`, `dma_copies.chunks_of`); device indices
are never read on the host.

Bad device indices. A backup whose device-side index check fails must change no host
byte, yet its bulk copies are issued before the verdict exists. So each chunk's staging
slot is first filled with the destination host rows' current bytes whenever the verdict
is bad: by a copy kernel that reads the host rows (where kernels reach the host buffer:
pinned memory on CUDA/ROCm, registered memory on Ascend) and runs only when the verdict
is bad; elsewhere (Ascend with plain pinned memory) by runtime copies host -> staging
before the gather, which adds the transfer's bytes in the other link direction. The bulk
copies then write back the bytes the host rows already hold. A verdict the host can read
for free (CPU) skips the transfer instead.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Optional, Tuple

import torch

import kvtier.platforms as platforms
from kvtier.autotune.select import config_for
from kvtier.errors import fail
from kvtier.kernels import RowMap
from kvtier.kernels.index_check import Checks
from kvtier.kernels.iota import iota
from kvtier.kernels.layouts import host_layout
from kvtier.kernels.ops import Op
from kvtier.kernels.transfer import Copy, Transfer
from kvtier.kernels.validate import compute_device

from . import link_copy
from .dma_copies import Chunk, chunks_of, runs_of, shape_2d
from kvtier import caches

Runs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
CHUNK_ENV = "KVTIER_DMA_CHUNK_BYTES"


@dataclass(frozen=True)
class DmaConfig:
    """How the dma strategy pipelines a transfer.

    chunk_bytes: bytes per chunk (and per staging slot; a slot holds at least one unit,
        a slot or a page of every layer and component moved). Larger chunks mean fewer
        launches and copy calls per transfer; the first chunk's gather (the last chunk's
        scatter, for loads) is the part that does not overlap with the link.
    slots: staging slots in the ring (2: one being gathered while the other crosses).
    """

    chunk_bytes: int = 8 << 20
    slots: int = 2

    def __post_init__(self):
        for name in ("chunk_bytes", "slots"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise fail(f"DmaConfig.{name}", v, "must be a positive int")


_CONFIG: List[Optional[DmaConfig]] = [None]


def settings() -> DmaConfig:
    """The dma configuration: `configure`'s, else ``KVTIER_DMA_CHUNK_BYTES`` (read once)
    over the defaults."""
    if _CONFIG[0] is None:
        env = os.environ.get(CHUNK_ENV)
        if env is None:
            _CONFIG[0] = DmaConfig()
        else:
            try:
                value = int(env)
            except ValueError:
                raise fail(CHUNK_ENV, env, "must be a positive int (bytes)") from None
            _CONFIG[0] = DmaConfig(chunk_bytes=value)
    return _CONFIG[0]


def configure(cfg: Optional[DmaConfig]) -> Optional[DmaConfig]:
    """Set the dma configuration for the process (None: back to the environment's and the
    defaults); returns the previous one. Staging rings already made are regrown as needed."""
    if cfg is not None and not isinstance(cfg, DmaConfig):
        raise fail("cfg", type(cfg).__name__, "must be a DmaConfig or None")
    old, _CONFIG[0] = _CONFIG[0], cfg
    return old


# ------------------------------------------------------------------ per-stream staging
@dataclass
class StagingSlot:
    """One staging slot as a ``(C, *layout dims)`` tensor and its row map."""

    tensor: torch.Tensor
    map: RowMap


caches.declare("pool.dma.StreamStaging.slots", key="dtype, components, layout, page size, layers, row shape, "
               "chunk cap, slot count", value="staging slots: views of this ring's buffer and their maps",
               bound="32 per ring", rule="the buffer grown (all dropped)",
               stale="not happen: views of the ring's current buffer only")
caches.declare("pool.dma.StreamStaging.host_slots", key="a kept chunk (the entry holds it, so its id is not reused)",
               value="the chunk's host slots on the device", bound="64 per ring",
               stale="not happen: the entry holds its chunk")


class StreamStaging:
    """The staging ring, side stream and events of one (device, caller stream).

    Every transfer through it orders its work against the previous one through the
    caller's stream (see `_backup` and `_load`), so transfers share one ring safely."""

    def __init__(self, device: torch.device):
        self.device = device
        self.runtime = None if device.type == "cpu" else getattr(torch, device.type)
        rt = self.runtime
        self.side = rt.Stream(device=device) if rt is not None else None
        self.buffer: Optional[torch.Tensor] = None
        self.slots = caches.bounded("pool.dma.StreamStaging.slots", 32)
        self.events: Dict[str, object] = {}
        # One transfer enqueues at a time: two threads on one stream would otherwise
        # interleave their chunks in one ring and wait on each other's events.
        self.lock = threading.Lock()
        self.host_slots = caches.bounded("pool.dma.StreamStaging.host_slots", 64)   # id(chunk) -> (chunk, its slots)

    # -- staging
    def ring(self, host_buf: torch.Tensor, layout: str, page_size: int, layers: int, cap: int,
             n_slots: int) -> List[StagingSlot]:
        """``n_slots`` staging slots of ``cap`` units shaped like ``host_buf``'s layout with
        ``layers`` layers; the ring's buffer grows (doubling) when they do not fit."""
        lay = host_layout(layout)
        row_shape = tuple(lay.row_shape(host_buf.shape[1:]))
        key = (host_buf.dtype, host_buf.shape[0], layout, page_size, layers, row_shape, cap, n_slots)
        ring = self.slots.get(key)
        if ring is not None:
            return ring
        unit = page_size if lay.paged else 1
        shape = (host_buf.shape[0], *lay.shape(layers=layers, slots=cap * unit, page_size=page_size,
                                               row_shape=row_shape))
        slot_bytes = -(-prod(shape) * host_buf.element_size() // ALIGN) * ALIGN
        if self.buffer is None or self.buffer.numel() < n_slots * slot_bytes:
            self._grow(n_slots * slot_bytes)
        ring = []
        for s in range(n_slots):
            t = self.buffer[s * slot_bytes:s * slot_bytes + prod(shape) * host_buf.element_size()]
            t = t.view(host_buf.dtype).view(shape)
            ring.append(StagingSlot(t, RowMap.stack([RowMap.from_host_layout(t[c], layout, unit)
                                              for c in range(shape[0])])))
        return self.slots.put(key, ring)

    def _grow(self, nbytes: int) -> None:
        old = 0 if self.buffer is None else self.buffer.numel()
        # Allocated on the caller's stream; the side stream is recorded so that the
        # caching allocator never hands the memory out while a copy may still read it.
        self.buffer = torch.empty(max(nbytes, 2 * old), dtype=torch.uint8, device=self.device)
        if self.side is not None:
            self.buffer.record_stream(self.side)
        self.slots.clear()

    # -- streams and events
    def event(self, name: str):
        ev = self.events.get(name)
        if ev is None and self.runtime is not None:
            ev = self.events[name] = self.runtime.Event()
        return ev

    def signal(self, name: str, stream) -> None:
        """Record event ``name`` on ``stream`` (None: nothing, on the CPU)."""
        if stream is not None:
            self.event(name).record(stream)

    def wait(self, stream, name: str) -> None:
        """Make ``stream`` wait for the last record of event ``name``."""
        if stream is not None:
            stream.wait_event(self.event(name))

    def on_side(self):
        return self.runtime.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def host_slots_of(self, chunk: Chunk, unit: int) -> torch.Tensor:
        """The host slots of ``chunk`` in staging order, on the device (uploaded once per
        kept chunk on this stream, so only transfers on it read them)."""
        hit = self.host_slots.get(id(chunk))
        if hit is not None and hit[0] is chunk:      # the entry holds the chunk: its id is not reused
            return hit[1]
        u = chunk.host_units
        slots = (u[:, None] * unit + torch.arange(unit)).reshape(-1) if unit > 1 else u
        if self.device.type != "cpu":
            slots = slots.pin_memory().to(self.device, non_blocking=True)
        self.host_slots.put(id(chunk), (chunk, slots))
        return slots


ALIGN = 256                     # bytes: staging slots start at this alignment
_STREAM_STAGING = caches.bounded(
    "pool.dma._STREAM_STAGING", 16, kind="state", key="device, caller stream",
    value="StreamStaging: staging ring, side stream, events (an evicted one's memory is freed once its streams finish)")


def stream_staging(device: torch.device) -> StreamStaging:
    """The staging of ``device`` and its current stream."""
    stream = platforms.current_stream(device) if device.type != "cpu" else None
    return _STREAM_STAGING.get_or_make((device, stream), lambda: StreamStaging(device))


# ------------------------------------------------------------------ transfers
def backup(op, dev_map, didx, host_buf, layout, page_size, dev_layer, host_layer, num_layers,
           run_list, by_page, config, verdict=None, host_map=None) -> None:
    """Device rows ``didx`` of layers dev_layer.. -> host layers host_layer.. at the runs.
    ``verdict``: the words the call's check launch wrote (None: unchecked); ``host_map``:
    the host buffer as one map of unit rows (the bad-verdict fill reads through it)."""
    t = _DmaCall(op, dev_map, didx, host_buf, layout, page_size, dev_layer, host_layer, num_layers,
                  run_list, by_page, config, verdict, host_map)
    if t.chunks:
        with t.staging.lock:
            t.backup()


def load(op, dev_map, didx, host_buf, layout, page_size, dev_layer, host_layer, num_layers,
         run_list, by_page, config, verdict=None, host_map=None) -> None:
    """Host layers host_layer.. at the runs -> device rows ``didx`` of layers dev_layer.."""
    t = _DmaCall(op, dev_map, didx, host_buf, layout, page_size, dev_layer, host_layer, num_layers,
                  run_list, by_page, config, verdict, host_map)
    if t.chunks:
        with t.staging.lock:
            t.load()


class DmaMove:
    """One copy of a host pool transfer that the dma strategy moves: the bulk mover of a
    `kvtier.kernels.transfer.Step`. ``host_side(host_list, checked)`` finds the runs of
    the host list (its values checked first where ``checked``, raising before any byte
    of the call moves); calling it with the call's lists, those runs and the call's
    verdict enqueues the move."""

    def __init__(self, op, dev_map: RowMap, host_buf: torch.Tensor, layout: str, page_size: int, dev_layer: int,
                 host_layer: int, num_layers: int, by_page: bool, config, limit: int):
        self.op, self.dev_map, self.host_buf, self.layout, self.page_size = op, dev_map, host_buf, layout, page_size
        self.dev_layer, self.host_layer, self.num_layers, self.by_page = dev_layer, host_layer, num_layers, by_page
        self.config = config
        paged = host_layout(layout).paged
        self.unit = page_size if paged else 1
        self.check = (limit, self.unit)
        # The host buffer as one map of unit rows (the bad-verdict fill reads the host rows through it).
        self.host_map = RowMap.stack([RowMap.from_host_layout(host_buf[c], layout, self.unit)
                                      for c in range(host_buf.shape[0])])
        self.move = backup if op.from_device else load

    def host_side(self, host_list: torch.Tensor, checked: bool) -> Runs:
        # Kept by value (`dma_copies.runs_of`): a call with the indices of an earlier one
        # (HiCache's per-layer loads) finds its runs, and with them its chunks.
        return runs_of(host_list.cpu(), self.unit, self.check if checked else None)

    def __call__(self, si: torch.Tensor, di: torch.Tensor, run_list: Runs, verdict) -> None:
        self.move(self.op, self.dev_map, si if self.op.from_device else di, self.host_buf, self.layout,
                  self.page_size, self.dev_layer, self.host_layer, self.num_layers, run_list, self.by_page,
                  self.config, verdict, self.host_map)


def verdict_now(verdict: Optional[torch.Tensor]) -> Optional[int]:
    """The verdict's value where the host reads it for free (no verdict: 0; a CPU word),
    or None where it lives on a device (known only to the copies)."""
    if verdict is None:
        return 0
    return int(verdict[0]) if verdict.device.type == "cpu" else None


def _staging_copy(op: Op, src: RowMap, si: torch.Tensor, dst: RowMap, di: torch.Tensor, src_layer: int,
                  dst_layer: int, num_layers: int, by_page: bool, config, verdict) -> None:
    """One copy between a staging slot and the device pool (or the host rows) at lists
    kvtier made itself (parts of the call's checked lists, or rows 0 .. n-1), gated by the
    call's ``verdict`` (None: the call is unchecked): a transfer of its own, kept nowhere
    (the staging ring's slots change as it grows)."""
    if not si.numel():
        return
    checks = Checks(("src_indices", src.num_rows, 1), ("dst_indices", dst.num_rows, 1))
    t = Transfer([Copy(src, dst, src_layer, dst_layer, num_layers, by_page)], device=compute_device(src, dst),
                 checks=checks, check=False, resolve=lambda c, n: (config, "kernel"), watched=False, op=op,
                 strategy="dma")
    t.launch_checked(t.steps(si.numel()), si, di, None, verdict, False)


class _DmaCall:
    """One backup or load of one host component group through its stream's staging."""

    def __init__(self, op, dev_map, didx, host_buf, layout, page_size, dev_layer, host_layer, num_layers,
                 run_list, by_page, config, verdict, host_map):
        self.chunks: List[Chunk] = []
        known = verdict_now(verdict)
        if known:
            return          # a bad list the host already knows of: the guard raises, nothing moves
        lay = host_layout(layout)
        self.op, self.dev_map, self.didx, self.host_buf = op, dev_map, didx, host_buf
        self.layout, self.page_size, self.num_layers, self.by_page = layout, page_size, num_layers, by_page
        self.dev_layer, self.host_layer, self.config, self.verdict = dev_layer, host_layer, config, verdict
        self.host_map = host_map
        self.unknown_verdict = known is None
        self.unit = page_size if lay.paged else 1
        cfg = settings()
        # A unit (a slot, or a page in page-major layouts) of every layer and component.
        unit_bytes = (host_buf.element_size() * host_buf.shape[0] * num_layers
                      * prod(lay.row_shape(host_buf.shape[1:])) * self.unit)
        self.cap = max(1, cfg.chunk_bytes // unit_bytes)
        self.staging = stream_staging(didx.device)
        self.ring = self.staging.ring(host_buf, layout, page_size, num_layers, self.cap, cfg.slots)
        ld, ud = 1 + lay.layer_dim, 1 + lay.unit_dim
        shape = _shape(host_buf, layout, host_layer, num_layers, self.ring[0].tensor, ld, ud)
        self.chunks = chunks_of(run_list, shape, self.cap)
        # The chunks' host offsets are from the layer range's first byte: its bytes from there.
        self.host_range = link_copy.bytes_from(host_buf, host_layer * host_buf.stride(ld) * host_buf.element_size())
        self.stage_op = Op("gather" if op.from_device else "scatter", op.scope)
        self.stream = platforms.current_stream(didx.device) if didx.device.type != "cpu" else None

    # -- pieces of a chunk
    def _slot(self, k: int) -> StagingSlot:
        return self.ring[k % len(self.ring)]

    def _stage_launch(self, ch: Chunk, slot: StagingSlot, to_stage: bool) -> None:
        di = self.didx[ch.first * self.unit:(ch.first + ch.count) * self.unit]
        si = iota(di.numel(), di.dtype, di.device)
        # The gather's own configuration (device-local, many programs), not the link's,
        # and not a configuration a pool fixes for its own transfers.
        cfg = config_for(self.stage_op, self.didx.device, row_bytes=self.dev_map.row_bytes,
                         page_size=self.dev_map.page_size, num_rows=di.numel(), num_layers=self.num_layers)
        dev, stage = (self.dev_map, di, self.dev_layer), (slot.map, si, 0)     # (map, rows, first layer)
        src, dst = (dev, stage) if to_stage else (stage, dev)
        _staging_copy(self.stage_op, src[0], src[1], dst[0], dst[1], src[2], dst[2], self.num_layers, self.by_page,
                      cfg, self.verdict)

    def _copies(self, ch: Chunk, slot: StagingSlot, to_host: bool) -> None:
        with self.staging.on_side():
            link_copy.issue(ch.copies, self.host_range, slot.tensor, to_host)

    # -- the bad-verdict fill (see the module doc)
    def _fill_mode(self) -> Optional[str]:
        if not self.unknown_verdict:
            return None
        return "kernel" if self.host_map.reachable_by(platforms.of(self.didx.device)) else "copies"

    def _fill_from_host(self, ch: Chunk, slot: StagingSlot, inverted: torch.Tensor) -> None:
        """Staging slot <- the chunk's host rows, only where the verdict is bad."""
        hs = self.staging.host_slots_of(ch, self.unit)
        _staging_copy(self.op, self.host_map, hs, slot.map, iota(hs.numel(), hs.dtype, hs.device),
                      self.host_layer, 0, self.num_layers, self.by_page, self.config, inverted)

    # -- the pipelines
    def backup(self) -> None:
        st, S, side = self.staging, self.stream, self.staging.side
        n = len(self.ring)
        mode = self._fill_mode()
        inverted = self.verdict[1:] if mode == "kernel" else None       # 0 exactly for a bad call
        if mode == "copies":
            st.signal("started", S)
            st.wait(side, "started")                # fills after the caller's earlier work
        for k, ch in enumerate(self.chunks):
            s = k % n
            slot = self._slot(k)
            if k >= n:
                st.wait(S, f"drained{s}")           # chunk k - n's copies have left this slot
            if mode == "kernel":
                self._fill_from_host(ch, slot, inverted)
            elif mode == "copies":
                self._copies(ch, slot, to_host=False)
                st.signal(f"filled{s}", side)
                st.wait(S, f"filled{s}")
            self._stage_launch(ch, slot, to_stage=True)
            st.signal(f"gathered{s}", S)
            st.wait(side, f"gathered{s}")
            self._copies(ch, slot, to_host=True)
            st.signal(f"drained{s}", side)
        st.signal("joined", side)
        st.wait(S, "joined")                        # the caller's stream after every copy

    def load(self) -> None:
        st, S, side = self.staging, self.stream, self.staging.side
        n = len(self.ring)
        st.signal("started", S)
        st.wait(side, "started")                    # uploads after the caller's earlier work
        for k, ch in enumerate(self.chunks):
            s = k % n
            slot = self._slot(k)
            if k >= n:
                st.wait(side, f"drained{s}")        # chunk k - n's scatter has left this slot
            self._copies(ch, slot, to_host=False)
            st.signal(f"uploaded{s}", side)
            st.wait(S, f"uploaded{s}")
            self._stage_launch(ch, slot, to_stage=False)
            st.signal(f"drained{s}", S)


_SHAPES = caches.bounded("pool.dma._SHAPES", 256, key="both views' shapes, strides, element size, layout, layer range",
                         value="2-D copy shape", stale="not happen: no address in it")


def _shape(host_buf, layout, host_layer, num_layers, stage, ld, ud):
    """`shape_2d` of the host layer range against a staging slot: a function of both
    views' shapes, strides and element size only, so kept by those."""
    key = (tuple(host_buf.shape), host_buf.stride(), host_buf.element_size(), layout, host_layer, num_layers,
           tuple(stage.shape), stage.stride(), ld, ud)
    return _SHAPES.get_or_make(key, lambda: shape_2d(host_buf.narrow(ld, host_layer, num_layers), stage, ud))
