"""`kvtier demo`: back random KV pages up to host memory, write them to a store and read
them back (an embedded file store in a temporary directory, or ``--store URL``), load
them back to the device through the kernels on the best device present, check every
byte, print what ran where and each tier's time."""
from __future__ import annotations

import os
import time


def register(sub) -> None:
    p = sub.add_parser("demo", help="back up and load a small KV cache through the kernels and check every byte")
    from kvtier.kernels.layouts import NAMES
    from kvtier.flags import positive_int
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--pages", type=positive_int, default=32)
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--moved-pages", type=positive_int, default=8, help="at most --pages")
    p.add_argument("--layout", default="page_first_direct", choices=NAMES)
    p.add_argument("--store", metavar="URL", help="the store tier: file:///dir, redis://host:port, ... "
                                                  "(default: a file store in a temporary directory, removed after)")
    p.set_defaults(func=run)


SIZES = ("layers", "pages", "page_size", "heads", "head_dim")


def run(args) -> int:
    from .args import UsageError, check_environment, check_fits
    if args.moved_pages > args.pages:
        raise UsageError(f"--moved-pages={args.moved_pages}: at most --pages={args.pages}")
    check_environment()
    from kvtier import platforms
    platform = platforms.detect_platform()          # the best device present
    device = platforms.default_device(platform)
    kv_bytes = 2 * args.layers * args.pages * args.page_size * args.heads * args.head_dim * 2   # K, V in bf16
    check_fits(" ".join(f"--{f.replace('_', '-')}={getattr(args, f)}" for f in SIZES), device, kv_bytes, kv_bytes)
    import shutil
    import tempfile
    import torch
    from kvtier.errors import KvtierError
    from kvtier.store import open_store
    scratch = None if args.store else tempfile.mkdtemp(prefix="kvtier-demo-store-")
    try:
        store = open_store(args.store or f"file://{scratch}")
    except KvtierError as e:
        raise UsageError(f"--store={args.store!r}: {e}") from None
    try:
        return _run(args, store, torch, device, platform)
    finally:
        store.close()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _run(args, store, torch, device, platform) -> int:
    if platform == "cpu":
        # Triton runs CPU tensors only in its interpreter, chosen before Triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kvtier.kernels import RowMap, copy_rows
    from kvtier.kernels.launcher import interpreter_active
    from kvtier.kernels.layouts import host_layout
    from kvtier.platforms import device_name, synchronize
    L, pages, P, H, D = args.layers, args.pages, args.page_size, args.heads, args.head_dim
    N = pages * P
    g = torch.Generator().manual_seed(0)
    pin = platform != "cpu"
    # Device: one tensor per layer for K and for V (CUDA style, address tables).
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32).to(torch.bfloat16)
    dev_k = [rand(N, H, D).to(device) for _ in range(L)]
    dev_v = [rand(N, H, D).to(device) for _ in range(L)]
    # Host: K and V in one buffer, so one launch moves both.
    layout = host_layout(args.layout, "--layout")
    host = torch.empty((2, *layout.shape(layers=L, slots=N, page_size=P, row_shape=(H, D))), dtype=torch.bfloat16)
    host = host.pin_memory() if pin else host
    host.view(torch.int16).fill_(0x5A5A)
    dmap = RowMap.stack([RowMap.from_layers(dev_k, P), RowMap.from_layers(dev_v, P)])
    hmap = RowMap.stack([RowMap.from_host_layout(host[0], args.layout, P),
                         RowMap.from_host_layout(host[1], args.layout, P)])
    take = torch.randperm(pages, generator=g)[:args.moved_pages]
    dev_idx = (take[:, None] * P + torch.arange(P)).flatten().to(device)
    host_idx = (torch.arange(args.moved_pages)[:, None] * P + torch.arange(P)).flatten().to(device)
    want = [t[dev_idx].cpu() for t in dev_k + dev_v]
    moved = 2 * L * dev_idx.numel() * H * D * 2

    def timed(fn):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        return time.perf_counter() - t

    backup = lambda: copy_rows(dmap, dev_idx, hmap, host_idx, by_page=True)  # noqa: E731
    load = lambda: copy_rows(hmap, host_idx, dmap, dev_idx, by_page=True)    # noqa: E731
    backup()                 # first calls compile the kernels: warm up, then time
    t_backup = timed(backup)
    # The store tier: the host pages out to the store, the host poisoned, and read back.
    tier = _store_tier(store, dev_k, dev_v, host, args.layout, P, N)
    keys = [f"demo-page-{i}-{time.time_ns()}" for i in range(args.moved_pages)]
    host_cpu_idx = host_idx.cpu()
    t_put, stored = _timed_host(lambda: tier.backup(keys, host_cpu_idx))
    host.view(torch.int16).fill_(0x5A5A)
    t_get, read = _timed_host(lambda: tier.prefetch(keys, host_cpu_idx))
    store_ok = all(stored) and read == args.moved_pages
    load()
    for t in dev_k + dev_v:  # poison the device pages, then load them back
        t[dev_idx] = torch.tensor(float("nan"), dtype=t.dtype)
    t_load = timed(load)
    ok = store_ok and all(torch.equal(a[dev_idx].cpu().view(torch.int16), b.view(torch.int16))
                          for a, b in zip(dev_k + dev_v, want))
    runner = ("Triton interpreter (CPU)" if interpreter_active() else "torch reference") if platform == "cpu" \
        else f"Triton kernels on {device_name(device) or device}"
    print(f"kvtier demo: {platform} ({runner})")
    print(f"  device KV: {L} layers x K,V x {N} slots x {H} heads x {D} bf16 (one tensor per layer)")
    print(f"  host KV:   {args.layout} {tuple(host.shape)}{' pinned' if pin else ''}")
    print(f"  store:     {store.url} ({type(store).__name__}), objects {tier.namespace}:<key>:<part>, {tier.read.m} per page")
    print(f"  moved {args.moved_pages} random pages of {P} tokens = {moved / 1e6:.2f} MB each way")
    if not store_ok:
        print(f"  store: {sum(stored)} of {len(stored)} pages stored, {read} read back ({dict(tier.stats)})")
    for name, t in (("backup device->host", t_backup), ("store put host->store", t_put),
                    ("store get store->host", t_get), ("load host->device", t_load)):
        rate = moved / t
        shown = f"{rate / 1e9:8.3f} GB/s" if rate >= 1e8 else f"{rate / 1e6:8.3f} MB/s"
        print(f"  {name:22s} {t * 1e3:9.2f} ms  {shown}  (one {'warm ' if 'store' not in name else ''}call)")
    if platform == "cpu":
        print("  CPU: the kernels ran in Triton's interpreter (or the torch reference); these times "
              "test the machinery, they are not a device's figures")
    print(f"  every byte checked: {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def _store_tier(store, dev_k, dev_v, host, layout, page_size, slots):
    """A StoreTier over the demo's host buffer: a HostPool adopting the device layers
    and taking ``host`` (K and V in one (2, ...) buffer, the pool's own form) as memory."""
    from kvtier.pool import HostPool, MHADevicePool
    from kvtier.store.tier import StoreTier
    pool = MHADevicePool.from_layers(dev_k, dev_v, page_size)
    hp = HostPool(pool, layout=layout, size_tokens=slots, pin_memory=host.is_pinned(),
                  factory=lambda shape, dtype, pin: host)
    return StoreTier(hp, store, model="kvtier-demo")


def _timed_host(fn):
    """(seconds, result) of one call on the host."""
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out
