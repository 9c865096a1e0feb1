"""This engine's keys in Redis, known without asking: a set kept by Redis's keyspace
notifications, so that the scheduler answers a lookup from memory instead of a round trip.

A miss with Redis behind memory otherwise waits for that round trip (0.5-0.8 ms on the CPU
build, docs/benchmarks.md section 24). The mirror may be wrong for a moment either way, and
both ways cost at most a miss: a key it lacks (a notification not read yet) is a miss, a
key it holds that Redis has lost (``FLUSHALL`` sends no notification per key; a TTL passed
but not yet collected) makes a fetch that finds nothing, and the blocks are recomputed, as
when a key is evicted between a lookup and its fetch. Whenever it may have missed a
notification (its connection dropped, notifications were turned off), it stops answering,
lookups ask Redis again, and it rebuilds itself: subscribe first, then ``SCAN``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from kvconnector.threads import name_os_thread

logger = logging.getLogger("kvconnector.store.redis_mirror")

# Keyspace events this needs ('E': keyevent channels; '$': SET; 'g': DEL, RENAME; 'x':
# expired; 'e': evicted). 'A' stands for every class but 'n', 'm' and 'K'/'E'.
NEEDED_FLAGS = "E$gxe"
_ALL = "g$lshzxet"
ADDED = (b"set", b"rename_to", b"restore", b"copy_to", b"move_to")
REMOVED = (b"del", b"expired", b"evicted", b"rename_from", b"move_from")
MAX_KEYS = 1_000_000  # ~150 MiB of set; past it the mirror stops and lookups ask Redis
CHECK_EVERY_S = 5.0  # how often the server's notification flags are read again
_SCAN_COUNT = 1000


def missing_flags(flags: str) -> str:
    """The keyspace-event classes of ``NEEDED_FLAGS`` that ``flags`` (the server's
    ``notify-keyspace-events``) does not turn on."""
    have = set(flags.replace("A", _ALL))
    return "".join(f for f in NEEDED_FLAGS if f not in have)


class RedisKeyMirror:
    """The keys under ``prefix`` that Redis holds. ``answer`` reads it (any thread); one
    background thread keeps it. ``client`` makes a redis-py client of the store's server.

    ``turn_on``: the mirror may turn on the notifications it needs (``CONFIG SET``,
    keeping every flag already set); if not allowed, or without ``turn_on``, it warns and
    stays off, and lookups ask Redis."""

    def __init__(self, client: Callable[[], redis.Redis], prefix: bytes, *,
                 turn_on: bool = True, max_keys: int = MAX_KEYS,
                 retry_s: tuple[float, float] = (0.5, 30.0)) -> None:
        self._client = client
        self.prefix = prefix
        self.turn_on = turn_on
        self.max_keys = max_keys
        self._retry_s = retry_s
        self._keys: set[bytes] = set()
        self.synced = False  # read without a lock: a bool flips atomically
        self.given_up: str | None = None  # why it stopped for good
        self.resyncs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvconnector-mirror",
                                        daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._keys)

    def answer(self, rkeys: Sequence[bytes]) -> list[bool] | None:
        """Which of the Redis keys ``rkeys`` Redis holds, or None while not in sync."""
        if not self.synced:
            return None
        keys = self._keys
        return [k in keys for k in rkeys]

    def forget(self, rkeys: Sequence[bytes]) -> None:
        """Keys a fetch did not find: a lost notification, or a flush (no event per key)."""
        for k in rkeys:
            self._keys.discard(k)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread("kvc-mirror")
        delay = self._retry_s[0]
        retrying = False  # the last try did not get in sync: say so again only at debug
        while not self._stop.is_set() and self.given_up is None:
            resyncs = self.resyncs
            try:
                self._follow()
            except Exception as e:  # a fault of Redis or of its replies: rebuild later
                lost = self.resyncs != resyncs
                (logger.debug if retrying and not lost else logger.warning)(
                    "kvconnector: Redis key mirror %s (%s: %s); lookups ask Redis meanwhile",
                    "lost sync" if lost else "cannot get in sync", type(e).__name__, e)
                retrying = not lost
            self.synced = False
            self._keys = set()
            if self.resyncs != resyncs:  # it was in sync: try again soon
                delay = self._retry_s[0]
            self._stop.wait(delay)
            delay = min(delay * 2, self._retry_s[1])

    def _give_up(self, why: str) -> None:
        self.given_up = why
        logger.warning("kvconnector: no Redis key mirror (%s); lookups ask Redis", why)

    def _follow(self) -> None:
        client = self._client()
        try:
            if not self._notifications_on(client):
                return
            db = client.connection_pool.connection_kwargs.get("db", 0)
            pubsub = client.pubsub()
            try:
                channels = [f"__keyevent@{db}__:{e.decode()}" for e in ADDED + REMOVED]
                pubsub.subscribe(*channels)
                pending: list[Any] = []
                self._confirm(pubsub, len(channels), client_timeout(client), pending)
                keys: set[bytes] = set()
                for batch in self._scan(client):
                    keys.update(batch)
                    self._drain(pubsub, pending)  # keep the server's buffer for us small
                    if len(keys) > self.max_keys:
                        return self._give_up(f"more than {self.max_keys} keys under "
                                             f"{self.prefix.decode(errors='replace')!r}")
                self._keys = keys
                for message in pending:
                    self._apply(message)
                self.synced = True
                self.resyncs += 1
                logger.info("kvconnector: Redis key mirror in sync, %d keys", len(keys))
                next_check = time.monotonic() + CHECK_EVERY_S
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None:
                        self._apply(message)
                        if len(self._keys) > self.max_keys:
                            return self._give_up(f"more than {self.max_keys} keys")
                    if time.monotonic() >= next_check:
                        if missing_flags(self._flags(client)):
                            raise ConnectionError("keyspace notifications were turned off")
                        next_check = time.monotonic() + CHECK_EVERY_S
            finally:
                pubsub.close()
        finally:
            client.close()

    def _flags(self, client: redis.Redis) -> str:
        reply = client.config_get("notify-keyspace-events")
        value = reply.get("notify-keyspace-events", reply.get(b"notify-keyspace-events", ""))
        return value.decode() if isinstance(value, bytes) else str(value)

    def _notifications_on(self, client: redis.Redis) -> bool:
        try:
            flags = self._flags(client)
        except redis.ResponseError as e:  # CONFIG renamed away or not permitted
            self._give_up(f"CONFIG GET notify-keyspace-events refused: {e}")
            return False
        missing = missing_flags(flags)
        if not missing:
            return True
        if not self.turn_on:
            self._give_up(f"the server's notify-keyspace-events {flags!r} lacks {missing!r}")
            return False
        try:
            client.config_set("notify-keyspace-events", flags + missing)
        except redis.ResponseError as e:
            self._give_up(f"CONFIG SET notify-keyspace-events refused: {e}")
            return False
        logger.warning("kvconnector: turned on Redis keyspace notifications %r (now %r) for "
                       "the key mirror", missing, flags + missing)
        return True

    def _scan(self, client: redis.Redis):  # -> Iterator[list[bytes]]
        cursor: int | bytes = 0
        match = self.prefix + b"*"
        while True:
            cursor, batch = client.scan(cursor, match=match, count=_SCAN_COUNT)
            yield batch
            if int(cursor) == 0:
                return

    def _confirm(self, pubsub: Any, n: int, timeout: float, pending: list[Any]) -> None:
        """Read the ``n`` subscribe confirmations: the scan must start after them, or a key
        set between the two would be missed by both."""
        deadline = time.monotonic() + timeout
        while n:
            message = pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
            if message is None:
                if time.monotonic() >= deadline:
                    raise TimeoutError("Redis did not confirm the subscription")
                continue
            if message["type"] == "subscribe":
                n -= 1
            else:
                pending.append(message)

    def _drain(self, pubsub: Any, into: list[Any]) -> None:
        while (message := pubsub.get_message(timeout=0)) is not None:
            into.append(message)

    def _apply(self, message: dict[str, Any]) -> None:
        if message.get("type") != "message":
            return
        key = message["data"]
        if not isinstance(key, bytes) or not key.startswith(self.prefix):
            return
        event = message["channel"].rsplit(b":", 1)[-1]
        if event in ADDED:
            self._keys.add(key)
        elif event in REMOVED:
            self._keys.discard(key)


def client_timeout(client: redis.Redis) -> float:
    return client.connection_pool.connection_kwargs.get("socket_timeout") or 2.0
