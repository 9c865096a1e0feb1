"""A Mistral-7B-Instruct-v0.2 stand-in, built offline: the real tokenizer and chat template,
the real attention geometry, random weights, fewer layers and a smaller MLP.

    python -m kvconnector.standin .cache/mistral-7b-standin              # 2 layers, runs on CPU
    python -m kvconnector.standin .cache/m7b-geometry --layers 32 --no-weights
                                                   # full KV geometry; load with load_format=dummy

The tokenizer is Mistral's v1 sentencepiece model (the file Mistral-7B-Instruct-v0.2 ships as
``tokenizer.model``), taken from the ``mistral_common`` package, laid out as the model's
Hugging Face repository lays it out, so vLLM loads it the way it loads the real model.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path

from kvconnector.build_once import build_once

logger = logging.getLogger("kvconnector.standin")


@dataclasses.dataclass(frozen=True)
class Mistral7B:
    """Mistral-7B-Instruct-v0.2's config.json, the numbers the KV cache depends on."""

    num_hidden_layers: int = 32
    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    vocab_size: int = 32000
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-5
    bos_token_id: int = 1
    eos_token_id: int = 2


MISTRAL_7B = Mistral7B()

# The v1 sentencepiece model: the same bytes as tokenizer.model in Mistral-7B(-Instruct)-v0.1/v0.2
# and Mixtral-8x7B on the Hugging Face hub.
TOKENIZER_V1_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"

# Mistral-7B-Instruct-v0.2's chat template (its tokenizer_config.json, 2024 revision: an
# optional system message goes before the first user message).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the "
    "exception of an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n")

# Query and key weights 4x the initializer's spread make attention peaked, so the output
# depends on particular earlier tokens; at 1x a random-weight model averages its context and
# its greedy output soon repeats one token, which a wrong KV block would not change.
QK_SCALE = 4.0
_SPECIAL = {"0": "<unk>", "1": "<s>", "2": "</s>"}
_FORMAT = 3  # bump when the files written change


def tokenizer_v1_path() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": True, "add_eos_token": False,
        "added_tokens_decoder": {i: {"content": c, "lstrip": False, "normalized": False,
                                     "rstrip": False, "single_word": False, "special": True}
                                 for i, c in _SPECIAL.items()},
        "additional_special_tokens": [], "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": None, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "legacy": False,
        "model_max_length": 1000000000000000019884624838656, "sp_model_kwargs": {},
        "spaces_between_special_tokens": False, "tokenizer_class": "LlamaTokenizer",
        "use_default_system_prompt": False,
    }


def _model_config(num_layers: int, intermediate_size: int, hidden_size: int) -> dict:
    m = MISTRAL_7B
    cfg = {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "attention_dropout": 0.0, "bos_token_id": m.bos_token_id, "eos_token_id": m.eos_token_id,
        "hidden_act": "silu", "hidden_size": hidden_size, "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": m.max_position_embeddings,
        "num_attention_heads": m.num_attention_heads, "num_hidden_layers": num_layers,
        "num_key_value_heads": m.num_key_value_heads, "rms_norm_eps": m.rms_norm_eps,
        "rope_theta": m.rope_theta, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": m.vocab_size,
    }
    if hidden_size != m.hidden_size:  # head_dim is no longer hidden / heads: written out
        cfg["head_dim"] = m.head_dim
    return cfg


def _write_tokenizer(path: Path) -> None:
    src = tokenizer_v1_path()
    if _sha256(src) != TOKENIZER_V1_SHA256:
        raise RuntimeError(f"{src} is not Mistral's v1 tokenizer (sha256 differs)")
    shutil.copyfile(src, path / "tokenizer.model")
    # For vLLM's --tokenizer-mode mistral (mistral_common reads tokenizer.model.v*).
    shutil.copyfile(src, path / "tokenizer.model.v1")
    (path / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))
    from transformers import LlamaTokenizer

    # The hub repository ships tokenizer.json too: the sentencepiece model as a fast tokenizer
    # (a Metaspace pre-tokenizer that adds the leading "▁" to the start of the text only).
    # Without the file, transformers 5 converts tokenizer.model for model_type "mistral"
    # without that prefix, and "Hello" no longer encodes as sentencepiece encodes it.
    LlamaTokenizer.from_pretrained(path).backend_tokenizer.save(str(path / "tokenizer.json"))


