"""Blend on real vLLM engines (CPU build): documents reused at any position, in any order,
after any system prompt, from memory and from Redis in another engine; exact with ratio 1.0
and at the stored positions with ratio 0; faults cost recompute; nothing leaks; models it
cannot serve are refused at start-up."""

from __future__ import annotations

import math
import random

import pytest

from tests.blend_models import build_model, tiny_tokenizer_dir
from tests.conftest import CACHE, run_engine
from tests.redis_server import RedisServer

pytestmark = pytest.mark.engine

SEPARATOR = " # # "
MAX_LEN = 2048


def _tokens(rng: random.Random, n: int, avoid: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(6, 400)
        if t not in avoid:
            out.append(t)
    return out


def _join(segments: list[list[int]], sep: list[int]) -> list[int]:
    out: list[int] = []
    for i, s in enumerate(segments):
        out += (sep if i else []) + s
    return out


@pytest.fixture(scope="module")
def peaked_mistral() -> str:
    return build_model(CACHE / "tiny-mistral-qk4", tiny_tokenizer_dir(CACHE), arch="mistral",
                       qk_scale=4.0)


@pytest.fixture(scope="module")
def sep(peaked_mistral) -> list[int]:
    """The separator as the model's tokenizer encodes it alone (what blend looks for)."""
    from transformers import AutoTokenizer

    from kvconnector.blend.segments import separator_ids

    return separator_ids(AutoTokenizer.from_pretrained(peaked_mistral), SEPARATOR)


class Prompts:
    def __init__(self, sep: list[int]) -> None:
        rng, avoid = random.Random(9), set(sep)
        self.sep = sep
        self.s1, self.s2 = [1] + _tokens(rng, 60, avoid), [1] + _tokens(rng, 90, avoid)
        self.d1, self.d2, self.d3, self.d4 = (_tokens(rng, n, avoid) for n in (300, 420, 250, 280))
        q1, q2, q3 = (_tokens(rng, n, avoid) for n in (40, 50, 45))
        self.p1 = _join([self.s1, self.d1, self.d2, self.d3, q1], sep)
        # Documents reordered, one never seen, after another system prompt.
        self.p2 = _join([self.s2, self.d2, self.d1, self.d4, self.d3, q2], sep)
        # The documents at the positions they were stored at.
        self.p3 = _join([self.s1, self.d1, self.d2, self.d3, q3], sep)
        self.plain = _tokens(rng, 700, avoid)  # no separator: prefix reuse
        self.small = _join([[1] + _tokens(rng, 20, avoid), _tokens(rng, 60, avoid),
                            _tokens(rng, 300, avoid)], sep)  # 80 document tokens
        # P1's first documents at their stored positions, then one never seen.
        self.p5 = _join([self.s1, self.d1, self.d2, _tokens(rng, 260, avoid),
                         _tokens(rng, 40, avoid)], sep)
        # The plain prompt's first four blocks, then documents of P1 at other positions.
        self.on_plain = _join([self.plain[:512], self.d2, self.d1, _tokens(rng, 30, avoid)],
                              sep)


@pytest.fixture(scope="module")
def prompts(sep) -> Prompts:
    return Prompts(sep)


@pytest.fixture(scope="module")
def stress_prompts(sep) -> list[list[int]]:
    """Prompts of three documents each, drawn from six: most reuse stored documents."""
    rng, avoid = random.Random(3), set(sep)
    docs = [_tokens(rng, rng.randrange(150, 190), avoid) for _ in range(6)]
    return [_join([[1] + _tokens(rng, 30, avoid), *rng.sample(docs, 3),
                   _tokens(rng, 40, avoid)], sep) for _ in range(12)]


STRESS_TOKENS = 160


RATIO_1 = {"blend_recompute_ratio": 1.0}
RATIO_0 = {"blend_recompute_ratio": 0.0}


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def _blend_config(redis_url: str | None = None) -> dict:
    # Models of 1-3 layers, where blending costs what full prefill does: blend anyway.
    cfg = {"memory_capacity": "64MiB", "blend": True, "blend_min_tokens": 200,
           "blend_max_cost": 1.0}
    if redis_url:
        cfg.update(redis_url=redis_url, redis_key_prefix="blend")
    return cfg


@pytest.fixture(scope="module")
def blend_run(peaked_mistral, prompts, redis_server, tmp_path_factory):
    p = prompts
    steps = [
        {"op": "generate", "prompts": [p.p1]},  # 0: stores S1, D1, D2, D3
        {"op": "totals"},  # 1
        {"op": "generate", "prompts": [p.p2], "params": RATIO_1, "logprobs": 20},  # 2
        {"op": "generate", "prompts": [p.p3], "params": RATIO_0},  # 3
        {"op": "totals"},  # 4
        {"op": "damage_doc", "doc": p.d2, "how": "lose"},  # 5: D2's slots lost
        {"op": "generate", "prompts": [p.p3], "params": RATIO_0},  # 6: D2 recomputed
        {"op": "totals"},  # 7
        {"op": "generate", "prompts": [p.p2] * 3 + [p.p3] * 2, "params": [  # 8
            {}, {"blend_strategy": "cacheblend"}, {"blend_strategy": "epic"}, {},
            {"blend_strategy": "cacheblend"}]},
        {"op": "generate", "prompts": [p.plain, p.plain]},  # 9: prefix reuse
        {"op": "generate", "prompts": [p.small]},  # 10: too few document tokens
        {"op": "totals"},  # 11
        {"op": "layer0_rerotation", "tokens": p.d1[:200], "p": 3, "q": 1500},  # 12
        {"op": "damage_doc", "doc": p.d1, "how": "noise"},  # 13: wrong data, sealed
        {"op": "generate", "prompts": [p.p3], "params": RATIO_0},  # 14: control
        {"op": "flush"},  # 15
        {"op": "outstanding"},  # 16
        {"op": "metrics"},  # 17
        {"op": "totals"},  # 18
    ]
    return run_engine(tmp_path_factory.mktemp("blend"), {
        "model": peaked_mistral, "max_model_len": MAX_LEN, "log_stats": True,
        "connector": _blend_config(redis_server.url), "steps": steps},
        runner="blend_runner.py", timeout=600)


@pytest.fixture(scope="module")
def baseline(peaked_mistral, prompts, stress_prompts, tmp_path_factory):
    p = prompts
    res = run_engine(tmp_path_factory.mktemp("blend-base"), {
        "model": peaked_mistral, "max_model_len": MAX_LEN, "connector": None, "steps": [
            {"op": "generate", "prompts": [p.p1, p.p3, p.plain, p.small]},
            {"op": "generate", "prompts": [p.p2], "logprobs": 20},
            {"op": "generate", "prompts": stress_prompts, "max_tokens": STRESS_TOKENS},
            {"op": "generate", "prompts": [p.p5, p.on_plain]}]},
        runner="blend_runner.py", timeout=600)
    (p1, p3, plain, small), (p2,), stress, (p5, on_plain) = res
    return {"p1": p1, "p2": p2, "p3": p3, "plain": plain, "small": small,
            "stress": [r["tokens"] for r in stress], "p5": p5, "on_plain": on_plain}


def _blended(prompt: list[int], block: int = 128) -> int:
    """The blended range: up to the last block boundary before the prompt's last token."""
    return (len(prompt) - 1) // block * block


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def test_documents_are_stored_under_their_own_keys(blend_run, baseline):
    first, totals = blend_run[0][0], blend_run[1]
    assert first["cached"] == 0 and first["tokens"] == baseline["p1"]["tokens"]
    assert totals["blend_saved_docs"] == 4  # S1, D1, D2, D3 (the question is no document)
    assert totals["blend_saved_pieces"] == 1 + 2 + 2 + 1
    assert totals.get("blend_requests", 0) == 0


def test_reordered_documents_with_ratio_1_equal_full_prefill(blend_run, baseline, prompts):
    """Every token recomputed over the blended range: vLLM's output within fp32 rounding,
    though the documents moved, one was never stored and the system prompt changed."""
    out, base = blend_run[2][0], baseline["p2"]
    assert out["cached"] == _blended(prompts.p2)  # the blended range was served as a hit
    assert out["tokens"] == base["tokens"]
    assert out["logprobs"].keys() == base["logprobs"].keys()
    for t, lp in base["logprobs"].items():
        assert math.isclose(out["logprobs"][t], lp, abs_tol=2e-4), t


def test_documents_at_their_stored_positions_with_ratio_0_give_identical_tokens(
        blend_run, baseline, prompts):
    before, after = blend_run[1], blend_run[4]
    out = blend_run[3][0]
    assert out["tokens"] == baseline["p3"]["tokens"]
    assert out["cached"] == _blended(prompts.p3) == 1024
    assert _delta(after, before, "blend_requests") == 2
    # Ratio 1 recomputed every token of P2's range; ratio 0 recomputes only what no
    # document covers in P3's: its three separators.
    assert _delta(after, before, "blend_recomputed_tokens") == (
        _blended(prompts.p2) + 3 * len(prompts.sep))


def test_a_lost_document_is_recomputed_never_served(blend_run, baseline):
    before, after = blend_run[4], blend_run[7]
    assert blend_run[5] == 2  # D2's two pieces lost
    assert _delta(after, before, "blend_doc_errors") == 1
    assert _delta(after, before, "load_errors") == 0  # the rest of the range was blended
    assert blend_run[6][0]["tokens"] == baseline["p3"]["tokens"]


def test_loaded_document_kv_is_really_used(blend_run, baseline):
    """Control: noise in sealed slots changes the output, so the equalities above
    are not the engine quietly recomputing everything."""
    assert blend_run[14][0]["tokens"] != baseline["p3"]["tokens"]


def test_prompts_without_separators_or_enough_documents_use_prefix_reuse(blend_run, baseline):
    before, after = blend_run[7], blend_run[11]
    plain1, plain2 = blend_run[9]
    assert plain1["tokens"] == plain2["tokens"] == baseline["plain"]["tokens"]
    assert plain2["cached"] == 640  # two full chunks and a partial one of one block
    assert _delta(after, before, "loaded_chunks") == 3
    small = blend_run[10][0]
    assert small["tokens"] == baseline["small"]["tokens"] and small["cached"] == 0
    assert _delta(after, before, "blend_requests") == 5  # only step 8's five


def test_strategies_serve_the_blended_range(blend_run, baseline):
    """Each strategy serves the range; at the stored positions (P3: the loaded K/V is what
    a prefill computes) partial recomputes give vLLM's tokens too, so the picked tokens'
    fresh K/V went where it belongs."""
    assert all(r["cached"] >= 1024 for r in blend_run[8])
    assert [r["tokens"] for r in blend_run[8][3:]] == [baseline["p3"]["tokens"]] * 2


def test_rerotated_layer0_keys_equal_keys_computed_at_the_new_position(blend_run):
    r = blend_run[12]
    assert r["not_moved"] > 0.1 * r["largest"]  # the check can fail
    assert r["moved"] <= 1e-5 * max(1.0, r["largest"])


def test_nothing_is_left_over(blend_run):
    out = blend_run[16]
    assert all(v == 0 for v in out["scheduler"].values()), out
    assert all(v == 0 for w in out["workers"] for v in w.values()), out


def test_a_second_engine_blends_documents_from_redis(blend_run, baseline, peaked_mistral,
                                                     prompts, redis_server, tmp_path_factory):
    """vLLM's default multi-process engine, empty memory tier: the documents come from the
    first engine through Redis (the request waits in WAITING_FOR_REMOTE_KVS meanwhile)."""
    assert blend_run[15] == [True]
    res = run_engine(tmp_path_factory.mktemp("blend-redis"), {
        "model": peaked_mistral, "max_model_len": MAX_LEN,
        "connector": _blend_config(redis_server.url), "log_stats": True, "steps": [
            {"op": "generate", "prompts": [prompts.p2], "params": RATIO_1, "logprobs": 20},
            {"op": "totals"}, {"op": "cached_by_source"}]},
        runner="blend_runner.py", multiprocess=True, timeout=600)
    out, totals, sources = res[0][0], res[1], res[2]
    # vLLM's per-tier count: the documents came from Redis (vLLM's label for a remote
    # store: "external_unspecified").
    assert sources.get("external_unspecified", 0) > 0, sources
    assert sum(sources.values()) == out["cached"], sources
    assert totals["redis_loaded_chunks"] >= 1 + 2 + 2 + 1
    assert totals.get("blend_doc_errors", 0) == 0
    assert totals["blend_requests"] == 1 and out["cached"] >= 1024
    assert out["tokens"] == baseline["p2"]["tokens"]
    for t, lp in baseline["p2"]["logprobs"].items():
        assert math.isclose(out["logprobs"][t], lp, abs_tol=2e-4), t


def test_a_document_corrupt_in_redis_is_recomputed_never_served(blend_run, baseline,
                                                                 peaked_mistral, prompts,
                                                                 redis_server,
                                                                 tmp_path_factory):
    """One flipped payload byte in every stored value: an engine with an empty memory tier
    must catch each one on its fetch (and delete it), recompute the documents, and answer
    as vLLM alone does, with full reuse (ratio 0) where nothing else would be recomputed."""
    assert blend_run[15] == [True]
    c = redis_server.client()
    damaged = {}
    for key in c.scan_iter(match=b"blend:*"):
        value = c.get(key)
        if value is not None and len(value) > 4096:  # chunk values, not descriptors
            damaged[key] = value[:-1] + bytes([value[-1] ^ 0x01])
            c.set(key, damaged[key])
    assert len(damaged) >= 4
    # An in-process engine: the test above covers the multi-process one (which imports
    # vLLM twice at each start).
    res = run_engine(tmp_path_factory.mktemp("blend-redis-corrupt"), {
        "model": peaked_mistral, "max_model_len": MAX_LEN,
        "connector": _blend_config(redis_server.url), "steps": [
            {"op": "generate", "prompts": [prompts.p3], "params": RATIO_0},
            {"op": "totals"}]}, runner="blend_runner.py", timeout=600)
    out, totals = res[0][0], res[1]
    assert out["tokens"] == baseline["p3"]["tokens"]
    assert totals.get("blend_doc_errors", 0) >= 1, totals
    assert totals.get("redis_loaded_chunks", 0) == 0, totals
    # Each damaged value it fetched was deleted (and its document stored again, recomputed).
    assert any(c.get(k) != v for k, v in damaged.items())


def test_no_state_leaks_after_blends_preemptions_and_aborts(peaked_mistral, stress_prompts,
                                                            baseline, tmp_path_factory):
    steps = [{"op": "stress", "prompts": stress_prompts, "max_tokens": STRESS_TOKENS,
              "abort_after_steps": 6}, {"op": "totals"}, {"op": "outstanding", "drain": True}]
    res = run_engine(tmp_path_factory.mktemp("blend-stress"), {
        "model": peaked_mistral, "kv_cache_bytes": 3 << 20, "max_model_len": 1024,
        "prefix_caching": True, "steps": steps,
        "connector": {**_blend_config(), "blend_recompute_ratio": 1.0}},
        runner="blend_runner.py", timeout=600)
    stress, totals, outstanding = res
    assert stress["resumed"] > 0, "the workload was meant to preempt requests"
    assert totals["blend_requests"] > 0
    assert len(stress["tokens"]) == len(stress_prompts) - len(stress["aborted"])
    assert all(v == 0 for v in outstanding["scheduler"].values()), outstanding
    assert all(v == 0 for w in outstanding["workers"] for v in w.values()), outstanding
    # Requests that survived preemption (and blends) still match vLLM alone.
    for i in range(len(stress_prompts)):
        if f"stress-{i}" in stress["tokens"]:
            assert stress["tokens"][f"stress-{i}"] == baseline["stress"][i], i


def test_qwen2_blends_exactly_after_vllms_own_hit_and_moves_documents_exactly(
        sep, tmp_path_factory):
    """Qwen2 (q/k/v biases), one layer, vLLM's prefix cache on.

    Ratio 1.0 after vLLM's own hit on the shared system prompt and first document (which
    the blend reads as context) equals full prefill. With one layer, K and V depend on the
    token and its position only, so full reuse (ratio 0) of documents moved to new
    positions equals full prefill too exactly when re-rotation is right, and so does any
    partial recompute (the default selection is run after vLLM's hit)."""
    model = build_model(CACHE / "tiny-qwen2-1layer", tiny_tokenizer_dir(CACHE), arch="qwen2",
                        num_layers=1, qk_scale=4.0)
    p = Prompts(sep)
    rng, avoid = random.Random(5), set(sep)
    ask = _join([p.s1, p.d1, p.d3, p.d2, _tokens(rng, 50, avoid)], sep)
    moved = _join([p.s2, p.d3, p.d2, p.d1, _tokens(rng, 50, avoid)], sep)
    # vLLM's hit on S1 D1 D2, then S2 and D3 moved, blended by the default selection: the
    # prompt's tail and its last queries read vLLM's hit as context.
    picked = _join([p.s1, p.d1, p.d2, p.s2, p.d3, _tokens(rng, 50, avoid)], sep)
    steps = [{"op": "generate", "prompts": [p.p1]},
             {"op": "generate", "prompts": [ask], "params": RATIO_1, "logprobs": 20},
             {"op": "generate", "prompts": [moved], "params": RATIO_0, "logprobs": 20},
             {"op": "generate", "prompts": [picked], "logprobs": 20},
             {"op": "totals"}]
    spec = {"model": model, "max_model_len": MAX_LEN, "steps": steps, "prefix_caching": True}
    res = run_engine(tmp_path_factory.mktemp("qwen2"), {
        **spec, "connector": {**_blend_config(), "blend_check_layer": 0}},
        runner="blend_runner.py", timeout=600)
    base = run_engine(tmp_path_factory.mktemp("qwen2-base"), {
        **spec, "connector": None, "steps": steps[1:4]}, runner="blend_runner.py", timeout=600)
    totals = res[4]
    shared = (len(p.s1) + len(sep) + len(p.d1)) // 128 * 128  # vLLM's own hit for ``ask``
    shared_picked = (len(p.s1) + len(p.d1) + len(p.d2) + 2 * len(sep)) // 128 * 128
    assert totals["blend_requests"] == 3 and totals["load_errors"] == 0
    assert totals["blend_tokens"] == (_blended(ask) - shared + _blended(moved)
                                      + _blended(picked) - shared_picked)
    for out, ref, prompt_ids in ((res[1][0], base[0][0], ask), (res[2][0], base[1][0], moved),
                                 (res[3][0], base[2][0], picked)):
        assert out["cached"] == _blended(prompt_ids)
        assert out["tokens"] == ref["tokens"]
        for t, lp in ref["logprobs"].items():
            assert math.isclose(out["logprobs"][t], lp, abs_tol=2e-4), t


def test_a_model_blend_cannot_serve_fails_at_start_up(tmp_path_factory):
    model = build_model(CACHE / "tiny-llama-longrope", tiny_tokenizer_dir(CACHE), arch="llama",
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "longrope",
                                         "short_factor": [1.0] * 16, "long_factor": [4.0] * 16,
                                         "original_max_position_embeddings": 1024})
    with pytest.raises(RuntimeError) as e:
        run_engine(tmp_path_factory.mktemp("refused"), {
            "model": model, "connector": {"blend": True}, "steps": []},
            runner="blend_runner.py", timeout=600)
    assert "blend is on but cannot serve this engine" in str(e.value)
    assert "Phi3LongRoPEScaledRotaryEmbedding does not rotate by a plain table lookup" in str(
        e.value)


