"""The worker half's chunks by hash: its pool slots, sealed under this worker's chunk keys,
and the Redis tier behind them. The half and blend (``blend/worker.py``) both read, seal and
fetch through it, so a fetch is timed and counted the same way for either."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvconnector.keys import ChunkKey
from kvconnector.ledger import Ledger
from kvconnector.store import SlotPool
from kvconnector.store.tiering import RedisTier


class WorkerStore:
    def __init__(self, pool: SlotPool, redis_tier: RedisTier | None, fingerprint: bytes,
                 tp_rank: int, ledger: Ledger,
                 copy_stream: torch.cuda.Stream | None = None) -> None:
        self.pool = pool
        self.redis_tier = redis_tier
        self.fingerprint = fingerprint
        self.tp_rank = tp_rank
        self.ledger = ledger
        self._copy_stream = copy_stream  # CUDA: the stream that copies slots to and from KV

    def key(self, chunk_hash: bytes) -> ChunkKey:
        return ChunkKey(self.fingerprint, self.tp_rank, chunk_hash)

    def read(self, slot: int, chunk_hash: bytes) -> torch.Tensor:
        """The slot's bytes; raises ``ChunkCorrupt`` unless it is sealed as ``chunk_hash``."""
        return self.pool.read(slot, self.key(chunk_hash))

    def begin_write(self, slot: int) -> torch.Tensor:
        return self.pool.begin_write(slot)

    def seal(self, slot: int, chunk_hash: bytes) -> None:
        """Mark the slot as holding ``chunk_hash`` and queue its copy to Redis."""
        key = self.key(chunk_hash)
        self.pool.end_write(slot, key)
        if self.redis_tier is not None:
            self.redis_tier.offload(slot, key)

    def fetch(self, wanted: Sequence[tuple[int, bytes]]) -> None:
        """Fill each ``(slot, chunk hash)`` from Redis (copy thread). A chunk that does not
        arrive leaves its slot unsealed, so reading it fails and its blocks are recomputed."""
        if not wanted or self.redis_tier is None:
            return
        if self._copy_stream is not None:
            # An earlier load may still be copying out of a slot the fetch refills.
            self._copy_stream.synchronize()
        start = time.perf_counter()
        n = self.redis_tier.fetch([(slot, self.key(h)) for slot, h in wanted])
        elapsed = time.perf_counter() - start
        self.ledger.count(redis_loaded_chunks=n, redis_misses=len(wanted) - n,
                          load_seconds=elapsed)
        self.ledger.observe(redis_fetch_seconds=elapsed)
