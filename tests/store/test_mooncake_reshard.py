"""Pages written at one TP size and read at another on a running Mooncake store
(``.ci/mooncake.sh``): byte-exact against the model's pages, both transfer modes."""
from __future__ import annotations

import uuid

import pytest

from mooncake_support import store_url
from reshard_support import Model, ranks
from store_support import slots

N = 3
WRITE_PAGES, READ_PAGES = [4, 1, 2], [0, 5, 3]


@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("kind", ["mha", "mha_v_indexer", "mla"])
@pytest.mark.parametrize("writer,reader", [(8, 2), (2, 8), (4, 1)])
def test_across_tp_on_mooncake(mode, kind, writer, reader):
    base = store_url()
    url = f"{base}{'&' if '?' in base else '?'}transfer={mode}"
    tag = uuid.uuid4().hex[:12]
    keys = [f"page{i}-{tag}" for i in range(N)]
    model = Model(kind, 8, N)
    for r, (hc, tier) in enumerate(ranks(model, writer, "page_first", url, pages=6)):
        model.fill(hc, r, writer, WRITE_PAGES)
        assert tier.backup(keys, slots(WRITE_PAGES)) == [True] * N
        tier.close()
    for r, (hc, tier) in enumerate(ranks(model, reader, "page_head", url, pages=6)):
        assert tier.prefetch(keys, slots(READ_PAGES)) == N, f"rank {r} of {reader}"
        model.check(hc, r, reader, READ_PAGES)
        tier.close()


@pytest.mark.parametrize("mode", ["staged", "direct"])
@pytest.mark.parametrize("kind", ["mha", "dsa"])
def test_stages_of_another_split_on_mooncake(mode, kind):
    """Stages 0-2 and 3-5 of a 6-layer model at TP 8 write, stages 0-1, 2-3 and 4-5 at
    TP 2 read, with the layer split (0, 2, 3, 4, 6) that holds both splits' boundaries."""
    base = store_url()
    url = f"{base}{'&' if '?' in base else '?'}transfer={mode}"
    tag = uuid.uuid4().hex[:12]
    keys = [f"page{i}-{tag}" for i in range(N)]
    model, split = Model(kind, 8, N, layers=6), (0, 2, 3, 4, 6)
    for stage in ((0, 3), (3, 3)):
        for r, (hc, tier) in enumerate(ranks(model, 8, "page_first", url, pages=6, stage=stage, layer_split=split)):
            model.fill(hc, r, 8, WRITE_PAGES, stage)
            assert tier.backup(keys, slots(WRITE_PAGES)) == [True] * N
            tier.close()
    for stage in ((0, 2), (2, 2), (4, 2)):
        for r, (hc, tier) in enumerate(ranks(model, 2, "page_first_direct", url, pages=6, stage=stage,
                                             layer_split=split)):
            assert tier.prefetch(keys, slots(READ_PAGES)) == N, f"stage {stage} rank {r}"
            model.check(hc, r, 2, READ_PAGES, stage=stage)
            tier.close()
