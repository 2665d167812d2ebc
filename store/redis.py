"""Redis and Valkey engines: one node (``redis://``, ``valkey://``) or a cluster
(``redis+cluster://``, ``valkey+cluster://``), over TLS with ``rediss://`` and
``rediss+cluster://`` (``valkeys://...``); URL syntax in `kvtier.store.redis_url`, the
TLS context (built once per engine, used for every node) in `kvtier.store.redis_tls`.

They speak RESP themselves (`kvtier.store.resp`: bulk replies land in the page buffers,
values are sent from them) and need no client library. A call's keys are grouped by
node, each group pipelined on one connection (or spread over ``connections``, one for
each `SPREAD_BYTES` of its values at most), the groups of different nodes at once on a
small thread pool (one runs on the calling thread), all under one deadline: the
engine's timeout from the call's start. A node that does not answer by then gives its
keys TIMEOUT and is not tried again for one timeout (its keys are TIMEOUT at once); a
refused or reset connection gives ERROR; other nodes' keys are not held up.

Writes to a master that lists a connected replica (``ROLE``, asked in a write's
pipeline at most every `ROLE_EVERY` per node, and again after a fault or a ``WAIT`` no
replica answered) are acknowledged only once one replica has them (``WAIT 1``), so an
acknowledged page survives the master's death; a master left without replicas (after a
failover) takes writes without waiting.

The cluster engine routes each key by its hash slot (CRC16 of the key or of its
``{hash tag}``), follows MOVED and ASK redirects, and reloads the slot map
(``CLUSTER SLOTS``) after a redirect or a node's fault, at most every 100 ms, so service
resumes as soon as the cluster has promoted a replica."""
from __future__ import annotations

import binascii
import concurrent.futures
import functools
import re
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from kvtier.errors import fail

from . import redis_ops as ops
from . import redis_tls
from . import resp
from .engine import DEFAULT_TIMEOUT_MS, Ahead, Engine, RawCalls, Status
from .redis_url import RedisUrl, parse, redacted

SLOTS = 16384
MAX_IDLE = 8                # idle connections kept per node
SPREAD_BYTES = 2 << 20      # a call's values a connection carries before the call spreads over another
MAX_ROUNDS = 5              # redirects followed per key in one call
REFRESH_EVERY = 0.1         # seconds between slot-map reloads while it is stale
# Where a TLS server ended a connection just after its handshake (message parts).
_REFUSED_CLIENT = ("certificate required", "EOF occurred", "reset by peer", "closed the connection")
ROLE_EVERY = 0.1            # seconds a node's ROLE answer is used for before a write asks again


# redis-benchmark's key names in a cluster: a tag of a few characters, which may hold "}"
_BENCHMARK_KEY = re.compile(rb"key:\{(.{1,8}?)\}:(?:__rand_int__|\d{12})\Z", re.DOTALL)


