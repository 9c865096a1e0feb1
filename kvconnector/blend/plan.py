"""What the scheduler half tells the workers about blends (carried in ``StepPlan``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PieceLoad:
    chunk_hash: bytes
    slot: int
    source: str = "memory"  # or the tier it is fetched from into the slot first


@dataclass
class DocLoad:
    """A stored document that sits at tokens ``[start, start + length)`` of this request."""

    doc_hash: bytes
    start: int
    length: int
    pieces: list[PieceLoad]


@dataclass
class BlendJob:
    """Fill tokens ``[start, end)`` of a request with blended KV before it runs.

    Tokens before ``start`` are vLLM's own prefix-cache hit and are read, never written.
    ``block_ids`` are the request's scheduler blocks covering ``[0, end)``; ``start`` and
    ``end`` are block aligned. Every token of the range that no loaded document covers is
    recomputed; so is the share the strategy picks.
    """

    req_id: str
    start: int
    end: int
    token_ids: list[int]  # tokens [start, end)
    block_ids: list[int]
    docs: list[DocLoad]
    strategy: str
    recompute_ratio: float
    check_layer: int
    epic_tokens: int
    tail_ids: list[int]  # the prompt's tokens after ``end`` (at least its last one)
    load_async: bool = False  # parked in WAITING_FOR_REMOTE_KVS: report in finished_recving
    sink_tokens: int = 0  # each loaded document's first tokens, recomputed on top of the ratio
    refine_layer: int = 0  # a second, narrower pick there (gradual filtering); 0: none
    refine_ratio: float = 0.15
    group_tokens: int = 1  # tokens picked together at a check layer
    # vLLM's hit before ``start`` holds blocks another request computes in this very step
    # (vLLM caches blocks when it allocates them): unreadable before the forward pass, so
    # the range is reported failed and vLLM recomputes it.
    prefix_unready: bool = False

    @property
    def slots(self) -> list[int]:
        return [p.slot for d in self.docs for p in d.pieces]


@dataclass
class DocSave:
    """Copy a computed document's KV out of the request's blocks into piece slots.

    ``block_ids`` cover the document's tokens, starting with block ``start // block_size``.
    ``pieces`` are ``(piece index, key hash, slot)`` for the pieces to write.
    """

    req_id: str
    doc_hash: bytes
    start: int
    length: int
    block_ids: list[int]
    pieces: list[tuple[int, bytes, int]] = field(default_factory=list)
