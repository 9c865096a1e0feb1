"""Prefix reuse under tensor parallelism (TP=2, one worker process per rank on the CPU
build): each rank stores and loads its own shard, in memory and through Redis; a shard that
one rank cannot load costs a miss on every rank, never a mixed KV; an engine of another TP
size never loads these shards."""

from __future__ import annotations

import os

import pytest

from tests.conftest import prompt, run_engine
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="TP=2 binds one core per rank: needs 2 cores")]

TP2 = {"tp": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}  # one core per rank
INTACT, DAMAGED = prompt(500, 700), prompt(501, 600)
TIMEOUT_S = 300  # a request that never finishes ends the engine run here


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """A TP=2 engine first computes both prompts as vLLM alone does (they opt out of the
    connector: nothing loaded or stored), then stores both (memory and Redis) and hits its
    memory; the test damages rank 1's shard of DAMAGED's first chunk in Redis; a second
    TP=2 engine and a TP=1 engine then ask Redis for both.

    The baseline is that first step rather than an engine without the connector: a TP=2
    engine start costs about a minute on 2 cores (two worker processes import vLLM), and
    an opted-out request's hooks do nothing (``test_engine.py`` checks it on one rank)."""
    with RedisServer() as server:
        extra = {"memory_capacity": "64MiB", "redis_url": server.url,
                 "redis_lookup_budget_ms": 10_000}
        writer = run_engine(tmp_path_factory.mktemp("tp-writer"), {
            **TP2, "model": tiny_model, "connector": extra, "steps": [
                {"op": "generate", "prompts": [INTACT, DAMAGED],
                 "kv_transfer_params": {"kvconnector": False}},  # 0: vLLM alone's tokens
                {"op": "totals"},  # 1
                {"op": "generate", "prompts": [INTACT, DAMAGED]},  # 2: stores both
                {"op": "generate", "prompts": [INTACT]},  # 3: memory hit
                {"op": "totals"}, {"op": "flush"},  # 4, 5
                {"op": "redis_keys", "prompts": [INTACT, DAMAGED], "rank": 0},  # 6
                {"op": "redis_keys", "prompts": [INTACT, DAMAGED], "rank": 1}]},  # 7
            timeout=TIMEOUT_S)
        c = server.client()
        rank0, rank1 = writer[6], writer[7]
        present = [bool(c.exists(k)) for keys in rank0 + rank1 for k in keys]
        c.set(rank1[1][0], c.get(rank1[0][0]))  # INTACT's shard under DAMAGED's key
        reader = run_engine(tmp_path_factory.mktemp("tp-reader"), {
            **TP2, "model": tiny_model, "connector": extra, "steps": [
                {"op": "generate", "prompts": [INTACT, DAMAGED]}, {"op": "totals"}]},
            timeout=TIMEOUT_S)
        tp1 = run_engine(tmp_path_factory.mktemp("tp1-reader"), {
            "model": tiny_model, "connector": extra, "steps": [
                {"op": "generate", "prompts": [INTACT]}, {"op": "totals"}]},
            timeout=TIMEOUT_S)
        return writer, present, reader, tp1


@pytest.fixture(scope="module")
def baseline(runs) -> list[list[int]]:
    """INTACT's and DAMAGED's tokens from vLLM alone (the writer's opted-out step)."""
    return [r["tokens"] for r in runs[0][0]]


def test_the_baseline_step_stayed_out_of_the_connector(runs):
    writer = runs[0]
    assert [r["cached"] for r in writer[0]] == [0, 0]
    totals = writer[1]
    assert all(totals.get(k, 0) == 0 for k in ("saved_chunks", "loaded_chunks",
                                                 "redis_loaded_chunks")), totals
    assert [r["cached"] for r in writer[2]] == [0, 0]  # nothing stored for the next step


def test_each_rank_stores_its_shard_and_memory_hits_give_the_same_tokens(runs, baseline):
    writer, present, _, _ = runs
    assert [r["tokens"] for r in writer[2]] == baseline
    assert writer[3][0]["tokens"] == baseline[0]
    assert writer[3][0]["cached"] == 640  # two full chunks and a partial one of one block
    assert writer[4]["loaded_chunks"] == 2 * 3  # both ranks, three chunks each
    assert all(present), "every chunk of both prompts in Redis, for both ranks"


def test_another_engine_loads_both_shards_from_redis(runs, baseline):
    _, _, reader, _ = runs
    intact = reader[0][0]
    assert intact["tokens"] == baseline[0] and intact["cached"] == 640
    assert reader[1]["redis_loaded_chunks"] >= 2 * 3


def test_a_shard_one_rank_cannot_load_costs_a_miss_on_every_rank(runs, baseline):
    """Rank 0 loads DAMAGED's first chunk, rank 1 refuses it: the request is recomputed,
    never served with rank 0's loaded KV beside rank 1's recomputed one."""
    _, _, reader, _ = runs
    damaged = reader[0][1]
    assert damaged["tokens"] == baseline[1]
    # Alone in the engine, its Redis hit loads before its step (a synchronous load):
    # vLLM counts the hit it scheduled as cached, and keeps it after the load failed
    # and the blocks were recomputed (docs/operations.md, load errors).
    assert damaged["cached"] == 512
    assert reader[1]["load_errors"] >= 1


def test_an_engine_of_another_tp_size_never_loads_these_shards(runs, baseline):
    _, _, _, tp1 = runs
    assert tp1[0][0]["cached"] == 0
    # Not even tried: a load refused by its header check would count a load error.
    assert tp1[1].get("redis_loaded_chunks", 0) == 0 and tp1[1].get("load_errors", 0) == 0
