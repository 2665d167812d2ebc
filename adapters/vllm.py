"""vLLM's CPU offloading with kvtier's row copy moving the blocks.

vLLM keeps, per KV cache tensor, a GPU view ``(num_gpu_blocks, page)`` and a CPU view
``(num_cpu_chunks, page * factor)`` (int8), where one CPU chunk holds ``factor`` GPU
blocks. The CPU view is either its own tensor or a slice of vLLM's shared offload region,
whose rows are ``row_stride`` bytes apart because every tensor's chunk sits in the same
row. Both are the same `RowMap`: ``page_size = factor`` sub-block rows of ``page`` bytes,
``page_stride`` the view's row stride. The maps are built once, at construction; a
transfer only turns block ids into row indices on the host (`vllm_blocks`), stages
them, and launches one copy per KV cache group and tensor geometry.

- `KvtierOffloadingHandler`: one direction, with the handler interface vLLM's offloading
  worker drives: ``transfer_async(job_id, (src_spec, dst_spec))`` (vLLM's
  ``OffloadingHandler``; ``transfer_async(job_id, src_spec, dst_spec)`` as vLLM 0.33's
  handler is called also works), ``get_finished()``, ``wait(job_ids)``, ``shutdown()``.
- `KvtierCPUOffloadingWorker`: vLLM 0.33's ``CPUOffloadingWorker`` (``submit_store``,
  ``submit_load``, ``get_finished``, ``wait``, ``shutdown``), with its constructor.
- ``KvtierCPUOffloadingSpec`` (built on first access, with vLLM imported): vLLM's
  ``CPUOffloadingSpec`` whose worker is kvtier's; name it in vLLM's
  ``kv_connector_extra_config`` (docs/engines/vllm.md).

Ordering: each handler queues on its own stream, after the work queued so far on the
current stream (the model's writes to the blocks a store reads; pending writes to the
blocks a load overwrites), so its jobs run in submission order. ``get_finished`` polls
the jobs' end events and never waits; ``wait`` waits for the named jobs. On the CPU
(no streams) a copy has finished when ``transfer_async`` returns.

Importing this module never imports vLLM.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections import deque
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

import kvtier.platforms as platforms
from kvtier.errors import KvtierError, fail
from kvtier.kernels.index_check import Checks
from kvtier.kernels.ops import BACKUP, LOAD
from kvtier.kernels.rowmap import RowMap
from kvtier.kernels.transfer import Copy, Transfer
from kvtier.kernels.validate import compute_device
from kvtier.pool import tuning

from .vllm_blocks import block_ids, fill_rows, group_layout, refs_or_all

__all__ = ["KvtierOffloadingHandler", "KvtierCPUOffloadingWorker", "TransferResult", "register_with_vllm"]

log = logging.getLogger("kvtier")


@dataclass
class TransferResult:
    """vLLM's ``TransferResult`` fields, used where vLLM's own class is not loaded."""

    job_id: int
    success: bool
    transfer_size: Optional[int] = None      # bytes
    transfer_time: Optional[float] = None    # seconds
    transfer_type: Optional[tuple] = None    # (src medium, dst medium)


def _result_type():
    """vLLM's ``TransferResult`` where vLLM's offloading modules are loaded (the handler
    runs inside vLLM), else kvtier's own with the same fields."""
    for name in ("vllm.v1.kv_offload.base", "vllm.v1.kv_offload.worker.worker"):
        cls = getattr(sys.modules.get(name), "TransferResult", None)
        if cls is not None:
            return cls
    return TransferResult


# ---------------------------------------------------------------- streams and events
class _HostQueue:
    """A direction's queue on the CPU: no stream, copies finish when launched (the queue is
    its own events: each has finished when its call returned)."""

    stream = None

    def event(self):
        return self

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def release(self, *events) -> None:
        pass

    def enter(self):
        return contextlib.nullcontext()

    def seconds(self, start, end) -> Optional[float]:
        return None


