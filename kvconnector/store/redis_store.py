"""A Redis (or Redis Cluster) tier for KV chunks, shared by every vLLM instance that uses it.

One Redis key per chunk, ``f"{key_prefix}:{chunk key}"``; the value is the format of
``kvconnector.store.codec`` (a small header, then the raw payload).

``RedisStore`` is the store's interface (lookups, puts, gets, counters). Beneath it:
``redis_url`` (the URL schemes taken, and how a URL is logged without its secrets),
``redis_connections`` (connections, one pipeline and one round trip per call, faults and
their backoff, ``redis_backoff``; a call itself in ``redis_call``), ``redis_stats`` (the
counters) and ``redis_wire`` (RESP written and read by hand on the
socket, so that large payloads are not copied).

Faults cost misses, never exceptions. A connection error (and a timeout of a put or a get,
or the third lookup in a row over its budget) puts the store in backoff: for 0.5 s, doubling
up to 30 s, with jitter, every call is a miss without touching the network; then one call
tries again and its success ends the backoff. Values that fail any codec check are counted,
deleted and returned as misses.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvconnector.store import codec, descriptor
from kvconnector.store.codec import CorruptValue, ExpectedChunk
from kvconnector.store.redis_call import PendingExists
from kvconnector.store.redis_connections import RedisConnections
from kvconnector.store.redis_stats import RedisStoreStats
from kvconnector.store.redis_url import checked_url, redact_url
from kvconnector.store.redis_wire import (
    ReplyError,
    Wire,
    bulk,
    byte_view,
    ttl_suffix,
    value_window,
)

logger = logging.getLogger("kvconnector.store.redis")

_DESCRIPTOR_KEY = descriptor.descriptor_key("")  # "fp:", a descriptor's key without the hex
_COALESCE = 16 * 1024  # payloads up to this size are copied into the command buffer
_WARN_EVERY_S = 10.0


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
        url, cluster = checked_url(url, cluster)
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
        self._warned: dict[str, float] = {}
        self._ttl_args = ttl_suffix(ttl_s)
        ref = weakref.ref(self)  # the connections do not keep the store (and sockets) alive
        self._connections = RedisConnections(
            url, self.safe_url, cluster=cluster, timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s, max_connections=max_connections,
            backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s,
            lookup_timeout_streak=lookup_timeout_streak, seed=seed,
            count=lambda **deltas: (s := ref()) is not None and s._count(**deltas),
            redis_kwargs=redis_kwargs)
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
        return (f"{self.key_prefix}:{key}" if self.key_prefix else str(key)).encode()

    @property
    def in_backoff(self) -> bool:
        """The store, or any node of its cluster, is backing off."""
        return self._connections.in_backoff

    def snapshot(self) -> dict[str, Any]:
        """A copy of the counters, as a dict (asked on every step: ``dataclasses.asdict``
        and its deep copies cost a step tens of microseconds)."""
        with self._lock:
            out = dict(vars(self.stats))
            out["corrupt_reasons"] = dict(self.stats.corrupt_reasons)
        out["in_backoff"] = self.in_backoff
        return out

    def exists_prefix(self, keys: Sequence[Any], budget_s: float) -> int:
        """How many leading ``keys`` are stored (asked as ``exists_many`` asks)."""
        found = self._exists(keys, budget_s).finish(count=False) if keys else []
        n = next((i for i, ok in enumerate(found) if not ok), len(found))
        self._count(lookups=1 if keys else 0, lookup_hits=n)
        return n

    def exists_many(self, keys: Sequence[Any], budget_s: float) -> list[bool]:
        """Which ``keys`` are stored: one pipelined EXISTS per key, one round trip, all of
        it within ``budget_s``. Over budget, in backoff or failed: none."""
        return self._exists(keys, budget_s).finish() if keys else []

    def start_exists(self, keys: Sequence[Any], budget_s: float) -> PendingExists | None:
        """``exists_many`` begun on a thread that must not wait: the EXISTS pipeline sent
        on a connection already open, its replies read by ``PendingExists.finish`` (on any
        thread). None, with nothing sent, where sending could wait (a cluster, a server in
        backoff, no idle connection: ``RedisConnections.start``)."""
        assert keys, "a lookup asks for at least one key"
        return self._begin_exists(keys, budget_s, at_once=True)

    def _exists(self, keys: Sequence[Any], budget_s: float) -> PendingExists:
        pending = self._begin_exists(keys, budget_s)
        assert pending is not None  # only a call begun at once gives up before sending
        return pending

    def key_space(self, fingerprint: bytes) -> bytes:  # starts every key of its chunks
        return self.redis_key(f"{fingerprint.hex()}:")

    def count_lookup(self, hits: int) -> None:  # one the key mirror answered
        self._count(lookups=1, lookup_hits=hits, mirror_lookups=1)

    def count_inline_lookup(self) -> None:  # one read on the thread that asked it
        self._count(inline_lookups=1)

    def mirror_client(self) -> Any:  # the key mirror's own client (a single server)
        return self._connections.new_client()

    def _begin_exists(self, keys: Sequence[Any], budget_s: float,
                      at_once: bool = False) -> PendingExists | None:
        deadline = time.monotonic() + max(budget_s, 0.0)
        rkeys = [self.redis_key(k) for k in keys]
        found = [False] * len(rkeys)
        reply_errors: list[str] = []

        def read(w: Wire, i: int) -> None:
            try:
                found[i] = w.read_simple() == 1
            except ReplyError as e:
                reply_errors.append(str(e))

        cmds = [b"*2\r\n$6\r\nEXISTS\r\n" + bulk(k) for k in rkeys]
        if at_once:
            call = self._connections.start("exists", rkeys, cmds, read, deadline)
            if call is None:
                return None
        else:
            call = self._connections.begin("exists", rkeys, cmds, read, deadline)
        return PendingExists(self, call, found, reply_errors)

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
            payload = byte_view(payload)
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

        def read(w: Wire, i: int) -> None:
            try:
                stored[i] = w.read_simple() == b"OK"
            except ReplyError as e:
                reply_errors.append(str(e))

        self._connections.call("put", rkeys, cmds, read, None)
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
            return key, header, descriptor.sign(bytes(byte_view(payload)), self.mac_key)
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
            dsts = [byte_view(b) for b in out]
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

        def read(w: Wire, i: int) -> None:
            try:
                value = self._read_value(w, expected[i], None if dsts is None else dsts[i])
            except ReplyError as e:
                reply_errors.append(str(e))
                return
            if isinstance(value, CorruptValue):
                corrupt.append((i, value))
            else:
                results[i] = value

        cmds = [b"*2\r\n$3\r\nGET\r\n" + bulk(k) for k in rkeys]
        window = value_window(max(e.nbytes for e in expected))
        answered = self._connections.call("get", rkeys, cmds, read, None, window)
        results = [r if a else None for r, a in zip(results, answered, strict=True)]
        corrupt = [(i, c) for i, c in corrupt if answered[i]]
        self._note_reply_errors(reply_errors)
        if corrupt:
            self._drop_corrupt([rkeys[i] for i, _ in corrupt], [c for _, c in corrupt])
        hits = sum(r is not None for r in results)
        self._count(gets=len(keys), hits=hits, misses=len(keys) - hits,
                    get_bytes=sum(r.nbytes for r in results if r is not None))
        return results

    def close(self) -> None:
        self._connections.close()

    # ---- internals ---------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            s = self.stats
            for name, d in deltas.items():
                setattr(s, name, getattr(s, name) + d)

    def _note_reply_errors(self, errors: list[str]) -> None:
        if not errors:
            return
        self._count(errors=len(errors))
        self._connections.note_error_replies(errors)
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

    def _read_value(self, w: Wire, expected: ExpectedChunk,
                    dst: memoryview | None) -> memoryview | CorruptValue | None:
        n = w.read_bulk_len()
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

        def read(w: Wire, i: int) -> None:
            try:
                counts[i] = int(w.read_simple() or 0)
            except ReplyError:
                pass

        cmds = [b"*2\r\n$3\r\nDEL\r\n" + bulk(k) for k in rkeys]
        self._connections.call("delete", rkeys, cmds, read, None)
        return sum(counts)
