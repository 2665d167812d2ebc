"""What a timed loop needs from the device: its runtime's events (`device_module`) and,
on CUDA and ROCm, a device sleep that keeps a stream busy while the host queues the
calls it times (`DeviceBusy`, `busy_keeper`: None where no sleep op exists)."""
from __future__ import annotations

from typing import Optional

import torch
from kvtier import caches


def device_module(device: torch.device):
    """torch.cuda / torch.npu (whichever backs ``device``), or None for the CPU."""
    return None if device.type == "cpu" else getattr(torch, device.type)


class DeviceBusy:
    """Keeps a CUDA/ROCm stream busy with ``torch.cuda._sleep`` so that calls queued
    behind it run back to back; ``still_busy()`` says whether the sleep is still running."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cycles_per_s = _sleep_rate(device)
        self._end = None

    def start(self, seconds: float) -> None:
        with torch.cuda.device(self.device):
            torch.cuda._sleep(max(1, int(self.cycles_per_s * seconds)))
            self._end = torch.cuda.Event()
            self._end.record()

    def still_busy(self) -> bool:
        return self._end is not None and not self._end.query()


@caches.lru("platforms.events._sleep_rate", bound="devices present", key="torch device",
            value="device sleep cycles per second (measured once)", stale="mistime a busy wait (figures, never bytes)")
def _sleep_rate(device: torch.device) -> float:
    """Sleep cycles per second on ``device``, measured once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)                 # loaded before it is timed
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end) / 1e3, 1e-6)


def can_sleep(device: torch.device) -> bool:
    """Whether ``device`` has a device sleep op (CUDA and ROCm; not Ascend or the CPU)."""
    return device.type == "cuda" and hasattr(torch.cuda, "_sleep")


def busy_keeper(device: torch.device) -> Optional[DeviceBusy]:
    """A `DeviceBusy` for ``device``, or None where no device sleep op exists (CPU, Ascend)."""
    return DeviceBusy(device) if can_sleep(device) else None
