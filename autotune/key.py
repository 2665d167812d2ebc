"""What a tuned result is keyed by: the device, the software versions, and the transfer.

A result holds for one device (name and architecture), one Triton and kvtier version,
one operation (which fixes the direction), one row size, page size and layer count,
and one bucket of transfer sizes: the number of rows rounded up to a power of two.
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

from kvtier.errors import KvtierError, fail
from kvtier import caches


def rows_bucket(num_rows: int) -> int:
    """The power of two at or above ``num_rows`` (1 for empty transfers)."""
    n = num_rows if type(num_rows) is int else int(num_rows)
    return 1 << (n - 1).bit_length() if n > 1 else 1


@dataclass(frozen=True)
class DeviceId:
    """A device as the cache knows it: one cache file per (platform, name)."""
    platform: str      # "cuda", "rocm", "npu", "cpu"
    name: str          # e.g. "NVIDIA H200", "Ascend910B4"
    arch: str          # e.g. "sm_90", "gfx942", "Ascend910B4", "x86_64"
    units: int = 0     # compute units: SMs, CUs, vector cores, CPU cores
    ub_bytes: int = 0  # Ascend Unified Buffer (bounds the tile); 0 elsewhere

    def slug(self) -> str:
        """A file-name-safe identity."""
        raw = f"{self.platform}-{self.name}"
        return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in raw)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TuneKey:
    """The transfer part of a key (the device and versions are the cache file's header)."""
    op: str
    crosses_link: bool
    row_bytes: int
    page_size: int
    rows_bucket: int
    num_layers: int

    def to_str(self) -> str:
        return (f"{self.op}|link={int(self.crosses_link)}|row={self.row_bytes}|page={self.page_size}"
                f"|rows={self.rows_bucket}|layers={self.num_layers}")

    @classmethod
    def from_str(cls, s: str) -> "TuneKey":
        op, *fields = s.split("|")
        kv = dict(f.split("=", 1) for f in fields)
        return cls(op=op, crosses_link=kv["link"] == "1", row_bytes=int(kv["row"]),
                   page_size=int(kv["page"]), rows_bucket=int(kv["rows"]), num_layers=int(kv["layers"]))

    @classmethod
    def of(cls, op: str, *, row_bytes: int, page_size: int, num_rows: int, num_layers: int,
           crosses_link: bool) -> "TuneKey":
        return cls(op, bool(crosses_link), int(row_bytes), int(page_size), rows_bucket(num_rows),
                   int(num_layers))


def versions() -> dict:
    """Triton and kvtier versions: a result measured under others is stale."""
    return {"triton": _triton_version(), "kvtier": _kvtier_version()}


@caches.lru("autotune.key._triton_version", maxsize=1, key="-", value="Triton's version string",
            stale="not happen: the installed Triton does not change in a process")
def _triton_version() -> str:
    try:
        import triton
        return str(triton.__version__)
    except ImportError:
        return "none"


@caches.lru("autotune.key._kvtier_version", maxsize=1, key="-", value="kvtier's version string", stale="-")
def _kvtier_version() -> str:
    try:
        from importlib.metadata import version
        return version("kvtier")
    except Exception:
        return "unknown"


def device_identity(platform: str) -> DeviceId:
    """Name, architecture and compute units of the current device of ``platform``
    (queried once per device through kvtier.platforms, which loads torch_npu only for
    "npu"): another current device is another answer."""
    return _identity_of(platform, platform_device(platform))


@caches.lru("autotune.key._identity_of", bound="devices present", key="platform, torch device (with its index)",
            value="DeviceId", stale="not happen: a device's properties do not change")
def _identity_of(platform: str, device) -> DeviceId:
    from kvtier.platforms import device_properties
    p = device_properties(device)
    return DeviceId(platform, str(p["name"]), str(p["arch"]), int(p.get("compute_units") or 0),
                    int(p.get("ub_bytes") or 0))


def platform_device(platform: str, arg: str = "platform"):
    """The current torch device of ``platform``; `KvtierError` naming ``arg`` when the name
    is unknown or this machine has no such device (none at all, or a CUDA device where
    "rocm" is asked for)."""
    from kvtier.platforms import PLATFORMS, default_device, platform_of
    if platform not in PLATFORMS:
        raise fail(arg, platform, f"must be one of {PLATFORMS}")
    try:
        device = default_device(platform)
        here = platform_of(device)
    except (KvtierError, RuntimeError) as e:     # no device here (a KvtierError: torch's reason is its cause)
        why = e.__cause__ if isinstance(e, KvtierError) and e.__cause__ is not None else e
        raise fail(arg, platform, f"no {platform} device here ({str(why).strip().splitlines()[0]})") from None
    if here != platform:
        raise fail(arg, platform, f"no {platform} device here (the device is {here})")
    return device
