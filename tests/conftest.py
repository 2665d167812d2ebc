"""Test setup: run Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before Triton is imported, so it is set here, first,
unless an accelerator is present (then the hardware-marked tests run compiled
kernels) or KVTIER_TEST_COMPILED=1 asks for compiled kernels explicitly.
"""
import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))


def _has_accelerator() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


if os.environ.get("KVTIER_TEST_COMPILED") != "1" and not _has_accelerator():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# An autotune cache of the suite's own, never the user's: tuned entries there would change
# the configurations tests launch with, and a stale file would warn in their output.
_CACHE = tempfile.mkdtemp(prefix="kvtier-test-cache-")
os.environ["KVTIER_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)

import pytest  # noqa: E402


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """An empty autotune cache directory for one test; the hot-path lookup forgets what it
    read before and after, so no test sees another's (or the user's) tuned entries."""
    from kvtier.autotune import select
    from kvtier.autotune.cache import CACHE_ENV
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    select.invalidate()
    yield tmp_path
    select.invalidate()


@pytest.fixture(autouse=True)
def no_failure_left_behind():
    """Index-check failures are recorded per thread (`kvtier.kernels.faults`): none may be
    left from one test to the next, where it would be raised by an unrelated call."""
    from kvtier.kernels import faults
    left = faults.pending()
    assert left is None, f"a failure recorded before this test was never raised: {left}"
    yield
    left = faults.pending()
    assert left is None, f"this test left a failure recorded but never raised: {left}"


def pytest_collection_modifyitems(config, items):
    import torch
    have = {
        "cuda": torch.cuda.is_available() and not getattr(torch.version, "hip", None),
        "rocm": torch.cuda.is_available() and bool(getattr(torch.version, "hip", None)),
        "npu": _npu_available(),
        "slow": os.environ.get("KVTIER_SLOW") == "1",
    }
    for item in items:
        for mark, ok in have.items():
            if mark in item.keywords and not ok:
                item.add_marker(pytest.mark.skip(reason=f"needs {mark} (not present here)"))


def _npu_available() -> bool:
    if "torch_npu" not in sys.modules and os.environ.get("KVTIER_TEST_NPU") != "1":
        return False  # never import torch_npu implicitly: without CANN it breaks torch
    try:
        import torch
        import torch_npu  # noqa: F401
        return torch.npu.is_available()
    except Exception:
        return False
