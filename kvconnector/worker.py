"""Worker half: executes each step's plan between vLLM's paged KV tensors and the pool.

Synchronous loads run on the main thread before the forward; saves and loads of requests
parked in WAITING_FOR_REMOTE_KVS run on the copy thread (``background.py``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from kvconnector import compat, kernels
from kvconnector.background import CopyThread
from kvconnector.blend.worker import BlendWorker
from kvconnector.config import ConnectorConfig
from kvconnector.kernels.batched import PagedCopier, block_runs
from kvconnector.layer_loads import LayerLoads
from kvconnector.layout import LayerLayout, LayoutError, describe_layers
from kvconnector.ledger import Ledger
from kvconnector.metadata import IDLE_WAIT_S, ChunkTransfer, StepPlan, WorkerReport
from kvconnector.metrics import DiskTap, StoreTap
from kvconnector.placement import AT_ONCE, WritePlacement
from kvconnector.stats import TransferStats
from kvconnector.store import ChunkCorrupt, SlotPool, open_disk, open_redis
from kvconnector.store.disk_space import disk_capacity
from kvconnector.store.disk_tier import DiskTier
from kvconnector.store.memory import host_memory
from kvconnector.store.tiering import RedisTier
from kvconnector.worker_store import WorkerStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvconnector.kernels.host_transfer import HostTransfer

logger = logging.getLogger("kvconnector.worker")

# A load from memory goes layer by layer from this size (waking the loader costs ~0.3 ms).
LAYER_MIN_BYTES = 16 << 20

# vLLM gives a stopping engine a few seconds (none by default) before it kills it.
SHUTDOWN_BUDGET_S = 1.0


class WorkerHalf:
    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig) -> None:
        self.config = config
        self.layer_names, self.spec = compat.attention_group(kv_cache_config)
        self.fingerprint_fields = compat.fingerprint(vllm_config, kv_cache_config, config)
        self.fingerprint = self.fingerprint_fields.digest()
        self.tp_rank = compat.tp_rank()
        self.num_slots = config.memory_slots(compat.chunk_bytes(kv_cache_config, config))
        self.blocks_per_chunk = config.chunk_size // self.spec.block_size
        self._kv_events = compat.kv_events_enabled(vllm_config)
        self._spare_cores = compat.spare_cores(vllm_config)
        config.check_memory_available(*host_memory())
        self.disk_capacity = (disk_capacity(config.disk_path, config.disk_capacity)
                              if config.disk_path else 0)
        self.ledger = Ledger()
        self._redis_tap = StoreTap()
        self.layers: list[torch.Tensor] = []
        self.layout: LayerLayout | None = None
        self.pool: SlotPool | None = None
        self.store: WorkerStore | None = None
        self._ratio = 1
        self.redis_tier: RedisTier | None = None
        self.write_gate = threading.Event()  # held saves and puts wait for it (placement.py)
        self.disk_tier: DiskTier | None = None
        self._disk_tap = DiskTap()
        self._host_transfer: HostTransfer | None = None
        self._copier: PagedCopier | None = None
        self.layer_loads: LayerLoads | None = None
        saves = WritePlacement(self._spare_cores or None, self.write_gate)
        self.copies = CopyThread(saves if compat.is_cpu_platform() else AT_ONCE)
        self._busy_reported: dict[str, float] = {}  # thread -> busy seconds reported
        self._device_lock = threading.Lock()  # HostTransfer's staging buffer is shared
        self.blend = (BlendWorker(config, vllm_config, self.spec, len(self.layer_names),
                                  self.copies, self.ledger)
                      if config.blending.enabled else None)

    @property
    def totals(self) -> TransferStats:
        """Counters since start-up."""
        return self.ledger.totals

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise LayoutError(f"vLLM registered no KV tensor for layers {missing}")
        self.layers = [kv_caches[n] for n in self.layer_names]
        self.layout = describe_layers({n: kv_caches[n] for n in self.layer_names},
                                      **compat.layout_kw(self.spec, compat.is_cpu_platform()))
        kbs = self.layout.kernel_block_size
        if self.spec.block_size % kbs:
            raise LayoutError(f"kernel block size {kbs} does not divide block size "
                              f"{self.spec.block_size}")
        self._ratio = self.spec.block_size // kbs
        shape = (len(self.layers), *self.layout.chunk_shape(self.config.chunk_size // kbs))
        if not self.layers[0].is_cuda:  # the KV cache came out of the same memory
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in self.layers}
            self.config.check_memory_available(*host_memory(), sum(storages.values()))
        redis = open_redis(self.config)
        self.pool = SlotPool(self.num_slots, shape, self.layout.dtype,
                             checksums=redis is not None)
        puts = WritePlacement.for_worker(self._spare_cores, self.write_gate,
                                       self.layers[0].is_cuda)
        if self.config.disk_path:
            self.disk_tier = open_disk(self.config, self.disk_capacity, self.pool,
                                       self.layout.family, self.fingerprint_fields,
                                       self.blocks_per_chunk, self._kv_events, puts)
        if redis is not None:
            self.redis_tier = RedisTier(redis, self.pool, self.layout.family,
                                        fingerprint=self.fingerprint_fields,
                                        blocks_per_chunk=self.blocks_per_chunk, placement=puts)
        if self.layers[0].is_cuda:
            from kvconnector.kernels.host_transfer import HostTransfer

            self._host_transfer = HostTransfer(self.layers, self.layout,
                                               self.config.chunk_size // kbs, max_chunks=1)
        else:
            self._copier = PagedCopier(self.layers, self.layout, self._spare_cores)
        stream = self._host_transfer.stream if self._host_transfer is not None else None
        tiers = [t for t in (self.disk_tier, self.redis_tier) if t is not None]
        self.store = WorkerStore(self.pool, tiers, self.fingerprint, self.tp_rank,
                                 self.ledger, stream)
        if self._copier is not None and self.config.by_layer(len(self.layer_names)):
            self.layer_loads = LayerLoads(self.layer_names, self._copier, self.store,
                                          self.redis_tier, self.ledger, self._kernel_ids,
                                          self.spec.block_size, self._spare_cores)
        if self.blend is not None:
            self.blend.attach(self.layers, self.layout, self.store)
        logger.info("kvconnector worker rank %d: %d layers, layout %s %s",
                    self.tp_rank, len(self.layers), self.layout.family, self.layout.sizes)

    def _kernel_ids(self, block_ids: list[int]) -> list[int]:
        return kernels.kernel_block_ids(block_ids, self._ratio)

    def _kernel_block_ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self._kernel_ids(block_ids)], dtype=torch.long)

    # ---- loads ----
    def load(self, plan: StepPlan) -> None:
        """Chunks this step's forward needs, in place before it starts; those the scheduler
        found only on disk or in Redis (for a request alone in the engine) fetched first."""
        try:
            self.copies.wait_for_slots(t.slot for t in plan.loads)
            if self._by_layer(plan):
                assert self.layer_loads is not None
                self.finish_layer_loads()  # the last step's, were it never finished
                self.layer_loads.start(plan.loads)  # the forward waits layer by layer
                return
            self._fetch(plan.loads)
            self._load_chunks(plan.loads, on_copy_thread=False)
        except Exception:  # never the request, never the engine: a recompute
            logger.exception("kvconnector: loading %d chunks failed", len(plan.loads))
            for t in plan.loads:
                self._load_failed(t, "error")

    def _by_layer(self, plan: StepPlan) -> bool:
        """Layer by layer: a load with chunks to read from Redis, or one from memory big
        enough to repay handing it to a spare core. Never beside a blend run before the
        forward pass: its prefix may be blocks this load fills (vLLM's hit on them)."""
        if self.layer_loads is None or not self.layer_loads.enabled or any(
                not j.load_async for j in plan.blends):
            return False
        assert self.pool is not None
        return any(self.layer_loads.ranged(t) for t in plan.loads) or bool(
            self._spare_cores) and len(plan.loads) * self.pool.chunk_bytes >= LAYER_MIN_BYTES

    def finish_layer_loads(self) -> None:
        """The end of this step's layer-by-layer load, before anything reads its blocks or
        its failures are reported."""
        if self.layer_loads is not None:
            for t, reason in self.layer_loads.finish():
                self._load_failed(t, reason)

    def start_async_loads(self, plan: StepPlan) -> None:
        """One copy-thread job per parked request: fetch from Redis, then fill its blocks."""
        by_request: dict[str, list[ChunkTransfer]] = {}
        for t in plan.async_loads:
            by_request.setdefault(t.req_id, []).append(t)
        for req_id, transfers in by_request.items():
            self.ledger.start_fetch(lambda r=req_id, ts=transfers: self.copies.submit(
                lambda: self._load_request(r, ts), [r], [t.slot for t in ts]))

    def _load_request(self, req_id: str, transfers: list[ChunkTransfer]) -> None:
        try:
            self._fetch(transfers)
            self._load_chunks(transfers, on_copy_thread=True)
        except Exception:  # blocks that may not have been written are recomputed
            logger.exception("kvconnector: loading request %s failed; its blocks will be "
                             "recomputed", req_id)
            for t in transfers:
                self._load_failed(t, "error")
        finally:  # vLLM releases the request only once it is reported, failed or not
            self.ledger.received(req_id)
            self.ledger.fetch_over()

    def _fetch(self, transfers: list[ChunkTransfer]) -> None:
        """Chunks promoted from the disk or Redis, into their slots."""
        assert self.store is not None
        self.store.fetch([(t.slot, t.chunk_hash, t.source, t.blocks) for t in transfers
                          if t.source != "memory" and t.slot >= 0])

    def _load_chunks(self, transfers: list[ChunkTransfer], on_copy_thread: bool) -> None:
        """Check every slot's key, then move all the chunks that passed at once. A slot
        that fails costs a recompute of its blocks, never the request."""
        assert self.pool is not None and self.store is not None
        start = time.perf_counter()
        ready: list[ChunkTransfer] = []
        for t in transfers:
            try:
                self.store.read(t.slot, t.chunk_hash)
            except ChunkCorrupt as e:
                logger.warning("kvconnector: %s; its blocks will be recomputed", e)
                self._load_failed(t, e.reason)
                continue
            ready.append(t)
        if not ready:
            return
        try:
            if self._copier is not None:
                runs = block_runs((t.slot, self._kernel_ids(t.block_ids)) for t in ready)
                self._copier.scatter(self.pool.buffer, runs)
            else:
                for t in ready:
                    self._load_cuda(self.pool.slot(t.slot), self._kernel_block_ids(t.block_ids),
                                    on_copy_thread)
        except Exception:
            logger.exception("kvconnector: loading %d chunks failed", len(ready))
            for t in ready:
                self._load_failed(t, "error")
            return
        elapsed = time.perf_counter() - start
        self.ledger.loaded(ready, self.spec.block_size, self.pool.chunk_bytes, elapsed)
        self.ledger.count(**{"phase_seconds.load_copy": elapsed})

    def _load_cuda(self, slot: torch.Tensor, block_ids: torch.Tensor,
                   on_copy_thread: bool) -> None:
        """Host slot -> blocks; on the main thread, ordered before the compute stream's next
        work; on the copy thread, complete on return."""
        assert self._host_transfer is not None
        with self._device_lock:
            done = self._host_transfer.load(slot[None], block_ids)
        if on_copy_thread:
            done.synchronize()
        else:
            torch.cuda.current_stream(self.layers[0].device).wait_event(done)

    def _load_failed(self, t: ChunkTransfer, reason: str) -> None:
        self.ledger.load_failed(t.req_id, t.index, [b for b in t.block_ids if b >= 0],
                                [t.chunk_hash])
        self.ledger.count(load_errors=1, **{f"load_errors.{reason}": 1})

    def forward_began(self, plan: StepPlan) -> None:
        if not plan.idle:
            self.write_gate.set()

    # ---- saves ----
    def save(self, transfers: list[ChunkTransfer]) -> None:
        """Start copying chunks out; the forward pass does not wait.

        The source blocks stay as they are until the copies are done: running requests own
        them, and a later step that hands them out again lists the request in its
        ``fence``, which ``handle_preemptions`` waits for before any KV is written.
        """
        assert self.store is not None
        if not transfers:
            return
        if self._host_transfer is None:
            self.copies.submit(lambda ts=transfers: self._save_chunks(ts),
                               {t.req_id for t in transfers}, [t.slot for t in transfers],
                               save=True)
            return
        for t in transfers:  # CUDA: the DMA is queued now, the seal waits for it on the thread
            self.copies.wait_for_slots([t.slot])
            start = time.perf_counter()
            try:
                buf = self.store.begin_write(t.slot)
                with self._device_lock:
                    done = self._host_transfer.save(self._kernel_block_ids(t.block_ids), buf[None])
            except Exception:
                self._save_failed(t)
                continue
            self.copies.submit(lambda t=t, d=done, s=start: self._seal(t, d, s),
                               [t.req_id], [t.slot])

    def _save_chunks(self, transfers: list[ChunkTransfer]) -> None:
        """All of a step's saves in one pass (the copy thread, CPU)."""
        assert self.store is not None and self._copier is not None
        start = time.perf_counter()
        try:
            for t in transfers:
                buf = self.store.begin_write(t.slot)
                if any(b < 0 for b in t.block_ids):
                    buf.zero_()  # a partial chunk: no bytes of an earlier chunk stay behind
            runs = block_runs((t.slot, self._kernel_ids(t.block_ids)) for t in transfers)
            self._copier.gather(self.store.pool.buffer, runs)
        except Exception:
            for t in transfers:
                self._save_failed(t)
            return
        for t in transfers:
            self._seal(t, None, start)

    def _seal(self, t: ChunkTransfer, copied: torch.cuda.Event | None, start: float) -> None:
        """Mark the slot as holding ``t``'s chunk. Only values bound for Redis get a checksum:
        memory slots never leave this process (docs/architecture.md, "Integrity")."""
        assert self.store is not None
        try:
            if copied is not None:
                copied.synchronize()
            self.store.seal(t.slot, t.chunk_hash, t.blocks)
        except Exception:
            self._save_failed(t)
            return
        n_blocks = sum(b >= 0 for b in t.block_ids)
        elapsed = time.perf_counter() - start
        self.ledger.count(saved_chunks=1, saved_tokens=n_blocks * self.spec.block_size,
                          saved_bytes=self.store.pool.chunk_bytes * n_blocks // len(t.block_ids),
                          save_seconds=elapsed)
        self.ledger.observe(chunk_save_seconds=elapsed)

    def _save_failed(self, t: ChunkTransfer) -> None:
        assert self.store is not None
        logger.exception("kvconnector: saving chunk %s failed", self.store.key(t.chunk_hash))
        self.ledger.bad_chunks([t.chunk_hash])
        self.ledger.count(save_errors=1)

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Runs before the step writes KV. Queues the saves of requests that finished since
        the last step (vLLM already took their blocks back), then finishes the copies still
        reading blocks that vLLM hands out again in this step (finished or preempted
        requests)."""
        if plan.finished_saves:
            self.save(plan.finished_saves)
        if plan.fence:
            self.copies.wait_for_requests(plan.fence)

    def finished_loading(self, idle: bool = False) -> set[str]:
        """Parked requests whose loads are done (failed ones included). In a step that
        computed nothing (``idle``), first wait up to ``IDLE_WAIT_S`` for a fetch in
        flight: nothing else is running, and the copy thread gets the GIL meanwhile."""
        if idle:
            self.ledger.wait_for_fetch(IDLE_WAIT_S)
        if self.blend is not None:
            self.blend.run_ready()
        return self.ledger.take_received()

    def take_load_errors(self) -> set[int]:
        return self.ledger.take_load_errors()

    def take_report(self) -> WorkerReport | None:
        if self.disk_tier is not None and self._kv_events:
            self.ledger.disk_removed(self.disk_tier.take_gone())
        return self.ledger.take_report()

    def outstanding(self) -> dict[str, int]:
        """Pending state; all zero between steps once every request has finished."""
        queued = self.redis_tier.queued if self.redis_tier is not None else 0
        out = {**self.ledger.outstanding(), "redis_puts_queued": queued,
               "disk_puts_queued": self.disk_tier.queued if self.disk_tier is not None else 0,
               "copy_jobs": self.copies.pending}
        if self.blend is not None:
            out.update(self.blend.outstanding())
        return out

    def shutdown(self) -> None:
        """Within ``SHUTDOWN_BUDGET_S``: what is queued and not started is dropped."""
        deadline = time.monotonic() + SHUTDOWN_BUDGET_S
        if not self.copies.close(SHUTDOWN_BUDGET_S / 2):
            logger.warning("kvconnector: a copy job outlasted the shutdown budget")
        for tier in (self.disk_tier, self.redis_tier):
            if tier is not None:
                tier.close(max(0.0, deadline - time.monotonic()))
        if self.layer_loads is not None:
            self.layer_loads.close()
        if self._copier is not None:
            self._copier.close()

    def take_stats(self) -> TransferStats | None:
        for name, busy in (("copy_thread", self.copies.busy_seconds),
                           *((f"{t.name}_writes", t.busy_seconds)
                             for t in (self.disk_tier, self.redis_tier) if t is not None)):
            if busy > self._busy_reported.get(name, 0.0):
                self.ledger.count(**{f"phase_seconds.{name}":
                                     busy - self._busy_reported.get(name, 0.0)})
                self._busy_reported[name] = busy
        self.ledger.count(**self._redis_tap.counts(self.redis_tier))
        if self.disk_tier is not None:
            counts, gauges = self._disk_tap.counts(self.disk_tier)
            self.ledger.count(**counts)
            self.ledger.gauges(**gauges)
        return self.ledger.take_stats()
