"""The store engine interface: batched, byte-level access to one key-value store.

An engine moves opaque objects (a page object's header and payload, `kvtier.store.page`)
between a store and caller-owned buffers. It knows nothing of pages, layouts or
checksums; it only promises, per key, one `Status`:

- ``exists(keys)``: HIT where an object is stored under the key, MISS where none is.
- ``get_into(keys, targets)``: each target is a sequence of writable buffers (anything
  with the buffer protocol: memoryviews of host page memory); a stored object whose
  length equals the target's total length is written into the buffers in order (a
  scatter read, zero-copy where the client allows) and reported HIT. An object of
  another length is CORRUPT, and the target's bytes are then undefined. A missing key
  is MISS (the target untouched where the engine can tell before reading).
- ``get_ahead(keys, nbytes)``: a ``get_into`` started before its buffers exist, ended by
  ``into(targets)`` (or ``cancel()``): an engine that can sends the requests at once,
  so that the store's round trip overlaps the caller's preparing of the targets.
- ``put_from(keys, sources)``: each source is a sequence of readable buffers whose
  concatenation is the object (a gather write); HIT where the store acknowledged it.
  A put replaces any object under the key; a reader sees the old object or the new
  one, never a mix (the file engine renames atomically; Redis SET is atomic).

A store fault never raises into the caller: a dead, refused or reset connection is
ERROR, a reply that did not come within the engine's timeout is TIMEOUT, and the call
returns within about twice the timeout whatever the store does. Every failure mode
logs one WARNING on the ``kvtier`` logger (the first time it happens per engine) and
is counted in `Engine.stats`. Bad arguments (not a fault of the store) raise
`KvtierError` naming the argument, before any byte moves.

Engines are chosen by URL (`open_store`): ``file:///dir``, ``redis://host:port``
(``valkey://`` the same), ``redis+cluster://host:port[,host:port...]``
(``valkey+cluster://``), ``rediss://`` and ``rediss+cluster://`` (TLS), ``mooncake://...``. A malformed URL, an unknown scheme, a
missing client library or an unreachable store raises `KvtierError` naming the URL at
construction. Client libraries are imported by the engine's module only (the ``store``
extra); the file engine needs none.
"""
from __future__ import annotations

import enum
import importlib
import logging
import threading
from collections import Counter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kvtier.errors import KvtierError, fail

log = logging.getLogger("kvtier")

DEFAULT_TIMEOUT_MS = 1000


class Status(enum.IntEnum):
    """The outcome of one key of a batched call."""

    HIT = 0         # exists: stored; get_into: read in full; put_from: stored
    MISS = 1        # no object under the key
    TIMEOUT = 2     # the store did not answer within the timeout
    CORRUPT = 3     # an object of the wrong length (an engine), or one that failed verification
    ERROR = 4       # the store refused or the connection failed


Buffers = Sequence[object]      # buffer-protocol objects (memoryview, bytearray, numpy arrays)
_STATUS_NAMES = {s: s.name.lower() for s in Status}      # as counted in `Engine.stats`
# The `Engine.stats` names of each call's statuses ("get.hit", ...), by op, then status.
_STAT_NAMES = {op: tuple(f"{op}.{_STATUS_NAMES[s]}" for s in Status) for op in ("exists", "get", "put", "delete")}
_FAULTS = (Status.TIMEOUT, Status.ERROR, Status.CORRUPT)


