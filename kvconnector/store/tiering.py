"""The tiers behind the memory tier, seen from a worker: each fetches chunks straight into
pool slots (before the loads that read them) and takes copies of sealed slots on background
threads, off the request's critical path. The disk tier (store/disk_tier.py) and Redis
(``RedisTier``) are the two; ``WorkerStore`` asks them in that order."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvconnector.keys import ChunkKey, Fingerprint
from kvconnector.store import descriptor
from kvconnector.store.codec import ExpectedChunk, encode_header
from kvconnector.store.memory import SlotPool

if TYPE_CHECKING:
    from kvconnector.store.redis_store import RedisStore

logger = logging.getLogger("kvconnector.store.tiering")

MAX_QUEUED_PUTS = 256


def expected_chunk(pool: SlotPool, layout_name: str, key: ChunkKey) -> ExpectedChunk:
    """What a stored copy of ``key`` must say about itself to be read into ``pool``."""
    return ExpectedChunk(str(key), layout_name, str(pool.buffer.dtype).removeprefix("torch."),
                         pool.chunk_shape, pool.chunk_bytes)


class LowerTier(Protocol):
    name: str  # "disk" | "redis": the tier's label in counters and metrics

    def fetch(self, wanted: Sequence[tuple[int, ChunkKey]]) -> list[bool]:
        """Fill and seal each ``(slot, key)``; which arrived intact. A slot that did not
        stays unsealed, so a load of it reports an error."""
        ...

    def offload(self, slot: int, key: ChunkKey) -> None:
        """Queue a copy of a sealed slot; never waits."""
        ...

    @property
    def queued(self) -> int: ...

    def flush(self) -> None: ...

    def close(self, timeout_s: float) -> None: ...


class PutQueue:
    """Sealed slots waiting for their copy to a tier, taken by ``threads`` background
    threads. A full queue drops the copy (a later miss), as does a stopping engine.
    ``first`` runs on one thread before any copy (the disk tier's scan)."""

    def __init__(self, name: str, put: Callable[[int, ChunkKey], None], threads: int = 1,
                 first: Callable[[], None] | None = None,
                 max_queued: int = MAX_QUEUED_PUTS) -> None:
        self.name = name
        self.dropped = 0
        self._put = put
        self._queue: queue.Queue[tuple[int, ChunkKey] | None] = queue.Queue(max_queued)
        self._ready = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(first if i == 0 else None,),
                                          name=f"kvconnector-{name}-put", daemon=True)
                         for i in range(threads)]
        if first is None:
            self._ready.set()
        for t in self._threads:
            t.start()

    def offload(self, slot: int, key: ChunkKey) -> None:
        try:
            self._queue.put_nowait((slot, key))
        except queue.Full:
            self.dropped += 1

    def _loop(self, first: Callable[[], None] | None) -> None:
        if first is not None:
            try:
                first()
            except Exception:
                logger.exception("kvconnector: preparing the %s tier failed", self.name)
            finally:
                self._ready.set()
        self._ready.wait()
        while (item := self._queue.get()) is not None:
            try:
                self._put(*item)
            except Exception:  # the thread must outlive any single bad put
                logger.exception("kvconnector: %s put failed", self.name)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    @property
    def queued(self) -> int:
        return self._queue.unfinished_tasks

    def flush(self) -> None:
        """Wait until every queued copy has been made (or failed)."""
        self._ready.wait()
        self._queue.join()

    def close(self, timeout_s: float) -> bool:
        """Make what can be made within ``timeout_s``, drop the rest (the engine is
        stopping: vLLM kills an engine that outstays its shutdown window). True if every
        thread has stopped."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        dropped = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            self._queue.task_done()
            if item is not None:
                dropped += 1
        if dropped:
            self.dropped += dropped
            logger.info("kvconnector: engine stopping, %d chunks not copied to %s", dropped,
                        self.name)
        for _ in self._threads:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                break
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


class RedisTier:
    name = "redis"

    def __init__(self, redis: RedisStore, pool: SlotPool, layout_name: str,
                 fingerprint: Fingerprint | None = None) -> None:
        self.redis = redis
        self.pool = pool
        self.layout_name = layout_name
        # The descriptor (store/descriptor.py) goes out with a put, at least every refresh.
        self._fingerprint = fingerprint
        self._descriptor_due = 0.0
        self._backoffs_seen = 0
        self._descriptor_every = min(descriptor.REFRESH_S, (redis.ttl_s or float("inf")) / 2)
        self._puts = PutQueue("redis", self._put)

    def expected(self, key: ChunkKey) -> ExpectedChunk:
        return expected_chunk(self.pool, self.layout_name, key)

    def fetch(self, wanted: Sequence[tuple[int, ChunkKey]]) -> list[bool]:
        """Fill and seal each ``(slot, key)`` from Redis in one pipeline."""
        for slot, _ in wanted:
            self.pool.begin_write(slot)
        keys = [k for _, k in wanted]
        got = self.redis.get_many(keys, [self.expected(k) for k in keys],
                                  out=[self.pool.slot_bytes(s) for s, _ in wanted])
        for (slot, key), payload in zip(wanted, got, strict=True):
            if payload is not None:  # checked by the codec (checksum or MAC) before this
                self.pool.end_write(slot, key, for_redis=False)  # Redis holds it
        return [p is not None for p in got]

    def offload(self, slot: int, key: ChunkKey) -> None:
        self._puts.offload(slot, key)

    @property
    def dropped_puts(self) -> int:
        return self._puts.dropped

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
        return self._puts.queued

    def flush(self) -> None:
        self._puts.flush()

    def close(self, timeout_s: float) -> None:
        self._puts.close(timeout_s)
        self.redis.close()
