"""Scheduler half of blend: which documents of a prompt are stored, the blended range
presented to vLLM, and which documents to save.

vLLM's connector contract is prefix-only, so the blended range is presented as a prefix
hit: from vLLM's own hit to the last block boundary before the prompt's end. The worker
fills every block of it before the forward pass that reads it (or, when Redis is involved,
before the parked request is reported received). A blended request's KV is approximate,
so it is never stored or reused as a prefix (no prefix-chain saves, and after a preemption
it is recomputed in full).

``BlendScheduler`` is part of the scheduler half: it shares ``SchedulerHalf``'s memory index,
Redis client, lookup thread and request states.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvconnector import compat
from kvconnector.blend.config import BlendConfig
from kvconnector.blend.cost import compute_share
from kvconnector.blend.families import BlendUnsupported
from kvconnector.blend.plan import BlendJob, DocLoad, DocSave, PieceLoad
from kvconnector.blend.segments import Document, documents, piece_capacity
from kvconnector.config import ConfigError
from kvconnector.keys import ChunkKey

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvconnector.metadata import StepPlan
    from kvconnector.scheduler import RequestState, SchedulerHalf

logger = logging.getLogger("kvconnector.blend.scheduler")

BLENDED = "blended (approximate KV, never reused as a prefix)"


@dataclass
class BlendRequest:
    request: Request
    config: BlendConfig
    docs: list[Document]
    handled: set[int] = field(default_factory=set)  # documents saved or found stored
    blended: bool = False
    declined: bool = False  # blending would cost about what full prefill does
    salted: bool = False  # vLLM's block hashes from the blended range on: approximate KV
    # The hit offered to vLLM: (start, end, document index -> "memory" | "redis", async).
    offer: tuple[int, int, dict[int, str], bool] | None = None
    redis_question: tuple[int, ...] | None = None
    redis_answer: Future[set[int]] | None = None


class BlendScheduler:
    def __init__(self, half: SchedulerHalf, vllm_config: VllmConfig) -> None:
        self.half = half
        self.config = half.config.blending
        reason = compat.blend_unsupported_reason(vllm_config)
        if reason is not None:
            raise BlendUnsupported(f"kvconnector: blend is on but cannot serve this engine: "
                                   f"{reason}. Set blend to false to serve it with prefix "
                                   "reuse only.")
        if self.config.separator_ids is not None:
            self.separator = list(self.config.separator_ids)
        else:
            self.separator = compat.separator_ids(vllm_config, self.config.separator)
            if not self.separator:
                raise ConfigError(f"blend_separator {self.config.separator!r} encodes to no "
                                  "tokens; give blend_separator_ids")
        self.num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self._requests: dict[str, BlendRequest] = {}
        self._jobs: list[BlendJob] = []
        self._held: dict[str, list[int]] = {}  # parked blends: slots their pieces are read from
        logger.info("kvconnector blend: separator token ids %s", self.separator)

    def _state(self, st: RequestState) -> BlendRequest:
        req = st.request
        br = self._requests.get(req.request_id)
        if br is None:
            cfg = self.config.for_request(req.kv_transfer_params)
            docs = (documents(req.prompt_token_ids, self.separator, st.seed,
                              self.half.config.chunk_size) if cfg.enabled else [])
            if cfg.enabled and not docs:
                self.half.stats.add(blend_unsegmented=1)
            br = BlendRequest(req, cfg, docs)
            self._requests[req.request_id] = br
        return br

    def match(self, st: RequestState, num_computed: int) -> tuple[int | None, bool] | None:
        """The blended range beyond vLLM's hit, ``(None, False)`` while Redis is asked, or
        None when the request is not blended (prefix reuse serves it as usual)."""
        br = self._state(st)
        req = br.request
        if not br.docs or br.blended or br.declined or req.num_output_tokens:
            return None
        bs = self.half.block_size
        end = (req.num_prompt_tokens - 1) // bs * bs
        if end <= num_computed:
            return None
        index = self.half.index
        in_range = [i for i, d in enumerate(br.docs) if d.start < end and d.end > num_computed]
        found = {i: "memory" for i in in_range if all(h in index for h in br.docs[i].pieces)}
        missing = [i for i in in_range if i not in found]
        if missing and self.half.redis is not None:
            in_redis = self._ask_redis(br, missing)
            if in_redis is None:
                return None, False
            found.update(dict.fromkeys(in_redis, "redis"))
        reusable = sum(min(br.docs[i].end, end) - max(br.docs[i].start, num_computed)
                       for i in found)
        if reusable < br.config.min_tokens:
            return None
        share = compute_share(br.config, self.num_layers, req.num_prompt_tokens - num_computed,
                              reusable, len(found))
        if share > br.config.max_cost:
            br.declined = True
            self.half.stats.add(blend_declined=1)
            logger.debug("kvconnector blend: request %s served as usual: blending would cost "
                         "%.2f of full prefill (blend_max_cost %.2f)", req.request_id, share,
                         br.config.max_cost)
            return None
        load_async = "redis" in found.values()
        br.offer = (num_computed, end, found, load_async)
        if not br.salted:  # vLLM caches the blocks when it allocates them, before after_alloc
            compat.mark_approximate(req, num_computed, bs, br.config.salt())
            br.salted = True
        return end - num_computed, load_async

    def _ask_redis(self, br: BlendRequest, docs: list[int]) -> set[int] | None:
        """Documents (of ``docs``) whose every piece is in Redis; None while asking."""
        redis, lookups = self.half.redis, self.half._lookups
        assert redis is not None and lookups is not None
        question = tuple(docs)
        if br.redis_answer is None or br.redis_question != question:
            keys = {i: [ChunkKey(self.half.fingerprint, 0, h) for h in br.docs[i].pieces]
                    for i in docs}
            budget = self.half.config.redis_lookup_budget_ms / 1000

            def ask() -> set[int]:
                return {i for i, ks in keys.items() if redis.exists_prefix(ks, budget) == len(ks)}

            br.redis_question, br.redis_answer = question, lookups.submit(ask)
        if not br.redis_answer.done():
            return None
        try:
            return br.redis_answer.result()
        except Exception:  # a failed lookup is a miss
            logger.debug("kvconnector: Redis blend lookup failed", exc_info=True)
            return set()

    def after_alloc(self, request: Request, blocks: KVCacheBlocks,
                    num_external_tokens: int) -> bool:
        """Plan the blend vLLM accepted; True if this request's hit was a blend."""
        br = self._requests.get(request.request_id)
        if br is None or br.offer is None:
            return False
        start, end, found, load_async = br.offer
        br.offer = None
        if num_external_tokens == 0:
            return True
        end = start + num_external_tokens
        index = self.half.index
        docs = []
        for i in sorted(found):
            doc = br.docs[i]
            pieces, promoted = [], []
            for h in doc.pieces:
                if h in index:
                    pieces.append(PieceLoad(h, index.use(h)))
                    continue
                slot = index.allocate(h) if load_async else None
                if slot is None:  # evicted since the lookup, or no room: recomputed
                    break
                index.use(h)
                promoted.append(h)
                pieces.append(PieceLoad(h, slot, from_redis=True))
            else:
                docs.append(DocLoad(doc.doc_hash, doc.start, doc.length, pieces))
                br.handled.add(i)
                continue
            for h in promoted:
                index.drop(h)
        bs = self.half.block_size
        job = BlendJob(
            request.request_id, start, end, list(request.prompt_token_ids[start:end]),
            list(blocks.get_block_ids()[0][:end // bs]), docs, br.config.strategy,
            br.config.recompute_ratio, br.config.check_layer, br.config.epic_tokens,
            list(request.prompt_token_ids[end:request.num_prompt_tokens]), load_async,
            br.config.sink_tokens, br.config.refine_layer, br.config.refine_ratio)
        self._jobs.append(job)
        if load_async:  # read on the worker's main thread once fetched: held until then
            slots = [p.slot for d in docs for p in d.pieces]
            for slot in slots:
                index.hold(slot)
            self._held[request.request_id] = slots
        br.blended = True
        self.half._requests[request.request_id].skip_reason = BLENDED
        cap = piece_capacity(self.half.config.chunk_size)
        redis = sum(min(cap, d.length - j * cap) for d in docs
                    for j, p in enumerate(d.pieces) if p.from_redis)
        redis = min(redis, num_external_tokens)
        memory = num_external_tokens - redis
        self.half._hit_split[request.request_id] = (memory, redis)
        by_tier = {"hit_tokens.memory": memory, "hit_tokens.redis": redis}
        self.half.stats.add(hit_tokens=num_external_tokens,
                            **{k: n for k, n in by_tier.items() if n})
        return True

    def build(self, plan: StepPlan, scheduler_output: SchedulerOutput) -> None:
        """This step's blends, and saves of the documents this step completes (the caller
        keeps the blocks they read until they are done, as for its own saves)."""
        plan.blends, self._jobs = self._jobs, []
        index, bs = self.half.index, self.half.block_size
        # A blend that fails leaves blocks this step's forward still reads: documents
        # computed in a blending step are saved from the request's next step on.
        blending = {j.req_id for j in plan.blends} | {t.req_id for t in plan.loads}
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            br = self._requests.get(req_id)
            st = self.half._requests.get(req_id)
            if (br is None or st is None or len(br.handled) == len(br.docs)
                    or st.skip_reason not in (None, BLENDED) or req_id in blending):
                continue
            req = br.request
            done = min(req.num_computed_tokens + n_scheduled, req.num_prompt_tokens)
            block_ids: list[int] | None = None
            for i, doc in enumerate(br.docs):
                if i in br.handled or doc.end > done:
                    continue
                br.handled.add(i)
                todo = [(j, h) for j, h in enumerate(doc.pieces) if h not in index]
                if not todo:
                    continue
                if block_ids is None:
                    block_ids = compat.request_block_ids(scheduler_output, req_id)
                    if block_ids is None:
                        break
                pieces = []
                for j, h in todo:
                    slot = index.allocate(h)
                    if slot is None:
                        break
                    pieces.append((j, h, slot))
                if pieces:
                    plan.doc_saves.append(DocSave(
                        req_id, doc.doc_hash, doc.start, doc.length,
                        block_ids[doc.start // bs:-(-doc.end // bs)], pieces))

    def update(self, output: KVConnectorOutput) -> None:
        """The worker has blended these parked requests: their slots may be planned again."""
        for req_id in output.finished_recving or ():
            for slot in self._held.pop(req_id, ()):
                self.half.index.release(slot)

    def reset(self) -> None:
        """After a cache reset (new key seed, empty index): requests not started yet find
        their documents again under the new seed. Planned blends still run: the slots of
        parked ones stay held (the index reuses them only once released)."""
        for req_id, br in list(self._requests.items()):
            if not br.request.num_computed_tokens and not br.blended:
                del self._requests[req_id]

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def outstanding(self) -> dict[str, int]:
        return {"blend_requests": len(self._requests), "blend_jobs": len(self._jobs),
                "blend_held": len(self._held)}
