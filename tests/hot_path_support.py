"""A stand-in for device memory on the CPU, to catch host reads of device tensors, and a
recorder of the tensors a call allocates.

On the CPU every tensor is host memory, so a `.item()` on device indices would go
unnoticed. `DeviceResident` marks index tensors as living on the device: any operation
that would read them on the host (a device sync on a GPU) raises `HostRead`, except while
a kvtier kernel runs (Triton's interpreter reads its arguments on the host: that is the
device's work). Derived tensors (slices, page expansions) stay device-resident.

`allocations()` records every torch op, outside a kernel launched within
`device_work_only()`, whose result is new memory: what a call allocates on the device
(or the host) around its launches.
"""
from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    """A kernel whose launches count as device work (host reads allowed inside).
    ``checks``: the counter of index checks, credited with every copy launch that checks
    its lists inline (``CHECK`` 2: `kvtier.kernels.launcher.INLINE`)."""

    def __init__(self, kernel, checks=None):
        self.kernel, self.launches, self.checks = kernel, 0, checks
        names = getattr(kernel, "arg_names", None)
        self.check_at = names.index("CHECK") if names is not None and "CHECK" in names else None

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            self.launches += 1
            if self.checks is not None and self.check_at is not None and args[self.check_at] == 2:
                self.checks.launches += 1
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
    yields (copy kernel, index checks) launch counters: the second counts check launches
    and copy launches that check inline."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _patch(monkeypatch)


def _patch(monkeypatch):
    copy_rows = importlib.import_module("kvtier.kernels.launcher")
    check = importlib.import_module("kvtier.kernels.index_check_kernel")
    platforms = importlib.import_module("kvtier.platforms")
    checks = _Counted(check.check_indices_jit)
    copies = _Counted(copy_rows._kernel(), checks)
    monkeypatch.setattr(copy_rows, "_kernel", lambda: copies)
    monkeypatch.setattr(check, "check_indices_jit", checks)

    def no_sync(*a, **k):
        raise HostRead("a device synchronize in a default-path call")
    monkeypatch.setattr(platforms, "synchronize", no_sync)
    return copies, checks


class _Allocations(TorchDispatchMode):
    """Names the ops whose result is new memory: bytes in a storage none of their inputs
    holds (not a view, an in-place result or an empty tensor), made outside a counted
    kernel launch."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _in_kernel[0]:
            inputs = {t.untyped_storage().data_ptr() for t in _tensors(args, kwargs)}
            if any(t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in inputs
                   for t in _tensors(out)):
                self.made.append(str(func))
        return out


def _tensors(*trees):
    for tree in trees:
        items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else (tree,)
        for x in items:
            if isinstance(x, torch.Tensor):
                yield x
            elif isinstance(x, (list, tuple, dict)):
                yield from _tensors(x)


@contextlib.contextmanager
def allocations():
    """Within the block, the name of every op that made a new tensor outside a kernel
    launch (`device_work_only` marks those) is appended to the yielded list."""
    mode = _Allocations()
    with mode:
        yield mode.made
