"""Huawei Ascend through torch_npu and triton-ascend: everything kvtier does differently there.

- torch_npu is imported only when asked (without the CANN toolkit it fails, and when torch
  auto-loads it as a device backend a failure takes ``import torch`` down too); the
  failure is remembered and reported, never raised at import.
- Launch limits: the grid is bound to physical cores (about one program per vector core,
  looping inside); the Unified Buffer bounds a tile (192 KB on 910B3/B4, 256 KB on
  910B1/B2, half of it with double buffering); a tile has at least two rows and a row
  piece at least 32 bytes (what triton-ascend 3.2 lowers as contiguous copies).
- Host memory: a kernel reaches host memory only once it is registered with the device
  (``aclrtHostRegister``, mapped), and then through a device address of its own;
  triton-ascend also rejects host tensors as kernel arguments. So for an NPU copy a host
  map is re-described as an int64 table of per-layer *device* addresses (the kernel's
  table mode), built once per map and device. Plain pinned memory is reachable by DMA only.
- Bulk copies (dma strategy): ``aclrtMemcpy2dAsync``. torch_npu may defer its own launches
  to a task-queue thread, which a direct runtime call would overtake, so the direct call is
  used only with ``TASK_QUEUE_ENABLE=0``; otherwise the copies go through torch.
- Timer: torch.npu events.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import weakref
import statistics
from dataclasses import replace
from typing import Optional

import torch

from kvtier.config import CopyConfig, Space
from kvtier.errors import KvtierError, fail
from kvtier.address import pow2_align as _pow2_align

from . import runtime_libs
from .record import PlatformUnavailable
from .record import Platform
from .runtime_libs import ARGS_2D, Runtime
from kvtier import caches

ACL_HOST_REGISTER_MAPPED = 0
HOST_PAGE = 4096        # aclrtHostRegister needs a 4 KiB-aligned start

# ------------------------------------------------------------------ torch_npu
_npu = caches.table("platforms.ascend._npu", key='"module" or "error"', value="torch_npu, or why it did not load",
                    bound="2", rule="-", stale="not happen: loaded once per process")


def load_torch_npu():
    """Import torch_npu once and return it; raise PlatformUnavailable with the reason
    (not installed, CANN missing, broken install) instead of letting it escape."""
    if "module" in _npu:
        return _npu["module"]
    if "error" not in _npu:
        if importlib.util.find_spec("torch_npu") is None:
            _npu["error"] = "torch_npu is not installed"
        else:
            try:
                import torch_npu  # noqa: F401  (registers torch.npu)
                _npu["module"] = torch_npu
                return torch_npu
            except BaseException as e:  # ImportError, OSError (no CANN libs), RuntimeError, ...
                if isinstance(e, KeyboardInterrupt):
                    raise
                _npu["error"] = f"importing torch_npu failed: {type(e).__name__}: {e}"
    raise PlatformUnavailable(f"the npu platform cannot be used: {_npu['error']}")


def npu_status() -> tuple:
    """(usable, reason): whether an Ascend NPU can be used, and why not."""
    try:
        load_torch_npu()
    except PlatformUnavailable as e:
        return False, str(e)
    try:
        if torch.npu.is_available():
            return True, ""
        return False, "torch_npu is installed but reports no NPU device"
    except Exception as e:  # a driver error while probing
        return False, f"torch.npu.is_available() failed: {type(e).__name__}: {e}"


def npu_available() -> bool:
    return npu_status()[0]


def probed() -> bool:
    """Whether torch_npu is installed or was asked about (then `kvtier info` reports it)."""
    return importlib.util.find_spec("torch_npu") is not None or bool(_npu)


# ------------------------------------------------------------------ launch limits
# Unified Buffer (on-chip vector memory) per Ascend model, bytes, where the runtime does
# not report it. 910B1/B2 have 256 KB; 910B3/B4 192 KB. Unknown models get the smaller.
_NPU_UB_BYTES = {"Ascend910B1": 256 << 10, "Ascend910B2": 256 << 10,
                 "Ascend910B3": 192 << 10, "Ascend910B4": 192 << 10}
_NPU_UB_DEFAULT = 192 << 10
NPU_MIN_ROWS = 2
# triton-ascend 3.2 moves a row piece as one contiguous copy only from this size (the Unified
# Buffer block) up; a smaller piece becomes a loop of scalar loads and stores.
NPU_MIN_PIECE_BYTES = 32


def _triton_npu_counts(device) -> dict:
    """num_aicore / num_vectorcore from triton-ascend's driver, when it is the active one."""
    try:
        from triton.runtime import driver
        props = driver.active.utils.get_device_properties(device)
        return {k: int(props[k]) for k in ("num_aicore", "num_vectorcore") if k in props}
    except Exception:
        return {}


