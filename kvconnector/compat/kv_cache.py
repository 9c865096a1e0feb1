"""vLLM's KV cache as kvconnector stores it: the attention group, the page layout, the
keys' fingerprint and the size of a chunk."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvconnector.compat.engine import is_cpu_platform
from kvconnector.config import ConfigError, ConnectorConfig
from kvconnector.keys import Fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig


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