QUALITY_TRIALS = 8


def test_quality_full_reuse_is_worse_than_blend_which_is_worse_than_recompute(
        tmp_path_factory):
    """On a model with peaked attention: the first-token distribution's distance from full
    prefill, per strategy, over many reordered-document prompts (printed; the benchmark
    records it). Full reuse must be clearly worse than cacheblend at 0.15, the default
    (attention at 0.15) within a third of full reuse's distance, and ratio 1.0 about zero."""
    from tests import blend_quality as q

    model = build_model(CACHE / "tiny-llama-peaked", tiny_tokenizer_dir(CACHE), arch="llama",
                        num_layers=3, qk_scale=4.0, logit_scale=8.0, local_bias=3.0)
    pairs, vocab = q.trials(QUALITY_TRIALS), q.vocab_size(model)
    spec = {"model": model, "max_model_len": MAX_LEN, "max_logprobs": vocab}
    res = run_engine(tmp_path_factory.mktemp("quality"), {
        **spec, "steps": q.blend_steps(pairs, vocab), "connector": {
            **_blend_config(), "memory_capacity": "256MiB", "blend_separator_ids": q.SEP}},
        runner="blend_runner.py", timeout=900)
    base = run_engine(tmp_path_factory.mktemp("quality-base"), {
        **spec, "steps": q.baseline_steps(pairs, vocab), "connector": None},
        runner="blend_runner.py", timeout=900)
    table = q.score(res, base)
    print("\n" + q.format_table(table))
    reuse, blend, attention, full = (table[k]["kl_mean"] for k in (
        "full reuse (ratio 0)", "cacheblend 0.15", "attention 0.15", "ratio 1.0"))
    assert full < 1e-4 and table["ratio 1.0"]["top1"] == 1.0
    assert blend < 0.8 * reuse
    assert min(blend, attention) > 100 * full
    # The default strategy meets the goal here: at most a third of full reuse's
    # gap (measured 0.17 on these trials), and it beats the paper's selection.
    assert attention <= reuse / 3 and attention < blend
    assert all(r["cached"] >= 512 for asked in res[1::2] for r in asked)  # all blended


