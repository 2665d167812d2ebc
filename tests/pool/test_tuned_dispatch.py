"""Tuned configurations reach every transfer made through the public calls, and every
launch is logged at DEBUG on the ``kvtier`` logger.

The autotune cache (``tmp_cache``) holds, for this machine's CPU, a winner for every
operation that differs from the shipped CPU default and from the other operations' (the
program count names the operation, the tile rows the layer count), under keys covering
the transfers below (row bytes, page sizes, row buckets, layer counts). Each public call
(HostPool backup / loads with the kernel and dma strategies, DevicePool gather / scatter
and CPU copies, the SGLang and Ascend adapter calls) is then checked launch by launch:
the configuration each launch ran with (a spy on ``CopyLaunch.__call__``, which every launch
passes) and
the one in the DEBUG line (op, scope, strategy, config, rows, bytes) are the tuned ones,
and the bytes moved match plain torch indexing. With the lookup replaced by the default,
the same checks fail: the tests depend on the lookup, not on luck.
"""
from __future__ import annotations

import ast
import importlib
import logging
import re
from dataclasses import dataclass, replace

import pytest
import torch

from kvtier import adapters
from kvtier.autotune import select
from kvtier.autotune.cache import store
from kvtier.autotune.key import TuneKey, device_identity
from kvtier.kernels import CopyConfig, default_config
from kvtier.kernels.launcher import interpreter_active, triton_available
from kvtier.kernels.ops import OPS, Op
from kvtier.pool import HostPool, MHADevicePool
from pool_support import host_rows

copy_rows_module = importlib.import_module("kvtier.kernels.launcher")

pytestmark = pytest.mark.skipif(not (triton_available() and interpreter_active()),
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1) to run the kernel on CPU")

L, P, PAGES, H, D = 2, 4, 2, 2, 8          # layers, page size, device pages, heads, head_dim
N = P * PAGES                              # device token slots
DTYPE = torch.float16
ROW_BYTES = H * D * DTYPE.itemsize         # 32: every transfer below moves rows of this size
PROGRAMS = {"backup": 3, "load": 5, "gather": 6, "scatter": 7}


def tuned_config(op: str, layers: int, strategy: str = "kernel") -> CopyConfig:
    """The winner stored for ``op`` over ``layers`` layers."""
    return CopyConfig(num_programs=PROGRAMS[op], rows=16 if layers == 1 else 32, block_bytes=1024,
                      num_warps=2, strategy=strategy)


def store_tuned(strategy=None) -> None:
    """Tuned entries for every op, both page sizes in use (1 and P), rows buckets 1..16 and
    1 or L layers, on the link setting the pools look up; ``strategy`` overrides per op."""
    entries = {}
    for op in OPS:
        for page in (1, P):
            for rows in (1, 2, 4, 8, 16):
                for layers in (1, L):
                    key = TuneKey.of(op, row_bytes=ROW_BYTES, page_size=page, num_rows=rows,
                                     num_layers=layers, crosses_link=Op(op).crosses_link)
                    cfg = tuned_config(op, layers, (strategy or {}).get(op, "kernel"))
                    entries[key] = {"config": cfg.to_dict(), "gbps": 1.0}
    store(device_identity("cpu"), entries)
    select.invalidate()


@pytest.fixture
def tuned(tmp_cache):
    for op in OPS:
        for layers in (1, L):
            cfg = tuned_config(op, layers)
            for crosses in (True, False):
                assert cfg != default_config("cpu", crosses_link=crosses)
    store_tuned()
    return tmp_cache


@pytest.fixture(autouse=True)
def kernel_runs(monkeypatch):
    """Every copy runs the Triton kernel with the configuration given (no torch fallback)."""
    def no_fallback(*a, **k):
        raise AssertionError("copy_rows fell back to the torch reference")
    monkeypatch.setattr(copy_rows_module, "reference_copy", no_fallback)


# ------------------------------------------------------------------ launch capture
LINE = re.compile(r"launch op=(\w+) scope=(\w+) strategy=(\w+) config=(\{.*\}) rows=(\d+) bytes=(\d+)$")


@dataclass
class Launch:
    op: str
    scope: str
    strategy: str
    logged: dict          # the config in the DEBUG line
    rows: int
    nbytes: int
    level: int
    given: CopyConfig     # the config copy_rows received
    n: int                # indices copy_rows received
    num_layers: int


