"""A random-weight Mistral of the real architecture, built offline for tests and demos."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger("kvconnector.tiny_model")

_WORDS = ("alpha beta gamma delta cache chunk token prefix block layer head value key "
          "vector memory store load save engine model request prompt answer question system "
          "user document reuse attention paged hash chain redis host device stream").split()


def _corpus(n_lines: int = 2000) -> list[str]:
    import random

    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30)))
            for _ in range(n_lines)]


def build_tiny_mistral(path: str | os.PathLike, *, num_layers: int = 2, vocab_size: int = 512,
                       seed: int = 0) -> Path:
    """Write config, weights and tokenizer to ``path`` (reused if already complete)."""
    path = Path(path)
    marker = path / "kvconnector-tiny.json"
    want = {"num_layers": num_layers, "vocab_size": vocab_size, "seed": seed, "v": 2}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

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
    cfg = MistralConfig(
        vocab_size=len(fast), hidden_size=256, intermediate_size=512,
        num_hidden_layers=num_layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=16384, sliding_window=None,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = MistralForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(want))
    logger.info("built tiny Mistral at %s", path)
    return path
