"""RESP2 framing over one TCP socket, with bulk replies read straight into caller buffers.

The Redis engine speaks the protocol itself rather than through a client library: a
library parses each bulk reply into a new bytes object that must then be copied into
the page buffer, and that copy (plus the object churn) held every Python client
measured to a fraction of ``redis-benchmark``'s GET throughput (docs/store-redis.md). Here a
GET reply's payload lands by ``recv_into`` in the target buffers themselves, and a SET
sends the page's buffers by ``sendmsg`` (a gather write) without joining them.

A `Connection` is used by one thread at a time. Its socket is non-blocking: each send
or receive is tried at once, and only where it would block does the connection wait
(``poll``) for as long as the call's deadline leaves, so a transfer whose bytes are there
costs one system call. Every blocking call takes an absolute
deadline (``time.monotonic()`` seconds); a call past it raises `TimeoutFault`, a
refused, reset or closed connection raises `ConnectionFault`, and either leaves the
connection `broken` (its framing state is unknown), to be closed and not reused. A
server's error reply is not raised: it is returned as a `ReplyError` value, since a
pipeline goes on past it (a MOVED redirect, a wrong-type key).

Over TLS (an ``ssl.SSLContext`` given) the socket is wrapped after the TCP connect and
the handshake runs non-blocking under the same deadline; a certificate the context
rejects is a `ConnectionFault` naming the node and OpenSSL's reason. Either direction may
then want the other (``SSLWantReadError`` on a send, ``SSLWantWriteError`` on a
receive: a TLS record or key update in between), and bytes already decrypted inside the
SSL object (``pending()``) are not seen by ``poll``, so a receive polls only where none
are. An SSL socket has no ``sendmsg``: a send joins runs of small buffers into one
record-sized chunk (the encryption copies every byte anyway) and sends large ones as
they are.
"""
from __future__ import annotations

import math
import select
import socket
import ssl
import time
from typing import List, Optional, Sequence

CRLF = b"\r\n"
_STAGE_BYTES = 1 << 16          # headers and small replies (and the longest line); payloads bypass it
_IOV_MAX = 512                  # buffers per sendmsg (Linux allows 1024)
_TLS_CHUNK = 16 << 10           # over TLS, smaller buffers are joined up to this (a TLS record's most)


class Fault(Exception):
    """The connection failed; the keys it carried get a fault status."""


class ConnectionFault(Fault):
    """Refused, reset or closed by the server, or a reply that is not RESP."""


class TimeoutFault(Fault):
    """No reply before the call's deadline."""


class ReplyError(str):
    """A server's error reply (``-ERR ...``, ``-MOVED 42 host:port``), as a value."""