class Engine:
    """One store, by URL. Subclasses implement `_exists`, `_get_into`, `_put_from` (and
    optionally `_delete`, `raw_throughput`, `close`); the public methods validate the
    arguments, count the outcomes and turn any exception a client raises into a status,
    so no store fault reaches the caller. Engines are safe to call from several threads
    at once (HiCache's controller runs a backup thread and a prefetch thread)."""

    scheme = ""
    fills_as_sent = False       # True: `_put_from` calls ``fill(i)`` as it sends key i; False: `put_from` fills all first
    sends_ahead = False         # True: `get_ahead` sends requests (else it only defers a `get_into`)

    def __init__(self, url: str, timeout_ms: int = DEFAULT_TIMEOUT_MS):
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)) or not timeout_ms > 0:
            raise fail("timeout_ms", timeout_ms, "must be a positive number of milliseconds")
        self.url = url
        self.timeout = float(timeout_ms) / 1000.0
        self.stats: Counter = Counter()
        self._stats_lock = threading.Lock()
        self._warned: set = set()

    # ------------------------------------------------------------------ public calls
    def exists(self, keys: Sequence[str]) -> List[Status]:
        keys = _keys(keys)
        return self._guarded("exists", len(keys), lambda: self._exists(keys))

    def get_into(self, keys: Sequence[str], targets: Sequence[Buffers],
                 landed: Optional[Callable[[int], None]] = None) -> List[Status]:
        """Read each key's value into its buffers. ``landed(i)``, where given, is called
        as soon as key i's value is whole in its buffers (on whichever of the engine's
        threads received it, before this returns), so that a reader can use the bytes
        while the CPU's cache still holds them; it must not raise. An engine whose client
        lands every value at once (Mooncake reading straight into the buffers) calls it
        for none: the statuses returned are what counts."""
        keys = _keys(keys)
        targets = _buffers("targets", targets, len(keys), writable=True)
        landed = landed or _unheard
        return self._guarded("get", len(keys), lambda: self._get_into(keys, targets, landed))

    def get_ahead(self, keys: Sequence[str], nbytes: Sequence[int]) -> "PendingGet":
        """A `get_into` of ``keys`` started before its buffers exist: ``nbytes[i]`` is the
        length key i's targets will have. An engine that can asks the store now (Redis:
        each connection's first window of GETs is sent), so that the store's
        round trip overlaps the caller's own work before `PendingGet.into`; any other
        starts at `into`. The values read are what the store holds at this call or
        later. The caller ends it with exactly one `PendingGet.into` or
        `PendingGet.cancel` (a `cancel` after `into` does nothing)."""
        keys = _keys(keys)
        if not isinstance(nbytes, (list, tuple)) or len(nbytes) != len(keys):
            got = len(nbytes) if isinstance(nbytes, (list, tuple)) else type(nbytes).__name__
            raise fail("nbytes", got, f"must be a list of {len(keys)} lengths, one per key")
        for i, n in enumerate(nbytes):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise fail(f"nbytes[{i}]", n, "must be a positive int")
        nbytes = list(nbytes)
        return PendingGet(self, keys, nbytes, self._send_ahead(keys, nbytes) if keys else None)

    def put_from(self, keys: Sequence[str], sources: Sequence[Buffers],
                 fill: Optional[Callable[[int], Optional[bool]]] = None) -> List[Status]:
        """Store each key's value from its buffers. ``fill(i)``, where given, is called
        once before any byte of key i's source is read, so that a writer can finish the
        source (the store tier: the staged copy and the header's checksum) just before
        it is sent, while the CPU's cache still holds it for the send. It must not
        raise; where it returns False, key i is not put (ERROR, nothing sent). An engine
        whose threads send values one by one (`fills_as_sent`) calls it on the thread
        that sends key i; one whose client takes the whole batch at once (Mooncake)
        calls it for every key before its call."""
        keys = _keys(keys)
        sources = _buffers("sources", sources, len(keys), writable=False)
        fill = fill or _unheard
        if self.fills_as_sent or fill is _unheard:
            return self._guarded("put", len(keys), lambda: self._put_from(keys, sources, fill))
        return self._guarded("put", len(keys), lambda: self._put_filled(keys, sources, fill))

    def _put_filled(self, keys: List[str], sources: List[List[memoryview]], fill) -> List[Status]:
        """`_put_from` for an engine that reads every source at once: every key filled
        first, the keys whose fill returned False ERROR without being sent."""
        go = [i for i in range(len(keys)) if fill(i) is not False]
        out = [Status.ERROR] * len(keys)
        if go:
            for i, s in zip(go, self._put_from([keys[i] for i in go], [sources[i] for i in go], _unheard)):
                out[i] = s
        return out

    def delete(self, keys: Sequence[str]) -> List[Status]:
        """Remove the objects (HIT: removed or absent; a fault: its status)."""
        keys = _keys(keys)
        return self._guarded("delete", len(keys), lambda: self._delete(keys))

    def close(self) -> None:
        """Release connections and threads; later calls return ERROR."""

    def raw_throughput(self, value_bytes: int, count: int) -> Dict[str, float]:
        """The store's own GET and SET throughput for ``count`` values of ``value_bytes``,
        measured with the store's own tool or client in the simplest way it offers
        (``{"get_gbps": ..., "set_gbps": ..., "how": "..."}``): what `kvtier bench
        --store` puts beside kvtier's figures."""
        raise NotImplementedError(f"{type(self).__name__} has no raw throughput measurement")

    def raw_calls(self, value_bytes: int, count: int) -> "RawCalls":
        """One raw SET and one raw GET of ``count`` values of ``value_bytes`` at a time,
        to be timed call by call (`RawCalls`): what `kvtier bench --store` puts beside
        the tier's latency. Engines give the store's own client call where they have one;
        this default moves plain buffers through the engine's own `put_from` and
        `get_into`."""
        return RawCalls(self, value_bytes, count)

    # ------------------------------------------------------------------ for subclasses
    def _exists(self, keys: List[str]) -> List[Status]:
        raise NotImplementedError

    def _get_into(self, keys: List[str], targets: List[List[memoryview]],
                  landed: Callable[[int], None]) -> List[Status]:
        raise NotImplementedError

    def _put_from(self, keys: List[str], sources: List[List[memoryview]],
                  fill: Callable[[int], Optional[bool]]) -> List[Status]:
        """Put the keys; an engine that `fills_as_sent` calls ``fill(i)`` just before it
        reads source i (False: ERROR, not sent), any other is given sources filled."""
        raise NotImplementedError

    def _delete(self, keys: List[str]) -> List[Status]:
        raise NotImplementedError

    def _send_ahead(self, keys: List[str], nbytes: List[int]) -> Optional["Ahead"]:
        """`get_ahead`'s requests, sent now: an `Ahead` that `_get_sent` reads, or None
        (nothing sent: `PendingGet.into` is a plain `_get_into`). Never raises: a fault
        here is met again, and reported, by the call at `into`."""
        return None

    def _get_sent(self, ahead: "Ahead", keys: List[str], targets: List[List[memoryview]],
                  landed: Callable[[int], None]) -> List[Status]:
        """`_get_into` of the keys whose requests `_send_ahead` sent as ``ahead``."""
        raise NotImplementedError

    def warn_once(self, mode: str, message: str, *args) -> None:
        """One WARNING per failure ``mode`` per engine (the rest are counted only)."""
        if mode not in self._warned:
            self._warned.add(mode)
            log.warning("kvtier store %s: " + message, self.url, *args)

    def count(self, op: str, statuses: Sequence[Status]) -> None:
        names = _STAT_NAMES[op]
        with self._stats_lock:
            for s in statuses:
                self.stats[names[s]] += 1

    def _guarded(self, op: str, n: int, call: Callable[[], List[Status]]) -> List[Status]:
        if n == 0:
            return []
        try:
            out = list(call())
            if len(out) != n:
                raise RuntimeError(f"engine returned {len(out)} statuses for {n} keys")
        except Exception as e:      # a client's exception is a store fault, never the caller's
            self.warn_once(f"{op}.exception", "%s failed (%s: %s); reported as ERROR",
                           op, type(e).__name__, e)
            out = [Status.ERROR] * n
        if out.count(Status.HIT) + out.count(Status.MISS) != n:
            for s in set(out):
                if s in _FAULTS:
                    self.warn_once(f"{op}.{s.name}", "%s: %s (counted in stats from now on)", op, s.name)
        self.count(op, out)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class Ahead:
    """What an engine's `Engine._send_ahead` sent: the engine's own state for
    `Engine._get_sent`, and ``cancel()``, which drops the requests' replies unread (a
    Redis engine closes the connection they are on)."""

    def cancel(self) -> None:
        raise NotImplementedError


