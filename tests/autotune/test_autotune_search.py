"""The search on CPU with a fake timer that makes a known configuration win: the winner
is recorded, wrong-bytes and failing configurations cannot win, spilling ones are not
timed, and pools then use the cached winner."""
import json
from types import SimpleNamespace

import pytest
import torch

from kvtier.pool import dma

from autotune_support import pool_call
from kvtier.autotune import select_config
from kvtier.autotune.cache import cache_path
from kvtier.autotune.key import TuneKey, device_identity
from kvtier.autotune.search import tune, tune_transfer
from kvtier.autotune.space import candidates
from kvtier.autotune.shape import PoolShape
from kvtier.bench.pools import Pools, TimedCall, build_call
from kvtier.kernels import CopyConfig, default_config

SHAPE = PoolShape.mha(2, 2, 8, torch.float16, page_size=2)       # 32-byte rows
# A layer_first pool moves token rows (its host index is a slot), so candidate blocks are
# clamped to the 32-byte row; gather moves whole pages of 64 bytes.
ROW_BLOCK = 32
CPU = device_identity("cpu")

pytestmark = pytest.mark.usefixtures("tmp_cache")


class FakeTimer:
    """Runs each configuration once (so its bytes are checked) and reports a time that
    makes ``winner`` the fastest, the rest slower by their position."""

    def __init__(self, winner=None, ranking=None):
        self.winner, self.ranking, self.seen = winner, ranking, []

    def __call__(self, fn, *, config):
        fn()
        self.seen.append(config)
        if self.ranking is not None:
            return self.ranking(config)
        return 1e-3 if config == self.winner else 2e-3 + 1e-4 * len(self.seen)


def test_tune_transfer_ranks_by_the_timer_and_computes_gbps():
    t = build_call(SHAPE, "backup", 8, torch.device("cpu"))
    cfgs = candidates(CPU, chunk_bytes=64, crosses_link=True, max_programs=2)
    win = cfgs[-1]
    ms = tune_transfer(t, cfgs, FakeTimer(win))
    assert [m.config for m in ms][0] == win and all(m.ok for m in ms)
    assert {m.config for m in ms} == set(cfgs)
    assert ms[0].seconds == 1e-3 and ms[0].gbps == pytest.approx(t.nbytes / 1e-3 / 1e9)
    assert [m.seconds for m in ms] == sorted(m.seconds for m in ms)


def test_a_configuration_that_moves_wrong_bytes_cannot_win(monkeypatch):
    t = build_call(SHAPE, "load", 8, torch.device("cpu"))
    cheat = CopyConfig(num_programs=1, rows=16, block_bytes=1024, num_warps=1)
    good = CopyConfig(num_programs=2, rows=16, block_bytes=1024, num_warps=1)
    real = TimedCall.runner
    monkeypatch.setattr(TimedCall, "runner", lambda self, c: (lambda: None) if c == cheat else real(self, c))
    ms = tune_transfer(t, [cheat, good], FakeTimer(cheat))           # the cheat is "fastest"
    assert ms[0].config == good and ms[0].ok
    assert ms[1].config == cheat and ms[1].error == "moved wrong bytes"


def test_a_configuration_that_fails_is_recorded_not_fatal():
    t = build_call(SHAPE, "gather", 8, torch.device("cpu"))
    bad = CopyConfig(num_programs=1, rows=16, block_bytes=1024, num_warps=1)
    good = CopyConfig(num_programs=2, rows=16, block_bytes=1024, num_warps=1)

    def timer(fn, *, config):
        if config == bad:
            raise RuntimeError("out of resources")
        fn()
        return 1.0

    ms = tune_transfer(t, [bad, good], timer)
    assert [m.config for m in ms] == [good, bad]
    assert "out of resources" in ms[1].error and ms[1].gbps == 0


def test_timer_returning_nonsense_is_a_failure():
    t = build_call(SHAPE, "gather", 8, torch.device("cpu"))
    ms = tune_transfer(t, [CopyConfig()], lambda fn, **_: 0.0)
    assert not ms[0].ok and "timer returned 0.0" in ms[0].error


def test_tune_records_the_winner_of_every_key_and_select_config_returns_it():
    dma = CopyConfig(num_programs=2, rows=64, block_bytes=ROW_BLOCK, num_warps=1, strategy="dma")
    kernel = CopyConfig(num_programs=2, rows=16, block_bytes=ROW_BLOCK, num_warps=1)
    page_kernel = CopyConfig(num_programs=2, rows=16, block_bytes=64, num_warps=1)
    win = {"backup": dma, "load": dma, "gather": page_kernel}     # gathers time kernels only
    timer = FakeTimer(ranking=lambda c: {dma: 1e-3, kernel: 1.1e-3, page_kernel: 1.1e-3}.get(c, 5e-3))
    results = tune(SHAPE, pools=Pools, ops=("backup", "load", "gather"), sizes=(4, 16), platform="cpu", timer=timer,
                   max_programs=2, target=None)
    assert len(results) == 6
    for r in results:
        assert r.best.config == win[r.key.op]
        assert r.key.rows_bucket in (4, 16) and r.key.row_bytes == 32 and r.key.num_layers == 2
        got = select_config(r.key.op, "cpu", row_bytes=32, page_size=2, num_rows=r.key.rows_bucket,
                            num_layers=2, crosses_link=r.key.crosses_link)
        assert got == win[r.key.op]
    doc = json.loads(cache_path(CPU).read_text())
    assert len(doc["entries"]) == 6
    e = doc["entries"][TuneKey.of("load", row_bytes=32, page_size=2, num_rows=16, num_layers=2,
                                  crosses_link=True).to_str()]
    assert e["max_programs"] == 2 and e["gbps"] > 0
    assert e["timed"] == len(candidates(CPU, chunk_bytes=64, crosses_link=True, max_programs=2))