class _StreamQueue:
    """A direction's queue on an accelerator: its own stream, events from a pool."""

    def __init__(self, device: torch.device):
        self.mod, self.device = getattr(torch, device.type), device
        self.stream = self.mod.Stream(device=device)
        self._events: List = []

    def event(self):
        return self._events.pop() if self._events else self.mod.Event(enable_timing=True)

    def release(self, *events) -> None:
        self._events.extend(events)

    def enter(self):
        """Order the queue after what the current stream has queued, then make it current."""
        self.stream.wait_stream(self.mod.current_stream(self.device))
        return self.mod.stream(self.stream)

    def seconds(self, start, end) -> Optional[float]:
        return start.elapsed_time(end) * 1e-3


def _queue(device: torch.device):
    return _HostQueue() if device.type == "cpu" else _StreamQueue(device)


class _Rows:
    """One transfer's row indices, GPU rows then CPU rows in one flat int64 buffer:
    on the host (page-locked where an accelerator is present) and, there, on the device."""

    def __init__(self, cap: int, device: torch.device):
        self.cap = cap
        self.host = platforms.pinned_empty((2 * cap,), torch.int64)
        self.np = self.host.numpy()
        self.dev = self.host if device.type == "cpu" else torch.empty(2 * cap, dtype=torch.int64, device=device)


@dataclass
class _Job:
    job_id: int
    start: object
    end: object
    nbytes: int
    rows: _Rows


@dataclass
class _Group:
    """One KV cache group: its (GPU map, CPU map) pairs, one per tensor geometry, the
    GPU blocks every tensor of it has, the bytes one of its blocks moves, and (once the
    handler's direction is known) the prepared transfer of its pairs."""

    maps: list
    gpu_blocks: int
    block_bytes: int
    transfer: Optional[Transfer] = None


