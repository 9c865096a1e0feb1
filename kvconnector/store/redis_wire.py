"""RESP2 on the socket of a redis-py connection, written and read by hand.

redis-py manages the connections (URL parsing, AUTH, SELECT, TLS, unix sockets, the pool,
the cluster's slot map). The commands themselves are written and read here, straight on
the connection's socket (redis-py's private ``Connection._sock``, reached in
redis_connections.py: hence ``redis<9`` in pyproject.toml):

* a SET is sent as its RESP prefix, the codec header and the caller's payload buffer,
  with ``sendmsg`` (scatter-gather): a 32 MiB payload is never joined with its header or
  copied into a command buffer;
* a GET reply is read with ``recv_into`` straight into a buffer of the payload's size (or
  one the caller passes in ``out``), after the header has been checked.

Why not redis-py's public API (``pack_command``/``pack_commands`` + ``send_packed_command``,
``read_response``): a SET's value is one argument, so header and payload must be joined (a
copy of every value); with hiredis installed redis-py packs with hiredis, which copies every
argument again (``command_packer=PythonRespSerializer(...)`` passes large ones through);
a GET comes back as a new bytes through the parser's buffer, and nothing public reads a reply
into a caller's buffer. Measured 2026-11-25 (benchmarks/bench_redis.py, docs/benchmarks.md
section 4; 2-core VM, redis-py 8.1.0 with hiredis 3.5.0, redis-server 6.2.14 on loopback),
the public API at its best against this path: 0.65-0.67 of its puts and 0.50-0.67 of its
gets (0.46-0.55 into caller buffers) for 32 MiB values (a Mistral-7B chunk); for 2 MiB,
puts 0.49 (8 per call) to 0.93, gets into caller buffers 0.75-0.77. For 64 KiB values it was
as fast (0.94-1.35): this code earns its place for large values only.

Connections speak RESP2.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

import redis

_DIRECT_READ = 16 * 1024  # reads at least this large go straight into the destination
_READ_BUF = 64 * 1024
_HEAD_READ = 1024  # a value's reply line, codec prefix and header fit (almost always)
_IOV_MAX = 512  # buffers per sendmsg call
_MAX_LINE = 4096


class Timeout(redis.TimeoutError):
    pass


class _ConnectionLost(redis.ConnectionError):
    pass


class ReplyError(Exception):
    """An error reply (``-ERR ...``) to one command; the connection is still in sync."""


def byte_view(buf: Any) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def ttl_suffix(ttl_s: float | None) -> tuple[bytes, int]:
    """A SET's expiry arguments, and the command's argument count with them."""
    if ttl_s is None:
        return b"", 3
    if float(ttl_s).is_integer():
        return b"$2\r\nEX\r\n" + bulk(b"%d" % int(ttl_s)), 5
    return b"$2\r\nPX\r\n" + bulk(b"%d" % max(1, round(ttl_s * 1000))), 5


# Reply bytes a GET pipeline keeps unanswered. redis-server builds a pipeline's replies in
# its output buffer before it writes the first: eight 5.6 MiB values came after 24 ms and in
# 37-45 ms in all, one at a time in 18-24 ms (Redis 6.2, loopback, a quiet 2-core VM; 2 MiB
# in flight was best for 1 to 5.6 MiB values). docs/benchmarks.md 12.
REPLY_BYTES_IN_FLIGHT = 2 << 20
# Whole values: about 256 KiB unanswered, at least two values, so the client reads one
# while redis-server builds the next. Sixteen 128 KiB values of a tiny-model hit, in the
# engine, where vLLM's engine-core process spins on redis-server's core: 1.8-2.2 ms with
# two in flight, 2.8-4.1 ms with all sixteen (docs/benchmarks.md section 26).
VALUE_BYTES_WANTED = 256 << 10


def reply_window(value_bytes: int) -> int:
    """How many GETs (or GETRANGEs) of replies of this size to keep unanswered."""
    return max(1, REPLY_BYTES_IN_FLIGHT // max(1, value_bytes))


def value_window(value_bytes: int) -> int:
    """How many GETs of whole values of this size to keep unanswered."""
    return min(reply_window(value_bytes), max(2, VALUE_BYTES_WANTED // max(1, value_bytes)))


def gather(cmds: list[Any], idx: Sequence[int]) -> list[Any]:
    """The buffers to write for commands ``idx``: packed commands joined, payloads of
    (head, payload, tail) commands left as they are (no copy)."""
    if len(idx) == 1 and type(cmds[idx[0]]) is bytes:
        return [cmds[idx[0]]]
    out: list[Any] = []
    acc = bytearray()
    for i in idx:
        c = cmds[i]
        if type(c) is tuple:
            head, payload, tail = c
            acc += head
            out.append(acc)
            out.append(payload)
            acc = bytearray(tail)
        else:
            acc += c
    if acc:
        out.append(acc)
    return out


class Wire:
    """RESP2 on a connected redis-py connection's socket: scatter-gather writes,
    buffered reads that land large bulk strings directly in their destination."""

    def __init__(self, sock: socket.socket, deadline: float | None) -> None:
        self.sock = sock
        self.deadline = deadline
        self.buf = bytearray(_READ_BUF)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        self.fill_limit = _READ_BUF  # bytes one buffered read may take

    def _arm(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise Timeout("over the time budget")
            self.sock.settimeout(left)

    def send(self, bufs: list[Any]) -> None:
        sock = self.sock
        if len(bufs) == 1 or isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
            for b in bufs:
                self._arm()
                sock.sendall(b)
            return
        views = [byte_view(b) for b in bufs]
        i = 0
        while i < len(views):
            self._arm()
            sent = sock.sendmsg(views[i:i + _IOV_MAX])
            while sent and i < len(views):
                n = views[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0
            while i < len(views) and views[i].nbytes == 0:
                i += 1

    def _recv_into(self, mv: memoryview) -> int:
        self._arm()
        n = self.sock.recv_into(mv)
        if n == 0:
            raise _ConnectionLost("connection closed by the server")
        return n

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            if self.start == 0:
                raise _ConnectionLost("protocol error: reply line too long")
            n = self.end - self.start
            self.buf[:n] = self.view[self.start:self.end]
            self.start, self.end = 0, n
        self.end += self._recv_into(self.view[self.end:self.end + self.fill_limit])

    def has_lines(self, n: int) -> bool:
        """Whether ``n`` whole lines are in the buffer, unread."""
        return self.buf.count(b"\r\n", self.start, self.end) >= n

    def fill(self) -> None:
        """One read into the buffer: what the socket has, waiting for it at most until
        the deadline."""
        self._fill()

    def read_line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.view[self.start:i])
                self.start = i + 2
                return line
            if self.end - self.start > _MAX_LINE:
                raise _ConnectionLost("protocol error: reply line too long")
            self._fill()

    def read_into(self, dst: memoryview) -> None:
        n = dst.nbytes
        got = min(n, self.end - self.start)
        if got:
            dst[:got] = self.view[self.start:self.start + got]
            self.start += got
        while got < n:
            if n - got >= _DIRECT_READ:
                got += self._recv_into(dst[got:])
            else:
                self._fill()
                take = min(n - got, self.end - self.start)
                dst[got:got + take] = self.view[self.start:self.start + take]
                self.start += take
                got += take

    def read_bytes(self, n: int) -> bytes:
        if self.end - self.start >= n:
            out = bytes(self.view[self.start:self.start + n])
            self.start += n
            return out
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def skip(self, n: int) -> None:
        while n > 0:
            if self.start == self.end:
                self._fill()
            take = min(n, self.end - self.start)
            self.start += take
            n -= take

    def read_crlf(self) -> None:
        if self.read_bytes(2) != b"\r\n":
            raise _ConnectionLost("protocol error: bulk string not followed by CRLF")

    def read_bulk_len(self) -> int:
        """The length of the bulk string reply that comes next (-1: nil), its data left to
        read. An error reply raises. Buffers no more than the reply's line and a value's
        header: a large payload can then be read straight into its destination, not through
        the buffer (one copy less)."""
        self.fill_limit = _HEAD_READ
        try:
            line = self.read_line()
        finally:
            self.fill_limit = _READ_BUF
        if line[:1] == b"-":
            raise ReplyError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise _ConnectionLost(f"protocol error: unexpected reply {line[:32]!r}")
        return int(line[1:])

    def read_simple(self) -> bytes | int | None:
        """A reply that is not a value: +status, :integer, $-1; an error raises."""
        line = self.read_line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise ReplyError(rest.decode(errors="replace"))
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.read_bytes(n)
            self.read_crlf()
            return data
        raise _ConnectionLost(f"protocol error: unexpected reply {line[:32]!r}")
