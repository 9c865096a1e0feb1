"""The vLLM hook: a ``KVConnectorBase_V1`` that routes each call to the half for its process."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvconnector import compat
from kvconnector.config import ConnectorConfig
from kvconnector.metadata import StepPlan
from kvconnector.scheduler import SchedulerHalf
from kvconnector.stats import TransferStats
from kvconnector.worker import WorkerHalf

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvconnector")
T = TypeVar("T")


def _timed(hook: Callable[..., T]) -> Callable[..., T]:
    """Adds the hook's time to the connector's phase timers (``phase_seconds`` on
    ``/metrics``): what kvconnector costs on vLLM's own thread, hook by hook."""
    name = hook.__name__

    @functools.wraps(hook)
    def timed(self: KVConnector, *args: Any, **kwargs: Any) -> T:
        start = time.perf_counter()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - start

    return timed


def _log_like_vllm() -> None:
    """Send our records wherever vLLM sends its own, at vLLM's level."""
    vllm_logger = logging.getLogger("vllm")
    if logger.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        logger.addHandler(handler)
    logger.setLevel(vllm_logger.getEffectiveLevel())
    logger.propagate = False


class KVConnector(KVConnectorBase_V1):
    """Stores full chunks of computed KV in host memory and loads shared prefixes back.

    Not ``SupportsHMA``: vLLM then runs without its hybrid KV cache manager, so every layer
    shares one block table and one chunk can carry all layers.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        _log_like_vllm()
        compat.check_vllm_version()
        compat.check_sleep_mode(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = ConnectorConfig.from_extra_config(compat.extra_config(vllm_config))
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._phases: dict[str, float] = {}  # hook -> seconds since the last stats
        self._phases_sent = 0.0
        if role == KVConnectorRole.SCHEDULER:
            compat.recompute_failed_loads(vllm_config)
            self._scheduler = SchedulerHalf(self.config, vllm_config, kv_cache_config)
        else:
            self._worker = WorkerHalf(self.config, vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a later miss

    @property
    def supports_sleep_mode(self) -> bool:
        return False  # read by vLLM 0.33; enable_sleep_mode is refused at start-up

    @property
    def worker(self) -> WorkerHalf:
        assert self._worker is not None, "worker-side call on the scheduler connector"
        return self._worker

    @property
    def scheduler(self) -> SchedulerHalf:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    @_timed
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, StepPlan)
        self.worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, StepPlan):
            self._worker.forward_began(connector_metadata)

    @_timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan.loads:
            self.worker.load(plan)
        if plan.async_loads:
            self.worker.start_async_loads(plan)
        if plan.blends:
            self.worker.blend.start(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        loads = self.worker.layer_loads
        if loads is not None:
            loads.wait(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # every layer of a chunk is copied at once in wait_for_save

    @_timed
    def wait_for_save(self) -> None:
        self.worker.write_gate.clear()
        self.worker.finish_layer_loads()
        plan = self._plan()
        if plan.saves:
            self.worker.save(plan.saves)
        if plan.doc_saves:
            self.worker.blend.save_docs(plan)

    @_timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        idle = self.has_connector_metadata() and self._plan().idle
        return None, self.worker.finished_loading(idle) or None

    def _plan(self) -> StepPlan:
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan)
        return plan

    @_timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        self.worker.finish_layer_loads()
        return self.worker.take_load_errors()

    @_timed
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The counters since the last call. A fault while gathering them costs this
        report, never the engine: vLLM calls this on its scheduler's and workers' steps."""
        half = self._worker or self._scheduler
        assert half is not None
        try:
            stats = half.take_stats()
            now = time.monotonic()
            # Phases ride along with other stats, or alone at most 4 times a second: a step
            # with nothing else to say sends vLLM nothing.
            if self._phases and (stats is not None or now - self._phases_sent >= 0.25):
                stats = stats if stats is not None else TransferStats()
                stats.add(**{f"phase_seconds.{k}": v for k, v in self._phases.items()})
                self._phases, self._phases_sent = {}, now
            return stats
        except Exception:
            logger.exception("kvconnector: gathering transfer stats failed; skipped")
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return TransferStats(data) if data is not None else TransferStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics:
        from kvconnector.metrics import PromMetrics

        return PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ----
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    @_timed
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @_timed
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[Any, int]:
        return self.scheduler.hit_sources(request, num_external_tokens)

    @_timed
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    @_timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    @_timed
    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tiers' KV events (events.py), when vLLM publishes KV events."""
        return self.scheduler.take_events()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_saves()

    def reset_cache(self) -> bool:
        self.scheduler.reset()
        return True
