"""Host memory as an Ascend kernel sees it.

On CUDA and ROCm a pinned host address is also its device address (UVA), so a host row map
goes to the kernel as it is. On Ascend a kernel reaches host memory only after it has been
registered with the device (``aclrtHostRegister``, mapped), and then through a device
address of its own; triton-ascend also rejects host tensors as kernel arguments. So for
an NPU copy a host map is re-described as an int64 table of per-layer *device* addresses
(the kernel's table mode), built once per map and device and cached on the map.

Registrations are recorded in `kvtier.platforms` (storage start -> device
address, bytes) by `register_npu_host` here or by an engine that registered the memory
itself (`platform.register_host_memory`).
"""
from __future__ import annotations

import ctypes
from dataclasses import replace
import torch

import kvtier.platforms as platform
from kvtier.kernels.errors import KvtierError, fail
from kvtier.kernels.rowmap import RowMap, _pow2_align

from . import runtime_libs

ACL_HOST_REGISTER_MAPPED = 0
HOST_PAGE = 4096        # aclrtHostRegister needs a 4 KiB-aligned start


def npu_reachable(m: RowMap) -> bool:
    """Whether every layer of host map ``m`` lies in registered memory (a yes is cached;
    a no is asked again, since the memory may be registered later)."""
    key = "npu_reachable"
    if not m._anchors.get(key):
        m._anchors[key] = all(platform.registered_device_address(a) is not None for a in _layer_bases(m))
    return m._anchors[key]


def device_addressed(m: RowMap, device: torch.device) -> RowMap:
    """``m`` as a kernel on ``device`` addresses it: host maps become tables of their
    registered device addresses (on ``device``); other maps are returned unchanged."""
    if m.device.type != "cpu" or device.type == "cpu":
        return m
    key = ("device_addressed", str(device))
    hit = m._anchors.get(key)
    if hit is None:
        hit = m._anchors[key] = translate(m, device)
    return hit


def translate(m: RowMap, table_device: torch.device) -> RowMap:
    """A table map over the device addresses of host map ``m``'s layers; the table lives
    on ``table_device`` (where the kernel reads it)."""
    addrs = []
    for a in _layer_bases(m):
        d = platform.registered_device_address(a)
        if d is None:
            raise KvtierError(f"{m.describe()}: host byte {a:#x} is not registered with the NPU; "
                              "register the host buffer (HostPool(register=True), "
                              "kvtier.platforms.ascend_host.register_npu_host) or use the dma strategy")
        addrs.append(d)
    table = torch.tensor(addrs, dtype=torch.int64).to(table_device)
    align = _pow2_align(m.row_bytes, m.token_stride, m.page_stride, m.chunk_bytes,
                        *([m.chunk_stride] if m.n_chunks > 1 else []), *addrs)
    return replace(m, table=table, base=0, layer_stride=0, comp_stride=0, device=table_device,
                   align=min(align, m.align), _anchors={})


def _layer_bases(m: RowMap):
    """Host address of every (component, layer) base, component-major."""
    if m.is_table:
        return m.table.tolist()
    return [m.base + c * m.comp_stride + l * m.layer_stride
            for c in range(m.num_components) for l in range(m.num_layers)]


# ------------------------------------------------------------------ registration (CANN)
def _acl(name: str, argtypes):
    platform.load_torch_npu()            # loads libascendcl, or says why it cannot
    f = runtime_libs.function("libascendcl.so", name, argtypes)
    if f is None:
        raise platform.PlatformUnavailable(f"{name} not found: libascendcl is not loaded")
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
    if start in platform._registered:
        return platform._registered[start][0] + (t.data_ptr() - start)
    register = _acl("aclrtHostRegister", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_void_p)])
    dev = ctypes.c_void_p()
    rc = register(start, nbytes, ACL_HOST_REGISTER_MAPPED, ctypes.byref(dev))
    if rc != 0 or not dev.value:
        raise platform.PlatformUnavailable(f"aclrtHostRegister of {nbytes} bytes at {start:#x} failed ({rc})")
    platform.register_host_memory(t, dev.value)
    return dev.value + (t.data_ptr() - start)


def unregister_npu_host(t: torch.Tensor) -> None:
    """Undo `register_npu_host` for ``t``'s storage (and forget the record)."""
    unregister_storage(t.untyped_storage().data_ptr())


def unregister_storage(start: int) -> None:
    """Undo the registration of the storage that starts at host address ``start``."""
    if platform._registered.pop(start, None) is not None:
        _acl("aclrtHostUnregister", [ctypes.c_void_p])(start)
