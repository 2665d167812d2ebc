"""What Triton's launch path adds to each hot-path call on a GPU, measured without one:
Triton's argument binding (the per-launch specialization of every argument, then the
compiled-kernel cache key) of exactly the launches each call of `kvtier bench --overhead`
makes, for the CUDA backend (sm_90), on this machine's CPU.

    python bench/scripts/launch_binding.py [REPEATS]

`kvtier bench --overhead` on a CPU times the calls up to their launches. Through Triton's
own launch path a GPU call adds, per launch, this binding (and the rest of that path),
then the driver launch (not measured here: it needs the GPU); kvtier's direct launches
(`kvtier.kernels.direct_launch`) skip that path from a copy launch's third launch on.
Each call runs once inside `LaunchProbe`; its launches (row copies, index checks) are
counted and the latest of each is bound REPEATS times (default 2000; median). Needs
community Triton with its CUDA backend (no GPU); exits 3 where this Triton has neither.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from kvtier.bench.overhead import CALLS, build_calls  # noqa: E402
from kvtier.bench.probe import LaunchProbe  # noqa: E402


def binders():
    """{"copy": bind, "check": bind}: (args, kwargs) -> None, one launch's binding and
    cache key as `JITFunction.run` computes them; raises ImportError where this Triton
    has no CUDA backend or binds otherwise."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime import jit
    from kvtier.kernels.codegen import compilable
    from kvtier.kernels.copy_rows_kernel import copy_rows_jit
    from kvtier.kernels.index_check_kernel import check_indices_jit
    if not hasattr(jit, "create_function_from_signature") or not hasattr(jit, "compute_cache_key"):
        import triton
        raise ImportError(f"Triton {triton.__version__} binds its launches otherwise")
    backend = make_backend(GPUTarget("cuda", 90, 32))

    def bind_for(kernel):
        fn = compilable(kernel)
        binder, keys = jit.create_function_from_signature(fn.signature, fn.params, backend), {}

        def bind(args, kwargs):
            _, specialization, options = binder(*args, **kwargs)
            jit.compute_cache_key(keys, specialization, options)
        return bind
    return {"copy": bind_for(copy_rows_jit), "check": bind_for(check_indices_jit)}


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main(argv) -> int:
    repeats = int(argv[1]) if len(argv) > 1 else 2000
    try:
        bind = binders()
    except ImportError as e:
        print(f"launch binding not measured: {e}", file=sys.stderr)
        return 3
    torch.set_num_threads(1)
    fns, _ = build_calls(torch.device("cpu"), lists=64)
    print(f"{'call':<40} {'copies':>6} {'checks':>6} {'us/copy':>8} {'us/check':>8} {'us/call':>8}")
    with LaunchProbe(keep_args=True) as probe:
        for name in CALLS:
            for _ in range(40):          # past the first calls (maps, routes, lanes built)
                fns[name]()
            marks = len(probe.grids), len(probe.check_grids)
            fns[name]()
            counts = {"copy": len(probe.grids) - marks[0], "check": len(probe.check_grids) - marks[1]}
            last = probe.last_launches()
            per = {k: median_us(lambda k=k: bind[k](*last[k]), repeats) if counts[k] else 0.0 for k in bind}
            total = sum(counts[k] * per[k] for k in per)
            print(f"{name:<40} {counts['copy']:>6} {counts['check']:>6} {per['copy']:8.2f} {per['check']:8.2f} "
                  f"{total:8.2f}")
    print("per launch: Triton's argument binding and cache key (CUDA backend), timed on this CPU; "
          "what kvtier's direct launches skip once a copy launch's kernel is kept")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