class Recorder:
    """The DEBUG launch lines of the ``kvtier`` logger, paired with the copy_rows calls."""

    def __init__(self, monkeypatch, caplog):
        self.caplog, self.calls = caplog, []
        real = copy_rows_module.CopyLaunch.__call__

        def spy(bound, si, di, *args, **kw):
            self.calls.append((bound.config, si.numel(), bound.num_layers))
            return real(bound, si, di, *args, **kw)

        monkeypatch.setattr(copy_rows_module.CopyLaunch, "__call__", spy)
        caplog.set_level(logging.DEBUG, logger="kvtier")

    def take(self):
        lines = [r for r in self.caplog.records if r.name == "kvtier" and r.getMessage().startswith("launch ")]
        calls, self.calls = self.calls, []
        self.caplog.clear()
        assert len(lines) == len(calls), f"{len(calls)} copy_rows launches but {len(lines)} launch lines"
        out = []
        for r, (cfg, n, nl) in zip(lines, calls):
            m = LINE.match(r.getMessage())
            assert m, f"malformed launch line: {r.getMessage()!r}"
            op, scope, strategy, logged, rows, nbytes = m.groups()
            out.append(Launch(op, scope, strategy, ast.literal_eval(logged), int(rows), int(nbytes),
                              r.levelno, cfg, n, nl))
        return out


@pytest.fixture
def rec(monkeypatch, caplog):
    return Recorder(monkeypatch, caplog)


def expect_tuned(launches, op, scope, layers, *, strategy="kernel", nbytes=None, config=None):
    """Every launch of one call ran and logged the tuned config of ``op`` over ``layers``
    (``config`` when given); ``strategy`` is the one the line names (the pool's); a
    ``scope`` of None is not checked."""
    want = config or tuned_config(op, layers)
    assert launches, f"{op}/{scope}: no launch"
    for x in launches:
        assert x.given == want, f"{op}/{scope}: launched with {x.given}, not the tuned config {want}"
        assert x.logged == want.to_dict(), f"{op}/{scope}: logged {x.logged}, not the tuned config"
        assert x.level == logging.DEBUG
        assert (x.op, x.strategy) == (op, strategy) and scope in (None, x.scope), (x.op, x.scope, x.strategy)
        assert x.num_layers == layers and x.rows == x.n
    if nbytes is not None:
        assert sum(x.nbytes for x in launches) == nbytes


# ------------------------------------------------------------------ buffers and references
def rand(shape, gen):
    t = torch.empty(shape, dtype=DTYPE)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
    return t


def u8(t):
    return t.contiguous().view(torch.uint8)


def same(a, b, what):
    assert torch.equal(u8(a), u8(b)), f"{what}: bytes differ"


def device_pool(storage="stacked", seed=0):
    """An MHA pool of L layers, PAGES pages of P slots, random bytes."""
    pool = MHADevicePool(N, P, L, H, D, dtype=DTYPE, storage=storage)
    g = torch.Generator().manual_seed(seed)
    for name in pool.components:
        for l in range(L):
            t = dev_layer(pool, name, l)
            t.copy_(rand(t.shape, g))
    return pool


def dev_layer(pool, name, l):
    """Layer ``l`` of a pool component as an (N, H*D) view."""
    return pool.buffers[name][l].reshape(N, -1)


def snapshot(pool):
    return {n: [dev_layer(pool, n, l).clone() for l in range(L)] for n in pool.components}


def slots(*s):
    return torch.tensor(s, dtype=torch.int64)


# ------------------------------------------------------------------ scenarios (shared with the negative test)
def expect_host(launches, op, scope, layers, strategy, nbytes):
    """A HostPool transfer's launches: the transfer's tuned config with the kernel strategy;
    with "dma", the staging gather (backup) or scatter (loads) under its own op's."""
    if strategy == "dma":
        op = "gather" if op == "backup" else "scatter"
    expect_tuned(launches, op, scope, layers, strategy=strategy, nbytes=nbytes)


