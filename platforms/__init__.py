"""Which accelerator kvtier runs on, and the few runtime calls that differ per backend.

Platforms: "cuda" (NVIDIA), "rocm" (AMD, through torch.cuda), "npu" (Huawei Ascend,
through torch_npu) and "cpu" (no accelerator; kernels run under Triton's interpreter).

torch_npu is imported only when a caller asks about the NPU, never at import time: without
the CANN toolkit it fails, and when torch auto-loads it as a device backend a failure takes
``import torch`` down too. So this module turns torch's backend autoload off (unless the
user chose a value, or torch is already imported) before it imports torch, and loads
torch_npu itself, once, catching and remembering why it failed.

Backends differ as data: each platform names the torch device type and the torch module
(``torch.cuda``, ``torch.npu``) that syncs, gives streams and describes devices.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional, Sequence

_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
if "torch" not in sys.modules:
    os.environ.setdefault(_AUTOLOAD, "0")

import torch  # noqa: E402

__all__ = [
    "PLATFORMS", "PlatformUnavailable", "detect_platform", "default_device", "platform_of",
    "npu_available", "npu_status", "load_torch_npu", "synchronize", "current_stream",
    "accelerator_present", "pin", "pinned_empty", "device_properties", "npu_launch_limits",
    "register_host_memory", "host_device_address", "platform_info",
]

PLATFORMS = ("cuda", "rocm", "npu", "cpu")
# platform -> torch device type (its runtime module is getattr(torch, type))
_DEVICE_TYPE = {"cuda": "cuda", "rocm": "cuda", "npu": "npu", "cpu": "cpu"}
ENV_PLATFORM = "KVTIER_PLATFORM"   # force a platform (tests, or to ignore an accelerator)


class PlatformUnavailable(RuntimeError):
    """The platform asked for cannot be used here; the message says why."""


# ------------------------------------------------------------------ torch_npu
_npu = {}  # "module" or "error" once load_torch_npu has run


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


# ------------------------------------------------------------------ detection
def _probe() -> str:
    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if importlib.util.find_spec("torch_npu") is not None and npu_available():
        return "npu"
    return "cpu"


_probed = {}


def detect_platform() -> str:
    """"cuda", "rocm", "npu" or "cpu"; KVTIER_PLATFORM overrides the probe."""
    forced = os.environ.get(ENV_PLATFORM)
    if forced:
        if forced not in PLATFORMS:
            raise PlatformUnavailable(f"{ENV_PLATFORM}={forced!r}: must be one of {PLATFORMS}")
        return forced
    if "platform" not in _probed:
        _probed["platform"] = _probe()
    return _probed["platform"]


def _type_of(device) -> str:
    # Read the type without torch.device(): "npu" is no torch device type until torch_npu loads.
    return device.split(":")[0] if isinstance(device, str) else torch.device(device).type


def _as_device(device) -> torch.device:
    if _type_of(device) == "npu":
        _runtime_of("npu")
    return torch.device(device)


def platform_of(device) -> str:
    """The platform a torch device (or device string) belongs to."""
    kind = _type_of(device)
    if kind == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if kind in PLATFORMS:
        return kind
    raise PlatformUnavailable(f"device={str(device)!r}: kvtier supports {PLATFORMS}")


def _runtime_of(kind: str):
    """The torch module driving devices of type ``kind`` (torch.cuda, torch.npu); None for the CPU."""
    if kind == "cpu":
        return None
    if kind == "npu":
        ok, why = npu_status()
        if not ok:
            raise PlatformUnavailable(why)
    mod = getattr(torch, kind, None)
    if mod is None:
        raise PlatformUnavailable(f"device type {kind!r}: torch has no {kind} runtime")
    return mod


def default_device(platform: Optional[str] = None) -> torch.device:
    """The current device of ``platform`` (default: the detected one)."""
    platform = platform or detect_platform()
    if platform not in PLATFORMS:
        raise PlatformUnavailable(f"platform={platform!r}: must be one of {PLATFORMS}")
    kind = _DEVICE_TYPE[platform]
    mod = _runtime_of(kind)
    return torch.device("cpu") if mod is None else torch.device(kind, mod.current_device())


def _resolve(device) -> torch.device:
    device = default_device() if device is None else _as_device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, _runtime_of(device.type).current_device())
    return device


def synchronize(device=None) -> None:
    """Wait for all work queued on ``device`` (a no-op on the CPU)."""
    device = _resolve(device)
    mod = _runtime_of(device.type)
    if mod is not None:
        mod.synchronize(device)


def current_stream(device=None):
    """The current stream of ``device`` (torch.cuda.Stream / torch.npu.Stream); None on the CPU."""
    device = _resolve(device)
    mod = _runtime_of(device.type)
    return None if mod is None else mod.current_stream(device)


# ------------------------------------------------------------------ host memory
def accelerator_present() -> bool:
    return detect_platform() != "cpu"


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in page-locked memory when an accelerator is present (pinning needs a
    device runtime); unchanged otherwise, and unchanged if already pinned."""
    if tensor.device.type != "cpu" or not accelerator_present() or tensor.is_pinned():
        return tensor
    return tensor.pin_memory()


