"""vLLM's version, its engine settings, and what its requests and scheduler outputs hold."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvconnector.config import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvconnector.compat")


# vLLM minor versions kvconnector runs on: 0.32 is tested here (CPU build); 0.33's sources
# passed the tests over the 0.32 build. docs/configuration.md has the table.
SUPPORTED_VLLM = ((0, 32), (0, 33))


ALLOW_UNTESTED_ENV = "KVCONNECTOR_ALLOW_UNTESTED_VLLM"


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is not one kvconnector was built and tested for."""


def check_vllm_version(version: str | None = None) -> None:
    """Refuse to start on a vLLM minor version outside ``SUPPORTED_VLLM``, with a message
    saying what to do; ``KVCONNECTOR_ALLOW_UNTESTED_VLLM=1`` turns that into a warning."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        import vllm

        version = vllm.__version__
    supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)
    try:
        minor = Version(version).release[:2]
    except InvalidVersion:
        logger.warning("kvconnector: cannot tell which vLLM this is (version %r); it is "
                       "built for vLLM %s", version, supported)
        return
    if minor in SUPPORTED_VLLM:
        return
    message = (f"kvconnector supports vLLM {supported}, but vLLM {version} is installed: "
               f"install a supported vLLM or a kvconnector release made for this one "
               f"(set {ALLOW_UNTESTED_ENV}=1 to try it anyway)")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        logger.warning("%s; going on because %s=1", message, ALLOW_UNTESTED_ENV)
        return
    raise UnsupportedVLLM(message)


def check_sleep_mode(vllm_config: VllmConfig) -> None:
    """Sleep mode frees the KV cache under saves still copying out of it, and vLLM 0.32
    gives connectors no hook to finish them first: refuse it at start-up."""
    model_config = vllm_config.model_config
    if model_config is not None and getattr(model_config, "enable_sleep_mode", False):
        raise ConfigError(
            "kvconnector does not support vLLM's sleep mode (enable_sleep_mode): sleep "
            "frees the KV cache while the connector may still be copying out of it. Start "
            "the engine without --enable-sleep-mode. A cache reset "
            "(reset_prefix_cache(reset_connector=True)) is what a weight update needs.")


def recompute_failed_loads(vllm_config: VllmConfig) -> None:
    """A cache must never fail a request, and a load can always fail: Redis keys anyone
    can plant, a value damaged or expired after the lookup, a chunk evicted between the
    lookup and the load. vLLM's default ``kv_load_failure_policy`` ("fail") would fail
    those requests, so the scheduler runs kvconnector with "recompute" whatever was asked.
    vLLM 0.32/0.33 build the scheduler's connector before they read the policy."""
    kv = vllm_config.kv_transfer_config
    if kv is None or kv.kv_load_failure_policy == "recompute":
        return
    logger.warning(
        "kvconnector: kv_load_failure_policy=%r would fail a request whenever a stored "
        "chunk cannot be loaded (damaged, evicted or expired after the lookup, or a key "
        "planted in a shared Redis); kvconnector runs with \"recompute\" instead: such "
        "chunks are recomputed. Set \"kv_load_failure_policy\": \"recompute\" to silence "
        "this.", kv.kv_load_failure_policy)
    kv.kv_load_failure_policy = "recompute"


def block_hashes(request: Request, first_block: int) -> list[Any]:
    """vLLM's hashes of a request's full blocks from ``first_block`` on: the keys vLLM
    caches them under."""
    return list(request.block_hashes[first_block:])