def test_blended_kv_never_reaches_requests_that_expect_it_exact(peaked_mistral, prompts,
                                                               baseline, tmp_path_factory):
    """Issue 20: with vLLM's own prefix cache on (its default), the blocks of a blended
    request were cached under the prompt's exact block hashes, and a later request of the
    same prompt that is not blended (or blended at a higher ratio) read them as exact."""
    p = prompts
    res = run_engine(tmp_path_factory.mktemp("blend-prefix-cache"), {
        "model": peaked_mistral, "max_model_len": MAX_LEN, "prefix_caching": True,
        "connector": _blend_config(), "steps": [
            {"op": "generate", "prompts": [p.p1]},  # stores the documents
            {"op": "generate", "prompts": [p.p2], "params": RATIO_0},  # approximate
            {"op": "generate", "prompts": [p.p2], "params": {"blend": False}},
            {"op": "generate", "prompts": [p.p2], "params": RATIO_1}]},
        runner="blend_runner.py", timeout=600)
    approximate, plain, exact = (r[0] for r in res[1:])
    assert approximate["cached"] == _blended(p.p2)
    assert approximate["tokens"] != baseline["p2"]["tokens"], "the test needs a difference"
    assert plain["tokens"] == baseline["p2"]["tokens"] and plain["cached"] == 0
    assert exact["tokens"] == baseline["p2"]["tokens"]


