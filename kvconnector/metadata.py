"""What crosses between the two processes each step (both sides must pickle)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvconnector.blend.plan import BlendJob, DocSave


@dataclass
class ChunkTransfer:
    """Move one chunk between a memory slot and the request's blocks.

    ``block_ids`` are scheduler block ids, one per block of the chunk; -1 marks a block
    to leave alone (on a load: one vLLM already has from its own prefix cache).
    """

    req_id: str
    index: int  # the chunk's position in the request
    chunk_hash: bytes
    slot: int
    block_ids: list[int]
    # A load: the tier to fetch the chunk from into the slot first ("disk", "redis"), or
    # "memory" (in the slot already).
    source: str = "memory"
    # A partial chunk (a prompt's last blocks): only its first ``blocks`` blocks are
    # stored, and only their bytes go to the disk and Redis. 0: a whole chunk.
    blocks: int = 0


# How long a step that scheduled nothing (``StepPlan.idle``) waits for background work a
# request waits on (a Redis lookup, a parked request's fetch): what a new request's first
# step may be delayed by, and Python's GIL switch interval, which a background thread
# competing with vLLM's idle loop waits for after every read from a socket or a file.
IDLE_WAIT_S = 0.005


@dataclass
class StepPlan(KVConnectorMetadata):
    """Scheduler -> workers: what to move this step.

    ``loads`` land before this step's forward; ``async_loads`` (requests parked in vLLM's
    WAITING_FOR_REMOTE_KVS) and ``saves`` run on the workers' copy thread. ``fence`` are
    requests (finished or preempted) whose queued saves read blocks vLLM hands out again
    in this step: the workers finish those copies before the step writes any KV.
    ``finished_saves`` are the last blocks of requests that finished since the last plan:
    vLLM already took their blocks back, so they are queued before this step writes any KV
    (and fenced like every other save).
    ``blends`` and ``doc_saves`` are CacheBlend's (kvconnector/blend/plan.py).
    ``idle``: vLLM scheduled no tokens this step (requests may wait for their KV).
    """

    loads: list[ChunkTransfer] = field(default_factory=list)
    async_loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    fence: set[str] = field(default_factory=set)
    finished_saves: list[ChunkTransfer] = field(default_factory=list)
    blends: list[BlendJob] = field(default_factory=list)
    doc_saves: list[DocSave] = field(default_factory=list)
    idle: bool = False


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Workers -> scheduler: chunks that proved unusable, to be forgotten, and per request
    the first chunk whose load failed (never planned again for that request)."""

    bad_chunks: set[bytes] = field(default_factory=set)
    failed_loads: dict[str, int] = field(default_factory=dict)
    # Chunks the disk tier evicted or could not write (for KV events only).
    disk_removed: set[bytes] = field(default_factory=set)

    def note_failed_load(self, req_id: str, index: int) -> None:
        self.failed_loads[req_id] = min(index, self.failed_loads.get(req_id, index))

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        assert isinstance(other, WorkerReport)
        out = WorkerReport(self.bad_chunks | other.bad_chunks, dict(self.failed_loads),
                           self.disk_removed | other.disk_removed)
        for req_id, index in other.failed_loads.items():
            out.note_failed_load(req_id, index)
        return out

    def __bool__(self) -> bool:
        return bool(self.bad_chunks or self.failed_loads or self.disk_removed)
