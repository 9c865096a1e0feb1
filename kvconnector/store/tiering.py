"""Worker side of memory -> Redis tiering: Redis chunks are fetched straight into pool slots
before a step's loads; sealed slots are copied to Redis by a background thread, off the
request's critical path."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvconnector.keys import ChunkKey, Fingerprint
from kvconnector.store import descriptor
from kvconnector.store.codec import ExpectedChunk, encode_header
from kvconnector.store.memory import SlotPool

if TYPE_CHECKING:
    from kvconnector.store.redis_store import RedisStore

logger = logging.getLogger("kvconnector.store.tiering")

MAX_QUEUED_PUTS = 256


class RedisTier:
    def __init__(self, redis: RedisStore, pool: SlotPool, layout_name: str,
                 fingerprint: Fingerprint | None = None) -> None:
        self.redis = redis
        self.pool = pool
        self.layout_name = layout_name
        self.dropped_puts = 0
        # The descriptor (store/descriptor.py) goes out with a put, at least every refresh.
        self._fingerprint = fingerprint
        self._descriptor_due = 0.0
        self._backoffs_seen = 0
        self._descriptor_every = min(descriptor.REFRESH_S, (redis.ttl_s or float("inf")) / 2)
        self._queue: queue.Queue[tuple[int, ChunkKey] | None] = queue.Queue(MAX_QUEUED_PUTS)
        self._thread = threading.Thread(target=self._put_loop, name="kvconnector-redis-put",
                                        daemon=True)
        self._thread.start()

    def expected(self, key: ChunkKey) -> ExpectedChunk:
        return ExpectedChunk(str(key), self.layout_name,
                             str(self.pool.buffer.dtype).removeprefix("torch."),
                             self.pool.chunk_shape, self.pool.chunk_bytes)

    def fetch(self, wanted: Sequence[tuple[int, ChunkKey]]) -> int:
        """Fill and seal each ``(slot, key)`` from Redis in one pipeline; returns how many
        arrived intact. A slot that did not stays unsealed, so its load reports an error."""
        for slot, _ in wanted:
            self.pool.begin_write(slot)
        keys = [k for _, k in wanted]
        got = self.redis.get_many(keys, [self.expected(k) for k in keys],
                                  out=[self.pool.slot_bytes(s) for s, _ in wanted])
        n = 0
        for (slot, key), payload in zip(wanted, got, strict=True):
            if payload is not None:  # checked by the codec (checksum or MAC) before this
                self.pool.end_write(slot, key, for_redis=False)  # Redis holds it
                n += 1
        return n

    def offload(self, slot: int, key: ChunkKey) -> None:
        """Queue a sealed slot for Redis; a full queue drops the put (a later miss)."""
        try:
            self._queue.put_nowait((slot, key))
        except queue.Full:
            self.dropped_puts += 1

    def _put_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._put(*item)
            except Exception:  # the thread must outlive any single bad put
                logger.exception("kvconnector: Redis put failed")
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _put(self, slot: int, key: ChunkKey) -> None:
        header = self.pool.lease(slot, key)
        if header is None:
            return  # the slot was reused before its turn came: nothing to copy
        try:
            if header.checksum is not None:
                self._send(key, self.pool.slot_bytes(slot), header.checksum)
        finally:
            self.pool.end_lease(slot)

    def _send(self, key: ChunkKey, payload: memoryview, xxh3: int) -> None:
        prefix = encode_header(self.expected(key), payload, xxh3=xxh3,
                               mac_key=self.redis.mac_key)
        items = [(key, prefix, payload)]
        now = time.monotonic()
        if self.redis.stats.backoffs != self._backoffs_seen:  # Redis may have lost data
            self._backoffs_seen = self.redis.stats.backoffs
            self._descriptor_due = 0.0
        if self._fingerprint is not None and now >= self._descriptor_due:
            items.append((descriptor.descriptor_key(key.fingerprint.hex()), b"",
                          descriptor.encode(self._fingerprint, self.expected(key))))
        if self.redis.put_many(items) == len(items) and len(items) > 1:
            self._descriptor_due = now + self._descriptor_every

    @property
    def queued(self) -> int:
        return self._queue.unfinished_tasks

    def flush(self) -> None:
        """Wait until every queued put has been sent (or failed)."""
        self._queue.join()

    def close(self, timeout_s: float) -> None:
        """Send what can be sent within ``timeout_s``, drop the rest (the engine is
        stopping: vLLM kills an engine that outstays its shutdown window)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        dropped = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self._queue.task_done()
            dropped += 1
        if dropped:
            self.dropped_puts += dropped
            logger.info("kvconnector: engine stopping, %d chunks not sent to Redis", dropped)
        self._queue.put(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self.redis.close()
