"""The embedded file store (``file:///dir``): one file per object, no server, no
dependency beyond the standard library.

On disk::

    dir/tmp/                 objects being written (renamed into place when whole)
    dir/ab/abcd...           one object: the hex BLAKE2b-128 digest of its key, in one
                             of 256 directories by its first byte (all made at opening,
                             so no write pays for a mkdir)

A key of any characters maps to a fixed-length, case-insensitive-safe name; keys are
not recoverable from names (the page format keeps the key inside the object).
Reads go straight into the caller's buffers (`os.preadv`, asking for one byte past
them, so no ``fstat`` is needed); a file whose size is not the target's is CORRUPT (the
target's bytes are then undefined). Writes go to a temporary file in dir/tmp
(the same file system) and `os.replace` puts it in place: a reader sees the old object
or the new one, and a writer that dies mid-write leaves a temporary file, not a torn
object. Temporary files of dead writers on this host are removed when an engine opens
the directory. No fsync: after a power loss a renamed object may hold fewer or other
bytes than written, which the page format reads as a miss (length, checksum).

Since names are digests, no key (``../../etc/passwd``, ``/abs``, NUL, any length) names
a path outside the directory.

``?max_bytes=N`` (or ``64MiB``, ``10GB``; `parse_bytes`) bounds the objects' bytes: a
write that would pass it evicts the least recently read or written objects first, and an
object larger than it is refused (ERROR, ``stats["put.too_large"]``); evictions are
counted in ``stats["evictions"]`` and ``stats["evicted_bytes"]``. The index is in memory
(`Capacity`), built at opening from the files' sizes and times; within one engine the
bound holds after every put from any of its threads, and across engines on one directory
each bounds the objects it knows of (docs/store.md). Eviction removes objects only,
never a writer's temporary file, and a reader that has an evicted object open still
reads it whole (POSIX).

Local file calls cannot be abandoned safely mid-call (the kernel would still write the
caller's buffers afterwards), so this engine does not apply the timeout.
"""
from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import itertools
import os
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple
from urllib.parse import parse_qsl, unquote, urlsplit

from kvtier import caches
from kvtier.errors import fail

from .engine import DEFAULT_TIMEOUT_MS, Engine, RawCalls, Status



def _iov_max() -> int:
    """Buffers one preadv/pwritev call takes (1024 on Linux and macOS)."""
    try:
        return max(16, min(os.sysconf("SC_IOV_MAX"), 1024))
    except (AttributeError, ValueError, OSError):
        return 16


_IOV_MAX = _iov_max()
_TMP = "tmp"
_OPEN_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


THREADS_MAX = 64
# A read's bytes one thread takes before the call spreads over another: files in the
# page cache read faster on the calling thread alone than dealt to two up to about
# 8 MiB (256 KiB files, medians, us, one thread against two: 4 files 108 against 175,
# 8 files 219 against 343, 32 files 774 against 765). Writes spread from two files on.
READ_SPREAD_BYTES = 2 << 20
# ... and only where its values average at least this: each value costs a thread's turn
# of the GIL (the tier verifies and places it on the thread that read it), which two
# threads contend for. The tier's reads of 64 MiB of a reshard's objects, medians, one
# thread against two: objects of 64 KiB 34 ms against 49, 128 KiB 25 against 29, 256 KiB
# 20 against 21, 512 KiB 19 against 14 (results/2026-12-07_cpu_store_reshard_placement,
# 2-core CPU; pages of one object: 64 KiB 29 against 39, 256 KiB 17 against 16).
READ_SPREAD_VALUE = 256 << 10
# A value of at least twice this, in a read of fewer keys than threads, is read in byte
# ranges of at least this on several threads: so one large page (a 70B-class model's
# rank page at TP 2 is 10 MiB) is not one thread's copy. A 16 MiB file in the page cache,
# one preadv: 8-19 GB/s; two threads, half each: 14-34 GB/s (2-core CPU, two runs;
# results/2026-12-07_cpu_store_reshard_placement).
RANGE_BYTES = 4 << 20
RANGE_ALIGN = 4096          # ranges start at multiples of this (the page cache's pages)


