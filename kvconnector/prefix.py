"""Prefix reuse on the scheduler side: how much of a prompt the store holds, and the loads
that bring it into the request's blocks."""

from __future__ import annotations

from dataclasses import dataclass

from kvconnector.config import ConnectorConfig
from kvconnector.fetches import Fetches
from kvconnector.keys import ChunkKey
from kvconnector.lookups import Lookups
from kvconnector.metadata import IDLE_WAIT_S, ChunkTransfer
from kvconnector.metrics import hit_tokens_by_tier
from kvconnector.request_state import PENDING, PrefixHit, RequestState
from kvconnector.store.disk_catalog import DiskCatalog
from kvconnector.store.memory import MemoryIndex

MISSING_SLOT = -1  # a load the worker must report as failed


@dataclass(frozen=True)
class Held:
    """What the store holds of a request: ``full`` leading chunks, then the first
    ``partial_blocks`` blocks of the next chunk (key ``partial_hash``), each from the tier
    in ``sources`` (one entry per chunk, the partial one last)."""

    full: int
    partial_blocks: int = 0
    partial_hash: bytes | None = None
    from_memory: int = 0  # leading tokens of it held in memory, readable at once
    sources: tuple[str, ...] = ()
    arriving: bool = False  # a chunk of it is still being fetched for another request


