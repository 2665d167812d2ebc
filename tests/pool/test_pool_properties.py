"""Property tests (hypothesis) of the pool constructors and HostPool transfers.

Constructors get random arguments, each drawn from a set of valid values or, for one or
two arguments, from a set of invalid ones: an invalid call raises `KvtierError` and
nothing else (never TypeError, ZeroDivisionError, AttributeError, ...) before anything is
allocated; a valid one builds the pool it describes. Transfers get random pools, layouts,
strategies and indices: a valid one moves exactly the bytes plain torch indexing of the
original tensors says, an invalid one raises `KvtierError` and moves nothing.
"""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.kernels import KvtierError, LAYOUTS
from kvtier.platforms import accelerator_present
from kvtier.pool import HostPool, IndexerSpec, MHADevicePool, MLADevicePool
from pool_support import (DeviceCase, HostCase, assert_same, dev_rows, host_rows, moved_dev_rows,
                          pages_to_slots, put_host_rows)

SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

JUNK = [None, True, False, 2.5, "4", [], math.nan, object()]     # never a count


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, shape, dtype, pin=None):
        self.calls += 1
        return torch.zeros(shape, dtype=dtype)


# ---------------------------------------------------------------------- device pool constructors
def _args(draw, valid, invalid):
    """Valid arguments, with one or two replaced by invalid values; (kwargs, bad names)."""
    args = {name: draw(s) for name, s in valid.items()}
    bad = draw(st.lists(st.sampled_from(sorted(invalid)), max_size=2, unique=True)
               | st.just([]) | st.just([]))
    for name in bad:
        args[name] = draw(invalid[name](args))
    return args, bad


COUNT_BAD = st.sampled_from([0, -1, -8] + JUNK)


@st.composite
def device_pool_calls(draw):
    mla = draw(st.booleans())
    page_size = draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(1, 3))
    common = {
        "size": st.integers(1, 4).map(lambda p: p * page_size),
        "page_size": st.just(page_size),
        "num_layers": st.just(layers),
        "dtype": st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.uint8]),
        "storage": st.sampled_from(["layers", "stacked"]),
        "start_layer": st.integers(0, 3),
        "device": st.sampled_from(["cpu", torch.device("cpu")]),
        "indexer": st.none() | st.builds(IndexerSpec, st.integers(1, layers), st.integers(1, 8),
                                         st.integers(1, 2)),
    }
    invalid = {
        "size": lambda a: COUNT_BAD | (st.just(a["page_size"] + 1) if is_int_(a["page_size"])
                                       and a["page_size"] > 1 else COUNT_BAD),
        "page_size": lambda a: COUNT_BAD,
        "num_layers": lambda a: COUNT_BAD,
        "dtype": lambda a: st.sampled_from(["bfloat16", "float16", None, 2, torch.Tensor]),
        "storage": lambda a: st.sampled_from(["rows", "", None, 1, ["layers"]]),
        "start_layer": lambda a: st.sampled_from([-1, True, 1.0, "0", None]),
        "device": lambda a: st.sampled_from(["gpu", "cpu:x", 1.5, None, True, ["cpu"]]),
        "indexer": lambda a: st.sampled_from(["dsa", 1, IndexerSpec(a["num_layers"] + 1)]
                                             if is_int_(a["num_layers"]) else ["dsa", 1]),
    }
    if mla:
        valid = {**common, "kv_lora_rank": st.integers(1, 12), "qk_rope_head_dim": st.integers(1, 4),
                 "split": st.booleans()}
        invalid.update({"kv_lora_rank": lambda a: COUNT_BAD, "qk_rope_head_dim": lambda a: COUNT_BAD,
                        "split": lambda a: st.sampled_from(["yes", None, 1, 0])})
    else:
        valid = {**common, "head_num": st.integers(1, 3), "head_dim": st.integers(1, 8),
                 "v_head_dim": st.none() | st.integers(1, 8)}
        invalid.update({"head_num": lambda a: COUNT_BAD, "head_dim": lambda a: COUNT_BAD,
                        "v_head_dim": lambda a: st.sampled_from([0, -1, True, 2.5, "8", math.inf])})
    args, bad = _args(draw, valid, invalid)
    return mla, args, bad


