"""Tiny random-weight models of the families blend serves (and one it refuses), built
offline with the tiny Mistral's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvconnector.build_once import build_once
from kvconnector.tiny_model import build_tiny_mistral

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_model(path: Path, tokenizer_from: Path, *, arch: str, num_layers: int = 2,
                qk_scale: float = 1.0, logit_scale: float = 1.0, local_bias: float = 0.0,
                rope_parameters: dict | None = None, seed: int = 0) -> str:
    """``arch``: "mistral", "llama" or "qwen2". Random weights give nearly uniform
    attention: ``qk_scale`` multiplies the query and key weights to make it peaked, so that
    which earlier tokens a token sees (and so a wrong or approximate KV) changes the output
    measurably; ``logit_scale`` multiplies the output head, for a next-token distribution
    that is not nearly flat. ``local_bias`` > 0 (llama) gives queries and keys a constant
    bias in a few slow RoPE pairs, so attention also favours nearby tokens, as trained
    models' heads often do."""
    want = {"arch": arch, "num_layers": num_layers, "qk_scale": qk_scale,
            "logit_scale": logit_scale, "local_bias": local_bias,
            "rope_parameters": rope_parameters, "seed": seed, "v": 1}
    marker = path / "kvconnector-blend-model.json"
    with build_once(marker, want) as needed:
        if needed:
            _build(path, tokenizer_from, arch, num_layers, qk_scale, logit_scale, local_bias,
                   rope_parameters, seed)
    return str(path)


def _build(path: Path, tokenizer_from: Path, arch: str, num_layers: int, qk_scale: float,
           logit_scale: float, local_bias: float, rope_parameters: dict | None,
           seed: int) -> None:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    path.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(tokenizer_from / name, path / name)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    common = dict(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                  num_hidden_layers=num_layers, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=16384, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False, torch_dtype="float32")
    if rope_parameters is not None:
        common["rope_parameters"] = rope_parameters
    if arch == "mistral":
        cfg = MistralConfig(head_dim=32, sliding_window=None, **common)
        model_cls = MistralForCausalLM
    elif arch == "llama":
        cfg = LlamaConfig(head_dim=32, attention_bias=local_bias > 0, **common)
        model_cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
        model_cls = Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    head_dim = 32
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_proj.weight.mul_(qk_scale)
            a.k_proj.weight.mul_(qk_scale)
            for proj in (a.q_proj, a.k_proj, a.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.02)
            if local_bias > 0:
                for proj in (a.q_proj, a.k_proj):
                    b = proj.bias.view(-1, head_dim)
                    b[:, 3:6] = local_bias  # neox pairs (i, i + 16) of slow frequencies
                    b[:, 19:22] = 0
            if getattr(a.o_proj, "bias", None) is not None:
                a.o_proj.bias.zero_()
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path, safe_serialization=True)


def tiny_tokenizer_dir(cache: Path) -> Path:
    return build_tiny_mistral(cache / "tiny-mistral")