def default_threads() -> int:
    """I/O threads per call by default: one per CPU, at most 4 (a local file read or
    write is the kernel copying bytes, so threads beyond the cores gain nothing)."""
    return max(1, min(4, os.cpu_count() or 1))


# Units `parse_bytes` takes after the digits (case-insensitive): decimal and binary.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BYTES_FORM = "a positive byte count: an int, or digits and a unit (KB MB GB TB, KiB MiB GiB TiB)"


def parse_bytes(value) -> Optional[int]:
    """``value`` as a positive number of bytes (an int, or a str of digits with an
    optional unit of `_UNITS`: ``"64MiB"``, ``"10GB"``); None where it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if not isinstance(value, str):
        return None
    m = re.fullmatch(r"([0-9]+) ?([A-Za-z]*)", value.strip())
    if m is None or m.group(2).lower() not in _UNITS:
        return None
    n = int(m.group(1)) * _UNITS[m.group(2).lower()]
    return n if n > 0 else None


_OPTIONS = "threads=N, max_bytes=N"


def parse_url(url: str) -> Tuple[str, int, Optional[int]]:
    """The directory of a ``file:///dir[?threads=N][&max_bytes=N]`` URL (absolute;
    ``file://localhost/dir`` too), its I/O threads per call (`default_threads` where not
    given) and its capacity in bytes (`parse_bytes`; None where not given: unbounded)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost") \
            or parts.fragment or not parts.path.startswith("/"):
        raise fail("url", url, f"must be file:///absolute/directory[?{_OPTIONS.replace(', ', '&')}] "
                   "(no host or fragment)")
    path = os.path.normpath(unquote(parts.path))
    if path == "/":
        raise fail("url", url, "names the root directory; give the store a directory of its own")
    threads, max_bytes, seen = default_threads(), None, set()
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in ("threads", "max_bytes"):
            raise fail("url", url, f"has an unknown option {name!r} (file:// takes {_OPTIONS})")
        if name in seen:
            raise fail("url", url, f"gives {name} more than once")
        seen.add(name)
        if name == "threads":
            if not value.isdigit() or not 1 <= int(value) <= THREADS_MAX:
                raise fail("url", url, f"threads must be an int from 1 to {THREADS_MAX}, not {value!r}")
            threads = int(value)
        else:
            max_bytes = parse_bytes(value)
            if max_bytes is None:
                raise fail("url", url, f"max_bytes must be {_BYTES_FORM}, not {value!r}")
    return path, threads, max_bytes


def object_name(key: str) -> str:
    """The file name of ``key``'s object, relative to the store directory."""
    h = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{h[:2]}/{h}"


FANOUT = tuple(f"{i:02x}" for i in range(256))


_SIZES = dict(kind="state", key="an object's name (the digest of its key)",
              value="its size in bytes, least recently read or written first",
              bound="the objects of one bounded file store (their bytes at most max_bytes)",
              rule="a put, hit, miss, delete or eviction of the object through this engine",
              stale="count bytes another process removed (more evicted than needed) or miss "
                    "objects it wrote (the bound holds over this engine's view)")
caches.declare("store.file.Capacity.sizes", **_SIZES)


