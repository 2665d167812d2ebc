"""Backup and prefetch through SGLang's own HiCache storage calls: kvtier's backend
(`kvtier.store.sglang.KvtierStorage` on ``file://DIR``) beside SGLang's built-in file
backend (``HiCacheFile``, same directory's file system), on SGLang's own host pool.

Each backend runs the controller's own page functions (`HiCacheController`'s zero-copy
pair for kvtier with ``interface_v1``; the generic pair, flat pages, for SGLang's file
backend, which has no v1 calls) over batches of 128 pages: a backup of fresh keys from
the first half of the host pool, then a prefetch of them into the second half, whose
bytes are checked against the first half once. Figures are GB/s of page bytes, best of
``--rounds`` after a warm-up round. Needs SGLang 0.5.23 importable (.ci/sglang.sh
installs it without its heavy dependencies; SGLang is loaded as its CPU tests load it,
tests/adapters/sglang_package_support.py)::

    PYTHONPATH=.sglang-target .venv/bin/python bench/scripts/sglang_storage.py [--dir DIR]

Figures, not assertions: nothing here passes or fails.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path

import torch

from kvtier.flags import Parser, positive_int

LAYERS, HEADS, HEAD_DIM = 8, 4, 64            # bf16: 8 KiB per token (K and V)
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 2
PAGE_BYTES = (256 << 10, 1 << 20)
LAYOUTS = ("page_first_direct", "page_first", "layer_first")
BATCH = 128                                    # SGLang's STORAGE_BATCH_SIZE


def _pool(layout: str, page_size: int, pages: int):
    """SGLang's MHA host pool of ``pages`` pages (plus its padding page), random bytes."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    dev_tokens = pages * page_size // 2
    dev = MHATokenToKVPool(dev_tokens, page_size, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False)
    info = dev.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev_tokens, start_layer=0, end_layer=LAYERS)
    b = host.kv_buffer.view(-1).view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8))
    return host


def _config(extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="bench/model", extra_config=extra)


def _backends(root: str, host):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    kv = StorageBackendFactory.create_backend("dynamic", _config({
        "backend_name": "kvtier", "module_path": "kvtier.store.sglang", "class_name": "KvtierStorage",
        "interface_v1": 1, "url": f"file://{root}/kvtier", "timeout_ms": 1000}), host)
    kv.register_mem_pool_host(host)
    sg = HiCacheFile(_config({"file_storage_path": f"{root}/sglang"}), file_path=f"{root}/sglang")
    sg.register_mem_pool_host(host)
    return {"kvtier": (kv, True), "sglang-file": (sg, False)}


def _round(backend, zero_copy: bool, host, page_size: int, pages: int) -> tuple:
    """(backup seconds, prefetch seconds, pages read) for one round of fresh keys."""
    from sglang.srt.managers.cache_controller import HiCacheController as C
    ctl = types.SimpleNamespace(storage_backend=backend, storage_host_pool=host, page_size=page_size)
    op = types.SimpleNamespace(request_id="bench", is_terminated=lambda: False)
    keys = [uuid.uuid4().hex for _ in range(pages)]
    put = C._page_set_zero_copy if zero_copy else C._generic_page_set
    get = C._page_get_zero_copy if zero_copy else C._generic_page_get
    t0 = time.perf_counter()
    for a in range(0, pages, BATCH):
        ks = keys[a:a + BATCH]
        put(ctl, ks, torch.arange(a * page_size, (a + len(ks)) * page_size))
    t1 = time.perf_counter()
    got = 0
    for a in range(0, pages, BATCH):
        ks = keys[a:a + BATCH]
        dst = torch.arange((pages + a) * page_size, (pages + a + len(ks)) * page_size)
        got += get(ctl, op, ks, dst)
    return t1 - t0, time.perf_counter() - t1, got


def _page(host, slot: int) -> torch.Tensor:
    return host.get_data_page(slot).contiguous().view(torch.uint8)


def run(root: str, mib: int, rounds: int) -> list:
    rows = []
    for page_bytes in PAGE_BYTES:
        P = page_bytes // TOKEN_BYTES
        pages = max(1, (mib << 20) // page_bytes)
        for layout in LAYOUTS:
            host = _pool(layout, P, 2 * pages)
            for name, (backend, zero_copy) in _backends(os.path.join(root, f"{layout}-{P}"), host).items():
                best = [float("inf"), float("inf")]
                for r in range(rounds + 1):
                    put_s, get_s, got = _round(backend, zero_copy, host, P, pages)
                    if got != pages:
                        raise RuntimeError(f"{name}: {got} of {pages} pages read back")
                    if r == 0:          # the warm-up round: the bytes checked
                        if not all(torch.equal(_page(host, q * P), _page(host, (pages + q) * P))
                                   for q in range(pages)):
                            raise RuntimeError(f"{name}: pages read back differ from the pages written")
                        continue
                    best = [min(best[0], put_s), min(best[1], get_s)]
                gb = pages * page_bytes / 1e9
                rows.append((layout, page_bytes >> 10, name, gb / best[0], gb / best[1]))
                print(f"{layout:18s} {page_bytes >> 10:5d} KiB  {name:12s} backup {gb / best[0]:6.2f} GB/s"
                      f"  prefetch {gb / best[1]:6.2f} GB/s", flush=True)
    return rows


def main(argv=None) -> int:
    p = Parser(prog="bench/scripts/sglang_storage.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="a directory on the file system to measure (default: a new one in /tmp)")
    p.add_argument("--mib", type=positive_int, default=64, help="MiB of pages per point (default 64)")
    p.add_argument("--rounds", type=positive_int, default=3, help="timed rounds per point (default 3)")
    args = p.parse_args(argv)
    if args.dir is not None and not os.path.isdir(args.dir):
        p.error(f"--dir={args.dir!r}: not a directory")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "adapters"))
    from sglang_package_support import load
    if load()[0] is None:
        print(f"{p.prog}: {load()[1]}", file=sys.stderr)
        return 2
    root = tempfile.mkdtemp(prefix="kvtier-sglang-bench-", dir=args.dir)
    try:
        print(f"pages of MHA bf16, {LAYERS} layers, {HEADS} heads of {HEAD_DIM}; {args.mib} MiB per point, "
              f"best of {args.rounds}; under {root}")
        run(root, args.mib, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
