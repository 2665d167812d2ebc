"""kvtier's vLLM CPU offloading handler and worker (kvtier.adapters.vllm).

The cases of vLLM's CPU-GPU worker tests (tests/v1/kv_offload: one group of several
tensors, page sizes, blocks_per_chunk 1 and 3, plain and shared CPU regions, a transfer
starting in the middle of a chunk; three groups with an empty one and one unaligned at
both ends; transfer sizes and types) run here on CPU tensors, through Triton's
interpreter, against a fake of vLLM's spec and cache classes that has their fields
(vLLM needs a GPU and many packages to import; `test_with_vllms_own_classes` runs where
it is importable). Expected bytes come from plain torch indexing on copies of the
buffers; destinations start poisoned; every buffer sits between sentinel margins, and a
shared region's bytes outside the moved sub-blocks (other tensors, other workers'
slots, row padding) must not change.
"""
from __future__ import annotations

import contextlib
import random
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

from kvtier.adapters import vllm as kv_vllm
from kvtier.adapters.vllm import KvtierCPUOffloadingWorker, KvtierOffloadingHandler
from kvtier.kernels import KvtierError
from helpers import POISON, Guarded, assert_bytes_equal


# ------------------------------------------------------------------ vLLM's classes, as data
class Spec:
    """vLLM's BlockIDsLoadStoreSpec: block ids as an int32 array."""

    def __init__(self, block_ids):
        self.block_ids = np.array(block_ids, dtype=np.int32)


class GPUSpec(Spec):
    """vLLM's GPULoadStoreSpec: GPU block ids by KV cache group, each group's size and
    the logical index of its first block."""

    def __init__(self, block_ids, group_sizes, block_indices):
        super().__init__(block_ids)
        self.group_sizes, self.block_indices = group_sizes, block_indices


class CPUSpec(Spec):
    """vLLM's CPULoadStoreSpec: CPU chunk ids."""


@dataclass
class Ref:
    tensor_idx: int
    page_size_bytes: int
    mapping: Optional[object] = None


@dataclass
class KVTensor:
    tensor: torch.Tensor
    page_size_bytes: int


@dataclass
class KVCaches:
    tensors: list
    group_data_refs: list


# ------------------------------------------------------------------ buffers
ROW_PAD = 72      # shared region: bytes of each row that belong to no tensor of this worker


class Region:
    """vLLM's SharedOffloadRegion as the worker sees it: one buffer of ``num_chunks`` rows;
    each call of `create_next_worker_view` carves the next ``(num_chunks, size)`` view
    out of every row. The rows also hold ``ROW_PAD`` bytes owned by nobody here."""

    def __init__(self, num_chunks: int, row_bytes: int, gen, fill="random"):
        self.num_chunks, self.row = num_chunks, row_bytes + ROW_PAD
        self.buf = Guarded((num_chunks * self.row,), torch.int8, fill=fill, gen=gen)
        self.offset, self.cleaned = ROW_PAD // 2, False

    def create_next_worker_view(self, size: int) -> torch.Tensor:
        t = self.buf.t
        v = t.as_strided((self.num_chunks, size), (self.row, 1), t.storage_offset() + self.offset)
        self.offset += size
        return v

    def cleanup(self) -> None:
        self.cleaned = True