class PendingGet:
    """A `get_into` started by `Engine.get_ahead`, ended by `into` or `cancel`; used on
    one thread."""

    def __init__(self, engine: Engine, keys: List[str], nbytes: List[int], ahead: Optional[Ahead]):
        self.engine, self.keys, self.nbytes = engine, keys, nbytes
        self._ahead = ahead
        self._ended = False

    def into(self, targets: Sequence[Buffers], landed: Optional[Callable[[int], None]] = None) -> List[Status]:
        """`Engine.get_into` of the keys into ``targets`` (each of the length given to
        `get_ahead`): the same statuses, counters, ``landed`` and checks."""
        if self._ended:
            raise fail("into", "a second call", "a PendingGet is read or cancelled once")
        engine, keys = self.engine, self.keys
        try:
            targets = _buffers("targets", targets, len(keys), writable=True)
            for i, (views, n) in enumerate(zip(targets, self.nbytes)):
                got = sum(v.nbytes for v in views)
                if got != n:
                    raise fail(f"targets[{i}]", f"{got} B", f"must be the {n} B given to get_ahead")
        except BaseException:
            self.cancel()
            raise
        self._ended = True
        ahead, self._ahead = self._ahead, None
        landed = landed or _unheard
        if ahead is None:
            return engine._guarded("get", len(keys), lambda: engine._get_into(keys, targets, landed))
        return engine._guarded("get", len(keys), lambda: engine._get_sent(ahead, keys, targets, landed))

    def cancel(self) -> None:
        """Drop the call: nothing is read (replies already on their way are dropped)."""
        self._ended = True
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.cancel()


