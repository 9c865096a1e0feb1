"""Scheduler half: what the store holds of each request, and which chunks move this step.

Each request has one ``RequestState``. A match (``PrefixReuse.match`` or, with blend on,
``BlendScheduler.match`` first) returns the hit offered to vLLM; once vLLM allocates the
request's blocks, the same part plans the loads (or the blend) from that hit.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from kvconnector import compat
from kvconnector.blend.request import BlendHit
from kvconnector.blend.scheduler import BlendScheduler
from kvconnector.config import ConnectorConfig
from kvconnector.events import DISK, MEMORY, TierEvents
from kvconnector.fetches import Fetches
from kvconnector.keys import ChunkKey, request_seed, reset_seed
from kvconnector.lookups import Lookups
from kvconnector.metadata import IDLE_WAIT_S, ChunkTransfer, StepPlan, WorkerReport
from kvconnector.metrics import StoreTap
from kvconnector.prefix import MISSING_SLOT, PrefixReuse
from kvconnector.request_state import PENDING, PrefixHit, RequestState
from kvconnector.saves import SavePlanner
from kvconnector.stats import TransferStats
from kvconnector.store import MemoryIndex, open_mirror, open_redis
from kvconnector.store.disk_catalog import DiskCatalog

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvconnector.scheduler")


class SchedulerHalf:
    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig) -> None:
        layer_names, spec = compat.attention_group(kv_cache_config)
        config.check_block_size(spec.block_size)
        self.config = config
        self.block_size = spec.block_size
        # The keys' fingerprint part (the workers compute the same one); chunk hashes chain
        # from ``_seed``, which a cache reset replaces.
        self.fingerprint = compat.fingerprint(vllm_config, kv_cache_config, config).digest()
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._seed = self.fingerprint
        # KV events for routers, when vLLM publishes them (events.py).
        self.events = (TierEvents(self.block_size, config.chunk_size,
                                  (MEMORY, DISK) if config.disk_path else (MEMORY,))
                       if compat.kv_events_enabled(vllm_config) else None)
        self.index = MemoryIndex(
            config.memory_slots(compat.chunk_bytes(kv_cache_config, config)),
            on_forget=(lambda h: self.events.removed(MEMORY, h)) if self.events else None)
        self.redis = open_redis(config, for_lookups=True)
        self.lookups = (Lookups(self.redis, config.redis_lookup_budget_ms / 1000,
                                open_mirror(config, self.redis, self.fingerprint))
                        if self.redis is not None else None)
        self.disk = DiskCatalog(config.disk_path) if config.disk_path else None
        self.fetches = Fetches(self.index)
        self.stats = TransferStats()
        self.prefix = PrefixReuse(config, self.block_size, self.fingerprint,
                                  self.tp_size, self.index, self.fetches, self.lookups, self.disk,
                                  compat.chunk_bytes(kv_cache_config, config),
                                  by_layer=compat.is_cpu_platform() and config.by_layer(
                                      len(layer_names)))
        self.saves = SavePlanner(config, self.block_size, self.index, self.events)
        self.blend = (BlendScheduler(config, vllm_config, self.block_size, self.fingerprint,
                                     self.index, self.fetches, self.lookups, self.stats,
                                     self.disk)
                      if config.blending.enabled else None)
        self._requests: dict[str, RequestState] = {}
        self._loads: list[ChunkTransfer] = []
        # vLLM block hashes of blocks this step loads from a tier that can fail (disk,
        # Redis, a chunk gone since the lookup), and of the loading request's blocks after.
        self._fallible: set[Any] = set()
        self._async_loads: list[ChunkTransfer] = []
        self._finished_saves: list[ChunkTransfer] = []  # planned at request_finished
        self._evictions_reported = 0
        self._redis_tap = StoreTap()
        self._slots_reported: int | None = None
        self.resumed_requests = 0  # preempted requests seen coming back
        self.kv_cache_manager: Any = None  # vLLM's, bound after start-up (bind_kv_cache_manager)

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

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the store holds beyond vLLM's own hit, and whether they load
        asynchronously; ``None`` (ask again next step) while Redis is asked."""
        st = self._state(request)
        st.offer = None
        if self._fallible and compat.hit_reaches(request, num_computed_tokens, self.block_size,
                                                 self._fallible):
            # vLLM caches blocks when it hands them out, and under "recompute" lets every
            # request that shares a block whose load failed count on the request that
            # recomputes it; a request aborted, preempted or capped by
            # long_prefill_token_threshold never or not yet has. Asked again next step,
            # the blocks are either loaded or out of vLLM's prefix cache.
            return None, False
        if st.skip_reason:
            return 0, False
        hit = self._match(st, num_computed_tokens)
        if hit == PENDING and self.lookups is not None and len(self._requests) == 1:
            # No other request in the engine: waiting for Redis here delays nobody, and
            # saves the idle step vLLM would spin before asking again.
            self.lookups.wait(IDLE_WAIT_S)
            hit = self._match(st, num_computed_tokens)
        if hit == PENDING:
            return None, False
        if hit is None or isinstance(hit, str):
            return 0, False
        st.offer = hit
        return hit.tokens, hit.load_async

    def _match(self, st: RequestState,
               num_computed_tokens: int) -> PrefixHit | BlendHit | str | None:
        hit = None
        if self.blend is not None and st.load_limit is None:
            hit = self.blend.match(st, num_computed_tokens)
        if hit is None and not st.skip_reason:  # blend may find the request approximate
            hit = self.prefix.match(st, num_computed_tokens, alone=len(self._requests) == 1)
        return hit

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None or st.offer is None:
            return
        hit, st.offer = st.offer, None
        if num_external_tokens == 0:
            return
        block_ids = blocks.get_block_ids()[0]
        if isinstance(hit, BlendHit):
            assert self.blend is not None
            by_tier = self.blend.plan(st, hit, block_ids, num_external_tokens)
        else:
            loads, by_tier = self.prefix.plan_loads(st, hit, block_ids, num_external_tokens)
            (self._async_loads if hit.load_async else self._loads).extend(loads)
            first = next((t.index for t in loads if not hit.load_async and (
                t.source != "memory" or t.slot == MISSING_SLOT)), None)
            if first is not None:
                self._fallible.update(compat.block_hashes(
                    request, first * self.config.chunk_size // self.block_size))
        st.hit_split = by_tier
        self.stats.add(hit_tokens=num_external_tokens,
                       **{f"hit_tokens.{tier}": n for tier, n in by_tier.items() if n})

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's per-tier count of a hit: host memory, disk or Redis."""
        st = self._requests.get(request.request_id)
        split = st.hit_split if st is not None else None
        if st is not None:
            st.hit_split = None
        if split is None:
            split = {"memory": num_external_tokens}
        labels = compat.hit_source_labels()
        out: dict[Any, int] = {}
        for tier, n in split.items():
            if n:
                out[labels[tier]] = out.get(labels[tier], 0) + n
        return out

    def build_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        idle = scheduler_output.total_num_scheduled_tokens == 0
        plan = StepPlan(loads=self._loads, async_loads=self._async_loads,
                        fence=self.saves.fence(scheduler_output),
                        finished_saves=self._finished_saves, idle=idle)
        self._loads, self._async_loads, self._finished_saves = [], [], []
        self._fallible.clear()
        if self.blend is not None:
            self.blend.build(plan, scheduler_output, self._requests)
            for save in plan.doc_saves:  # blocks handed out again wait for the document save
                self.saves.read_by(save.req_id, save.block_ids)
        self.resumed_requests += len(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        # A load that fails still has this step's forward pass read the blocks it left
        # unfilled before vLLM recomputes them: what a loading request computes in its
        # loading step is saved from its next step (or its finish) on, once that load is
        # known to have worked.
        self.saves.plan_step(scheduler_output, self._requests,
                             {t.req_id for t in plan.loads}, plan.saves)
        self.index.unpin_all()
        if idle and self.lookups is not None:  # nothing runs: let Redis answer meanwhile
            self.lookups.wait(IDLE_WAIT_S)
        return plan

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if output.invalid_block_ids:
            evicted = compat.evict_failed_blocks(self.kv_cache_manager, self._requests,
                                                 output.invalid_block_ids)
            logger.debug("kvconnector: %d blocks out of vLLM's prefix cache after failed "
                         "loads", len(evicted))
        report = output.kv_connector_worker_meta
        if isinstance(report, WorkerReport):
            for h in report.bad_chunks:
                self.index.drop(h)
            if self.lookups is not None and self.lookups.mirror is not None and report.bad_chunks:
                self.lookups.forget([ChunkKey(self.fingerprint, r, h)
                                     for h in report.bad_chunks for r in range(self.tp_size)])
            if self.events is not None:
                for h in report.disk_removed:
                    self.events.removed(DISK, h)
            for req_id, index in report.failed_loads.items():
                st = self._requests.get(req_id)
                if st is not None:
                    st.load_limit = min(index, st.load_limit if st.load_limit is not None
                                        else index)
        # Promoted chunks may be planned for reading again; parked blends' slots released.
        self.fetches.received(output.finished_recving or ())

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Finished or aborted: its blocks go back to vLLM at once, as without a connector
        (so ``reset_prefix_cache`` succeeds right after a request). Saves still queued on
        them are fenced when vLLM hands those blocks out again (``build_meta``).

        A request that finished with output also saves the full blocks after its last full
        chunk. vLLM calls this after the step's plan was built, so that save goes into the
        next plan's ``finished_saves``, which the workers queue before that step writes any
        KV; its blocks are fenced like every other save."""
        st = self._requests.pop(request.request_id, None)
        if st is not None and not st.skip_reason:
            self.saves.plan_finish(st, request, block_ids, self._finished_saves)
        return False, None

    def take_events(self) -> list[Any]:
        return self.events.take() if self.events is not None else []

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
        may hold different weights; sharing between them would serve wrong KV. Planned
        blends still run: the slots of parked ones stay held until they are received.
        """
        self._seed = reset_seed(self.fingerprint, secrets.token_bytes(16))
        forgotten = len(self.index)
        self.index.clear()
        self._finished_saves.clear()  # their slots are free again
        for req_id, st in list(self._requests.items()):
            if st.request.num_computed_tokens == 0:
                del self._requests[req_id]  # starts afresh under the new seed
            else:
                st.offer = None
                if not st.skip_reason:
                    st.skip_reason = "computed before a cache reset"
        logger.info("kvconnector: cache reset, %d stored chunks forgotten", forgotten)

    def shutdown(self) -> None:
        if self.lookups is not None:
            self.lookups.shutdown()
        if self.redis is not None:
            self.redis.close()

    def outstanding(self) -> dict[str, int]:
        """Per-request state still held; all zero once every request has finished."""
        out = {"requests": len(self._requests),
               "offers": sum(st.offer is not None for st in self._requests.values()),
               "planned_loads": len(self._loads) + len(self._async_loads),
               "planned_finished_saves": len(self._finished_saves),
               "pinned_slots": self.index.pinned, **self.fetches.outstanding()}
        if self.blend is not None:
            out.update(self.blend.outstanding())
        return out

    def take_stats(self) -> TransferStats | None:
        new_evictions = self.index.evictions - self._evictions_reported
        if new_evictions:
            self.stats.add(evictions=new_evictions)
            self._evictions_reported = self.index.evictions
        if redis_counts := self._redis_tap.counts(self.redis):
            self.stats.add(**redis_counts)
        if len(self.index) != self._slots_reported:
            self._slots_reported = len(self.index)
            self.stats.set_gauges(memory_slots_used=len(self.index),
                                  memory_slots=self.index.num_slots)
        if self.stats.is_empty():
            return None
        # The parts hold this object: hand over its contents, not the object.
        out = TransferStats(self.stats.data)
        self.stats.reset()
        return out