# ---------------------------------------------------------------- the handler
class KvtierOffloadingHandler:
    """One direction of vLLM's CPU offloading (GPU -> CPU when ``gpu_to_cpu``).

    Arguments as vLLM's ``SingleDirectionOffloadingHandler`` takes them:
    ``gpu_tensors`` ``(num_gpu_blocks, page)`` and ``cpu_tensors``
    ``(num_cpu_chunks, page * blocks_per_chunk)``, 1-byte dtype, pages contiguous, CPU
    rows any distance apart (plain tensors or views of vLLM's shared region);
    ``blocks_per_chunk`` (older vLLM: ``block_size_factor``); ``layer_refs_per_group``
    (older: ``kv_cache_groups_data_refs``): per KV cache group, references with
    ``tensor_idx`` and ``page_size_bytes`` (the bytes of a block that move; None: one
    group of every tensor at its full page). ``canonical_layout`` is refused;
    ``host_memory_is_pinned`` is accepted and not needed (the CPU tensors are checked).

    Bad arguments and bad specs raise `KvtierError` naming them before any byte moves.
    """

    def __init__(self, gpu_tensors: Sequence[torch.Tensor], cpu_tensors: Sequence[torch.Tensor],
                 blocks_per_chunk: Optional[int] = None, layer_refs_per_group=None,
                 gpu_to_cpu: Optional[bool] = None, canonical_layout: bool = False,
                 host_memory_is_pinned: bool = True, *, block_size_factor: Optional[int] = None,
                 kv_cache_groups_data_refs=None):
        factor = blocks_per_chunk if blocks_per_chunk is not None else block_size_factor
        factor = 1 if factor is None else factor
        if isinstance(factor, bool) or not isinstance(factor, (int, np.integer)) or factor < 1:
            raise fail("blocks_per_chunk", factor, "must be a positive int (GPU blocks per CPU chunk)")
        if not isinstance(gpu_to_cpu, bool):
            raise fail("gpu_to_cpu", gpu_to_cpu, "must be True (store) or False (load)")
        if canonical_layout:
            raise fail("canonical_layout", canonical_layout,
                       "kvtier moves plain and shared CPU regions; the canonical layout is not supported")
        gpus, cpus = _check_tensors(gpu_tensors, cpu_tensors, int(factor))
        refs = layer_refs_per_group if layer_refs_per_group is not None else kv_cache_groups_data_refs
        groups = refs_or_all(refs, [g.shape[1] for g in gpus])
        self.gpu_to_cpu, self.blocks_per_chunk = gpu_to_cpu, int(factor)
        self.num_cpu_chunks = min(c.shape[0] for c in cpus)
        self.transfer_type = ("GPU", "CPU") if gpu_to_cpu else ("CPU", "GPU")
        self._groups = [_group(gpus, cpus, refs_g, self.blocks_per_chunk) for refs_g in groups]
        maps = [m for g in self._groups for pair in g.maps for m in pair]
        self.device = compute_device(*maps)
        _check_reach(maps, self.device)
        self._op = BACKUP if gpu_to_cpu else LOAD
        for g in self._groups:
            g.transfer = _transfer(self._op, g.maps, self.device) if g.maps else None
        self._queue = _queue(self.device)
        self._jobs: deque = deque()
        self._pending: dict = {}          # job_id -> end event
        self._free: List[_Rows] = []      # index buffers of finished jobs
        self._closed = False
        self._result = _result_type()
        self._typed = "transfer_type" in {f.name for f in dataclasses.fields(self._result)}

    # ------------------------------------------------------------ vLLM's interface
    def transfer_async(self, job_id: int, spec, dst_spec=None) -> bool:
        """Queue job ``job_id`` moving ``spec = (src_spec, dst_spec)`` (or ``spec,
        dst_spec``); True once it is queued. GPU specs carry GPU block ids (and, per
        group, ``group_sizes`` / ``block_indices``); CPU specs carry chunk ids."""
        if self._closed:
            raise fail("handler", "shut down", "transfer_async after shutdown(): make a new handler")
        src_spec, dst_spec = _pair(spec, dst_spec)
        if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
            raise fail("job_id", job_id, "must be an int")
        if job_id in self._pending:
            raise fail("job_id", job_id, "is still in flight on this handler")
        store = self.gpu_to_cpu
        gpu_arg, cpu_arg = ("src_spec", "dst_spec") if store else ("dst_spec", "src_spec")
        gpu_spec, cpu_spec = (src_spec, dst_spec) if store else (dst_spec, src_spec)
        gpu_ids, cpu_ids = block_ids(gpu_arg, gpu_spec), block_ids(cpu_arg, cpu_spec)
        sizes, skips = group_layout(gpu_arg, gpu_spec, gpu_ids.size, len(self._groups),
                                    self.blocks_per_chunk, load=not store)
        n = gpu_ids.size
        rows = self._rows(n)
        try:
            spans = fill_rows(gpu_arg, gpu_ids, cpu_arg, cpu_ids, sizes, skips, self.blocks_per_chunk,
                              [g.gpu_blocks for g in self._groups], self.num_cpu_chunks,
                              rows.np[:n], rows.np[n:2 * n])
        except KvtierError:
            self._free.append(rows)
            raise
        queue = self._queue
        start, end = queue.event(), queue.event()
        with queue.enter():
            start.record(queue.stream)
            if n and rows.dev is not rows.host:
                rows.dev[:2 * n].copy_(rows.host[:2 * n], non_blocking=True)
            for group, (a, b) in zip(self._groups, spans):
                if a != b:
                    gi, ci = rows.dev[a:b], rows.dev[n + a:n + b]
                    group.transfer.launch(*((gi, ci) if store else (ci, gi)))
            end.record(queue.stream)
        nbytes = sum(s * g.block_bytes for s, g in zip(sizes, self._groups))
        self._jobs.append(_Job(int(job_id), start, end, nbytes, rows))
        self._pending[int(job_id)] = end
        return True

    def get_finished(self) -> list:
        """Jobs finished since the last call, in submission order, as vLLM's
        ``TransferResult``s (``success`` True, size in bytes, device time in seconds
        where timed). Polls events; never waits."""
        done = []
        while self._jobs and self._jobs[0].end.query():
            job = self._jobs.popleft()
            kw = dict(job_id=job.job_id, success=True, transfer_size=job.nbytes,
                      transfer_time=self._queue.seconds(job.start, job.end))
            if self._typed:
                kw["transfer_type"] = self.transfer_type
            done.append(self._result(**kw))
            self._queue.release(job.start, job.end)
            self._free.append(job.rows)
            del self._pending[job.job_id]
        return done

    def wait(self, job_ids) -> None:
        """Block until the named jobs (those still queued here) have finished; they are
        still reported by the next `get_finished`."""
        for job_id in job_ids:
            end = self._pending.get(job_id)
            if end is not None:
                end.synchronize()

    def shutdown(self) -> None:
        """Wait for every queued job and drop the handler's buffers and maps (with them the
        views of the engine's tensors: vLLM can then release its shared region); later
        transfers are refused."""
        for job in self._jobs:
            job.end.synchronize()
        self._jobs.clear()
        self._pending.clear()
        self._free.clear()
        self._groups = []
        self._closed = True

    # ------------------------------------------------------------ internals
    def _rows(self, n: int) -> _Rows:
        """An index buffer for ``n`` rows: a finished job's, else a new one (sized to the
        next power of two, so a steady stream of transfers stops allocating)."""
        for i, r in enumerate(self._free):
            if r.cap >= n:
                return self._free.pop(i)
        cap = 1 << max(n - 1, 0).bit_length()
        return _Rows(cap, self.device)


