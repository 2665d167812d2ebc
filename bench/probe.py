"""Look at a kvtier call up to its kernel launch without running the kernel.

Inside ``LaunchProbe()``, the row-copy kernel is replaced by a recorder: every call of
the core or of a pool still validates, plans and looks up its configuration, then
records its launch grid instead of launching. This gives the programs a transfer uses
and the host time a call spends before its launch, with no GPU and no interpreter.
"""
from __future__ import annotations

import importlib

# The module, not the function of the same name that kvtier.kernels exports.
_core = importlib.import_module("kvtier.kernels.copy_rows")


class NoKernel(RuntimeError):
    """Triton is not installed: calls run the torch reference, with no launch to probe."""


class _Recorder:
    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return _no_launch


def _no_launch(*args, **kwargs):
    return None


class LaunchProbe:
    """Context manager; ``.grids`` lists the grid of every launch made inside it."""

    def __enter__(self) -> "LaunchProbe":
        if _core._triton() is None:
            raise NoKernel("Triton is not installed: kvtier calls run the torch reference, "
                           "there is no kernel launch to probe")
        self._saved = _core._kernel
        self._saved_interp = _core.interpreter_active
        self._rec = _Recorder()
        _core._kernel = lambda: self._rec
        # The CPU falls back to the reference without the interpreter; the probe never
        # runs the kernel, so it may take the launch path anywhere.
        _core.interpreter_active = lambda: True
        return self

    def __exit__(self, *exc) -> None:
        _core._kernel = self._saved
        _core.interpreter_active = self._saved_interp

    @property
    def grids(self):
        return self._rec.grids

    def programs(self) -> int:
        """Programs of the largest launch seen (0 if nothing launched)."""
        return max((g[0] for g in self.grids), default=0)
