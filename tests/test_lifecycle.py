"""vLLM's lifecycle with the connector on: weights changed in place, cache resets, sleep and
wake, a cache reset right after a request, and blocks handed out again while their saves
are still queued. Real engines (CPU build), tiny random-weight Mistral."""

from __future__ import annotations

import pytest

from tests.conftest import prompt, run_engine

pytestmark = pytest.mark.engine

CHUNK = 256
P1 = prompt(1, 700)  # 2 full chunks and a partial chunk of 1 block
P2 = prompt(2, 700)
HIT = 640  # all of a 700-token prompt but its last block (128 tokens on CPU)
MEM = {"memory_capacity": "64MiB"}
QUEUED = {**MEM, "inline_save_max_kib": 0}  # every save on the copy thread, behind its gate
# Scaling the embeddings changes every layer's KV, and this model's output with it.
SCALE = {"op": "scale_weight", "name": "model.embed_tokens.weight", "factor": 4.0}
TIMEOUT = 300


@pytest.fixture(scope="module")
def new_weights(tiny_model, tmp_path_factory):
    """Tokens of fresh engines (no connector) with the weights scaled once and twice."""
    res = run_engine(tmp_path_factory.mktemp("fresh-weights"), {
        "model": tiny_model, "connector": None, "steps": [
            {"op": "generate", "prompts": [P1, P2]}, SCALE,
            {"op": "generate", "prompts": [P1]}, SCALE,
            {"op": "generate", "prompts": [P1]}]}, timeout=TIMEOUT)
    return {"P1": res[0][0]["tokens"], "P2": res[0][1]["tokens"],
            "x4": res[2][0]["tokens"], "x16": res[4][0]["tokens"]}


@pytest.fixture(scope="module")
def updated(tiny_model, tmp_path_factory):
    return run_engine(tmp_path_factory.mktemp("weights-update"), {
        "model": tiny_model, "connector": MEM, "log_stats": True, "steps": [
            {"op": "generate", "prompts": [P1]},  # 0: stores P1's 2 chunks
            {"op": "reset_prefix_cache"},  # 1: vLLM's own cache only, right after a request
            {"op": "generate", "prompts": [P1]},  # 2: the connector still serves P1
            SCALE,  # 3: weights changed in place, no reset yet
            {"op": "generate", "prompts": [P1]},  # 4: stale KV reused (documented)
            {"op": "reset_prefix_cache", "reset_connector": True},  # 5
            {"op": "generate", "prompts": [P1]},  # 6: recomputed with the new weights
            {"op": "generate", "prompts": [P1]},  # 7: stored again, reused
            SCALE,  # 8
            {"op": "sleep_wake", "level": 1},  # 9: sleep resets every cache too
            {"op": "generate", "prompts": [P1]},  # 10
            {"op": "totals"},  # 11
            {"op": "cached_by_source"},  # 12
            {"op": "scheduler_attr", "name": "requires_kv_delivery"}]}, timeout=TIMEOUT)  # 13


def test_reset_prefix_cache_right_after_a_request_succeeds(updated, new_weights):
    assert updated[1] is True
    warm = updated[2][0]
    assert warm["cached"] == HIT and warm["tokens"] == new_weights["P1"]


def test_hits_from_memory_are_labelled_host_in_vllms_metrics(updated):
    assert updated[12] == {"host": 3 * HIT}  # steps 2, 4 and 7


def test_vllm_is_told_a_miss_is_acceptable(updated):
    assert updated[13] is False  # kv_both would make vLLM treat our saves as hand-offs


def test_without_a_reset_stored_kv_is_reused(updated, new_weights):
    """The connector cannot see weights change: until the cache is reset it serves KV
    computed with the old weights, and the output differs from the new weights' output."""
    stale = updated[4][0]
    assert stale["cached"] == HIT
    assert stale["tokens"] != new_weights["x4"]


def test_reset_after_a_weight_update_serves_the_new_weights(updated, new_weights):
    assert updated[5] is True
    after, again = updated[6][0], updated[7][0]
    assert after["cached"] == 0, "a chunk stored before the reset was loaded"
    assert after["tokens"] == new_weights["x4"]
    assert again["cached"] == HIT  # what was stored after the reset is reused
    assert again["tokens"] == new_weights["x4"]