def _pair(spec, dst_spec):
    if dst_spec is not None:
        return spec, dst_spec
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise fail("spec", type(spec).__name__, "must be a (src_spec, dst_spec) pair")
    return spec


def _check_tensors(gpu_tensors, cpu_tensors, factor: int):
    for arg, ts in (("gpu_tensors", gpu_tensors), ("cpu_tensors", cpu_tensors)):
        if isinstance(ts, torch.Tensor) or not isinstance(ts, (list, tuple)) or not ts:
            raise fail(arg, type(ts).__name__, "must be a non-empty list of tensors")
    if len(gpu_tensors) != len(cpu_tensors):
        raise fail("cpu_tensors", f"{len(cpu_tensors)} tensors", f"must pair with the {len(gpu_tensors)} GPU tensors")
    for i, (g, c) in enumerate(zip(gpu_tensors, cpu_tensors)):
        for arg, t in ((f"gpu_tensors[{i}]", g), (f"cpu_tensors[{i}]", c)):
            if (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.element_size() != 1
                    or t.numel() == 0 or t.stride(1) != 1):
                raise fail(arg, (tuple(t.shape), t.dtype, tuple(t.stride())) if isinstance(t, torch.Tensor)
                           else type(t).__name__,
                           "must be a non-empty 2-D 1-byte tensor (blocks, page bytes), pages contiguous")
        if c.device.type != "cpu":
            raise fail(f"cpu_tensors[{i}].device", str(c.device), "must be host memory")
        if c.shape[1] != g.shape[1] * factor:
            raise fail(f"cpu_tensors[{i}]", tuple(c.shape),
                       f"a chunk must hold blocks_per_chunk={factor} GPU pages of {g.shape[1]} bytes")
    return list(gpu_tensors), list(cpu_tensors)


def _group(gpus, cpus, refs, factor: int) -> _Group:
    """Maps for one group: its tensors, as distinct (tensor, bytes) pairs, grouped by
    geometry, each geometry one pair of address-table maps (one launch)."""
    classes: dict = {}
    for t, page in dict.fromkeys(refs):
        g = gpus[t][:, :page]
        c = cpus[t].unflatten(1, (factor, gpus[t].shape[1]))[:, :, :page]
        key = (tuple(g.shape), g.stride(), g.device, tuple(c.shape), c.stride())
        classes.setdefault(key, []).append((g, c))
    maps = [(RowMap.from_layers([g for g, _ in pairs]),
             RowMap.from_layers([c for _, c in pairs], page_size=factor, paged_dims=True))
            for pairs in classes.values()]
    return _Group(maps=maps, gpu_blocks=min(gpus[t].shape[0] for t, _ in refs) if refs else 0,
                  block_bytes=sum(page for _, page in refs))


