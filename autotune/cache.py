"""Tuned results on disk: one JSON file per device in the user's cache directory.

    $KVTIER_CACHE_DIR, else $XDG_CACHE_HOME/kvtier, else ~/.cache/kvtier
        autotune-<platform>-<device name>.json

The file holds a format ``version``, the device identity and one entry per transfer key;
each entry records the Triton and kvtier versions it was measured under. Writes merge
with what is on disk under a file lock and land atomically (temporary file +
os.replace), so concurrent tuners keep each other's entries and readers never see half
a file. A file that cannot be read, has another format version, belongs to another
device, or entries measured under other versions are ignored with a warning. A directory
that cannot be written (a file in its place, read-only, cannot be created) raises
`KvtierError` naming the variable it came from (`writable_cache_dir`, before tuning).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import logging
import time
from pathlib import Path
from typing import Dict, Optional

from kvtier.config import CopyConfig
from kvtier.errors import fail
from kvtier.writable import writable_dir

from .key import DeviceId, TuneKey, versions

log = logging.getLogger("kvtier")

FORMAT_VERSION = 1
CACHE_ENV = "KVTIER_CACHE_DIR"


def cache_dir() -> Path:
    """$KVTIER_CACHE_DIR, else $XDG_CACHE_HOME/kvtier, else ~/.cache/kvtier."""
    return cache_location()[1]


def cache_location():
    """(how the directory was named, the directory): the variable, with the rest of the path."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return CACHE_ENV, Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return "XDG_CACHE_HOME/kvtier", Path(xdg) / "kvtier"
    return "HOME/.cache/kvtier", Path.home() / ".cache" / "kvtier"


def writable_cache_dir(path: Optional[Path] = None) -> Path:
    """The directory ``path`` (a cache file) goes in, default the cache directory, made if
    missing; raises `KvtierError` naming how it was named when no file can be written there."""
    if path is not None:
        return writable_dir(Path(path).parent, "directory of path")
    name, d = cache_location()
    return writable_dir(d, name)


def cache_path(device: DeviceId) -> Path:
    return cache_dir() / f"autotune-{device.slug()}.json"


def _warn(path: Path, why: str) -> None:
    """One WARNING on the ``kvtier`` logger per reading of a cache file it ignores (in
    part or whole): the pools run with the platform defaults there instead."""
    log.warning("kvtier autotune cache %s: %s; it is ignored (run `kvtier autotune` to measure again)", path, why)


def _read_doc(path: Path, device: DeviceId, quiet: bool = False) -> Optional[dict]:
    """The file's document if it is readable, of this format and for this device."""
    warn = (lambda *a: None) if quiet else _warn
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        warn(path, f"unreadable ({e})")
        return None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        warn(path, f"corrupt JSON ({type(e).__name__}: {str(e)[:80]})")
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), dict):
        warn(path, "not an autotune cache")
        return None
    if doc.get("version") != FORMAT_VERSION:
        warn(path, f"format version {doc.get('version')!r}, this kvtier reads {FORMAT_VERSION}")
        return None
    dev = doc.get("device")
    if not isinstance(dev, dict):
        warn(path, f"device field {dev!r} is not a device description")
        return None
    # A device named without its architecture (arch "") matches by name.
    if dev.get("name") != device.name or (device.arch and dev.get("arch") != device.arch):
        warn(path, f"written for {dev.get('name')!r}/{dev.get('arch')!r}, not {device.name!r}/{device.arch!r}")
        return None
    return doc


def _valid(key: str, entry) -> Optional[tuple]:
    try:
        return TuneKey.from_str(key), CopyConfig.from_dict(entry["config"])
    except Exception:
        return None


def load(device: DeviceId, path: Optional[Path] = None) -> Dict[TuneKey, CopyConfig]:
    """The usable results for ``device``: entries of the current Triton and kvtier
    versions whose key and configuration parse. Never raises for a bad file."""
    path = path or cache_path(device)
    doc = _read_doc(path, device)
    if doc is None:
        return {}
    now, out, stale, bad = versions(), {}, 0, 0
    for key, entry in doc["entries"].items():
        parsed = _valid(key, entry) if isinstance(entry, dict) else None
        if parsed is None:
            bad += 1
        elif {k: entry.get(k) for k in now} != now:
            stale += 1
        else:
            out[parsed[0]] = parsed[1]
    if bad:
        _warn(path, f"{bad} malformed entries")
    if stale:
        _warn(path, f"{stale} entries measured under other Triton/kvtier versions (now {now})")
    return out


def entries(device: DeviceId, path: Optional[Path] = None) -> dict:
    """The raw entries of the device's file (for display), {} when it cannot be used."""
    doc = _read_doc(path or cache_path(device), device)
    return doc["entries"] if doc else {}


def store(device: DeviceId, new: Dict[TuneKey, dict], path: Optional[Path] = None) -> Path:
    """Merge ``new`` entries (key -> {"config": ..., "gbps": ..., ...}) into the device's
    file under a lock and replace it atomically. Entries of other keys are kept, except
    those measured under other versions; entries of the same key are replaced. A directory
    or file that cannot be written raises `KvtierError` naming it."""
    writable_cache_dir(path)
    path = path or cache_path(device)
    now = versions()
    try:
        return _store(path, device, new, now)
    except OSError as e:      # the file itself (a directory in its place, a full disk)
        raise fail("path", str(path), f"cannot be written ({e.strerror or e})") from None


def _store(path: Path, device: DeviceId, new: Dict[TuneKey, dict], now: dict) -> Path:
    with _locked(path):
        doc = _read_doc(path, device, quiet=True)     # a bad file is replaced, not reported twice
        kept = {k: e for k, e in (doc or {}).get("entries", {}).items()
                if isinstance(e, dict) and {v: e.get(v) for v in now} == now and _valid(k, e)}
        for key, entry in new.items():
            kept[key.to_str()] = dict(entry, **now, tuned_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        out = {"version": FORMAT_VERSION, "device": device.to_dict(), "entries": dict(sorted(kept.items()))}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(out, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return path


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``<path>.lock`` (POSIX flock; elsewhere merge-on-write alone)."""
    with open(str(path) + ".lock", "a+") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