def is_int_(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _construct(mla, args, factory):
    a = dict(args)
    pos = [a.pop(n) for n in (("size", "page_size", "num_layers", "kv_lora_rank", "qk_rope_head_dim") if mla
                              else ("size", "page_size", "num_layers", "head_num", "head_dim"))]
    return (MLADevicePool if mla else MHADevicePool)(*pos, factory=factory, **a)


@settings(max_examples=300, **SETTINGS)
@given(device_pool_calls())
def test_device_pool_constructor_valid_builds_invalid_raises_kvtier_error(call):
    mla, args, bad = call
    factory = Counting()
    if bad:
        with pytest.raises(KvtierError) as info:
            _construct(mla, args, factory)
        assert factory.calls == 0, f"allocated before refusing: {info.value}"
        assert any(name in str(info.value) for name in bad), (bad, str(info.value))
        return
    pool = _construct(mla, args, factory)
    assert factory.calls > 0
    assert (pool.size, pool.page_size, pool.num_layers) == (args["size"], args["page_size"], args["num_layers"])
    assert pool.start_layer == args["start_layer"] and pool.storage == args["storage"]
    if mla:
        want = ({"latent": (1, args["kv_lora_rank"]), "rope": (1, args["qk_rope_head_dim"])} if args["split"]
                else {"kv": (1, args["kv_lora_rank"] + args["qk_rope_head_dim"])})
    else:
        vd = args["v_head_dim"] if args["v_head_dim"] is not None else args["head_dim"]
        want = {"k": (args["head_num"], args["head_dim"]), "v": (args["head_num"], vd)}
    if args["indexer"] is not None:
        want.update(index_k=(args["indexer"].index_head_dim,), index_scale=(args["indexer"].scale_dim,))
    assert {n: c.row_shape for n, c in pool.components.items()} == want


# ---------------------------------------------------------------------- HostPool constructor
def _dev_pool():
    return MHADevicePool(16, 4, 2, 2, 8, dtype=torch.float16)


BYTES_PER_TOKEN = 2 * 2 * (2 * 8 * 2)         # K+V x 2 layers x 32-byte rows


@st.composite
def host_pool_calls(draw):
    valid = {
        "layout": st.sampled_from(LAYOUTS),
        "strategy": st.sampled_from(["auto", "kernel", "dma"]),
        "size": st.integers(4, 40).flatmap(lambda t: st.sampled_from([
            {"size_tokens": t}, {"size_gb": t * BYTES_PER_TOKEN / 1e9}])),
        "pin_memory": st.sampled_from([None, False] + ([True] if accelerator_present() else [])),
        "check": st.sampled_from([None, True, False]),
        "register": st.booleans(),
    }
    invalid = {
        "layout": lambda a: st.sampled_from(["bad", "", None, 3, ["layer_first"], b"layer_first"]),
        "strategy": lambda a: st.sampled_from(["fast", None, 1, ("kernel",)]),
        "size": lambda a: st.sampled_from(
            [{"size_tokens": v} for v in (0, 3, -4, True, 16.0, "16", math.nan)]
            + [{"size_gb": v} for v in (0, -1.0, math.nan, math.inf, True, "1", 1e-12, None, [1])]
            + [{}, {"size_tokens": 16, "size_gb": 1.0}]),
        "pin_memory": lambda a: st.sampled_from(["yes", 1, 0, "False"]
                                                + ([] if accelerator_present() else [True])),
        "check": lambda a: st.sampled_from(["on", 1, 0]),
        "register": lambda a: st.sampled_from([None, 1, "yes"]),
        "device_pools": lambda a: st.sampled_from([None, [], 3, "pool", [None]]),
    }
    args, bad = _args(draw, {**valid, "device_pools": st.just("ok")}, invalid)
    return args, bad


@settings(max_examples=300, **SETTINGS)
@given(host_pool_calls())
def test_host_pool_constructor_valid_builds_invalid_raises_kvtier_error(call):
    args, bad = call
    dev = _dev_pool()
    pools = dev if args["device_pools"] == "ok" else args["device_pools"]
    factory = Counting()
    kw = {k: args[k] for k in ("layout", "strategy", "pin_memory", "check", "register")}
    if bad:
        with pytest.raises(KvtierError) as info:
            HostPool(pools, factory=factory, **kw, **args["size"])
        assert factory.calls == 0, f"allocated before refusing: {info.value}"
        names = {"size": ("size_tokens", "size_gb")}
        assert any(n in str(info.value) for b in bad for n in names.get(b, (b,))), (bad, str(info.value))
        return
    host = HostPool(pools, factory=factory, **kw, **args["size"])
    tokens = args["size"].get("size_tokens")
    if tokens is None:
        tokens = int(args["size"]["size_gb"] * 1e9) // BYTES_PER_TOKEN
    assert host.size == tokens // 4 * 4 and factory.calls == 1        # K and V share one buffer
    assert host.available_size() == host.size


# ---------------------------------------------------------------------- HostPool transfers
KINDS = ("mha", "mha_v_indexer", "mla", "mla_split_indexer")
PAGED = ("page_first_direct", "page_head")


@st.composite
def transfers(draw):
    P = draw(st.sampled_from([1, 2, 4]))
    dev_pages, host_pages = draw(st.integers(2, 6)), draw(st.integers(2, 6))
    n = draw(st.integers(0, min(dev_pages, host_pages)))
    case = {
        "kind": draw(st.sampled_from(KINDS)),
        "storage": draw(st.sampled_from(["layers", "stacked"])),
        "layout": draw(st.sampled_from(LAYOUTS)),
        "strategy": draw(st.sampled_from(["kernel", "dma", "auto"])),
        "P": P, "dev_pages": dev_pages, "host_pages": host_pages,
        "layers": draw(st.integers(1, 3)),
        "start_layer": draw(st.integers(0, 2)),
        "hpages": draw(st.permutations(range(host_pages)))[:n],
        "dpages": draw(st.permutations(range(dev_pages)))[:n],
        "op": draw(st.sampled_from(["backup", "load", "load_layer"])),
        "dtype32": draw(st.booleans()),
    }
    case["layer"] = draw(st.integers(0, case["layers"] - 1))
    bad = draw(st.sampled_from([None, None, None, "host_range", "host_negative", "dev_range", "count",
                                "host_float", "host_list", "dev_2d", "misaligned", "layer", "layer_bool",
                                "pool", "host_on_meta"]))
    case["bad"] = bad
    return case


def _corrupt(case, dev, hc, hidx, didx):
    """(host_pool, device_pool, host_indices, device_indices, layer_id) with the bad argument."""
    bad, h, pool = case["bad"], hc.host, dev.pool
    layer = pool.start_layer + case["layer"]
    if bad is None:
        return pool, hidx, didx, layer
    one = torch.tensor([0], dtype=hidx.dtype)
    h1 = torch.cat([hidx, one]) if hidx.numel() else pages_to_slots([0], case["P"]).to(hidx.dtype)
    d1 = torch.cat([didx, one]) if didx.numel() else pages_to_slots([0], case["P"]).to(didx.dtype)
    if bad == "host_range":
        return pool, torch.cat([hidx, pages_to_slots([case["host_pages"]], case["P"]).to(hidx.dtype)]), \
            torch.cat([didx, pages_to_slots([0], case["P"]).to(didx.dtype)]), layer
    if bad == "host_negative":
        h = pages_to_slots([0], case["P"]).to(hidx.dtype) - case["P"]
        return pool, torch.cat([hidx, h]), torch.cat([didx, pages_to_slots([0], case["P"]).to(didx.dtype)]), layer
    if bad == "dev_range":
        return pool, torch.cat([hidx, pages_to_slots([0], case["P"]).to(hidx.dtype)]), \
            torch.cat([didx, pages_to_slots([case["dev_pages"]], case["P"]).to(didx.dtype)]), layer
    if bad == "count":
        return pool, h1, didx, layer
    if bad == "host_float":
        return pool, h1.float(), d1, layer
    if bad == "host_list":
        return pool, h1.tolist(), d1, layer
    if bad == "dev_2d":
        return pool, h1, d1.view(1, -1), layer
    if bad == "misaligned":
        if case["layout"] in PAGED and case["P"] > 1:
            return pool, torch.cat([hidx, torch.arange(1, 1 + case["P"], dtype=hidx.dtype)]), \
                torch.cat([didx, pages_to_slots([0], case["P"]).to(didx.dtype)]), layer
        return pool, h1, d1.double(), layer
    if bad == "layer":
        return pool, hidx, didx, pool.end_layer if case["op"] == "load_layer" else None
    if bad == "layer_bool":
        return pool, hidx, didx, True if case["op"] == "load_layer" else None
    if bad == "pool":
        return "pool", hidx, didx, layer
    if bad == "host_on_meta":
        return pool, h1.to("meta"), d1, layer
    raise AssertionError(bad)


def _run(op, h, pool, hidx, didx, layer):
    if op == "backup":
        h.backup_from_device_all_layer(pool, hidx, didx)
    elif op == "load":
        h.load_to_device_all_layer(pool, hidx, didx)
    else:
        h.load_to_device_per_layer(pool, hidx, didx, layer)


@settings(max_examples=150, **SETTINGS)
@given(transfers())
def test_host_pool_transfers_move_exactly_the_right_bytes(case):
    P = case["P"]
    gen = torch.Generator().manual_seed(len(case["hpages"]) * 7 + P)
    dev = DeviceCase(case["kind"], case["storage"], P, layers=case["layers"], size=case["dev_pages"] * P,
                     start_layer=case["start_layer"], gen=gen)
    hc = HostCase(dev.pool, case["layout"], case["strategy"], size_tokens=case["host_pages"] * P)
    h = hc.host
    idt = torch.int32 if case["dtype32"] else torch.int64
    hidx = pages_to_slots(list(case["hpages"]), P).to(idt)
    didx = pages_to_slots(list(case["dpages"]), P).to(idt)
    # Put distinct bytes in the host rows first, so that a load moves something visible.
    for name, buf in h.buffers.items():
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8,
                                                  generator=gen))
    hbefore, dbefore = hc.snapshot(), dev.snapshot()
    pool, hi, di, layer = _corrupt(case, dev, hc, hidx, didx)
    if case["bad"] is not None and not (case["bad"] in ("layer", "layer_bool") and case["op"] != "load_layer"):
        with pytest.raises(KvtierError):
            _run(case["op"], h, pool, hi, di, layer)
        h.synchronize()
        assert_same(h.buffers, hbefore, f"host after a refused {case['op']} ({case['bad']})")
        assert_same(dev.model, dbefore, f"device after a refused {case['op']} ({case['bad']})")
    # The good call (also right after a refused one) moves exactly the right bytes.
    _run(case["op"], h, dev.pool, hidx, didx, dev.pool.start_layer + case["layer"])
    h.synchronize()
    hidx64, didx64 = hidx.long(), didx.long()
    if case["op"] == "backup":
        want = {n: b.clone() for n, b in hbefore.items()}
        for name, layers in dev.model.items():
            for l, t in enumerate(layers):
                put_host_rows(want[name], case["layout"], l, P, hidx64, dev_rows(t, didx64))
        assert_same(h.buffers, want, "host after backup")
        assert_same(dev.model, dbefore, "device after backup")
    else:
        only = None if case["op"] == "load" else {case["layer"]}
        every_slot = torch.arange(h.size)
        host_model = {name: [host_rows(hbefore[name], case["layout"], l, P, every_slot)
                             for l in range(len(layers))] for name, layers in dev.model.items()}
        assert_same(dev.model, moved_dev_rows(dbefore, host_model, hidx64, didx64, layers=only),
                    f"device after {case['op']}")
        assert_same(h.buffers, hbefore, f"host after {case['op']}")
    dev.check_margins()
    hc.check_margins()
