"""Look at a kvtier call up to its kernel launches without running a kernel.

Inside ``LaunchProbe()``, both kernels a call can launch are replaced by recorders: the
row-copy kernel (`kvtier.kernels.launcher`) and the index-check kernel
(``check_indices_jit`` in `kvtier.kernels.index_check_kernel`, which
`kvtier.kernels.index_check` launches before the copies when value checks are on).
Every call of the core, a pool or an adapter still validates, plans, looks up its
configuration and builds its launch arguments, then records each launch grid instead of
launching. This gives the programs a transfer uses and the host time a call spends up to
its launches, with no GPU and no interpreter run.

Nothing a call learns inside the probe outlives it as a verdict: kvtier keeps no verdict
of any index list between calls (every launch checks its own), so a later real call
checks again whatever was recorded here.
"""
from __future__ import annotations

import importlib

import kvtier.kernels.launcher as _core


class NoKernel(RuntimeError):
    """Triton is not installed: calls run the torch reference, with no launch to probe."""


class _Recorder:
    """Records every launch's grid; with ``keep_args``, the latest launch's arguments too
    (off by default: the overhead measurement times calls with this recorder in them)."""

    def __init__(self, keep_args: bool = False):
        self.grids = []
        self.last = None        # (args, kwargs) of the latest launch, with keep_args
        self._launch = self._keep if keep_args else _no_launch

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self._launch

    def _keep(self, *args, **kwargs):
        self.last = (args, kwargs)


# The stand-in for a launch: a C callable that takes any arguments and does nothing with
# them (a Python function would cost its argument packing, about 0.2 us per launch here,
# which the overhead measurement would count as the call's own time).
_no_launch = "".format


class LaunchProbe:
    """Context manager; ``.grids`` lists the grid of every row-copy launch made inside it,
    ``.check_grids`` every index-check launch (neither kernel runs). ``keep_args``: keep
    each kernel's latest launch arguments too (`last_launches`)."""

    def __init__(self, keep_args: bool = False):
        self.keep_args = keep_args

    def __enter__(self) -> "LaunchProbe":
        if _core._triton() is None:
            raise NoKernel("Triton is not installed: kvtier calls run the torch reference, "
                           "there is no kernel launch to probe")
        # Imported here: both need Triton, which is present from this point on.
        self._check_mod = importlib.import_module("kvtier.kernels.index_check_kernel")
        self._maps = importlib.import_module("kvtier.adapters.maps")
        self._rec, self._check_rec = _Recorder(self.keep_args), _Recorder(self.keep_args)
        self._saved = (_core._kernel, _core.interpreter_active, self._check_mod.check_indices_jit,
                       self._maps.interpreter_active, _core._RUNNERS)
        _core._kernel = lambda: self._rec
        self._check_mod.check_indices_jit = self._check_rec
        # The CPU falls back to the reference without the interpreter; the probe never
        # runs a kernel, so it may take the launch path anywhere (the adapters' module
        # holds its own name for the same test).
        _core.interpreter_active = lambda: True
        self._maps.interpreter_active = lambda: True
        _core._RUNNERS = {kind: "kernel" for kind in ("cpu", "cuda", "npu")}
        return self

    def __exit__(self, *exc) -> None:
        (_core._kernel, _core.interpreter_active, self._check_mod.check_indices_jit,
         self._maps.interpreter_active, _core._RUNNERS) = self._saved

    @property
    def grids(self):
        return self._rec.grids

    @property
    def check_grids(self):
        return self._check_rec.grids

    def last_launches(self) -> dict:
        """The latest recorded launch of each kernel, as (args, kwargs): {"copy": ...,
        "check": ...}, None where that kernel has not launched (or ``keep_args`` is off)."""
        return {"copy": self._rec.last, "check": self._check_rec.last}

    def programs(self) -> int:
        """Programs of the largest row-copy launch seen (0 if nothing launched)."""
        return max((g[0] for g in self.grids), default=0)
