"""The benchmark's timer (`kvtier.autotune.timing.time_calls`): kernel-only device time and
host time per call are separate fields with their spread; on an accelerator the loop runs
behind a device sleep, is retried with a longer one when the sleep ran out before the last
call was queued, and is reported as not kernel-only when it never held. Driven here with
stand-in events and a stand-in sleep (no timed assertions)."""
import itertools
import time

import pytest
import torch

from kvtier.autotune import timing


def test_cpu_wall_clock_fields():
    calls = []
    t = timing.time_calls(lambda: calls.append(1), torch.device("cpu"), warmup=3, iters=25)
    assert len(calls) == 28 and t.iters == 25
    assert t.method == timing.WALL_CLOCK and t.kernel_only is False
    d = t.to_dict()
    for k in ("device_s", "host_s", "device_p10_s", "device_p90_s", "device_min_s", "host_p10_s", "host_p90_s"):
        assert isinstance(d[k], float) and d[k] >= 0
    assert d["device_min_s"] <= d["device_p10_s"] <= d["device_s"] <= d["device_p90_s"]


def test_spread_of_known_samples():
    med, p10, p90, low = timing.spread([float(x) for x in range(1, 12)])
    assert (med, low) == (6.0, 1.0) and p10 == pytest.approx(2.0) and p90 == pytest.approx(10.0)
    assert timing.spread([3.0]) == (3.0, 3.0, 3.0, 3.0)


class _Clock:
    """A device clock advanced by the calls: each call takes ``per_call`` device seconds."""

    def __init__(self, per_call):
        self.now, self.per_call = 0.0, per_call


class _Event:
    def __init__(self, clock):
        self.clock, self.t = clock, None

    def record(self):
        self.t = self.clock.now

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


class _Keeper:
    def __init__(self, busy):
        self.busy, self.sleeps = busy, []

    def start(self, seconds):
        self.sleeps.append(seconds)

    def still_busy(self):
        return next(self.busy)


def _fake_device(monkeypatch, busy):
    clock = _Clock(per_call=[1e-3, 2e-3, 3e-3])
    mod = type("Mod", (), {"Event": staticmethod(lambda enable_timing=False: _Event(clock))})
    keeper = _Keeper(busy)
    monkeypatch.setattr(timing, "device_module", lambda d: mod)
    monkeypatch.setattr(timing, "busy_keeper", lambda d: keeper)
    monkeypatch.setattr(timing.platforms, "synchronize", lambda d=None: None)
    cycle = itertools.cycle(clock.per_call)

    def call():
        clock.now += next(cycle)
    return call, keeper


def test_busy_stream_per_call_events(monkeypatch):
    call, keeper = _fake_device(monkeypatch, iter([True]))
    t = timing.time_calls(call, torch.device("cuda"), warmup=0, iters=30)
    assert t.method == timing.BUSY_EVENTS and t.kernel_only is True and t.iters == 30
    assert t.device_s == pytest.approx(2e-3) and t.device_min_s == pytest.approx(1e-3)
    assert t.device_p90_s == pytest.approx(3e-3)
    assert len(keeper.sleeps) == 1 and keeper.sleeps[0] >= timing.MIN_BUSY_S
    assert t.host_s != t.device_s          # two separate measurements


def test_sleep_that_runs_out_is_retried_longer(monkeypatch):
    call, keeper = _fake_device(monkeypatch, iter([False, True]))
    t = timing.time_calls(call, torch.device("cuda"), warmup=0, iters=20)
    assert t.kernel_only is True and len(keeper.sleeps) == 2 and keeper.sleeps[1] > keeper.sleeps[0]


def test_a_host_that_never_keeps_ahead_is_not_kernel_only(monkeypatch):
    call, keeper = _fake_device(monkeypatch, itertools.repeat(False))
    t = timing.time_calls(call, torch.device("cuda"), warmup=0, iters=20)
    assert len(keeper.sleeps) == timing.BUSY_TRIES
    assert t.method == timing.IDLE_EVENTS and t.kernel_only is False and t.iters == 20


def test_a_call_that_synchronizes_is_not_retried(monkeypatch):
    call, keeper = _fake_device(monkeypatch, itertools.repeat(False))

    def waits():            # blocks the host for longer than any sleep queued
        call()
        time.sleep(2 * timing.MIN_BUSY_S)
    t = timing.time_calls(waits, torch.device("cuda"), warmup=0, iters=20)
    assert len(keeper.sleeps) == 1 and t.kernel_only is False


def test_public_names_kept_for_the_autotuner():
    from kvtier.autotune import search  # noqa: F401  (import the users)
    from kvtier.bench import pools  # noqa: F401
    assert callable(timing.default_timer) and callable(timing.gbps) and timing.Timer
    assert timing.gbps(2e9, 1.0) == 2.0 and timing.gbps(1, 0) == float("inf")
