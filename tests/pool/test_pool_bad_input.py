"""Every bad input to the pool classes: a `KvtierError` naming the argument and the value,
raised before anything is allocated or moved (the destination and the pool buffers are
unchanged), and a good call afterwards works."""
import math
import re

import pytest
import torch

from kvtier.kernels import KvtierError
from kvtier.platforms import accelerator_present
from kvtier.pool import (CpuCopy, DevicePool, HostPool, IndexerSpec, MHADevicePool, MLADevicePool,
                         TransferLayout)
from pool_support import DeviceCase, assert_same, dev_rows, moved_dev_rows

F16 = torch.float16


def raises(match_arg, value, call):
    """``call()`` raises KvtierError whose message names ``match_arg=value``."""
    with pytest.raises(KvtierError) as info:
        call()
    msg = str(info.value)
    assert f"{match_arg}={value!r}" in msg, msg
    return msg


class Counting:
    """A factory that counts the allocations asked of it (a refused constructor makes none)."""

    def __init__(self, host=False):
        self.calls, self.host = 0, host

    def __call__(self, shape, dtype, pin=None):
        self.calls += 1
        return torch.zeros(shape, dtype=dtype)


# ---------------------------------------------------------------------- HostPool constructor
def _dev():
    d = MHADevicePool(16, 4, 2, 2, 8, dtype=F16)
    for t in d.buffers["k"] + d.buffers["v"]:
        t.copy_(torch.randn_like(t))
    return d


HOST_BAD = [
    ("device_pools", None, lambda d, kw: HostPool(None, size_tokens=16, **kw)),
    ("device_pools", 3, lambda d, kw: HostPool(3, size_tokens=16, **kw)),
    ("device_pools", [], lambda d, kw: HostPool([], size_tokens=16, **kw)),
    ("pin_memory", "yes", lambda d, kw: HostPool(d, size_tokens=16, pin_memory="yes", **kw)),
    ("pin_memory", 1, lambda d, kw: HostPool(d, size_tokens=16, pin_memory=1, **kw)),
    ("size_gb", math.inf, lambda d, kw: HostPool(d, size_gb=math.inf, **kw)),
    ("size_gb", -math.inf, lambda d, kw: HostPool(d, size_gb=-math.inf, **kw)),
    ("size_gb", True, lambda d, kw: HostPool(d, size_gb=True, **kw)),
    ("size_gb", 1e-9, lambda d, kw: HostPool(d, size_gb=1e-9, **kw)),     # < one page: names size_gb
    ("size_gb", "1", lambda d, kw: HostPool(d, size_gb="1", **kw)),
    ("size_gb", 0, lambda d, kw: HostPool(d, size_gb=0, **kw)),
    ("size_gb", 1e15, lambda d, kw: HostPool(d, size_gb=1e15, **kw)),           # more than this machine has
    ("size_tokens", 10 ** 15, lambda d, kw: HostPool(d, size_tokens=10 ** 15, **kw)),
    ("size_tokens", True, lambda d, kw: HostPool(d, size_tokens=True, **kw)),
    ("size_tokens", 16.0, lambda d, kw: HostPool(d, size_tokens=16.0, **kw)),
    ("size_tokens", 3, lambda d, kw: HostPool(d, size_tokens=3, **kw)),
    ("layout", 3, lambda d, kw: HostPool(d, size_tokens=16, layout=3, **kw)),
    ("layout", None, lambda d, kw: HostPool(d, size_tokens=16, layout=None, **kw)),
    ("layout", ["layer_first"], lambda d, kw: HostPool(d, size_tokens=16, layout=["layer_first"], **kw)),
    ("strategy", 3, lambda d, kw: HostPool(d, size_tokens=16, strategy=3, **kw)),
    ("strategy", None, lambda d, kw: HostPool(d, size_tokens=16, strategy=None, **kw)),
    ("strategy", ("kernel",), lambda d, kw: HostPool(d, size_tokens=16, strategy=("kernel",), **kw)),
    ("check", "on", lambda d, kw: HostPool(d, size_tokens=16, check="on", **kw)),
    ("register", None, lambda d, kw: HostPool(d, size_tokens=16, register=None, **kw)),
]


