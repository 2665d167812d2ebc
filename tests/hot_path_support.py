"""A stand-in for device memory on the CPU, to catch host reads of device tensors.

On the CPU every tensor is host memory, so a `.item()` on device indices would go
unnoticed. `DeviceResident` marks index tensors as living on the device: any operation
that would read them on the host (a device sync on a GPU) raises `HostRead`, except while
a kvtier kernel runs (Triton's interpreter reads its arguments on the host: that is the
device's work). Derived tensors (slices, page expansions) stay device-resident.
"""
from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
          torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
          torch.unique, torch.Tensor.unique, torch.aminmax, torch.Tensor.aminmax}
_in_kernel = [0]


class HostRead(AssertionError):
    """A default-path call read device memory on the host."""


class DeviceResident(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _in_kernel[0]:
            name = getattr(func, "__name__", str(func))
            if func in _READS:
                raise HostRead(f"{name} read a device-resident tensor on the host")
            if func is torch.Tensor.to and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values())):
                raise HostRead("to('cpu') of a device-resident tensor")
            if func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) \
                    and args[1].dtype == torch.bool:
                raise HostRead("boolean-mask indexing of a device-resident tensor (its size needs a sync)")
        return super().__torch_function__(func, types, args, kwargs)


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceResident)


class _Counted:
    """A kernel whose launches count as device work (host reads allowed inside)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            self.launches += 1
            _in_kernel[0] += 1
            try:
                return run(*(a.as_subclass(torch.Tensor) if isinstance(a, DeviceResident) else a
                             for a in args), **kwargs)
            finally:
                _in_kernel[0] -= 1
        return launch


@contextlib.contextmanager
def device_work_only():
    """Within the block, host reads of device-resident tensors and device syncs raise;
    yields (copy kernel, check kernel) launch counters."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _patch(monkeypatch)


def _patch(monkeypatch):
    copy_rows = importlib.import_module("kvtier.kernels.copy_rows")
    check = importlib.import_module("kvtier.kernels.index_check_kernel")
    platforms = importlib.import_module("kvtier.platforms")
    copies = _Counted(copy_rows._kernel())
    checks = _Counted(check._check_indices_kernel)
    monkeypatch.setattr(copy_rows, "_kernel", lambda: copies)
    monkeypatch.setattr(check, "_check_indices_kernel", checks)

    def no_sync(*a, **k):
        raise HostRead("a device synchronize in a default-path call")
    monkeypatch.setattr(platforms, "synchronize", no_sync)
    return copies, checks