class Rig:
    """``n`` GPU tensors ``(gpu_blocks, page)`` and their CPU tensors
    ``(cpu_chunks, page * factor)``, plain or views of one shared region, all int8 and
    inside sentinel margins. The source side is random, the destination side poisoned."""

    def __init__(self, n, gpu_blocks, cpu_chunks, page, factor, shared, store, seed=0):
        gen = torch.Generator().manual_seed(seed)
        src_fill = lambda is_src: "random" if is_src else "poison"
        self.guards = [Guarded((gpu_blocks, page), torch.int8, fill=src_fill(store), gen=gen) for _ in range(n)]
        self.gpu = [g.t for g in self.guards]
        if shared:
            self.region = Region(cpu_chunks, page * factor * n, gen, fill=src_fill(not store))
            self.guards.append(self.region.buf)
            self.cpu = [self.region.create_next_worker_view(page * factor) for _ in range(n)]
        else:
            self.region = None
            cg = [Guarded((cpu_chunks, page * factor), torch.int8, fill=src_fill(not store), gen=gen)
                  for _ in range(n)]
            self.guards += cg
            self.cpu = [g.t for g in cg]
        self.page, self.factor = page, factor

    def clone(self):
        """A copy of every buffer, with the same views into it (for the torch reference)."""
        raws = [g.raw.clone() for g in self.guards]
        remap = lambda t: _same_view(t, self.guards, raws)
        return raws, [remap(t) for t in self.gpu], [remap(t) for t in self.cpu]

    def assert_equals(self, raws, what=""):
        for g, want in zip(self.guards, raws):
            g.check()
            assert_bytes_equal(g.raw, want, what)


def _same_view(t, guards, raws):
    for g, raw in zip(guards, raws):
        base = g.raw
        if base.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            off = t.storage_offset() - base.storage_offset()
            return raw.view(torch.int8).as_strided(t.shape, t.stride(), off)
    raise AssertionError("view of no rig buffer")


def reference(gpu, cpu, pairs, refs, page, factor, store):
    """Plain torch: for every (GPU block, CPU sub-block row) pair and every reference of
    the group, ``page_size_bytes`` bytes move between the GPU block and sub-block
    ``row % factor`` of chunk ``row // factor``."""
    for b, r in pairs:
        c, j = divmod(r, factor)
        for t, pb in refs:
            cpu_sub = cpu[t][c, j * page:j * page + pb]
            if store:
                cpu_sub.copy_(gpu[t][b, :pb])
            else:
                gpu[t][b, :pb].copy_(cpu_sub)


def mappings(num_gpu, num_cpu, chunks, factor, skip_front, skip_back, rnd):
    """vLLM's test selection: random chunks, as many random GPU blocks as their
    sub-blocks, less ``skip_front`` / ``skip_back`` sub-blocks at the ends."""
    cpu = rnd.sample(range(num_cpu), chunks)
    gpu = rnd.sample(range(num_gpu), chunks * factor)
    rows = [c * factor + j for c in cpu for j in range(factor)]
    end = len(rows) - skip_back
    return cpu, gpu[skip_front:end], rows[skip_front:end]


def finish(handler):
    """get_finished until every queued job is reported (at once on the CPU)."""
    out = handler.get_finished()
    assert not handler._jobs
    return out