@pytest.mark.parametrize("arg,value,call", HOST_BAD, ids=[f"{a}={v!r}" for a, v, _ in HOST_BAD])
def test_host_pool_constructor_names_the_argument(arg, value, call):
    dev = _dev()
    before = {n: [t.clone() for t in ts] for n, ts in dev.buffers.items()}
    factory = Counting(host=True)
    msg = raises(arg, value, lambda: call(dev, {"factory": factory}))
    assert factory.calls == 0, f"allocated before refusing: {msg}"
    assert_same(dev.buffers, before, "device pool")
    if arg == "size_gb":
        assert "size_tokens" not in msg       # the caller never passed it
    host = HostPool(dev, size_tokens=16, factory=factory)          # a good call works
    assert factory.calls == 1 and host.size == 16


def test_an_allocation_the_allocator_refuses_names_the_size_argument():
    def refusing(shape, dtype, pin):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB\nmore")
    with pytest.raises(KvtierError, match=r"size_gb=0.01: allocating .* host memory failed: DefaultCPUAllocator"):
        HostPool(_dev(), size_gb=0.01, factory=refusing)


def test_host_pool_nan_size_and_both_sizes():
    dev = _dev()
    with pytest.raises(KvtierError, match=r"size_gb=nan"):
        HostPool(dev, size_gb=math.nan)
    with pytest.raises(KvtierError, match=r"size_tokens, size_gb=\(16, 1.0\)"):
        HostPool(dev, size_tokens=16, size_gb=1.0)
    with pytest.raises(KvtierError, match=r"size_tokens, size_gb=\(None, None\)"):
        HostPool(dev)


def test_host_pool_pool_listed_twice_is_refused():
    dev = _dev()
    with pytest.raises(KvtierError, match=r"device_pools\[1\]=.*listed twice"):
        HostPool([dev, dev], size_tokens=16)


@pytest.mark.skipif(accelerator_present(), reason="pinning works where an accelerator is present")
def test_pin_memory_without_an_accelerator_is_refused_before_allocation():
    dev = _dev()
    raises("pin_memory", True, lambda: HostPool(dev, size_tokens=16, pin_memory=True))
    # With a factory the caller supplies the memory: pin is only passed on to it.
    seen = []
    HostPool(dev, size_tokens=16, pin_memory=True,
             factory=lambda shape, dtype, pin: seen.append(pin) or torch.zeros(shape, dtype=dtype))
    assert seen == [True]


def test_good_size_gb_still_rounds_down_to_pages():
    dev = _dev()
    per_token = dev.num_layers * 2 * 2 * 8 * 2
    host = HostPool(dev, size_gb=per_token * 9 / 1e9)                 # 9 tokens -> 2 pages
    assert host.size == 8
    host = HostPool(dev, size_gb=1)                                    # an int is a number of GB
    assert host.size == int(1e9) // per_token // 4 * 4


# ---------------------------------------------------------------------- device pools
def _mha(factory, **kw):
    args = dict(size=16, page_size=4, num_layers=2, head_num=2, head_dim=8)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    return MHADevicePool(args["size"], args["page_size"], args["num_layers"], args["head_num"],
                         args["head_dim"], dtype=kw.pop("dtype", F16), factory=factory, **kw)


def _mla(factory, **kw):
    args = dict(size=16, page_size=4, num_layers=2, kv_lora_rank=12, qk_rope_head_dim=4)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    return MLADevicePool(args["size"], args["page_size"], args["num_layers"], args["kv_lora_rank"],
                         args["qk_rope_head_dim"], dtype=kw.pop("dtype", F16), factory=factory, **kw)


DEVICE_BAD = [
    (_mha, "page_size", 0, {}),
    (_mha, "page_size", True, {}),
    (_mha, "page_size", -4, {}),
    (_mha, "size", True, {}),
    (_mha, "size", 0, {}),
    (_mha, "size", 10, {}),                  # not whole pages
    (_mha, "num_layers", True, {}),
    (_mha, "num_layers", 2.0, {}),
    (_mha, "head_num", False, {}),
    (_mha, "head_dim", 0, {}),
    (_mha, "dtype", "bfloat16", {}),
    (_mha, "dtype", None, {}),
    (_mha, "v_head_dim", -1, {}),
    (_mha, "v_head_dim", 0, {}),
    (_mha, "v_head_dim", True, {}),
    (_mha, "start_layer", True, {}),
    (_mha, "start_layer", -1, {}),
    (_mha, "storage", 3, {}),
    (_mha, "storage", "rows", {}),
    (_mha, "device", "gpu0", {}),
    (_mha, "device", 1.5, {}),
    (_mha, "indexer", "dsa", {}),
    (_mha, "indexer.num_layers", 3, {}),          # more than the pool's 2 layers
    (_mla, "page_size", 0, {}),
    (_mla, "num_layers", True, {}),
    (_mla, "kv_lora_rank", 0, {}),
    (_mla, "qk_rope_head_dim", -1, {}),
    (_mla, "dtype", "bfloat16", {}),
    (_mla, "split", "yes", {}),
    (_mla, "split", None, {}),
    (_mla, "indexer", 1, {}),
]


