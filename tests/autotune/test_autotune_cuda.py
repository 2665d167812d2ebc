"""On a CUDA/ROCm device: a real tuning run (device timer, pinned host memory, both
strategies, spill pruning) writes a cache that the pools then use."""
import json

import pytest
import torch

from autotune_support import pool_call
from kvtier.autotune.cache import cache_path
from kvtier.autotune.key import device_identity
from kvtier.autotune.search import tune
from kvtier.autotune.shape import PoolShape
from kvtier.bench.pools import Pools, build_call

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("tmp_cache")]


def test_tune_on_the_device_and_pools_use_the_winner(monkeypatch):
    platform = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    shape = PoolShape.mha(4, 8, 128, torch.bfloat16, page_size=16)
    results = tune(shape, pools=Pools, ops=("backup", "load", "gather"), sizes=(1024,), platform=platform,
                   max_programs=4, quick=True)
    assert all(r.best is not None and r.best.gbps > 0 for r in results)
    across = {r.key.op: r for r in results if r.key.crosses_link}
    assert {m.config.strategy for m in across["backup"].measurements} == {"kernel", "dma"}
    dev = device_identity(platform)
    doc = json.loads(cache_path(dev).read_text())
    assert doc["device"]["name"] == torch.cuda.get_device_name() and len(doc["entries"]) == 3

    t = build_call(shape, "backup", 1024, torch.device("cuda"))
    launched = pool_call(monkeypatch, t)
    torch.cuda.synchronize()
    assert launched == [across["backup"].best.config] and t.verify()
