"""Route an installed SGLang's HiCache transfers through kvtier: ``install()``.

SGLang's host pools bind their transfer calls as module globals when they are imported
(``from sgl_kernel.kvcacheio import ...`` on CUDA/ROCm, ``from sgl_kernel_npu.kvcacheio
import ...`` on Ascend) and, on CUDA/ROCm, take their own JIT HiCache kernels for the
``layer_first`` and ``page_first`` layouts whenever ``can_use_hicache_jit_kernel`` /
``can_use_write_back_jit_kernel`` answer yes. ``install()``:

1. puts module objects ``sgl_kernel.kvcacheio`` and ``sgl_kernel_npu.kvcacheio`` holding
   kvtier's calls in ``sys.modules`` (an installed real module keeps every name kvtier
   does not provide; a missing ``sgl_kernel`` / ``sgl_kernel_npu`` package is stood in by
   an empty package, so ``from sgl_kernel import x`` still raises ImportError), so
   modules imported later bind kvtier's calls;
2. rebinds, in every SGLang HiCache module that imports here (`SGLANG_MODULES`), each
   global the module's code looks up that kvtier provides, whatever platform branch
   bound it (or left it unbound, as on a CPU), and answers no in the JIT-availability
   checks, so ``layer_first`` / ``page_first`` take the kvcacheio calls, i.e. kvtier;
   Mamba's JIT calls are bound to kvtier's single-component calls;
3. makes SGLang's pointer tables use `kvtier.adapters.sglang_ranges.get_device_accessible_ptr`;
4. registers every SGLang host pool as it is built (each ``HostKVCache`` class's
   ``__init__``, wrapped): its tensors (host buffers, the device buffers and pointer
   tables it holds) become a buffer set of `kvtier.adapters.registry`, so each of its
   calls' transfers is prepared once and kept for the pool's lifetime.

Call it before SGLang builds its host pools: a pool decides JIT or not when it is built.
Idempotent; ``uninstall()`` restores every binding it changed. Each routed module is
logged at INFO.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import logging
import sys
import threading
import types
from typing import Dict, List, Tuple

import torch

from . import registry
from . import sglang as _cuda_calls
from . import sglang_npu as _npu_calls
from . import sglang_npu_state as _npu_state
from . import sglang_ranges as _ranges
from kvtier import caches

__all__ = ["install", "uninstall", "installed", "SGLANG_MODULES", "KVCACHEIO", "KVCACHEIO_NPU"]

log = logging.getLogger("kvtier")

# SGLang's names of the calls kvtier provides, per source module.
KVCACHEIO: Dict[str, object] = {n: getattr(m, n) for m in (_cuda_calls, _ranges) for n in m.__all__}
KVCACHEIO_NPU: Dict[str, object] = {n: getattr(m, n) for m in (_npu_calls, _npu_state) for n in m.__all__}

# The modules of SGLang 0.5.23 that bind HiCache transfer calls, JIT checks or pointer
# helpers; those that do not import here (another platform's runtime missing) are skipped.
SGLANG_MODULES: Tuple[str, ...] = (
    "sglang.kernels.ops.kvcache.hicache",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.unified",
    "sglang.srt.mem_cache.pool_host.mha_mxfp8",
    "sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.hisparse_memory_pool",
    "sglang.srt.mem_cache.embedding_cache_controller",
    "sglang.srt.hardware_backend.npu.memory_pool_npu",
)

# page_unified's own JIT load-back is left alone: kvtier has no page_unified call.
JIT_CHECKS = ("can_use_hicache_jit_kernel", "can_use_write_back_jit_kernel")


def _no_jit(*args, **kwargs) -> bool:
    """SGLang's JIT-availability checks, answered so that its kvcacheio calls run."""
    return False


def _mamba_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
                 num_warps_per_item=None):
    """SGLang's Mamba JIT ``transfer_kv_mamba_pf_lf``: one component's layer of a page-first
    host buffer into a device layer, as `transfer_kv_per_layer_mla_pf_lf`."""
    _cuda_calls.transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id,
                                                item_size, src_layout_dim)


def _mamba_lf_pf(src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers,
                 num_warps_per_item=None):
    """SGLang's Mamba JIT ``transfer_kv_mamba_lf_pf``: every layer (pointer table) into a
    page-first host buffer, as `transfer_kv_all_layer_mla_lf_pf`."""
    _cuda_calls.transfer_kv_all_layer_mla_lf_pf(src_ptrs, dst, src_indices, dst_indices, item_size,
                                                dst_layout_dim, num_layers)


def _device_ptr_resolver():
    """Stands in for SGLang's ``_resolve_device_accessible_ptr_fn`` (which accepts only a
    registered sgl_kernel torch op)."""
    return _ranges.get_device_accessible_ptr


# Every global an SGLang module may look up, and kvtier's value for it.
BINDINGS: Dict[str, object] = {
    **KVCACHEIO, **KVCACHEIO_NPU,
    **{n: _no_jit for n in JIT_CHECKS},
    "transfer_kv_mamba_pf_lf": _mamba_pf_lf,
    "transfer_kv_mamba_lf_pf": _mamba_lf_pf,
    "_resolve_device_accessible_ptr_fn": _device_ptr_resolver,
}

_MISSING = object()
_lock = threading.Lock()
# (owner: module or sys.modules dict, name, previous value or _MISSING), in change order.
_saved: List[Tuple[object, str, object]] = caches.table(
    "adapters.sglang_install._saved", factory=list, kind="state", key="-",
    value="(owner, name, previous value) of every binding install() changed", bound="bindings changed",
    rule="uninstall()")
