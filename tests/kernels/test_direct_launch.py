"""Direct launches of kept compiled kernels (`kvtier.kernels.direct_launch`), without a GPU.

Triton's own launch path (`JITFunction.run`, compiled mode) runs here with a stand-in
driver, and a stand-in compiled kernel is planted where Triton's kernel cache would hold
the real one: what Triton passes to a kernel's launcher is then compared, call by call,
with what a direct launch passes, on this machine's Triton version. (A `cuda` test in
tests/pool checks the bytes on a GPU.)"""
import importlib
import itertools

import pytest
import torch

pytest.importorskip("triton.backends.nvidia", reason="needs community Triton's CUDA backend")
jit = pytest.importorskip("triton.runtime.jit")
driver_mod = pytest.importorskip("triton.runtime.driver")
if not (hasattr(jit, "create_function_from_signature") and hasattr(jit, "compute_cache_key")
        and hasattr(driver_mod.driver, "_active")):
    pytest.skip("this Triton launches otherwise", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402

from kvtier.kernels import CopyConfig, RowMap, direct_launch  # noqa: E402
from kvtier.kernels.codegen import compilable  # noqa: E402
from kvtier.kernels.copy_rows_kernel import copy_rows_jit  # noqa: E402
from kvtier.kernels.index_check import Checks, check_launch  # noqa: E402
from kvtier.kernels.index_check_kernel import check_indices_jit  # noqa: E402

core = importlib.import_module("kvtier.kernels.launcher")
check_module = importlib.import_module("kvtier.kernels.index_check_kernel")
TARGET = GPUTarget("cuda", 90, 32)
STREAM = 0x5EA


class FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return STREAM

    def get_current_target(self):
        return TARGET


class Metadata:
    """Launch metadata: a new object per launch, as Triton's."""


class FakeKernel:
    """Stands in for a compiled kernel: its launcher records what it is called with. As
    in Triton 3.9, ``run`` is a property that returns the launcher held in ``_run``."""

    def __init__(self, launches):
        self.function, self.packed_metadata = object(), (4, 0, 1)
        self._run = self._launcher
        self._launches = launches

    @property
    def run(self):
        return self._run

    def _launcher(self, *args):
        self._launches.append((self, args))

    def launch_metadata(self, grid, stream, *args):
        return Metadata()


class OlderFakeKernel(FakeKernel):
    """As Triton sets ``run`` on the kernel itself (an instance attribute)."""

    run = None

    def __init__(self, launches):
        super().__init__(launches)
        self.run = self._launcher


class SealedFakeKernel(FakeKernel):
    """A launcher with no attribute to watch it from (computed on every read)."""

    @property
    def run(self):
        return lambda *a: self._launcher(*a)


@pytest.fixture(params=[FakeKernel, OlderFakeKernel])
def triton_path(monkeypatch, request):
    """(launches, passes): every call of a planted kernel's launcher as (kernel, args),
    and every launch that went through `JITFunction.run`, for the row copy and the index
    check as compiled JITFunctions."""
    backend = make_backend(TARGET)
    kernel_class = getattr(request, "param", FakeKernel)
    launches, passes = [], []
    kernel_caches = {}                  # id(a JITFunction's key cache) -> its kernel cache
    for kernel, install in ((copy_rows_jit, lambda jf: monkeypatch.setattr(core, "_kernel", lambda: jf)),
                            (check_indices_jit,
                             lambda jf: monkeypatch.setattr(check_module, "check_indices_jit", jf))):
        jf = compilable(kernel)
        kernels, keys = {}, {}
        kernel_caches[id(keys)] = kernels
        jf.device_caches[0] = (kernels, keys, TARGET, backend,
                               jit.create_function_from_signature(jf.signature, jf.params, backend))
        install(jf)
    real_key = jit.compute_cache_key

    def planting(keys, specialization, options):      # a compiled kernel for every new key
        key = real_key(keys, specialization, options)
        kernel_caches[id(keys)].setdefault(key, kernel_class(launches))
        passes.append(key)
        return key
    monkeypatch.setattr(jit, "compute_cache_key", planting)
    saved = driver_mod.driver._active
    driver_mod.driver.set_active(FakeDriver())
    monkeypatch.setattr(core, "interpreter_active", lambda: False)      # compiled Triton
    monkeypatch.setattr(core, "_RUNNERS", {"cpu": "kernel"})
    monkeypatch.setenv(direct_launch.DIRECT_ENV, "1")
    yield launches, passes
    driver_mod.driver._active = saved


def maps(rows=64, offset=0):
    """(source, destination) stacked maps of ``rows`` rows of 16 int32, ``offset`` words
    past their allocations' starts."""
    src = torch.arange(rows * 16 + offset, dtype=torch.int32)[offset:].view(1, rows, 16)
    dst = torch.zeros(rows * 16 + offset, dtype=torch.int32)[offset:].view(1, rows, 16)
    return RowMap.from_stacked(src, 1), RowMap.from_stacked(dst, 1)


def bound_copy(rows=64):
    src, dst = maps(rows)
    bound = core.copy_launch(src, dst, src_layer=0, dst_layer=0, num_layers=1, by_page=False,
                      config=CopyConfig(num_programs=4, rows=8, block_bytes=64, num_warps=4),
                      device=torch.device("cpu"), n_rows=8)
    return bound, bound.addresses(src, dst), (src, dst)


RECORD = torch.zeros(8, dtype=torch.int64)
CHECKS = Checks(("src_indices", 64, 1), ("dst_indices", 64, 1))
ARG = {n: i for i, n in enumerate(copy_rows_jit.arg_names)}
LAUNCHER = 9            # where the kernel's own arguments start in its launcher's


def launch(bound, sides, si, di):
    """One checked launch of ``bound`` (the index check inline, as a link copy makes it)."""
    bound(si, di, sides, core.INLINE, RECORD, CHECKS)


def same_launch(a, b):
    """Two recorded launcher calls pass the same arguments (new metadata objects apart)."""
    (ka, xa), (kb, xb) = a, b
    return ka is kb and len(xa) == len(xb) and all(
        (type(x) is type(y)) if i == 6 else (x is y or (not isinstance(x, torch.Tensor) and x == y))
        for i, (x, y) in enumerate(zip(xa, xb)))


def test_kept_kernel_is_checked_then_launched_directly_with_tritons_arguments(triton_path):
    launches, passes = triton_path
    bound, sides, _ = bound_copy()
    assert bound.direct is not None
    si, di = torch.tensor([3, 1, 7]), torch.tensor([0, 5, 2])
    for _ in range(5):
        launch(bound, sides, si, di)
    # Triton launched the first two (the second one watched), the rest went direct.
    assert len(passes) == 2 and len(launches) == 5
    assert all(same_launch(launches[0], launch_) for launch_ in launches[1:])
    kernel, args = launches[-1]
    assert 1 <= args[0] <= bound.config.num_programs and args[1:4] == (1, 1, STREAM)
    assert args[4] is kernel.function and args[5] is kernel.packed_metadata
    at = lambda name: args[LAUNCHER + ARG[name]]    # noqa: E731
    assert at("src_idx") is si and at("dst_idx") is di and at("n_idx") == 3 and at("record") is RECORD
    assert at("src_limit") == 64 and at("CHECK") == core.INLINE


def test_each_specialization_is_kept_and_checked_on_its_own(triton_path):
    launches, passes = triton_path
    bound, sides, _ = bound_copy()
    base = torch.arange(9, dtype=torch.int64)
    forms = {"int64": base[:3], "int32": base[:3].to(torch.int32), "8-byte aligned": base[1:4]}
    di = torch.tensor([0, 5, 2])
    for (name, si), _ in itertools.product(forms.items(), range(4)):
        launch(bound, sides, si, di)
    # Each form: one launch kept, one watched, two direct, each with its own kernel.
    assert len(passes) == 6 and len(launches) == 12
    kernels = [k for k, _ in launches]
    assert len({id(k) for k in kernels}) == 3
    for i in range(0, 12, 4):
        assert all(same_launch(launches[i], launches[i + j]) for j in (1, 2, 3))


def test_each_call_passes_its_own_buffers_to_one_kept_kernel(triton_path):
    """A bound copy holds no buffer: each call's own maps' addresses go where the sides'
    base arguments are, to the same kept kernel (the addresses are not specialized on:
    their alignment is the layout's), the rest is what Triton passed."""
    launches, passes = triton_path
    bound, _, _ = bound_copy()
    si, di = torch.tensor([3, 1, 7]), torch.tensor([0, 5, 2])
    pairs = [maps() for _ in range(6)]          # new buffers per call
    for src, dst in pairs:
        launch(bound, bound.addresses(src, dst), si, di)
    assert len(passes) == 2 and len(launches) == 6
    for (kernel, args), (src, dst) in zip(launches, pairs):
        assert args[LAUNCHER + ARG["src_base"]] == src.base and args[LAUNCHER + ARG["dst_base"]] == dst.base
    assert len({id(k) for k, _ in launches}) == 1


def test_a_launch_that_differs_from_tritons_is_never_made_directly(triton_path, monkeypatch):
    launches, passes = triton_path
    real = direct_launch._arguments

    def swapped(k, grid, stream, args):           # what a Triton with another launch would show
        a = real(k, grid, stream, args)
        return a[:9] + (a[10], a[9]) + a[11:]
    monkeypatch.setattr(direct_launch, "_arguments", swapped)
    bound, sides, _ = bound_copy()
    si, di = torch.tensor([3, 1, 7]), torch.tensor([0, 5, 2])
    for _ in range(5):
        launch(bound, sides, si, di)
    assert len(passes) == 5 and len(launches) == 5      # every launch through Triton


def test_arguments_that_cannot_be_built_keep_the_launches_on_tritons_path(triton_path, monkeypatch):
    """Where a direct launch's arguments cannot be worked out (a Triton whose kernels
    are read otherwise), the call still moves its bytes through Triton, every time."""
    launches, passes = triton_path

    def unreadable(k, grid, stream, args):
        raise TypeError("launch_metadata() takes 3 positional arguments")
    monkeypatch.setattr(direct_launch, "_arguments", unreadable)
    bound, sides, _ = bound_copy(rows=96)
    si, di = torch.tensor([3, 1, 7]), torch.tensor([0, 5, 2])
    for _ in range(4):
        launch(bound, sides, si, di)
    assert len(passes) == 4 and len(launches) == 4


@pytest.mark.parametrize("triton_path", [SealedFakeKernel], indirect=True)
def test_a_launcher_that_cannot_be_watched_is_never_called_directly(triton_path):
    launches, passes = triton_path
    bound, sides, _ = bound_copy(rows=88)
    si, di = torch.tensor([3, 1, 7]), torch.tensor([0, 5, 2])
    for _ in range(4):
        launch(bound, sides, si, di)
    assert len(passes) == 4 and len(launches) == 4


def test_switched_off_by_the_environment(triton_path, monkeypatch):
    launches, passes = triton_path
    monkeypatch.setenv(direct_launch.DIRECT_ENV, "0")
    bound, sides, _ = bound_copy(rows=72)
    assert bound.direct is None
    for _ in range(3):
        launch(bound, sides, torch.tensor([3, 1, 7]), torch.tensor([0, 5, 2]))
    assert len(passes) == 3 and len(launches) == 3


def test_nothing_is_kept_under_the_interpreter():
    bound, _, _ = bound_copy(rows=80)      # this test run's kernels run in Triton's interpreter
    assert bound.direct is None


def test_the_index_check_is_launched_directly_too(triton_path):
    launches, passes = triton_path
    a, b = torch.tensor([3, 1, 7]), torch.tensor([0, 5, 2])
    cpu = torch.device("cpu")
    for _ in range(4):      # every call checks (and launches) again
        words = check_launch(cpu, CHECKS, a, b, direct=True)
    assert words is not None
    assert len(passes) == 2 and len(launches) == 4
    assert all(same_launch(launches[0], launch_) for launch_ in launches[1:])
    _, args = launches[-1]
    assert args[:4] == (1, 1, 1, STREAM) and args[9] is a and args[14] is b
    # A limit of another class (not a multiple of 16) is another specialization to the kept
    # kernels (Triton itself does not specialize on it): two launches through Triton again.
    for _ in range(3):
        check_launch(cpu, Checks(("src_indices", 65, 1), ("dst_indices", 64, 1)), a, b, direct=True)
    assert len(passes) == 4 and len(launches) == 7


@pytest.fixture
def on_gpu():
    """(an MHA device pool of random rows on the GPU: 512 slots in pages of 16, 4 layers,
    2 heads x 64 bf16; the row copy's launches that went through Triton, one entry each)."""
    from kvtier.pool import MHADevicePool
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    jf = core._kernel()
    through_triton = []
    real_run = jf.run

    def counted(*args, **kwargs):
        through_triton.append(1)
        return real_run(*args, **kwargs)
    jf.run = counted
    try:
        dev = MHADevicePool(512, 16, 4, 2, 64, dtype=torch.bfloat16, device="cuda")
        for t in dev.buffers["k"] + dev.buffers["v"]:
            t.copy_(torch.randn_like(t))
        yield dev, through_triton
    finally:
        del jf.run


@pytest.mark.cuda
def test_on_a_gpu_direct_launches_move_the_same_bytes(on_gpu):
    """On a GPU: a per-layer load loop repeated with index lists of both dtypes and of 8-
    and 16-byte alignment; after two launches through Triton per specialization the rest
    are direct, and every byte matches torch's own gather."""
    from kvtier.pool import HostPool
    dev, through_triton = on_gpu
    host = HostPool(dev, layout="layer_first", size_tokens=1024, strategy="kernel")
    src = torch.arange(64, 96, device="cuda")
    host_idx = host.alloc(32).cuda()
    host.backup_from_device_all_layer(dev, host_idx, src)
    base = torch.arange(200, 240, device="cuda", dtype=torch.int64)
    forms = [base[:32], base[:32].to(torch.int32), base[1:33]]       # int64, int32, 8-byte aligned
    for rep in range(6):
        for dst in forms:
            for layer in range(4):
                host.load_to_device_per_layer(dev, host_idx, dst, layer)
            torch.cuda.synchronize()
            for t in dev.buffers["k"] + dev.buffers["v"]:
                rows = t.view(-1, 2, 64)
                assert torch.equal(rows[dst.long()].view(torch.int16), rows[src].view(torch.int16))
                rows[dst.long()] = 0        # the next form's load must write them again
    host.synchronize()
    # At most two launches through Triton per bound copy (the backup, one per layer) and
    # specialization (each form); the other 73 - 26 were direct.
    assert len(through_triton) <= 2 * (1 + 4 * len(forms)), len(through_triton)


@pytest.mark.cuda
def test_on_a_gpu_gathers_and_scatters_bound_to_layouts_move_the_same_bytes(on_gpu):
    """On a GPU: gathers into new buffers and scatters of them (copies bound to the
    buffers' layout, each call handing over its own), repeated past the two launches
    through Triton per bound copy, so the later launches are direct with the call's buffer
    as the destination or the source; every byte matches torch's indexing."""
    dev, through_triton = on_gpu
    P = dev.page_size

    def rows(name, slots):          # (layers, slots, 2, 64) as int16
        return torch.stack([t.view(-1, 2, 64)[slots] for t in dev.buffers[name]]).view(torch.int16)
    offsets = torch.arange(P, device="cuda")
    for _ in range(5):
        src, dst = torch.randperm(16, device="cuda")[:4], torch.randperm(16, device="cuda")[:4] + 16
        got = dev.gather(src, pages=True)
        dev.scatter(dst, got, pages=True)
        torch.cuda.synchronize()
        src_slots, dst_slots = ((p[:, None] * P + offsets).reshape(-1) for p in (src, dst))
        for name in ("k", "v"):
            assert torch.equal(got[name].reshape(4, -1, 2, 64).view(torch.int16), rows(name, src_slots)), name
            assert torch.equal(rows(name, dst_slots), rows(name, src_slots)), name
    dev.synchronize()
    # Two launches through Triton for the gather's bound copy and two for the scatter's;
    # the other six were direct.
    assert len(through_triton) <= 4, len(through_triton)
