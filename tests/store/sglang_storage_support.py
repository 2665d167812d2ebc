"""Builders for test_sglang_storage (no tests here): SGLang 0.5.23's own host pools on
CPU filled with random bytes, its storage config, its backend factory building
`kvtier.store.sglang.KvtierStorage` through the ``dynamic`` backend, and a reference
reading of a host page written as plain indexing of SGLang's buffers (independent of
kvtier's row maps).

`load()` returns ``(modules, None)`` or ``(None, why)`` (SGLang not importable)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "adapters"))
import sglang_package_support  # noqa: E402

P, LAYERS, HEADS, HEAD_DIM, V_HEAD_DIM, LORA, ROPE = 4, 3, 2, 8, 16, 16, 8
POISON = 0xA5
# What SGLang 0.5.23 builds on a CPU and --hicache-mem-layout can ask for: (kind, layout).
CASES = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"), ("mha", "page_head"),
         ("mha_asym", "page_first"), ("mha_asym", "page_first_direct"),
         ("mla", "layer_first"), ("mla", "page_first"), ("mla", "page_first_direct")]
KIND_LAYOUTS = {k: [l for kk, l in CASES if kk == k] for k, _ in CASES}


def load():
    mods, why = sglang_package_support.load()
    if mods is None:
        return None, why
    from sglang.srt.mem_cache import hicache_storage
    from sglang.srt.mem_cache.storage import backend_factory
    mods["hicache_storage"], mods["factory"] = hicache_storage, backend_factory
    return mods, None


mods = None


def _mods():
    global mods
    if mods is None:
        mods, why = load()
        assert mods is not None, why
    return mods


def build(kind: str, layout: str, dtype=torch.bfloat16, device_tokens: int = 64, seed: int = 0,
          heads: int = HEADS, stage=None):
    """(device pool, host pool): SGLang's own pools of ``kind`` ("mha", "mha_asym",
    "mla") on the CPU, the host pool in ``layout`` (SGLang's sizing: twice the device
    pool plus its padding page) holding random bytes; ``stage``: the layers (first,
    count) of a pipeline stage's pools (default: the model's ``LAYERS``)."""
    m = _mods()
    mp = m["memory_pool"]
    first, layers = stage or (0, LAYERS)
    span = dict(start_layer=first, end_layer=first + layers)
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=device_tokens, **span)
    if kind == "mla":
        dev = mp.MLATokenToKVPool(device_tokens, P, dtype, LORA, ROPE, layers, "cpu", False, **span)
        info = dev.get_device_pool_infos()[0].buffer_info
        pool = m["mla"].MLATokenToKVPoolHost(info, 2.0, 0, P, layout, target_layer_num=layers, **common)
    else:
        dev = mp.MHATokenToKVPool(device_tokens, P, dtype, heads, HEAD_DIM, layers, "cpu", False,
                                  v_head_dim=V_HEAD_DIM if kind == "mha_asym" else None, **span)
        info = dev.get_device_pool_infos()[0].buffer_info
        pool = m["mha"].get_mha_host_pool_cls(info)(info, 2.0, 0, P, layout, **common)
    g = torch.Generator().manual_seed(seed)
    for t in tensors(pool):
        b = t.view(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return dev, pool


def host_pool(kind: str, layout: str, **kw):
    return build(kind, layout, **kw)[1]


def tensors(pool) -> List[torch.Tensor]:
    kv = pool.kv_buffer
    return list(kv) if isinstance(kv, (tuple, list)) else [kv]


def poison(pool) -> None:
    for t in tensors(pool):
        t.view(-1).view(torch.uint8).fill_(POISON)


def snapshot(pool) -> List[torch.Tensor]:
    return [t.view(-1).view(torch.uint8).clone() for t in tensors(pool)]


def _components(pool) -> List[torch.Tensor]:
    """The pool's buffers with a leading component dim: (C, *layout dims)."""
    if type(pool).__name__ == "MHATokenToKVPoolHost":
        return [pool.kv_buffer]                    # (2, ...): K and V
    return [t.unsqueeze(0) for t in tensors(pool)]


def token_rows(pool) -> List[torch.Tensor]:
    """Each buffer as (C, layers, tokens, row bytes), by SGLang's layouts' dimension
    order (hicache docs: layer_first (L, N, ...), page_first (N, L, ...),
    page_first_direct (pages, L, P, ...), page_head (pages, H, P, L, D))."""
    out = []
    for t in _components(pool):
        if pool.layout == "layer_first":           # (C, L, N, *row)
            v = t.flatten(3)
        elif pool.layout == "page_first":          # (C, N, L, *row)
            v = t.transpose(1, 2).flatten(3)
        elif pool.layout == "page_first_direct":   # (C, pages, L, P, *row)
            v = t.transpose(1, 2).flatten(2, 3).flatten(3)
        elif pool.layout == "page_head":           # (C, pages, H, P, L, D)
            v = t.permute(0, 4, 1, 3, 2, 5).flatten(2, 3).flatten(3)
        else:
            raise ValueError(pool.layout)
        out.append(v.contiguous().view(torch.uint8))
    return out


def page(pool, page_no: int) -> bytes:
    """Every byte of host page ``page_no`` (all components and layers), in one fixed
    order that does not depend on the layout."""
    return b"".join(r[:, :, page_no * P:(page_no + 1) * P].contiguous().numpy().tobytes()
                    for r in token_rows(pool))


def all_pages(pool) -> List[bytes]:
    """`page` of every host page."""
    rows = token_rows(pool)
    return [b"".join(r[:, :, q * P:(q + 1) * P].contiguous().numpy().tobytes() for r in rows)
            for q in range(pool.size // P)]


def head_pages(pool, page_no: int, heads: int) -> List[bytes]:
    """`page` of an MHA pool split by KV head: for each of the rows' ``heads`` heads,
    every byte of that head in host page ``page_no`` (K then V, layers, tokens)."""
    rows = [r[:, :, page_no * P:(page_no + 1) * P] for r in token_rows(pool)]
    return [b"".join(r.unflatten(-1, (heads, -1))[..., h, :].contiguous().numpy().tobytes() for r in rows)
            for h in range(heads)]


def slots(pages) -> torch.Tensor:
    return (torch.as_tensor(list(pages), dtype=torch.int64)[:, None] * P + torch.arange(P)).flatten()


def storage_config(url: str, *, mla: bool = False, tp=(0, 1), pp=(0, 1), model_name="test-org/test-model",
                   metrics: bool = True, **extra):
    """SGLang's HiCacheStorageConfig with the extra config of the issue's example
    (``extra``: more keys, or None to leave one out)."""
    cfg = {"backend_name": "kvtier", "module_path": "kvtier.store.sglang", "class_name": "KvtierStorage",
           "interface_v1": 1, "url": url, "timeout_ms": 1000}
    cfg.update(extra)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    return _mods()["hicache_storage"].HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=False, model_name=model_name,
        extra_config=cfg)


def create(config, pool, register: bool = True):
    """The backend as SGLang's controller builds it: the factory's ``dynamic`` path,
    then ``register_mem_pool_host``."""
    backend = _mods()["factory"].StorageBackendFactory.create_backend("dynamic", config, pool)
    if register:
        backend.register_mem_pool_host(pool)
    return backend


def backend(url: str, pool, **kw):
    return create(storage_config(url, mla=type(pool).__name__ == "MLATokenToKVPoolHost", **kw), pool)
