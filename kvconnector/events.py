"""KV events for KV-aware routers (llm-d, Dynamo): which prompt blocks the connector's tiers
hold, published by vLLM with its own events when ``--kv-events-config`` enables them.

A chunk the scheduler plans to save is announced as ``BlockStored`` for each of its blocks
(vLLM's own block hashes and tokens, so a router matches them against prompts as it matches
vLLM's GPU blocks), once per tier it goes to: ``medium`` "CPU" for host memory (vLLM's
offloading names it so) and "DISK" for the disk tier. ``BlockRemoved`` follows when the
memory tier evicts or forgets the chunk, and when a worker reports that the disk tier
evicted it or could not write it. Redis is not announced: it is shared across hosts and
evicts without telling anyone. Blend's documents are not prefix blocks and are not announced.

A stored event is sent when the save is planned, before the bytes are in place: a router
may send a request a step early, which costs that request nothing but a wait for the copy.
To announce a removal, the blocks of each announced chunk are remembered, for at most
``MAX_TRACKED`` chunks per tier (the oldest are forgotten: their removal is not announced).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvconnector import compat

if TYPE_CHECKING:
    from vllm.v1.request import Request

MEMORY = "CPU"
DISK = "DISK"
MAX_TRACKED = 100_000


class TierEvents:
    def __init__(self, block_size: int, chunk_size: int, tiers: tuple[str, ...]) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        self.tiers = tiers
        self._pending: list[Any] = []
        self._blocks: dict[str, OrderedDict[bytes, list[Any]]] = {t: OrderedDict()
                                                                 for t in tiers}

    def stored(self, request: Request, chunk_index: int, chunk_hash: bytes,
               num_blocks: int) -> None:
        """The first ``num_blocks`` blocks of chunk ``chunk_index`` of ``request`` go to
        every tier."""
        first = chunk_index * self.blocks_per_chunk
        for tier in self.tiers:
            event = compat.block_stored(request, first, num_blocks, self.block_size, tier)
            if event is None:
                return  # vLLM did not hash these blocks at this size: nothing to say
            self._pending.append(event)
            tracked = self._blocks[tier]
            tracked[chunk_hash] = event.block_hashes
            tracked.move_to_end(chunk_hash)
            while len(tracked) > MAX_TRACKED:
                tracked.popitem(last=False)

    def removed(self, tier: str, chunk_hash: bytes) -> None:
        blocks = self._blocks.get(tier, {}).pop(chunk_hash, None)
        if blocks:
            self._pending.append(compat.block_removed(blocks, tier))

    def take(self) -> list[Any]:
        out, self._pending = self._pending, []
        return out
