"""What the hot-path calls of `kvtier bench --overhead` cannot avoid, timed on this machine:
the pieces every all-layer call and gather pays (its storage watch, the shape and value
checks of new lists, one recorded launch) and what a gather into new buffers adds (its
allocation and the views of it), beside one `torch.index_select` of the overhead
measurement's shape. Apart from those: what an all-layer call on an accelerator's pool
adds for host indices passed on the CPU (kvtier's own `HostPool.alloc` lists; SGLang
moves them to the device first), their value check on the host, which raises at once.

    python bench/scripts/overhead_floor.py [CALLS]

CALLS (default 20000) per piece; each figure is the mean microseconds of one piece over
CALLS calls (timeit), kernels recorded, not run (`LaunchProbe`), on the pools, indices and
shape of `kvtier.bench.overhead.build_calls`. The sums are lower bounds for the calls:
the calls themselves add their own Python around these pieces.
"""
from __future__ import annotations

import itertools
import os
import sys
import timeit

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from kvtier.cli.bench_cmd import load_bench  # noqa: E402

load_bench()
from kvtier.bench.overhead import SHAPE, build_calls  # noqa: E402
from kvtier.bench.probe import LaunchProbe  # noqa: E402
from kvtier.autotune.workload import Pools, PoolShape  # noqa: E402
from kvtier.kernels.index_check import _check_on_host  # noqa: E402
from kvtier.kernels.ops import BACKUP  # noqa: E402
from kvtier.kernels.storage_watch import check_storage  # noqa: E402
from kvtier.pool import launch as launcher  # noqa: E402


def main(argv) -> int:
    n = int(argv[1]) if len(argv) > 1 else 20000
    torch.set_num_threads(1)
    fns, what = build_calls(torch.device("cpu"), lists=64)
    ps = PoolShape.mha(SHAPE["layers"], SHAPE["heads"], SHAPE["head_dim"], SHAPE["dtype"],
                       page_size=SHAPE["page_size"], host_layout=SHAPE["host_layout"])
    pools = Pools(ps, SHAPE["tokens"], torch.device("cpu"), spare=2, strategy="kernel", check=None)
    hp, dp = pools.host_pool, pools.device_pool
    hi, di = pools.host_slots, pools.device_slots
    lists = [(hi.clone(), di.clone()) for _ in range(64)]
    walk = itertools.cycle(lists).__next__

    def us(fn) -> float:
        return timeit.timeit(fn, number=n) / n * 1e6

    plan = hp.guard.pair(("host_indices", hp.size, SHAPE["page_size"]), ("device_indices", dp.size, SHAPE["page_size"]))

    def check(h, d):                # the value check an all-layer call makes of new lists (its pair plan kept)
        return hp.guard.check_pair(hp.device, plan, h, d)

    slots = hp._resolve(dp, whole=True)

    with LaunchProbe():
        hp.backup_from_device_all_layer(dp, hi, di)
        step = hp._last_routes[4][None][0]      # the call's one launch (K and V together)
        out = dp.gather(di[::SHAPE["page_size"]] // SHAPE["page_size"], pages=True)
        buf = next(iter(out.values()))._base
        word = next(iter(dp._gather_layouts.values())).bounds[0].plan.dp_dtype
        saved, hp.check = hp.check, False   # what an all-layer call checks of new lists besides values
        try:
            shapes = us(lambda: hp._check_indices(slots, *walk(), keep=False))
        finally:
            hp.check = saved
        pieces = {
            f"storage watch ({len(step.watch.tensors)} tensors)": us(lambda: check_storage(step.watch)),
            "shape checks of two new lists": shapes,
            "value check of two new lists": us(lambda: check(*walk())),
            "one recorded copy launch": us(lambda: launcher.run_bound(BACKUP, step.bound, di, hi, None, None, True)),
            "allocation of the gather's result": us(lambda: torch.empty(buf.shape, dtype=buf.dtype)),
            "its view as the kernel's words": us(lambda: buf.view(word)),
            f"its {buf.shape[0]} component views": us(lambda: [buf[i] for i in range(buf.shape[0])]),
        }
        host_check = us(lambda: _check_on_host("host_indices", walk()[0], hp.size, SHAPE["page_size"], False))
        base = us(fns["torch.index_select"])
    width = max(map(len, pieces))
    for name, t in pieces.items():
        print(f"{name:<{width}} {t:6.2f} us")
    names = list(pieces)
    every, extra = sum(pieces[k] for k in names[:4]), sum(pieces[k] for k in names[4:])
    print(f"{'every all-layer call and gather':<{width}} {every:6.2f} us (sum of the first four)")
    print(f"{'a gather into new buffers':<{width}} {every + extra:6.2f} us (all seven)")
    print(f"{'torch.index_select':<{width}} {base:6.2f} us (one device layer, {what['tokens']} rows)")
    print(f"{'host check of CPU host indices':<{width}} {host_check:6.2f} us (an accelerator's all-layer call "
          f"with {what['tokens']} host indices on the CPU, in pages of {SHAPE['page_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
