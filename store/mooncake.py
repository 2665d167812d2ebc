"""Mooncake Store engine (``mooncake://``): a Mooncake Store client in this process
(one per configuration, shared by the engines that use it: `kvtier.store.mooncake_client`).

URL::

    mooncake://MASTER_HOST:PORT[?option=value&...]

``MASTER_HOST:PORT`` is the Mooncake master's RPC address (``mooncake_master
--rpc_port``). Options (sizes take K, M, G, T suffixes, binary: ``64M`` = 64 MiB):

- ``metadata=p2p`` (default): Mooncake's P2P handshake, no metadata service; or the
  metadata service's own address (``http://host:port/metadata``, ``etcd://host:port``).
- ``protocol=tcp`` (default) or ``rdma`` (with ``device=NAME[,NAME]``).
- ``segment=0`` (default): memory this process lends the store. 0 makes a pure client
  that keeps objects on the store's other nodes; give a size to hold objects here too.
- ``buffer=16M``: Mooncake's own transfer buffer (its copying calls; kvtier uses none).
- ``staging=64M``: each registered staging region (see below); the largest object.
- ``transfer=staged`` (default) or ``direct`` (see below).
- ``replicas=1``: copies of each object on distinct nodes.
- ``local=HOST``: this client's address as other nodes see it (default: 127.0.0.1 for
  a loopback master, else the local address that routes to the master).

Writes go straight from the caller's memory (zero-copy: ``batch_put_from``, or
``batch_put_from_multi_buffers`` for several buffers), except an object in many or
small pieces (under 256 KiB a piece on average: each piece is one transfer), which is
gathered in a registered staging region first. Mooncake's put keeps an object
already under the key, and its upsert rewrites an object of the same length in place,
under its readers; so a put removes the old object first, and where Mooncake refuses
that because the object is leased (read or looked up within the master's
``--default_kv_lease_ttl``, 10 s by default) the put answers ERROR: an object is never
rewritten under a reader (a reader racing a replacement sees the old object, a miss,
or the new one). ``delete`` removes leased objects too (``force``). Reads depend on
``transfer``:

- ``staged``: Mooncake reads into a registered staging region and the bytes are copied
  into the caller's buffers once the call has returned, each value reported landed
  (`Engine.get_into`'s ``landed``) as soon as it is copied. A read abandoned at the
  deadline (a hung master or store node) keeps its region until Mooncake returns, so a
  late answer can never land in the caller's memory.
- ``direct``: Mooncake reads straight into the caller's buffers (zero-copy; objects
  in many or small pieces are staged, as writes are). An
  abandoned read may still write there after the call returned TIMEOUT: use it only
  where Mooncake's own timeouts (``MC_RPC_TIMEOUT_MS``, ``MC_TCP_STATUS_TIMEOUT_SEC``)
  are below kvtier's. Over RDMA the caller's memory must be registered
  (`MooncakeEngine.register_memory`, e.g. a host pool's buffers); pieces outside it go
  through staging.

Bounds: Mooncake's calls wait up to 30 s on a silent master or node; each call here runs
on a worker thread and is answered TIMEOUT at the engine's timeout (`deadline`).
``setup`` and ``close`` hold the GIL while they wait, so the master is probed first
(`mooncake_client.probe_master`) and a silent one fails construction at once. Looking a
key up (``exists``) or reading it gives it a lease in Mooncake: a put over it is refused
for the lease time, a delete is not.

Network: Mooncake's transfer engine listens on all interfaces for its TCP data and
handshake ports (it has no bind option; the master binds ``--rpc_address``). CI runs
its Mooncake tests in a private network namespace (``.ci/mooncake.sh``).
"""
from __future__ import annotations

import contextlib
import threading
import time
import uuid
import weakref
from typing import Dict, List, Optional, Sequence

from kvtier.errors import fail

from . import mooncake_client as clients
from .deadline import DeadlineWorkers, Outcome
from .engine import DEFAULT_TIMEOUT_MS, Engine, Status
from .mooncake_url import MooncakeURL, parse_url