def test_sleep_and_wake_forget_stored_kv(updated, new_weights):
    assert updated[9] is True
    woken = updated[10][0]
    assert woken["cached"] == 0
    assert woken["tokens"] == new_weights["x16"]
    assert updated[11]["load_errors"] == 0


def test_blocks_handed_out_again_wait_for_their_queued_saves(tiny_model, tmp_path_factory,
                                                             new_weights):
    """A finished request's blocks go back to vLLM at once. Here its saves are stuck behind
    the closed copy gate while the next prompt needs the same blocks (a KV cache of 8
    blocks): that step must wait for the saves, or they would copy the next prompt's KV and
    seal it under P1's keys."""
    res = run_engine(tmp_path_factory.mktemp("fence"), {
        "model": tiny_model, "connector": QUEUED, "kv_cache_bytes": 9 << 17,
        "max_model_len": 1024, "steps": [
            {"op": "copy_gate", "close": True},  # 0
            {"op": "generate", "prompts": [P1]},  # 1: its saves stay queued
            {"op": "reset_prefix_cache"},  # 2: its blocks are free nonetheless
            {"op": "copy_gate", "close": False, "after_s": 2.0},  # 3
            {"op": "generate", "prompts": [P2], "timed": True},  # 4: reuses P1's blocks
            {"op": "generate", "prompts": [P1]},  # 5: loads what was saved
            {"op": "totals"}]}, timeout=TIMEOUT)
    assert res[2] is True
    assert res[4][0]["seconds"] >= 1.5, "the step reusing P1's blocks did not wait"
    assert res[4][0]["tokens"] == new_weights["P2"]
    assert res[5][0]["cached"] == HIT and res[6]["load_errors"] == 0
    assert res[5][0]["tokens"] == new_weights["P1"]


def test_saves_planned_at_finish_read_the_blocks_before_they_are_reused(tiny_model,
                                                                        tmp_path_factory):
    """A finished request's last blocks are saved in the next step, after vLLM took them
    back. Here that save waits behind the closed copy gate while the next prompt reuses the
    blocks (a KV cache of 9 blocks): the step must wait for it, and the chunk it stored
    must be the finished request's, which the next turn of its chat then reloads."""
    first = prompt(3, 600)  # 4 full blocks: no partial chunk at the end of the prompt
    answer_tokens = 60  # 659 tokens computed: 5 full blocks, the 5th stored at the finish
    spec = {"model": tiny_model, "kv_cache_bytes": 9 << 17, "max_model_len": 1024}
    res = run_engine(tmp_path_factory.mktemp("finish-fence"), {**spec, "connector": QUEUED,
                                                                "steps": [
        {"op": "generate", "prompts": [first], "max_tokens": answer_tokens},  # 0
        {"op": "copy_gate", "close": True},  # 1: the finish save will queue behind it
        {"op": "copy_gate", "close": False, "after_s": 1.5},  # 2
        {"op": "generate", "prompts": [P1], "timed": True},  # 3: reuses first's blocks
        {"op": "totals"}]}, timeout=TIMEOUT)  # 4
    turn2 = first + res[0][0]["tokens"] + prompt(5, 40)
    res += run_engine(tmp_path_factory.mktemp("finish-fence-turn2"), {
        **spec, "connector": MEM, "steps": [
            {"op": "generate", "prompts": [first], "max_tokens": answer_tokens},  # 5
            {"op": "generate", "prompts": [P1]},  # 6: reuses the blocks
            {"op": "generate", "prompts": [turn2]},  # 7: loads the chunk saved at finish
            {"op": "totals"}]}, timeout=TIMEOUT)  # 8
    base = run_engine(tmp_path_factory.mktemp("finish-fence-base"), {
        **spec, "connector": None, "steps": [{"op": "generate", "prompts": [turn2]}]},
        timeout=TIMEOUT)
    assert res[3][0]["seconds"] >= 1.0, "the step reusing the blocks did not wait"
    assert res[4]["saved_chunks"] >= 3  # first's chunks 0 and 1, and its 5th block
    hit = res[7][0]
    assert hit["cached"] == (len(first) + answer_tokens - 1) // 128 * 128 == 640
    assert hit["tokens"] == base[0][0]["tokens"]
    assert res[8]["load_errors"] == 0
