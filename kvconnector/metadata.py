"""What crosses between the two processes each step (both sides must pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ChunkTransfer:
    """Move one chunk between a memory slot and the request's blocks.

    ``block_ids`` are scheduler block ids, one per block of the chunk; -1 marks a block
    to leave alone (on a load: one vLLM already has from its own prefix cache).
    """

    req_id: str
    chunk_hash: bytes
    slot: int
    block_ids: list[int]
    from_redis: bool = False  # a load: fetch into the slot from Redis first


@dataclass
class StepPlan(KVConnectorMetadata):
    """Scheduler -> workers: what to move this step.

    ``loads`` land before this step's forward; ``async_loads`` (requests parked in vLLM's
    WAITING_FOR_REMOTE_KVS) and ``saves`` run on the workers' copy thread. ``fence`` are
    requests (finished or preempted) whose queued saves read blocks vLLM hands out again
    in this step: the workers finish those copies before the step writes any KV.
    """

    loads: list[ChunkTransfer] = field(default_factory=list)
    async_loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    fence: set[str] = field(default_factory=set)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Workers -> scheduler: chunks that proved unusable, to be forgotten."""

    bad_chunks: set[bytes] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        assert isinstance(other, WorkerReport)
        return WorkerReport(self.bad_chunks | other.bad_chunks)