def test_documents_computed_in_a_failed_blend_are_never_stored(peaked_mistral, prompts,
                                                               baseline, tmp_path_factory):
    """Issue 20: a blend that fails leaves its range unwritten while the step's forward
    pass reads it; a document new in that range was saved from those blocks. Saved once
    vLLM recomputed it, it gives full prefill's tokens at its stored position (ratio 0)."""
    p = prompts
    res = run_engine(tmp_path_factory.mktemp("blend-failed"), {
        "model": peaked_mistral, "max_model_len": MAX_LEN, "connector": _blend_config(),
        "steps": [
            {"op": "generate", "prompts": [p.p1]},  # 0: S1, D1, D2, D3
            {"op": "break_blend", "broken": True},  # 1
            {"op": "generate", "prompts": [p.p5], "params": RATIO_0},  # 2: fails
            {"op": "break_blend", "broken": False},  # 3
            {"op": "totals"},  # 4
            {"op": "generate", "prompts": [p.p5], "params": RATIO_0},  # 5: all stored
            {"op": "totals"}]}, runner="blend_runner.py", timeout=600)
    failed, first, served, second = res[2][0], res[4], res[5][0], res[6]
    assert failed["tokens"] == baseline["p5"]["tokens"]  # recomputed by vLLM
    assert first["load_errors"] == 1 and first.get("blend_requests", 0) == 0
    assert served["cached"] == _blended(p.p5)
    assert second["blend_requests"] == 1 and second.get("blend_doc_errors", 0) == 0
    assert served["tokens"] == baseline["p5"]["tokens"]


