"""Differential tests: greedy tokens with the connector, whatever it stores and evicts,
equal vLLM alone's. Memory tiers smaller than the workload, Redis behind them or not."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tests import differential
from tests.blend_models import build_model, tiny_tokenizer_dir
from tests.conftest import CACHE, run_engine
from tests.redis_server import RedisServer

pytestmark = pytest.mark.engine


def _issue19_prompts() -> list[list[int]]:
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(4, 400) for _ in range(n)]

    l1 = fresh(3000)
    l2, l3 = l1[:1024] + fresh(1900), fresh(2000)
    return [l1, l1, l2, l1, l3, l2, l3, l1]


CAPACITIES = ["256KiB", "512KiB", "1MiB", "3MiB"]  # 1, 2, 4 and 12 chunks


def test_small_memory_tier_with_redis_behind_it_serves_vllms_tokens(tiny_model, tmp_path):
    """Issue 19: one request at a time, long prompts sharing a prefix, a memory tier of a
    few chunks. With Redis behind it, 5 of 8 answers differed from vLLM alone's: one plan
    placed several chunks into one slot, and Redis received the last one's bytes under
    every key, with a valid checksum."""
    seq = [[{"prompt": p, "max_tokens": 16}] for p in _issue19_prompts()]
    with RedisServer() as redis:
        engines = [{"connector": None, "batches": seq}]
        for cap in CAPACITIES:
            engines.append({"connector": {"memory_capacity": cap}, "batches": seq})
            engines.append({"connector": {"memory_capacity": cap, "redis_url": redis.url,
                                          "redis_key_prefix": f"cap{cap}",
                                          "load_by_layer": True}, "batches": seq})
        res = run_engine(tmp_path, {"model": tiny_model, "engines": engines},
                         runner="differential_runner.py")
    want = [b[0]["tokens"] for b in res[0]["outputs"]]
    for engine, r in zip(engines[1:], res[1:], strict=True):
        got = [b[0]["tokens"] for b in r["outputs"]]
        cached = [b[0]["cached"] for b in r["outputs"]]
        assert got == want, (engine["connector"], cached)
        assert sum(cached) > 0, (engine["connector"], cached)  # the store was used
        if "redis_url" in engine["connector"]:
            assert r["totals"]["redis_loaded_chunks"] > 0, engine["connector"]
            assert r["totals"]["load_errors"] == 0, engine["connector"]
            # a lone request's Redis hit is read layer by layer while its forward runs
            assert r["totals"]["layer_loads"] > 0, engine["connector"]


SEEDS = range(3)  # scripts/differential.py runs as many more as you give it time


@pytest.fixture(scope="module")
def shared_redis():
    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workloads_match_vllm_alone(tiny_model, tmp_path, shared_redis, seed):
    w = differential.workload(seed, shared_redis.url, disk_dir=tmp_path / "disk")
    problems = differential.run(tiny_model, tmp_path, w)
    assert not problems, "\n".join(problems)
    assert differential.cached_tokens(tmp_path) > 0  # the workload did hit the caches
    if any("redis_url" in e["connector"] and not e["connector"].get("redis_key_mirror")
           for e in w.engines):
        # lone requests' lookups were read on the scheduler's thread, among the others
        assert differential.total(tmp_path, "lookup_inline_lookups") > 0


@pytest.fixture(scope="module")
def blend_model() -> str:
    return build_model(CACHE / "tiny-mistral-qk4", tiny_tokenizer_dir(CACHE), arch="mistral",
                       qk_scale=4.0)


@pytest.mark.parametrize("seed", range(2))
def test_random_blends_at_ratio_1_match_vllm_alone(blend_model, tmp_path, shared_redis, seed):
    """Documents in random orders and overlaps, stored and evicted through small memory
    tiers and Redis, blended with every token recomputed: vLLM alone's tokens."""
    w = differential.blend_workload(seed, shared_redis.url, disk_dir=tmp_path / "disk")
    problems = differential.run(blend_model, tmp_path, w)
    assert not problems, "\n".join(problems)
    assert differential.total(tmp_path, "blend_requests") > 0


def _fresh(rng: random.Random) -> Callable[[int], list[int]]:
    """Fresh tokens from ``rng``, never a blend separator."""
    return lambda k: [rng.randrange(5, 400) for _ in range(k)]


