"""The worker half's chunks by hash: its pool slots, sealed under this worker's chunk keys,
and the tiers behind them (disk, Redis). The half and blend (``blend/worker.py``) both read,
seal and fetch through it, so a fetch is timed and counted the same way for either."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvconnector.keys import ChunkKey
from kvconnector.ledger import Ledger
from kvconnector.store import SlotPool
from kvconnector.store.tiering import LowerTier


class WorkerStore:
    def __init__(self, pool: SlotPool, tiers: Sequence[LowerTier], fingerprint: bytes,
                 tp_rank: int, ledger: Ledger,
                 copy_stream: torch.cuda.Stream | None = None) -> None:
        self.pool = pool
        self.tiers = list(tiers)  # nearest first: disk, then Redis
        self.fingerprint = fingerprint
        self.tp_rank = tp_rank
        self.ledger = ledger
        self._copy_stream = copy_stream  # CUDA: the stream that copies slots to and from KV

    def tier(self, name: str) -> LowerTier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def key(self, chunk_hash: bytes) -> ChunkKey:
        return ChunkKey(self.fingerprint, self.tp_rank, chunk_hash)

    def read(self, slot: int, chunk_hash: bytes) -> torch.Tensor:
        """The slot's bytes; raises ``ChunkCorrupt`` unless it is sealed as ``chunk_hash``."""
        return self.pool.read(slot, self.key(chunk_hash))

    def check(self, slot: int, chunk_hash: bytes) -> None:
        """``read``'s check alone: a load copies out of the whole pool at once."""
        self.pool.check(slot, self.key(chunk_hash))

    def begin_write(self, slot: int) -> torch.Tensor:
        return self.pool.begin_write(slot)

    def seal(self, slot: int, chunk_hash: bytes, blocks: int = 0) -> None:
        """Mark the slot as holding ``chunk_hash`` and queue its copies to the lower tiers
        (of its first ``blocks`` blocks, for a partial chunk)."""
        key = self.key(chunk_hash)
        self.pool.end_write(slot, key)
        for tier in self.tiers:
            tier.offload(slot, key, blocks)

    def fetch(self, wanted: Sequence[tuple[int, bytes, str, int]]) -> None:
        """Fill each ``(slot, chunk hash, tier, blocks)`` from the tier the scheduler found
        it in, or a farther one (copy thread); ``blocks``: of a partial chunk, else 0. A
        chunk that does not arrive leaves its slot unsealed, so reading it fails and its
        blocks are recomputed. A chunk fetched from Redis is also written to the disk
        tier."""
        if not wanted or not self.tiers:
            return
        if self._copy_stream is not None:
            # An earlier load may still be copying out of a slot the fetch refills.
            self._copy_stream.synchronize()
        names = [t.name for t in self.tiers]
        todo = [(slot, h, names.index(src) if src in names else len(names), blocks)
                for slot, h, src, blocks in wanted]
        for i, tier in enumerate(self.tiers):
            asked = [(slot, h, blocks) for slot, h, first, blocks in todo if first <= i]
            if not asked:
                continue
            start = time.perf_counter()
            got = tier.fetch([(slot, self.key(h), blocks) for slot, h, blocks in asked])
            elapsed = time.perf_counter() - start
            n = sum(got)
            self.ledger.count(**{f"{tier.name}_loaded_chunks": n,
                                 f"{tier.name}_misses": len(asked) - n,
                                 "load_seconds": elapsed,
                                 f"phase_seconds.{tier.name}_fetch": elapsed})
            self.ledger.observe(**{f"{tier.name}_fetch_seconds": elapsed})
            arrived = {slot for (slot, _, _), ok in zip(asked, got, strict=True) if ok}
            if tier.name == "redis":
                for slot, h, blocks in asked:
                    if slot in arrived:
                        self.to_disk(slot, h, blocks)
            todo = [t for t in todo if t[0] not in arrived]

    def to_disk(self, slot: int, chunk_hash: bytes, blocks: int = 0) -> None:
        """A chunk that arrived from Redis is also written to the disk tier, if any."""
        disk = self.tier("disk")
        if disk is not None:
            disk.offload(slot, self.key(chunk_hash), blocks)