def _properties(device: torch.device, p) -> dict:
    counts = _triton_npu_counts(device.index or 0)
    name = getattr(p, "name", str(device))
    return dict(arch=name, **counts,
                compute_units=counts.get("num_vectorcore", getattr(p, "multi_processor_count", 0)),
                ub_bytes=_NPU_UB_BYTES.get(name, _NPU_UB_DEFAULT))


def npu_launch_limits(props: dict) -> dict:
    """Launch bounds for the row-copy kernel on an Ascend device.

    grid: one program per vector core (the grid is bound to physical cores; each program
    loops over its share). max_tile_bytes: the largest [ROWS, BLOCK] tile, half the Unified
    Buffer (a load and a store in flight, double-buffered) and a power of two.
    min_rows: rows per tile at least 2: triton-ascend 3.2 cannot lower a gather whose row
    dimension has size 1 (tests/ascend shows it); a short tile repeats its last row.
    min_piece_bytes: the smallest row piece lowered as one contiguous copy (32 bytes, the
    Unified Buffer block); the kernel copies a shorter row tail as one overlapping window of
    this size ending at the chunk's end, where the chunk is at least this long.
    ``props``: the device's figures (`kvtier.platforms.device_properties`, or given).
    """
    cores = int(props.get("num_vectorcore") or props.get("compute_units") or 1)
    ub = int(props.get("ub_bytes") or _NPU_UB_DEFAULT)
    tile = 1 << ((ub // 2).bit_length() - 1)
    return {"grid": max(1, cores), "max_tile_bytes": tile, "ub_bytes": ub, "min_rows": NPU_MIN_ROWS,
            "min_piece_bytes": NPU_MIN_PIECE_BYTES}


def _fit_space(space: Space, figures: dict) -> Space:
    """Tiles within half the device's Unified Buffer, where the device says how big it is."""
    if not figures.get("ub_bytes"):
        return space
    limits = npu_launch_limits({"ub_bytes": figures["ub_bytes"], "compute_units": figures.get("units", 0)})
    return replace(space, tile_limit=limits["max_tile_bytes"])


# ------------------------------------------------------------------ host memory
# Registrations: storage start address -> (device address, bytes, weak reference to the
# storage), recorded by `register_npu_host` or by an engine that registered the memory
# itself (`register_host_memory`); how an entry lives and why none is stale: its declaration.
_registered = caches.table(
    "platforms.ascend._registered", key="a registered storage's start address",
    value="(weak reference to the storage, its size, device address)", bound="registered storages alive",
    rule="the storage freed (its weak reference), or a lookup that finds another storage, start or size there",
    stale="not happen: every lookup re-checks the storage is alive at that start with that size")


def register_host_memory(tensor: torch.Tensor, device_address: int) -> None:
    """Record that ``tensor``'s storage is registered with the NPU at ``device_address``
    (for as long as that storage lives)."""
    if tensor.device.type != "cpu":
        raise PlatformUnavailable(f"tensor on {tensor.device}: only host memory is registered")
    st = tensor.untyped_storage()
    start = st.data_ptr()
    ref = weakref.ref(st, lambda r, start=start: _forget_registration(start, r))
    _registered[start] = (int(device_address), st.nbytes(), ref)


def _forget_registration(start: int, ref) -> None:
    """The storage behind a registration was freed: drop its entry (only that one)."""
    entry = _registered.get(start)
    if entry is not None and entry[2] is ref:
        del _registered[start]


def _live(start: int, entry) -> bool:
    """Whether a registration still describes its storage: alive, at ``start``, same size."""
    st = entry[2]()
    return st is not None and st.data_ptr() == start and st.nbytes() == entry[1]


def registered_device_address(addr: int) -> Optional[int]:
    """The NPU device address of host byte ``addr`` under a live registration, or None."""
    for start, entry in list(_registered.items()):
        dev, nbytes = entry[0], entry[1]
        if start <= addr < start + nbytes:
            if not _live(start, entry):
                _forget_registration(start, entry[2])
                continue
            return dev + (addr - start)
    return None


def npu_reachable(m) -> bool:
    """Whether every layer of host map ``m`` (a `kvtier.kernels.RowMap`) lies in
    registered memory."""
    return all(registered_device_address(a) is not None for a in _layer_bases(m))


def device_addressed(m, device: torch.device):
    """Row map ``m`` as a kernel on ``device`` addresses it: a host map lying in one
    registration is the same map at the registered device address of its base (what a
    call on such a buffer passes, `kvtier.kernels.launcher.Addresses`); any other host map
    becomes a table of its layers' device addresses; device maps are returned unchanged."""
    if m.device.type != "cpu" or device.type == "cpu":
        return m
    if not m.is_table:
        spread = (m.num_components - 1) * m.comp_stride       # (first, end) bytes of every component and layer
        lo = m.base + min(0, spread)
        hi = m.base + max(0, spread) + (m.num_layers - 1) * m.layer_stride + m.layer_span()
        d_lo, d_last = registered_device_address(lo), registered_device_address(hi - 1)
        if d_lo is not None and d_last is not None and d_last - d_lo == hi - 1 - lo:
            base = d_lo + (m.base - lo)
            return replace(m, base=base, device=device, align=min(m.align, _pow2_align(base)))
    return translate(m, device)


def translate(m, table_device: torch.device):
    """A table map over the device addresses of host map ``m``'s layers; the table lives
    on ``table_device`` (where the kernel reads it)."""
    addrs = []
    for a in _layer_bases(m):
        d = registered_device_address(a)
        if d is None:
            raise KvtierError(f"{m.describe()}: host byte {a:#x} is not registered with the NPU; "
                              "register the host buffer (HostPool(register=True), "
                              "kvtier.platforms.ascend.register_npu_host) or use the dma strategy")
        addrs.append(d)
    table = torch.tensor(addrs, dtype=torch.int64).to(table_device)
    align = _pow2_align(m.row_bytes, m.token_stride, m.page_stride, m.chunk_bytes,
                        *([m.chunk_stride] if m.n_chunks > 1 else []), *addrs)
    return replace(m, table=table, table2=None, base=0, layer_stride=0, comp_stride=0, device=table_device,
                   align=min(align, m.align), table_comp=-1, table_layer=1, table_split=-1)


def _layer_bases(m):
    """Host address of every (component, layer) base, component-major."""
    if m.is_table:
        return m.table.tolist()
    return [m.base + c * m.comp_stride + l * m.layer_stride
            for c in range(m.num_components) for l in range(m.num_layers)]


# ------------------------------------------------------------------ registration (CANN)
def _acl(name: str, argtypes):
    load_torch_npu()            # loads libascendcl, or says why it cannot
    f = runtime_libs.function("libascendcl.so", name, argtypes)
    if f is None:
        raise PlatformUnavailable(f"{name} not found: libascendcl is not loaded")
    return f


def register_npu_host(t: torch.Tensor) -> int:
    """Register ``t``'s whole storage with the current NPU (mapped: kernels read and write
    it) and record it; returns the device address of ``t``'s first byte. CANN wants the
    storage to start on a 4 KiB boundary (pinned allocations do)."""
    if t.device.type != "cpu":
        raise fail("tensor", str(t.device), "only host memory is registered")
    st = t.untyped_storage()
    start, nbytes = st.data_ptr(), st.nbytes()
    if start % HOST_PAGE:
        raise fail("tensor", hex(start), f"storage must start on a {HOST_PAGE}-byte boundary to be registered")
    entry = _registered.get(start)
    if entry is not None and _live(start, entry):
        return entry[0] + (t.data_ptr() - start)
    register = _acl("aclrtHostRegister", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_void_p)])
    dev = ctypes.c_void_p()
    rc = register(start, nbytes, ACL_HOST_REGISTER_MAPPED, ctypes.byref(dev))
    if rc != 0 or not dev.value:
        raise PlatformUnavailable(f"aclrtHostRegister of {nbytes} bytes at {start:#x} failed ({rc})")
    register_host_memory(t, dev.value)
    _owned.add(start)
    return dev.value + (t.data_ptr() - start)