def _joined(*parts: list[int]) -> list[int]:
    """The parts of a blend prompt, a separator between each two."""
    out = list(parts[0])
    for part in parts[1:]:
        out += differential.BLEND_SEPARATOR + part
    return out


def test_a_blend_reading_blocks_another_request_computes_in_its_step_matches_vllm_alone(
        blend_model, tmp_path):
    """vLLM caches a block when it allocates it, so a request can hit blocks another
    request of the same step has yet to compute. A blend runs before the forward pass and
    read them unwritten: here the second request of prompt x hits the two blocks prompt y
    computes in that step (seed 16179 of scripts/differential.py, made explicit). Such a
    blend is not run; vLLM recomputes its range."""
    rng = random.Random(16179)
    fresh = _fresh(rng)

    system, d1, d2, d3, d4 = [1] + fresh(44), fresh(187), fresh(114), fresh(151), fresh(335)
    x = _joined(system, d1, d2, d3, d4, fresh(10))  # 852 tokens: blended up to 768
    y = _joined(system, d1, d2, fresh(101), fresh(58))  # shares x's first two blocks
    z = _joined([1] + fresh(52), d4, fresh(101), fresh(40))  # stores d4
    w = differential.Workload(16179, [x, y, z], differential.BLEND_MAX_MODEL_LEN)
    w.engines.append({"connector": {
        "memory_capacity": 4 * differential.CHUNK_BYTES, "blend": True,
        "blend_separator_ids": differential.BLEND_SEPARATOR, "blend_recompute_ratio": 1.0,
        "blend_max_cost": 1.0, "blend_min_tokens": 128},
        "prefix_caching": True, "kv_cache_bytes": 64 << 20,
        "max_model_len": differential.BLEND_MAX_MODEL_LEN})
    w.batches.append([[(2, 4, None)], [(0, 12, None), (1, 5, None), (0, 19, None)]])
    problems = differential.run(blend_model, tmp_path, w)
    assert not problems, "\n".join(problems)
    assert differential.total(tmp_path, "blend_requests") > 0
    assert differential.total(tmp_path, "blend_prefix_unready") == 1  # the race was met


def test_a_blend_twin_that_waited_a_step_never_stores_blended_kv_as_exact(blend_model,
                                                                         tmp_path):
    """Two requests of one prompt, both matched for blending in one step; vLLM schedules
    the first and has no room left for the second (chunked prefill off, a filler fills the
    step). A step later the second hits the first's blended blocks under its salted
    hashes, and was served and saved as a plain request: its approximate chunks went to
    the disk tier under exact prefix keys, and an engine without blend loaded them."""
    rng = random.Random(5)
    fresh = _fresh(rng)

    system, d1, d2, d3 = [1] + fresh(44), fresh(250), fresh(250), fresh(250)
    first = _joined(system, d1, d2, d3, fresh(20))  # stores the documents
    prompt = _joined(system, d3, d1, d2, fresh(30))  # blended at ratio 0 up to 768
    max_len = differential.BLEND_MAX_MODEL_LEN
    filler = fresh(max_len - (len(prompt) - 768) - 5)  # leaves less than the twin's tail
    disk = {"memory_capacity": "64MiB", "disk_path": str(tmp_path / "disk"),
            "disk_capacity": "64MiB"}
    blend = {**disk, "blend": True, "blend_separator_ids": differential.BLEND_SEPARATOR,
             "blend_recompute_ratio": 0.0, "blend_max_cost": 1.0, "blend_min_tokens": 128}

    def one(p: list[int]) -> dict:
        return {"prompt": p, "max_tokens": 8}

    res = run_engine(tmp_path, {"model": blend_model, "engines": [
        {"connector": None, "max_model_len": max_len, "batches": [[one(prompt)]]},
        {"connector": blend, "max_model_len": max_len, "prefix_caching": True,
         "llm": {"enable_chunked_prefill": False, "max_num_batched_tokens": max_len},
         "batches": [[one(first)], [one(prompt), one(filler), one(prompt)]]},
        {"connector": disk, "max_model_len": max_len, "batches": [[one(prompt)]]},
    ]}, runner="differential_runner.py")
    exact = res[0]["outputs"][0][0]["tokens"]
    blended, _, twin = res[1]["outputs"][1]
    assert blended["cached"] == twin["cached"] == 768
    assert blended["tokens"] != exact, "the test needs blended KV to change the answer"
    assert res[2]["outputs"][0][0]["tokens"] == exact
