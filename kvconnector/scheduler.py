"""Scheduler half: how much of a prompt the store holds, and which chunks move this step."""

from __future__ import annotations

import logging
import secrets
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvconnector import compat
from kvconnector.blend.scheduler import BlendScheduler
from kvconnector.config import ConnectorConfig
from kvconnector.keys import (
    ChunkKey,
    chunk_hashes,
    partial_chunk_hash,
    request_seed,
    reset_seed,
)
from kvconnector.metadata import ChunkTransfer, StepPlan, WorkerReport
from kvconnector.metrics import StoreTap, hit_tokens_by_tier
from kvconnector.stats import TransferStats
from kvconnector.store import MemoryIndex, open_redis

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvconnector.scheduler")

MISSING_SLOT = -1  # a load the worker must report as failed


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
    # The last Redis question, (first chunk asked, chunks asked, partial blocks asked), and
    # its pending answer: (full chunks found, blocks of the partial chunk found).
    redis_question: tuple[int, int, int] | None = None
    redis_answer: Future[tuple[int, int]] | None = None
    partial_hashes: dict[tuple[int, int], bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Hit:
    """What the store holds of a request: ``full`` leading chunks, then the first
    ``partial_blocks`` blocks of the next chunk (key ``partial_hash``)."""

    full: int
    partial_blocks: int = 0
    partial_hash: bytes | None = None
    from_memory: int = 0  # leading tokens of the hit held in memory


class SchedulerHalf:
    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig) -> None:
        _, spec = compat.attention_group(kv_cache_config)
        config.check_block_size(spec.block_size)
        self.config = config
        self.block_size = spec.block_size
        self.blocks_per_chunk = config.chunk_size // spec.block_size
        # The keys' fingerprint part (the workers compute the same one); chunk hashes chain
        # from ``_seed``, which a cache reset replaces.
        self.fingerprint = compat.fingerprint(vllm_config, kv_cache_config, config).digest()
        self._seed = self.fingerprint
        self.index = MemoryIndex(config.memory_slots(compat.chunk_bytes(kv_cache_config,
                                                                         config)))
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.redis = open_redis(config, for_lookups=True)
        self._lookups = (ThreadPoolExecutor(1, thread_name_prefix="kvconnector-lookup")
                         if self.redis is not None else None)
        self.stats = TransferStats()
        self._requests: dict[str, RequestState] = {}
        self._lookup_start: dict[str, tuple[int, bool]] = {}  # req -> (tokens, async)
        self._hit_split: dict[str, tuple[int, int]] = {}  # req -> (memory, Redis) tokens
        self._loads: list[ChunkTransfer] = []
        self._async_loads: list[ChunkTransfer] = []
        self._finished_saves: list[ChunkTransfer] = []  # planned at request_finished
        self._partial_of: dict[str, tuple[int, bytes]] = {}  # req -> (chunk, key) of its hit
        # Chunks promoted from Redis whose fetch the worker has not reported done.
        self._arriving: dict[bytes, int] = {}
        self._fetching: dict[str, list[bytes]] = {}  # parked request -> its promotions
        # Block id -> the request whose latest planned save reads it. When vLLM hands such
        # a block out again, the plan makes the workers finish that request's copies first.
        self._readers: dict[int, str] = {}
        self._evictions_reported = 0
        self._redis_tap = StoreTap()
        self._slots_reported: int | None = None
        self.resumed_requests = 0  # preempted requests seen coming back
        self.blend = (BlendScheduler(self, vllm_config) if config.blending.enabled
                      else None)

    def _state(self, request: Request) -> RequestState:
        st = self._requests.get(request.request_id)
        if st is None:
            reason = compat.uncacheable_reason(request)
            if reason:
                logger.debug("kvconnector: not caching request %s (%s)",
                             request.request_id, reason)
            st = RequestState(request, request_seed(self._seed, request.cache_salt), reason)
            self._requests[request.request_id] = st
        return st

    def _hashes(self, st: RequestState, num_tokens: int) -> list[bytes]:
        """The request's chunk hashes covering its first ``num_tokens`` tokens."""
        have, want = len(st.hashes), num_tokens // self.config.chunk_size
        if want > have:
            c = self.config.chunk_size
            tokens = st.request.all_token_ids[have * c: want * c]
            st.hashes.extend(chunk_hashes(tokens, c, st.hashes[-1] if have else st.seed))
        return st.hashes[:want]

    def _partial_hash(self, st: RequestState, chunk: int, blocks: int) -> bytes:
        """Key of the first ``blocks`` blocks of chunk ``chunk`` of the request's tokens."""
        key = (chunk, blocks)
        h = st.partial_hashes.get(key)
        if h is None:
            c, bs = self.config.chunk_size, self.block_size
            prev = self._hashes(st, chunk * c)[chunk - 1] if chunk else st.seed
            tokens = st.request.all_token_ids[chunk * c:chunk * c + blocks * bs]
            h = partial_chunk_hash(prev, tokens)
            st.partial_hashes[key] = h
        return h

    def _partial_blocks(self, chunk: int, cap: int) -> int:
        """Most blocks a partial chunk at index ``chunk`` can give within ``cap`` tokens."""
        return max(0, min(self.blocks_per_chunk - 1,
                          (cap - chunk * self.config.chunk_size) // self.block_size))

    def _memory_partial(self, st: RequestState, chunk: int, cap: int) -> tuple[int, bytes | None]:
        """The longest partial chunk at index ``chunk`` held in memory (blocks, key)."""
        if st.load_limit is not None and chunk >= st.load_limit:
            return 0, None
        for k in range(self._partial_blocks(chunk, cap), 0, -1):
            h = self._partial_hash(st, chunk, k)
            if h in self.index:
                return k, h
        return 0, None

    def _lookup(self, st: RequestState, cap: int) -> Hit | None:
        """The request's hit: full chunks from memory then Redis, then a partial chunk. A
        partial chunk is asked of Redis only with full chunks that memory lacked: a request
        whose full chunks are all in memory never waits on the network for a few blocks.
        None while Redis is asked."""
        hashes = self._hashes(st, st.request.num_tokens)[:st.load_limit]
        n = len(hashes)
        in_memory = self.index.count_prefix(hashes)
        # Chunks still on their way from Redis into their slots are in the index, but only
        # a job behind their fetch on the copy thread can read them: an asynchronous load.
        ready = next((i for i, h in enumerate(hashes[:in_memory]) if h in self._arriving),
                     in_memory)
        c, bs = self.config.chunk_size, self.block_size
        full, k, ph = in_memory, 0, None
        if self.redis is not None and in_memory < n:
            answer = self._redis_prefix(st, hashes, in_memory, cap)
            if answer is None:
                return None
            # Every chunk fetched from Redis lands in a slot of its own this step: a hit
            # larger than the free slots would fail its last chunks and recompute them.
            room = max(0, self.index.num_slots - self.index.pinned - in_memory)
            full += min(answer[0], room)
            if full == n and answer[1] and room > answer[0]:
                k = answer[1]
                ph = self._partial_hash(st, n, k)
        mk, mh = self._memory_partial(st, full, cap)
        if mk >= k and mh is not None:
            k, ph = mk, mh
        from_memory = ready * c
        if full == ready and ph is not None and ph in self.index and ph not in self._arriving:
            from_memory += k * bs
        return Hit(full, k, ph, from_memory)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the store holds beyond vLLM's own hit. Memory hits load synchronously;
        a hit that needs Redis loads asynchronously while the request waits in vLLM's
        WAITING_FOR_REMOTE_KVS. ``None`` (ask again next step) while Redis is asked."""
        st = self._state(request)
        if st.skip_reason:
            return 0, False
        if self.blend is not None and st.load_limit is None:
            blended = self.blend.match(st, num_computed_tokens)
            if blended is not None:
                return blended
        # A load must leave at least one token for the forward pass.
        cap = (request.num_tokens - 1) // self.block_size * self.block_size
        found = self._lookup(st, cap)
        if found is None:
            return None, False
        c = self.config.chunk_size
        hit = min(found.full * c + found.partial_blocks * self.block_size, cap)
        if hit <= num_computed_tokens:
            return 0, False
        load_async = hit > found.from_memory
        self._lookup_start[request.request_id] = (num_computed_tokens, load_async)
        if found.partial_hash is not None:
            self._partial_of[request.request_id] = (found.full, found.partial_hash)
        else:
            self._partial_of.pop(request.request_id, None)
        return hit - num_computed_tokens, load_async

    def _redis_prefix(self, st: RequestState, hashes: list[bytes], start: int,
                      cap: int) -> tuple[int, int] | None:
        """(full chunks after ``start`` that every TP rank holds in Redis, blocks of the
        longest partial chunk after all of them), or None while the lookup thread is
        still asking. One round trip per request and question."""
        assert self.redis is not None and self._lookups is not None
        n = len(hashes)
        max_k = 0
        if st.load_limit is None or n < st.load_limit:
            max_k = self._partial_blocks(n, cap)
        question = (start, n, max_k)
        if st.redis_answer is None or st.redis_question != question:
            ranks = range(self.tp_size)
            full = [ChunkKey(self.fingerprint, r, h) for h in hashes[start:] for r in ranks]
            partial = [ChunkKey(self.fingerprint, r, self._partial_hash(st, n, k))
                       for k in range(max_k, 0, -1) for r in ranks]
            st.redis_question = question
            st.redis_answer = self._lookups.submit(self._ask_redis, full, partial, max_k)
        if not st.redis_answer.done():
            return None
        try:
            return st.redis_answer.result()
        except Exception:  # the store counts its own faults; a failed lookup is a miss
            logger.debug("kvconnector: Redis lookup failed", exc_info=True)
            return 0, 0

    def _ask_redis(self, full: list[ChunkKey], partial: list[ChunkKey],
                   max_k: int) -> tuple[int, int]:
        """On the lookup thread: one EXISTS pipeline for both kinds of keys."""
        assert self.redis is not None
        found = self.redis.exists_many(full + partial, self.config.redis_lookup_budget_ms / 1000)
        tp = self.tp_size
        per_chunk = [all(found[i:i + tp]) for i in range(0, len(found), tp)]
        n_full = len(full) // tp
        chunks = 0
        while chunks < n_full and per_chunk[chunks]:
            chunks += 1
        if chunks < n_full:
            return chunks, 0
        for i, ok in enumerate(per_chunk[n_full:]):
            if ok:
                return chunks, max_k - i
        return chunks, 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self.blend is not None and self.blend.after_alloc(request, blocks,
                                                             num_external_tokens):
            return
        lookup = self._lookup_start.pop(request.request_id, None)
        partial = self._partial_of.pop(request.request_id, None)
        if num_external_tokens == 0 or lookup is None:
            return
        start, load_async = lookup
        st = self._requests[request.request_id]
        end = start + num_external_tokens
        block_ids = blocks.get_block_ids()[0]
        c, bs = self.config.chunk_size, self.block_size
        planned = self._async_loads if load_async else self._loads
        redis_tokens = 0
        for ci in range(start // c, -(-end // c)):
            h = partial[1] if partial is not None and ci == partial[0] else st.hashes[ci]
            from_redis = h not in self.index
            if not load_async and (from_redis or h in self._arriving):
                slot = MISSING_SLOT  # evicted since the lookup: reported and recomputed
            elif from_redis:  # promoted into memory: the worker fetches it into this slot
                slot = self.index.allocate(h)
                if slot is None:
                    slot = MISSING_SLOT
                else:
                    self.index.use(h)
                    self._arriving[h] = self._arriving.get(h, 0) + 1
                    self._fetching.setdefault(request.request_id, []).append(h)
            else:
                slot = self.index.use(h)
            first = ci * c // bs
            ids = [block_ids[first + j] if start <= (first + j) * bs < end else -1
                   for j in range(self.blocks_per_chunk)]
            planned.append(ChunkTransfer(request.request_id, ci, h, slot, ids, from_redis))
            if from_redis:
                redis_tokens += min(end, (ci + 1) * c) - max(start, ci * c)
        self._hit_split[request.request_id] = (num_external_tokens - redis_tokens, redis_tokens)
        self.stats.add(hit_tokens=num_external_tokens)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's per-tier count of a hit: host memory or Redis."""
        memory, redis = self._hit_split.pop(request.request_id, (num_external_tokens, 0))
        labels = compat.hit_source_labels()
        return {label: n for label, n in zip(labels, (memory, redis), strict=True) if n}

    def build_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        fence = {self._readers.pop(b) for b in compat.blocks_handed_out(scheduler_output)
                 if b in self._readers}
        plan = StepPlan(loads=self._loads, async_loads=self._async_loads, fence=fence,
                        finished_saves=self._finished_saves)
        self._loads, self._async_loads, self._finished_saves = [], [], []
        if self.blend is not None:
            self.blend.build(plan, scheduler_output)
            for save in plan.doc_saves:  # blocks handed out again wait for the document save
                self._readers.update((b, save.req_id) for b in save.block_ids if b >= 0)
        self.resumed_requests += len(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        c = self.config.chunk_size
        # A load that fails still has this step's forward pass read the blocks it left
        # unfilled before vLLM recomputes them: what a loading request computes in its
        # loading step is saved from its next step (or its finish) on, once that load is
        # known to have worked.
        loading = {t.req_id for t in plan.loads}
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None or st.skip_reason or req_id in loading:
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
                self._plan_full_saves(st, req_id, n_full, block_ids, plan.saves)
            if prompt_done:  # the prompt's last blocks, for a repeat of the same prompt
                self._plan_partial_save(st, req_id, done_after_step, block_ids, plan.saves)
        self.stats.add(**hit_tokens_by_tier(plan.loads + plan.async_loads, self.block_size))
        self.index.unpin_all()
        return plan

    def _plan_full_saves(self, st: RequestState, req_id: str, n_full: int,
                         block_ids: list[int], out: list[ChunkTransfer]) -> None:
        hashes = self._hashes(st, n_full * self.config.chunk_size)
        bpc = self.blocks_per_chunk
        for ci in range(st.stored, n_full):
            h = hashes[ci]
            if h in self.index:
                self.index.touch(h)
                continue
            slot = self.index.allocate(h)
            if slot is None:
                break
            blocks = block_ids[ci * bpc:(ci + 1) * bpc]
            out.append(ChunkTransfer(req_id, ci, h, slot, list(blocks)))
            self._readers.update((b, req_id) for b in blocks if b >= 0)
        st.stored = n_full

    def _plan_partial_save(self, st: RequestState, req_id: str, done: int,
                           block_ids: list[int], out: list[ChunkTransfer]) -> None:
        """Save the full blocks of the chunk after the last full one of the first ``done``
        tokens (whose KV is complete), if the chunks before it are stored."""
        c, bpc = self.config.chunk_size, self.blocks_per_chunk
        chunk = done // c
        k = done // self.block_size - chunk * bpc
        if k <= 0 or len(block_ids) < chunk * bpc + k:
            return
        if self.index.count_prefix(self._hashes(st, chunk * c)) < chunk:
            return  # unreachable without the chunks before it
        h = self._partial_hash(st, chunk, k)
        if h in self.index:
            self.index.touch(h)
            return
        slot = self.index.allocate(h)
        if slot is None:
            return
        blocks = list(block_ids[chunk * bpc:chunk * bpc + k]) + [-1] * (bpc - k)
        out.append(ChunkTransfer(req_id, chunk, h, slot, blocks))
        self._readers.update((b, req_id) for b in blocks if b >= 0)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        report = output.kv_connector_worker_meta
        if isinstance(report, WorkerReport):
            for h in report.bad_chunks:
                self.index.drop(h)
            for req_id, index in report.failed_loads.items():
                st = self._requests.get(req_id)
                if st is not None:
                    st.load_limit = min(index, st.load_limit if st.load_limit is not None
                                        else index)
        for req_id in output.finished_recving or ():
            for h in self._fetching.pop(req_id, ()):
                if self._arriving[h] > 1:
                    self._arriving[h] -= 1
                else:
                    del self._arriving[h]
        if self.blend is not None:
            self.blend.update(output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Finished or aborted: its blocks go back to vLLM at once, as without a connector
        (so ``reset_prefix_cache`` succeeds right after a request). Saves still queued on
        them are fenced when vLLM hands those blocks out again (``build_meta``).

        A request that finished with output also saves the full blocks after its last full
        chunk (prompt and answer), so that the next turn of a chat reloads all of it but
        the last block. vLLM calls this after the step's plan was built, so that save goes
        into the next plan's ``finished_saves``, which the workers queue before that step
        writes any KV; its blocks are fenced like every other save."""
        st = self._requests.pop(request.request_id, None)
        self._lookup_start.pop(request.request_id, None)
        self._hit_split.pop(request.request_id, None)
        if self.blend is not None:
            self.blend.forget(request.request_id)
        self._partial_of.pop(request.request_id, None)
        if st is not None and not st.skip_reason:
            done = compat.kv_complete_tokens(request)
            if not self.config.save_decode_chunks:
                done = min(done, request.num_prompt_tokens)
            n_full = done // self.config.chunk_size
            if n_full > st.stored:  # computed in its loading step, its last
                self._plan_full_saves(st, request.request_id, n_full, block_ids,
                                      self._finished_saves)
            self._plan_partial_save(st, request.request_id, done, block_ids,
                                    self._finished_saves)
        return False, None

    def has_pending_saves(self) -> bool:
        """Saves planned at a request's finish that no plan has carried yet: vLLM keeps
        stepping (an empty step) so they run while the engine is idle."""
        return bool(self._finished_saves)

    def reset(self) -> None:
        """vLLM's cache reset (after a weight update, on sleep): every chunk stored so far
        becomes unreachable for this engine, in memory and in Redis.

        The hash chains restart from a new random seed: nothing is deleted and nothing
        global is written, so other engines keep using those chunks until they reset too.
        A per-engine random seed, not a counter, because two engines that each reset once
        may hold different weights; sharing between them would serve wrong KV.
        """
        self._seed = reset_seed(self.fingerprint, secrets.token_bytes(16))
        forgotten = len(self.index)
        self.index.clear()
        self._finished_saves.clear()  # their slots are free again
        for req_id, st in list(self._requests.items()):
            if st.request.num_computed_tokens == 0:
                del self._requests[req_id]  # starts afresh under the new seed
            elif not st.skip_reason:
                st.skip_reason = "computed before a cache reset"
        self._lookup_start.clear()
        self._partial_of.clear()  # fetches still arriving keep their entries: new keys differ
        if self.blend is not None:
            self.blend.reset()
        logger.info("kvconnector: cache reset, %d stored chunks forgotten", forgotten)

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.shutdown(wait=False, cancel_futures=True)
        if self.redis is not None:
            self.redis.close()

    def outstanding(self) -> dict[str, int]:
        """Per-request state still held; all zero once every request has finished."""
        out = {"requests": len(self._requests), "lookups": len(self._lookup_start),
               "hit_splits": len(self._hit_split),
               "planned_loads": len(self._loads) + len(self._async_loads),
               "planned_finished_saves": len(self._finished_saves),
               "partial_hits": len(self._partial_of), "arriving": len(self._arriving),
               "pinned_slots": self.index.pinned}
        if self.blend is not None:
            out.update(self.blend.outstanding())
        return out

    def take_stats(self) -> TransferStats | None:
        new_evictions = self.index.evictions - self._evictions_reported
        if new_evictions:
            self.stats.add(evictions=new_evictions)
            self._evictions_reported = self.index.evictions
        self.stats.add(**self._redis_tap.counts(self.redis))
        if len(self.index) != self._slots_reported:
            self._slots_reported = len(self.index)
            self.stats.set_gauges(memory_slots_used=len(self.index),
                                  memory_slots=self.index.num_slots)
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, TransferStats()
        return stats
