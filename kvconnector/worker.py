"""Worker half: executes each step's plan between vLLM's paged KV tensors and the pool."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from kvconnector import compat, kernels
from kvconnector.config import ConnectorConfig
from kvconnector.keys import ChunkKey
from kvconnector.layout import LayerLayout, LayoutError, describe_layers
from kvconnector.metadata import ChunkTransfer, StepPlan, WorkerReport
from kvconnector.stats import TransferStats
from kvconnector.store import ChunkCorrupt, SlotPool, open_redis
from kvconnector.store.tiering import RedisTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvconnector.worker")


class WorkerHalf:
    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig) -> None:
        self.config = config
        self.layer_names, self.spec = compat.attention_group(kv_cache_config)
        self.fingerprint = compat.fingerprint(vllm_config, kv_cache_config, config).digest()
        self.tp_rank = compat.tp_rank()
        self.num_slots = config.memory_capacity // compat.chunk_bytes(kv_cache_config, config)
        self.stats = TransferStats()  # since the last report to vLLM
        self.totals = TransferStats()  # since start-up
        self._load_errors: set[int] = set()
        self._bad_chunks: set[bytes] = set()
        self.layers: list[torch.Tensor] = []
        self.layout: LayerLayout | None = None
        self.pool: SlotPool | None = None
        self._ratio = 1
        self.redis_tier: RedisTier | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise LayoutError(f"vLLM registered no KV tensor for layers {missing}")
        self.layers = [kv_caches[n] for n in self.layer_names]
        self.layout = describe_layers(
            {n: kv_caches[n] for n in self.layer_names},
            num_kv_heads=self.spec.num_kv_heads, head_size=self.spec.head_size,
            cpu_pages=compat.is_cpu_platform(), mla=compat.is_mla(self.spec))
        kbs = self.layout.kernel_block_size
        if self.spec.block_size % kbs:
            raise LayoutError(f"kernel block size {kbs} does not divide block size "
                              f"{self.spec.block_size}")
        self._ratio = self.spec.block_size // kbs
        shape = (len(self.layers), *self.layout.chunk_shape(self.config.chunk_size // kbs))
        self.pool = SlotPool(self.num_slots, shape, self.layout.dtype)
        redis = open_redis(self.config)
        if redis is not None:
            self.redis_tier = RedisTier(redis, self.pool, self.layout.family)
        self._host_transfer = None
        if self.layers[0].is_cuda:
            from kvconnector.kernels.host_transfer import HostTransfer

            self._host_transfer = HostTransfer(self.layers, self.layout,
                                               self.config.chunk_size // kbs, max_chunks=1)
        logger.info("kvconnector worker rank %d: %d layers, layout %s %s",
                    self.tp_rank, len(self.layers), self.layout.family, self.layout.sizes)

    def _key(self, t: ChunkTransfer) -> ChunkKey:
        return ChunkKey(self.fingerprint, self.tp_rank, t.chunk_hash)

    def _kernel_block_ids(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long)
        if self._ratio == 1:
            return ids[None]
        sub = torch.arange(self._ratio)
        expanded = ids[:, None] * self._ratio + sub[None, :]
        expanded[ids < 0] = -1
        return expanded.reshape(1, -1)

    def load(self, plan: StepPlan) -> None:
        assert self.pool is not None and self.layout is not None
        wanted = [(t.slot, self._key(t)) for t in plan.loads if t.from_redis and t.slot >= 0]
        if wanted and self.redis_tier is not None:
            start = time.perf_counter()
            n = self.redis_tier.fetch(wanted)
            self._count(redis_loaded_chunks=n, redis_misses=len(wanted) - n,
                        load_seconds=time.perf_counter() - start)
        for t in plan.loads:
            start = time.perf_counter()
            try:
                data = self.pool.read(t.slot, self._key(t))
                self._copy_in(data, self._kernel_block_ids(t.block_ids))
            except Exception as e:  # a bad chunk costs a recompute, never the request
                if not isinstance(e, ChunkCorrupt):
                    logger.exception("kvconnector: loading chunk %s failed", self._key(t))
                else:
                    logger.warning("kvconnector: %s; its blocks will be recomputed", e)
                self._load_errors.update(b for b in t.block_ids if b >= 0)
                self._bad_chunks.add(t.chunk_hash)
                self._count(load_errors=1)
                continue
            n_blocks = sum(b >= 0 for b in t.block_ids)
            self._count(loaded_chunks=1, loaded_tokens=n_blocks * self.spec.block_size,
                        loaded_bytes=self.pool.chunk_bytes * n_blocks // len(t.block_ids),
                        load_seconds=time.perf_counter() - start)

    def save(self, plan: StepPlan) -> None:
        assert self.pool is not None and self.layout is not None
        for t in plan.saves:
            start = time.perf_counter()
            try:
                buf = self.pool.begin_write(t.slot)
                self._copy_out(self._kernel_block_ids(t.block_ids), buf)
                self.pool.end_write(t.slot, self._key(t))
                if self.redis_tier is not None:
                    self.redis_tier.offload(t.slot, self._key(t))
            except Exception:
                logger.exception("kvconnector: saving chunk %s failed", self._key(t))
                self._bad_chunks.add(t.chunk_hash)
                self._count(save_errors=1)
                continue
            self._count(saved_chunks=1, saved_tokens=self.config.chunk_size,
                        saved_bytes=self.pool.chunk_bytes,
                        save_seconds=time.perf_counter() - start)

    def _copy_out(self, block_ids: torch.Tensor, slot: torch.Tensor) -> None:
        """Blocks -> one host slot, complete on return."""
        if self._host_transfer is None:
            kernels.gather(self.layers, self.layout, block_ids, slot[None])
        else:
            self._host_transfer.save(block_ids, slot[None]).synchronize()

    def _copy_in(self, slot: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Host slot -> blocks, ordered before the compute stream's next work."""
        if self._host_transfer is None:
            kernels.scatter(slot[None], self.layout, block_ids, self.layers)
        else:
            done = self._host_transfer.load(slot[None], block_ids)
            torch.cuda.current_stream(self.layers[0].device).wait_event(done)

    def _count(self, **counts: float) -> None:
        self.stats.add(**counts)
        self.totals.add(**counts)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        if not self._bad_chunks:
            return None
        report, self._bad_chunks = WorkerReport(self._bad_chunks), set()
        return report

    def outstanding(self) -> dict[str, int]:
        """Pending state; all zero between steps once every request has finished."""
        queued = self.redis_tier.queued if self.redis_tier is not None else 0
        return {"load_errors": len(self._load_errors), "bad_chunks": len(self._bad_chunks),
                "redis_puts_queued": queued}

    def shutdown(self) -> None:
        if self.redis_tier is not None:
            self.redis_tier.flush()
            self.redis_tier.close()

    def take_stats(self) -> TransferStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, TransferStats()
        return stats
