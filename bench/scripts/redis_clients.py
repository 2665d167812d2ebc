"""Which way of talking to Redis lands GET replies in page buffers, and sends SETs from
them, fastest: the engine's own RESP framing (`kvtier.store.redis`, over 1, 2 and 4
connections) against redis-py + hiredis, valkey + libvalkey and valkey-glide-sync (each
where installed: pip install 'redis[hiredis]' 'valkey[libvalkey]' valkey-glide-sync),
beside redis-benchmark's own GET and SET in the same rounds.

    python bench/scripts/redis_clients.py redis://127.0.0.1:PORT [ROUNDS] [SIZES]

SIZES: value bytes, comma-separated (default 65536,262144,1048576). Each round moves
64 MiB per client and size, 128 keys a call (a library: one pipeline of 128 GETs whose
replies are copied into the buffers, one pipeline of 128 SETs); the rounds interleave
the clients, and each figure is the median of the rounds (GB/s, and in parentheses
the client process's CPU seconds per GB moved). Every read is checked byte for byte.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from kvtier.store import Status, open_store
from kvtier.store.redis_url import parse

TOTAL = 64 << 20
BATCH = 128


def engine_client(url: str, connections: int):
    e = open_store(f"{url}?connections={connections}")

    def get(keys, bufs):
        assert set(e.get_into(keys, [[b] for b in bufs])) == {Status.HIT}

    def put(keys, bufs):
        assert set(e.put_from(keys, [[b] for b in bufs])) == {Status.HIT}
    return get, put


def redis_py_client(module, host: str, port: int):
    client = module.Redis(host=host, port=port)

    def get(keys, bufs):
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        for b, v in zip(bufs, pipe.execute()):
            b[:] = v

    def put(keys, bufs):
        pipe = client.pipeline(transaction=False)
        for k, b in zip(keys, bufs):
            pipe.set(k, b)
        pipe.execute()
    return get, put


def glide_client(host: str, port: int):
    from glide_sync import GlideClient, GlideClientConfiguration, NodeAddress
    client = GlideClient.create(GlideClientConfiguration([NodeAddress(host, port)], request_timeout=10_000))

    def get(keys, bufs):
        for b, v in zip(bufs, client.mget(keys)):
            b[:] = v

    def put(keys, bufs):
        client.mset({k: bytes(b) for k, b in zip(keys, bufs)})
    return get, put


def clients(url: str) -> dict:
    (host, port), = parse(url, cluster=False).addrs
    out = {f"kvtier RESP x{c}": engine_client(url, c) for c in (1, 2, 4)}
    for name, module in (("redis-py+hiredis", "redis"), ("valkey+libvalkey", "valkey")):
        try:
            out[name] = redis_py_client(__import__(module), host, port)
        except ImportError:
            print(f"({name}: not installed)")
    try:
        out["valkey-glide-sync"] = glide_client(host, port)
    except ImportError:
        print("(valkey-glide-sync: not installed)")
    return out


def timed(fn, keys, bufs, size):
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(keys), BATCH):
        fn(keys[i:i + BATCH], bufs[i:i + BATCH])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    gb = len(keys) * size / 1e9
    return gb / wall, cpu / gb


def main(argv) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    url = argv[0]
    rounds = int(argv[1]) if len(argv) > 1 else 5
    sizes = [int(s) for s in argv[2].split(",")] if len(argv) > 2 else [65536, 262144, 1 << 20]
    named = clients(url)
    raw_engine = open_store(url)
    how = ""
    for size in sizes:
        n = TOTAL // size
        keys = [f"kvtier-bench/clients/{size}/{i}" for i in range(n)]
        src = np.random.default_rng(size).integers(0, 256, n * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        srcs = [memoryview(src[i * size:(i + 1) * size]) for i in range(n)]
        dsts = [memoryview(dst[i * size:(i + 1) * size]) for i in range(n)]
        results: dict = {}
        for _ in range(rounds):
            raw = raw_engine.raw_throughput(size, max(n, 1000))
            how = raw["how"]
            results.setdefault("redis-benchmark", []).append(((raw["get_gbps"], 0.0), (raw["set_gbps"], 0.0)))
            for name, (get, put) in named.items():
                p = timed(put, keys, srcs, size)
                dst[:] = 0
                g = timed(get, keys, dsts, size)
                if not np.array_equal(dst, src):
                    raise SystemExit(f"{name}: the bytes read differ from those written")
                results.setdefault(name, []).append((g, p))
        print(f"value {size >> 10} KiB: median of {rounds} rounds, {n} values a round, {BATCH} a call; "
              "GB/s (client CPU s/GB)")
        base_g = statistics.median(r[0][0] for r in results["redis-benchmark"])
        base_s = statistics.median(r[1][0] for r in results["redis-benchmark"])
        for name, rs in results.items():
            g, gc = (statistics.median(r[0][j] for r in rs) for j in (0, 1))
            s, sc = (statistics.median(r[1][j] for r in rs) for j in (0, 1))
            cpu = lambda c: f" ({c:.2f})" if c else "       "     # noqa: E731
            print(f"  {name:20s} GET {g:5.2f}{cpu(gc)} {g / base_g:4.2f}x   SET {s:5.2f}{cpu(sc)} {s / base_s:4.2f}x")
        sys.stdout.flush()
        raw_engine.delete(keys)
    print(f"redis-benchmark: {how} (-d, -n per size)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