def unregister_npu_host(t: torch.Tensor) -> None:
    """Undo `register_npu_host` for ``t``'s storage (and forget the record)."""
    unregister_storage(t.untyped_storage().data_ptr())


def unregister_storage(start: int) -> None:
    """Undo the registration of the storage that starts at host address ``start`` (with
    the NPU where kvtier registered it, `register_npu_host`; the record either way)."""
    _registered.pop(start, None)
    if start in _owned:
        _owned.discard(start)
        _acl("aclrtHostUnregister", [ctypes.c_void_p])(start)


# Storage starts kvtier registered with the NPU itself (`register_npu_host`), so that each
# is unregistered once: explicitly, or when its storage is freed.
_owned = caches.table("platforms.ascend._owned", factory=set, kind="state", key="storage start address",
                      value="(member) registered by kvtier itself", bound="registered storages alive",
                      rule="unregistered once, explicitly or when the storage is freed")



def _register_for_pool(buf: torch.Tensor):
    """HostPool(register=True): register ``buf`` and unregister it when its storage is freed."""
    register_npu_host(buf)
    st = buf.untyped_storage()
    return weakref.finalize(st, unregister_storage, st.data_ptr())


# ------------------------------------------------------------------ bulk copies (dma)
@caches.lru("platforms.ascend._acl_runtime", bound="1", key="-", value="ACL's bulk copy calls (ctypes)",
            stale="not happen: a loaded library stays")
