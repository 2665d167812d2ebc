"""A tier call makes no garbage-collected object per stored object that lives through
its engine call: a call of thousands of objects would otherwise promote thousands of
them each time, and the collector's full passes over the whole process (an engine's
heap) come that much more often. Buffers and header views of objects staged whole are
made once per staging buffer (`Staging.payloads`, `Staging.frames`), and the engine
takes the caller's buffer lists as they are where they are byte views already."""
from __future__ import annotations

import gc

import pytest
import torch

from kvtier.store import open_store
from kvtier.store.bench import bench_host, one_object_tier
from kvtier.store.tier import StoreTier

PAGES = 128
# Tracked objects a call may have alive at its engine call: its own lists, closures and
# hand-off to a worker thread (40-70), none per stored object (the calls move 128-512).
LIMIT = 100


def _tiers(engine, layout, m):
    """A reader of ``m`` objects a page and the tiers writing them: ``m`` 1 is one
    object per page; 4, the heads of rank 0 of TP 2 written by ranks 0-3 of TP 8."""
    if m == 1:
        host = bench_host(32 << 10, PAGES, layout, heads=2, head_dim=64)
        tier = one_object_tier(host, engine)
        return tier, [tier]
    host = bench_host(32 << 10, PAGES, layout, heads=4, head_dim=64)
    writers = [StoreTier(bench_host(32 << 10, PAGES, layout, heads=1, page_size=host.page_size, head_dim=64),
                         engine, model="alloc", tp=(r, 8), heads=8) for r in range(4)]
    return StoreTier(host, engine, model="alloc", tp=(0, 2), heads=8), writers


class _Alive:
    """How many GC-tracked objects made since `start` are alive when `count` is called."""

    counts = None           # not started: `count` counts nothing

    def start(self):
        gc.collect()
        self.before = {id(o) for o in gc.get_objects()}
        self.counts = []

    def count(self):
        if self.counts is not None:
            self.counts.append(sum(1 for o in gc.get_objects() if id(o) not in self.before))


@pytest.mark.parametrize("layout,m", [("page_first", 1), ("page_first", 4), ("page_head", 4)])
def test_a_call_keeps_no_object_alive_per_stored_object(tmp_path, layout, m):
    engine = open_store(f"file://{tmp_path}/s")
    reader, writers = _tiers(engine, layout, m)
    assert reader.read.m == m
    idx = torch.arange(PAGES * reader.host.page_size, dtype=torch.int64)
    keys = [f"page-{i:04d}" for i in range(PAGES)]
    alive = _Alive()
    get, put = engine._get_into, engine._put_from

    def counting_get(*args):
        alive.count()
        return get(*args)

    def counting_put(*args):
        alive.count()
        return put(*args)

    engine._get_into, engine._put_from = counting_get, counting_put
    was = gc.isenabled()
    try:
        for w in writers:                   # the first calls make the staging buffers and their frames
            assert w.backup(keys, idx) == [True] * PAGES
        assert reader.prefetch(keys, idx) == PAGES
        gc.disable()                        # nothing collected while counting
        for w in writers:
            alive.start()
            assert w.backup([k.replace("page", "more") for k in keys], idx) == [True] * PAGES   # keys as long: frames made
            assert len(alive.counts) == 1 and alive.counts[0] < LIMIT, alive.counts
        alive.start()
        assert reader.prefetch(keys, idx) == PAGES
        assert len(alive.counts) == 1 and alive.counts[0] < LIMIT, (alive.counts, PAGES * m)
    finally:
        if was:
            gc.enable()
        engine._get_into, engine._put_from = get, put
        for t in {id(t): t for t in writers + [reader]}.values():
            t.close()
        engine.close()
