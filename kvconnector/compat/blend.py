"""What blend needs of vLLM: the loaded model, the tokenizer, the CPU build's own KV write
and paged attention kernels, and what an engine must be to blend."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

from kvconnector.compat.kv_cache import cpu_isa
from kvconnector.config import ConfigError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec

logger = logging.getLogger("kvconnector.compat")


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
