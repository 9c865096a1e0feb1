"""Everything that depends on vLLM's version or platform lives here."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvconnector.config import ConfigError, ConnectorConfig
from kvconnector.keys import Fingerprint

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig
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


def mark_approximate(request: Request, first_token: int, block_size: int, salt: bytes) -> None:
    """Keep KV that full prefill did not compute (a blend) out of vLLM's prefix cache for
    requests that expect it exact. vLLM caches a request's blocks under
    ``request.block_hashes`` (computed when the request arrives, before the connector is
    asked): the hashes of the blocks from ``first_token`` on are replaced by salted ones,
    so vLLM caches those blocks under keys that no plain request computes, and the hashes
    of later blocks chain from them. Idempotent per salt only: call it once per request."""
    hashes = request.block_hashes
    for i in range(first_token // block_size, len(hashes)):
        hashes[i] = type(hashes[i])(hashlib.blake2b(salt + bytes(hashes[i]),
                                                    digest_size=32).digest())


def hit_source_labels() -> tuple[Any, Any]:
    """vLLM's labels for hits from (host memory, Redis). vLLM has no label for a remote
    store; it reports its own object-store tier as DISK, a storage tier behind memory."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return CacheHitSource.HOST, CacheHitSource.DISK


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def attention_group(kv_cache_config: KVCacheConfig) -> tuple[list[str], AttentionSpec]:
    """The single attention group kvconnector stores (layer names, spec)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ConfigError(
            f"kvconnector stores models whose KV cache is one attention group; this model "
            f"has {len(groups)} group(s) {kinds}")
    return list(groups[0].layer_names), groups[0].kv_cache_spec


def is_mla(spec: AttentionSpec) -> bool:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return isinstance(spec, MLAAttentionSpec)


def cpu_isa(vllm_config: VllmConfig, spec: AttentionSpec) -> str:
    """The instruction-set packing the CPU attention kernels use for K pages."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(vllm_config.model_config.dtype, spec.block_size, spec.head_size,
                         vllm_config.cache_config.cache_dtype)


def check_packing(spec: AttentionSpec) -> None:
    """Refuse KV caches whose bytes inside a page are ordered by the attention backend's
    own packing (the spec alone does not say how), or hold more than one token per row."""
    from kvconnector.layout import LayoutError

    tokens_per_state = getattr(spec, "tokens_per_state", 1)
    head_slots = getattr(spec, "num_head_slots", None)
    content_bytes = getattr(spec, "state_content_bytes", None)
    why = None
    if tokens_per_state != 1:
        why = f"compressed KV ({tokens_per_state} tokens per stored state)"
    elif head_slots is not None:
        why = (f"K and V packed as {head_slots} head slots (ROCm attention, B12X), whose "
               "order inside a page depends on the attention backend")
    elif content_bytes is not None:
        why = f"packed KV content ({content_bytes} bytes per token and head)"
    elif not is_mla(spec) and getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        why = f"K and V of different head sizes ({spec.head_size}, {spec.head_size_v})"
    if why:
        raise LayoutError(f"kvconnector cannot store this model's KV cache: {why}; use "
                          "another attention backend or KV cache dtype, or run without it")


def layout_kw(spec: AttentionSpec, on_cpu: bool) -> dict[str, Any]:
    """``layout.describe``'s arguments for the tensors vLLM registers for ``spec``."""
    check_packing(spec)
    mla = is_mla(spec)
    return {"num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size, "mla": mla,
            "cpu_pages": on_cpu and not mla}


def kv_layout_name(vllm_config: VllmConfig, spec: AttentionSpec) -> str:
    check_packing(spec)
    if is_mla(spec):
        return "mla"  # one latent per token, on every platform
    if is_cpu_platform():
        return f"cpu-pages-{cpu_isa(vllm_config, spec)}"
    return "chunk"