class Capacity:
    """The objects of a bounded file store (``max_bytes``) as one engine knows them, least
    recently used first, and the eviction that keeps their bytes within ``max_bytes``.

    What it knows: the objects found at opening (oldest first by the later of the file's
    access and modification times), those this engine writes, and those it reads that
    another engine wrote. Recency is this engine's own reads (hits) and writes.

    Recency lives here, in memory, rather than in the files' times (an `os.utime` per hit),
    the cheaper on the hot path: a hit moves one entry under a lock (0.8 us on the 2-core
    development VM) where `os.utime` is a system call (4.5 us there, ext4) and an inode
    to write back per page read, and finding the oldest file would need a scan of the
    directory. The cost: an engine does not see another process's reads.

    Every change runs under ``lock``: placing a new object (the eviction it needs, its
    `os.replace`, its entry), so that the objects on disk of which this engine knows never
    pass ``max_bytes``, not even between two of its threads' puts. Evictions remove
    files of the 256 object directories only, never a writer's temporary file; a
    reader that opened an object before its eviction still reads it whole (POSIX keeps
    an unlinked file open to who holds it), so a hit is never a torn read."""

    def __init__(self, root: str, max_bytes: int, counted):
        self.root, self.max_bytes = root, max_bytes
        self._counted = counted             # counted(evictions, bytes)
        self.lock = threading.Lock()
        self.sizes = caches.table("store.file.Capacity.sizes", factory=OrderedDict, **_SIZES)
        self.total = 0
        self._seed()

    def path(self, name: str) -> str:
        return f"{self.root}/{name[:2]}/{name}"

    def _seed(self) -> None:
        """Know the objects on disk, least recently used first; evict down to the bound."""
        found = []
        for d in FANOUT:
            try:
                entries = list(os.scandir(os.path.join(self.root, d)))
            except OSError:
                continue
            for entry in entries:
                if len(entry.name) != 32 or not entry.name.startswith(d):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue            # removed meanwhile
                found.append((max(st.st_atime, st.st_mtime), entry.name, st.st_size))
        found.sort()
        with self.lock:
            for _, name, size in found:
                self.sizes[name] = size
                self.total += size
            self._make_room(0)

    def place(self, name: str, size: int, commit) -> None:
        """Make room for ``size`` bytes of object ``name`` (the one it replaces counts
        no more), ``commit()`` (the rename that puts it in place), and know it as the
        most recently used. Raises what ``commit`` or an eviction raises (the object is
        then not put; the one it would have replaced is known again)."""
        with self.lock:
            old = self.sizes.pop(name, None)
            if old is not None:
                self.total -= old
            try:
                self._make_room(size)
                commit()
            except BaseException:
                if old is not None and os.path.exists(self.path(name)):
                    self.sizes[name] = old
                    self.total += old
                    self._make_room(0)
                raise
            self.sizes[name] = size
            self.total += size

    def used(self, name: str, size: int) -> None:
        """A hit on ``name`` (its file held ``size`` bytes): now the most recently used;
        one this engine did not know (another engine wrote it) is known from now on,
        where it is still on disk."""
        with self.lock:
            old = self.sizes.get(name)
            if old is not None:
                self.sizes.move_to_end(name)
                if old == size:
                    return
                self.total += size - old            # replaced by another engine
            else:
                try:
                    size = os.stat(self.path(name)).st_size
                except FileNotFoundError:
                    return          # evicted (by this engine too) while it was read
                self.sizes[name] = size
                self.total += size
            try:
                self._make_room(0)
            except OSError:
                pass        # the read stands; the next put evicts again and reports the fault

    def gone(self, name: str) -> None:
        """A miss on ``name``: forgotten where it is no longer on disk (another engine
        removed it)."""
        with self.lock:
            if name in self.sizes and not os.path.exists(self.path(name)):
                self.total -= self.sizes.pop(name)

    def remove(self, name: str) -> None:
        """Delete ``name``'s object (absent already: deleted all the same)."""
        with self.lock:
            _unlink_missing_ok(self.path(name))
            size = self.sizes.pop(name, None)
            if size is not None:
                self.total -= size

    def _make_room(self, size: int) -> None:
        """Evict the least recently used objects until ``size`` more bytes fit (under
        ``lock``). A file another engine removed already is forgotten, not counted; one
        that cannot be removed stays known and raises its `OSError`."""
        count = freed = 0
        try:
            while self.sizes and self.total + size > self.max_bytes:
                name, n = self.sizes.popitem(last=False)
                try:
                    os.unlink(self.path(name))
                    count, freed = count + 1, freed + n
                except FileNotFoundError:
                    pass
                except OSError:
                    self.sizes[name] = n
                    self.sizes.move_to_end(name, last=False)
                    raise
                self.total -= n
        finally:
            if count:
                self._counted(count, freed)


