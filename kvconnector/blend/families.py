"""The model families blend can run: their decoder layers, step by step, over vLLM's own
modules (so weights, quantization, dtypes and kernels are exactly vLLM's).

A family is accepted only if its decoder layer and attention ``forward`` are the very
functions this module replays (Llama, Mistral, Qwen2 in vLLM 0.32), so a model that changes
the computation in a subclass is refused at start-up rather than blended wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvconnector.blend.rope import ReRotator, RopeUnsupported


class BlendUnsupported(ValueError):
    """The model (or engine setting) cannot be blended; the message says why."""

    @classmethod
    def refusing(cls, reason: object) -> BlendUnsupported:
        """The error that ends an engine's start: what it cannot do, and the way out."""
        return cls(f"kvconnector: blend is on but cannot serve this engine: {reason}. "
                   "Set blend to false to serve it with prefix reuse only.")


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None


class BlendLayer:
    """One decoder layer: ``norm_in`` -> ``qkv`` -> (attention, done by the caller) -> ``post``."""

    def __init__(self, layer: torch.nn.Module, qk_norm: bool) -> None:
        self.layer = layer
        self.attn = layer.self_attn
        self.qk_norm = qk_norm

    def norm_in(self, h: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.layer.input_layernorm(h), h
        return self.layer.input_layernorm(h, residual)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``."""
        a = self.attn
        qkv, _ = a.qkv_proj(x)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        t = x.shape[0]
        if self.qk_norm:  # Qwen2 variants normalise each head before RoPE
            q = a.q_norm(q.reshape(t, a.num_heads, a.head_dim)).reshape(t, a.q_size)
            k = a.k_norm(k.reshape(t, a.num_kv_heads, a.head_dim)).reshape(t, a.kv_size)
        q, k = a.rotary_emb(positions, q, k)
        return (q.reshape(t, a.num_heads, a.head_dim), k.reshape(t, a.num_kv_heads, a.head_dim),
                v.reshape(t, a.num_kv_heads, a.head_dim))

    def post(self, attn_out: torch.Tensor, residual: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = self.attn.o_proj(attn_out)
        h, residual = self.layer.post_attention_layernorm(out, residual)
        return self.layer.mlp(h), residual


@dataclass
class BlendModel:
    family: str
    embed: Callable[[torch.Tensor], torch.Tensor]
    layers: list[BlendLayer]
    geometry: Geometry
    rotator: ReRotator
    device: torch.device
    dtype: torch.dtype


ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def supported_architectures() -> set[str]:
    return set(ARCHITECTURES)


def _families() -> dict[str, tuple[tuple[Callable, ...], tuple[Callable, ...]]]:
    """Architecture -> (decoder layer forwards, attention forwards) this module replays."""
    from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer
    from vllm.model_executor.models.mistral import MistralAttention, MistralDecoderLayer
    from vllm.model_executor.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer

    return dict(zip(ARCHITECTURES, (
        ((LlamaDecoderLayer.forward,), (LlamaAttention.forward,)),
        ((MistralDecoderLayer.forward,), (MistralAttention.forward,)),
        ((Qwen2DecoderLayer.forward,), (Qwen2Attention.forward,))), strict=True))


def adapt(model: torch.nn.Module, dtype: torch.dtype) -> BlendModel:
    """The blendable view of a loaded vLLM model, or ``BlendUnsupported`` naming why not."""
    arch = type(model).__name__
    families = _families()
    if arch not in families:
        raise BlendUnsupported(
            f"model architecture {arch} is not a family blend supports "
            f"({', '.join(sorted(families))})")
    layer_fwds, attn_fwds = families[arch]
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", []))
    if not layers or not hasattr(inner, "embed_tokens"):
        raise BlendUnsupported(f"{arch}: no decoder layers or embeddings found")
    first = layers[0]
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if type(layer).forward not in layer_fwds or type(attn).forward not in attn_fwds:
            raise BlendUnsupported(f"{arch} layer {i} ({type(layer).__name__}) computes "
                                   "differently from the family blend replays")
        if getattr(attn, "do_llama_4_scaling", False):
            raise BlendUnsupported(f"{arch}: llama_4_scaling (position-dependent query "
                                   "scaling) is not supported")
        if getattr(layer, "ada_rms_norm_t_cond", None) is not None:
            raise BlendUnsupported(f"{arch}: ada_rms_norm_t_cond is not supported")
        if getattr(attn, "dual_chunk_attention_config", None):
            raise BlendUnsupported(f"{arch}: dual-chunk attention is not supported")
    a = first.self_attn
    from vllm.v1.attention.backend import AttentionType

    if getattr(a.attn, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
        raise BlendUnsupported(f"{arch}: only causal decoder attention can be blended")
    windows = {getattr(layer.self_attn.attn, "sliding_window", None) for layer in layers}
    if len(windows) > 1:
        raise BlendUnsupported(f"{arch}: layers with different sliding windows {windows}")
    try:
        rotator = ReRotator(a.rotary_emb)
    except RopeUnsupported as e:
        raise BlendUnsupported(f"{arch}: {e}") from None
    geometry = Geometry(len(layers), a.num_heads, a.num_kv_heads, a.head_dim, a.scaling,
                        windows.pop())
    qk_norm = bool(getattr(a, "qk_norm", False))
    return BlendModel(arch, inner.embed_tokens, [BlendLayer(layer, qk_norm) for layer in layers],
                      geometry, rotator, inner.embed_tokens.weight.device, dtype)

