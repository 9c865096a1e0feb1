"""A Redis (or Redis Cluster) tier for KV chunks, shared by every vLLM instance that uses it.

One Redis key per chunk, ``f"{key_prefix}:{chunk key}"``; the value is the format of
``kvconnector.store.codec`` (a small header, then the raw payload).

redis-py manages the connections (URL parsing, AUTH, SELECT, TLS, unix sockets, the pool,
the cluster's slot map). The commands themselves are written and read here, straight on
the connection's socket:

* a SET is sent as its RESP prefix, the codec header and the caller's payload buffer,
  with ``sendmsg`` (scatter-gather): a 32 MiB payload is never joined with its header or
  copied into a command buffer, which redis-py's packer does for every value;
* a GET reply is read with ``recv_into`` straight into a buffer of the payload's size (or
  one the caller passes in ``out``), after the header has been checked;
* every call is one pipeline: all commands are written, then all replies read (in a
  cluster, to all nodes concerned at once), so one call costs one round trip;
* the store keeps its connections between calls (checked with a poll when idle for more
  than 50 ms), skipping redis-py's per-checkout checks. Connections speak RESP2.

Faults cost misses, never exceptions. A connection error (and a timeout of a put or a get,
or the third lookup in a row over its budget) puts the store in backoff: for 0.5 s, doubling
up to 30 s, with jitter, every call is a miss without touching the network; then one call
tries again and its success ends the backoff. Values that fail any codec check are counted,
deleted and returned as misses.

URL schemes: ``redis://``, ``rediss://`` (TLS), ``unix://`` (redis-py's syntax, including
``?db=``, ``?password=``), and ``redis+cluster://`` / ``rediss+cluster://`` for Redis Cluster
(the same as ``cluster=True``). Passwords go to logs only through ``redact_url``.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import random
import re
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvconnector.store import codec, descriptor
from kvconnector.store.codec import CorruptValue, ExpectedChunk

logger = logging.getLogger("kvconnector.store.redis")

_SECRET_QUERY_KEYS = {"password", "pass", "passwd", "pwd", "auth", "token", "secret"}
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SCHEMES = {"redis", "rediss", "unix", *_CLUSTER_SCHEMES}

_DESCRIPTOR_KEY = descriptor.descriptor_key("")  # "fp:", a descriptor's key without the hex
_COALESCE = 16 * 1024  # payloads up to this size are copied into the command buffer
_DIRECT_READ = 16 * 1024  # reads at least this large go straight into the destination
_READ_BUF = 64 * 1024
_HEAD_READ = 1024  # a value's reply line, codec prefix and header fit (almost always)
_IOV_MAX = 512  # buffers per sendmsg call
_MAX_LINE = 4096
# A connection idle for longer is polled before reuse, to find one the server closed
# (restart, idle timeout) without losing a call; one used just before is trusted.
_RECHECK_AFTER_S = 0.05
_WARN_EVERY_S = 10.0
# No CLIENT SETINFO on connect: one round trip less, and none to wait for on a hung server.
_NO_CLIENT_SETINFO: dict[str, Any] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.connection.AbstractConnection).parameters
    else {"lib_name": None, "lib_version": None})


# One host of a URL's netloc: a name or IPv4 address, or [IPv6], with an optional port.
_HOSTPORT = r"(?:[A-Za-z0-9._-]+|\[[0-9A-Za-z:.%]+\])(?::[0-9]{1,5})?"
_HOSTS_RE = re.compile(rf"(?:{_HOSTPORT}(?:,{_HOSTPORT})*)?")  # empty: unix://...@/path
_HOSTPORT_RE = re.compile(_HOSTPORT)
# A secret query parameter and its value (to the next & or #), wherever it is.
_SECRET_RE = re.compile(r"(?i)(?<=[?&])(" + "|".join(sorted(_SECRET_QUERY_KEYS))
                        + r")=[^&#]*")


def _userinfo_end(rest: str) -> int | None:
    """Where the userinfo of ``rest`` (a URL after "://") ends: the last "@" that is followed
    by a list of hosts (up to the next "/", "?", "#" or the end) and is not inside a secret
    query value. A password may hold "@", ":", "/", "?", "#" unencoded: with the last such
    "@", all of it goes with the userinfo. None: no userinfo (and -1: one that cannot be
    told apart from the rest, so nothing of the URL is safe to show)."""
    secret_spans = [m.span() for m in _SECRET_RE.finditer(rest)]
    found = False
    for i in range(len(rest) - 1, -1, -1):
        if rest[i] != "@":
            continue
        found = True
        if any(a <= i < b for a, b in secret_spans):
            continue
        end = len(rest)
        for sep in "/?#":
            j = rest.find(sep, i + 1)
            if j >= 0:
                end = min(end, j)
        if _HOSTS_RE.fullmatch(rest, i + 1, end):
            return i
    return -1 if found else None


def _redact_userinfo(userinfo: str) -> str:
    """``***`` for the userinfo; for a cluster URL with a userinfo per host
    (``:pw@h1:7000,:pw@h2:7001``, the userinfo before the last "@" is
    ``:pw@h1:7000,:pw``), ``***@h1:7000,***``: the hosts stay, only when every piece but
    the last reads as userinfo@host (a "," in a password collapses it all to ``***``)."""
    *pieces, _last = userinfo.split(",")
    hosts = [piece.rpartition("@")[2] for piece in pieces]
    if not all("@" in p and _HOSTPORT_RE.fullmatch(h) for p, h in zip(pieces, hosts,
                                                                       strict=True)):
        return "***"
    return ",".join([*(f"***@{h}" for h in hosts), "***"])


def redact_url(url: str) -> str:
    """``url`` without its secrets, safe to log: the userinfo (user and password, which
    ``redis://PASSWORD@host`` puts in the user field) is replaced by ``***`` as a whole, for
    each host of a cluster URL, and so are the values of secret query parameters
    (``?password=``). Found by parsing the netloc, not by a pattern for a password: see
    ``_userinfo_end``."""
    try:
        scheme, sep, rest = url.partition("://")
        if not sep:
            scheme, rest = "", url
        head = f"{scheme}{sep}"
        at = _userinfo_end(rest)
        if at == -1:
            return f"{head}***"
        if at is not None:
            rest = f"{_redact_userinfo(rest[:at])}@{rest[at + 1:]}"
        return head + _SECRET_RE.sub(lambda m: f"{m.group(1)}=***", rest)
    except Exception:
        return "<unparseable url>"


def url_userinfo_problem(url: str) -> str | None:
    """Why redis-py would misread the userinfo of ``url``, or None. A "/", "?" or "#" in a
    password ends the netloc for a URL parser: redis-py would connect to a host and port
    cut from the password (and name them in its errors). Such a URL is refused."""
    rest = url.partition("://")[2]
    at = _userinfo_end(rest)
    if at == -1 or (at is not None and any(c in rest[:at] for c in "/?#")):
        return ("its userinfo holds '/', '?' or '#' (or cannot be told from the host): "
                "percent-encode them in the password (%2F, %3F, %23) and any '@' after the "
                "host (%40), or give the password with redis_password_env / "
                "redis_password_file")
    return None


def url_has_password(url: str) -> bool:
    """Whether ``url`` carries a password (userinfo or a secret query key)."""
    return redact_url(url) != url


@dataclass
class RedisStoreStats:
    """Counters since the store was made. ``puts``/``put_failed``, ``gets``, ``hits`` and
    ``misses`` count chunks, ``put_bytes``/``get_bytes`` their payload bytes; ``lookups``
    counts ``exists_prefix`` calls and ``lookup_hits`` the chunks they found. ``errors``,
    ``timeouts``, ``busy`` (no free connection in time) and ``skipped_in_backoff`` count
    calls (``errors`` also counts error replies); ``backoffs`` how often the store entered
    backoff and ``reconnects`` the probes that tried Redis again after one."""

    puts: int = 0
    put_bytes: int = 0
    put_failed: int = 0
    gets: int = 0
    get_bytes: int = 0
    hits: int = 0
    misses: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    corrupt: int = 0
    corrupt_deleted: int = 0
    corrupt_reasons: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    timeouts: int = 0
    busy: int = 0
    backoffs: int = 0
    reconnects: int = 0
    skipped_in_backoff: int = 0


class _Backoff:
    """Exponential backoff with jitter, shared by all threads of a store.

    ``allow`` answers "ok" (healthy), "probe" (backoff over: this call, alone, tries again)
    or "skip" (in backoff, or another call is probing).
    """

    def __init__(self, initial_s: float, max_s: float, rng: random.Random) -> None:
        self.initial_s, self.max_s, self._rng = initial_s, max_s, rng
        self._lock = threading.Lock()
        self.delay_s = 0.0
        self.until = 0.0  # 0.0: not in backoff
        self._probing = False

    @property
    def active(self) -> bool:
        return self.until != 0.0

    def allow(self) -> str:
        if self.until == 0.0:
            return "ok"
        with self._lock:
            if self.until == 0.0:
                return "ok"
            if self._probing or time.monotonic() < self.until:
                return "skip"
            self._probing = True
            return "probe"

    def failure(self, probe: bool) -> float | None:
        """Enter (or extend) backoff; returns the delay, or None if already backing off."""
        with self._lock:
            now = time.monotonic()
            if not probe and self.until != 0.0:
                return None  # another call already put the store in backoff
            self.delay_s = self.initial_s if self.delay_s == 0.0 else min(
                self.max_s, self.delay_s * 2)
            delay = self.delay_s * self._rng.uniform(0.8, 1.2)
            self.until = now + delay
            self._probing = False
            return delay

    def success(self) -> None:
        with self._lock:
            self.delay_s = 0.0
            self.until = 0.0
            self._probing = False


class _Timeout(redis.TimeoutError):
    pass


class _ConnectionLost(redis.ConnectionError):
    pass


class _ReplyError(Exception):
    """An error reply (``-ERR ...``) to one command; the connection is still in sync."""


def _byte_view(buf: Any) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


class _Wire:
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
                raise _Timeout("over the time budget")
            self.sock.settimeout(left)

    def send(self, bufs: list[Any]) -> None:
        sock = self.sock
        if len(bufs) == 1 or isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
            for b in bufs:
                self._arm()
                sock.sendall(b)
            return
        views = [_byte_view(b) for b in bufs]
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

    def read_simple(self) -> bytes | int | None:
        """A reply that is not a value: +status, :integer, $-1; an error raises."""
        line = self.read_line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise _ReplyError(rest.decode(errors="replace"))
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.read_bytes(n)
            self.read_crlf()
            return data
        raise _ConnectionLost(f"protocol error: unexpected reply {line[:32]!r}")


@dataclass
class _Held:
    """A connection this store holds between calls, with its poller and read buffer."""

    __slots__ = ("pool", "conn", "poller", "wire", "used")
    pool: Any
    conn: Any
    poller: Any
    wire: _Wire
    used: float


class RedisStore:
    """Chunks in Redis. Thread-safe; make one per process (redis-py pools are per process).

    The scheduler process only calls ``exists_prefix``; workers call ``put_many`` and
    ``get_many``. No method raises for a Redis fault: it returns misses and counts.
    """

    def __init__(self, url: str, *, key_prefix: str = "kvc", ttl_s: float | None = None,
                 timeout_s: float = 2.0, connect_timeout_s: float | None = None,
                 cluster: bool = False, max_connections: int = 8,
                 backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0,
                 lookup_timeout_streak: int = 3, seed: int | None = None,
                 mac_key: bytes | None = None, **redis_kwargs: Any) -> None:
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in _SCHEMES:
            raise ValueError(f"unsupported Redis URL {redact_url(url)!r}: use redis://, "
                             "rediss://, unix://, redis+cluster:// or rediss+cluster://")
        problem = url_userinfo_problem(url)
        if problem is not None:
            raise ValueError(f"Redis URL {redact_url(url)!r}: {problem}")
        if scheme in _CLUSTER_SCHEMES:
            cluster = True
            url = _CLUSTER_SCHEMES[scheme] + url[len(scheme):]
        if cluster and scheme == "unix":
            raise ValueError("Redis Cluster needs a TCP URL (redis:// or rediss://)")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError("ttl_s must be positive (or None for no expiry)")
        if timeout_s <= 0 or max_connections <= 0:
            raise ValueError("timeout_s and max_connections must be positive")
        self.url = url
        self.safe_url = redact_url(url)
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.cluster = cluster
        self.max_connections = max_connections
        self.lookup_timeout_streak = lookup_timeout_streak
        self.mac_key = mac_key
        self.stats = RedisStoreStats()
        self._lock = threading.Lock()
        self._slots: queue.SimpleQueue = queue.SimpleQueue()  # one token per connection
        for _ in range(max_connections):
            self._slots.put(None)
        self._backoff_s = (backoff_initial_s, backoff_max_s)
        self._rng = random.Random(seed)
        self._backoff = self._new_backoff()  # the server's, or a cluster's routing
        self._node_backoffs: dict[str, _Backoff] = {}  # a cluster's, per node
        self._timeout_streak = 0
        self._closed = False
        self._warned: dict[str, float] = {}
        # Connections this store holds between calls, per pool: reused without the pool's
        # per-checkout checks (tens of microseconds, a good part of a 64 KiB GET).
        self._idle: dict[int, tuple[Any, list[_Held]]] = {}
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (s := ref()) is not None and s._forget_idle())
        self._ttl_args = self._ttl_suffix(ttl_s)
        self._conn_kwargs: dict[str, Any] = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s if connect_timeout_s else min(
                timeout_s, 0.5),
            protocol=2, **_NO_CLIENT_SETINFO,
            retry=Retry(NoBackoff(), 0), max_connections=max_connections,
            health_check_interval=0)
        self._conn_kwargs.update(redis_kwargs)
        self._pool: redis.ConnectionPool | None = None
        self._cluster: Any = None  # redis.cluster.RedisCluster, made on first use
        self._cluster_stale = False
        self._cluster_lock = threading.Lock()
        if not cluster:
            # Parses the URL (password, db, TLS, unix socket); connects on first use.
            try:
                self._pool = redis.ConnectionPool.from_url(url, **self._conn_kwargs)
            except ValueError as e:  # its message may quote the URL's parts: not shown
                raise ValueError(f"bad Redis URL {self.safe_url!r} ({type(e).__name__})") \
                    from None
            self._pool.connection_kwargs["protocol"] = 2  # the wire code here speaks RESP2
        logger.info("kvconnector redis store: %s (prefix %r, cluster=%s, ttl=%s, timeout=%.3gs)",
                    self.safe_url, key_prefix, cluster, ttl_s, timeout_s)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisStore:
        """A store for ``url``; nothing is connected until the first call.

        ``key_prefix``: Redis key = f"{key_prefix}:{chunk key}" (namespaces deployments).
        ``ttl_s``: expiry of stored chunks (EX, or PX for fractions), None for none.
        ``timeout_s``: socket timeout of puts and gets (no progress for that long: a fault).
        ``connect_timeout_s``: TCP/TLS connect timeout, default min(timeout_s, 0.5). A
        lookup's budget does not bound a connect, so the scheduler's store should use
        about its lookup budget here (a connect is needed only at start and after faults).
        ``cluster``: Redis Cluster (also chosen by redis+cluster:// or rediss+cluster://).
        ``max_connections``: concurrent calls (and connections per server); a call that
        finds none free within its time counts as ``busy`` and is a miss.
        ``backoff_initial_s``/``backoff_max_s``: the backoff after a fault (jitter +-20%).
        ``lookup_timeout_streak``: lookups over budget in a row that count as a fault.
        ``mac_key``: ``codec.mac_key(secret)``; values read must carry a valid MAC (the
        writer signs them with ``codec.encode_header(..., mac_key=store.mac_key)``).
        Other keyword arguments go to redis-py's connection pool (e.g. ``ssl_ca_certs``).
        """
        return cls(url, **kwargs)

    def __repr__(self) -> str:
        return f"RedisStore({self.safe_url!r}, prefix={self.key_prefix!r})"

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- public API --------------------------------------------------------------------

    def redis_key(self, key: Any) -> bytes:
        key = str(key)
        return (f"{self.key_prefix}:{key}" if self.key_prefix else key).encode()

    def _new_backoff(self) -> _Backoff:
        return _Backoff(*self._backoff_s, self._rng)

    @property
    def in_backoff(self) -> bool:
        """The store, or any node of its cluster, is backing off."""
        return self._backoff.active or any(b.active for b in self._node_backoffs.values())

    def snapshot(self) -> dict[str, Any]:
        """A copy of the counters, as a dict."""
        with self._lock:
            out = asdict(self.stats)
        out["in_backoff"] = self.in_backoff
        return out

    def exists_prefix(self, keys: Sequence[Any], budget_s: float) -> int:
        """How many leading ``keys`` are stored: one pipelined EXISTS per key, one round
        trip, all of it within ``budget_s``. Over budget, in backoff or failed: 0."""
        if not keys:
            return 0
        n = 0
        for found in self._exists(keys, budget_s):
            if not found:
                break
            n += 1
        self._count(lookups=1, lookup_hits=n)
        return n

    def exists_many(self, keys: Sequence[Any], budget_s: float) -> list[bool]:
        """Which ``keys`` are stored, like ``exists_prefix`` (one round trip within
        ``budget_s``; over budget, in backoff or failed: none)."""
        if not keys:
            return []
        found = self._exists(keys, budget_s)
        self._count(lookups=1, lookup_hits=sum(found))
        return found

    def _exists(self, keys: Sequence[Any], budget_s: float) -> list[bool]:
        if not keys:
            return []
        deadline = time.monotonic() + max(budget_s, 0.0)
        rkeys = [self.redis_key(k) for k in keys]
        found = [False] * len(rkeys)
        reply_errors: list[str] = []

        def read(w: _Wire, i: int) -> None:
            try:
                found[i] = w.read_simple() == 1
            except _ReplyError as e:
                reply_errors.append(str(e))

        cmds = [b"*2\r\n$6\r\nEXISTS\r\n" + _bulk(k) for k in rkeys]
        answered = self._call("exists", rkeys, cmds, read, deadline)
        self._note_reply_errors(reply_errors)
        return [f and a for f, a in zip(found, answered, strict=True)]

    def put_many(self, items: Sequence[tuple[Any, bytes, Any]]) -> int:
        """Store ``(key, header, payload)`` items, header from ``codec.encode_header``.

        One pipeline of SETs (with EX/PX when ``ttl_s`` is set); payloads are written from
        their own buffers, not copied. Returns how many were stored; never raises for a
        Redis fault (the items are then simply not stored, and counted).

        A fingerprint's descriptor goes as ``(descriptor.descriptor_key(...), b"", value)``;
        with ``mac_key`` the store signs it (``descriptor.sign``), as it is the chunks:
        readers with the key use only signed descriptors."""
        if not items:
            return 0
        if self.mac_key is not None:
            items = [self._signed_descriptor(it) for it in items]
        rkeys: list[bytes] = []
        cmds: list[Any] = []
        sizes: list[int] = []
        ttl_tail = b"\r\n" + self._ttl_args[0]
        n_args = self._ttl_args[1]
        for key, header, payload in items:
            rkey = self.redis_key(key)
            payload = _byte_view(payload)
            size = len(header) + payload.nbytes
            head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
                n_args, len(rkey), rkey, size, header)
            if payload.nbytes <= _COALESCE:
                cmds.append(head + payload.tobytes() + ttl_tail)
            else:
                cmds.append((head, payload, ttl_tail))
            rkeys.append(rkey)
            sizes.append(payload.nbytes)
        stored = [False] * len(items)
        reply_errors: list[str] = []

        def read(w: _Wire, i: int) -> None:
            try:
                stored[i] = w.read_simple() == b"OK"
            except _ReplyError as e:
                reply_errors.append(str(e))

        self._call("put", rkeys, cmds, read, None)
        n = sum(stored)
        nbytes = sum(size for size, ok in zip(sizes, stored, strict=True) if ok)
        self._note_reply_errors(reply_errors)
        self._count(puts=n, put_bytes=nbytes, put_failed=len(items) - n)
        return n

    def _signed_descriptor(self, item: tuple[Any, bytes, Any]) -> tuple[Any, bytes, Any]:
        key, header, payload = item
        if header or not str(key).startswith(_DESCRIPTOR_KEY) or \
                not descriptor.is_descriptor(payload):
            return item
        try:
            return key, header, descriptor.sign(bytes(_byte_view(payload)), self.mac_key)
        except ValueError as e:  # not well formed: sent as it is, a reader refuses it
            logger.debug("kvconnector redis: descriptor %s not signed: %s", key, e)
            return item

    def get_many(self, keys: Sequence[Any], expected: Sequence[ExpectedChunk],
                 out: Sequence[Any] | None = None) -> list[memoryview | None]:
        """Fetch chunks: one pipeline of GETs. Each value is checked by the codec; a corrupt,
        truncated, oversized or foreign value is counted, deleted and returned as None.
        A fault returns None for every key.

        ``out``: optional writable buffers (one per key, at least ``nbytes`` each, e.g. a
        pinned host tensor's memory) that payloads are read into directly; the returned
        views then point into them. Otherwise each payload gets a new buffer (a numpy uint8 array).
        """
        if len(keys) != len(expected):
            raise ValueError(f"{len(keys)} keys but {len(expected)} expected chunks")
        dsts: list[memoryview] | None = None
        if out is not None:
            if len(out) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(out)} out buffers")
            dsts = [_byte_view(b) for b in out]
            for d, e in zip(dsts, expected, strict=True):
                if d.readonly or d.nbytes < e.nbytes:
                    raise ValueError(f"out buffer for {e.key} is read-only or smaller than "
                                     f"{e.nbytes} bytes")
        if not keys:
            return []
        rkeys = [self.redis_key(k) for k in keys]
        results: list[memoryview | None] = [None] * len(keys)
        corrupt: list[tuple[int, CorruptValue]] = []
        reply_errors: list[str] = []

        def read(w: _Wire, i: int) -> None:
            try:
                value = self._read_value(w, expected[i], None if dsts is None else dsts[i])
            except _ReplyError as e:
                reply_errors.append(str(e))
                return
            if isinstance(value, CorruptValue):
                corrupt.append((i, value))
            else:
                results[i] = value

        cmds = [b"*2\r\n$3\r\nGET\r\n" + _bulk(k) for k in rkeys]
        answered = self._call("get", rkeys, cmds, read, None)
        results = [r if a else None for r, a in zip(results, answered, strict=True)]
        corrupt = [(i, c) for i, c in corrupt if answered[i]]
        self._note_reply_errors(reply_errors)
        if corrupt:
            self._drop_corrupt([rkeys[i] for i, _ in corrupt], [c for _, c in corrupt])
        hits = sum(r is not None for r in results)
        self._count(gets=len(keys), hits=hits, misses=len(keys) - hits,
                    get_bytes=sum(r.nbytes for r in results if r is not None))
        return results

    def delete_many(self, keys: Sequence[Any]) -> int:
        """Delete keys; returns how many existed. Faults: 0."""
        return self._delete([self.redis_key(k) for k in keys])

    def close(self) -> None:
        self._closed = True
        self._drain_idle()
        try:
            if self._pool is not None:
                self._pool.disconnect()
            if self._cluster is not None:
                self._cluster.close()
        except Exception as e:  # closing must not raise either
            logger.debug("closing %s: %s", self.safe_url, e)

    # ---- internals ---------------------------------------------------------------------

    @staticmethod
    def _ttl_suffix(ttl_s: float | None) -> tuple[bytes, int]:
        if ttl_s is None:
            return b"", 3
        if float(ttl_s).is_integer():
            return b"$2\r\nEX\r\n" + _bulk(b"%d" % int(ttl_s)), 5
        return b"$2\r\nPX\r\n" + _bulk(b"%d" % max(1, round(ttl_s * 1000))), 5

    def _count(self, **deltas: int) -> None:
        with self._lock:
            s = self.stats
            for name, d in deltas.items():
                setattr(s, name, getattr(s, name) + d)

    def _note_reply_errors(self, errors: list[str]) -> None:
        if not errors:
            return
        self._count(errors=len(errors))
        if self.cluster and any(e.startswith(("MOVED", "ASK", "CLUSTERDOWN")) for e in errors):
            self._cluster_stale = True
        self._warn("reply", "kvconnector redis %s: %d error replies, first: %s",
                   self.safe_url, len(errors), errors[0][:200])

    def _warn(self, kind: str, msg: str, *args: Any) -> None:
        """A warning at most every ``_WARN_EVERY_S`` per kind (debug in between)."""
        now = time.monotonic()
        if now - self._warned.get(kind, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned[kind] = now
            logger.warning(msg, *args)
        else:
            logger.debug(msg, *args)

    def _read_value(self, w: _Wire, expected: ExpectedChunk,
                    dst: memoryview | None) -> memoryview | CorruptValue | None:
        # Buffer no more than the reply's line and header: a large payload is then read
        # straight into its destination, not through the buffer (one copy less).
        w.fill_limit = _HEAD_READ
        try:
            line = w.read_line()
        finally:
            w.fill_limit = _READ_BUF
        if line[:1] == b"-":
            raise _ReplyError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise _ConnectionLost(f"protocol error: unexpected reply {line[:32]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        left = n + 2  # bytes of this reply not yet read, its final CRLF included
        try:
            prefix = w.read_bytes(min(n, codec.PREFIX_LEN))
            left -= len(prefix)
            header_len = codec.check_prefix(prefix, n)
            header_bytes = w.read_bytes(header_len)
            left -= header_len
            header = codec.check_header(header_bytes, expected)
            size = left - 2
            codec.check_payload_len(header, size)
            # numpy.empty: no zero-fill, and reuses freed heap (bytearray: 10x slower at 2 MiB)
            payload = dst[:size] if dst is not None else memoryview(np.empty(size, np.uint8))
            w.read_into(payload)
            left = 2
            w.read_crlf()
            left = 0
            codec.check_payload(header, payload, self.mac_key)
            return payload
        except CorruptValue as c:
            w.skip(left)
            return c

    def _drop_corrupt(self, rkeys: list[bytes], problems: list[CorruptValue]) -> None:
        with self._lock:
            self.stats.corrupt += len(problems)
            reasons = self.stats.corrupt_reasons
            for c in problems:
                reasons[c.reason] = reasons.get(c.reason, 0) + 1
        deleted = self._delete(rkeys)
        self._count(corrupt_deleted=deleted)
        self._warn("corrupt", "kvconnector redis %s: %d corrupt values deleted (first %s: %s)",
                   self.safe_url, deleted, rkeys[0].decode(errors="replace"), problems[0])

    def _delete(self, rkeys: list[bytes]) -> int:
        if not rkeys:
            return 0
        counts = [0] * len(rkeys)

        def read(w: _Wire, i: int) -> None:
            try:
                counts[i] = int(w.read_simple() or 0)
            except _ReplyError:
                pass

        cmds = [b"*2\r\n$3\r\nDEL\r\n" + _bulk(k) for k in rkeys]
        self._call("delete", rkeys, cmds, read, None)
        return sum(counts)

    def _routes(self, rkeys: list[bytes]) -> list[tuple[Any, Sequence[int], _Backoff, str]]:
        """(connection pool, key indices, its backoff, its name) per server the keys live
        on. A cluster's nodes back off one by one: the keys of live nodes keep being
        served while a dead one is skipped."""
        if not self.cluster:
            return [(self._pool, range(len(rkeys)), self._backoff, self.safe_url)]
        with self._cluster_lock:
            if self._cluster is None:
                from redis.cluster import RedisCluster
                kw = {k: v for k, v in self._conn_kwargs.items() if k != "retry"}
                self._cluster = RedisCluster.from_url(
                    self.url, retry=Retry(NoBackoff(), 0), **kw)
                self._cluster_stale = False
            elif self._cluster_stale:
                self._drain_idle()  # nodes may have moved: pools are rebuilt
                self._cluster.nodes_manager.initialize()
                self._cluster_stale = False
            rc = self._cluster
        groups: dict[str, tuple[Any, list[int], _Backoff, str]] = {}
        for i, k in enumerate(rkeys):
            node = rc.get_node_from_key(k)
            group = groups.get(node.name)
            if group is None:
                backoff = self._node_backoffs.get(node.name)
                if backoff is None:
                    backoff = self._node_backoffs.setdefault(node.name, self._new_backoff())
                group = groups[node.name] = (node.redis_connection.connection_pool, [],
                                             backoff, node.name)
            group[1].append(i)
        return list(groups.values())

    def _call(self, op: str, rkeys: list[bytes], cmds: list[Any],
              read: Callable[[_Wire, int], None], deadline: float | None) -> list[bool]:
        """Run one pipeline: send ``cmds[i]`` (packed bytes, or (head, payload, tail) to be
        written without copying the payload) for every key, then ``read`` every reply.
        Returns, per key, whether its server answered: False for a key whose server is in
        backoff or failed (its ``read`` results are to be ignored). Faults are counted,
        never raised; each server (each node of a cluster) backs off on its own."""
        answered = [False] * len(rkeys)
        if self._closed:
            return answered
        state = self._backoff.allow()  # the server, or a cluster's routing
        if state == "skip":
            self._count(skipped_in_backoff=1)
            return answered
        if state == "probe":
            self._count(reconnects=1)
        try:
            self._slots.get_nowait()
        except queue.Empty:
            wait = self.timeout_s if deadline is None else deadline - time.monotonic()
            try:
                if wait <= 0:
                    raise queue.Empty
                self._slots.get(timeout=wait)
            except queue.Empty:
                self._count(busy=1)
                if state == "probe":
                    self._backoff.failure(probe=True)
                return answered
        groups: list[_Group] = []
        try:
            try:
                routes = self._routes(rkeys)
            except Exception as e:
                self._failure(op, state, e, self._backoff, self.safe_url)
                return answered
            if self.cluster and state == "probe":
                self._backoff.success()  # the cluster answers again; its nodes decide
                state = "ok"
            for pool, idx, backoff, name in routes:
                g_state = state if backoff is self._backoff else backoff.allow()
                if g_state == "skip":
                    self._count(skipped_in_backoff=1)
                    continue
                if g_state == "probe" and backoff is not self._backoff:
                    self._count(reconnects=1)
                groups.append(_Group(pool, idx, backoff, name, g_state))
            for g in groups:
                g.attempt(lambda g=g: setattr(g, "held", self._acquire(g.pool)))
            if deadline is not None and time.monotonic() >= deadline:
                for g in groups:
                    g.fail(_Timeout("over the time budget while connecting"))
            for g in groups:
                if g.held is not None:
                    g.held.wire.deadline = deadline
                g.attempt(lambda g=g: g.held.wire.send(_gather(cmds, g.idx)))
            for g in groups:
                g.attempt(lambda g=g: [read(g.held.wire, i) for i in g.idx])
            if deadline is not None and time.monotonic() > deadline:
                # every reply read (the connection is in sync), but too late to be used
                for g in groups:
                    g.late = g.error is None
                    g.fail(_Timeout("replies came after the time budget"))
        finally:
            for g in groups:
                if g.held is not None:
                    self._release(g.held, g.error is not None and not g.late,
                                  deadline is not None)
            self._slots.put(None)
        for g in groups:
            if g.error is not None:
                self._failure(op, g.state, g.error, g.backoff, g.name)
                continue
            for i in g.idx:
                answered[i] = True
            with self._lock:
                self._timeout_streak = 0
            if g.state == "probe":
                g.backoff.success()
                logger.info("kvconnector redis %s: reachable again", g.name)
        return answered

    def _acquire(self, pool: Any) -> _Held:
        """A connected connection: the last one this store used with ``pool`` if a poll
        shows nothing unread on it (a server that closed it makes it readable), else one
        from the pool (which connects it)."""
        entry = self._idle.get(id(pool))
        while entry and entry[1]:
            try:
                held = entry[1].pop()
            except IndexError:
                break
            wire = held.wire
            if held.conn._sock is wire.sock and wire.start == wire.end and (
                    time.monotonic() - held.used < _RECHECK_AFTER_S
                    or not held.poller.poll(0) and not (
                        isinstance(wire.sock, ssl.SSLSocket) and wire.sock.pending())):
                return held
            held.conn.disconnect()  # closed by the server (restart, idle timeout)
            pool.release(held.conn)
        conn = pool.get_connection()
        poller = select.poll()
        poller.register(conn._sock, select.POLLIN)
        return _Held(pool, conn, poller, _Wire(conn._sock, None), 0.0)

    def _release(self, held: _Held, failed: bool, restore_timeout: bool) -> None:
        conn = held.conn
        try:
            if failed or conn._sock is None:
                conn.disconnect()
                held.pool.release(conn)
                return
            if restore_timeout:
                conn._sock.settimeout(self._conn_kwargs["socket_timeout"])
            held.used = time.monotonic()
            entry = self._idle.get(id(held.pool))
            if entry is None:
                entry = self._idle.setdefault(id(held.pool), (held.pool, []))
            entry[1].append(held)
        except Exception as e:
            logger.debug("releasing a connection: %s", e)

    def _drain_idle(self) -> None:
        for pool, idle in list(self._idle.values()):
            while idle:
                try:
                    held = idle.pop()
                except IndexError:
                    break
                try:
                    held.conn.disconnect()
                    pool.release(held.conn)
                except Exception:
                    pass

    def _forget_idle(self) -> None:
        """In a forked child: the parent's sockets are not ours to use, nor to close."""
        self._idle = {}

    def _failure(self, op: str, state: str, e: BaseException, backoff: _Backoff,
                 where: str) -> None:
        is_timeout = isinstance(e, (socket.timeout, TimeoutError, redis.TimeoutError))
        with self._lock:
            if is_timeout:
                self.stats.timeouts += 1
                self._timeout_streak += 1
                streak = self._timeout_streak
            else:
                self.stats.errors += 1
                streak = 0
        if is_timeout and op == "exists" and state != "probe" and \
                streak < self.lookup_timeout_streak:
            logger.debug("kvconnector redis %s: lookup over its budget", where)
            return
        delay = backoff.failure(probe=state == "probe")
        if self.cluster:
            self._cluster_stale = True
        if delay is None:
            return
        self._count(backoffs=1)
        self._drain_idle()
        log = logger.warning if state == "ok" else logger.debug
        log("kvconnector redis %s: %s failed (%s: %s); misses for %.2fs", where, op,
            type(e).__name__, e, delay)


class _Group:
    """The keys of one call that live on one server, and how their part went."""

    def __init__(self, pool: Any, idx: Sequence[int], backoff: _Backoff, name: str,
                 state: str) -> None:
        self.pool, self.idx, self.backoff, self.name, self.state = (
            pool, idx, backoff, name, state)
        self.held: _Held | None = None
        self.error: BaseException | None = None
        self.late = False  # all replies read, after the deadline: the connection is fine

    def attempt(self, step: Callable[[], Any]) -> None:
        if self.error is None:
            try:
                step()
            except Exception as e:
                self.error = e

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error


def _gather(cmds: list[Any], idx: Sequence[int]) -> list[Any]:
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
