"""Import SGLang's real package (installed by .ci/sglang.sh) for test_sglang_package.

`load()` returns ``(modules, None)`` or ``(None, why)``. SGLang's config package imports
torchvision for its multimodal processors, which no pool module uses; PyPI's Linux
torchvision wheels are CUDA builds that do not load beside the CPU torch build, so where
torchvision cannot be imported an empty placeholder package stands in for it (any
attribute is an inert object; version "0.0", so transformers takes no torchvision path).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

SGLANG_VERSION = "0.5.23"
MODULES = {
    "memory_pool": "sglang.srt.mem_cache.memory_pool",
    "mha": "sglang.srt.mem_cache.pool_host.mha",
    "mla": "sglang.srt.mem_cache.pool_host.mla",
    "hicache": "sglang.kernels.ops.kvcache.hicache",
    "npu_pool": "sglang.srt.hardware_backend.npu.memory_pool_npu",
}


class _Inert:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Inert()

    def __getattr__(self, name):
        return _Inert()


class _Placeholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path, target=None):
        if name == self.root or name.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name, "placeholder (tests/adapters/sglang_package_support.py)")
        m.__path__, m.__version__ = [], "0.0"
        m.__getattr__ = lambda name: _Inert()
        return m

    def exec_module(self, module):
        pass


def _torchvision_loads() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
        return True
    except Exception:
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
        return False


def load():
    if importlib.util.find_spec("sglang") is None:
        return None, "SGLang is not importable (bash .ci/sglang.sh installs sglang==0.5.23 for this test)"
    if not _torchvision_loads():
        sys.meta_path.insert(0, _Placeholder("torchvision"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mods = {k: importlib.import_module(v) for k, v in MODULES.items()}
    except Exception as e:
        return None, f"SGLang's pool modules do not import here: {type(e).__name__}: {e}"
    from importlib.metadata import version
    got = version("sglang")
    if got != SGLANG_VERSION:
        return None, f"sglang {got} is installed; this test pins {SGLANG_VERSION}"
    return mods, None