def hit_reaches(request: Request, num_computed_tokens: int, block_size: int,
                hashes: set[Any]) -> bool:
    """Whether vLLM's own prefix-cache hit of ``num_computed_tokens`` holds a block cached
    under one of ``hashes``."""
    return any(h in hashes for h in request.block_hashes[:num_computed_tokens // block_size])


def evict_failed_blocks(kv_cache_manager: Any, req_ids: Iterable[str],
                        failed: set[int]) -> set[int]:
    """Take blocks whose load failed out of vLLM's prefix cache, with every later block of
    each request holding one (computed over them). Under "recompute" vLLM 0.32 keeps them
    cached for the request that will recompute them; until it has, a request that hits them
    reads KV that was never written: after that request is aborted or preempted (any
    configuration), or beside its prefill capped by ``long_prefill_token_threshold``. The
    requests keep their blocks and recompute into them. Returns the blocks evicted; none
    where vLLM bound no cache manager to the connector (``bind_kv_cache_manager``)."""
    if kv_cache_manager is None or not failed:
        return set()
    evict = set(failed)
    for req_id in req_ids:
        groups = kv_cache_manager.get_block_ids(req_id)
        ids = list(groups[0]) if groups else []
        first = next((i for i, b in enumerate(ids) if b in failed), None)
        if first is not None:
            evict.update(ids[first:])
    kv_cache_manager.evict_blocks(evict)
    return evict


def mark_approximate(request: Request, first_token: int, block_size: int, salt: bytes,
                     end_token: int | None = None) -> None:
    """Keep KV that full prefill did not compute (a blend) out of vLLM's prefix cache for
    requests that expect it exact. vLLM caches a request's blocks under
    ``request.block_hashes`` (computed when the request arrives, before the connector is
    asked): the hashes of the blocks from ``first_token`` on are replaced by salted ones,
    so vLLM caches those blocks under keys that no plain request computes, and the hashes
    of later blocks chain from them. Each block is salted on its own, so salting
    ``[a, b)`` after ``[b, end)`` equals salting ``[a, end)``; a block must be salted once.
    ``end_token``: salt the blocks before it only."""
    hashes = request.block_hashes
    end = len(hashes) if end_token is None else end_token // block_size
    for i in range(first_token // block_size, end):
        hashes[i] = type(hashes[i])(hashlib.blake2b(salt + bytes(hashes[i]),
                                                    digest_size=32).digest())


def hit_source_labels() -> dict[str, Any]:
    """vLLM's labels for hits from each tier. vLLM has no label for a remote store: Redis
    is its "external" source (``EXTERNAL_UNSPECIFIED``: "uninstrumented connector or
    remote store")."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return {"memory": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
            "redis": CacheHitSource.EXTERNAL_UNSPECIFIED}


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def spare_cores(vllm_config: VllmConfig) -> set[int]:
    """Cores a CPU worker may use beside those vLLM bound its compute threads to: the ones
    it reserves for its engine-core process (the worker's parent) and KV transfers
    (``VLLM_CPU_NUM_OF_RESERVED_CPU``). Empty unless this worker is its engine's only one:
    other ranks compute on the rest."""
    parallel = vllm_config.parallel_config
    if parallel.world_size * parallel.data_parallel_size > 1 or \
            not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        return os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0)
    except OSError:  # the parent is gone or out of reach: no spare cores known
        return set()


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


# ``kv_transfer_params`` key: ``false`` keeps a request out of kvconnector's tiers.
OPT_OUT_KEY = "kvconnector"


def uncacheable_reason(request: Request) -> str | None:
    """Why a request's KV must not be shared by token ids alone, if it must not, or why it
    asked to stay out of the cache (``kv_transfer_params``: ``{"kvconnector": false}``:
    nothing of it is looked up or stored)."""
    params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, dict) and OPT_OUT_KEY in params:
        if params[OPT_OUT_KEY] is False:
            return "kv_transfer_params: kvconnector false"
        if params[OPT_OUT_KEY] is not True:
            logger.warning("kvconnector: ignoring kv_transfer_params %s=%r of request %s: "
                           "expected true or false", OPT_OUT_KEY, params[OPT_OUT_KEY],
                           request.request_id)
    if request.lora_request is not None:
        return "LoRA adapter"
    if request.mm_features:
        return "multimodal input"
    if request.prompt_embeds is not None:
        return "prompt embeddings"
    if getattr(request, "pooling_params", None) is not None:
        return "pooling request"
    return None


def kv_complete_tokens(request: Request) -> int:
    """Leading tokens of a finished request whose KV its blocks hold: 0 unless it finished
    with output (an abort can come while its KV is still being loaded or computed)."""
    from vllm.v1.request import RequestStatus

    normal = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
              getattr(RequestStatus, "FINISHED_REPETITION", RequestStatus.FINISHED_STOPPED)}
    if request.status not in normal or request.num_output_tokens == 0:
        return 0
    # Tokens of a step still in flight (async scheduling) are counted but not computed yet.
    return max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))


def request_block_ids(scheduler_output: SchedulerOutput, req_id: str) -> list[int] | None:
    """Scheduler block ids of a request scheduled in this step (the one attention group)."""
    state = scheduler_output.kv_connector_block_state
    if state is None:
        return None
    groups = state.get_block_ids(req_id)
    return list(groups[0]) if groups else None


def blocks_computed(scheduler_output: SchedulerOutput, block_size: int) -> dict[str, set[int]]:
    """Per request scheduled in this step, the blocks its forward pass writes KV into.
    vLLM caches a full block when it allocates it, so another request of the same step may
    already hold such a block as part of its prefix-cache hit."""
    before = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    out: dict[str, set[int]] = {}
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        ids = request_block_ids(scheduler_output, req_id)
        start = before.get(req_id)
        if ids is not None and start is not None:
            out[req_id] = set(ids[start // block_size:-(-(start + n) // block_size)])
    return out


def blocks_handed_out(scheduler_output: SchedulerOutput) -> set[int]:
    """Block ids this step may write KV into: blocks of requests scheduled new or resumed,
    blocks added to running requests, blocks vLLM zeroes or copies into."""
    ids: set[int] = set()
    for new in scheduler_output.scheduled_new_reqs:
        if new.block_ids:
            ids.update(new.block_ids[0])
    for groups in scheduler_output.scheduled_cached_reqs.new_block_ids:
        if groups:
            ids.update(groups[0])
    ids.update(scheduler_output.new_block_ids_to_zero or ())
    ids.update(c.dst_block_id for c in scheduler_output.kv_cache_block_copies or ())
    return ids


def extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
