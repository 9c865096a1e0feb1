"""Everything the scheduler half knows about one request, and the hit it offered vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvconnector.keys import chunk_hashes, partial_chunk_hashes

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvconnector.blend.request import BlendHit, BlendRequest
    from kvconnector.lookups import Asked

PENDING = "pending"  # a match while Redis is asked: vLLM asks again next step


@dataclass(frozen=True)
class PrefixHit:
    """A prefix hit offered to vLLM: ``tokens`` after vLLM's own hit of ``start`` tokens,
    ending with the first ``partial[2]`` blocks of chunk ``partial[0]`` (key ``partial[1]``)
    if set."""

    start: int
    tokens: int
    load_async: bool
    partial: tuple[int, bytes, int] | None = None
    # Per chunk index from the first: the tier that held it at the lookup ("memory",
    # "disk", "redis"); the partial chunk is the last entry when there is one.
    sources: tuple[str, ...] = ()
    # Loaded before the step's forward although some chunks come from the disk or Redis:
    # the worker fetches them first (a request alone in the engine delays nobody).
    fetch_now: bool = False


@dataclass
class RequestState:
    request: Request
    seed: bytes
    skip_reason: str | None
    hashes: list[bytes] = field(default_factory=list)  # chained, one per full chunk
    stored: int = 0  # leading chunks already saved or found in the store
    # Chunks from this index on are never loaded for this request: a load of that chunk
    # failed once, and vLLM asks again after it recomputes from the failure.
    load_limit: int | None = None
    partial_hashes: dict[tuple[int, int], bytes] = field(default_factory=dict)
    lookup: Asked[Any] | None = None  # the last Redis question about its prefix
    offer: PrefixHit | BlendHit | None = None  # until vLLM allocates its blocks
    hit_split: dict[str, int] | None = None  # tokens by tier, for vLLM's hit sources
    blend: BlendRequest | None = None

    def chunk_hashes(self, num_tokens: int, chunk_size: int) -> list[bytes]:
        """The hashes of the full chunks of the first ``num_tokens`` tokens."""
        have, want = len(self.hashes), num_tokens // chunk_size
        if want > have:
            tokens = self.request.all_token_ids[have * chunk_size: want * chunk_size]
            self.hashes.extend(chunk_hashes(tokens, chunk_size,
                                            self.hashes[-1] if have else self.seed))
        return self.hashes[:want]

    def partial_hash(self, chunk: int, blocks: int, chunk_size: int, block_size: int) -> bytes:
        """Key of the first ``blocks`` blocks of chunk ``chunk``."""
        h = self.partial_hashes.get((chunk, blocks))
        if h is None:  # and the shorter ones, which a lookup asks for next
            prev = self.chunk_hashes(chunk * chunk_size, chunk_size)[chunk - 1] if chunk \
                else self.seed
            start = chunk * chunk_size
            tokens = self.request.all_token_ids[start:start + blocks * block_size]
            for k, hk in enumerate(partial_chunk_hashes(prev, tokens, block_size), 1):
                self.partial_hashes[(chunk, k)] = hk
            h = self.partial_hashes[(chunk, blocks)]
        return h
