"""Batched commands on one Redis connection: GET into buffers, SET from buffers, EXISTS,
UNLINK, each pipelined in windows with one window in flight ahead of the one being read
(the server fills the next window's replies while this one is received).

Each function takes a `resp.Connection`, the items (key bytes, buffers, an ASKING
flag), a result list to fill and the call's deadline. A reply becomes a `Status`, or a
`Redirect` for the cluster engine to follow. A `resp.Fault` propagates with the items
read so far already filled in; the caller gives the rest the fault's status."""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from . import resp
from .engine import Status

WINDOW_BYTES = 512 << 10   # payload bytes a window carries: little in flight stays in cache (docs/store-redis.md)
WINDOW_KEYS = 256           # and at most this many keys
LEAD_BYTES = 4096           # a GET target's first buffer up to this long (a page header) is received with the reply's header


class Redirect(NamedTuple):
    """A MOVED or ASK reply: the key lives (for good, or for this one command) elsewhere."""
    kind: str
    slot: int
    host: str
    port: int


class Item(NamedTuple):
    key: bytes
    buffers: Sequence[memoryview]   # get: targets; put: sources; others: ()
    nbytes: int                     # sum of the buffers' lengths
    asking: bool = False            # prefix the command with ASKING (an ASK redirect)
    # get: ``landed(index)`` once the value is in its buffers; put: ``fill(index)`` before
    # its buffers are sent (False: not sent). One callable for a call's items, each told
    # its own index: a callable per item would be one more tracked object per key.
    landed: Optional[Callable[[int], None]] = None
    fill: Optional[Callable[[int], Optional[bool]]] = None
    index: int = -1


class ServerErrors:
    """Error replies that are not redirects, kept for the engine to log once."""

    def __init__(self):
        self.seen: List[str] = []

    def __call__(self, reply: resp.ReplyError) -> Status:
        self.seen.append(str(reply))
        return Status.ERROR


def _error(reply: resp.ReplyError, errors: ServerErrors):
    r = resp.parse_redirect(reply)
    return Redirect(*r) if r else errors(reply)


_ASKING = resp.command("ASKING")


def _windows(items: Sequence[Item]):
    start, size = 0, 0
    for i, it in enumerate(items):
        if i > start and (size + it.nbytes > WINDOW_BYTES or i - start >= WINDOW_KEYS):
            yield start, i
            start, size = i, 0
        size += it.nbytes
    if start < len(items):
        yield start, len(items)


def _pipeline(conn: resp.Connection, items: Sequence[Item], out: list, deadline: float,
              encode: Callable[[Item], Optional[list]], decode: Callable[[Item], object],
              lead: Optional[Tuple[bytes, Callable[[], None]]] = None, first_sent: bool = False) -> None:
    """Send window k+1 before reading window k's replies; out[i] = decode(items[i]), or
    ERROR where encode(items[i]) returned None (nothing sent for it, not even ASKING).
    ``lead``: a command sent ahead of the first window, and what reads its reply.
    ``first_sent``: the first window's commands are sent already (`send_gets`)."""
    windows = list(_windows(items))
    sent = [True] * len(items)

    def send(w):
        lo, hi = windows[w]
        parts: list = [lead[0]] if lead and w == 0 else []
        for i in range(lo, hi):
            command = encode(items[i])
            if command is None:
                sent[i] = False
                continue
            if items[i].asking:
                parts.append(_ASKING)
            parts += command
        conn.send(parts, deadline)

    if not first_sent:
        send(0)
    for w, (lo, hi) in enumerate(windows):
        if w + 1 < len(windows):
            send(w + 1)
        if lead and w == 0:
            lead[1]()
        for i in range(lo, hi):
            it = items[i]
            if not sent[i]:
                out[i] = Status.ERROR
                continue
            if it.asking:
                conn.read_reply(deadline)       # ASKING's +OK
            out[i] = decode(it)


def _length(line: bytes) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise resp.ConnectionFault(f"a bad bulk length {line[:32]!r}") from None


def _get(it: Item) -> list:
    return [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(it.key), it.key)]


def send_gets(conn: resp.Connection, items: Sequence[Item], deadline: float) -> None:
    """Send the GETs of `get_into`'s first window of ``items`` (their buffers may be
    empty yet; ``nbytes`` makes the windows); `get_into` with ``ahead`` reads them."""
    lo, hi = next(_windows(items))
    conn.send([part for it in items[lo:hi] for part in _get(it)], deadline)


