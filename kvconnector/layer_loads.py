"""A step's load, a few layers at a time on a loader thread while the forward pass runs:
vLLM calls ``wait_for_layer_load`` before each attention layer, and only that layer has to
be in place by then (CPU build). Used for loads with chunks in Redis, and for big ones from
memory when vLLM left a core spare (the copy then runs there, off the forward's path).

Before this, a Redis hit fetched every chunk whole and copied it in before the forward
started: on the 2-core machine of docs/benchmarks.md the forward of a 2048-token SmolLM2
hit waited ~30 ms for 45 MiB, most of it redis-server's own copying on the other core.
Here the loader reads each chunk's header, then, layer group by layer group, that group's
bytes of every chunk (``store/redis_ranges.py``) and copies them into the paged KV; the
forward waits only for the layers it reaches first. The loader runs on the core vLLM
leaves to its engine-core process, where redis-server should run too (docs/operations.md).

A group's copy is made by the loader, unless the forward is already waiting for that group
when its bytes are in: then the forward copies it instead of idling, and the loader goes on
to fetch the next group. For a SmolLM2 8k-token Redis hit the loader's core did the fetch
(~180 ms) and every copy (~35 ms), more than the ~190 ms forward, which waited ~40 ms for
layers. Every copy made on the forward made that hit slower (1.42x vLLM's own hit, against
section 43's 1.28x); shared this way, the forward waited 2.5-8 ms less in each of three paired runs,
though the hit's time was about the same (docs/benchmarks.md section 44).

The bytes are used before they are verified: each chunk's checksum (or MAC) is checked once
all of it is in, before the step ends. A chunk that fails, or that stops arriving, has its
blocks reported as failed and vLLM recomputes them and drops the step's token for that
request: the same as a synchronous load that fails before the forward. A layer whose
``wait_for_layer_load`` never came may have been read before it was written: then the whole
load is reported failed and loads go back to whole chunks before the forward.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from kvconnector import threads
from kvconnector.kernels.batched import PagedCopier, block_runs
from kvconnector.ledger import Ledger
from kvconnector.metadata import ChunkTransfer
from kvconnector.store import ChunkCorrupt
from kvconnector.store.redis_ranges import Head, check_payloads, read_heads, read_ranges
from kvconnector.store.tiering import RedisTier
from kvconnector.worker_store import WorkerStore

logger = logging.getLogger("kvconnector.layer_loads")

# Layer groups per load, at most: each is one round trip to Redis.
GROUPS = 10

Failure = tuple[ChunkTransfer, str]
Arriving = tuple[ChunkTransfer, Head, memoryview]  # a chunk, its header, its slot's bytes


class Group:
    """Layers ``first``..``last - 1`` of a load: their bytes arrive, then one thread copies
    them into the paged KV (``claim``), then they are ready."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.arrived = threading.Event()
        self.ready = threading.Event()
        self.copy: Callable[[int, int], None] | None = None  # set before ``arrived``
        self.awaited = False  # the forward waits for it: the loader leaves the copy to it
        self._claim = threading.Lock()

    def claim(self) -> bool:
        return self._claim.acquire(blocking=False)