class PrefixReuse:
    def __init__(self, config: ConnectorConfig, block_size: int, fingerprint: bytes,
                 tp_size: int, index: MemoryIndex, fetches: Fetches,
                 lookups: Lookups | None, disk: DiskCatalog | None, chunk_bytes: int,
                 by_layer: bool = False) -> None:
        self.chunk_size = config.chunk_size
        self.chunk_bytes = chunk_bytes
        self.sync_fetch_max_bytes = config.sync_fetch_max_bytes(by_layer)
        self.block_size = block_size
        self.blocks_per_chunk = config.chunk_size // block_size
        self.fingerprint = fingerprint
        self.tp_size = tp_size
        self.index = index
        self.fetches = fetches
        self.lookups = lookups
        self.disk = disk
        # A chunk held in memory at the lookup but evicted since is looked for here.
        self.nearest_lower = "disk" if disk is not None else "redis"

    def match(self, st: RequestState, num_computed: int,
              alone: bool = False) -> PrefixHit | str | None:
        """The hit beyond vLLM's own ``num_computed`` tokens, PENDING while Redis is asked.
        Memory hits load synchronously; a hit that needs the disk or Redis loads
        asynchronously while the request waits in vLLM's WAITING_FOR_REMOTE_KVS, unless the
        request is ``alone`` in the engine: then up to ``sync_fetch_max_mib`` are fetched
        before its own step's forward, which saves the step that would report the fetch."""
        req = st.request
        # A load must leave at least one token for the forward pass.
        cap = (req.num_tokens - 1) // self.block_size * self.block_size
        if cap <= num_computed:
            return None  # vLLM's own hit holds all a load could give: ask no tier
        held = self._held(st, cap, alone)
        if held is None:
            return PENDING
        hit = min(held.full * self.chunk_size + held.partial_blocks * self.block_size, cap)
        if hit <= num_computed:
            return None
        partial = ((held.full, held.partial_hash, held.partial_blocks)
                   if held.partial_hash is not None else None)
        load_async = hit > held.from_memory
        lower = sum(s != "memory" for s in held.sources)
        fetch_now = (load_async and alone and not held.arriving
                     and lower * self.chunk_bytes <= self.sync_fetch_max_bytes)
        return PrefixHit(num_computed, hit - num_computed, load_async and not fetch_now,
                         partial, held.sources, fetch_now)

    def _partial_blocks(self, chunk: int, cap: int) -> int:
        """Most blocks a partial chunk at index ``chunk`` can give within ``cap`` tokens."""
        return max(0, min(self.blocks_per_chunk - 1,
                          (cap - chunk * self.chunk_size) // self.block_size))

    def _partial_hash(self, st: RequestState, chunk: int, blocks: int) -> bytes:
        return st.partial_hash(chunk, blocks, self.chunk_size, self.block_size)

    def _keys(self, chunk_hash: bytes) -> list[ChunkKey]:
        """The keys of one chunk: every TP rank stores its share under its own."""
        return [ChunkKey(self.fingerprint, r, chunk_hash) for r in range(self.tp_size)]

    def _memory_partial(self, st: RequestState, chunk: int, cap: int) -> tuple[int, bytes | None]:
        """The longest partial chunk at index ``chunk`` held in memory (blocks, key)."""
        if st.load_limit is not None and chunk >= st.load_limit:
            return 0, None
        for k in range(self._partial_blocks(chunk, cap), 0, -1):
            h = self._partial_hash(st, chunk, k)
            if h in self.index:
                return k, h
        return 0, None

    def _disk_partial(self, st: RequestState, chunk: int, cap: int) -> int:
        """Blocks of the longest partial chunk at index ``chunk`` on disk."""
        assert self.disk is not None
        if st.load_limit is not None and chunk >= st.load_limit:
            return 0
        for k in range(self._partial_blocks(chunk, cap), 0, -1):
            if self.disk.holds(self._keys(self._partial_hash(st, chunk, k))):
                return k
        return 0

    def _held(self, st: RequestState, cap: int, alone: bool) -> Held | None:
        """Full chunks from memory, then disk, then Redis, then a partial chunk. A partial
        chunk is asked of the disk and Redis only with full chunks that memory lacked: a
        request whose full chunks are all in memory never waits for a few blocks. None
        while Redis is asked."""
        hashes = st.chunk_hashes(st.request.num_tokens, self.chunk_size)[:st.load_limit]
        n = len(hashes)
        in_memory = self.index.count_prefix(hashes)
        ready = next((i for i, h in enumerate(hashes[:in_memory]) if h in self.fetches),
                     in_memory)
        on_disk = in_redis = k = 0
        ph, partial_source = None, "memory"
        if self.disk is not None and in_memory < n:
            on_disk = self.disk.count_prefix([self._keys(h) for h in hashes[in_memory:]])
            if in_memory + on_disk == n:
                k = self._disk_partial(st, n, cap)
                ph, partial_source = (self._partial_hash(st, n, k), "disk") if k else (None,
                                                                                       "memory")
        if self.lookups is not None and in_memory + on_disk < n:
            answer = self._ask_redis(st, hashes, in_memory + on_disk, cap, alone)
            if answer is None:
                return None
            in_redis = answer[0]
            if in_memory + on_disk + in_redis == n and answer[1]:
                k, ph, partial_source = answer[1], self._partial_hash(st, n, answer[1]), "redis"
        # Every chunk fetched from a lower tier lands in a slot of its own this step: a hit
        # larger than the free slots would fail its last chunks and recompute them.
        room = max(0, self.index.num_slots - self.index.pinned - in_memory)
        lower = min(on_disk + in_redis, room)
        full = in_memory + lower
        if full < n or (ph is not None and room <= lower):
            k, ph = 0, None
        sources = ["memory"] * in_memory + ["disk"] * min(on_disk, lower) + ["redis"] * max(
            0, lower - on_disk)
        mk, mh = self._memory_partial(st, full, cap)
        if mk >= k and mh is not None:
            k, ph, partial_source = mk, mh, "memory"
        if ph is not None:
            sources.append(partial_source)
        from_memory = ready * self.chunk_size
        if full == ready and ph is not None and ph in self.index and ph not in self.fetches:
            from_memory += k * self.block_size
        arriving = ready < in_memory or (ph is not None and ph in self.fetches)
        return Held(full, k, ph, from_memory, tuple(sources), arriving)

    def _ask_redis(self, st: RequestState, hashes: list[bytes], start: int, cap: int,
                   alone: bool) -> tuple[int, int] | None:
        """(full chunks after ``start`` that every TP rank holds in Redis, blocks of the
        longest partial chunk after all of them), or None while asking. One round trip per
        request and question: one EXISTS pipeline for both kinds of keys."""
        assert self.lookups is not None
        n = len(hashes)
        max_k = 0
        if st.load_limit is None or n < st.load_limit:
            max_k = self._partial_blocks(n, cap)
        wanted = hashes[start:] + [self._partial_hash(st, n, k) for k in range(max_k, 0, -1)]
        n_full, tp = n - start, self.tp_size
        keys = [ChunkKey(self.fingerprint, r, h) for h in wanted for r in range(tp)]

        def interpret(found: list[bool]) -> tuple[int, int]:
            per_chunk = [all(found[i:i + tp]) for i in range(0, len(found), tp)]
            chunks = 0
            while chunks < n_full and per_chunk[chunks]:
                chunks += 1
            if chunks < n_full:
                return chunks, 0
            return chunks, next((max_k - i for i, ok in enumerate(per_chunk[n_full:]) if ok), 0)

        st.lookup, answer = self.lookups.answer(st.lookup, (start, n, max_k), keys, interpret,
                                                (0, 0), IDLE_WAIT_S if alone else 0.0)
        return answer

    def plan_loads(self, st: RequestState, hit: PrefixHit, block_ids: list[int],
                   num_tokens: int) -> tuple[list[ChunkTransfer], dict[str, int]]:
        """The loads of the ``num_tokens`` vLLM accepted of ``hit``, and how many of those
        tokens come from each tier."""
        start, end = hit.start, hit.start + num_tokens
        c, bs, req_id = self.chunk_size, self.block_size, st.request.request_id
        loads = []
        for ci in range(start // c, -(-end // c)):
            partial = hit.partial is not None and ci == hit.partial[0]
            h = hit.partial[1] if hit.partial is not None and partial else st.hashes[ci]
            source = "memory"
            if h not in self.index:
                found = hit.sources[ci] if ci < len(hit.sources) else "memory"
                source = found if found != "memory" else self.nearest_lower
            if not hit.load_async and (h in self.fetches or (
                    source != "memory" and not hit.fetch_now)):
                slot = MISSING_SLOT  # evicted since the lookup: reported and recomputed
            elif source != "memory":  # promoted into memory: the worker fetches it first
                slot = self.index.allocate(h)
                if slot is None:
                    slot = MISSING_SLOT
                else:
                    self.index.use(h)
                    if hit.load_async:  # else fetched before this step's forward
                        self.fetches.promote(req_id, h)
            else:
                slot = self.index.use(h)
            first = ci * c // bs
            ids = [block_ids[first + j] if start <= (first + j) * bs < end else -1
                   for j in range(self.blocks_per_chunk)]
            loads.append(ChunkTransfer(req_id, ci, h, slot, ids, source,
                                       hit.partial[2] if hit.partial and partial else 0))
        return loads, hit_tokens_by_tier(loads, bs)