def run_host(rec, strategy, layout, storage="stacked"):
    pool = device_pool(storage)
    host = HostPool(pool, layout=layout, size_tokens=N, strategy=strategy)
    orig = snapshot(pool)
    hidx, didx, d2 = slots(4, 5, 6, 7), slots(0, 1, 2, 3), slots(4, 5, 6, 7)
    all_bytes = P * ROW_BYTES * L * 2

    host.backup_from_device_all_layer(pool, hidx, didx)
    expect_host(rec.take(), "backup", "all", L, strategy, all_bytes)
    for name in pool.components:
        for l in range(L):
            same(host_rows(host.buffers[name], layout, l, P, hidx), orig[name][l][didx], f"host {name}{l}")

    host.load_to_device_all_layer(pool, hidx, d2)
    expect_host(rec.take(), "load", "all", L, strategy, all_bytes)
    for name in pool.components:
        for l in range(L):
            same(dev_layer(pool, name, l)[d2], orig[name][l][didx], f"device {name}{l} after load")

    for name in pool.components:
        for l in range(L):
            dev_layer(pool, name, l)[d2] = 0
    host.load_to_device_per_layer(pool, hidx, d2, 1)
    expect_host(rec.take(), "load", "layer", 1, strategy, all_bytes // L)
    for name in pool.components:
        same(dev_layer(pool, name, 1)[d2], orig[name][1][didx], f"device {name}1 after per-layer load")
        assert not u8(dev_layer(pool, name, 0)[d2]).any(), "the per-layer load touched layer 0"


def run_gather_scatter(rec, storage="stacked"):
    pool = device_pool(storage, seed=1)
    orig = snapshot(pool)
    idx = slots(6, 1, 3)
    out = pool.gather(idx)
    expect_tuned(rec.take(), "gather", "all", L, nbytes=3 * ROW_BYTES * L * 2)
    for name in pool.components:
        for l in range(L):
            same(out[name][l].reshape(3, -1), orig[name][l][idx], f"gather {name}{l}")

    pages = pool.gather(slots(1), pages=True)
    expect_tuned(rec.take(), "gather", "all", L, nbytes=P * ROW_BYTES * L * 2)
    for name in pool.components:
        for l in range(L):
            same(pages[name][l].reshape(P, -1), orig[name][l][P:], f"page gather {name}{l}")

    dst = slots(0, 2, 5)
    pool.scatter(dst, out)
    expect_tuned(rec.take(), "scatter", "all", L, nbytes=3 * ROW_BYTES * L * 2)
    for name in pool.components:
        for l in range(L):
            want = orig[name][l].clone()
            want[dst] = orig[name][l][idx]
            same(dev_layer(pool, name, l), want, f"scatter {name}{l}")

    pool.scatter(slots(0), pages, pages=True)           # page 1 over page 0
    expect_tuned(rec.take(), "scatter", "all", L, nbytes=P * ROW_BYTES * L * 2)
    for name in pool.components:
        for l in range(L):
            same(dev_layer(pool, name, l)[:P], orig[name][l][P:], f"page scatter {name}{l}")


def run_cpu_copy(rec, storage="stacked"):
    pool = device_pool(storage, seed=2)
    orig = snapshot(pool)
    idx = slots(7, 0, 4, 2, 5)
    copy = pool.get_cpu_copy(idx, chunk_size=4)          # two chunks: 4 and 1 slots
    got = rec.take()
    assert [x.n for x in got] == [4, 1]
    expect_tuned(got, "gather", "all", L, nbytes=5 * ROW_BYTES * L * 2)
    for name in pool.components:
        for l in range(L):
            dev_layer(pool, name, l)[idx] = 0
    pool.load_cpu_copy(copy, idx)
    got = rec.take()
    assert [x.n for x in got] == [4, 1]
    expect_tuned(got, "scatter", "all", L, nbytes=5 * ROW_BYTES * L * 2)
    for name in pool.components:
        for l in range(L):
            same(dev_layer(pool, name, l), orig[name][l], f"cpu copy round trip {name}{l}")


class SGLangWorld:
    """SGLang-style buffers: per-layer device tensors (N, H, D) per component (separate
    allocations), a layer_first host (L, M, H, D) and a page_first host (M, L, H, D)."""

    M = 12   # host slots

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.dev = {c: [rand((N, H, D), g) for _ in range(L)] for c in "kv"}
        self.lf = {c: rand((L, self.M, H, D), g) for c in "kv"}
        self.pf = {c: rand((self.M, L, H, D), g) for c in "kv"}


def table(layers):
    return torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)