def test_a_blend_that_would_cost_full_prefill_is_served_as_usual(peaked_mistral, prompts,
                                                                 baseline, tmp_path_factory):
    """Issue 20: on a 2-layer model the check layer is the whole model, so blending would
    be slower than full prefill (1.15x measured): with the default ``blend_max_cost`` the
    reordered prompt is served as usual."""
    p = prompts
    cfg = {k: v for k, v in _blend_config().items() if k != "blend_max_cost"}
    res = run_engine(tmp_path_factory.mktemp("blend-declined"), {
        "model": peaked_mistral, "max_model_len": MAX_LEN, "connector": cfg, "log_stats": True,
        "steps": [{"op": "generate", "prompts": [p.p1]},
                  {"op": "generate", "prompts": [p.p2]},
                  {"op": "metrics"}]}, runner="blend_runner.py", timeout=600)
    served, metrics = res[1][0], res[2]
    assert metrics.get("blend_requests", 0) == 0 and metrics["blend_declined"] == 1
    assert served["tokens"] == baseline["p2"]["tokens"][:len(served["tokens"])]


def test_a_blend_beside_a_load_of_its_prefix_never_reads_it_unloaded(
        peaked_mistral, prompts, baseline, tmp_path_factory):
    """A blend runs before the step's forward pass and reads the blocks of vLLM's hit. When
    that hit is blocks another request of the same step loads from memory, a load that went
    layer by layer (beside the forward) would leave them unwritten for the blend: such a
    step loads whole. Here the plain prompt loads its chunks while ``on_plain`` (its first
    four blocks, then documents) arrives in the same step and is blended on them."""
    p = prompts
    cfg = {**_blend_config(), **RATIO_1, "load_by_layer": True}
    res = run_engine(tmp_path_factory.mktemp("blend-beside-layer-load"), {
        "model": peaked_mistral, "max_model_len": MAX_LEN, "prefix_caching": True,
        "connector": cfg, "steps": [
            {"op": "generate", "prompts": [p.p1, p.plain]},  # 0: documents, plain's chunks
            {"op": "reset_prefix_cache"},  # 1: kvconnector's memory keeps them
            {"op": "memory_loads_by_layer", "late_s": 0.3},  # 2: and vLLM's KV is noise
            {"op": "arrivals", "first": p.plain, "with_first": p.on_plain},  # 3
            {"op": "totals"},  # 4
            {"op": "reset_prefix_cache"},  # 5
            {"op": "arrivals", "first": p.plain},  # 6: alone, the load goes by layer
            {"op": "totals"}]}, runner="blend_runner.py", timeout=600)
    assert res[1] and res[2], "the worker must be able to load layer by layer"
    beside, before, alone, after = res[3], res[4], res[6], res[7]
    assert beside["first"]["cached"] == alone["first"]["cached"] == _blended(p.plain)
    assert beside["with_first"]["cached"] == _blended(p.on_plain)
    assert beside["first"]["tokens"] == alone["first"]["tokens"] == baseline["plain"]["tokens"]
    assert beside["with_first"]["tokens"] == baseline["on_plain"]["tokens"]
    assert before["blend_requests"] == 1 and before.get("layer_loads", 0) == 0
    assert after["layer_loads"] == 1  # the same load without a blend beside it