def _acl_runtime() -> Optional[Runtime]:
    copy_2d = runtime_libs.function("libascendcl.so", "aclrtMemcpy2dAsync", ARGS_2D)
    if copy_2d is None:
        return None
    # aclrtMemcpy2dAsync takes at most 5 * 1024 * 1024 rows per call (CANN documentation).
    return Runtime("acl", copy_2d, lambda d: torch.npu.current_stream(d).npu_stream,
                   max_pitch=(1 << 63) - 1, max_height=5 * 1024 * 1024)


def _dma_runtime():
    if os.environ.get("TASK_QUEUE_ENABLE", "1") != "0":
        return None, "set TASK_QUEUE_ENABLE=0 for aclrtMemcpy2dAsync"
    rt = _acl_runtime()
    return rt, "" if rt is not None else "the runtime library was not found"


def npu_timer(warmup: int = 0, repeats: int = 0):
    """Median over torch.npu events, one pair per repeat."""
    warmup, repeats = warmup or 5, repeats or 20

    def timer(fn, **_):
        for _ in range(warmup):
            fn()
        torch.npu.synchronize()
        samples = []
        for _ in range(repeats):
            start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return statistics.median(samples)
    return timer


# About one program per vector core, looping inside (the grid is bound to physical cores);
# at least 2 rows; tiles well inside the 192 KB Unified Buffer. No warps.
DEFAULT = CopyConfig(num_programs=40, rows=2, block_bytes=16384, num_warps=1)

NPU = Platform(
    name="npu", device_type="npu", link_config=DEFAULT, device_config=DEFAULT,
    # One stage: no cp.async; the tile already fills half the Unified Buffer.
    space=Space((2, 4, 8), (4096, 8192, 16384, 32768), (1,), 96 * 1024, 0, stages=(1,)),
    quick_space=Space((2, 4), (8192, 16384), (1,), 96 * 1024, 0, stages=(1,)),
    max_programs=lambda units, crosses_link: units or DEFAULT.num_programs,
    timer=npu_timer, min_rows=NPU_MIN_ROWS, min_piece_bytes=NPU_MIN_PIECE_BYTES,
    dma_runtime=_dma_runtime, kernel_reaches=npu_reachable, kernel_view=device_addressed,
    host_address=lambda t: registered_device_address(t.data_ptr()),
    unreachable=("Ascend kernels reach only host memory registered with the NPU "
                 "(HostPool(register=True), kvtier.platforms.ascend.register_npu_host); "
                 "use the dma strategy (device staging + bulk copies)"),
    register_host=_register_for_pool, properties=_properties, fit_space=_fit_space,
    inline_check_programs=0)    # vector compares lower to scalar code: a check launch of its own