def test_per_layer_transfers_are_their_own_keys():
    timer = FakeTimer(ranking=lambda c: 1e-3 * c.num_programs)
    results = tune(SHAPE, pools=Pools, ops=("load",), sizes=(4,), layer_counts=(1, 2), platform="cpu", timer=timer,
                   max_programs=2, target=None)
    assert sorted(r.key.num_layers for r in results) == [1, 2]
    assert all(r.best.config.num_programs == 1 for r in results)


def test_spilling_configurations_are_not_timed():
    def report(target, *, config, row_bytes, **shape):
        assert target == "sm90" and row_bytes == SHAPE.row_bytes * SHAPE.page_size
        return SimpleNamespace(spills=128 if config.rows == 64 else 0)

    timer = FakeTimer(ranking=lambda c: 1e-3 if c.rows == 64 else 2e-3)   # spillers would win
    results = tune(SHAPE, pools=Pools, ops=("gather",), sizes=(8,), platform="cpu", timer=timer, max_programs=2,
                   quick=False, target="sm90", report=report)
    r = results[0]
    assert r.pruned and all(c.rows == 64 for c in r.pruned)
    assert all(c.rows != 64 for c in timer.seen) and r.best.config.rows != 64


def test_nothing_written_when_asked_or_when_every_configuration_fails(tmp_cache):
    tune(SHAPE, pools=Pools, ops=("gather",), sizes=(4,), platform="cpu", timer=FakeTimer(), max_programs=1,
         target=None, write=False)
    assert not cache_path(CPU).exists()

    def broken(fn, **_):
        raise RuntimeError("no")

    results = tune(SHAPE, pools=Pools, ops=("gather",), sizes=(4,), platform="cpu", timer=broken, max_programs=1, target=None)
    assert results[0].best is None and not cache_path(CPU).exists()


def test_unknown_op_is_rejected_before_any_work():
    with pytest.raises(ValueError, match="'swap'"):
        tune(SHAPE, pools=Pools, ops=("swap",), platform="cpu", timer=FakeTimer())


def test_pools_pick_the_cached_winner(monkeypatch):
    """The pools look the cached winner up and launch with it."""
    win = CopyConfig(num_programs=2, rows=16, block_bytes=ROW_BLOCK, num_warps=1)
    tune(SHAPE, pools=Pools, ops=("backup",), sizes=(8,), platform="cpu", max_programs=2, target=None,
         timer=FakeTimer(ranking=lambda c: 1e-3 if c == win else 3e-3))
    t = build_call(SHAPE, "backup", 8, torch.device("cpu"))
    assert pool_call(monkeypatch, t) == [win] and t.verify()
    assert win != default_config("cpu", crosses_link=True)


def test_load_layer_is_timed_on_the_whole_pool_and_keyed_as_one_layer(monkeypatch):
    """A per-layer load moves one layer of a pool of every layer (as the engine's pool is),
    is stored as op "load" with num_layers=1, and the pool's per-layer load then uses it."""
    win = CopyConfig(num_programs=1, rows=64, block_bytes=ROW_BLOCK, num_warps=1, strategy="dma")
    seen = []
    real = Pools.call
    monkeypatch.setattr(Pools, "call", lambda self, op: seen.append(self.pool_shape.num_layers) or real(self, op))
    results = tune(SHAPE, pools=Pools, ops=("load_layer",), sizes=(4,), platform="cpu", max_programs=2, target=None,
                   timer=FakeTimer(win))
    monkeypatch.setattr(Pools, "call", real)
    r, = results
    assert seen == [SHAPE.num_layers]
    assert (r.key.op, r.key.num_layers, r.nbytes) == ("load", 1, 4 * 32 * 1 * 2)
    assert r.best.config == win
    t = Pools(SHAPE, 4, torch.device("cpu"), seed=3).call("load_layer")
    # The winner is a dma config: the pool's load takes the dma path with it (whose
    # staging scatter runs with the scatter op's own configuration).
    took, real_load = [], dma.load
    monkeypatch.setattr(dma, "load", lambda *a: took.append(a[11]) or real_load(*a))
    t.poison()
    t.runner()()
    assert took == [win] and t.verify()
