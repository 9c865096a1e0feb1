"""The tiers behind the memory tier, seen from a worker: each fetches chunks straight into
pool slots (before the loads that read them) and takes copies of sealed slots on background
threads, off the request's critical path. The disk tier (store/disk_tier.py) and Redis
(``RedisTier``) are the two; ``WorkerStore`` asks them in that order."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvconnector.keys import ChunkKey, Fingerprint
from kvconnector.placement import AT_ONCE, WritePlacement
from kvconnector.store import descriptor
from kvconnector.store.codec import ExpectedChunk, encode_header
from kvconnector.store.memory import SlotPool
from kvconnector.threads import start as start_thread

if TYPE_CHECKING:
    from kvconnector.store.redis_store import RedisStore

logger = logging.getLogger("kvconnector.store.tiering")

MAX_QUEUED_PUTS = 256
MAX_PUT_BATCH = 16  # chunks in one Redis pipeline
PUT_BATCH_BYTES = 16 << 20  # a batch holds its slots leased until Redis answers
FLUSH_TIMEOUT_S = 60.0  # flush() is for tests, tools and benchmarks: a stuck write fails them

Chunk = tuple[int, ChunkKey, int]  # (slot, key, blocks of a partial chunk or 0)


class SlotBytes:
    """The bytes a tier stores for a slot: the whole chunk, or for a partial chunk
    (``blocks`` > 0) only its first blocks, packed (the tail of a one-block prompt costs a
    block, not a chunk)."""

    def __init__(self, pool: SlotPool, layout_name: str, blocks_per_chunk: int) -> None:
        self.pool = pool
        self.layout_name = layout_name
        self.blocks_per_chunk = blocks_per_chunk

    def _part(self, slot: int, blocks: int) -> torch.Tensor:
        return self.pool.part(slot, blocks, self.blocks_per_chunk)

    def expected(self, key: ChunkKey, blocks: int = 0) -> ExpectedChunk:
        """What a stored copy of ``key`` must say about itself to be read into the pool."""
        shape = tuple(self._part(0, blocks).shape)
        nbytes = math.prod(shape) * self.pool.buffer.element_size()
        return ExpectedChunk(str(key), self.layout_name,
                             str(self.pool.buffer.dtype).removeprefix("torch."), shape, nbytes)

    def to_send(self, slot: int, blocks: int, xxh3: int | None) -> tuple[memoryview, int | None]:
        """A leased slot's bytes to store, and their checksum if known (the seal's, for a
        whole chunk)."""
        if not blocks:
            return self.pool.slot_bytes(slot), xxh3
        packed = self._part(slot, blocks).contiguous()
        return memoryview(packed.view(torch.uint8).reshape(-1).numpy()), None

    def to_receive(self, slot: int, blocks: int) -> tuple[memoryview, torch.Tensor | None]:
        """Where to read a stored copy: the slot itself, or for a partial chunk a packed
        buffer that ``received`` then copies into the slot."""
        if not blocks:
            return self.pool.slot_bytes(slot), None
        packed = torch.empty(self._part(0, blocks).shape, dtype=self.pool.buffer.dtype)
        return memoryview(packed.view(torch.uint8).reshape(-1).numpy()), packed

    def received(self, slot: int, blocks: int, packed: torch.Tensor | None) -> None:
        if packed is not None:
            self._part(slot, blocks).copy_(packed)


class LowerTier(Protocol):
    name: str  # "disk" | "redis": the tier's label in counters and metrics

    def fetch(self, wanted: Sequence[tuple[int, ChunkKey, int]]) -> list[bool]:
        """Fill and seal each ``(slot, key, blocks)`` (``blocks``: of a partial chunk, or
        0); which arrived intact. A slot that did not stays unsealed, so a load of it
        reports an error."""
        ...

    def offload(self, slot: int, key: ChunkKey, blocks: int = 0) -> None:
        """Queue a copy of a sealed slot (of its first ``blocks`` blocks); never waits."""
        ...

    @property
    def queued(self) -> int: ...

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool: ...

    def close(self, timeout_s: float) -> None: ...


class PutQueue:
    """Sealed slots waiting for their copy to a tier, taken by ``threads`` background
    threads, each taking up to ``batch`` of those queued at once (``put`` gets a list). A
    full queue drops the copy (a later miss), as does a stopping engine. ``first`` runs on
    one thread before any copy (the disk tier's scan). ``placement``: the threads' cores,
    and the gate a batch waits for."""

    def __init__(self, name: str, put: Callable[[list[Chunk]], None], threads: int = 1,
                 first: Callable[[], None] | None = None,
                 max_queued: int = MAX_QUEUED_PUTS, batch: int = 1,
                 placement: WritePlacement = AT_ONCE) -> None:
        self.name = name
        self.batch = max(1, batch)
        self._gate = placement.gate
        self._hold_s = placement.hold_s
        self.dropped = 0
        self.busy_seconds = 0.0  # time spent making copies, all threads (phase timers)
        self._put = put
        self._queue: queue.Queue[Chunk | None] = queue.Queue(max_queued)
        self._ready = threading.Event()
        if first is None:
            self._ready.set()
        self._threads = [start_thread(f"kvconnector-{name}-put",
                                      lambda f=first if i == 0 else None: self._loop(f),
                                      placement.cores)
                         for i in range(threads)]

    def offload(self, slot: int, key: ChunkKey, blocks: int = 0) -> None:
        try:
            self._queue.put_nowait((slot, key, blocks))
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
        stop = False
        while not stop:
            batch, stop = self._take()
            if not batch:
                continue
            if self._gate is not None and not stop:
                self._gate.wait(self._hold_s)
            start = time.perf_counter()
            try:
                self._put(batch)
            except Exception:  # the thread must outlive any single bad put
                logger.exception("kvconnector: %s put failed", self.name)
            finally:
                self.busy_seconds += time.perf_counter() - start  # racy across threads: a metric
                for _ in batch:
                    self._queue.task_done()
        self._queue.task_done()  # the stop mark

    def _take(self) -> tuple[list[Chunk], bool]:
        """The next chunks to copy (the first to come, and those queued behind it up to
        ``batch``), and whether the stop mark came with them."""
        first = self._queue.get()
        if first is None:
            return [], True
        batch = [first]
        while len(batch) < self.batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    @property
    def queued(self) -> int:
        return self._queue.unfinished_tasks

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every queued copy has been made (or failed); False if some were
        still queued or running after ``timeout_s`` (a stuck write: the caller decides)."""
        deadline = time.monotonic() + timeout_s
        if not self._ready.wait(timeout_s):
            return False
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._queue.unfinished_tasks,
                                 max(0.0, deadline - time.monotonic()))

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
                 fingerprint: Fingerprint | None = None, blocks_per_chunk: int = 1,
                 placement: WritePlacement = AT_ONCE) -> None:
        self.redis = redis
        self.pool = pool
        self.bytes = SlotBytes(pool, layout_name, blocks_per_chunk)
        # The descriptor (store/descriptor.py) goes out with a put, at least every refresh.
        self._fingerprint = fingerprint
        self._descriptor_due = 0.0
        self._backoffs_seen = 0
        self._descriptor_every = min(descriptor.REFRESH_S, (redis.ttl_s or float("inf")) / 2)
        # One pipeline for the chunks queued together (a step's saves): on a 2-core machine
        # each round trip also costs the forward a hand-over of the GIL and the core.
        self._puts = PutQueue("redis", self._put,
                              batch=max(1, min(MAX_PUT_BATCH, PUT_BATCH_BYTES // pool.chunk_bytes)),
                              placement=placement)

    def expected(self, key: ChunkKey, blocks: int = 0) -> ExpectedChunk:
        return self.bytes.expected(key, blocks)

    def fetch(self, wanted: Sequence[tuple[int, ChunkKey, int]]) -> list[bool]:
        """Fill and seal each ``(slot, key, blocks)`` from Redis in one pipeline."""
        for slot, _, _ in wanted:
            self.pool.begin_write(slot)
        into = [self.bytes.to_receive(slot, blocks) for slot, _, blocks in wanted]
        got = self.redis.get_many([k for _, k, _ in wanted],
                                  [self.expected(k, b) for _, k, b in wanted],
                                  out=[view for view, _ in into])
        for (slot, key, blocks), payload, (_, packed) in zip(wanted, got, into, strict=True):
            if payload is not None:  # checked by the codec (checksum or MAC) before this
                self.bytes.received(slot, blocks, packed)
                self.pool.end_write(slot, key, for_redis=False)  # Redis holds it
        return [p is not None for p in got]

    def offload(self, slot: int, key: ChunkKey, blocks: int = 0) -> None:
        self._puts.offload(slot, key, blocks)

    @property
    def dropped_puts(self) -> int:
        return self._puts.dropped

    def _put(self, chunks: list[Chunk]) -> None:
        leased: list[int] = []
        try:
            items = []
            for slot, key, blocks in chunks:
                header = self.pool.lease(slot, key)
                if header is None:
                    continue  # the slot was reused before its turn came: nothing to copy
                leased.append(slot)
                if header.for_redis:  # else it came from Redis or the disk
                    payload, xxh3 = self.bytes.to_send(slot, blocks, header.checksum)
                    items.append((key, encode_header(self.expected(key, blocks), payload,
                                                     xxh3=xxh3, mac_key=self.redis.mac_key),
                                  payload))
            if items:
                self._send(items)
        finally:
            for slot in leased:
                self.pool.end_lease(slot)

    def _send(self, items: list[tuple[Any, bytes, Any]]) -> None:
        key = items[0][0]
        now = time.monotonic()
        if self.redis.stats.backoffs != self._backoffs_seen:  # Redis may have lost data
            self._backoffs_seen = self.redis.stats.backoffs
            self._descriptor_due = 0.0
        described = self._fingerprint is not None and now >= self._descriptor_due
        if described:
            items.append((descriptor.descriptor_key(key.fingerprint.hex()), b"",
                          descriptor.encode(self._fingerprint, self.expected(key))))
        if self.redis.put_many(items) == len(items) and described:
            self._descriptor_due = now + self._descriptor_every

    @property
    def queued(self) -> int:
        return self._puts.queued

    @property
    def busy_seconds(self) -> float:
        return self._puts.busy_seconds

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        return self._puts.flush(timeout_s)

    def close(self, timeout_s: float) -> None:
        self._puts.close(timeout_s)
        self.redis.close()