def command(*args) -> bytes:
    """One command in RESP (an array of bulk strings); str args are UTF-8 encoded."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = b"%d" % a
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def bulk_header(length: int) -> bytes:
    """The header line a bulk reply of ``length`` bytes starts with."""
    return b"$%d\r\n" % length


class Connection:
    """One TCP connection to a Redis/Valkey node (see the module docstring)."""

    def __init__(self, host: str, port: int, deadline: float, tls: Optional[ssl.SSLContext] = None):
        self.host, self.port = host, port
        self.broken = False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutFault(f"no time left to connect to {host}:{port}")
        try:
            self._sock = socket.create_connection((host, port), timeout=remaining)
        except socket.timeout:
            raise TimeoutFault(f"connecting to {host}:{port} timed out") from None
        except OSError as e:
            raise ConnectionFault(f"connecting to {host}:{port}: {e}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setblocking(False)       # waits are `_io`'s own, bounded by each call's deadline
        self._tls = tls is not None
        if self._tls:
            try:
                self._sock = tls.wrap_socket(self._sock, server_hostname=host, do_handshake_on_connect=False)
            except (OSError, ValueError) as e:
                self.close()
                raise ConnectionFault(f"TLS to {host}:{port}: {_ssl_reason(e)}") from None
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(self._sock, select.POLLIN)
        self._writable.register(self._sock, select.POLLOUT)
        self._stage = bytearray(_STAGE_BYTES)
        self._view = memoryview(self._stage)
        self._start = self._end = 0     # unread bytes are _stage[_start:_end]
        self._asked = False             # sent since the last receive: no reply is there yet
        if self._tls:
            self._handshake(deadline)

    def stale(self) -> bool:
        """Whether an idle connection is unusable: the server closed or reset it (it
        died or restarted), or sent bytes nobody asked for. One poll that does not wait."""
        if self.broken or self._start != self._end:
            return True
        try:
            if not self._readable.poll(0):
                return False
        except OSError:
            return True
        if not self._tls:
            return True                 # end of stream, a reset, or unasked-for bytes
        # Over TLS the bytes may be the server's alone (a session ticket): only a receive
        # tells. One that wants more holds no reply; any byte of one, or the end, is stale.
        try:
            self._sock.recv_into(memoryview(bytearray(1)))
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return self._sock.pending() > 0
        except OSError:
            pass
        return True

    def close(self) -> None:
        self.broken = True
        try:
            self._sock.close()
        except OSError:
            pass

    # ------------------------------------------------------------------ sending
    def send(self, parts: Sequence, deadline: float) -> None:
        """Send ``parts`` (bytes-like) in order, as one stream: a gather write with no join."""
        views: List[memoryview] = [p if isinstance(p, memoryview) else memoryview(p) for p in parts]
        if self._tls:
            self._send_tls(views, deadline)
            return
        i = 0
        while i < len(views):
            n = self._io(self._sock.sendmsg, views[i:i + _IOV_MAX], deadline, self._writable)
            self._asked = True
            while n > 0:                # step past what was sent; resume mid-buffer
                size = views[i].nbytes
                if n >= size:
                    n -= size
                    i += 1
                else:
                    views[i] = views[i][n:]
                    n = 0
            while i < len(views) and views[i].nbytes == 0:
                i += 1

    def _send_tls(self, views: List[memoryview], deadline: float) -> None:
        """`send` over TLS: runs of buffers under `_TLS_CHUNK` joined into one chunk, each
        chunk or larger buffer sent whole (an SSL send that wants to wait is retried
        with the same bytes, as OpenSSL requires)."""
        chunk = bytearray()
        for v in views:
            if v.nbytes < _TLS_CHUNK:
                if len(chunk) + v.nbytes > _TLS_CHUNK:
                    self._send_all(memoryview(chunk), deadline)
                    chunk = bytearray()
                chunk += v
                continue
            if chunk:
                self._send_all(memoryview(chunk), deadline)
                chunk = bytearray()
            self._send_all(v.cast("B") if v.format != "B" else v, deadline)
        if chunk:
            self._send_all(memoryview(chunk), deadline)

    def _send_all(self, view: memoryview, deadline: float) -> None:
        while view.nbytes:
            n = self._io(self._sock.send, view, deadline, self._writable)
            self._asked = True
            view = view[n:]

    def _handshake(self, deadline: float) -> None:
        try:
            self._io(lambda _: self._sock.do_handshake(), None, deadline, self._writable)
        except ConnectionFault as e:
            why = _ssl_reason(e.__cause__) if e.__cause__ is not None else str(e)
            raise ConnectionFault(f"TLS handshake with {self.host}:{self.port} failed: {why}") from None
        except TimeoutFault:
            raise TimeoutFault(f"TLS handshake with {self.host}:{self.port}: no answer in time "
                               "(a port without TLS?)") from None

    # ------------------------------------------------------------------ receiving
    def read_line(self, deadline: float, ask: int = _STAGE_BYTES) -> bytes:
        """The next line (without CRLF). ``ask`` bounds each receive: a caller that knows
        how long the line will be asks for no more, so the payload after it is not
        staged (and copied) but received straight into its buffers."""
        while True:
            i = self._stage.find(CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start:i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._stage):
                self._protocol("a line longer than %d bytes" % len(self._stage))
            self._fill(deadline, max(ask, 2))
            ask = len(self._stage)          # not all there yet: no more guessing

    def read_into(self, targets: Sequence[memoryview], deadline: float) -> None:
        """Fill ``targets`` in order with the next bytes of the stream."""
        for t in targets:
            filled = self._take_staged(t)
            size = t.nbytes
            while filled < size:
                filled += self._recv(t[filled:], deadline)

    def skip(self, n: int, deadline: float) -> None:
        """Drop the next ``n`` bytes of the stream (a payload nobody wants)."""
        while n > 0:
            if self._start == self._end:
                self._fill(deadline, min(n, _STAGE_BYTES))
            k = min(n, self._end - self._start)
            self._start += k
            n -= k

    def expect_crlf(self, deadline: float, ask: int = 2) -> None:
        """Consume the CRLF that ends a bulk payload."""
        while self._end - self._start < 2:
            self._fill(deadline, ask)
        if self._view[self._start:self._start + 2] != CRLF:
            self._protocol("a bulk payload not followed by CRLF")
        self._start += 2

    def read_reply(self, deadline: float):
        """The next reply as a value: bytes (bulk; None for nil), int, str (simple),
        `ReplyError`, or a list of replies (None for a nil array)."""
        line = self.read_line(deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode(errors="replace")
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        if kind == b":":
            return self._int(rest)
        if kind == b"$":
            n = self._int(rest)
            if n < 0:
                return None
            out = bytearray(n)
            self.read_into([memoryview(out)], deadline)
            self.expect_crlf(deadline)
            return bytes(out)
        if kind == b"*":
            n = self._int(rest)
            return None if n < 0 else [self.read_reply(deadline) for _ in range(n)]
        self._protocol(f"an unknown reply type {line[:16]!r}")

    def call(self, deadline: float, *args):
        """Send one command and return its reply."""
        self.send([command(*args)], deadline)
        return self.read_reply(deadline)

    # ------------------------------------------------------------------ internals
    def _int(self, text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            self._protocol(f"a bad length or integer {text[:32]!r}")

    def _take_staged(self, target: memoryview) -> int:
        k = min(self._end - self._start, target.nbytes)
        if k:
            target[:k] = self._view[self._start:self._start + k]
            self._start += k
        return k

    def _fill(self, deadline: float, ask: int) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end + ask > len(self._stage):       # make room: move the unread bytes down
            unread = self._end - self._start
            self._view[:unread] = self._view[self._start:self._end]
            self._start, self._end = 0, unread
        ask = min(ask, len(self._stage) - self._end)
        self._end += self._recv(self._view[self._end:self._end + ask], deadline)

    def _recv(self, view: memoryview, deadline: float) -> int:
        # The first receive after a send waits first: its reply is a round trip away
        # (unless the SSL object holds decrypted bytes, which poll cannot see).
        wait, self._asked = self._asked, False
        if wait and self._tls and self._sock.pending():
            wait = False
        n = self._io(self._sock.recv_into, view, deadline, self._readable, wait)
        if n == 0:
            self.close()
            raise ConnectionFault(f"{self.host}:{self.port} closed the connection")
        return n

    def _io(self, op, arg, deadline: float, ready, wait: bool = False) -> int:
        """``op(arg)`` on the non-blocking socket, waiting on ``ready`` (the socket's
        readable or writable poll) while it would block (``wait``: first), at most until
        ``deadline``."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise TimeoutFault(f"{self.host}:{self.port} did not answer in time")
            if wait:
                try:
                    ready.poll(math.ceil(remaining * 1000))     # ms; then the deadline is checked again
                except OSError as e:
                    self.close()
                    raise ConnectionFault(f"{self.host}:{self.port}: {e}") from None
                wait = False
                continue
            try:
                return op(arg)
            except BlockingIOError:
                wait = True
            except ssl.SSLWantReadError:        # TLS: the record is not all there (on a send too)
                ready, wait = self._readable, True
            except ssl.SSLWantWriteError:       # TLS: it has to send first (on a receive too)
                ready, wait = self._writable, True
            except OSError as e:                # ssl.SSLError (a rejected certificate too) is one
                self.close()
                raise ConnectionFault(f"{self.host}:{self.port}: {_ssl_reason(e)}") from e

    def _protocol(self, what: str) -> None:
        self.close()
        raise ConnectionFault(f"{self.host}:{self.port} sent {what}")


def _ssl_reason(e: Exception) -> str:
    """An error's words; for an ssl error, OpenSSL's reason without its source location
    (a rejected certificate: why, ``certificate verify failed: self-signed certificate``)."""
    if isinstance(e, ssl.SSLCertVerificationError) and e.verify_message:
        return f"certificate verify failed: {e.verify_message}"
    if isinstance(e, ssl.SSLError):
        text = e.args[1] if len(e.args) > 1 and isinstance(e.args[1], str) else str(e)
        return text.split(" (_ssl.c:")[0]
    return str(e)


def parse_redirect(reply: ReplyError) -> Optional[tuple]:
    """``("MOVED"|"ASK", slot, host, port)`` for a redirect error reply, else None."""
    parts = reply.split()
    if len(parts) != 3 or parts[0] not in ("MOVED", "ASK"):
        return None
    host, _, port = parts[2].rpartition(":")
    try:
        return parts[0], int(parts[1]), host, int(port)
    except ValueError:
        return None