def _model_config_digest(vllm_config: VllmConfig) -> str:
    hf = vllm_config.model_config.hf_config.to_dict()
    hf.pop("_name_or_path", None)
    text = json.dumps(hf, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_SAMPLES = 32  # reads of WEIGHT_SAMPLE_BYTES spread over each weight file
WEIGHT_SAMPLE_BYTES = 4096


def _weight_files(model: str, revision: str | None) -> list[Path]:
    path = Path(model)
    if path.is_file():
        return [path]
    if not path.is_dir():  # a hub id: the snapshot vLLM downloaded, if it is cached here
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception:
            return []
    return sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def weights_digest(model: str, revision: str | None = None) -> str:
    """A digest of the model's weight files: names, sizes and ``WEIGHT_SAMPLES`` reads
    spread over each, so that other weights under the same path or hub id (a fine-tune
    written over the original) get other keys, at the cost of a few hundred small reads at
    start-up. A change to a few bytes can escape the samples: ``namespace`` is the way to
    keep such models apart. Empty when no weight file is found."""
    files = _weight_files(model, revision)
    if not files:
        return ""
    h = hashlib.blake2b(digest_size=8)
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size};".encode())
        with open(p, "rb") as f:
            for i in range(WEIGHT_SAMPLES):
                f.seek(max(0, size - WEIGHT_SAMPLE_BYTES) * i // (WEIGHT_SAMPLES - 1))
                h.update(f.read(WEIGHT_SAMPLE_BYTES))
    return h.hexdigest()


def fingerprint(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                config: ConnectorConfig) -> Fingerprint:
    layer_names, spec = attention_group(kv_cache_config)
    mc = vllm_config.model_config
    load_format = getattr(vllm_config.load_config, "load_format", "")
    return Fingerprint(
        model=str(mc.model),
        revision=str(mc.revision or ""),
        model_config_digest=_model_config_digest(vllm_config),
        dtype=str(spec.dtype).removeprefix("torch."),
        kv_layout=kv_layout_name(vllm_config, spec),
        block_size=spec.block_size,
        num_layers=len(layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        chunk_size=config.chunk_size,
        namespace=config.namespace,
        weights=("" if str(load_format) == "dummy"
                 else weights_digest(str(mc.model), mc.revision)),
        model_dtype=str(mc.dtype).removeprefix("torch."),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        quantization=str(mc.quantization or ""),
        load_format=str(load_format),
    )


def chunk_bytes(kv_cache_config: KVCacheConfig, config: ConnectorConfig) -> int:
    """Bytes of one chunk on one rank; the same number in both processes."""
    layer_names, spec = attention_group(kv_cache_config)
    blocks = config.chunk_size // spec.block_size
    return spec.real_page_size_bytes * len(layer_names) * blocks


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def uncacheable_reason(request: Request) -> str | None:
    """Why a request's KV must not be shared by token ids alone, if it must not."""
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


# ---- blend (kvconnector/blend/) ----
_LOADED_MODELS: list[tuple[weakref.ref, weakref.ref]] = []  # (model config, model)


def install_model_hook() -> None:
    """Record every model vLLM loads in this process, so blend can run its layers without
    users patching vLLM. Called by the ``vllm.general_plugins`` entry point, which vLLM runs
    in every process before it loads the model; idempotent."""
    try:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except ImportError:
        logger.warning("kvconnector: vLLM's BaseModelLoader moved; blend cannot find the model")
        return
    original = BaseModelLoader.load_model
    if getattr(original, "_kvconnector_hook", False):
        return

    def load_model(self, vllm_config, model_config, *args, **kwargs):
        model = original(self, vllm_config, model_config, *args, **kwargs)
        _LOADED_MODELS.append((weakref.ref(model_config), weakref.ref(model)))
        return model

    load_model._kvconnector_hook = True  # type: ignore[attr-defined]
    BaseModelLoader.load_model = load_model  # type: ignore[method-assign]


def loaded_model(vllm_config: VllmConfig) -> torch.nn.Module:
    """The model this worker loaded for ``vllm_config`` (recorded by ``install_model_hook``)."""
    from kvconnector.blend.families import BlendUnsupported

    alive = [(c(), m()) for c, m in _LOADED_MODELS]
    alive = [(c, m) for c, m in alive if m is not None]
    mine = [m for c, m in alive if c is vllm_config.model_config]
    if len(mine) == 1:
        return mine[0]
    if not alive:
        raise BlendUnsupported(
            "blend needs the model object, which kvconnector's vLLM plugin records when vLLM "
            "loads the model, and it recorded none in this process: install kvconnector in "
            "vLLM's environment (pip install -e .), keep it allowed in VLLM_PLUGINS, and use "
            "a model loader built on vLLM's BaseModelLoader.load_model")
    raise BlendUnsupported(f"blend found {len(alive)} loaded models and none (or several) "
                           "for this engine's model config")


def blend_unsupported_reason(vllm_config: VllmConfig) -> str | None:
    """Why this engine cannot blend at all (the model itself is checked by the worker)."""
    from kvconnector.blend.families import supported_architectures

    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size > 1:
        return f"tensor parallelism (TP={pc.tensor_parallel_size}) is not supported yet"
    if pc.pipeline_parallel_size > 1:
        return f"pipeline parallelism (PP={pc.pipeline_parallel_size}) is not supported"
    if vllm_config.lora_config is not None:
        return "LoRA is enabled (blend replays the base model's layers)"
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", str(vllm_config.model_config.dtype).removeprefix("torch.")):
        return f"the KV cache dtype {cache_dtype} differs from the model dtype"
    archs = list(getattr(vllm_config.model_config.hf_config, "architectures", None) or [])
    if archs and not set(archs) & supported_architectures():
        return (f"model architecture {archs[0]} is not a family blend supports "
                f"({', '.join(sorted(supported_architectures()))})")
    return None


def separator_ids(vllm_config: VllmConfig, text: str) -> list[int]:
    """The blend separator ``text`` as the model's tokenizer writes it inside prompts."""
    from vllm.tokenizers import cached_tokenizer_from_config

    from kvconnector.blend.segments import separator_ids as ids_in_prompts

    tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    if tokenizer is None:
        raise ConfigError("blend_separator needs the tokenizer, which this engine does not "
                          "load (skip_tokenizer_init); give blend_separator_ids instead")
    return ids_in_prompts(tokenizer, text)


def cpu_kv_writer(vllm_config: VllmConfig, spec: AttentionSpec):
    """vLLM's own CPU cache write (the attention backend's), for probing the page packing:
    ``write(key [T, H, D], value [T, H, D], kv_cache [B, H, block, 2D], slot_mapping)``."""
    from vllm import _custom_ops as ops

    isa = cpu_isa(vllm_config, spec)

    def write(key, value, kv_cache, slot_mapping) -> None:
        b, h, n, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(b, h, 2 * n, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa)

    return write


def cpu_paged_attention(vllm_config: VllmConfig, spec: AttentionSpec):
    """vLLM's own CPU attention kernel over a request's paged K/V, for queries at any
    ascending positions: ``attend(q [A, Hq, D], kv_layer, block_table [blocks] int32,
    q_pos [A], scale, window) -> [A, Hq * D]``. Each run of consecutive positions is one
    sequence whose last tokens are the queries (causal, as in a chunked prefill)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm import envs

    isa = cpu_isa(vllm_config, spec)

    def attend(q, kv_layer, block_table, q_pos, scale: float, window: int | None):
        a, hq, d = q.shape
        b, h, n, _ = kv_layer.shape
        key_cache, value_cache = kv_layer.view(b, h, 2 * n, -1).chunk(2, dim=2)
        breaks = (torch.nonzero(q_pos[1:] != q_pos[:-1] + 1).squeeze(1) + 1).tolist()
        starts, ends = [0, *breaks], [*breaks, a]
        query_start_loc = torch.tensor([*starts, a], dtype=torch.int32)
        seq_lens = (q_pos[torch.tensor(ends) - 1] + 1).to(torch.int32)
        table = block_table[None].expand(len(starts), -1).contiguous()
        sliding = -1 if window is None else window
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(starts), num_heads=hq, num_kv_heads=h, head_dim=d,
            seq_lens=seq_lens, dtype=q.dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=sliding, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q.contiguous(), key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True,
            alibi_slopes=None, sliding_window=sliding, block_table=table, softcap=0,
            scheduler_metadata=meta, s_aux=None)
        return out.reshape(a, hq * d)

    return attend