@pytest.mark.parametrize("make,arg,value,extra", DEVICE_BAD,
                         ids=[f"{m.__name__[1:]}-{a}={v!r}" for m, a, v, _ in DEVICE_BAD])
def test_device_pool_constructor_names_the_argument(make, arg, value, extra):
    factory = Counting()
    kw = dict(extra)
    if arg == "indexer.num_layers":
        kw["indexer"] = IndexerSpec(value, 16)
    else:
        kw[arg] = value
    msg = raises(arg, value, lambda: make(factory, **kw))
    assert factory.calls == 0, f"allocated before refusing: {msg}"
    pool = make(factory)                                                # a good call works
    assert factory.calls > 0 and pool.size == 16


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("num_layers", True), ("index_head_dim", 0),
                                         ("scale_dim", -1), ("dtype", "uint8")])
def test_indexer_spec_names_its_own_field(field, value):
    kw = {"num_layers": 1, field: value}
    # The indexer's field is named, not another argument (it once said "layers='list'").
    for make in (_mha, _mla):
        factory = Counting()
        raises(f"indexer.{field}", value, lambda: make(factory, indexer=IndexerSpec(**kw)))
        assert factory.calls == 0
    assert _mha(None, indexer=IndexerSpec(1, 16)).components["index_k"].num_layers == 1


def test_v_head_dim_none_is_head_dim_and_a_value_is_kept():
    assert _mha(None).components["v"].row_shape == (2, 8)
    assert _mha(None, v_head_dim=4).components["v"].row_shape == (2, 4)


def test_factory_must_return_the_asked_tensor():
    with pytest.raises(KvtierError, match=r"factory=\(\(4, 4, 2, 8\), torch.float32\)"):
        _mha(lambda shape, dtype: torch.zeros(shape))
    with pytest.raises(KvtierError, match="factory='list'"):
        _mha(lambda shape, dtype: [])
    with pytest.raises(KvtierError, match="factory=3"):
        _mha(3)


def _layers(n, rows=16, row=(2, 8)):
    return [torch.randn(rows, *row).to(F16) for _ in range(n)]


ADOPT_BAD = [
    ("v_layers", "'3 layers'", lambda: MHADevicePool.from_layers(_layers(2), _layers(3), 4)),
    ("v_layers", "'1 layers'", lambda: MHADevicePool.from_layers(_layers(2), _layers(1), 4)),
    ("k_layers", "'NoneType'", lambda: MHADevicePool.from_layers(None, _layers(2), 4)),
    ("k_layers", "[]", lambda: MHADevicePool.from_layers([], [], 4)),
    ("v_layers[1]", "'str'", lambda: MHADevicePool.from_layers(_layers(2), [_layers(1)[0], "x"], 4)),
    ("k_layers", "'Tensor'", lambda: MHADevicePool.from_layers(torch.zeros(2, 16, 2, 8), _layers(2), 4)),
    ("v", "(3, 16, 2, 8)", lambda: MHADevicePool.from_stacked(torch.zeros(2, 16, 2, 8),
                                                             torch.zeros(3, 16, 2, 8), 4)),
    ("v", "'NoneType'", lambda: MHADevicePool.from_stacked(torch.zeros(2, 16, 2, 8), None, 4)),
    ("page_size", "0", lambda: MHADevicePool.from_layers(_layers(2), _layers(2), 0)),
    ("page_size", "True", lambda: MHADevicePool.from_layers(_layers(2), _layers(2), True)),
    ("start_layer", "True", lambda: MHADevicePool.from_layers(_layers(2), _layers(2), 4, start_layer=True)),
    ("paged_dims", "'no'", lambda: MHADevicePool.from_layers(_layers(2), _layers(2), 4, paged_dims="no")),
    ("indexer_buffers", "['k']", lambda: MHADevicePool.from_layers(_layers(2), _layers(2), 4,
                                                                   indexer_buffers={"k": _layers(2)})),
    ("indexer_buffers['index_k']", "'3 layers'", lambda: MHADevicePool.from_layers(
        _layers(2), _layers(2), 4, indexer_buffers={"index_k": _layers(3, row=(16,)),
                                                    "index_scale": _layers(3, row=(1,))})),
    ("indexer_buffers['index_scale']", "'1 layers'", lambda: MHADevicePool.from_layers(
        _layers(2), _layers(2), 4, indexer_buffers={"index_k": _layers(2, row=(16,)),
                                                    "index_scale": _layers(1, row=(1,))})),
    ("rope_layers", "'3 layers'", lambda: MLADevicePool.from_layers(_layers(2, row=(1, 12)), 4,
                                                                    rope_layers=_layers(3, row=(1, 4)))),
    ("rope", "(1, 16, 1, 4)", lambda: MLADevicePool.from_stacked(torch.zeros(2, 16, 1, 12), 4,
                                                                 rope=torch.zeros(1, 16, 1, 4))),
    ("kv_layers", "'int'", lambda: MLADevicePool.from_layers(3, 4)),
    ("buffers", "'list'", lambda: DevicePool([torch.zeros(2, 16, 2, 8)], 4)),
    ("buffers", "{}", lambda: DevicePool({}, 4)),
    ("buffers['v']", "'NoneType'", lambda: DevicePool({"k": torch.zeros(2, 16, 2, 8), "v": None}, 4)),
    ("buffers['v']", "'3 layers'", lambda: DevicePool({"k": torch.zeros(2, 16, 2, 8),
                                                       "v": torch.zeros(3, 16, 2, 8)}, 4)),
]


