"""Scheduler half of blend: which documents of a prompt are stored, the blended range
presented to vLLM, and which documents to save.

vLLM's connector contract is prefix-only, so the blended range is presented as a prefix
hit: from vLLM's own hit to the last block boundary before the prompt's end. The worker
fills every block of it before the forward pass that reads it (or, when Redis is involved,
before the parked request is reported received). A blended request's KV is approximate,
so it is never stored or reused as a prefix (no prefix-chain saves, and after a preemption
it is recomputed in full).

``BlendScheduler`` is a plug-in of the scheduler half: it is handed the half's memory index,
Redis lookups, fetches in flight and counters, and keeps its per-request state in the half's
``RequestState.blend``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvconnector import compat
from kvconnector.blend.cost import compute_share
from kvconnector.blend.families import BlendUnsupported
from kvconnector.blend.plan import BlendJob, DocLoad, DocSave, PieceLoad
from kvconnector.blend.request import BlendHit, BlendRequest
from kvconnector.blend.segments import documents, piece_capacity
from kvconnector.config import ConfigError, ConnectorConfig
from kvconnector.fetches import Fetches
from kvconnector.keys import ChunkKey
from kvconnector.lookups import Lookups
from kvconnector.request_state import PENDING, RequestState
from kvconnector.stats import TransferStats
from kvconnector.store.disk_catalog import DiskCatalog
from kvconnector.store.memory import MemoryIndex

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvconnector.metadata import StepPlan

logger = logging.getLogger("kvconnector.blend.scheduler")

BLENDED = "blended (approximate KV, never reused as a prefix)"


class BlendScheduler:
    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig, block_size: int,
                 fingerprint: bytes, index: MemoryIndex, fetches: Fetches,
                 lookups: Lookups | None, stats: TransferStats,
                 disk: DiskCatalog | None = None) -> None:
        self.config = config.blending
        self.chunk_size = config.chunk_size
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.index = index
        self.fetches = fetches
        self.lookups = lookups
        self.disk = disk
        self.stats = stats
        reason = compat.blend_unsupported_reason(vllm_config)
        if reason is not None:
            raise BlendUnsupported.refusing(reason)
        if self.config.separator_ids is not None:
            self.separator = list(self.config.separator_ids)
        else:
            self.separator = compat.separator_ids(vllm_config, self.config.separator)
            if not self.separator:
                raise ConfigError(f"blend_separator {self.config.separator!r} encodes to no "
                                  "tokens; give blend_separator_ids")
        self.num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self._jobs: list[BlendJob] = []
        logger.info("kvconnector blend: separator token ids %s", self.separator)

    def _state(self, st: RequestState) -> BlendRequest:
        if st.blend is None:
            req = st.request
            cfg = self.config.for_request(req.kv_transfer_params)
            docs = (documents(req.prompt_token_ids, self.separator, st.seed, self.chunk_size)
                    if cfg.enabled else [])
            if cfg.enabled and not docs:
                self.stats.add(blend_unsegmented=1)
            st.blend = BlendRequest(cfg, docs)
        return st.blend

    def match(self, st: RequestState, num_computed: int) -> BlendHit | str | None:
        """The blended range beyond vLLM's hit (documents from memory, disk, then Redis),
        PENDING while Redis is asked, or None when
        the request is not blended (prefix reuse serves it as usual)."""
        br = self._state(st)
        req = st.request
        if br.salted_at is not None and num_computed > br.salted_at and not br.blended:
            # Matched before, but vLLM could not schedule it then: its hit now reaches
            # blocks cached under its salted hashes, KV blended for a twin (the same
            # prompt, matched in the same step). Approximate: never stored as exact.
            br.blended = True
            st.skip_reason = BLENDED
            logger.debug("kvconnector blend: request %s reads blended KV from vLLM's prefix "
                         "cache", req.request_id)
            return None
        if not br.docs or br.blended or br.declined or req.num_output_tokens:
            return None
        bs = self.block_size
        end = (req.num_prompt_tokens - 1) // bs * bs
        if end <= num_computed:
            return None
        in_range = [i for i, d in enumerate(br.docs) if d.start < end and d.end > num_computed]
        found = {i: "memory" for i in in_range
                 if all(h in self.index for h in br.docs[i].pieces)}
        missing = [i for i in in_range if i not in found]
        if missing and self.disk is not None:
            on_disk = [i for i in missing if self.disk.count_prefix(
                [[ChunkKey(self.fingerprint, 0, h)] for h in br.docs[i].pieces])
                == len(br.docs[i].pieces)]
            found.update(dict.fromkeys(on_disk, "disk"))
            missing = [i for i in missing if i not in found]
        if missing and self.lookups is not None:
            in_redis = self._ask_redis(br, missing)
            if in_redis is None:
                return PENDING
            found.update(dict.fromkeys(in_redis, "redis"))
        reusable = sum(min(br.docs[i].end, end) - max(br.docs[i].start, num_computed)
                       for i in found)
        if reusable < br.config.min_tokens:
            return None
        share = compute_share(br.config, self.num_layers, req.num_prompt_tokens - num_computed,
                              reusable, len(found))
        if share > br.config.max_cost:
            br.declined = True
            self.stats.add(blend_declined=1)
            logger.debug("kvconnector blend: request %s served as usual: blending would cost "
                         "%.2f of full prefill (blend_max_cost %.2f)", req.request_id, share,
                         br.config.max_cost)
            return None
        # vLLM caches the blocks when it allocates them, before planning: salt them first.
        if br.salted_at is None:
            compat.mark_approximate(req, num_computed, bs, br.config.salt())
            br.salted_at = num_computed
        elif num_computed < br.salted_at:  # not scheduled then, and vLLM evicted blocks since
            compat.mark_approximate(req, num_computed, bs, br.config.salt(), br.salted_at)
            br.salted_at = num_computed
        return BlendHit(num_computed, end, found, any(t != "memory" for t in found.values()))

    def _ask_redis(self, br: BlendRequest, docs: list[int]) -> set[int] | None:
        """Documents (of ``docs``) whose every piece is in Redis; None while asking. One
        round trip for all of them."""
        assert self.lookups is not None
        keys: list[ChunkKey] = []
        spans: dict[int, tuple[int, int]] = {}
        for i in docs:
            spans[i] = (len(keys), len(keys) + len(br.docs[i].pieces))
            keys += [ChunkKey(self.fingerprint, 0, h) for h in br.docs[i].pieces]

        def interpret(found: list[bool]) -> set[int]:
            return {i for i, (a, b) in spans.items() if all(found[a:b])}

        br.lookup, answer = self.lookups.answer(br.lookup, tuple(docs), keys, interpret, set())
        return answer

    def plan(self, st: RequestState, hit: BlendHit, block_ids: list[int],
             num_tokens: int) -> dict[str, int]:
        """Plan the blend of the ``num_tokens`` vLLM accepted of ``hit``; how many of them
        come from each tier."""
        br = self._state(st)
        request = st.request
        end = hit.start + num_tokens
        docs = []
        for i in sorted(hit.found):
            doc = br.docs[i]
            pieces, promoted = [], []
            for h in doc.pieces:
                if h in self.index:
                    pieces.append(PieceLoad(h, self.index.use(h)))
                    continue
                slot = self.index.allocate(h) if hit.load_async else None
                if slot is None:  # evicted since the lookup, or no room: recomputed
                    break
                self.index.use(h)
                promoted.append(h)
                source = hit.found[i] if hit.found[i] != "memory" else (
                    "disk" if self.disk is not None else "redis")
                pieces.append(PieceLoad(h, slot, source))
            else:
                docs.append(DocLoad(doc.doc_hash, doc.start, doc.length, pieces))
                br.handled.add(i)
                continue
            for h in promoted:
                self.index.drop(h)
        cfg = br.config
        self._jobs.append(BlendJob(
            request.request_id, hit.start, end, list(request.prompt_token_ids[hit.start:end]),
            block_ids[:end // self.block_size], docs, cfg.strategy, cfg.recompute_ratio,
            cfg.check_layer, cfg.epic_tokens,
            list(request.prompt_token_ids[end:request.num_prompt_tokens]), hit.load_async,
            cfg.sink_tokens, cfg.refine_layer, cfg.refine_ratio, cfg.group_tokens))
        if hit.load_async:  # read on the worker's main thread once fetched: held until then
            self.fetches.hold(request.request_id, [p.slot for d in docs for p in d.pieces])
        br.blended = True
        st.skip_reason = BLENDED
        cap = piece_capacity(self.chunk_size)
        by_tier: dict[str, int] = {}
        for d in docs:
            for j, p in enumerate(d.pieces):
                if p.source != "memory":
                    by_tier[p.source] = by_tier.get(p.source, 0) + min(cap, d.length - j * cap)
        lower = sum(by_tier.values())
        if lower > num_tokens:  # pieces overlap what vLLM had: count no more than the hit
            by_tier = {t: n * num_tokens // lower for t, n in by_tier.items()}
        by_tier["memory"] = num_tokens - sum(by_tier.values())
        return by_tier

    def build(self, plan: StepPlan, scheduler_output: SchedulerOutput,
              states: dict[str, RequestState]) -> None:
        """This step's blends, and saves of the documents this step completes (the caller
        keeps the blocks they read until they are done, as for its own saves)."""
        plan.blends, self._jobs = self._jobs, []
        bs = self.block_size
        self._check_prefixes(plan.blends, scheduler_output)
        # A blend that fails leaves blocks this step's forward still reads: documents
        # computed in a blending step are saved from the request's next step on.
        blending = {j.req_id for j in plan.blends} | {t.req_id for t in plan.loads}
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            st = states.get(req_id)
            br = st.blend if st is not None else None
            if (st is None or br is None or len(br.handled) == len(br.docs)
                    or st.skip_reason not in (None, BLENDED) or req_id in blending):
                continue
            req = st.request
            done = min(req.num_computed_tokens + n_scheduled, req.num_prompt_tokens)
            block_ids: list[int] | None = None
            for i, doc in enumerate(br.docs):
                if i in br.handled or doc.end > done:
                    continue
                br.handled.add(i)
                todo = [(j, h) for j, h in enumerate(doc.pieces) if h not in self.index]
                if not todo:
                    continue
                if block_ids is None:
                    block_ids = compat.request_block_ids(scheduler_output, req_id)
                    if block_ids is None:
                        break
                pieces = []
                for j, h in todo:
                    slot = self.index.allocate(h)
                    if slot is None:
                        break
                    pieces.append((j, h, slot))
                if pieces:
                    plan.doc_saves.append(DocSave(
                        req_id, doc.doc_hash, doc.start, doc.length,
                        block_ids[doc.start // bs:-(-doc.end // bs)], pieces))

    def _check_prefixes(self, jobs: list[BlendJob], scheduler_output: SchedulerOutput) -> None:
        """Mark the blends that run before this step's forward pass but read blocks it
        computes. (A parked blend runs after a forward pass: its prefix is written by then.)"""
        sync = [j for j in jobs if not j.load_async and j.start]
        if not sync:
            return
        computed = compat.blocks_computed(scheduler_output, self.block_size)
        for job in sync:
            prefix = set(job.block_ids[:job.start // self.block_size])
            if any(prefix & ids for req_id, ids in computed.items() if req_id != job.req_id):
                job.prefix_unready = True
                logger.debug("kvconnector blend: request %s hit blocks another request "
                             "computes in this step; its range is recomputed", job.req_id)

    def outstanding(self) -> dict[str, int]:
        return {"blend_jobs": len(self._jobs)}