class FileEngine(Engine):
    """Objects as files under one directory (module doc). The directory is made if it
    does not exist; one that cannot be made or written raises `KvtierError` naming the URL.

    A call's reads and writes are spread over ``threads`` threads (the URL's
    ``?threads=N``, else `default_threads`): the calling thread and ``threads - 1`` of
    the engine's own, made at the first call that uses them and ended by `close`.

    ``max_bytes`` (the URL's ``?max_bytes=N``, or this keyword; an int, or a str such as
    ``"64MiB"``, `parse_bytes`) bounds the bytes of the objects; a write that would pass
    it evicts the least recently used first (`Capacity`). None: unbounded."""

    scheme = "file"
    fills_as_sent = True
    # A hint `StoreTier` reads: move at most this many bytes per call (its staging
    # memory); each page is checksummed and converted on the thread that moves it, as
    # it moves, so larger calls gain nothing (docs/store.md has the figures).
    batch_bytes = 16 << 20

    def __init__(self, url: str, timeout_ms: int = DEFAULT_TIMEOUT_MS, max_bytes=None):
        super().__init__(url, timeout_ms)
        self.root, self.threads, self.max_bytes = parse_url(url)
        if max_bytes is not None:
            if parse_bytes(max_bytes) is None:
                raise fail("max_bytes", max_bytes, f"must be {_BYTES_FORM}")
            if self.max_bytes is not None:
                raise fail("max_bytes", max_bytes, f"is given twice: the URL {url!r} gives one too")
            self.max_bytes = parse_bytes(max_bytes)
        self.tmp = os.path.join(self.root, _TMP)
        try:
            os.makedirs(self.tmp, exist_ok=True)
            for d in FANOUT:
                os.makedirs(os.path.join(self.root, d), exist_ok=True)
            probe = os.path.join(self.tmp, f"probe.{uuid.uuid4().hex}")
            with open(probe, "wb") as f:
                f.write(b"kvtier")
            os.unlink(probe)
        except OSError as e:
            raise fail("url", url, f"the store directory cannot be written: {e.strerror or e}") from None
        self._host = socket.gethostname()
        self._serial = itertools.count()
        self._closed = False
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()
        self._remove_dead_writers()
        self._capacity: Optional[Capacity] = None
        if self.max_bytes is not None:
            try:
                self._capacity = Capacity(self.root, self.max_bytes, self._count_evictions)
            except OSError as e:
                raise fail("url", url, f"the store's objects cannot be evicted down to max_bytes: "
                           f"{e.strerror or e}") from None

    @property
    def stored_bytes(self) -> Optional[int]:
        """The bytes of the objects this engine knows of (`Capacity`; None: unbounded)."""
        return self._capacity.total if self._capacity is not None else None

    def _count_evictions(self, count: int, nbytes: int) -> None:
        with self._stats_lock:
            self.stats["evictions"] += count
            self.stats["evicted_bytes"] += nbytes

    # ------------------------------------------------------------------ engine calls
    def _exists(self, keys: List[str]) -> List[Status]:
        return self._each("exists", keys, lambda i, k, _: self._stat(k))

    def _get_into(self, keys: List[str], targets: List[List[memoryview]], landed) -> List[Status]:
        capacity = self._capacity

        def get(i: int, key: str, views: List[memoryview]) -> Status:
            path = self._path(key)
            status = self._read(path, views)
            if status == Status.HIT:
                landed(i)
                if capacity is not None:
                    capacity.used(path[-32:], sum(v.nbytes for v in views))
            elif status == Status.MISS and capacity is not None:
                capacity.gone(path[-32:])
            return status
        nbytes = sum(v.nbytes for views in targets for v in views)
        if len(keys) < self.threads and nbytes >= 2 * RANGE_BYTES * len(keys):
            return self._get_ranged(keys, targets, landed)
        spread = -(-nbytes // READ_SPREAD_BYTES) if nbytes >= READ_SPREAD_VALUE * len(keys) else 1
        return self._spread("get", keys, get, targets, spread)

    def _get_ranged(self, keys: List[str], targets: List[List[memoryview]], landed) -> List[Status]:
        """`_get_into` of values too large and too few to give each thread one
        (`RANGE_BYTES`): each file opened and its length checked once, then read in
        byte ranges dealt to the threads; ``landed(i)`` once every range of key i is
        in. Returns only once no thread touches the buffers."""
        if self._closed:
            return [Status.ERROR] * len(keys)
        capacity, per_key = self._capacity, max(1, self.threads // len(keys))
        out: List[Optional[Status]] = [None] * len(keys)
        fds: List[int] = []
        ranges = []         # (key index, fd, file offset, the buffers' pieces it fills)
        try:
            for i, key in enumerate(keys):
                path, want = self._path(key), sum(v.nbytes for v in targets[i])
                try:
                    fd = os.open(path, _OPEN_READ)
                except FileNotFoundError:
                    out[i] = Status.MISS
                    if capacity is not None:
                        capacity.gone(path[-32:])
                    continue
                except OSError as e:
                    out[i] = self._error("get", e)
                    continue
                fds.append(fd)
                try:
                    if os.fstat(fd).st_size != want:
                        out[i] = Status.CORRUPT
                        continue
                except OSError as e:
                    out[i] = self._error("get", e)
                    continue
                parts = max(1, min(per_key, want // RANGE_BYTES))
                ranges += [(i, fd, a, pieces) for a, pieces in _ranges(targets[i], parts)]
            if ranges:
                pool = self._thread_pool()
                if pool is None:            # closed meanwhile
                    return [Status.ERROR] * len(keys)
                shares = _deal(len(ranges), min(self.threads, len(ranges)))
                for share, statuses in zip(shares, _on_threads(
                        pool, shares, lambda share: [self._read_range(*ranges[r][1:]) for r in share])):
                    for r, status in zip(share, statuses):
                        i = ranges[r][0]
                        if out[i] in (None, Status.HIT):
                            out[i] = status
        finally:
            for fd in fds:
                os.close(fd)
        for i, status in enumerate(out):
            if status == Status.HIT:
                landed(i)
                if capacity is not None:
                    capacity.used(self._path(keys[i])[-32:], sum(v.nbytes for v in targets[i]))
        return out

    def _read_range(self, fd: int, offset: int, views: List[memoryview]) -> Status:
        try:
            return Status.HIT if _vectored(os.preadv, fd, views, offset) == sum(v.nbytes for v in views) \
                else Status.CORRUPT
        except OSError as e:
            return self._error("get", e)

    def _put_from(self, keys: List[str], sources: List[List[memoryview]], fill) -> List[Status]:
        most = self.max_bytes

        def put(i: int, key: str, views: List[memoryview]) -> Status:
            if most is not None and sum(v.nbytes for v in views) > most:
                return self._refuse_too_large(sum(v.nbytes for v in views))
            if fill(i) is False:
                return Status.ERROR
            self._write(self._path(key), views)
            return Status.HIT
        return self._spread("put", keys, put, sources)

    def _delete(self, keys: List[str]) -> List[Status]:
        return self._each("delete", keys, lambda i, k, _: self._unlink(k))

    def _each(self, what: str, keys: List[str], one, views=None, at: Sequence[int] = ()) -> List[Status]:
        """``one(i, key i, its views)``'s status per key (the keys at ``at``, else all):
        ERROR for every key once closed, and a store fault (an `OSError`) as the status
        `_error` gives it."""
        if self._closed:
            return [Status.ERROR] * (len(at) or len(keys))
        out = []
        for i in at or range(len(keys)):
            try:
                out.append(one(i, keys[i], views[i] if views is not None else None))
            except OSError as e:
                out.append(self._error(what, e))
        return out

    def _spread(self, what: str, keys: List[str], one, views, most: int = THREADS_MAX) -> List[Status]:
        """`_each` over the keys dealt round-robin to ``threads`` threads (at most
        ``most``; the calling thread takes the first share); returns once every thread is
        done with its keys, so no buffer is touched after the call."""
        n = min(self.threads, len(keys), max(1, most))
        pool = self._thread_pool() if n > 1 else None
        if pool is None:                # one thread, or closed (ERROR for every key)
            return self._each(what, keys, one, views)
        shares = _deal(len(keys), n)
        out: List[Status] = [Status.ERROR] * len(keys)
        for share, statuses in zip(shares, _on_threads(
                pool, shares, lambda share: self._each(what, keys, one, views, share))):
            for i, s in zip(share, statuses):
                out[i] = s
        return out

    def _thread_pool(self) -> Optional[concurrent.futures.ThreadPoolExecutor]:
        """The engine's threads (None once closed: none are made again)."""
        with self._pool_lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="kvtier-file")
            return self._pool

    def _refuse_too_large(self, nbytes: int) -> Status:
        """An object larger than ``max_bytes``: not stored (ERROR), counted."""
        with self._stats_lock:
            self.stats["put.too_large"] += 1
        self.warn_once("put.too_large", "an object of %d B is larger than max_bytes=%d: not stored "
                       "(counted in stats['put.too_large'] from now on)", nbytes, self.max_bytes)
        return Status.ERROR

    def _stat(self, key: str) -> Status:
        path = self._path(key)
        try:
            os.stat(path)
        except FileNotFoundError:
            if self._capacity is not None:
                self._capacity.gone(path[-32:])
            return Status.MISS
        return Status.HIT

    def _unlink(self, key: str) -> Status:
        path = self._path(key)
        if self._capacity is not None:
            self._capacity.remove(path[-32:])
        else:
            _unlink_missing_ok(path)      # gone already: deleted all the same
        return Status.HIT

    def close(self) -> None:
        self._closed = True
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # ------------------------------------------------------------------ files
    def _path(self, key: str) -> str:
        return f"{self.root}/{object_name(key)}"

    def _error(self, op: str, e: OSError) -> Status:
        self.warn_once(f"{op}.oserror", "%s failed: %s", op, e)
        return Status.ERROR

    @staticmethod
    def _read(path: str, views: List[memoryview]) -> Status:
        try:
            fd = os.open(path, _OPEN_READ)
        except FileNotFoundError:
            return Status.MISS
        try:
            return Status.HIT if _read_whole(fd, views) else Status.CORRUPT
        finally:
            os.close(fd)

    def _write(self, path: str, views: List[memoryview]) -> None:
        # host.pid.thread.serial: unique among writers (a forked child has its own pid),
        # and tells a dead writer's file from a live one's (`_remove_dead_writers`).
        tmp = f"{self.tmp}/{self._host}.{os.getpid()}.{threading.get_ident()}.{next(self._serial)}"
        fd = os.open(tmp, _OPEN_WRITE, 0o644)
        try:
            try:
                _pwritev_all(fd, views)
            finally:
                os.close(fd)
            if self._capacity is None:
                _replace(tmp, path)
            else:
                self._capacity.place(path[-32:], sum(v.nbytes for v in views), lambda: _replace(tmp, path))
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def _remove_dead_writers(self) -> None:
        """Remove temporary files left by writers on this host that no longer run (a
        writer's files are named host.pid.thread.serial)."""
        host = socket.gethostname()
        try:
            names = os.listdir(self.tmp)
        except OSError:
            return
        for name in names:
            parts = name.rsplit(".", 3)
            if len(parts) != 4 or parts[0] != host or not parts[1].isdigit():
                continue
            pid = int(parts[1])
            if pid == os.getpid() or _alive(pid):
                continue
            _unlink_quietly(os.path.join(self.tmp, name))

    # ------------------------------------------------------------------ raw figure
    def raw_throughput(self, value_bytes: int, count: int) -> Dict[str, float]:
        """Plain writes, then plain reads, of ``count`` new files of ``value_bytes`` in a
        fresh directory beside the objects (unbuffered `open`, `write` / `readinto`,
        `close`) on one thread, each file from and into its own part of one buffer, as
        a reader landing values in host pages does: the file system's own figure for
        this store (``set_gbps``, ``get_gbps``). ``get_gbps_one_buffer``: reads into one
        buffer that stays in the CPU's cache. ``set_gbps_threads`` and
        ``get_gbps_threads``: the same writes and reads dealt to this engine's
        ``threads`` threads, as its calls deal them (where it has more than one)."""
        if isinstance(value_bytes, bool) or not isinstance(value_bytes, int) or value_bytes <= 0:
            raise fail("value_bytes", value_bytes, "must be a positive int")
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise fail("count", count, "must be a positive int")
        data = memoryview(bytearray(os.urandom(value_bytes)) * count)
        values = [data[i * value_bytes:(i + 1) * value_bytes] for i in range(count)]
        total = value_bytes * count
        set_s, get_s, one_s = self._plain(values, 1, one_buffer=True)
        out = {"get_gbps": total / get_s / 1e9, "set_gbps": total / set_s / 1e9,
               "get_gbps_one_buffer": total / one_s / 1e9,
               "how": f"{count} plain file writes then reads of {value_bytes} B (open, write/readinto, close)"}
        if self.threads > 1 and count > 1:
            set_s, get_s, _ = self._plain(values, self.threads)
            out.update(set_gbps_threads=total / set_s / 1e9, get_gbps_threads=total / get_s / 1e9)
            out["how"] += f"; again on {self.threads} threads"
        return out

    def raw_calls(self, value_bytes: int, count: int) -> RawCalls:
        """Plain writes of ``count`` new files of ``value_bytes`` and plain reads of them
        (`os.open`, one `os.write` or `os.preadv`, `os.close`) on the calling thread, in a
        fresh directory beside the objects: the file system's own call, one file at a
        time (`RawCalls`)."""
        return _FileRawCalls(self, value_bytes, count)

    def _plain(self, values: List[memoryview], threads: int, one_buffer: bool = False):
        """Seconds to write, read back, and (``one_buffer``) read into one buffer, the
        files of ``values``, each file's turn dealt round-robin to ``threads`` threads."""
        where = os.path.join(self.root, f"raw.{uuid.uuid4().hex}")
        os.makedirs(where)
        paths = [os.path.join(where, str(i)) for i in range(len(values))]
        one = bytearray(values[0].nbytes)

        def write(share):
            for i in share:
                with open(paths[i], "wb", buffering=0) as f:
                    f.write(values[i])

        def read(share):
            for i in share:
                with open(paths[i], "rb", buffering=0) as f:
                    f.readinto(values[i])

        def read_one(share):
            for i in share:
                with open(paths[i], "rb", buffering=0) as f:
                    f.readinto(one)

        shares = _deal(len(values), threads)
        pool = concurrent.futures.ThreadPoolExecutor(threads - 1) if threads > 1 else None

        def timed(fn) -> float:
            t = time.perf_counter()
            _on_threads(pool, shares, fn)
            return time.perf_counter() - t

        try:
            return timed(write), timed(read), timed(read_one) if one_buffer else 0.0
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            for p in paths:
                _unlink_quietly(p)
            os.rmdir(where)


def _plain_calls(what: str, paths: List[str], buffers, flags: int, move) -> None:
    """One plain open, ``move(fd, buffer)`` and close per path (`_FileRawCalls`)."""
    try:
        for path, b in zip(paths, buffers):
            fd = os.open(path, flags, 0o644)
            try:
                if move(fd, b) != b.nbytes:
                    raise RuntimeError(f"a plain {what} of {path} stopped short")
            finally:
                os.close(fd)
    except OSError as e:
        raise RuntimeError(f"a plain {what} failed: {e}") from None


class _FileRawCalls(RawCalls):
    """`FileEngine.raw_calls`."""

    def __init__(self, engine: FileEngine, value_bytes: int, count: int):
        super().__init__(engine, value_bytes, count)
        self.where = os.path.join(engine.root, f"raw.{uuid.uuid4().hex}")
        os.makedirs(self.where)
        self.paths: List[str] = []
        self.how = (f"plain writes then reads of {count} new file(s) of {value_bytes} B "
                    "(os.open, os.write / os.preadv, os.close), one after the other")

    def set(self) -> None:
        self.paths = [f"{self.where}/{k}" for k in self.fresh_keys()]
        _plain_calls("write", self.paths, self.sources, _OPEN_WRITE, os.write)

    def get(self) -> None:
        _plain_calls("read", self.paths, self.targets, _OPEN_READ, lambda fd, t: os.preadv(fd, [t], 0))

    def clear(self) -> None:
        written, self.written = self.written, []
        for k in written:
            _unlink_quietly(f"{self.where}/{k}")

    def close(self) -> None:
        self.clear()
        try:
            os.rmdir(self.where)
        except OSError:
            pass


def _deal(count: int, threads: int) -> List[range]:
    """Positions 0 .. count-1 dealt round-robin to ``threads`` shares."""
    return [range(t, count, threads) for t in range(threads)]


def _on_threads(pool, shares: List[range], fn) -> list:
    """``fn(share)`` per share, the first on the calling thread and the others on
    ``pool``; their results in share order. Returns or raises only once every share
    it started has ended (a pool shut down meanwhile refuses the rest: an exception)."""
    futures: list = []
    try:
        for share in shares[1:]:
            futures.append(pool.submit(fn, share))
        first = fn(shares[0])
    finally:
        concurrent.futures.wait(futures)
    return [first] + [f.result() for f in futures]


def _ranges(views: Sequence[memoryview], parts: int) -> List[Tuple[int, List[memoryview]]]:
    """The bytes of ``views`` (a file's offsets 0 .. their total, in order) as
    ``parts`` ranges of about equal length cut at multiples of `RANGE_ALIGN`: (the
    range's first offset, the views' pieces that hold it) each."""
    total = sum(v.nbytes for v in views)
    if total == 0:
        return [(0, [])]
    cuts = sorted({0, total, *((total * k // parts) // RANGE_ALIGN * RANGE_ALIGN for k in range(1, parts))})
    starts = list(itertools.accumulate([v.nbytes for v in views], initial=0))
    out = []
    for a, b in zip(cuts, cuts[1:]):
        pieces = [v[max(a, s) - s:min(b, s + v.nbytes) - s] for s, v in zip(starts, views)
                  if max(a, s) < min(b, s + v.nbytes)]
        out.append((a, pieces))
    return out


def _read_whole(fd: int, views: Sequence[memoryview]) -> bool:
    """Read the file into ``views`` in order; whether it holds exactly their bytes.
    One ``preadv`` asks for a byte more than they hold: a file of their length reads
    short by that byte, a longer one reads it, so no ``fstat`` is needed. A read short
    of their length (the file is shorter, or the kernel cut the read) is checked the
    careful way: the file's length, then the read resumed until it ends."""
    want = sum(v.nbytes for v in views)
    if len(views) < _IOV_MAX:
        n = os.preadv(fd, [*views, bytearray(1)], 0)
        if n >= want:
            return n == want
    return os.fstat(fd).st_size == want and _vectored(os.preadv, fd, views) == want


def _pwritev_all(fd: int, views: Sequence[memoryview]) -> None:
    """Write ``views`` in order from offset 0 (a write that stops short is an `OSError`:
    the object is not put)."""
    if _vectored(os.pwritev, fd, views) != sum(v.nbytes for v in views):
        raise OSError(errno.ENOSPC, "the file system took no more bytes")


def _vectored(call, fd: int, views: Sequence[memoryview], start: int = 0) -> int:
    """``call`` (``os.preadv`` or ``os.pwritev``) over every view from offset ``start``,
    at most `_IOV_MAX` views per call, resumed after a short transfer; returns the bytes
    moved (short only where a read meets the end of the file)."""
    done, i, pending = 0, 0, [v for v in views if v.nbytes]
    while i < len(pending):
        batch = pending[i:i + _IOV_MAX]
        n = call(fd, batch, start + done)
        if n == 0:
            return done
        done += n
        for v in batch:                # skip the views done; cut the one done in part
            if n >= v.nbytes:
                n -= v.nbytes
                i += 1
            else:
                pending[i] = v[n:]
                break
    return done

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:             # another user's process: alive
        return True
    return True


def _replace(tmp: str, path: str) -> None:
    """Put the whole file ``tmp`` in place as ``path`` (atomically)."""
    try:
        os.replace(tmp, path)
    except FileNotFoundError:       # its directory was removed since opening
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(tmp, path)


def _unlink_missing_ok(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