# ------------------------------------------------------------------ vLLM's cases
@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("store", [True, False], ids=["gpu_to_cpu", "cpu_to_gpu"])
def test_transfer(store, page, factor, shared):
    """vLLM's test_transfer: 4 tensors, 3 chunks' worth of blocks, the first
    ``factor - 1`` sub-blocks skipped (a transfer from the middle of a chunk)."""
    rnd = random.Random(page + factor)
    rig = Rig(4, 64, 256 if not shared else 32, page, factor, shared, store, seed=page + factor)
    skip = factor - 1
    cpu_ids, gpu_ids, rows = mappings(64, len(rig.cpu[0]), 3, factor, skip, 0, rnd)
    handler = KvtierOffloadingHandler(rig.gpu, rig.cpu, factor, [[Ref(i, page) for i in range(4)]], store)
    gspec = GPUSpec(gpu_ids, group_sizes=(len(gpu_ids),), block_indices=(skip,))
    spec = (gspec, CPUSpec(cpu_ids)) if store else (CPUSpec(cpu_ids), gspec)
    raws, g, c = rig.clone()
    reference(g, c, list(zip(gpu_ids, rows)), [(i, page) for i in range(4)], page, factor, store)

    assert handler.transfer_async(1, spec) is True
    assert [j.job_id for j in handler._jobs] == [1]
    (res,) = finish(handler)
    assert (res.job_id, res.success, res.transfer_type) == (1, True, ("GPU", "CPU") if store else ("CPU", "GPU"))
    assert res.transfer_size == len(gpu_ids) * 4 * page
    rig.assert_equals(raws, "after the transfer")
    dst = rig.cpu if store else rig.gpu
    for b, r in zip(gpu_ids, rows):                 # every moved block was poison before
        blk = dst[0][r // factor, (r % factor) * page:(r % factor + 1) * page] if store else dst[0][b]
        assert not bool((blk.view(torch.uint8) == POISON).all())
    handler.shutdown()


@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize("store", [True, False], ids=["gpu_to_cpu", "cpu_to_gpu"])
def test_transfer_multi_group(store, factor):
    """vLLM's test_transfer_multi_group: three groups of two tensors; group 0 aligned,
    group 1 empty, group 2 missing ``factor - 1`` sub-blocks at both ends."""
    rnd = random.Random(7 * factor)
    page, per_group = 512, 2
    rig = Rig(6, 64, 256, page, factor, False, store, seed=factor)
    refs = [[Ref(g * per_group + i, page) for i in range(per_group)] for g in range(3)]
    skip = factor - 1
    chosen_cpu = rnd.sample(range(256), 4)
    chosen_gpu = rnd.sample(range(64), 4 * factor)
    groups = []
    for g, (cs, gs) in enumerate(((chosen_cpu[:2], chosen_gpu[:2 * factor]), ([], []),
                                   (chosen_cpu[2:], chosen_gpu[2 * factor:]))):
        rows = [c * factor + j for c in cs for j in range(factor)]
        if g == 2 and skip:
            gs, rows = gs[skip:-skip], rows[skip:-skip]
        groups.append((cs, gs, rows))
    gpu_ids = [b for _, gs, _ in groups for b in gs]
    cpu_ids = [c for cs, _, _ in groups for c in cs]
    gspec = GPUSpec(gpu_ids, group_sizes=[len(gs) for _, gs, _ in groups], block_indices=[0, 0, skip])
    spec = (gspec, CPUSpec(cpu_ids)) if store else (CPUSpec(cpu_ids), gspec)
    handler = KvtierOffloadingHandler(rig.gpu, rig.cpu, factor, refs, store)
    raws, g, c = rig.clone()
    for (cs, gs, rows), group_refs in zip(groups, refs):
        reference(g, c, list(zip(gs, rows)), [(r.tensor_idx, r.page_size_bytes) for r in group_refs],
                  page, factor, store)

    assert handler.transfer_async(1, spec)
    (res,) = finish(handler)
    assert res.transfer_size == sum(len(gs) * per_group * page for _, gs, _ in groups)
    rig.assert_equals(raws)


# ------------------------------------------------------------------ shared regions
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_shared_region_round_trip(factor):
    """vLLM's shared region (rows spanning every tensor's chunk, where ``.view(-1, page)``
    fails for factor > 1): store blocks, load them into other blocks, byte-exact, with
    every other byte of the region and of the GPU tensors unchanged."""
    page, n = 96, 3
    rig = Rig(n, 32, 8, page, factor, True, True, seed=factor)
    if factor > 1:
        with pytest.raises(RuntimeError):
            rig.cpu[0].view(-1, page)
    refs = [[Ref(i, page) for i in range(n)]]
    store = KvtierOffloadingHandler(rig.gpu, rig.cpu, factor, refs, True)
    load = KvtierOffloadingHandler(rig.gpu, rig.cpu, factor, refs, False)
    chunks = [5, 0, 3]
    blocks = list(range(2, 2 + len(chunks) * factor))[::-1]
    rows = [c * factor + j for c in chunks for j in range(factor)]
    raws, g, c = rig.clone()
    reference(g, c, list(zip(blocks, rows)), [(i, page) for i in range(n)], page, factor, True)
    store.transfer_async(1, (GPUSpec(blocks, [len(blocks)], [0]), CPUSpec(chunks)))
    finish(store)
    rig.assert_equals(raws, "after the store")

    targets = [31 - k for k in range(len(blocks))]
    reference(g, c, list(zip(targets, rows)), [(i, page) for i in range(n)], page, factor, False)
    load.transfer_async(2, (CPUSpec(chunks), GPUSpec(targets, [len(targets)], [0])))
    finish(load)
    rig.assert_equals(raws, "after the load")
    for t in range(n):
        assert torch.equal(rig.gpu[t][targets], rig.gpu[t][blocks])


@pytest.mark.parametrize("factor", [1, 2, 4])
def test_worker_on_a_shared_region(factor):
    """vLLM 0.33's worker interface: views carved from the region at construction, a
    store and an expedited load in one get_finished, the region released at shutdown."""
    page, n, chunks = 64, 2, 6
    gen = torch.Generator().manual_seed(factor)
    gpu = [Guarded((16, page // 2), torch.int16, gen=gen) for _ in range(n)]   # any dtype: vLLM views it as int8
    region = Region(chunks, page * factor * n, gen, fill="poison")
    caches = KVCaches([KVTensor(g.t, page) for g in gpu], [[Ref(i, page) for i in range(n)]])
    worker = KvtierCPUOffloadingWorker(caches, factor, chunks, mmap_region=region)
    blocks = list(range(factor))
    before = [g.t.clone() for g in gpu]
    assert worker.submit_store(10, GPUSpec(blocks, [factor], [0]), CPUSpec([4]))
    targets = list(range(8, 8 + factor))
    assert worker.submit_load(11, CPUSpec([4]), GPUSpec(targets, [factor], [0]), expedited=True)
    assert sorted(r.job_id for r in worker.get_finished()) == [10, 11]
    for b, t in zip(gpu, before):
        assert torch.equal(b.t[targets], t[blocks])
        b.check()
    sub = region.buf.t.view(chunks, -1)[4, ROW_PAD // 2:ROW_PAD // 2 + page * factor]
    assert torch.equal(sub.view(factor, page), before[0].view(torch.int8).view(16, page)[blocks])
    region.buf.check()
    worker.shutdown()
    assert region.cleaned


# ------------------------------------------------------------------ spec forms
def test_older_spec_forms():
    """vLLM before group_sizes: ``transfer_async(job_id, (src, dst))`` with block ids
    only; a load takes the last sub-blocks of its first chunk (``-n % factor`` skipped),
    a store fills whole chunks. vLLM 0.33's call form (src, dst as two arguments) too."""
    page, factor = 64, 4
    rig = Rig(2, 16, 6, page, factor, False, True, seed=3)
    store = KvtierOffloadingHandler(rig.gpu, rig.cpu, block_size_factor=factor, gpu_to_cpu=True)
    load = KvtierOffloadingHandler(rig.gpu, rig.cpu, block_size_factor=factor, gpu_to_cpu=False)
    raws, g, c = rig.clone()
    blocks = [9, 1, 4, 0, 7, 2, 3, 5]
    reference(g, c, list(zip(blocks, [5 * 4 + j for j in range(4)] + [2 * 4 + j for j in range(4)])),
              [(0, page), (1, page)], page, factor, True)
    store.transfer_async(1, Spec(blocks), Spec([5, 2]))
    finish(store)
    rig.assert_equals(raws, "store")
    targets, rows = [15, 14, 13, 12, 11, 10], [5 * 4 + 2, 5 * 4 + 3] + [2 * 4 + j for j in range(4)]
    reference(g, c, list(zip(targets, rows)), [(0, page), (1, page)], page, factor, False)
    load.transfer_async(2, (Spec([5, 2]), Spec(targets)))
    finish(load)
    rig.assert_equals(raws, "load")


def test_unpadded_page_bytes_move_only():
    """A reference's page_size_bytes below the tensor's (padded) page moves that many
    bytes of each block; the padding stays as it was on both sides."""
    page, pb, factor = 128, 80, 2
    rig = Rig(2, 8, 4, page, factor, True, True, seed=5)
    refs = [[Ref(0, pb), Ref(1, page)]]
    h = KvtierOffloadingHandler(rig.gpu, rig.cpu, factor, refs, True)
    raws, g, c = rig.clone()
    reference(g, c, [(3, 2), (6, 3)], [(0, pb), (1, page)], page, factor, True)
    h.transfer_async(4, (GPUSpec([3, 6], [2], [0]), CPUSpec([1])))
    (res,) = finish(h)
    assert res.transfer_size == 2 * (pb + page)
    rig.assert_equals(raws)


# ------------------------------------------------------------------ errors
def _bad_cases():
    g = lambda ids, sizes=None, starts=None: GPUSpec(ids, sizes or [len(ids)], starts or [0])
    return [
        ((g([0, 99]), CPUSpec([1])), "src_spec.block_ids=99"),
        ((g([0, -1]), CPUSpec([1])), "src_spec.block_ids=-1"),
        ((g([0, 1]), CPUSpec([4])), "dst_spec.block_ids=4"),
        ((g([0, 1]), CPUSpec([1, 2])), "dst_spec.block_ids"),
        ((g([0, 1], [1]), CPUSpec([1])), "src_spec.group_sizes"),
        ((g([0, 1], [2, 0]), CPUSpec([1])), "src_spec.group_sizes"),
        ((g([0, 1], [2], [0, 1]), CPUSpec([1])), "src_spec.block_indices"),
        ((g([0, 1], [2], [-1]), CPUSpec([1])), "src_spec.block_indices"),
        ((object(), CPUSpec([1])), "src_spec="),
        ((Spec(np.zeros((2, 1))), CPUSpec([1])), "src_spec.block_ids"),
        ((g([0, 1]),), "spec="),
    ]


@pytest.mark.parametrize("spec,name", _bad_cases())
def test_bad_specs_are_named_and_move_nothing(spec, name):
    page = 32
    rig = Rig(2, 8, 4, page, 2, True, True, seed=9)
    h = KvtierOffloadingHandler(rig.gpu, rig.cpu, 2, None, True)
    raws, _, _ = rig.clone()
    for caught in (KvtierError, ValueError, RuntimeError):
        with pytest.raises(caught, match=name.replace(".", r"\.").replace("[", r"\[")):
            h.transfer_async(1, spec)
    rig.assert_equals(raws, "after a refused transfer")
    assert h.get_finished() == []
    # The handler still works after a refusal.
    assert h.transfer_async(1, (GPUSpec([0, 1], [2], [0]), CPUSpec([3])))
    assert [r.job_id for r in finish(h)] == [1]


def test_bad_constructor_arguments_are_named():
    gpu = [torch.zeros(8, 32, dtype=torch.int8) for _ in range(2)]
    cpu = [torch.zeros(4, 64, dtype=torch.int8) for _ in range(2)]
    cases = [
        (dict(gpu_tensors=gpu, cpu_tensors=cpu[:1]), "cpu_tensors="),
        (dict(gpu_tensors=gpu, cpu_tensors=[cpu[0], torch.zeros(4, 96, dtype=torch.int8)]), r"cpu_tensors\[1\]"),
        (dict(gpu_tensors=[gpu[0], gpu[1].float()], cpu_tensors=cpu), r"gpu_tensors\[1\]"),
        (dict(gpu_tensors=gpu, cpu_tensors=[cpu[0], cpu[1].t().contiguous().t()]), r"cpu_tensors\[1\]"),
        (dict(gpu_tensors=gpu[0], cpu_tensors=cpu), "gpu_tensors="),
        (dict(gpu_tensors=gpu, cpu_tensors=cpu, blocks_per_chunk=0), "blocks_per_chunk=0"),
        (dict(gpu_tensors=gpu, cpu_tensors=cpu, gpu_to_cpu=None), "gpu_to_cpu=None"),
        (dict(gpu_tensors=gpu, cpu_tensors=cpu, canonical_layout=True), "canonical_layout=True"),
        (dict(gpu_tensors=gpu, cpu_tensors=cpu, layer_refs_per_group=[[Ref(2, 32)]]),
         r"layer_refs_per_group\[0\]\[0\]\.tensor_idx=2"),
        (dict(gpu_tensors=gpu, cpu_tensors=cpu, layer_refs_per_group=[[Ref(0, 33)]]),
         r"layer_refs_per_group\[0\]\[0\]\.page_size_bytes=33"),
    ]
    for kw, name in cases:
        kw = {"blocks_per_chunk": 2, "gpu_to_cpu": True, **kw}
        with pytest.raises(KvtierError, match=name):
            KvtierOffloadingHandler(**kw)


# ------------------------------------------------------------------ ordering, without a GPU
class FakeEvent:
    def __init__(self, log, name):
        self.log, self.name, self.done = log, name, False

    def record(self, stream):
        self.log.append(("record", self.name, stream))

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(("synchronize", self.name))
        self.done = True


class FakeQueue:
    """A stream queue whose events finish when the test says so."""

    stream = "side-stream"

    def __init__(self):
        self.log, self.events = [], []

    def event(self):
        e = FakeEvent(self.log, len(self.events))
        self.events.append(e)
        return e

    def release(self, *events):
        self.log.append(("release", *(e.name for e in events)))

    def enter(self):
        self.log.append(("wait_stream", "current"))
        return contextlib.nullcontext()

    def seconds(self, start, end):
        return 0.25


def test_get_finished_polls_in_order_and_wait_waits_for_the_named_jobs(monkeypatch):
    queue = FakeQueue()
    monkeypatch.setattr(kv_vllm, "_queue", lambda device: queue)
    built = []
    real_rows = kv_vllm._Rows
    monkeypatch.setattr(kv_vllm, "_Rows", lambda cap, device: built.append(cap) or real_rows(cap, device))
    rig = Rig(1, 8, 4, 32, 1, False, True)
    h = KvtierOffloadingHandler(rig.gpu, rig.cpu, 1, None, True)
    for job in (1, 2, 3):
        assert h.transfer_async(job, (GPUSpec([job], [1], [0]), CPUSpec([job])))
    assert queue.log[:2] == [("wait_stream", "current"), ("record", 0, "side-stream")]
    with pytest.raises(KvtierError, match="job_id=2"):
        h.transfer_async(2, (GPUSpec([0], [1], [0]), CPUSpec([0])))
    queue.events[3].done = True                       # job 2 ends before job 1: not reported yet
    assert h.get_finished() == []
    queue.events[1].done = True
    assert [(r.job_id, r.transfer_time) for r in h.get_finished()] == [(1, 0.25), (2, 0.25)]
    h.wait({3, 99})
    assert [e for e in queue.log if e[0] == "synchronize"] == [("synchronize", 5)]
    assert [r.job_id for r in h.get_finished()] == [3]
    assert built == [1, 1, 1]
    h.transfer_async(4, (GPUSpec([0], [1], [0]), CPUSpec([0])))  # a finished job's buffer
    assert built == [1, 1, 1]


def test_importing_the_adapter_does_not_import_vllm():
    code = ("import sys, kvtier.adapters.vllm as m; assert 'vllm' not in sys.modules; "
            "assert m.TransferResult is m._result_type()")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_adopting_a_vllm_worker():
    """The spec's path: kvtier's worker on the tensors vLLM's worker allocated."""
    page, factor = 32, 2
    rig = Rig(2, 8, 4, page, factor, True, True, seed=11)

    class VllmHandler:
        src_tensors, dst_tensors = rig.gpu, rig.cpu
        dst_blocks_per_chunk, layer_refs_per_group = factor, [[Ref(0, page), Ref(1, page)]]

    class VllmWorker:
        _store_handler, shut = VllmHandler(), False

        def shutdown(self):
            self.shut = True

    vw = VllmWorker()
    w = KvtierCPUOffloadingWorker.adopt(vw)
    raws, g, c = rig.clone()
    reference(g, c, [(5, 6), (2, 7)], [(0, page), (1, page)], page, factor, True)
    w.submit_store(1, GPUSpec([5, 2], [2], [0]), CPUSpec([3]))
    assert [r.job_id for r in w.get_finished()] == [1]
    rig.assert_equals(raws)
    w.shutdown()
    assert vw.shut
    with pytest.raises(KvtierError, match="vllm_worker"):
        KvtierCPUOffloadingWorker.adopt(object())


# ------------------------------------------------------------------ vLLM's own classes
def test_with_vllms_own_classes():
    """Where vLLM imports (it does not in CI: it needs its package and a dozen others):
    its spec classes drive the handler, results are its TransferResult, and kvtier's
    worker is registered as its OffloadingWorker."""
    base = pytest.importorskip("vllm.v1.kv_offload.base")
    common = pytest.importorskip("vllm.v1.kv_offload.cpu.common")
    kv_vllm.register_with_vllm()
    page, factor = 64, 2
    rig = Rig(2, 8, 4, page, factor, True, True, seed=13)
    refs = [[base.CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(2)]]
    h = KvtierOffloadingHandler(rig.gpu, rig.cpu, factor, refs, True)
    raws, g, c = rig.clone()
    reference(g, c, [(7, 5), (1, 6)], [(0, page), (1, page)], page, factor, True)
    spec = (base.GPULoadStoreSpec([7, 1], group_sizes=[2], block_indices=[1]), common.CPULoadStoreSpec([2, 3]))
    assert h.transfer_async(1, *spec)
    (res,) = h.get_finished()
    assert isinstance(res, base.TransferResult)
    rig.assert_equals(raws)
    caches = base.CanonicalKVCaches(
        tensors=[base.CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in rig.gpu],
        group_data_refs=refs)
    assert isinstance(KvtierCPUOffloadingWorker(caches, factor, 4), base.OffloadingWorker)


# ------------------------------------------------------------------ real streams
@pytest.mark.cuda
@pytest.mark.parametrize("factor", [1, 2])
def test_cuda_streams(factor):
    """On a GPU: stores wait for the model's queued writes (a busy current stream),
    jobs finish in order on the queue, get_finished polls, and a shared pinned region
    round-trips byte-exact."""
    dev, page, n, chunks = "cuda", 4096, 3, 16
    gpu = [Guarded((64, page), torch.int8, device=dev, fill="zeros") for _ in range(n)]
    row = page * factor * n + ROW_PAD
    region = Guarded((chunks * row,), torch.int8, pin=True, fill="poison")
    t = region.t
    cpu = [t.as_strided((chunks, page * factor), (row, 1), t.storage_offset() + i * page * factor)
           for i in range(n)]
    refs = [[Ref(i, page) for i in range(n)]]
    store = KvtierOffloadingHandler([g.t for g in gpu], cpu, factor, refs, True)
    load = KvtierOffloadingHandler([g.t for g in gpu], cpu, factor, refs, False)
    blocks = list(range(4, 4 + 4 * factor))
    torch.cuda._sleep(200_000_000)                     # the model is still busy ...
    want = []
    for g in gpu:                                      # ... and then writes the blocks
        want.append(torch.randint(-128, 127, (len(blocks), page), dtype=torch.int8, device=dev))
        g.t[blocks] = want[-1]
    store.transfer_async(1, (GPUSpec(blocks, [len(blocks)], [0]), CPUSpec([9, 2, 5, 0])))
    targets = list(range(40, 40 + len(blocks)))
    store.wait({1})
    load.transfer_async(2, (CPUSpec([9, 2, 5, 0]), GPUSpec(targets, [len(targets)], [0])))
    results = []
    while len(results) < 2:
        results += store.get_finished() + load.get_finished()
    assert [r.job_id for r in results] == [1, 2]
    assert all(r.transfer_time and r.transfer_time > 0 for r in results)
    torch.cuda.synchronize()
    for g, w in zip(gpu, want):
        assert torch.equal(g.t[targets], w)
        g.check()
    region.check()