def key_slot(key: bytes) -> int:
    """The cluster hash slot of ``key``: CRC16 (XMODEM, as ``binascii.crc_hqx``) of the
    key, or of its hash tag (the text between the first ``{`` and the next ``}``, when
    not empty), modulo 16384."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return binascii.crc_hqx(key, 0) & (SLOTS - 1)


class Node:
    """One server: its address and a pool of idle connections (each used by one thread
    at a time)."""

    def __init__(self, host: str, port: int, conf: RedisUrl, tls=None):
        self.host, self.port = host, port
        self._conf = conf
        self._tls = tls             # the engine's ssl.SSLContext (None: plain TCP)
        self._idle: List[resp.Connection] = []
        self._lock = threading.Lock()
        self.held_until = 0.0       # after a timeout, not tried again before this
        self.closed = False
        # What ROLE last said (replicas connected; None: not a master), and until when
        # writes go by it without asking again (`ROLE_EVERY`; a fault or an unanswered
        # WAIT ends it at once).
        self.replicas: Optional[int] = None
        self.role_until = 0.0

    def role_known(self, now: float) -> bool:
        return now < self.role_until

    def learned_role(self, replicas: Optional[int]) -> None:
        self.replicas, self.role_until = replicas, time.monotonic() + ROLE_EVERY

    def forget_role(self) -> None:
        self.role_until = 0.0

    def acquire(self, deadline: float) -> resp.Connection:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if not conn.stale():
                return conn
            conn.close()            # the server went away while it was idle
        conn = resp.Connection(self.host, self.port, deadline, self._tls)
        try:
            self._hello(conn, deadline)
        except BaseException:
            conn.close()
            raise
        return conn

    def release(self, conn: resp.Connection) -> None:
        if not conn.broken and not self.closed:
            with self._lock:
                if len(self._idle) < MAX_IDLE:
                    self._idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        self.closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def _hello(self, conn: resp.Connection, deadline: float) -> None:
        conf = self._conf
        if conf.password is not None:
            args = ("AUTH", conf.username, conf.password) if conf.username else ("AUTH", conf.password)
            reply = conn.call(deadline, *args)
            if isinstance(reply, resp.ReplyError):
                conn.close()
                raise resp.ConnectionFault(f"{self} refused AUTH: {reply}")
        if conf.db:
            reply = conn.call(deadline, "SELECT", conf.db)
            if isinstance(reply, resp.ReplyError):
                conn.close()
                raise resp.ConnectionFault(f"{self} refused SELECT {conf.db}: {reply}")

    def __repr__(self) -> str:
        return f"{self.host}:{self.port}"


class _RedisEngine(Engine):
    """What both engines share: items, groups, the thread pool, faults and waits."""

    cluster = False
    fills_as_sent = True
    sends_ahead = True

    def __init__(self, url: str, timeout_ms: int = DEFAULT_TIMEOUT_MS):
        conf = parse(url, cluster=self.cluster)
        super().__init__(redacted(url), timeout_ms)
        self._conf = conf
        self._tls = redis_tls.context(conf, self.url) if conf.tls else None
        self._nodes: Dict[Tuple[str, int], Node] = {}
        self._nodes_lock = threading.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ Engine
    def _exists(self, keys: List[str]) -> List[Status]:
        return self._run(ops.exists, [ops.Item(k.encode(), (), 0) for k in keys])

    def _get_into(self, keys, targets, landed) -> List[Status]:
        return self._run(ops.get_into, self._get_items(keys, targets, landed))

    @staticmethod
    def _get_items(keys, targets, landed) -> List[ops.Item]:
        return [ops.Item(k.encode(), t, sum([v.nbytes for v in t]), landed=landed, index=i)
                for i, (k, t) in enumerate(zip(keys, targets))]

    def _send_ahead(self, keys, nbytes) -> Optional["_SentGets"]:
        """The call's GETs, grouped into its tasks as `_run` groups them (by node, then
        connection), each task's first window sent now on a connection of its own that
        the `_SentGets` holds. A task whose node is held or whose send failed is left
        to the call at `into`, which meets the fault and reports it; None where no
        task could be sent or some key's slot has no master."""
        if self._closed:
            return None
        deadline = time.monotonic() + self.timeout
        items = [ops.Item(k.encode(), (), n) for k, n in zip(keys, nbytes)]
        sent = _SentGets(deadline)
        try:
            groups = self._route(items, list(range(len(items))), {}, deadline)
            if None in groups:
                return None
            for node, idxs in self._tasks(groups, items):
                conn = None
                if self._not_now(node, time.monotonic(), deadline) is None:
                    try:
                        conn = node.acquire(deadline)
                        ops.send_gets(conn, [items[i] for i in idxs], deadline)
                    except Exception:
                        if conn is not None:
                            conn.close()
                            node.release(conn)
                        conn = None
                sent.tasks.append((node, idxs, conn))
        except Exception:
            sent.cancel()
            return None
        if all(conn is None for _, _, conn in sent.tasks):
            return None
        return sent

    def _get_sent(self, ahead: "_SentGets", keys, targets, landed) -> List[Status]:
        try:
            return self._run(ops.get_into, self._get_items(keys, targets, landed), deadline=ahead.deadline,
                             sent=ahead)
        finally:
            ahead.cancel()          # where `_run` raised before it took the connections

    def _put_from(self, keys, sources, fill) -> List[Status]:
        return self._run(ops.put_from, self._put_items(keys, sources, fill), replicated=True)

    @staticmethod
    def _put_items(keys, sources, fill) -> List[ops.Item]:
        return [ops.Item(k.encode(), s, sum([v.nbytes for v in s]), fill=fill, index=i)
                for i, (k, s) in enumerate(zip(keys, sources))]

    def _delete(self, keys: List[str]) -> List[Status]:
        return self._run(ops.delete, [ops.Item(k.encode(), (), 0) for k in keys])

    def close(self) -> None:
        self._closed = True
        with self._nodes_lock:
            nodes = list(self._nodes.values())
        for n in nodes:
            n.close()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def raw_throughput(self, value_bytes: int, count: int) -> Dict[str, object]:
        """``redis-benchmark``'s own SET and GET of ``count`` values of ``value_bytes``
        against this engine's node (a cluster: ``--cluster``, from one master)."""
        from .redis_benchmark import run
        host, port = self._benchmark_node()
        result = run(host, port, value_bytes, count, cluster=self.cluster,
                     username=self._conf.username, password=self._conf.password, db=self._conf.db,
                     tls_args=redis_tls.benchmark_args(self._conf) if self._conf.tls else ())
        self.delete(self._benchmark_keys(result.pop("written")))   # what its SETs left behind
        return result

    def _benchmark_keys(self, written: List[str]) -> List[str]:
        """The names redis-benchmark's keys ``written`` have on this store."""
        return written

    def raw_calls(self, value_bytes: int, count: int) -> RawCalls:
        """Bare pipelined SETs and GETs of ``count`` values of ``value_bytes`` (RESP, as
        a plain client sends them) on one connection to each node the keys hash to, from
        this engine's connection pools, on the calling thread: every node's commands
        sent, then every node's replies read; no redirects, no replica wait
        (`RawCalls`)."""
        return _RedisRawCalls(self, value_bytes, count)

    def _master_of(self, key: bytes) -> Optional[Node]:
        """The node that serves ``key`` (None: no master serves its slot)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ for the engines
    def _node(self, host: str, port: int) -> Node:
        with self._nodes_lock:
            node = self._nodes.get((host, port))
            if node is None:
                node = self._nodes[(host, port)] = Node(host, port, self._conf, self._tls)
            return node

    def _route(self, items: Sequence[ops.Item], pending: List[int], asked: Dict[int, Node],
               deadline: float) -> Dict[Optional[Node], List[int]]:
        raise NotImplementedError

    def _redirected(self, redirect: ops.Redirect) -> Optional[Node]:
        """Where a MOVED/ASK reply sends the key next (None: nowhere)."""
        return None

    def _faulted(self, node: Node) -> None:
        """A node timed out or failed (the cluster reloads its slot map)."""

    def _benchmark_node(self) -> Tuple[str, int]:
        raise NotImplementedError

    def count_event(self, name: str) -> None:
        """Count something that is not a key's status (a redirect, a slot-map reload)."""
        with self._stats_lock:
            self.stats[name] += 1

    def _unreachable(self, why: str) -> None:
        """Construction could not reach the store: close and raise naming the URL."""
        self.close()
        conf = self._conf
        if conf.tls and conf.cert is None and any(w in why for w in _REFUSED_CLIENT):
            # A server that wants a client certificate ends the connection after the
            # handshake, by an alert (certificate required) or by closing it at once.
            why += " (a server that requires a client certificate ends it so: give cert= and key=)"
        raise fail("url", self.url, f"cannot reach the store: {why}")

    # ------------------------------------------------------------------ one call
    def _run(self, op, items: List[ops.Item], replicated: bool = False, deadline: Optional[float] = None,
             sent: Optional["_SentGets"] = None) -> List[Status]:
        """``op`` for every item, in rounds: each round's keys grouped by node (and
        stripe), each group one `_task`; redirected keys go again in the next round.
        ``sent``: the first round is the tasks `_send_ahead` made (under ``deadline``),
        each on the connection its first window was sent on."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout
        out: list = [None] * len(items)
        pending = list(range(len(items)))
        asked: Dict[int, Node] = {}         # ASK redirects: this key, this once, that node
        for _ in range(MAX_ROUNDS):
            if sent is not None:
                tasks, sent = sent.take(), None
            elif self._closed:
                break
            else:
                groups = self._route(items, pending, asked, deadline)
                if None in groups:              # slots no master serves
                    for i in groups.pop(None):
                        out[i] = Status.ERROR
                    self.warn_once("unserved", "a key's hash slot has no master in the slot map")
                tasks = [(node, idxs, None) for node, idxs in self._tasks(groups, items)]
            self._dispatch(op, tasks, items, out, deadline, replicated)
            pending, asked = [], {}
            for i, r in enumerate(out):
                if isinstance(r, ops.Redirect):
                    node = self._redirected(r)
                    if node is None:
                        out[i] = Status.ERROR
                        continue
                    pending.append(i)
                    if r.kind == "ASK":
                        asked[i] = node
                    # sent once already: its fill has run and is not called again
                    items[i] = items[i]._replace(asking=r.kind == "ASK", fill=None)
            if not pending:
                break
        return [Status.ERROR if not isinstance(s, Status) else s for s in out]

    def _tasks(self, groups: Dict[Node, List[int]], items) -> List[Tuple[Node, List[int]]]:
        """A round's tasks: each node's keys dealt over its share of the connections."""
        tasks = []
        for node, stripes in _stripes(groups, self._conf.connections, items).items():
            idxs = groups[node]
            tasks += [(node, idxs[s::stripes]) for s in range(stripes)]
        return tasks

    def _dispatch(self, op, tasks, items, out, deadline, replicated) -> None:
        """Each task ``(node, idxs, conn)`` run, the first on this thread, the others on
        the thread pool; returns when all have."""
        if not tasks:
            return
        futures = []
        if len(tasks) > 1:
            pool = self._thread_pool()
            futures = [pool.submit(self._task, op, node, idxs, items, out, deadline, replicated, conn)
                       for node, idxs, conn in tasks[1:]]
        node, idxs, conn = tasks[0]
        self._task(op, node, idxs, items, out, deadline, replicated, conn)
        # Every task ends by the deadline on its own (each socket wait is bounded by it);
        # waiting for all of them keeps a late reply from landing in a buffer the caller
        # already has back.
        if futures:
            concurrent.futures.wait(futures)

    def _thread_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=16 * self._conf.connections, thread_name_prefix="kvtier-redis")
            return self._pool

    def _task(self, op, node: Node, idxs: List[int], items, out, deadline, replicated,
              conn: Optional[resp.Connection] = None) -> None:
        """Run ``op`` for the keys ``idxs`` on one connection to ``node``; fills out[i].
        ``conn``: the connection `_send_ahead` sent their first window of GETs on (the
        task's from here on, released or closed by it)."""
        sub = [items[i] for i in idxs]
        res: list = [None] * len(sub)
        now = time.monotonic()
        # GETs sent ahead are answered already: their replies are read whatever else holds
        fault = self._not_now(node, now, deadline) if conn is None else None
        if fault is None:
            # A write asks the node's ROLE in its pipeline unless a recent answer holds.
            role = ops.Role() if replicated and not node.role_known(now) else None
            replicas = node.replicas if replicated else None
            settled = False             # False in `finally`: interrupted mid-stream
            if conn is not None:
                op = functools.partial(op, ahead=True)
            try:
                if conn is None:
                    conn = node.acquire(deadline)
                errors = ops.ServerErrors()
                if role is not None:
                    op(conn, sub, res, deadline, errors, role)
                    replicas = role.replicas
                    node.learned_role(replicas)
                else:
                    op(conn, sub, res, deadline, errors)
                if errors.seen:         # CLUSTERDOWN, LOADING, WRONGTYPE...: ERROR, said once
                    self.warn_once(f"reply:{errors.seen[0].split()[0]}", "%s answered %s",
                                   node, errors.seen[0])
                    node.forget_role()
                    self._faulted(node)
                if replicas and any(r is Status.HIT for r in res):
                    self._wait_replica(node, conn, res, deadline)
                settled = True
            except Exception as e:      # a fault of the server's, or of this code: a status
                if conn is not None:
                    conn.close()        # whatever it was, the stream's framing is lost
                if isinstance(e, resp.Fault):
                    self.warn_once(f"fault:{type(e).__name__}", "%s", e)
                else:
                    self.warn_once(f"bug:{type(e).__name__}", "%s failed (%s: %s); reported as ERROR",
                                   node, type(e).__name__, e)
                fault = Status.TIMEOUT if isinstance(e, resp.TimeoutFault) else Status.ERROR
                node.forget_role()
                if role is not None:
                    replicas = role.replicas    # read before any write's reply, where it was
                if replicas:    # no write there counts without its WAIT
                    res = [None] * len(sub)
                if fault is Status.TIMEOUT:
                    node.held_until = time.monotonic() + self.timeout
                self._faulted(node)
                settled = True
            finally:
                if conn is not None:
                    if not settled:
                        conn.close()
                    node.release(conn)  # closes it instead where it is broken
        for j, i in enumerate(idxs):
            out[i] = res[j] if res[j] is not None else fault

    def _not_now(self, node: Node, now: float, deadline: float) -> Optional[Status]:
        """Why a task does not go to ``node`` now (its keys' status), or None."""
        if now >= deadline:                 # the call's time went elsewhere (a slot-map reload)
            return Status.TIMEOUT
        if now < node.held_until:
            self.warn_once("held", "%s timed out; its keys are TIMEOUT for %.1f s before it "
                           "is tried again", node, self.timeout)
            return Status.TIMEOUT
        return Status.ERROR if self._closed else None

    def _wait_replica(self, node: Node, conn: resp.Connection, res: list, deadline: float) -> None:
        wait_ms = (deadline - time.monotonic()) * 1000.0 * 0.8
        acked = ops.wait_replica(conn, deadline, wait_ms) if wait_ms >= 1 else 0
        if acked < 1:
            node.forget_role()          # the next write asks whether the replica is still there
            self.warn_once("unreplicated", "%s lists a replica but none acknowledged the writes "
                           "in time; they are reported TIMEOUT", node)
            for j, r in enumerate(res):
                if r is Status.HIT:
                    res[j] = Status.TIMEOUT


class _SentGets(Ahead):
    """`_RedisEngine._send_ahead`'s tasks ``(node, idxs, conn)`` (conn: the connection
    the task's first window was sent on, or None), until the call at `into` takes them
    (`take`), or `cancel` closes their connections with the replies unread."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.tasks: List[Tuple[Node, List[int], Optional[resp.Connection]]] = []

    def take(self) -> List[Tuple[Node, List[int], Optional[resp.Connection]]]:
        tasks, self.tasks = self.tasks, []
        return tasks

    def cancel(self) -> None:
        for node, _, conn in self.take():
            if conn is not None:
                conn.close()            # its replies are in the stream: never reused
                node.release(conn)


class _RedisRawCalls(RawCalls):
    """`_RedisEngine.raw_calls`."""

    def __init__(self, engine: _RedisEngine, value_bytes: int, count: int):
        super().__init__(engine, value_bytes, count)
        self._conns: Dict[Node, resp.Connection] = {}
        self._header = resp.bulk_header(value_bytes)
        self.how = (f"bare pipelined SET / GET of {count} value(s) of {value_bytes} B, one connection "
                    "per node, on the calling thread (RESP; no replica wait)")

    def _groups(self) -> Tuple[List[Tuple[resp.Connection, List[int]]], float]:
        deadline = time.monotonic() + self.engine.timeout
        groups: Dict[Node, List[int]] = {}
        for i, k in enumerate(self.keys):
            node = self.engine._master_of(k.encode())
            if node is None:
                raise RuntimeError("a raw key's hash slot has no master")
            groups.setdefault(node, []).append(i)
        out = []
        for node, idxs in groups.items():
            conn = self._conns.get(node)
            if conn is None or conn.broken:
                conn = self._conns[node] = node.acquire(deadline)
            out.append((conn, idxs))
        return out, deadline

    def set(self) -> None:
        self.fresh_keys()
        try:
            conns, deadline = self._groups()
            for conn, idxs in conns:
                parts: list = []
                for i in idxs:
                    k, v = self.keys[i].encode(), self.sources[i]
                    parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, v.nbytes), v, resp.CRLF]
                conn.send(parts, deadline)
            for conn, idxs in conns:
                for _ in idxs:
                    reply = conn.read_reply(deadline)
                    if reply != "OK":
                        raise RuntimeError(f"a raw SET answered {reply!r:.60}")
        except resp.Fault as e:
            raise RuntimeError(f"a raw SET failed: {e}") from None

    def get(self) -> None:
        try:
            conns, deadline = self._groups()
            for conn, idxs in conns:
                conn.send([b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)
                           for k in (self.keys[i].encode() for i in idxs)], deadline)
            for conn, idxs in conns:
                for i in idxs:
                    line = conn.read_line(deadline, len(self._header))
                    if line != self._header[:-2]:
                        raise RuntimeError(f"a raw GET answered {line[:40]!r}")
                    conn.read_into([self.targets[i]], deadline)
                    conn.expect_crlf(deadline)
        except resp.Fault as e:
            raise RuntimeError(f"a raw GET failed: {e}") from None

    def close(self) -> None:
        conns, self._conns = self._conns, {}
        for node, conn in conns.items():
            node.release(conn)
        self.clear()


def _stripes(groups: Dict[Node, List[int]], connections: int, items: Sequence[ops.Item]) -> Dict[Node, int]:
    """Connections per node for one call: ``connections`` in all, shared by the nodes
    in proportion to their keys, at least one each and never more than their keys (a
    cluster call reaching three masters with ``connections=4`` uses one connection a
    master: on two cores, twelve threads ran slower than three; docs/store-redis.md),
    nor more than one per `SPREAD_BYTES` of the node's values: a small call (a few
    pages, or keys alone) runs on one connection, on the calling thread where it
    reaches one node, with no hand-off to the engine's threads."""
    if len(groups) == 1:
        (node, idxs), = groups.items()
        if len(idxs) == 1:          # one key: one connection (the latency case, no sums)
            return {node: 1}
    total = sum(len(idxs) for idxs in groups.values())
    out = {}
    for node, idxs in groups.items():
        share = min(len(idxs), round(connections * len(idxs) / total))
        if share > 1:
            share = min(share, -(-sum(items[i].nbytes for i in idxs) // SPREAD_BYTES))
        out[node] = max(1, share)
    return out


class RedisEngine(_RedisEngine):
    """One Redis or Valkey node (``redis://host:port[/db]``)."""

    scheme = "redis"

    def __init__(self, url: str, timeout_ms: int = DEFAULT_TIMEOUT_MS):
        super().__init__(url, timeout_ms)
        (host, port), = self._conf.addrs
        self._server = self._node(host, port)
        deadline = time.monotonic() + self.timeout
        try:
            conn = self._server.acquire(deadline)
            reply = conn.call(deadline, "PING")
            self._server.release(conn)
        except resp.Fault as e:
            self._unreachable(str(e))
        if isinstance(reply, resp.ReplyError):
            self._unreachable(f"PING answered {reply}")

    def _route(self, items, pending, asked, deadline):
        return {self._server: pending}

    def _redirected(self, redirect):
        self.warn_once("moved", "%s redirects keys (%s): it is a cluster node; "
                       "open it as redis+cluster://", self._server, redirect.kind)
        return None

    def _benchmark_node(self):
        return self._server.host, self._server.port

    def _master_of(self, key):
        return self._server


class RedisClusterEngine(_RedisEngine):
    """A Redis or Valkey cluster (``redis+cluster://host:port[,host:port...]``): the
    hosts are seeds; the slot map comes from the cluster."""

    scheme = "redis+cluster"
    cluster = True

    def __init__(self, url: str, timeout_ms: int = DEFAULT_TIMEOUT_MS):
        super().__init__(url, timeout_ms)
        self._seeds = [self._node(h, p) for h, p in self._conf.addrs]
        self._slots: List[Optional[Node]] = [None] * SLOTS
        self._masters: List[Node] = []
        self._replicas: List[Node] = []
        self._refresh_lock = threading.Lock()
        self._stale = True
        self._refreshed_at = -1.0
        why = self._refresh(time.monotonic() + self.timeout)
        if why:
            self._unreachable(why)

    def _route(self, items, pending, asked, deadline):
        if self._stale and time.monotonic() - self._refreshed_at >= REFRESH_EVERY:
            self._refresh(deadline)
        slots = self._slots
        groups: Dict[Optional[Node], List[int]] = {}
        for i in pending:
            node = asked.get(i) or slots[key_slot(items[i].key)]
            groups.setdefault(node, []).append(i)
        return groups

    def _redirected(self, redirect):
        host = redirect.host or self._seeds[0].host     # "MOVED 42 :port": the same host
        node = self._node(host, redirect.port)
        if redirect.kind == "MOVED":
            self._slots[redirect.slot] = node
            self._stale = True
            self.warn_once("moved", "the cluster moved slots (MOVED to %s); reloading its slot map", node)
        self.count_event(f"cluster.{redirect.kind.lower()}")
        return node

    def _faulted(self, node):
        self._stale = True

    def _benchmark_node(self):
        node = self._masters[0] if self._masters else self._seeds[0]
        return node.host, node.port

    def _master_of(self, key):
        return self._slots[key_slot(key)]

    def _benchmark_keys(self, written: List[str]) -> List[str]:
        """In a cluster, redis-benchmark puts a hash tag of one slot per master into
        every key name, so that the master it sends a key to serves it
        (``key:{06S}:000000000042`` for slot 0, ``key:{8M}}:...`` for slot 5461). The tags
        are read back from each master's first slot, the one redis-benchmark 7 tags
        with (``CLUSTER GETKEYSINSLOT``): every name of redis-benchmark's shape there."""
        deadline = time.monotonic() + self.timeout
        tags = set()
        for node in self._masters:
            if node not in self._slots:
                continue
            slot = self._slots.index(node)
            conn = None
            try:
                conn = node.acquire(deadline)
                names = conn.call(deadline, "CLUSTER", "GETKEYSINSLOT", slot, 1 << 16)
            except resp.Fault as e:
                self.warn_once("benchmark.keys", "cannot list %s's slot %d to remove "
                               "redis-benchmark's keys (%s)", node, slot, e)
                names = None
                if conn is not None:
                    conn.close()
            if conn is not None:
                node.release(conn)
            for name in names if isinstance(names, list) else ():
                m = _BENCHMARK_KEY.match(name)
                if m and m.group(1).isascii() and key_slot(name) == slot:
                    tags.add(m.group(1).decode())
        return [f"key:{{{tag}}}:{name[4:]}" for tag in sorted(tags) for name in written]

    def _refresh(self, deadline: float) -> Optional[str]:
        """Reload the slot map from the first node that gives one; None, or why none did.
        One thread reloads at a time; the others go on with the map they have."""
        if not self._refresh_lock.acquire(blocking=False):
            return None
        try:
            self._refreshed_at = time.monotonic()
            now = self._refreshed_at
            known = self._masters + self._replicas + self._seeds
            order = sorted(dict.fromkeys(known), key=lambda n: n.held_until > now)   # held last
            why = "no node given"
            for node in order:
                try_deadline = min(deadline, time.monotonic() + self.timeout / 2)
                if try_deadline <= time.monotonic():
                    return why + " (out of time)"
                try:
                    conn = node.acquire(try_deadline)
                    reply = conn.call(try_deadline, "CLUSTER", "SLOTS")
                    node.release(conn)
                except resp.Fault as e:
                    why = str(e)
                    continue
                if isinstance(reply, resp.ReplyError) or not isinstance(reply, list):
                    why = f"{node} answered CLUSTER SLOTS with {reply!r:.80}"
                    continue
                if not reply:
                    why = f"{node} serves no slots (is the cluster created?)"
                    continue
                try:
                    self._load(node, reply)
                except (TypeError, ValueError, IndexError, AttributeError):
                    why = f"{node} answered CLUSTER SLOTS with a reply of another shape: {reply!r:.80}"
                    continue
                self._stale = False
                self.count_event("cluster.refresh")
                return None
            self.warn_once("refresh", "cannot reload the cluster's slot map: %s", why)
            return why
        finally:
            self._refresh_lock.release()

    def _load(self, source: Node, reply: list) -> None:
        slots: List[Optional[Node]] = [None] * SLOTS
        masters, replicas = [], []
        for entry in reply:
            start, end, master, *reps = entry
            node = self._endpoint(source, master)
            masters.append(node)
            replicas += [self._endpoint(source, r) for r in reps]
            for s in range(int(start), int(end) + 1):
                slots[s] = node
        self._slots = slots
        self._masters = list(dict.fromkeys(masters))
        self._replicas = list(dict.fromkeys(replicas))

    def _endpoint(self, source: Node, entry: list) -> Node:
        host = entry[0].decode() if isinstance(entry[0], bytes) else str(entry[0] or "")
        if host in ("", "?"):          # the node does not know its own address
            host = source.host
        return self._node(host, int(entry[1]))