@pytest.mark.parametrize("arg,value,call", ADOPT_BAD, ids=[f"{a}={v}" for a, v, _ in ADOPT_BAD])
def test_adoption_names_the_argument(arg, value, call):
    with pytest.raises(KvtierError) as info:
        call()
    assert str(info.value).startswith(f"{arg}={value}"), str(info.value)
    pool = MHADevicePool.from_layers(_layers(2), _layers(2), 4)        # a good call works
    assert pool.num_layers == 2


def test_adoption_errors_from_the_row_map_name_the_caller_argument():
    k, v = _layers(2), _layers(2)
    v[1] = torch.zeros(16, 2, 4, dtype=F16)
    with pytest.raises(KvtierError, match=r"^v_layers: layers\[1\]="):
        MHADevicePool.from_layers(k, v, 4)
    with pytest.raises(KvtierError, match=r"^rope: "):
        MLADevicePool.from_stacked(torch.zeros(2, 16, 1, 12), 4, rope=torch.zeros(2, 16))


# ---------------------------------------------------------------------- transfer layout
def _layout_pool():
    return MHADevicePool(16, 4, 3, 2, 8, dtype=F16)


GOOD = {"item_bytes": [128, 128], "num_layers": 3, "attn_tp_size": 1, "num_regions": 6}
LAYOUT_BAD = [
    ("remote.item_bytes", None, {**GOOD, "item_bytes": None}),
    ("remote.item_bytes", 128, {**GOOD, "item_bytes": 128}),
    ("remote.item_bytes", "ab", {**GOOD, "item_bytes": "ab"}),
    ("remote.item_bytes", [128.0, 128], {**GOOD, "item_bytes": [128.0, 128]}),
    ("remote.item_bytes", [True, 128], {**GOOD, "item_bytes": [True, 128]}),
    ("remote.item_bytes", None, {f: None for f in GOOD}),           # all-None: the first field
    ("remote.num_layers", 3.0, {**GOOD, "num_layers": 3.0}),
    ("remote.num_layers", "3", {**GOOD, "num_layers": "3"}),
    ("remote.attn_tp_size", True, {**GOOD, "attn_tp_size": True}),
    ("remote.num_regions", None, {**GOOD, "num_regions": None}),
    ("remote", 1, {**GOOD, 1: 2}),                                   # mixed key types
    ("remote", 1, {1: 2, "item_bytes": [128, 128]}),                 # mixed and missing
    ("remote", "extra", {**GOOD, "extra": 0}),
    ("remote", "list", [1, 2]),
    ("attn_tp_size", True, GOOD),
    ("attn_tp_size", 2.0, GOOD),
    ("by_page", "yes", GOOD),
]


@pytest.mark.parametrize("arg,value,remote", LAYOUT_BAD, ids=[f"{a}={v!r}" for a, v, _ in LAYOUT_BAD])
def test_check_transfer_layout_names_the_field(arg, value, remote):
    pool = _layout_pool()
    kw = {"attn_tp_size": value} if arg == "attn_tp_size" else {"by_page": value} if arg == "by_page" else {}
    raises(arg, value, lambda: pool.check_transfer_layout(remote, **kw))
    pool.check_transfer_layout(GOOD)                                      # a good call works
    pool.check_transfer_layout(dict(GOOD, item_bytes=(128, 128)))
    pool.check_transfer_layout(TransferLayout((128, 128), 3, 1, 6))


