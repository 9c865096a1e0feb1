"""A random-weight Mistral of the real architecture, built offline for tests and demos."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvconnector.build_once import build_once

logger = logging.getLogger("kvconnector.tiny_model")

_WORDS = ("alpha beta gamma delta cache chunk token prefix block layer head value key "
          "vector memory store load save engine model request prompt answer question system "
          "user document reuse attention paged hash chain redis host device stream").split()


def _corpus(n_lines: int = 2000) -> list[str]:
    import random

    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30)))
            for _ in range(n_lines)]


def _tokenizer(path: Path, vocab_size: int):
    """A byte-level BPE trained on generated text, saved into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(path)
    return fast


def _special_ids(fast) -> dict:
    return {"vocab_size": len(fast), "bos_token_id": fast.bos_token_id,
            "eos_token_id": fast.eos_token_id, "pad_token_id": fast.pad_token_id}


def _save(path: Path, model_cls, cfg, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    model_cls(cfg).save_pretrained(path, safe_serialization=True)
    logger.info("built tiny %s at %s", cfg.model_type, path)


def build_tiny_mistral(path: str | os.PathLike, *, num_layers: int = 2, vocab_size: int = 512,
                       seed: int = 0) -> Path:
    """Write config, weights and tokenizer to ``path`` (reused if already complete)."""
    path = Path(path)
    marker = path / "kvconnector-tiny.json"
    want = {"num_layers": num_layers, "vocab_size": vocab_size, "seed": seed, "v": 2}
    with build_once(marker, want) as needed:
        if needed:
            _build_tiny_mistral(path, num_layers, vocab_size, seed)
    return path


def _build_tiny_mistral(path: Path, num_layers: int, vocab_size: int, seed: int) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    fast = _tokenizer(path, vocab_size)
    cfg = MistralConfig(
        hidden_size=256, intermediate_size=512,
        num_hidden_layers=num_layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=16384, sliding_window=None,
        tie_word_embeddings=False, torch_dtype="float32", **_special_ids(fast))
    _save(path, MistralForCausalLM, cfg, seed)


def build_tiny_deepseek(path: str | os.PathLike, *, num_layers: int = 2, vocab_size: int = 512,
                        seed: int = 0) -> Path:
    """A random-weight DeepSeek-V2 (MLA attention: one 576-wide latent per token, as in
    DeepSeek-V2/V3), all layers dense."""
    path = Path(path)
    marker = path / "kvconnector-tiny.json"
    want = {"model": "deepseek_v2", "num_layers": num_layers, "vocab_size": vocab_size,
            "seed": seed, "v": 1}
    with build_once(marker, want) as needed:
        if needed:
            _build_tiny_deepseek(path, num_layers, vocab_size, seed)
    return path


def _build_tiny_deepseek(path: Path, num_layers: int, vocab_size: int, seed: int) -> None:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    fast = _tokenizer(path, vocab_size)
    cfg = DeepseekV2Config(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=32, first_k_dense_replace=num_layers, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=16384,
        tie_word_embeddings=False, torch_dtype="float32", **_special_ids(fast))
    _save(path, DeepseekV2ForCausalLM, cfg, seed)