def test_a_blend_whose_hit_shrank_while_it_waited_never_gives_exact_requests_its_kv(
        peaked_mistral, prompts, baseline, tmp_path_factory):
    """A blend salts vLLM's block hashes from the end of vLLM's hit when it matches. Left
    waiting (no room in the step) while vLLM evicts the end of that hit, it is blended from
    the shorter hit on, so the blocks between must be salted too: cached under their plain
    hashes, they gave the same prompt, served exactly, blended KV."""
    p = prompts
    rng = random.Random(11)
    filler = _tokens(rng, MAX_LEN - 2, set(p.sep))  # leaves no room for P2's 3-token tail
    res = run_engine(tmp_path_factory.mktemp("blend-hit-shrank"), {
        "model": peaked_mistral, "max_model_len": MAX_LEN, "prefix_caching": True,
        "connector": {**_blend_config(), **RATIO_0},
        "llm": {"enable_chunked_prefill": False, "max_num_batched_tokens": MAX_LEN},
        "steps": [
            {"op": "generate", "prompts": [p.p1]},  # 0: stores the documents
            {"op": "generate", "prompts": [p.p2[:513]], "params": {"blend": False}},  # 1
            {"op": "evicted_while_waiting", "filler": filler, "prompt": p.p2,
             "evict_from": 3},  # 2: P2 matched with a hit of 4 blocks, blended from 3
            {"op": "generate", "prompts": [p.p2], "params": {"blend": False}}]},  # 3
        runner="blend_runner.py", timeout=600)
    waited, exact = res[2], res[3][0]
    assert waited["unscheduled"] and waited["evicted"] == 1
    assert waited["salted_at"] == [512, 384]
    assert waited["waited"]["tokens"] != baseline["p2"]["tokens"], "needs blended KV to differ"
    assert exact["tokens"] == baseline["p2"]["tokens"]


def test_blend_is_visible_on_metrics(blend_run):
    """Issue 20: blended requests, reused and recomputed tokens, blend time, documents,
    prompts without a separator reach vLLM's Prometheus registry (/metrics)."""
    metrics, totals = blend_run[17], blend_run[18]
    assert metrics["blend_requests"] == totals["blend_requests"] > 0
    assert metrics["blend_seconds"] == totals["blend_requests"]  # one observation each
    assert metrics["blend_loaded_tokens"] == totals["blend_loaded_tokens"] > 0
    assert metrics["blend_recomputed_tokens"] == totals["blend_recomputed_tokens"] > 0
    assert metrics["blend_saved_docs"] == totals["blend_saved_docs"] > 0
    assert metrics["blend_doc_errors"] == totals["blend_doc_errors"] > 0  # the lost D2
    assert metrics["blend_unsegmented"] == 2  # the plain prompt, twice
    assert metrics.get("blend_failures", 0) == 0