def test_transfer_layout_refuses_bad_flags():
    pool = _layout_pool()
    raises("attn_tp_size", True, lambda: pool.transfer_layout(attn_tp_size=True))
    raises("by_page", 1, lambda: pool.transfer_layout(by_page=1))
    with pytest.raises(KvtierError, match=r"remote.item_bytes=\(\)"):
        pool.check_transfer_layout(TransferLayout((), 3, 1, 6))


# ---------------------------------------------------------------------- load_cpu_copy
def _bad_chunk(kind, t):
    if kind == "non-contiguous":
        wide = torch.zeros(*t.shape, 2, dtype=t.dtype)
        wide[..., 0] = t
        return wide[..., 0]
    if kind == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    if kind == "dtype":
        return t.to(torch.float64 if t.dtype != torch.float64 else torch.float32)
    if kind == "shape":
        return torch.cat([t, t], dim=-1)
    if kind == "not-a-tensor":
        return t.tolist()
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["non-contiguous", "meta", "dtype", "shape", "not-a-tensor"])
@pytest.mark.parametrize("storage", ["layers", "stacked"])
def test_load_cpu_copy_checks_every_chunk_before_any_byte_moves(kind, storage):
    dev = DeviceCase("mha_v_indexer", storage, 4, size=24)
    src = torch.tensor([3, 17, 4, 5, 22, 0, 9])
    dst = torch.tensor([1, 2, 6, 7, 8, 11, 12])
    copy = dev.pool.get_cpu_copy(src, chunk_size=3)                 # chunks of 3, 3, 1
    assert len(copy.chunks) == 3 and len(copy.chunks[0]) == len(dev.pool.groups) > 1
    before = dev.snapshot()
    k, g = 2, len(dev.pool.groups) - 1                              # the last tensor of the last chunk
    good = copy.chunks[k][g]
    bad = _bad_chunk(kind, good)
    copy.chunks[k][g] = bad
    with pytest.raises(KvtierError) as info:
        dev.pool.load_cpu_copy(copy, dst)
    msg = str(info.value)
    assert msg.startswith(f"copy.chunks[{k}][{g}]="), msg
    if isinstance(bad, torch.Tensor):
        assert repr(tuple(bad.shape)) in msg and str(bad.dtype) in msg, msg
    assert_same(dev.model, before, f"device after a refused load ({kind})")
    copy.chunks[k][g] = good                                         # a good call works
    dev.pool.load_cpu_copy(copy, dst)
    assert_same(dev.model, moved_dev_rows(before, before, src, dst), "device after load_cpu_copy")
    dev.check_margins()


def test_load_cpu_copy_refuses_malformed_copies():
    dev = DeviceCase("mla", "layers", 4, size=24)
    idx = torch.tensor([1, 2, 3])
    copy = dev.pool.get_cpu_copy(idx, chunk_size=2)
    before = dev.snapshot()
    cases = [
        ("copy.chunks[1]", CpuCopy(copy.groups, 2, 3, [copy.chunks[0], []])),
        ("copy.chunks[1]", CpuCopy(copy.groups, 2, 3, [copy.chunks[0], None])),
        ("copy.chunks", CpuCopy(copy.groups, 2, 3, None)),
        ("copy.chunks", CpuCopy(copy.groups, 2, 3, copy.chunks[:1])),
        ("copy.chunk_size", CpuCopy(copy.groups, 0, 3, copy.chunks)),
        ("copy.chunk_size", CpuCopy(copy.groups, True, 3, copy.chunks)),
        ("copy.num_indices", CpuCopy(copy.groups, 2, 3.0, copy.chunks)),
        ("copy.groups", CpuCopy((("k",),), 2, 3, copy.chunks)),
    ]
    for arg, bad in cases:
        with pytest.raises(KvtierError, match="^" + re.escape(arg) + "="):
            dev.pool.load_cpu_copy(bad, idx)
        assert_same(dev.model, before, arg)
    with pytest.raises(KvtierError, match="chunk_size=True"):
        dev.pool.get_cpu_copy(idx, chunk_size=True)
    dev.pool.load_cpu_copy(copy, torch.tensor([5, 6, 7]))
    for l, t in enumerate(dev.model["kv"]):
        assert torch.equal(dev_rows(t, torch.tensor([5, 6, 7])), dev_rows(before["kv"][l], idx))
