"""Which chunks of its requests' KV a scheduler step saves, and the blocks those saves read."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvconnector import compat
from kvconnector.config import ConnectorConfig
from kvconnector.events import TierEvents
from kvconnector.metadata import ChunkTransfer
from kvconnector.request_state import RequestState
from kvconnector.store.memory import MemoryIndex

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class SavePlanner:
    def __init__(self, config: ConnectorConfig, block_size: int, index: MemoryIndex,
                 events: TierEvents | None = None) -> None:
        self.config = config
        self.events = events
        self.chunk_size = config.chunk_size
        self.block_size = block_size
        self.blocks_per_chunk = config.chunk_size // block_size
        self.index = index
        # Block id -> the request whose latest planned save reads it. When vLLM hands such
        # a block out again, the plan makes the workers finish that request's copies first.
        self._readers: dict[int, str] = {}

    def read_by(self, req_id: str, block_ids: Iterable[int]) -> None:
        self._readers.update((b, req_id) for b in block_ids if b >= 0)

    def fence(self, scheduler_output: SchedulerOutput) -> set[str]:
        """Requests whose queued saves read blocks vLLM hands out again this step."""
        return {self._readers.pop(b) for b in compat.blocks_handed_out(scheduler_output)
                if b in self._readers}

    def plan_step(self, scheduler_output: SchedulerOutput, states: dict[str, RequestState],
                  skip: set[str], out: list[ChunkTransfer]) -> None:
        """The saves of the chunks this step completes (and, once a prompt is done, of its
        last blocks), for the scheduled requests not in ``skip``."""
        c = self.chunk_size
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            st = states.get(req_id)
            if st is None or st.skip_reason or req_id in skip:
                continue
            req = st.request
            done_after_step = min(req.num_computed_tokens + n_scheduled, req.num_tokens)
            if not self.config.save_decode_chunks:
                done_after_step = min(done_after_step, req.num_prompt_tokens)
            n_full = done_after_step // c
            prompt_done = req.num_computed_tokens < req.num_prompt_tokens <= done_after_step
            if n_full <= st.stored and not prompt_done:
                continue
            block_ids = compat.request_block_ids(scheduler_output, req_id)
            if block_ids is None:
                continue
            if n_full > st.stored:
                self._full(st, n_full, block_ids, out)
            if prompt_done:  # the prompt's last blocks, for a repeat of the same prompt
                self._partial(st, done_after_step, block_ids, out)

    def plan_finish(self, st: RequestState, request: Request, block_ids: list[int],
                    out: list[ChunkTransfer]) -> None:
        """A finished request's chunks computed in its last step, and the full blocks after
        its last full chunk (prompt and answer), so that the next turn of a chat reloads all
        of it but the last block."""
        done = compat.kv_complete_tokens(request)
        if not self.config.save_decode_chunks:
            done = min(done, request.num_prompt_tokens)
        n_full = done // self.chunk_size
        if n_full > st.stored:  # computed in its loading step, its last
            self._full(st, n_full, block_ids, out)
        self._partial(st, done, block_ids, out)

    def _full(self, st: RequestState, n_full: int, block_ids: list[int],
              out: list[ChunkTransfer]) -> None:
        req_id, bpc = st.request.request_id, self.blocks_per_chunk
        hashes = st.chunk_hashes(n_full * self.chunk_size, self.chunk_size)
        for ci in range(st.stored, n_full):
            h = hashes[ci]
            if h in self.index:
                self.index.touch(h)
                continue
            slot = self.index.allocate(h)
            if slot is None:
                break
            blocks = list(block_ids[ci * bpc:(ci + 1) * bpc])
            out.append(ChunkTransfer(req_id, ci, h, slot, blocks))
            self.read_by(req_id, blocks)
            if self.events is not None:
                self.events.stored(st.request, ci, h, bpc)
        st.stored = n_full

    def _partial(self, st: RequestState, done: int, block_ids: list[int],
                 out: list[ChunkTransfer]) -> None:
        """Save the full blocks of the chunk after the last full one of the first ``done``
        tokens (whose KV is complete), if the chunks before it are stored."""
        c, bpc = self.chunk_size, self.blocks_per_chunk
        chunk = done // c
        k = done // self.block_size - chunk * bpc
        if k <= 0 or len(block_ids) < chunk * bpc + k:
            return
        if self.index.count_prefix(st.chunk_hashes(chunk * c, c)) < chunk:
            return  # unreachable without the chunks before it
        h = st.partial_hash(chunk, k, c, self.block_size)
        if h in self.index:
            self.index.touch(h)
            return
        slot = self.index.allocate(h)
        if slot is None:
            return
        blocks = list(block_ids[chunk * bpc:chunk * bpc + k]) + [-1] * (bpc - k)
        out.append(ChunkTransfer(st.request.request_id, chunk, h, slot, blocks, blocks=k))
        self.read_by(st.request.request_id, blocks)
        if self.events is not None:
            self.events.stored(st.request, chunk, h, k)