def run_sglang_per_layer(rec):
    w = SGLangWorld(3)
    si, di = slots(9, 2, 11), slots(5, 0, 3)
    want = {c: [t.clone() for t in w.dev[c]] for c in "kv"}
    adapters.transfer_kv_per_layer(w.lf["k"][1], w.dev["k"][0], w.lf["v"][1], w.dev["v"][0], si, di, ROW_BYTES)
    expect_tuned(rec.take(), "load", "layer", 1, nbytes=3 * ROW_BYTES * 2)
    for c in "kv":
        want[c][0][di] = w.lf[c][1][si]

    adapters.transfer_kv_per_layer_pf_lf(w.pf["k"], w.dev["k"][1], w.pf["v"], w.dev["v"][1], si, di, 1,
                                         ROW_BYTES, ROW_BYTES * L)
    expect_tuned(rec.take(), "load", "layer", 1, nbytes=3 * ROW_BYTES * 2)
    for c in "kv":
        want[c][1][di] = w.pf[c][si, 1]
        for l in range(L):
            same(w.dev[c][l], want[c][l], f"device {c}{l}")


def run_sglang_all_layer(rec, form):
    w = SGLangWorld(4)
    si, di = slots(1, 6, 4, 7), slots(10, 0, 3, 8)
    pack = table if form == "tables" else list
    lf_want, pf_want = {c: w.lf[c].clone() for c in "kv"}, {c: w.pf[c].clone() for c in "kv"}
    adapters.transfer_kv_all_layer(pack(w.dev["k"]), pack(list(w.lf["k"])), pack(w.dev["v"]),
                                   pack(list(w.lf["v"])), si, di, ROW_BYTES, L)
    expect_tuned(rec.take(), "backup", "all", L, nbytes=4 * ROW_BYTES * L * 2)

    adapters.transfer_kv_all_layer_lf_pf(pack(w.dev["k"]), w.pf["k"], pack(w.dev["v"]), w.pf["v"], si, di,
                                         ROW_BYTES, ROW_BYTES * L, L)
    expect_tuned(rec.take(), "backup", "all", L, nbytes=4 * ROW_BYTES * L * 2)
    for c in "kv":
        for l in range(L):
            lf_want[c][l][di] = w.dev[c][l][si]
            pf_want[c][di, l] = w.dev[c][l][si]
        same(w.lf[c], lf_want[c], f"lf host {c}")
        same(w.pf[c], pf_want[c], f"pf host {c}")


class AscendWorld:
    """Ascend-style K and V: device (2, L, PAGES, P, H, D), host (2, 3, L, P, H, D)."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.dev = rand((2, L, PAGES, P, H, D), g)
        self.host = rand((2, 3, L, P, H, D), g)
        self.di, self.hi = slots(4, 5, 6, 7), slots(8, 9, 10, 11)    # device page 1, host page 2

    def call(self, fn, direction, *extra, **kw):
        fn(self.di, self.hi, self.dev[0], self.host[0], self.dev[1], self.host[1], *extra,
           page_size=P, direction=direction, **kw)


def run_ascend(rec, direction):
    w = AscendWorld(5)
    dev0, host0 = w.dev.clone(), w.host.clone()
    w.call(adapters.transfer_kv_dim_exchange, direction)
    op = "load" if direction == 1 else "backup"
    expect_tuned(rec.take(), op, "all", L, nbytes=P * ROW_BYTES * L * 2)
    if direction == 1:
        want = dev0.clone()
        want[:, :, 1] = host0[:, 2]
        same(w.dev, want, "device after H2D")
        same(w.host, host0, "host after H2D")
    else:
        want = host0.clone()
        want[:, 2] = dev0[:, :, 1]
        same(w.host, want, "host after D2H")
        same(w.dev, dev0, "device after D2H")


# ------------------------------------------------------------------ the cases
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("strategy", ["kernel", "dma"])
def test_host_pool_transfers_use_tuned_configs(tuned, rec, strategy, layout):
    """backup_from_device_all_layer, load_to_device_all_layer, load_to_device_per_layer;
    with "dma" the staging gather's (scatter's) launches carry the gather (scatter) tuned config."""
    run_host(rec, strategy, layout)


def test_host_pool_layers_storage(tuned, rec):
    run_host(rec, "kernel", "page_first", storage="layers")


def test_host_pool_auto_takes_the_tuned_strategy(tmp_cache, rec):
    """strategy="auto" follows the tuned config's strategy field: dma for backup here."""
    store_tuned(strategy={"backup": "dma"})
    pool = device_pool()
    host = HostPool(pool, layout="layer_first", size_tokens=N, strategy="auto")
    orig = snapshot(pool)
    host.backup_from_device_all_layer(pool, slots(0, 1, 2, 3), slots(4, 5, 6, 7))
    expect_host(rec.take(), "backup", "all", L, "dma", None)
    host.load_to_device_all_layer(pool, slots(0, 1, 2, 3), slots(0, 1, 2, 3))
    expect_tuned(rec.take(), "load", "all", L, strategy="kernel")
    for name in pool.components:
        for l in range(L):
            same(dev_layer(pool, name, l)[:P], orig[name][l][P:], f"round trip {name}{l}")