class RawCalls:
    """Raw calls of ``count`` values of ``value_bytes``, each value from and into a
    buffer of its own: `set` writes ``count`` new keys, `get` reads the keys the last
    `set` wrote, `clear` removes every key written so far, `close` that and anything
    else the calls hold. A value not stored or not read back raises `RuntimeError`
    (a raw figure of failed calls means nothing). ``how`` says what the calls are.

    This one goes through the engine's own `put_from` and `get_into` (every check and
    count of the engine included); engines override `Engine.raw_calls` with the store's
    own client call where they have one."""

    def __init__(self, engine: "Engine", value_bytes: int, count: int):
        for arg, v in (("value_bytes", value_bytes), ("count", count)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise fail(arg, v, "must be a positive int")
        self.engine, self.value_bytes, self.count = engine, value_bytes, count
        self.sources = [memoryview(bytearray(_noise(value_bytes))) for _ in range(count)]
        self.targets = [memoryview(bytearray(value_bytes)) for _ in range(count)]
        self.keys: List[str] = []
        self.written: List[str] = []
        self.how = (f"{type(engine).__name__}.put_from / get_into of {count} value(s) of "
                    f"{value_bytes} B, one buffer each")

    def fresh_keys(self) -> List[str]:
        """``count`` new key names, remembered for `clear`."""
        import uuid
        self.keys = [f"kvtier-raw-{uuid.uuid4().hex}" for _ in range(self.count)]
        self.written += self.keys
        return self.keys

    def set(self) -> None:
        statuses = self.engine.put_from(self.fresh_keys(), [[s] for s in self.sources])
        _all_stored("put_from", statuses)

    def get(self) -> None:
        statuses = self.engine.get_into(self.keys, [[t] for t in self.targets])
        _all_stored("get_into", statuses)

    def clear(self) -> None:
        written, self.written = self.written, []
        if written:
            self.engine.delete(written)

    def close(self) -> None:
        self.clear()


def _noise(n: int) -> bytes:
    import os
    return os.urandom(n)


def _all_stored(call: str, statuses) -> None:
    bad = sorted({s.name for s in statuses if s != Status.HIT})
    if bad:
        raise RuntimeError(f"raw {call} answered {', '.join(bad)}")


def _unheard(i: int) -> None:
    """`Engine.get_into`'s ``landed`` and `Engine.put_from`'s ``fill`` where the caller
    gave none."""


def _keys(keys) -> List[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)):
        raise fail("keys", type(keys).__name__, "must be a list of str keys")
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise fail(f"keys[{i}]", k, "must be a non-empty str")
    return list(keys)