_routed: Dict[str, List[str]] = caches.table("adapters.sglang_install._routed", kind="state", key="SGLang module",
                                             value="names routed through kvtier", bound="modules routed",
                                             rule="uninstall()")
_active: List[bool] = caches.table("adapters.sglang_install._active", factory=list, kind="state", key="-",
                                   value="non-empty while installed", bound="1", rule="uninstall()")


def installed() -> Dict[str, List[str]]:
    """``{module: [names bound to kvtier]}`` of the current installation (empty if none)."""
    return {m: list(n) for m, n in _routed.items()}


def _set(owner, name: str, value) -> None:
    if isinstance(owner, dict):
        _saved.append((owner, name, owner.get(name, _MISSING)))
        owner[name] = value
    else:
        _saved.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)


def _looked_up(module: types.ModuleType) -> set:
    """Every name the module's code refers to (globals included), read from its code."""
    try:
        code = module.__spec__.loader.get_code(module.__name__)
    except Exception:  # no source or bytecode to read: bind what the module holds
        return set(vars(module))
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def _package(name: str) -> types.ModuleType:
    """An empty stand-in package: ``from <name> import x`` raises ImportError as when absent."""
    pkg = types.ModuleType(name, f"Stand-in for {name}, which is not installed (kvtier).")
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    return pkg


def _provide(package: str, calls: Dict[str, object]) -> str:
    """Make ``<package>.kvcacheio`` hold kvtier's calls; returns what was done."""
    full = f"{package}.kvcacheio"
    try:
        real = importlib.import_module(full)
    except Exception:  # absent, or present without its runtime (no driver here)
        real = None
    if real is not None:
        for n, f in calls.items():
            _set(real, n, f)
        return f"{full} (installed module, {len(calls)} names rebound)"
    if package not in sys.modules or sys.modules[package] is None:
        try:
            importlib.import_module(package)
        except Exception:
            _set(sys.modules, package, _package(package))
    mod = types.ModuleType(full, f"{full} provided by kvtier.adapters")
    mod.__spec__ = importlib.machinery.ModuleSpec(full, None)
    mod.__dict__.update(calls)
    _set(sys.modules, full, mod)
    _set(sys.modules[package], "kvcacheio", mod)
    return f"{full} (provided by kvtier)"


def install(modules=SGLANG_MODULES) -> Dict[str, List[str]]:
    """Route SGLang's HiCache transfers through kvtier (see the module docstring).
    Returns ``{module: [names bound]}``; a second call changes nothing."""
    with _lock:
        if _active:
            return installed()
        _active.append(True)
        for package, calls in (("sgl_kernel", KVCACHEIO), ("sgl_kernel_npu", KVCACHEIO_NPU)):
            log.info("kvtier: SGLang install: %s", _provide(package, calls))
        for name in modules:
            try:
                module = importlib.import_module(name)
            except Exception as e:  # another platform's module: nothing of it runs here
                log.debug("kvtier: SGLang install: %s not imported (%s)", name, e)
                continue
            wanted = sorted(n for n in _looked_up(module) & BINDINGS.keys()
                            if not (n == "_resolve_device_accessible_ptr_fn" and not hasattr(module, n)))
            for n in wanted:
                _set(module, n, BINDINGS[n])
            if wanted:
                _routed[name] = wanted
                log.info("kvtier: SGLang install: %s -> kvtier: %s", name, ", ".join(wanted))
            for cls in _host_pool_classes(module):
                _set(cls, "__init__", _registering(cls.__dict__["__init__"]))
        if not _routed:
            log.info("kvtier: SGLang install: no SGLang module imported; kvcacheio modules provided")
        return installed()


def _host_pool_classes(module: types.ModuleType) -> List[type]:
    """The classes ``module`` defines that are SGLang host pools (``HostKVCache``
    subclasses) with an ``__init__`` of their own."""
    base = getattr(sys.modules.get("sglang.srt.mem_cache.pool_host.base"), "HostKVCache", None)
    if base is None:
        return []
    return [c for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, base) and c.__module__ == module.__name__
            and "__init__" in c.__dict__ and not getattr(c.__dict__["__init__"], "_kvtier_registers", False)]


def _registering(init):
    """``init`` (a host pool class's ``__init__``), then the pool registered as a buffer
    set (`register_pool`)."""
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        register_pool(self)
    __init__._kvtier_registers = True
    __init__.__wrapped__ = init
    __init__.__doc__ = init.__doc__
    return __init__


def register_pool(pool) -> None:
    """Register SGLang host pool ``pool``'s tensors and its device pool's (those each holds
    as attributes, and in lists and tuples of them: a transfer's calls pass both sides) as a
    buffer set owned by the host pool (`kvtier.adapters.registry`);
    call it again after the pool's buffers change."""
    owners = [pool] + [d for d in (getattr(pool, "device_pool", None),) if d is not None and hasattr(d, "__dict__")]
    held = [v for o in owners for v in vars(o).values() if isinstance(v, torch.Tensor)
            or (isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v))]
    if held:
        registry.register(pool, held)


def uninstall() -> None:
    """Undo `install`: every binding and sys.modules entry it changed gets its old value."""
    with _lock:
        for owner, name, old in reversed(_saved):
            if isinstance(owner, dict):
                if old is _MISSING:
                    owner.pop(name, None)
                else:
                    owner[name] = old
            elif old is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, old)
        _saved.clear()
        _routed.clear()
        _active.clear()
