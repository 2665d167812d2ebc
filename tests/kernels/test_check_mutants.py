"""The tests of the in-kernel check fail when the check is skipped.

Each mutant is the row-copy kernel with one of its two gates removed (built from the
kernel's own source, loaded from a file of its own, put in the launcher's place): the
inline gate (a bad list found by the launch's own check still lets its programs copy)
and the verdict gate (the copies of a call of several launches ignore the check
launch's verdict). On a scenario the suite tests (a load whose device list is in
range but not whole pages, so a mutant moves bytes without leaving its buffers), the
real kernel moves nothing and each mutant moves bytes: the suite's assertion that
nothing moved is what catches it.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest
import torch

from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from pool_support import DeviceCase, HostCase
from kvtier.kernels import KvtierError

core = importlib.import_module("kvtier.kernels.launcher")
P = 4
GATES = {
    "inline gate": "        total = tl.where(bad_code == 0, total, 0)\n",
    "verdict gate": "        total = tl.where(tl.load(verdict) == 0, total, 0)\n",
}


def _mutant(gate: str, tmp_path):
    """The kernel with ``gate``'s line removed, from a module file of its own (Triton
    reads a kernel's source from its file)."""
    import kvtier.kernels.copy_rows_kernel as real
    src = inspect.getsource(real)
    assert src.count(GATES[gate]) == 1, f"the kernel no longer has its {gate} line"
    path = tmp_path / f"mutant_{gate.replace(' ', '_')}.py"
    path.write_text(src.replace(GATES[gate], "        pass\n"))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.copy_rows_jit


def _bad_load(kind: str) -> bool:
    """A load whose device list is in range but not whole pages: True where bytes moved."""
    dev = DeviceCase(kind, "layers", P, layers=2, size=32, gen=torch.Generator().manual_seed(5))
    host = HostCase(dev.pool, "page_first_direct", "kernel", size_tokens=48)
    host.host.backup_from_device_all_layer(dev.pool, torch.arange(0, 8), torch.arange(8, 16))
    before = dev.snapshot()
    bad = torch.tensor([17, 18, 19, 20, 21, 22, 23, 24])       # slots of pages 4-6, not whole pages
    with pytest.raises(KvtierError, match="device_indices=17: "):
        host.host.load_to_device_all_layer(dev.pool, torch.arange(0, 8), bad)
    after = dev.snapshot()
    return any(not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for n in before for a, b in zip(before[n], after[n]))


@pytest.mark.parametrize("gate,kind", [("inline gate", "mha"), ("verdict gate", "mha_v_indexer")],
                         ids=["inline gate, one launch", "verdict gate, several launches"])
def test_a_kernel_without_its_check_gate_is_caught(gate, kind, tmp_path, monkeypatch):
    assert not _bad_load(kind), "the real kernel moved bytes for a bad list"
    mutant = _mutant(gate, tmp_path)
    monkeypatch.setattr(core, "_kernel", lambda: mutant)
    assert _bad_load(kind), f"the kernel without its {gate} moved nothing: the scenario cannot catch it"
