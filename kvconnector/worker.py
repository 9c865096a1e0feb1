"""Worker half: executes each step's plan between vLLM's paged KV tensors and the pool.

Synchronous loads run on the main thread before the forward; saves and loads of requests
parked in WAITING_FOR_REMOTE_KVS run on the copy thread (``background.py``). The copies
themselves, and what each owes the ledger, are ``block_copies.py``'s."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from kvconnector import compat
from kvconnector.background import CopyThread
from kvconnector.blend.worker import BlendWorker
from kvconnector.block_copies import BlockCopies, copy_stream, paged_mover
from kvconnector.config import ConnectorConfig
from kvconnector.layer_loads import LayerLoads
from kvconnector.layout import LayerLayout, LayoutError, describe_layers
from kvconnector.ledger import Ledger
from kvconnector.metadata import IDLE_WAIT_S, ChunkTransfer, StepPlan, WorkerReport
from kvconnector.metrics import DiskTap, StoreTap
from kvconnector.placement import AT_ONCE, WritePlacement
from kvconnector.stats import TransferStats
from kvconnector.store import SlotPool, open_disk, open_redis
from kvconnector.store.disk_space import disk_capacity
from kvconnector.store.disk_tier import DiskTier
from kvconnector.store.memory import host_memory
from kvconnector.store.tiering import RedisTier
from kvconnector.worker_store import WorkerStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

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
        self.blocks: BlockCopies | None = None
        self.redis_tier: RedisTier | None = None
        self.write_gate = threading.Event()  # held saves and puts wait for it (placement.py)
        self.disk_tier: DiskTier | None = None
        self._disk_tap = DiskTap()
        self.layer_loads: LayerLoads | None = None
        saves = WritePlacement(self._spare_cores or None, self.write_gate)
        self.copies = CopyThread(saves if compat.is_cpu_platform() else AT_ONCE)
        self._busy_reported: dict[str, float] = {}  # thread -> busy seconds reported
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
        shape = (len(self.layers), *self.layout.chunk_shape(self.config.chunk_size // kbs))
        if not self.layers[0].is_cuda:  # the KV cache came out of the same memory
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in self.layers}
            self.config.check_memory_available(*host_memory(), sum(storages.values()))
        redis = open_redis(self.config)
        self.pool = SlotPool(self.num_slots, shape, self.layout.dtype)
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
        mover = paged_mover(self.layers, self.layout, self.config.chunk_size // kbs,
                            self._spare_cores)
        tiers = [t for t in (self.disk_tier, self.redis_tier) if t is not None]
        self.store = WorkerStore(self.pool, tiers, self.fingerprint, self.tp_rank,
                                 self.ledger, copy_stream(mover))
        self.blocks = BlockCopies(mover, self.layers, self.spec.block_size, kbs, self.store,
                                  self.ledger, self.copies,
                                  self.config.inline_save_max_kib << 10)
        copier = self.blocks.copier
        if copier is not None and self.config.by_layer(len(self.layer_names)):
            self.layer_loads = LayerLoads(self.layer_names, copier, self.store,
                                          self.redis_tier, self.ledger, self.blocks.kernel_ids,
                                          self.spec.block_size, self._spare_cores)
        if self.blend is not None:
            self.blend.attach(self.layers, self.layout, self.store)
        logger.info("kvconnector worker rank %d: %d layers, layout %s %s",
                    self.tp_rank, len(self.layers), self.layout.family, self.layout.sizes)

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
            assert self.blocks is not None
            self._fetch(plan.loads)
            self.blocks.load(plan.loads, on_copy_thread=False)
        except Exception:  # never the request, never the engine: a recompute
            logger.exception("kvconnector: loading %d chunks failed", len(plan.loads))
            for t in plan.loads:
                self.ledger.chunk_load_failed(t, "error")

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
                self.ledger.chunk_load_failed(t, reason)

    def start_async_loads(self, plan: StepPlan) -> None:
        """One copy-thread job per parked request: fetch from Redis, then fill its blocks."""
        by_request: dict[str, list[ChunkTransfer]] = {}
        for t in plan.async_loads:
            by_request.setdefault(t.req_id, []).append(t)
        for req_id, transfers in by_request.items():
            self.ledger.start_fetch(lambda r=req_id, ts=transfers: self.copies.submit(
                lambda: self._load_request(r, ts), [r], [t.slot for t in ts]))

    def _load_request(self, req_id: str, transfers: list[ChunkTransfer]) -> None:
        assert self.blocks is not None
        try:
            self._fetch(transfers)
            self.blocks.load(transfers, on_copy_thread=True)
        except Exception:  # blocks that may not have been written are recomputed
            logger.exception("kvconnector: loading request %s failed; its blocks will be "
                             "recomputed", req_id)
            for t in transfers:
                self.ledger.chunk_load_failed(t, "error")
        finally:  # vLLM releases the request only once it is reported, failed or not
            self.ledger.received(req_id)
            self.ledger.fetch_over()

    def _fetch(self, transfers: list[ChunkTransfer]) -> None:
        """Chunks promoted from the disk or Redis, into their slots."""
        assert self.store is not None
        self.store.fetch([(t.slot, t.chunk_hash, t.source, t.blocks) for t in transfers
                          if t.source != "memory" and t.slot >= 0])

    def forward_began(self, plan: StepPlan) -> None:
        if not plan.idle:
            self.write_gate.set()

    # ---- saves ----
    def save(self, transfers: list[ChunkTransfer]) -> None:
        assert self.blocks is not None
        self.blocks.save(transfers)

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
        if self.blocks is not None:
            self.blocks.close()

    def take_stats(self) -> TransferStats | None:
        for name, busy in (("copy_thread", self.copies.busy_seconds),
                           *((f"{t.name}_writes", t.busy_seconds)
                             for t in (self.disk_tier, self.redis_tier) if t is not None)):
            if busy > self._busy_reported.get(name, 0.0):
                self.ledger.count(**{f"phase_seconds.{name}":
                                     busy - self._busy_reported.get(name, 0.0)})
                self._busy_reported[name] = busy
        if redis_counts := self._redis_tap.counts(self.redis_tier):
            self.ledger.count(**redis_counts)
        if self.disk_tier is not None:
            counts, gauges = self._disk_tap.counts(self.disk_tier)
            self.ledger.count(**counts)
            self.ledger.gauges(**gauges)
        return self.ledger.take_stats()
