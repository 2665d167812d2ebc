"""Where one hot-path call spends its host time up to the launch: cProfile over many calls
of one of `kvtier.bench.overhead.CALLS` inside `LaunchProbe` (kernels recorded, not run),
on the overhead measurement's shape.

    python bench/scripts/profile_overhead.py [CALL] [CALLS] [TOP]

CALL defaults to HostPool.load_to_device_per_layer, CALLS to 2000, TOP to 25. Prints the
call's unprofiled median first (cProfile inflates every figure below it), then the
functions under it by cumulative microseconds per call, with their own (self) time and
calls per call. Runs on any machine; indices and tables as in `kvtier bench --overhead`.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from kvtier.bench.overhead import CALLS, build_calls  # noqa: E402
from kvtier.bench.probe import LaunchProbe  # noqa: E402
from kvtier.platforms.cpu import wall_timer  # noqa: E402


def main(argv) -> int:
    name = argv[1] if len(argv) > 1 else "HostPool.load_to_device_per_layer"
    n = int(argv[2]) if len(argv) > 2 else 2000
    top = int(argv[3]) if len(argv) > 3 else 25
    if name not in CALLS:
        print(f"CALL={name!r}: must be one of {', '.join(CALLS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    fns, _ = build_calls(torch.device("cpu"))
    fn = fns[name]
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    with LaunchProbe():
        median_s = wall_timer(50, n)(fn)       # the median of n calls after 50 warm-up calls
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
    print(f"{name}: {median_s * 1e6:.1f} us median unprofiled, {n} calls, up to the launch")
    print(f"{'cum us/call':>11} {'self us':>8} {'n/call':>7}  function (under cProfile)")
    rows = []
    for (path, line, func), (_, ncalls, tt, ct, _) in pstats.Stats(prof).stats.items():
        where = os.path.relpath(path, root) if path.startswith(root) else path
        rows.append((ct / n * 1e6, tt / n * 1e6, ncalls / n, f"{where}:{line}({func})"))
    for cum, own, calls, where in sorted(rows, reverse=True)[:top]:
        print(f"{cum:11.1f} {own:8.1f} {calls:7.1f}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
