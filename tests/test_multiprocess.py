"""vLLM's default mode, scheduler and workers in separate processes (each engine start there
imports vLLM twice, so one engine runs every scenario in turn): a repeat loads from the
store, a load split with the copy helper, weights changed and the caches reset."""

from __future__ import annotations

import os

import pytest

from tests.conftest import prompt, run_engine

pytestmark = pytest.mark.engine

P1 = prompt(1, 700)  # 2 full chunks and 1 full block of chunk 2 (640 tokens), 60 more
P1_HIT = 640  # a repeat reloads all of P1 but its last (partial) block
MEM = {"memory_capacity": "64MiB"}
# Scaling the embeddings changes every layer's KV, and this model's output with it.
SCALE = {"op": "scale_weight", "name": "model.embed_tokens.weight", "factor": 4.0}
TIMEOUT = 300


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory) -> dict:
    """vLLM alone: P1's tokens with the model's weights, then with them scaled."""
    res = run_engine(tmp_path_factory.mktemp("mp-base"), {
        "model": tiny_model, "connector": None, "steps": [
            {"op": "generate", "prompts": [P1]}, SCALE,
            {"op": "generate", "prompts": [P1]}]}, timeout=TIMEOUT)
    return {"P1": res[0][0]["tokens"], "x4": res[2][0]["tokens"]}


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> list:
    return run_engine(tmp_path_factory.mktemp("mp"), {
        "model": tiny_model, "connector": MEM, "steps": [
            {"op": "generate", "prompts": [P1]},  # 0: stores P1
            {"op": "generate", "prompts": [P1]},  # 1: loads it
            {"op": "totals"},  # 2
            {"op": "every_load_to_the_helper"},  # 3
            {"op": "generate", "prompts": [P1]},  # 4: loads it, half on the helper
            {"op": "totals"},  # 5
            SCALE,  # 6
            {"op": "reset_prefix_cache", "reset_connector": True},  # 7
            {"op": "generate", "prompts": [P1]},  # 8: recomputed with the new weights
            {"op": "generate", "prompts": [P1]}]},  # 9: stored again, reused
        multiprocess=True, timeout=TIMEOUT)


def test_repeated_prompt_loads_from_the_store(run, baseline):
    assert run[1][0]["cached"] == P1_HIT and run[2]["loaded_chunks"] == 3
    assert run[0][0]["tokens"] == run[1][0]["tokens"] == baseline["P1"]


def test_a_load_split_with_the_helper_gives_the_same_tokens(run, baseline):
    """A worker computing on one thread copies half of a load on the core vLLM left spare
    (here every load, however small): the answer is vLLM alone's."""
    if len(os.sched_getaffinity(0)) > 1:  # a 1-core machine has no core to spare
        assert run[3], "no load helper on a worker with a core to spare"
    assert run[4][0]["cached"] == P1_HIT
    assert run[5]["loaded_chunks"] - run[2]["loaded_chunks"] == 3
    assert run[4][0]["tokens"] == baseline["P1"]


def test_reset_reaches_the_scheduler_and_the_workers(run, baseline):
    """The reset reaches the scheduler's connector in the engine-core process, and the
    workers (another process) follow the keys it plans."""
    assert run[7] is True
    assert run[8][0]["cached"] == 0 and run[8][0]["tokens"] == baseline["x4"]
    assert run[9][0]["cached"] == P1_HIT and run[9][0]["tokens"] == baseline["x4"]
