"""Integration tests against Mistral-7B-Instruct-v0.2: its real tokenizer and chat template, its
exact KV geometry, prompts of real text and chat turns.

By default they run on the stand-in (``kvconnector/standin.py``: the real tokenizer, chat
template and attention geometry with random weights and 2 layers) and, for the size checks, on
the stand-in with all 32 layers (weights from vLLM's dummy loader). Both have a residual
stream of 1024 rather than 4096: the KV geometry does not depend on it (32 query and 8 KV
heads of 128 read and write the same KV cache), and a forward pass takes about a quarter of
the multiply-adds, in bf16, which CPUs without bf16 units compute slowly. With
``KVCONNECTOR_MISTRAL_7B=/path/to/Mistral-7B-Instruct-v0.2`` every test runs on the real weights
as well (a GPU machine with vLLM for CUDA; ``scripts/gpu_check.sh`` sets it).

The central check is the project's: greedy output with KV loaded from the store equals a run
without the connector, token for token; the expected number of loaded tokens is worked out
from the token ids, chunk by chunk.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvconnector.standin import build_mistral_standin, sample_text
from tests.conftest import CACHE, run_engine
from tests.openai_server import OpenAIServer, cached_tokens
from tests.redis_server import RedisServer

pytestmark = pytest.mark.engine

REAL_ENV = "KVCONNECTOR_MISTRAL_7B"
SKIP_REAL = (f"real Mistral-7B weights not given: set {REAL_ENV}=/path/to/"
             "Mistral-7B-Instruct-v0.2 (a local copy of the Hugging Face repository) on a "
             "machine that can run it, e.g. a GPU with vLLM for CUDA (scripts/gpu_check.sh)")

# Mistral-7B's numbers, written out rather than taken from the code under test.
CHUNK = 256
LAYERS_7B = 32
KV_BYTES_PER_TOKEN_LAYER = 4096  # K and V x 8 KV heads x head_dim 128 x 2 bytes (bf16)
CHUNK_BYTES_7B = 32 << 20  # 32 layers x 256 tokens x 4 KiB
TOKENIZER_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"
SLOTS = 32  # memory_capacity is set to this many chunks
STANDIN_HIDDEN = 1024  # the stand-ins' residual stream (Mistral-7B: 4096)

# Ids of the v1 sentencepiece model (sentencepiece itself gives these, BOS first).
KNOWN_TEXT_IDS = {
    "Hello world": [1, 22557, 1526],
    "[INST] What is your favourite condiment? [/INST]":
        [1, 733, 16289, 28793, 1824, 349, 574, 16020, 2076, 2487, 28804, 733, 28748, 16289,
         28793],
}
# The example conversation of Mistral-7B-Instruct-v0.2's model card, through its chat template.
CONDIMENT = [
    {"role": "user", "content": "What is your favourite condiment?"},
    {"role": "assistant", "content": "Well, I'm quite partial to a good squeeze of fresh lemon "
                                     "juice."},
    {"role": "user", "content": "Do you have mayonnaise recipes?"},
]
CONDIMENT_IDS = [
    1, 733, 16289, 28793, 1824, 349, 574, 16020, 2076, 2487, 28804, 733, 28748, 16289, 28793,
    4673, 28725, 315, 28742, 28719, 3448, 10473, 298, 264, 1179, 11322, 19961, 302, 6138,
    23598, 18342, 28723, 2, 733, 16289, 28793, 2378, 368, 506, 993, 7136, 864, 21116, 28804,
    733, 28748, 16289, 28793]

REPORT = sample_text(1, 40)  # about 640 tokens
OTHER_REPORT = sample_text(3, 40)
SHORT_REPORT = sample_text(5, 20)


def conversation(report: str, question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from this report only.\n\n" + report},
            {"role": "user", "content": question}]


C1 = conversation(REPORT, "Which machine kept a record of every letter it had seen?")
C2 = conversation(REPORT, "What did they measure after moving the bridge?")
C3 = conversation(OTHER_REPORT, "Who wrote the ledger down twice?")
Q_TURN2 = "Say that again in one short sentence."
ANSWER_TOKENS = 160
SHORT_TOKENS = 16


@dataclass(frozen=True)
class Target:
    name: str
    path: str
    geometry_path: str  # a model with Mistral-7B's 32 layers
    geometry_load_format: str
    hidden_size: int = 4096

    @property
    def layers(self) -> int:
        return json.loads((Path(self.path) / "config.json").read_text())["num_hidden_layers"]

    @property
    def chunk_bytes(self) -> int:
        return self.layers * CHUNK * KV_BYTES_PER_TOKEN_LAYER

    @property
    def kv_cache_bytes(self) -> int:  # vLLM's own KV cache: 8192 tokens
        return self.layers * KV_BYTES_PER_TOKEN_LAYER * 8192

    def connector(self, **extra) -> dict:
        return {"memory_capacity": SLOTS * self.chunk_bytes, **extra}


@pytest.fixture(scope="module", params=["standin", "mistral-7b"])
def target(request) -> Target:
    if request.param == "mistral-7b":
        path = os.environ.get(REAL_ENV)
        if not path:
            pytest.skip(SKIP_REAL)
        return Target("mistral-7b", path, path, "auto")
    standin = build_mistral_standin(CACHE / "mistral-7b-standin-h1024", hidden_size=STANDIN_HIDDEN)
    full = build_mistral_standin(CACHE / "mistral-7b-standin-32l", num_layers=LAYERS_7B,
                                 hidden_size=STANDIN_HIDDEN, weights=False)
    return Target("standin", str(standin), str(full), "dummy", STANDIN_HIDDEN)


@pytest.fixture(scope="module")
def reference():
    """mistral_common's v1 tokenizer: Mistral's reference implementation of the encoding."""
    from mistral_common.protocol.instruct.messages import (
        AssistantMessage,
        SystemMessage,
        UserMessage,
    )
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tok = MistralTokenizer.v1()
    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}

    class Reference:
        def chat(self, messages: list[dict]) -> list[int]:
            request = ChatCompletionRequest(
                messages=[kinds[m["role"]](content=m["content"]) for m in messages])
            return tok.encode_chat_completion(request).tokens

        def turn_suffix(self, question: str) -> list[int]:
            """What the chat template appends to an answer for the next user turn."""
            raw = tok.instruct_tokenizer.tokenizer
            return [raw.eos_id] + raw.encode(f"[INST] {question} [/INST]", bos=False, eos=False)

    return Reference()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def expected_hit(prompt: list[int], block: int, *earlier: dict) -> int:
    """Tokens the connector should load for ``prompt`` after the requests ``earlier`` ran
    (each {"prompt", "tokens"}): the longest prefix of ``prompt`` it shares with one of them
    that the store holds, short of the last block (vLLM computes at least one prompt token).
    The store holds each earlier request's full chunks, and as partial chunks its full
    blocks at the end of its prompt and at the end of prompt + answer (the last generated
    token never had its KV computed)."""
    cap = (len(prompt) - 1) // block * block
    best = 0
    for out in earlier:
        seq = out["prompt"] + out["tokens"]
        done = len(seq) - 1
        common = min(common_prefix(prompt, seq), done)
        best = max(best, min(common // CHUNK * CHUNK, cap))
        for end in (len(out["prompt"]) // block * block, done // block * block):
            if end <= min(common, cap):
                best = max(best, end)
    return best


def plan(steps: list[tuple[str, dict]]) -> tuple[list[dict], list[str]]:
    """Named steps for tests/mistral_runner.py; ``continue``/``step`` may name a step."""
    names = [n for n, _ in steps]
    resolved = []
    for _, step in steps:
        step = dict(step)
        for ref in ("continue", "step"):
            if isinstance(step.get(ref), str):
                step[ref] = names.index(step[ref])
        resolved.append(step)
    return resolved, names


def run_steps(tmp: Path, spec: dict, steps: list[tuple[str, dict]]) -> dict:
    resolved, names = plan(steps)
    results = run_engine(tmp, {**spec, "steps": resolved}, runner="mistral_runner.py")
    return dict(zip(names, results, strict=True))


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def run(target, redis, reference, tmp_path_factory) -> dict:
    """One engine with the connector (memory + Redis) through every connector scenario."""
    spec = {"model": target.path, "kv_cache_bytes": target.kv_cache_bytes,
            "connector": target.connector(redis_url=redis.url, redis_key_prefix=target.name)}
    return run_steps(tmp_path_factory.mktemp(f"{target.name}-run"), spec, [
        ("known_text", {"op": "tokenize", "texts": list(KNOWN_TEXT_IDS)}),
        ("known_chat", {"op": "chat", "messages": CONDIMENT, "max_tokens": 1}),
        ("turn1", {"op": "chat", "messages": C1, "max_tokens": ANSWER_TOKENS}),
        ("turn1_again", {"op": "chat", "messages": C1}),
        ("other_question", {"op": "chat", "messages": C2}),
        ("turn2", {"op": "generate", "continue": "turn1",
                   "suffix": reference.turn_suffix(Q_TURN2)}),
        ("other_report", {"op": "chat", "messages": C3}),
        ("flush", {"op": "flush"}),
        ("totals_before_faults", {"op": "totals"}),
        ("corrupt", {"op": "foreign", "step": "turn1", "chunk": 0}),
        ("turn1_corrupt", {"op": "chat", "messages": C1}),
        ("totals_after_corrupt", {"op": "totals"}),
        ("noise0", {"op": "corrupt", "step": "other_report", "chunk": 0, "reseal": True}),
        ("noise1", {"op": "corrupt", "step": "other_report", "chunk": 1, "reseal": True}),
        ("other_report_noise", {"op": "chat", "messages": C3}),
        ("totals_after_noise", {"op": "totals"}),
        ("redis_stats", {"op": "redis_stats"}),
        ("redis_keys", {"op": "redis_keys", "step": "other_report"}),
        ("geometry", {"op": "geometry"}),
    ])


@pytest.fixture(scope="module")
def block(run) -> int:
    return run["geometry"]["workers"][0]["block_size"]


@pytest.fixture(scope="module")
def baseline(target, run, tmp_path_factory) -> dict:
    """The same token ids through vLLM without the connector."""
    prompts = {"turn1": ANSWER_TOKENS, "other_question": SHORT_TOKENS,
               "turn2": SHORT_TOKENS, "other_report": SHORT_TOKENS}
    res = run_steps(tmp_path_factory.mktemp(f"{target.name}-base"), {
        "model": target.path, "kv_cache_bytes": target.kv_cache_bytes, "connector": None},
        [(name, {"op": "generate", "prompt": run[name]["prompt"], "max_tokens": n})
         for name, n in prompts.items()])
    return {name: r["tokens"] for name, r in res.items()}


@pytest.fixture(scope="module")
def second_engine(target, run, redis, tmp_path_factory) -> dict:
    """A fresh engine (empty memory tier) on the Redis the first engine wrote to, after one
    bit of the other report's first chunk was flipped in Redis."""
    client = redis.client()
    key = run["redis_keys"][0][0]
    value = bytearray(client.get(key))
    value[-1000] ^= 0x10  # in the payload
    client.set(key, bytes(value))
    return run_steps(tmp_path_factory.mktemp(f"{target.name}-redis"), {
        "model": target.path, "kv_cache_bytes": target.kv_cache_bytes,
        "connector": target.connector(redis_url=redis.url, redis_key_prefix=target.name,
                                      redis_lookup_budget_ms=10_000)}, [
        ("turn1", {"op": "chat", "messages": C1}),
        ("totals", {"op": "totals"}),
        ("other_report", {"op": "chat", "messages": C3}),
        ("totals_after_flip", {"op": "totals"}),
        ("redis_stats", {"op": "redis_stats"}),
    ])