@pytest.mark.parametrize("storage", ["stacked", "layers"])
def test_device_pool_gather_scatter_use_tuned_configs(tuned, rec, storage):
    run_gather_scatter(rec, storage)


def test_device_pool_cpu_copies_use_tuned_configs(tuned, rec):
    run_cpu_copy(rec)


def test_sglang_per_layer_calls_use_tuned_configs(tuned, rec):
    """transfer_kv_per_layer (lf -> lf) and transfer_kv_per_layer_pf_lf: loads of one layer."""
    run_sglang_per_layer(rec)


@pytest.mark.parametrize("form", ["tables", "lists"])
def test_sglang_all_layer_calls_use_tuned_configs(tuned, rec, form):
    """transfer_kv_all_layer and transfer_kv_all_layer_lf_pf with pointer tables or
    per-layer tensor lists: backups of every layer."""
    run_sglang_all_layer(rec, form)


@pytest.mark.parametrize("direction", [1, 2], ids=["H2D", "D2H"])
def test_ascend_dim_exchange_uses_tuned_configs(tuned, rec, direction):
    run_ascend(rec, direction)


def test_ascend_per_layer_dim_exchange_uses_tuned_config(tuned, rec):
    """The per-layer Ascend call looks up the one-layer load key (the scope of its log
    line is the next test's concern)."""
    w = AscendWorld(6)
    dev0, host0 = w.dev.clone(), w.host.clone()
    w.call(adapters.transfer_kv_per_layer_dim_exchange, 1, 1)
    expect_tuned(rec.take(), "load", None, 1, nbytes=P * ROW_BYTES * 2)
    want = dev0.clone()
    want[:, 1, 1] = host0[:, 2, 1]
    same(w.dev, want, "device after the per-layer H2D")


def test_ascend_per_layer_dim_exchange_logs_layer_scope(tuned, rec):
    w = AscendWorld(7)
    w.call(adapters.transfer_kv_per_layer_dim_exchange, 1, 1)
    got = rec.take()
    assert got and all(x.scope == "layer" for x in got), [x.scope for x in got]


def test_block_quota_replaces_only_the_program_count(tuned, rec):
    """An engine's block_quota caps the programs; the rest of the tuned config stays."""
    w = SGLangWorld(8)
    adapters.transfer_kv_per_layer(w.lf["k"][0], w.dev["k"][0], w.lf["v"][0], w.dev["v"][0],
                                   slots(1, 2), slots(3, 4), ROW_BYTES, block_quota=2)
    expect_tuned(rec.take(), "load", "layer", 1, config=replace(tuned_config("load", 1), num_programs=2))


SCENARIOS = {
    "host_kernel": lambda rec: run_host(rec, "kernel", "layer_first"),
    "host_dma": lambda rec: run_host(rec, "dma", "layer_first"),
    "gather_scatter": run_gather_scatter,
    "cpu_copy": run_cpu_copy,
    "sglang_per_layer": run_sglang_per_layer,
    "sglang_all_layer": lambda rec: run_sglang_all_layer(rec, "tables"),
    "ascend": lambda rec: run_ascend(rec, 1),
}


@pytest.mark.parametrize("without", ["select_config_patched", "empty_cache"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_checks_fail_without_the_tuned_lookup(tmp_cache, rec, monkeypatch, scenario, without):
    """The checks above depend on the lookup: with select_config answering the shipped
    default (or with nothing tuned), the first launch of every scenario fails them."""
    if without == "select_config_patched":
        store_tuned()
        monkeypatch.setattr(select, "select_config",
                            lambda op, platform, **kw: default_config(platform, crosses_link=kw["crosses_link"]))
    with pytest.raises(AssertionError, match="not the tuned config"):
        SCENARIOS[scenario](rec)