def _write_weights(path: Path, cfg: dict, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * MISTRAL_7B.head_dim
    kv = cfg["num_key_value_heads"] * MISTRAL_7B.head_dim

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std * scale).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": normal(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": normal(q, h, scale=QK_SCALE),
            p + "self_attn.k_proj.weight": normal(kv, h, scale=QK_SCALE),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def build_mistral_standin(path: str | os.PathLike, *, num_layers: int = 2,
                          intermediate_size: int = 1024,
                          hidden_size: int = MISTRAL_7B.hidden_size, weights: bool = True,
                          seed: int = 0) -> Path:
    """Write the stand-in to ``path`` (reused if already complete) and return it.

    Without ``weights`` only config and tokenizer are written: load it with vLLM's
    ``load_format="dummy"`` to get an engine of that geometry without a weights file.
    A smaller ``hidden_size`` keeps the KV geometry (32 query and 8 KV heads of 128) and
    shrinks every projection: the KV cache and its chunks are the same size."""
    path = Path(path)
    marker = path / "kvconnector-standin.json"
    want = {"num_layers": num_layers, "intermediate_size": intermediate_size,
            "hidden_size": hidden_size, "weights": weights, "seed": seed, "format": _FORMAT}
    with build_once(marker, want) as needed:
        if needed:
            _build(path, _model_config(num_layers, intermediate_size, hidden_size), weights,
                   seed)
    return path


def _build(path: Path, cfg: dict, weights: bool, seed: int) -> None:
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": MISTRAL_7B.bos_token_id, "eos_token_id": MISTRAL_7B.eos_token_id},
        indent=2))
    _write_tokenizer(path)
    if weights:
        _write_weights(path, cfg, seed)
    else:
        (path / "model.safetensors").unlink(missing_ok=True)
    logger.info("built Mistral-7B stand-in (%d layers) at %s", cfg["num_hidden_layers"], path)


_SENTENCES = (
    "The {a} in the {b} kept a record of every {c} it had seen.",
    "Nobody expected the {a} to reach the {b} before the end of the {c}.",
    "A {a} is only as useful as the {b} that stands behind it.",
    "When the {a} failed, the {b} took over and the {c} carried on as before.",
    "She wrote the {a} down twice, once for the {b} and once for the {c}.",
    "Every {a} on the list had to be checked against the {b}.",
    "The old {a} was slower, but its {b} never lost a single {c}.",
    "They measured the {a} again after moving the {b} closer to the {c}.",
    "If the {a} is full, the oldest {b} is dropped to make room for the {c}.",
    "In the morning the {a} was quiet, and by noon the {b} was busy with {c}s.",
    "He asked whether the {a} could be shared between the {b} and the {c}.",
    "The report compared the {a} with the {b} over three long weeks.",
)
_NOUNS = ("library river station engine garden ledger harbour committee lantern bridge "
          "council archive orchard workshop signal compass village market letter machine "
          "teacher winter mountain question answer window journey kitchen museum theory "
          "schedule harvest printer network cache request document chapter").split()


def sample_text(seed: int, n_sentences: int) -> str:
    """Deterministic English prose (for real-text prompts through the real tokenizer)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_SENTENCES).format(a=rng.choice(_NOUNS), b=rng.choice(_NOUNS),
                                                  c=rng.choice(_NOUNS))
                    for _ in range(n_sentences))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="folder to write the model to")
    p.add_argument("--layers", type=int, default=2,
                   help="decoder layers (32 = Mistral-7B's full KV geometry)")
    p.add_argument("--intermediate-size", type=int, default=1024,
                   help=f"MLP width (Mistral-7B: {MISTRAL_7B.intermediate_size})")
    p.add_argument("--hidden-size", type=int, default=MISTRAL_7B.hidden_size,
                   help="residual stream width; the KV geometry does not depend on it")
    p.add_argument("--no-weights", action="store_true",
                   help="config and tokenizer only; load with load_format=dummy")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_mistral_standin(args.path, num_layers=args.layers,
                          intermediate_size=args.intermediate_size,
                          hidden_size=args.hidden_size, weights=not args.no_weights,
                          seed=args.seed)


if __name__ == "__main__":
    main()
