"""What the hot-path calls of `kvtier bench --overhead` cannot avoid, timed on this machine:
the pieces every all-layer call and gather pays (its storage watch, the shape checks of
new lists, one recorded launch that checks the lists' values inline) and what a gather
into new buffers adds (its allocation and the views of it), beside one
`torch.index_select` of the overhead measurement's shape. Apart from those: what the dma
strategy pays for host indices it has not seen (their value check on the host, which
raises at once).

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
from kvtier.bench.overhead import SHAPE, build_calls, overhead_pools  # noqa: E402
from kvtier.bench.probe import LaunchProbe  # noqa: E402
from kvtier.kernels import faults  # noqa: E402
from kvtier.kernels.launcher import INLINE  # noqa: E402
from kvtier.kernels.index_check import check_list_on_host  # noqa: E402
from kvtier.kernels.storage_watch import check_storage  # noqa: E402


def main(argv) -> int:
    n = int(argv[1]) if len(argv) > 1 else 20000
    torch.set_num_threads(1)
    fns, what = build_calls(torch.device("cpu"), lists=64)
    pools = overhead_pools(torch.device("cpu"))
    hp, dp = pools.host_pool, pools.device_pool
    hi, di = pools.host_slots, pools.device_slots
    lists = [(hi.clone(), di.clone()) for _ in range(64)]
    walk = itertools.cycle(lists).__next__

    def us(fn) -> float:
        return timeit.timeit(fn, number=n) / n * 1e6

    transfer = hp.transfers[0].backup               # the pool's prepared backup with its device pool
    steps = transfer.steps(di.numel())
    launch, addresses = steps.single, steps.addresses[0]     # the call's one launch (K and V together)
    record = faults.call_record(hp.device)

    with LaunchProbe():
        hp.backup_from_device_all_layer(dp, hi, di)
        out = dp.gather(di[::SHAPE["page_size"]] // SHAPE["page_size"], pages=True)
        buf = next(iter(out.values()))._base
        pieces = {
            f"storage watch ({len(transfer.watch.tensors)} tensors)": us(lambda: check_storage(transfer.watch)),
            "shape checks of two new lists": us(lambda: hp._check_shapes(dp, *walk())),
            "one recorded copy launch, checking its lists": us(
                lambda: launch(di, hi, addresses, INLINE, record.tensor, transfer.checks)),
            "allocation of the gather's result": us(lambda: torch.empty(buf.shape, dtype=buf.dtype)),
            f"its {buf.shape[0]} component views": us(lambda: buf.unbind()),
        }
        host_check = us(lambda: check_list_on_host("host_indices", walk()[0], hp.size, SHAPE["page_size"], False))
        base = us(fns["torch.index_select"])
    width = max(map(len, pieces))
    for name, t in pieces.items():
        print(f"{name:<{width}} {t:6.2f} us")
    names = list(pieces)
    every, extra = sum(pieces[k] for k in names[:3]), sum(pieces[k] for k in names[3:])
    print(f"{'every all-layer call and gather':<{width}} {every:6.2f} us (sum of the first three)")
    print(f"{'a gather into new buffers':<{width}} {every + extra:6.2f} us (all five)")
    print(f"{'torch.index_select':<{width}} {base:6.2f} us (one device layer, {what['tokens']} rows)")
    print(f"{'host check of CPU host indices':<{width}} {host_check:6.2f} us (the dma strategy's, once per "
          f"new list of {what['tokens']} host indices in pages of {SHAPE['page_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