def _buffers(arg: str, seqs, n: int, writable: bool) -> List[Sequence[memoryview]]:
    if not isinstance(seqs, (list, tuple)) or len(seqs) != n:
        got = len(seqs) if isinstance(seqs, (list, tuple)) else type(seqs).__name__
        raise fail(arg, got, f"must be a list of {n} buffer lists, one per key")
    out = []
    for i, seq in enumerate(seqs):
        if not isinstance(seq, (list, tuple)) or not seq:
            raise fail(f"{arg}[{i}]", type(seq).__name__, "must be a non-empty list of buffers")
        for b in seq:
            if not (type(b) is memoryview and b.format == "B" and b.ndim == 1 and b.contiguous
                    and not (writable and b.readonly)):
                break
        else:       # byte views already: as it is (a new list a key would live through the call)
            out.append(seq)
            continue
        views = []
        for j, b in enumerate(seq):
            try:
                v = b if isinstance(b, memoryview) else memoryview(b)
            except TypeError:
                raise fail(f"{arg}[{i}][{j}]", type(b).__name__, "must support the buffer protocol") from None
            if writable and v.readonly:
                raise fail(f"{arg}[{i}][{j}]", "read-only buffer", "get_into writes into it")
            if not v.contiguous:
                raise fail(f"{arg}[{i}][{j}]", "non-contiguous buffer", "must be contiguous")
            views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
        out.append(views)
    return out


# ---------------------------------------------------------------------- by URL
# scheme -> (module, class name); modules are imported only when their URL is opened.
SCHEMES: Dict[str, Tuple[str, str]] = {
    "file": ("kvtier.store.file", "FileEngine"),
    "redis": ("kvtier.store.redis", "RedisEngine"),
    "valkey": ("kvtier.store.redis", "RedisEngine"),
    "redis+cluster": ("kvtier.store.redis", "RedisClusterEngine"),
    "valkey+cluster": ("kvtier.store.redis", "RedisClusterEngine"),
    "rediss": ("kvtier.store.redis", "RedisEngine"),
    "valkeys": ("kvtier.store.redis", "RedisEngine"),
    "rediss+cluster": ("kvtier.store.redis", "RedisClusterEngine"),
    "valkeys+cluster": ("kvtier.store.redis", "RedisClusterEngine"),
    "mooncake": ("kvtier.store.mooncake", "MooncakeEngine"),
}


# The URL forms `open_store` takes, for errors that list them.
URL_FORMS = ("file:///dir[?max_bytes=N], redis://host:port, rediss://host:port?ca=..., "
             "redis+cluster://host:port[,...], rediss+cluster://..., valkey://..., mooncake://...")


def open_store(url: str, timeout_ms: int = DEFAULT_TIMEOUT_MS, **options) -> Engine:
    """The engine for ``url``, connected (a store that cannot be reached raises
    `KvtierError` naming the URL, as does a malformed URL or a missing client library)."""
    if not isinstance(url, str) or "://" not in url:
        raise fail("url", url, f"must be a store URL: {URL_FORMS}")
    scheme = url.split("://", 1)[0].lower()      # urlsplit raises on some malformed URLs
    if scheme not in SCHEMES:
        raise fail("url", url, f"unknown scheme {scheme!r}; one of {sorted(SCHEMES)}")
    module, cls = SCHEMES[scheme]
    try:
        engine_cls = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise fail("url", url, f"its engine needs a client library that is not installed ({e}); "
                   "pip install 'kvtier[store]'") from None
    return engine_cls(url, timeout_ms=timeout_ms, **options)


__all__ = ["Engine", "PendingGet", "RawCalls", "Status", "open_store", "SCHEMES", "DEFAULT_TIMEOUT_MS", "KvtierError"]