def _transfer(op, maps, device: torch.device) -> Transfer:
    """The prepared transfer of one group's (GPU map, CPU map) pairs in ``op``'s direction.
    Its row lists are kvtier's own, checked on the host when they are made
    (`vllm_blocks.fill_rows`), so its launches check nothing more."""
    copies = [Copy(g, c, 0, 0, g.num_layers) if op is BACKUP else Copy(c, g, 0, 0, g.num_layers) for g, c in maps]
    first = copies[0]
    checks = Checks(("src rows", first.src.num_rows, 1), ("dst rows", first.dst.num_rows, 1))
    return Transfer(copies, device=device, checks=checks, check=False, resolve=tuning.resolver(op),
                    epoch=tuning.EPOCH, op=op)


def _check_reach(maps, device: torch.device) -> None:
    """An accelerator's kernels must be able to address the CPU tensors (pinned or
    registered host memory)."""
    if device.type == "cpu":
        return
    plat = platforms.of(device)
    for m in maps:
        if m.device.type == "cpu" and not m.reachable_by(plat):
            raise fail("cpu_tensors", m.describe(),
                       f"not addressable by kernels on {plat.name}: pin or register the host memory")


# ---------------------------------------------------------------- the worker
class KvtierCPUOffloadingWorker:
    """vLLM's CPU offloading worker (vLLM 0.33's ``CPUOffloadingWorker``) on kvtier.

    ``kv_caches``: vLLM's ``CanonicalKVCaches`` (``tensors``, each with ``tensor`` and
    ``page_size_bytes``; ``group_data_refs``). The CPU side is, per tensor, a view of
    ``mmap_region`` (vLLM's ``SharedOffloadRegion``, ``create_next_worker_view``) or a
    new ``(num_cpu_chunks, page * blocks_per_chunk)`` int8 tensor (page-locked where an
    accelerator is present). Three handlers, each on its own stream: stores, loads, and
    expedited loads (so they do not queue behind loads).
    ``gpu_to_cpu_handler`` / ``cpu_to_gpu_handler`` name the first two as vLLM's older
    ``CpuGpuOffloadingHandlers`` did.
    """

    def __init__(self, kv_caches, blocks_per_chunk: int, num_cpu_chunks: int, mmap_region=None,
                 canonical_layout: bool = False):
        if canonical_layout:
            raise fail("canonical_layout", canonical_layout,
                       "kvtier moves plain and shared CPU regions; the canonical layout is not supported")
        tensors = getattr(kv_caches, "tensors", None)
        if not tensors:
            raise fail("kv_caches", type(kv_caches).__name__, "must be vLLM's CanonicalKVCaches (non-empty tensors)")
        if mmap_region is not None and platforms.accelerator_present():
            _register_region(mmap_region)
        gpus, cpus = [], []
        for kt in tensors:
            page = kt.page_size_bytes
            gpus.append(kt.tensor.view(torch.int8).view(-1, page))
            if mmap_region is not None:
                cpus.append(mmap_region.create_next_worker_view(page * blocks_per_chunk))
            else:
                cpus.append(torch.zeros((num_cpu_chunks, page * blocks_per_chunk), dtype=torch.int8,
                                        pin_memory=platforms.accelerator_present()))
        self._owner = None
        self._region = mmap_region
        self._build(gpus, cpus, blocks_per_chunk, getattr(kv_caches, "group_data_refs", None))

    @classmethod
    def adopt(cls, vllm_worker) -> "KvtierCPUOffloadingWorker":
        """kvtier's worker on the buffers of a worker vLLM built (its CPU tensors or
        shared-region views, pinned as vLLM pins them); shutting it down shuts vLLM's
        down too (which releases the region). Reads vLLM 0.33's handler attributes."""
        h = getattr(vllm_worker, "_store_handler", None)
        try:
            gpus, cpus = list(h.src_tensors), list(h.dst_tensors)
            factor, refs = h.dst_blocks_per_chunk, h.layer_refs_per_group
        except AttributeError as e:
            raise fail("vllm_worker", type(vllm_worker).__name__,
                       f"has no store handler with vLLM 0.33's attributes ({e})") from None
        self = cls.__new__(cls)
        self._owner, self._region = vllm_worker, None
        self._build(gpus, cpus, factor, refs)
        return self

    def _build(self, gpus, cpus, factor, refs) -> None:
        make = lambda to_cpu: KvtierOffloadingHandler(gpus, cpus, factor, refs, gpu_to_cpu=to_cpu)
        self._store, self._load, self._expedited = make(True), make(False), make(False)
        self.gpu_to_cpu_handler, self.cpu_to_gpu_handler = self._store, self._load

    def submit_store(self, job_id: int, src_spec, dst_spec) -> bool:
        """GPU blocks -> CPU chunks, asynchronously."""
        return self._store.transfer_async(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec, dst_spec, expedited: bool = False) -> bool:
        """CPU chunks -> GPU blocks, asynchronously; ``expedited`` on its own stream."""
        return (self._expedited if expedited else self._load).transfer_async(job_id, src_spec, dst_spec)

    def get_finished(self) -> list:
        return self._store.get_finished() + self._load.get_finished() + self._expedited.get_finished()

    def wait(self, job_ids) -> None:
        for h in (self._store, self._load, self._expedited):
            h.wait(job_ids)

    def shutdown(self) -> None:
        for h in (self._store, self._load, self._expedited):
            h.shutdown()
        if self._owner is not None:
            self._owner.shutdown()
            self._owner = None
        if self._region is not None:
            self._region.cleanup()
            self._region = None


