"""Meta tensors as index lists (and slot mappings) given to the engine adapters: one
`KvtierError` naming the argument, before any byte moves."""
import pytest
import torch

from kvtier.adapters import lmcache, sglang
from kvtier.kernels import KvtierError

F16 = torch.float16
L, N, H, D = 2, 16, 2, 8
ITEM = H * D * 2


def _buffers():
    g = torch.Generator().manual_seed(0)
    dev_k = [torch.randn(N, H, D, generator=g).to(F16) for _ in range(L)]
    dev_v = [torch.randn(N, H, D, generator=g).to(F16) for _ in range(L)]
    host = torch.randn(2, L, N, H, D, generator=g).to(F16)       # SGLang's layer_first host buffer
    return dev_k, dev_v, host


def _table(ts):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)


META, GOOD = torch.arange(4, device="meta"), torch.arange(4)
CALLS = [
    ("src_indices", lambda k, v, h, m, g: sglang.transfer_kv_per_layer(h[0, 0], h[1, 0], k[0], v[0], m, g,
                                                                      item_size=ITEM)),
    ("dst_indices", lambda k, v, h, m, g: sglang.transfer_kv_per_layer(h[0, 0], h[1, 0], k[0], v[0], g, m,
                                                                      item_size=ITEM)),
    ("src_indices", lambda k, v, h, m, g: sglang.transfer_kv_all_layer(
        _table(k), _table(list(h[0])), _table(v), _table(list(h[1])), m, g, item_size=ITEM, num_layers=L)),
    ("dst_indices", lambda k, v, h, m, g: sglang.transfer_kv_per_layer_mla(h[0, 0], k[0], g, m, item_size=ITEM)),
    ("slot_mapping", lambda k, v, h, m, g: lmcache.multi_layer_kv_transfer(
        _KV, _table(_PAGED), m, "cpu", N, False)),
]
_PAGED = [torch.randn(2, N, H, D).to(F16) for _ in range(L)]     # LMCache's paged layers (K, V)
_KV = torch.randn(2, L, 4, H * D).to(F16)                        # its memory object


@pytest.mark.parametrize("arg,call", CALLS, ids=[f"{i}-{a}" for i, (a, _) in enumerate(CALLS)])
def test_a_meta_index_list_is_named_and_nothing_moves(arg, call):
    k, v, h = _buffers()
    every = k + v + [h, _KV] + _PAGED
    before = [t.clone() for t in every]
    with pytest.raises(KvtierError, match=f"{arg}.*meta"):
        call(k, v, h, META, GOOD)
    assert all(torch.equal(a, b) for a, b in zip(before, every)), "bytes moved for a meta index list"