# Mooncake's error codes (mooncake-store/include/types.h) that decide a status.
_NOT_FOUND = {-704, -710, -712, -703}   # object / replica not found, gone, not ready
_RPC_TIMEOUT = -901
_NO_SPACE = -200
_LEASED = {-706, -714}                  # object has a lease / replicas busy: not removed
_BUSY = "busy"                          # a put refused over a leased object
_AMBIGUOUS_GET = {-600, -800}           # a target of another length reads as one of these

SELF_TEST_S = 2.0
# Buffers one Mooncake call moves at most. Its TCP transport queues 1024 transfers per
# peer and admits 1024 more for a second; a call past that fails its keys (-800) or,
# far past it, hangs. Half the queue leaves room for a second thread's call.
MAX_PIECES_PER_CALL = 512
# Each buffer is one transfer in Mooncake's TCP transport; an object in pieces smaller
# than this on average moves faster gathered in a staging region (one transfer and a
# copy) than piece by piece (docs/store-mooncake.md: 64 pieces of 16 KiB moved at a
# third of the speed of one buffer; a 64-byte header beside a 256 KiB payload read at
# 0.75x of one buffer, staged at 0.9x; beside 1 MiB, at 0.96x).
MIN_MEAN_PIECE = 256 << 10


def _address(view: memoryview) -> int:
    import numpy as np
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