def get_into(conn: resp.Connection, items: Sequence[Item], out: list, deadline: float,
             errors: ServerErrors, ahead: bool = False) -> None:
    """GET each key into its buffers: HIT when the value's length is theirs, CORRUPT
    (payload dropped, buffers untouched) when it is another, MISS for none. ``ahead``:
    the first window's GETs were sent by `send_gets` (the same keys and lengths)."""

    def decode(it: Item):
        header = resp.bulk_header(it.nbytes)
        # Ask no further than the reply's header and the first buffer where it is small
        # (a page header: one receive for both); the rest lands straight in the buffers.
        lead = it.buffers[0].nbytes if it.buffers and it.buffers[0].nbytes <= LEAD_BYTES else 0
        line = conn.read_line(deadline, len(header) + lead)
        if line[:1] == b"$":
            n = _length(line)
            if n < 0:
                return Status.MISS
            if n == it.nbytes:
                conn.read_into(it.buffers, deadline)
                conn.expect_crlf(deadline, 2 + len(header) + lead)     # and the next reply's, alike
                if it.landed is not None:
                    it.landed(it.index)
                return Status.HIT
            conn.skip(n, deadline)
            conn.expect_crlf(deadline)
            return Status.CORRUPT
        if line[:1] == b"-":
            return _error(resp.ReplyError(line[1:].decode(errors="replace")), errors)
        raise resp.ConnectionFault(f"a GET reply that is not a bulk string: {line[:32]!r}")

    _pipeline(conn, items, out, deadline, _get, decode, first_sent=ahead)


class Role:
    """What a node's ROLE said: ``replicas`` connected (None: not a master, or not asked)."""

    def __init__(self):
        self.replicas: Optional[int] = None


_ROLE = resp.command("ROLE")


def put_from(conn: resp.Connection, items: Sequence[Item], out: list, deadline: float,
             errors: ServerErrors, role: Optional[Role] = None) -> None:
    """SET each key from its buffers (a gather write: the buffers are sent as they are).
    ``role``: ask the node's ROLE in the same pipeline, ahead of the SETs (so a write
    that needs a replica's acknowledgement costs no extra round trip to find out)."""

    def encode(it: Item):
        if it.fill is not None and it.fill(it.index) is False:
            return None         # not sent: ERROR
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(it.key), it.key, it.nbytes)
        return [head, *it.buffers, resp.CRLF]

    def decode(it: Item):
        reply = conn.read_reply(deadline)
        if reply == "OK":
            return Status.HIT
        if isinstance(reply, resp.ReplyError):
            return _error(reply, errors)
        raise resp.ConnectionFault(f"a SET reply that is not OK: {reply!r:.40}")

    def read_role():
        role.replicas = _replicas(conn.read_reply(deadline))

    _pipeline(conn, items, out, deadline, encode, decode, (_ROLE, read_role) if role else None)


def _integer_op(name: bytes, hit: Callable[[int], Status]):
    def op(conn: resp.Connection, items: Sequence[Item], out: list, deadline: float,
           errors: ServerErrors) -> None:
        def encode(it: Item):
            return [b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(name), name, len(it.key), it.key)]

        def decode(it: Item):
            reply = conn.read_reply(deadline)
            if isinstance(reply, int):
                return hit(reply)
            if isinstance(reply, resp.ReplyError):
                return _error(reply, errors)
            raise resp.ConnectionFault(f"a {name.decode()} reply that is not an integer: {reply!r:.40}")

        _pipeline(conn, items, out, deadline, encode, decode)
    return op


exists = _integer_op(b"EXISTS", lambda n: Status.HIT if n else Status.MISS)
delete = _integer_op(b"UNLINK", lambda n: Status.HIT)


def _replicas(reply) -> Optional[int]:
    """How many replicas a ROLE reply lists (None: the node is not a master)."""
    if isinstance(reply, list) and reply and reply[0] == b"master":
        return len(reply[2]) if len(reply) > 2 and isinstance(reply[2], list) else 0
    return None


def wait_replica(conn: resp.Connection, deadline: float, wait_ms: int) -> int:
    """WAIT for one replica to acknowledge this connection's writes; the count that did."""
    reply = conn.call(deadline, "WAIT", 1, max(1, int(wait_ms)))
    if isinstance(reply, int):
        return reply
    raise resp.ConnectionFault(f"a WAIT reply that is not an integer: {reply!r:.40}")