def layer_groups(num_layers: int, groups: int = GROUPS,
                 growing: bool = False) -> list[tuple[int, int]]:
    """Groups of equal size, or with ``growing`` of 1, 2, 3, ... layers (the last takes what
    is left). A copy from memory outruns the forward, so it goes in growing groups: the
    forward waits for the first layer only (a SmolLM2 8k-token memory hit waited 1.3 ms for
    layers, against 5.2 ms for the first group of three; 1.033x vLLM's own against 1.060x). A fetch
    from Redis is slower than the forward, which then waits for each group: groups that
    grow made it wait for the big last ones (1.429x against 1.260x; docs/benchmarks.md
    section 43)."""
    if not growing:
        size = max(1, -(-num_layers // groups))
        return [(k, min(num_layers, k + size)) for k in range(0, num_layers, size)]
    out: list[tuple[int, int]] = []
    first = 0
    while first < num_layers:
        size = len(out) + 1 if len(out) < groups - 1 else num_layers - first
        out.append((first, min(num_layers, first + size)))
        first = out[-1][1]
    return out


class LayerLoads:
    def __init__(self, layer_names: Sequence[str], copier: PagedCopier, store: WorkerStore,
                 redis: RedisTier | None, ledger: Ledger,
                 kernel_ids: Callable[[list[int]], list[int]], block_size: int,
                 cores: set[int]) -> None:
        self._index = {name: i for i, name in enumerate(layer_names)}
        self._num_layers = len(layer_names)
        self._copier = copier
        self._store = store
        self._redis = redis
        self._ledger = ledger
        self._kernel_ids = kernel_ids
        self._block_size = block_size
        self._thread = threads.pool("kvconnector-layer-loads", cores)
        self._groups: list[Group] = []
        self._group_of: list[Group] = []  # per layer
        self._waited: set[int] = set()
        self._job: Future[list[Failure]] | None = None
        self._transfers: list[ChunkTransfer] = []
        self._wait_s = 0.0
        self._forward_copy_s = 0.0
        self._copy_failed = False
        self.enabled = True

    def ranged(self, t: ChunkTransfer) -> bool:
        """Read from Redis by layer groups (else whole, or already in memory)."""
        return self._redis is not None and t.source == "redis" and not t.blocks and t.slot >= 0

    def start(self, transfers: list[ChunkTransfer]) -> None:
        ranged = any(self.ranged(t) for t in transfers)
        self._groups = [Group(a, b) for a, b in layer_groups(self._num_layers,
                                                               growing=not ranged)]
        self._group_of = [g for g in self._groups for _ in range(g.first, g.last)]
        self._waited = set()
        self._transfers = transfers
        self._wait_s = self._forward_copy_s = 0.0
        self._copy_failed = False
        self._job = self._thread.submit(self._load, transfers, self._groups)

    def wait(self, layer_name: str) -> None:
        if self._job is None:
            return
        i = self._index.get(layer_name)
        if i is None:
            return
        self._waited.add(i)
        group = self._group_of[i]
        if group.ready.is_set():
            return
        start = time.perf_counter()
        group.awaited = True
        group.arrived.wait()
        if group.claim():
            self._wait_s += time.perf_counter() - start
            self._forward_copy_s += self._copy(group)
            return
        group.ready.wait()
        self._wait_s += time.perf_counter() - start

    def _copy(self, group: Group) -> float:
        """Copies the group (on either thread); a fault costs the load, never the step."""
        start = time.perf_counter()
        try:
            if group.copy is not None:
                group.copy(group.first, group.last)
        except Exception:
            logger.exception("kvconnector: copying layers %d..%d of a load failed",
                             group.first, group.last - 1)
            self._copy_failed = True
        finally:
            group.ready.set()
        return time.perf_counter() - start

    def finish(self) -> list[Failure]:
        """Wait for the load to end; the transfers that failed, and why."""
        job, self._job = self._job, None
        if job is None:
            return []
        try:
            failed = job.result()
        except Exception:  # the loader's own fault: nothing it wrote can be trusted
            logger.exception("kvconnector: a layer-by-layer load failed")
            failed = [(t, "error") for t in self._transfers]
        if self._copy_failed:  # a group's blocks may be half written
            failed = [(t, "error") for t in self._transfers]
        self._ledger.count(layer_loads=1, **{"phase_seconds.layer_wait": self._wait_s,
                                             "phase_seconds.load_copy": self._forward_copy_s,
                                             "phase_seconds.load_copy_forward":
                                                 self._forward_copy_s})
        self._ledger.observe(layer_wait_seconds=self._wait_s)
        if len(self._waited) < self._num_layers:
            logger.warning("kvconnector: vLLM did not call wait_for_layer_load for %d of %d "
                           "layers; the step's load is recomputed and later loads go whole "
                           "before the forward", self._num_layers - len(self._waited),
                           self._num_layers)
            self.enabled = False
            done = {id(t) for t, _ in failed}
            failed += [(t, "layer_not_awaited") for t in self._transfers if id(t) not in done]
        self._transfers = []
        return failed

    def close(self) -> None:
        """The engine is stopping: a load still running ends within its Redis deadline."""
        self._thread.shutdown(wait=False)

    # ---- on the loader thread ----

    def _load(self, transfers: list[ChunkTransfer], groups: list[Group]) -> list[Failure]:
        try:
            return self._load_layers(transfers, groups)
        finally:
            for g in groups:  # the forward never waits on a load that has ended
                g.arrived.set()  # one never reached has no copy: its wait only marks it ready

    def _load_layers(self, transfers: list[ChunkTransfer], groups: list[Group]
                     ) -> list[Failure]:
        start = time.perf_counter()
        # Partial chunks and chunks from the disk come whole first: they are small or local.
        self._store.fetch([(t.slot, t.chunk_hash, t.source, t.blocks) for t in transfers
                           if t.source != "memory" and (t.source != "redis" or t.blocks)])
        ranged = [t for t in transfers if self.ranged(t)]
        slots = {t.slot for t in ranged}
        failed: list[Failure] = []
        ready_now: list[ChunkTransfer] = []
        for t in transfers:
            if t.slot in slots:
                continue  # arriving, or riding on a chunk that is (the same chunk twice)
            try:
                self._store.read(t.slot, t.chunk_hash)
                ready_now.append(t)
            except ChunkCorrupt as e:
                logger.warning("kvconnector: %s; its blocks will be recomputed", e)
                failed.append((t, e.reason))
        redis_s = time.perf_counter()
        deadline = time.monotonic() + (self._redis.redis.timeout_s if self._redis else 0.0)
        arriving, lost = self._heads(ranged, deadline)
        copy_s = 0.0
        for g in groups:
            arriving, gone = self._ranges(arriving, g.first, g.last, deadline)
            lost |= gone
            if g.first == 0 or gone:
                copy = self._scatter(ready_now + [t for t in transfers
                                                  if t.slot in slots and t.slot not in lost])
            g.copy = copy
            g.arrived.set()
            if not g.awaited and g.claim():
                copy_s += self._copy(g)
        lost |= self._seal(arriving)
        if slots:
            fetch_s = time.perf_counter() - redis_s - copy_s
            self._ledger.count(redis_loaded_chunks=len(slots - lost), redis_misses=len(lost),
                               **{"phase_seconds.redis_fetch": fetch_s})
            self._ledger.observe(redis_fetch_seconds=fetch_s)
        self._ledger.count(**{"phase_seconds.load_copy": copy_s})
        failed += [(t, "not_in_slot") for t in transfers if t.slot in lost]
        self._ledger.loaded(ready_now + [t for t in transfers if t.slot in slots - lost],
                            self._block_size, self._store.pool.chunk_bytes,
                            time.perf_counter() - start)
        return failed

    def _heads(self, ranged: list[ChunkTransfer], deadline: float
               ) -> tuple[list[Arriving], set[int]]:
        """The chunks whose headers check out, each with its slot's bytes; the slots of
        those that do not."""
        if not ranged:
            return [], set()
        assert self._redis is not None
        for t in ranged:
            self._store.pool.begin_write(t.slot)
        keys = [self._store.key(t.chunk_hash) for t in ranged]
        heads = read_heads(self._redis.redis, keys, [self._redis.expected(k) for k in keys],
                           deadline)
        arriving = [(t, h, self._redis.bytes.to_receive(t.slot, 0)[0])
                    for t, h in zip(ranged, heads, strict=True) if h is not None]
        return arriving, {t.slot for t, h in zip(ranged, heads, strict=True) if h is None}

    def _ranges(self, arriving: list[Arriving], first: int, last: int, deadline: float
                ) -> tuple[list[Arriving], set[int]]:
        """Layers ``first``..``last - 1`` of every arriving chunk; the slots that stopped."""
        if not arriving:
            return arriving, set()
        assert self._redis is not None
        starts, outs = [], []
        for _, head, view in arriving:
            per_layer = view.nbytes // self._num_layers
            starts.append(head.offset + per_layer * first)
            outs.append(view[per_layer * first:per_layer * last])
        got = read_ranges(self._redis.redis, [self._store.key(t.chunk_hash)
                                              for t, _, _ in arriving], starts, outs,
                          deadline)
        return ([a for a, ok in zip(arriving, got, strict=True) if ok],
                {a[0].slot for a, ok in zip(arriving, got, strict=True) if not ok})

    def _scatter(self, active: list[ChunkTransfer]) -> Callable[[int, int], None] | None:
        if not active:
            return None
        runs = block_runs((t.slot, self._kernel_ids(t.block_ids)) for t in active)
        return self._copier.layer_scatter(self._store.pool.buffer, runs)

    def _seal(self, arriving: list[Arriving]) -> set[int]:
        """The last check of every ranged chunk; those that pass are sealed in the pool
        (and written to the disk tier, as a whole fetch from Redis is). The slots of those
        that fail."""
        if not arriving:
            return set()
        assert self._redis is not None
        ok = check_payloads(self._redis.redis,
                            [self._store.key(t.chunk_hash) for t, _, _ in arriving],
                            [h for _, h, _ in arriving], [v for _, _, v in arriving])
        bad: set[int] = set()
        for (t, _, _), good in zip(arriving, ok, strict=True):
            if good:
                self._store.pool.end_write(t.slot, self._store.key(t.chunk_hash),
                                           for_redis=False)
                self._store.to_disk(t.slot, t.chunk_hash)
            else:
                bad.add(t.slot)
        return bad
