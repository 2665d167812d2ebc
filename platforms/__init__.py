"""Which accelerator kvtier runs on, and everything that differs per accelerator.

Platforms: "cuda" (NVIDIA), "rocm" (AMD, through torch.cuda), "npu" (Huawei Ascend,
through torch_npu) and "cpu" (no accelerator; kernels run under Triton's interpreter).
Each is one `Platform` record (`record.py`) built in its family's module (`cuda.py`,
`ascend.py`, `cpu.py`): launch defaults, tuning space, timer, bulk copy calls, launch
floors, how kernels reach host memory. `get(name)` and `of(device)` return the record;
nothing outside this package branches on a platform's name.

torch_npu is imported only when a caller asks about the NPU, never at import time (see
`ascend.py`): when torch auto-loads it as a device backend and it fails (no CANN toolkit),
``import torch`` fails too. So where torch is not imported yet and the user has not chosen,
this module imports torch with the backend autoload off, and then puts the environment
back as it was: child processes (an engine's workers) inherit nothing from kvtier.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
_AUTOLOAD_OFF = "torch" not in sys.modules and _AUTOLOAD not in os.environ
if _AUTOLOAD_OFF:
    os.environ[_AUTOLOAD] = "0"
    try:
        import torch
    finally:
        del os.environ[_AUTOLOAD]

import torch  # noqa: E402

from kvtier.errors import fail  # noqa: E402

from .record import Platform, PlatformUnavailable  # noqa: E402
from . import ascend, cpu, cuda  # noqa: E402
from .ascend import (NPU_MIN_PIECE_BYTES, NPU_MIN_ROWS, load_torch_npu, npu_available,  # noqa: E402,F401
                     npu_status, register_host_memory)
from kvtier import caches  # noqa: E402

__all__ = [
    "Platform", "PLATFORMS", "PlatformUnavailable", "get", "of", "platform_of", "detect_platform",
    "default_device", "default_config", "device_name", "synchronize", "current_stream", "stream_key",
    "accelerator_present", "pin", "pinned_empty", "device_properties", "host_device_address",
    "platform_info",
]

_RECORDS = {p.name: p for p in (cuda.CUDA, cuda.ROCM, ascend.NPU, cpu.CPU)}
PLATFORMS = tuple(_RECORDS)
ENV_PLATFORM = "KVTIER_PLATFORM"   # force a platform (tests, or to ignore an accelerator)


def get(name: str) -> Platform:
    """The record of platform ``name``."""
    try:
        return _RECORDS[name]
    except (KeyError, TypeError):
        raise PlatformUnavailable(f"platform={name!r}: must be one of {PLATFORMS}") from None


def _type_of(device) -> str:
    # Read the type without torch.device(): "npu" is no torch device type until torch_npu loads.
    return device.split(":")[0] if isinstance(device, str) else torch.device(device).type


def platform_of(device) -> str:
    """The platform a torch device (or device string) belongs to."""
    kind = _type_of(device)
    if kind == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if kind in _RECORDS:
        return kind
    raise PlatformUnavailable(f"device={str(device)!r}: kvtier supports {PLATFORMS}")


def of(device) -> Platform:
    """The record of the platform a torch device belongs to."""
    return _RECORDS[platform_of(device)]


def default_config(platform: str = "cpu", crosses_link: bool = True):
    """The shipped configuration for ``platform`` (unknown names: the CPU's)."""
    return _RECORDS.get(platform, cpu.CPU).default_config(crosses_link)


# ------------------------------------------------------------------ detection
def _probe() -> str:
    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if ascend.probed() and npu_available():
        return "npu"
    return "cpu"


_probed = caches.table("platforms._probed", key="the one key 'platform'", value="the probed platform name",
                       bound="1", rule="-", stale="not happen: the machine's accelerators do not change")


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


def _as_device(device) -> torch.device:
    if _type_of(device) == ascend.NPU.device_type:
        _runtime_of(ascend.NPU.device_type)
    return torch.device(device)


def _runtime_of(kind: str):
    """The torch module driving devices of type ``kind`` (torch.cuda, torch.npu); None for the CPU."""
    if kind == "cpu":
        return None
    if kind == ascend.NPU.device_type:
        ok, why = npu_status()
        if not ok:
            raise PlatformUnavailable(why)
    mod = getattr(torch, kind, None)
    if mod is None:
        raise PlatformUnavailable(f"device type {kind!r}: torch has no {kind} runtime")
    return mod


def default_device(platform: Optional[str] = None) -> torch.device:
    """The current device of ``platform`` (default: the detected one); `KvtierError`
    naming the platform where this machine has none (torch itself raises an
    AssertionError, "Torch not compiled with CUDA enabled", or a RuntimeError)."""
    kind = get(platform or detect_platform()).device_type
    mod = _runtime_of(kind)
    if mod is None:
        return torch.device("cpu")
    try:
        return torch.device(kind, mod.current_device())
    except (AssertionError, RuntimeError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise fail("platform", platform or kind, f"has no device here ({why})") from e


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


def capturing() -> bool:
    """Whether the current stream is capturing a graph (CUDA/ROCm graphs): then nothing
    worked out from a tensor's values may be reused, since a replay reads the values the
    tensor holds then. False at once where no such runtime was initialised."""
    return _cuda_ready() and _cuda_capturing()


def _hot_path_queries():
    """torch.cuda's ``is_initialized`` and ``is_current_stream_capturing`` without their
    Python wrappers where torch has the underlying names (asked on every hot-path call)."""
    cuda = torch.cuda
    ready = (lambda: cuda._initialized) if isinstance(getattr(cuda, "_initialized", None), bool) \
        else cuda.is_initialized
    capturing_ = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or cuda.is_current_stream_capturing
    return ready, capturing_


_cuda_ready, _cuda_capturing = _hot_path_queries()


CUDA_RUNTIME = ("cuda", "rocm")     # the platforms on torch's CUDA runtime (torch.cuda)


def on_cuda_runtime(device) -> bool:
    """Whether ``device`` runs on torch's CUDA runtime (NVIDIA CUDA, or ROCm's HIP behind
    the same API): what baselines built for sgl_kernel or vLLM's CUDA code need."""
    return _as_device(device).type == "cuda"


def current_stream(device=None):
    """The current stream of ``device`` (torch.cuda.Stream / torch.npu.Stream); None on the CPU."""
    device = _resolve(device)
    mod = _runtime_of(device.type)
    return None if mod is None else mod.current_stream(device)


def stream_key(device: torch.device):
    """A hashable identity of ``device``'s current stream, cheap enough for every hot-path
    call: on CUDA/ROCm (``device`` with its index) the raw stream handle, read as Triton's
    launcher reads it, without making a Stream object; elsewhere `current_stream`."""
    if _RAW_STREAM is not None and device.type == "cuda" and device.index is not None:
        return device.index, _RAW_STREAM(device.index)
    return current_stream(device)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


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


def host_device_address(tensor: torch.Tensor, platform: str) -> Optional[int]:
    """The address a ``platform`` kernel uses for ``tensor.data_ptr()``, or None when the
    kernel cannot reach it (then the copy must use the dma strategy)."""
    return tensor.data_ptr() if tensor.device.type != "cpu" else get(platform).host_address(tensor)


# ------------------------------------------------------------------ properties
def device_properties(device=None) -> dict:
    """platform, name, arch, compute_units (SMs / CUs / vector cores), memory; NPU adds
    num_aicore, num_vectorcore and ub_bytes. The CPU reports its core count."""
    device = _resolve(device)
    platform = platform_of(device)
    if platform == "cpu":
        import platform as _pyplatform
        return {"platform": "cpu", "name": _pyplatform.processor() or _pyplatform.machine(),
                "arch": _pyplatform.machine(), "compute_units": os.cpu_count() or 1}
    p = _runtime_of(device.type).get_device_properties(device)
    info = {"platform": platform, "name": getattr(p, "name", str(device)),
            "memory_bytes": int(getattr(p, "total_memory", 0))}
    info.update(get(platform).properties(device, p))
    return info


def npu_launch_limits(device=None, props: Optional[dict] = None) -> dict:
    """An NPU's launch limits (`kvtier.platforms.ascend.npu_launch_limits`), from ``props``
    or from the device's own figures."""
    return ascend.npu_launch_limits(props if props is not None else device_properties(device))


@caches.lru("platforms.device_name", bound="devices present", key="torch device (with its index)",
            value="the device's name", stale="not happen: a device's name does not change")
def device_name(device) -> str:
    """The device's name as autotune results are filed ("" for the CPU)."""
    device = torch.device(device)
    return "" if device.type == "cpu" else str(device_properties(device).get("name", ""))


TRITON_CONFLICT = ("community Triton and triton-ascend are both installed; both provide the "
                   "`triton` module, so whichever was installed last is the one that runs. Use one "
                   "environment per platform: `pip uninstall triton` on Ascend, `pip uninstall "
                   "triton-ascend` elsewhere, then reinstall the one you keep")


def triton_conflict() -> Optional[str]:
    """Why the installed Tritons clash (both distributions present), or None."""
    from importlib.metadata import PackageNotFoundError, version
    present = []
    for dist in ("triton", "triton-ascend"):
        try:
            version(dist)
            present.append(dist)
        except PackageNotFoundError:
            pass
    return TRITON_CONFLICT if len(present) == 2 else None


def platform_info() -> dict:
    """What `kvtier info` prints: the platform, its device, and why others are absent."""
    import importlib.util
    info = {"platform": detect_platform(), "torch": torch.__version__,
            "torch_backend_autoload": "0 (for kvtier's import of torch)" if _AUTOLOAD_OFF
            else os.environ.get(_AUTOLOAD, "1")}
    try:
        import triton
        info["triton"] = triton.__version__
        info["triton_backend"] = "ascend" if importlib.util.find_spec("triton.backends.ascend") else "community"
    except Exception as e:
        info["triton"] = f"unavailable ({type(e).__name__}: {e})"
    conflict = triton_conflict()
    if conflict:
        info["warning"] = conflict
    info["cuda"] = torch.cuda.is_available()
    if ascend.probed():
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