def _register_region(region) -> None:
    """Page-lock vLLM's shared region as vLLM's own worker does (with vLLM's helper),
    so that kernels reach it; where that fails the handlers refuse the region by name."""
    if getattr(region, "is_pinned", False):
        return
    try:
        from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region
    except ImportError:
        return
    try:
        pin_mmap_region(region, worker_slot_only=True)
    except TypeError:          # vLLM before worker-slot registration
        pin_mmap_region(region)


# ---------------------------------------------------------------- vLLM's own classes
def register_with_vllm() -> None:
    """Register kvtier's classes as implementations of vLLM's abstract interfaces
    (``OffloadingWorker`` in vLLM 0.33, ``OffloadingHandler`` before), so vLLM's
    isinstance checks accept them. Imports vLLM."""
    import importlib
    for module, name, cls in (("vllm.v1.kv_offload.base", "OffloadingWorker", KvtierCPUOffloadingWorker),
                              ("vllm.v1.kv_offload.worker.worker", "OffloadingHandler", KvtierOffloadingHandler)):
        try:
            base = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        base.register(cls)


def _spec_class():
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    register_with_vllm()

    class KvtierCPUOffloadingSpec(CPUOffloadingSpec):
        """vLLM's CPU offloading spec with kvtier moving the blocks: vLLM sizes,
        allocates and pins the CPU buffers (tensors or its shared region) as usual."""

        def create_worker(self, kv_caches):
            return KvtierCPUOffloadingWorker.adopt(super().create_worker(kv_caches))

    KvtierCPUOffloadingSpec.__module__ = __name__
    return KvtierCPUOffloadingSpec


def __getattr__(name):
    # vLLM loads an out-of-tree spec with getattr(module, spec_name): build it then.
    if name == "KvtierCPUOffloadingSpec":
        cls = globals()[name] = _spec_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