def test_config_has_mistral_7b_attention_geometry(target):
    cfg = json.loads((Path(target.path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (cfg["model_type"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            head_dim, cfg["vocab_size"]) == ("mistral", 32, 8, 128, 32000)
    assert cfg["hidden_size"] == target.hidden_size
    assert cfg["rope_theta"] == 1e6 and cfg.get("sliding_window") is None


def test_vllm_loads_the_real_mistral_tokenizer(target, run, reference):
    model_file = Path(target.path) / "tokenizer.model"
    assert hashlib.sha256(model_file.read_bytes()).hexdigest() == TOKENIZER_SHA256
    known = run["known_text"]
    assert known["ids"] == list(KNOWN_TEXT_IDS.values())
    assert (known["bos"], known["eos"], known["vocab"]) == (1, 2, 32000)
    # vLLM's chat rendering = the model card's format = mistral_common's reference encoding.
    assert run["known_chat"]["prompt"] == CONDIMENT_IDS == reference.chat(CONDIMENT)
    assert CONDIMENT_IDS[-len(reference.turn_suffix(CONDIMENT[2]["content"])):] == \
        reference.turn_suffix(CONDIMENT[2]["content"])
    assert run["turn1"]["prompt"] == reference.chat(C1)
    assert run["other_report"]["prompt"] == reference.chat(C3)


def test_chunk_size_and_slots_follow_the_model(target, run):
    g = run["geometry"]
    w = g["workers"][0]
    assert (w["layers"], w["num_kv_heads"], w["head_size"], w["dtype"]) == \
        (target.layers, 8, 128, "bfloat16")
    assert w["chunk_bytes"] == target.chunk_bytes == target.layers * CHUNK * 4096
    assert w["num_slots"] == w["pool_slots"] == g["scheduler_slots"] == SLOTS


def test_repeated_chat_loads_prompt_from_store(run, baseline, block):
    turn1, again = run["turn1"], run["turn1_again"]
    assert turn1["cached"] == 0
    # All of the prompt but its last block: full chunks, then the prompt's partial chunk.
    assert again["cached"] == expected_hit(again["prompt"], block, turn1) == \
        (len(again["prompt"]) - 1) // block * block
    assert turn1["tokens"] == baseline["turn1"]
    assert again["tokens"] == baseline["turn1"][:SHORT_TOKENS]


def test_other_question_loads_the_shared_report(run, baseline, block):
    turn1, again, other = run["turn1"], run["turn1_again"], run["other_question"]
    assert other["cached"] == expected_hit(other["prompt"], block, turn1, again) >= CHUNK
    assert other["tokens"] == baseline["other_question"]


def test_chat_turn2_reuses_turn1_prompt_and_answer(run, baseline, block):
    turn1, turn2 = run["turn1"], run["turn2"]
    stored = turn1["prompt"] + turn1["tokens"]
    assert len(turn1["prompt"]) % CHUNK + ANSWER_TOKENS > CHUNK, "answer must fill a chunk"
    # All of turn 1's prompt and answer but its last block.
    assert turn2["cached"] == expected_hit(turn2["prompt"], block, turn1) == \
        (len(stored) - 1) // block * block
    assert turn2["tokens"] == baseline["turn2"]


def test_loaded_bytes_are_mistral_kv_bytes(target, run):
    totals = run["totals_before_faults"]
    loads = sum(run[s]["cached"] for s in ("turn1_again", "other_question", "turn2"))
    assert totals["loaded_tokens"] == loads
    assert totals["loaded_bytes"] == loads * target.layers * KV_BYTES_PER_TOKEN_LAYER
    assert totals["load_errors"] == 0


def test_slot_holding_another_key_is_refused(run, baseline):
    assert run["corrupt"] == [True]
    before, after = run["totals_before_faults"], run["totals_after_corrupt"]
    assert after["load_errors"] - before["load_errors"] >= 1
    assert run["turn1_corrupt"]["tokens"] == baseline["turn1"][:SHORT_TOKENS]


def test_flipped_bit_in_redis_is_caught_and_recomputed(second_engine, baseline):
    out, stats = second_engine["other_report"], second_engine["redis_stats"]
    before, after = second_engine["totals"], second_engine["totals_after_flip"]
    assert stats["corrupt_reasons"] == {"checksum": 1}
    assert after["load_errors"] - before["load_errors"] == 1
    assert out["tokens"] == baseline["other_report"]


def test_loaded_kv_is_really_used(run, baseline, block):
    """Control: noise written into stored slots changes the answer, so the equalities above
    are not the engine quietly recomputing (and the model is sensitive to its KV)."""
    assert run["noise0"] == [True] and run["noise1"] == [True]
    noisy = run["other_report_noise"]
    assert noisy["cached"] == expected_hit(noisy["prompt"], block, run["other_report"]) \
        >= 2 * CHUNK
    assert run["totals_after_noise"]["load_errors"] == run["totals_after_corrupt"]["load_errors"]
    assert run["other_report"]["tokens"] == baseline["other_report"]
    assert noisy["tokens"] != baseline["other_report"]


def test_second_engine_loads_from_redis(run, second_engine, baseline, block):
    assert run["redis_stats"]["puts"] >= 4
    out, totals = second_engine["turn1"], second_engine["totals"]
    assert out["prompt"] == run["turn1"]["prompt"]
    assert out["cached"] == expected_hit(out["prompt"], block, run["turn1"]) >= 2 * CHUNK
    assert totals["redis_loaded_chunks"] == -(-out["cached"] // CHUNK)
    assert totals["load_errors"] == 0
    assert out["tokens"] == baseline["turn1"][:SHORT_TOKENS]


@pytest.fixture(scope="module")
def server(target, tmp_path_factory):
    # The stand-in in fp32: on CPUs with AMX, bf16 matrix products of a prompt computed whole
    # and of its tail after a hit differ in rounding, and answers drifted apart after ~30
    # tokens with identical loaded KV. fp32 KV takes twice the bytes of the bf16 budgets.
    scale, dtype = (2, "float32") if target.name == "standin" else (1, "bfloat16")
    kvt = {"kv_connector": "kvconnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": target.connector(
               memory_capacity=scale * SLOTS * target.chunk_bytes)}
    with OpenAIServer(target.path, tmp_path_factory.mktemp(f"{target.name}-server"), kvt, args=[
            "--dtype", dtype, "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--enforce-eager", "--kv-cache-memory-bytes", str(scale * target.kv_cache_bytes),
            "--max-model-len", "4096"]) as s:
        yield s


def _chat(server: OpenAIServer, messages: list[dict], max_tokens: int) -> dict:
    return server.post("/v1/chat/completions", {
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def test_openai_chat_endpoint_two_turns(server, run, block):
    first, second = (_chat(server, C1, ANSWER_TOKENS) for _ in range(2))
    prompt = first["prompt_token_ids"]
    answer = first["choices"][0]["token_ids"]
    assert prompt == run["turn1"]["prompt"]  # the server's template and tokenizer
    # Compared with the first answer, computed by the same server: on CPU the server's worker
    # runs with other thread settings than the offline engines, and bf16 results drift apart
    # after some tokens even without a connector.
    assert second["choices"][0]["token_ids"] == answer
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    first_out = {"prompt": prompt, "tokens": answer}
    second_out = {"prompt": prompt, "tokens": second["choices"][0]["token_ids"]}
    assert [cached_tokens(first), cached_tokens(second)] == [
        0, expected_hit(prompt, block, first_out)]
    # Turn 2 as a client sends it: the answer comes back as text through the template.
    turn2 = _chat(server, [*C1, {"role": "assistant",
                                 "content": first["choices"][0]["message"]["content"]},
                           {"role": "user", "content": Q_TURN2}], SHORT_TOKENS)
    assert cached_tokens(turn2) == expected_hit(turn2["prompt_token_ids"], block, first_out,
                                                second_out)
    assert cached_tokens(turn2) >= len(prompt) // CHUNK * CHUNK


def test_openai_completion_with_text_prompt(server, block):
    body = {"prompt": SHORT_REPORT + " " + REPORT, "max_tokens": SHORT_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    first, second = (server.post("/v1/completions", body) for _ in range(2))
    prompt = first["choices"][0]["prompt_token_ids"]
    assert first["usage"]["prompt_tokens"] == len(prompt) > 2 * CHUNK
    assert [cached_tokens(first), cached_tokens(second)] == [
        0, expected_hit(prompt, block, {"prompt": prompt,
                                        "tokens": first["choices"][0]["token_ids"]})]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


@pytest.fixture(scope="module")
def geometry(target, tmp_path_factory) -> dict:
    """Mistral-7B's 32 layers: a real engine start, one chunk saved and loaded."""
    return run_steps(tmp_path_factory.mktemp(f"{target.name}-32l"), {
        "model": target.geometry_path, "load_format": target.geometry_load_format,
        "kv_cache_bytes": 256 << 20, "max_model_len": 1024,
        "connector": {"memory_capacity": "1GiB"}}, [
        ("first", {"op": "chat", "messages": [{"role": "user", "content": SHORT_REPORT}],
                   "max_tokens": 4}),
        ("again", {"op": "chat", "messages": [{"role": "user", "content": SHORT_REPORT}],
                   "max_tokens": 4}),
        ("totals", {"op": "totals"}),
        ("geometry", {"op": "geometry"}),
    ])


def test_kv_geometry_is_mistral_7b(geometry):
    g = geometry["geometry"]
    w = g["workers"][0]
    assert (w["layers"], w["num_kv_heads"], w["head_size"], w["dtype"]) == \
        (LAYERS_7B, 8, 128, "bfloat16")
    assert w["page_size_bytes"] == w["block_size"] * KV_BYTES_PER_TOKEN_LAYER
    # 256 MiB of vLLM KV cache holds 2048 tokens of Mistral-7B (128 KiB per token).
    if "kv_cache_blocks" in g:
        tokens = g["kv_cache_blocks"] * w["block_size"]
        assert tokens == (256 << 20) // (LAYERS_7B * KV_BYTES_PER_TOKEN_LAYER) == 2048
        assert all(b == tokens * KV_BYTES_PER_TOKEN_LAYER for b in w["layer_tensor_bytes"])
    assert w["chunk_bytes"] == CHUNK_BYTES_7B
    assert w["num_slots"] == w["pool_slots"] == (1 << 30) // CHUNK_BYTES_7B == 32
    assert w["pool_bytes"] == 1 << 30
    assert g.get("scheduler_slots", 32) == 32
    first, again, totals = geometry["first"], geometry["again"], geometry["totals"]
    assert 256 < len(first["prompt"]) < 512 and again["cached"] == CHUNK
    assert totals["saved_chunks"] >= 1 and totals["saved_bytes"] == \
        totals["saved_chunks"] * CHUNK_BYTES_7B
    assert totals["loaded_chunks"] == 1 and totals["loaded_bytes"] == CHUNK_BYTES_7B
    assert again["tokens"] == first["tokens"]
