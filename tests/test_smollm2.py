"""A real trained model (SmolLM2-135M-Instruct, built offline by kvconnector/smollm2.py)
through the connector: prefix reuse in fp32 and bf16, and blend at ratio 1.0, each giving
vLLM alone's tokens; the model really answers from the text it was given."""

from __future__ import annotations

import argparse
import collections
import json

import pytest

from tests.conftest import CACHE, run_engine

pytestmark = pytest.mark.engine

FACT, QUESTION, ANSWER = ("The access code for the archive room is 7421.",
                          "What is the access code for the archive room?", "7421")
SEPARATOR = " # # "


@pytest.fixture(scope="module")
def smollm2() -> str:
    from kvconnector.smollm2 import build_smollm2

    return str(build_smollm2(CACHE / "smollm2"))


def _documents() -> list[str]:
    """Real English we did not write, shipped with Python: three standard-library
    docstrings, the fact planted in the middle of the second."""
    docs = [" ".join(d.split()) for d in (json.__doc__, argparse.__doc__, collections.__doc__)]
    words = docs[1].split()
    docs[1] = " ".join(words[:len(words) // 2] + [FACT] + words[len(words) // 2:])
    return docs


def _chat_ids(path: str, context: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "Answer from this text.\n" + context},
                {"role": "user", "content": QUESTION}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def test_a_real_model_gives_vllms_answers_from_the_store(smollm2, tmp_path):
    from transformers import AutoTokenizer

    docs = _documents()
    stored = _chat_ids(smollm2, SEPARATOR.join(docs))
    moved = _chat_ids(smollm2, SEPARATOR.join([docs[2], docs[1], docs[0]]))
    # bf16 on one document (567 tokens against 1561): a CPU without AVX512-BF16 computes
    # bf16 several times slower than fp32.
    short = _chat_ids(smollm2, docs[1])
    mem = {"memory_capacity": "256MiB"}
    # The separator as text: its trailing space joins the next word in these prompts.
    blend = {**mem, "blend": True, "blend_separator": SEPARATOR, "blend_recompute_ratio": 1.0,
             "blend_max_cost": 1.0, "blend_min_tokens": 64}

    def engine(connector, dtype, prompts, tokens=16) -> dict:
        return {"connector": connector, "dtype": dtype, "kv_cache_bytes": 256 << 20,
                "batches": [[{"prompt": p, "max_tokens": tokens}] for p in prompts]}

    res = run_engine(tmp_path, {"model": smollm2, "engines": [
        engine(None, "float32", [stored, moved]),
        engine(mem, "float32", [stored, stored]),
        engine(None, "bfloat16", [short]),
        engine(mem, "bfloat16", [short, short]),
        engine(blend, "float32", [stored, moved]),
    ]}, runner="differential_runner.py", timeout=900)
    out = [[b[0] for b in r["outputs"]] for r in res]
    base32, mem32, base16, mem16, blended = out
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert ANSWER in tok.decode(base32[0]["tokens"]), tok.decode(base32[0]["tokens"])
    for run, want, ids in ((mem32, base32[0], stored), (mem16, base16[0], short)):
        hit = (len(ids) - 1) // 128 * 128  # the CPU build's blocks of 128 tokens
        assert run[0]["cached"] == 0 and run[1]["cached"] == hit > 0
        assert run[0]["tokens"] == run[1]["tokens"] == want["tokens"]
    assert blended[1]["cached"] > 0 and res[4]["totals"]["blend_requests"] == 1
    assert blended[1]["tokens"] == base32[1]["tokens"]  # every token recomputed: exact
