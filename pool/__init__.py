"""kvtier.pool: device and host KV pools whose every transfer is a row-copy launch.

- `MHADevicePool`, `MLADevicePool`: an engine's KV memory (allocated here or adopted),
  one tensor per layer or one stacked tensor per component; gather/scatter, CPU copies,
  prefill-decode layout checks.
- `HostPool`: pinned host memory in a named layout with HiCache's methods
  (`backup_from_device_all_layer`, `load_to_device_per_layer`, ...), packing target and
  draft pools, with a thread-safe `PageAllocator`.
"""
from .allocator import PageAllocator
from .cpu_copy import CpuCopy
from .device import DevicePool
from .host import HostPool
from .mha import MHADevicePool
from .mla import MLADevicePool
from .spec import Component, IndexerSpec
from .transfer_layout import TransferLayout

__all__ = ["DevicePool", "MHADevicePool", "MLADevicePool", "HostPool", "PageAllocator",
           "IndexerSpec", "Component", "CpuCopy", "TransferLayout"]