# ---------------------------------------------------------------------- the engine
class MooncakeEngine(Engine):
    """`Engine` over one Mooncake Store client (see the module docstring for the URL)."""

    scheme = "mooncake"

    def __init__(self, url: str, timeout_ms: int = DEFAULT_TIMEOUT_MS):
        super().__init__(url, timeout_ms=timeout_ms)
        self.config = cfg = parse_url(url)
        store_module = clients.import_client(url)
        self._client = clients.acquire(url, cfg, store_module, self.timeout)
        self._store = self._client.store
        self._closed = False
        self._users = 0                 # calls inside the engine now (close waits for them)
        self._users_lock = threading.Condition()
        self._registered: List[int] = []
        self._workers = DeadlineWorkers("kvtier-mooncake")
        self._replicate = store_module.ReplicateConfig()
        self._replicate.replica_num = cfg.replicas
        self._staging = self._client.staging(cfg.staging)
        # An engine dropped without close() gives back its registrations and its hold on
        # the client all the same (memory registered with Mooncake must not be freed).
        self._finalizer = weakref.finalize(self, _forget, self._client, self._registered)
        try:
            self._self_test()
        except Exception:
            self.close()
            raise

    # ------------------------------------------------------------------ public extras
    def register_memory(self, buffers: Sequence[object]) -> None:
        """Register host memory (a host pool's buffers) with Mooncake, once per buffer,
        until `close`: ``transfer=direct`` over RDMA then reads into it with no staging
        copy (over TCP any host memory will do)."""
        with self._using():
            for i, b in enumerate(buffers):
                try:
                    view = memoryview(b).cast("B")
                except (TypeError, ValueError):
                    raise fail(f"buffers[{i}]", type(b).__name__,
                               "must be a contiguous buffer") from None
                start = _address(view)
                if start in self._registered:
                    continue
                rc = self._client.register(start, view.nbytes)
                if rc != 0:
                    raise fail(f"buffers[{i}]", f"{view.nbytes} bytes at {start:#x}",
                               f"Mooncake refused to register it (code {rc})")
                self._registered.append(start)

    def close(self) -> None:
        with self._users_lock:
            if getattr(self, "_closed", True):
                return
            self._closed = True
            end = time.monotonic() + self.timeout
            while self._users and self._users_lock.wait(max(0.0, end - time.monotonic())):
                pass
            users = self._users
        while self._workers.in_flight and time.monotonic() < end:
            time.sleep(0.005)
        self._workers.close()
        busy = users or self._workers.in_flight
        if busy:    # a call still inside Mooncake may write to what would be released
            self.warn_once("close", "closed with %d calls still inside Mooncake; its client "
                           "and memory are kept", busy)
            return
        self._finalizer.detach()
        for start in self._registered:
            self._client.unregister(start)
        why = clients.release(self._client, self.config.host, self.config.port, self.timeout)
        if why:
            self.warn_once("close", "%s", why)

    @contextlib.contextmanager
    def _using(self):
        """A call's hold on the client: none starts after close(), which waits for them."""
        with self._users_lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._users += 1
        try:
            yield
        finally:
            with self._users_lock:
                self._users -= 1
                self._users_lock.notify_all()

    def raw_throughput(self, value_bytes: int, count: int) -> Dict[str, float]:
        """Mooncake's own ``batch_put_from`` / ``batch_get_into`` of ``count`` values of
        ``value_bytes`` on registered buffers, in batches of up to 128 keys."""
        for arg, v in (("value_bytes", value_bytes), ("count", count)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise fail(arg, v, "must be a positive int")
        with self._using():
            return self._raw(value_bytes, count)

    def _raw(self, value_bytes: int, count: int) -> Dict[str, float]:
        import numpy as np
        batch = min(count, 128)
        src = np.random.randint(0, 256, batch * value_bytes, dtype=np.uint8)
        dst = np.zeros(batch * value_bytes, dtype=np.uint8)
        prefix = f"kvtier-raw-{uuid.uuid4().hex}-"
        keys = [f"{prefix}{i}" for i in range(count)]
        for a in (src, dst):
            if self._client.register(a.ctypes.data, a.nbytes) != 0:
                raise RuntimeError("Mooncake refused to register the measurement buffers")

        def timed(call, buf, ok) -> float:
            """Seconds ``call`` (batch_put_from or batch_get_into) took over every batch."""
            seconds = 0.0
            for lo in range(0, count, batch):
                chunk = keys[lo:lo + batch]
                ptrs = [buf.ctypes.data + i * value_bytes for i in range(len(chunk))]
                t = time.perf_counter()
                rc = call(chunk, ptrs, [value_bytes] * len(chunk))
                seconds += time.perf_counter() - t
                if any(r != ok for r in rc):
                    raise RuntimeError(f"Mooncake's {call.__name__} failed: codes {sorted(set(rc))}")
            return seconds
        try:
            put_s = timed(self._store.batch_put_from, src, 0)
            get_s = timed(self._store.batch_get_into, dst, value_bytes)
            last = (count - 1) % batch + 1          # the last batch's values
            if not np.array_equal(src[:last * value_bytes], dst[:last * value_bytes]):
                raise RuntimeError("Mooncake's batch_get_into returned other bytes than were put")
        finally:
            self._store.batch_remove(keys, True)
            for a in (src, dst):
                self._client.unregister(a.ctypes.data)
        total = count * value_bytes / 1e9
        return {"get_gbps": total / get_s, "set_gbps": total / put_s,
                "how": f"Mooncake batch_get_into / batch_put_from, registered buffers, "
                       f"batches of {batch}"}

    # ------------------------------------------------------------------ engine calls
    def _exists(self, keys: List[str]) -> List[Status]:
        with self._using():
            return self._exists_now(keys)

    def _delete(self, keys: List[str]) -> List[Status]:
        with self._using():
            return self._delete_now(keys)

    def _get_into(self, keys: List[str], targets: List[List[memoryview]], landed) -> List[Status]:
        with self._using():
            return self._get_now(keys, targets, landed)

    def _put_from(self, keys: List[str], sources: List[List[memoryview]], fill) -> List[Status]:
        with self._using():         # batch calls read every source at once: filled already
            return self._put_now(keys, sources)

    def _exists_now(self, keys: List[str]) -> List[Status]:
        codes = self._call("exists", self._deadline(), lambda: self._store.batch_is_exist(keys))
        if codes is None:
            return self._unanswered(len(keys))
        return [Status.HIT if c == 1 else Status.MISS if c == 0 else _fault(c) for c in codes]

    def _delete_now(self, keys: List[str]) -> List[Status]:
        codes = self._call("delete", self._deadline(), lambda: self._store.batch_remove(keys, True))
        if codes is None:
            return self._unanswered(len(keys))
        return [Status.HIT if c == 0 or c in _NOT_FOUND else _fault(c) for c in codes]

    def _get_now(self, keys: List[str], targets: List[List[memoryview]], landed) -> List[Status]:
        end = self._deadline()
        lengths = [sum(v.nbytes for v in t) for t in targets]
        out: List[Optional[Status]] = [None] * len(keys)
        for idx in _rounds(keys):
            self._get_some(keys, targets, lengths, idx, out, end, landed)
        return out

    def _put_now(self, keys: List[str], sources: List[List[memoryview]]) -> List[Status]:
        end = self._deadline()
        lengths = [sum(v.nbytes for v in s) for s in sources]
        out: List[Optional[Status]] = [None] * len(keys)
        for idx in _rounds(keys):       # a key given twice: the later source is written last
            self._put_some(keys, sources, lengths, idx, out, end)
        return out

    def _get_some(self, keys, targets, lengths, idx, out, end, landed) -> None:
        direct: List[int] = []
        staged: List[int] = []
        for i in idx:
            use_direct = self.config.transfer == "direct" and self._zero_copy(targets[i], lengths[i])
            (direct if use_direct else staged).append(i)
        if direct:
            self._direct_get(keys, targets, lengths, direct, out, end)
        if staged:
            self._staged_get(keys, targets, lengths, staged, out, end, landed)

    def _put_some(self, keys, sources, lengths, idx, out, end) -> None:
        direct: List[int] = []      # written from the caller's pieces (zero-copy)
        gathered: List[int] = []    # gathered in a staging region first
        for i in idx:
            (direct if self._zero_copy(sources[i], lengths[i]) else gathered).append(i)
        if direct:
            ks = [keys[i] for i in direct]
            ptrs = [[_address(v) for v in sources[i]] for i in direct]
            sizes = [[v.nbytes for v in sources[i]] for i in direct]
            codes = self._call("put", end, lambda: self._replace(ks, ptrs, sizes),
                               keep=[sources[i] for i in direct])
            self._answer(out, direct, codes, self._put_status)
        for group, region in self._regions(gathered, lengths, out, end):
            offsets, at = [], 0
            for i in group:
                offsets.append(at)
                for piece in sources[i]:
                    region.view[at:at + piece.nbytes] = piece
                    at += piece.nbytes
            ks = [keys[i] for i in group]
            ptrs = [[region.address + o] for o in offsets]
            sizes = [[lengths[i]] for i in group]
            codes = self._call("put", end, lambda: self._replace(ks, ptrs, sizes), region=region)
            if codes is not None:
                self._staging.give(region)
            self._answer(out, group, codes, self._put_status)

    def _replace(self, keys, ptrs, sizes) -> List[int]:
        """Put each object whole in place of any under its key (on a worker). Mooncake's
        put keeps an existing object, and its upsert rewrites one of the same length in
        place under its readers: the old object is removed first, unless it is leased
        (read or looked up within the master's lease time), when the put is refused
        (_BUSY) rather than mixed into a read."""
        removed = self._store.batch_remove(keys, False)
        codes: list = [0 if c == 0 or c in _NOT_FOUND else _BUSY if c in _LEASED else c
                       for c in removed]
        go = [j for j, c in enumerate(codes) if c == 0]
        whole = [j for j in go if len(ptrs[j]) == 1]
        parts = [j for j in go if len(ptrs[j]) > 1]
        for a, b in _spans([1] * len(whole)):
            part = whole[a:b]
            got = self._store.batch_put_from([keys[j] for j in part], [ptrs[j][0] for j in part],
                                             [sizes[j][0] for j in part], self._replicate)
            for j, c in zip(part, got):
                codes[j] = c
        for a, b in _spans([len(ptrs[j]) for j in parts]):
            part = parts[a:b]
            got = self._store.batch_put_from_multi_buffers(
                [keys[j] for j in part], [ptrs[j] for j in part], [sizes[j] for j in part],
                self._replicate)
            for j, c in zip(part, got):
                codes[j] = c
        return codes

    # ------------------------------------------------------------------ reads
    def _direct_get(self, keys, targets, lengths, idx, out, end) -> None:
        ks = [keys[i] for i in idx]
        want = [lengths[i] for i in idx]
        ptrs = [[_address(v) for v in targets[i]] for i in idx]
        sizes = [[v.nbytes for v in targets[i]] for i in idx]

        def read():
            codes = []
            for a, b in _spans([len(p) for p in ptrs]):
                codes += self._store.batch_get_into_multi_buffers(ks[a:b], ptrs[a:b], sizes[a:b])
            return self._check_lengths(ks, want, codes)
        codes = self._call("get", end, read, keep=[targets[i] for i in idx])
        self._answer(out, idx, codes, self._get_status)

    def _staged_get(self, keys, targets, lengths, idx, out, end, landed) -> None:
        """Reads into a staging region, then each value copied into its target and
        reported there (``landed``: a reader checks it while the CPU's cache holds it);
        a direct read lands every value at once and reports none."""
        for group, region in self._regions(idx, lengths, out, end):
            offsets, at = [], 0
            for i in group:
                offsets.append(at)
                at += lengths[i]
            ks = [keys[i] for i in group]
            want = [lengths[i] for i in group]
            ptrs = [region.address + o for o in offsets]

            def read():
                codes = []
                for a, b in _spans([1] * len(ks)):
                    codes += self._store.batch_get_into(ks[a:b], ptrs[a:b], want[a:b])
                return self._check_lengths(ks, want, codes)
            codes = self._call("get", end, read, region=region)
            if codes is not None:       # Mooncake has returned: the region is ours to read
                for i, off, code in zip(group, offsets, codes):
                    if code == lengths[i]:
                        at = off
                        for piece in targets[i]:
                            piece[:] = region.view[at:at + piece.nbytes]
                            at += piece.nbytes
                        landed(i)
                self._staging.give(region)
            self._answer(out, group, codes, self._get_status)

    def _check_lengths(self, keys, want, codes) -> list:
        """Mooncake's codes, with ("length", n) where the stored object has another length
        than the target: Mooncake answers a shorter one with its length and a longer one
        (or a multi-buffer mismatch) with an ambiguous code, settled by asking its size."""
        out: list = []
        for key, n, code in zip(keys, want, codes):
            if 0 <= code != n:
                out.append(("length", code))
            elif code in _AMBIGUOUS_GET:
                size = self._store.get_size(key)
                out.append(("length", size) if size >= 0 and size != n else
                           -704 if size in _NOT_FOUND else code)
            else:
                out.append(code)
        return out

    # ------------------------------------------------------------------ plumbing
    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _zero_copy(self, pieces: List[memoryview], length: int) -> bool:
        """Whether Mooncake should move an object straight to or from its pieces: few
        enough, large enough, and memory it may reach (any host memory over TCP, only
        registered memory over RDMA)."""
        if len(pieces) > 1 and (len(pieces) > MAX_PIECES_PER_CALL
                                or length < MIN_MEAN_PIECE * len(pieces)):
            return False
        if self.config.protocol == "tcp":
            return True
        return all(self._client.covers(_address(v), v.nbytes) for v in pieces)

    def _regions(self, idx: List[int], lengths: List[int], out, end: float):
        """Yield groups of ``idx`` that fit one staging region, each with a region (the
        caller gives it back, or the late call does); keys that get none are answered
        in ``out``."""
        cap = self._staging.size
        groups: List[List[int]] = []
        used = 0
        for i in idx:
            if lengths[i] > cap:
                self.warn_once("staging.small", "an object of %d bytes exceeds staging=%d "
                               "bytes; raise staging= in the URL", lengths[i], cap)
                out[i] = Status.ERROR
                continue
            if not groups or used + lengths[i] > cap:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += lengths[i]
        for group in groups:
            region = None
            if time.monotonic() < end:
                try:
                    region = self._staging.take()
                except RuntimeError as e:
                    self.warn_once("staging.register", "%s", e)
                    for i in group:
                        out[i] = Status.ERROR
                    continue
                if region is None:
                    self.warn_once("staging.busy", "every staging region is held by a call the "
                                   "store has not answered; answering TIMEOUT")
            if region is None:
                for i in group:
                    out[i] = Status.TIMEOUT
                continue
            yield group, region

    def _call(self, op: str, end: float, fn, region: Optional[clients.Region] = None, keep=None):
        """Mooncake's answer to ``fn``, run on a worker until ``end``; None where it did
        not answer in time (the region then follows the call and comes back when
        Mooncake returns). ``keep``: the caller's buffers Mooncake reads or writes."""
        on_late = (lambda: self._staging.give(region)) if region is not None else None
        left = end - time.monotonic()
        outcome, codes = (self._workers.call(fn, left, on_late, keep=keep) if left > 0
                          else (Outcome.LATE, None))
        if outcome is Outcome.DONE:
            return codes
        if region is not None and (left <= 0 or outcome is Outcome.BUSY):
            self._staging.give(region)      # never lent to Mooncake
        with self._stats_lock:
            self.stats[f"{op}.unanswered_calls"] += 1
        if outcome is Outcome.LATE:
            self.warn_once(f"{op}.late", "%s: no answer from Mooncake within %.3f s; the call "
                           "goes on in the background", op, self.timeout)
        else:
            self.warn_once("busy", "every worker waits on a call the store has not answered; "
                           "answering TIMEOUT at once")
        return None

    @staticmethod
    def _unanswered(n: int) -> List[Status]:
        return [Status.TIMEOUT] * n

    def _answer(self, out, idx, codes, status_of) -> None:
        if codes is None:
            for i in idx:
                out[i] = Status.TIMEOUT
            return
        if len(codes) != len(idx):
            raise RuntimeError(f"Mooncake returned {len(codes)} codes for {len(idx)} keys")
        for i, code in zip(idx, codes):
            out[i] = status_of(code)

    def _get_status(self, code) -> Status:
        if isinstance(code, tuple):     # ("length", n): an object of another length
            self.warn_once("get.length", "a stored object of %d bytes where the target has "
                           "another length: CORRUPT", code[1])
            return Status.CORRUPT
        if code >= 0:
            return Status.HIT
        if code in _NOT_FOUND:
            return Status.MISS
        return _fault(code)

    def _put_status(self, code) -> Status:
        if code == 0:
            return Status.HIT
        if code == _BUSY:
            self.warn_once("put.leased", "an object read or looked up within the master's "
                           "lease time is not replaced (Mooncake would rewrite it under its "
                           "readers): ERROR")
            return Status.ERROR
        if code == _NO_SPACE:
            self.warn_once("put.space", "the store has no room for an object (code %d)", code)
        return _fault(code)

    def _self_test(self) -> None:
        """One small object put, read back and removed: a store that cannot hold one (no
        node lends memory, a transfer path that fails) fails at construction. It may
        take SELF_TEST_S (a first transfer opens connections to the store node)."""
        import numpy as np
        key = f"kvtier-probe-{uuid.uuid4().hex}"
        data = np.random.randint(0, 256, 4096, dtype=np.uint8)
        back = np.zeros(4096, dtype=np.uint8)
        timeout, self.timeout = self.timeout, max(self.timeout, SELF_TEST_S)
        try:
            put = self.put_from([key], [[memoryview(data)]])[0]
            if put != Status.HIT:
                why = {Status.TIMEOUT: f"did not answer within {self.timeout:.3f} s"}.get(
                    put, "refused it (no store node lends memory? start one, or give segment=SIZE)")
                raise fail("url", self.url, f"a 4 KiB test object could not be stored: Mooncake {why}")
            got = self.get_into([key], [[memoryview(back)]])[0]
            self.delete([key])
        finally:
            self.timeout = timeout
        if got != Status.HIT or not np.array_equal(back, data):
            raise fail("url", self.url, f"a 4 KiB test object did not read back ({got.name})")
        self.stats.clear()


def _forget(client, registered: List[int]) -> None:
    """What close() gives back, for an engine collected without it (no master probe:
    the client stays kept)."""
    for start in registered:
        client.unregister(start)
    clients.drop(client)


def _rounds(keys: List[str]) -> List[List[int]]:
    """Indices of ``keys`` in rounds with no key twice (Mooncake answers a key given
    twice in one call for one of its buffers only): first occurrences, then seconds..."""
    seen: Dict[str, int] = {}
    rounds: List[List[int]] = []
    for i, k in enumerate(keys):
        r = seen.get(k, 0)
        seen[k] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(i)
    return rounds


def _spans(pieces: List[int]):
    """(start, stop) of consecutive runs of keys moving at most MAX_PIECES_PER_CALL
    buffers each (a key with more has a run of its own)."""
    start, total = 0, 0
    for i, n in enumerate(pieces):
        if total and total + n > MAX_PIECES_PER_CALL:
            yield start, i
            start, total = i, 0
        total += n
    if start < len(pieces):
        yield start, len(pieces)


def _fault(code: int) -> Status:
    return Status.TIMEOUT if code == _RPC_TIMEOUT else Status.ERROR


__all__ = ["MooncakeEngine", "MooncakeURL", "parse_url"]