def pinned_empty(shape: Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when an accelerator is present."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=accelerator_present())


# Host memory a kernel may address directly. CUDA/ROCm: any pinned memory (UVA: the host
# address is the device address). Ascend: only memory registered with the device (e.g.
# aclrtHostRegister / halHostRegister through an extension), which has its own device
# address; plain pinned memory is reachable by DMA only. Registrations are recorded here
# by whoever registers the memory: storage start address -> (device address, bytes).
_registered = {}


def register_host_memory(tensor: torch.Tensor, device_address: int) -> None:
    """Record that ``tensor``'s storage is registered with the NPU at ``device_address``."""
    if tensor.device.type != "cpu":
        raise PlatformUnavailable(f"tensor on {tensor.device}: only host memory is registered")
    st = tensor.untyped_storage()
    _registered[st.data_ptr()] = (int(device_address), st.nbytes())


def host_device_address(tensor: torch.Tensor, platform: str) -> Optional[int]:
    """The address a ``platform`` kernel uses for ``tensor.data_ptr()``, or None when the
    kernel cannot reach it (then the copy must use the dma strategy)."""
    if tensor.device.type != "cpu":
        return tensor.data_ptr()
    if platform in ("cuda", "rocm"):
        return tensor.data_ptr() if tensor.is_pinned() else None
    if platform == "npu":
        return registered_device_address(tensor.data_ptr())
    return tensor.data_ptr()  # cpu: the interpreter reads host memory itself


def registered_device_address(addr: int) -> Optional[int]:
    """The NPU device address of host byte ``addr`` under a recorded registration, or None."""
    for start, (dev, nbytes) in _registered.items():
        if start <= addr < start + nbytes:
            return dev + (addr - start)
    return None


# ------------------------------------------------------------------ properties
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


def device_properties(device=None) -> dict:
    """name, arch, compute_units (SMs / CUs / vector cores), memory; NPU adds num_aicore,
    num_vectorcore and ub_bytes. The CPU reports its core count."""
    device = _resolve(device)
    platform = platform_of(device)
    if platform == "cpu":
        import platform as _pyplatform
        return {"platform": "cpu", "name": _pyplatform.processor() or _pyplatform.machine(),
                "arch": _pyplatform.machine(), "compute_units": os.cpu_count() or 1}
    mod = _runtime_of(device.type)
    p = mod.get_device_properties(device)
    info = {"platform": platform, "name": getattr(p, "name", str(device)),
            "memory_bytes": int(getattr(p, "total_memory", 0))}
    if platform == "cuda":
        info.update(arch=f"sm_{p.major}{p.minor}", compute_units=p.multi_processor_count)
    elif platform == "rocm":
        info.update(arch=getattr(p, "gcnArchName", ""), compute_units=p.multi_processor_count)
    else:
        counts = _triton_npu_counts(device.index or 0)
        name = info["name"]
        info.update(arch=name, **counts,
                    compute_units=counts.get("num_vectorcore", getattr(p, "multi_processor_count", 0)),
                    ub_bytes=_NPU_UB_BYTES.get(name, _NPU_UB_DEFAULT))
    return info


def npu_launch_limits(device=None, *, props: Optional[dict] = None) -> dict:
    """Launch bounds for the row-copy kernel on an Ascend device.

    grid: one program per vector core (the grid is bound to physical cores; each program
    loops over its share). max_tile_bytes: the largest [ROWS, BLOCK] tile, half the Unified
    Buffer (a load and a store in flight, double-buffered) and a power of two.
    min_rows: rows per tile at least 2: triton-ascend 3.2 cannot lower a gather whose row
    dimension has size 1 (tests/ascend shows it); a short tile repeats its last row.
    min_piece_bytes: the smallest row piece lowered as one contiguous copy (32 bytes, the
    Unified Buffer block); the kernel copies a shorter row tail as one overlapping window of
    this size ending at the chunk's end, where the chunk is at least this long.
    ``props`` (from device_properties) can be passed to compute without a device.
    """
    props = props if props is not None else device_properties(device)
    cores = int(props.get("num_vectorcore") or props.get("compute_units") or 1)
    ub = int(props.get("ub_bytes") or _NPU_UB_DEFAULT)
    tile = 1 << ((ub // 2).bit_length() - 1)
    return {"grid": max(1, cores), "max_tile_bytes": tile, "ub_bytes": ub, "min_rows": NPU_MIN_ROWS,
            "min_piece_bytes": NPU_MIN_PIECE_BYTES}


def platform_info() -> dict:
    """What `kvtier info` prints: the platform, its device, and why others are absent."""
    info = {"platform": detect_platform(), "torch": torch.__version__,
            "torch_backend_autoload": os.environ.get(_AUTOLOAD, "1")}
    try:
        import triton
        info["triton"] = triton.__version__
        info["triton_backend"] = "ascend" if importlib.util.find_spec("triton.backends.ascend") else "community"
    except Exception as e:
        info["triton"] = f"unavailable ({type(e).__name__}: {e})"
    info["cuda"] = torch.cuda.is_available()
    if importlib.util.find_spec("torch_npu") is not None or "module" in _npu or "error" in _npu:
        ok, why = npu_status()
        info["npu"] = ok if ok else why
    else:
        info["npu"] = "torch_npu is not installed"
    try:
        info["device"] = device_properties()
    except Exception as e:
        info["device"] = f"unavailable ({type(e).__name__}: {e})"
    if info["platform"] == "npu" and isinstance(info["device"], dict):
        info["npu_launch_limits"] = npu_launch_limits(props=info["device"])
    return info
