"""Hits to the last full block, on the scheduler half alone, at 16-token blocks (GPU
backends' size, which a real engine on the CPU build cannot run: it uses 128).

Unit tests: ``SchedulerHalf`` is real; vLLM's Request, blocks and SchedulerOutput are small
fakes carrying only the fields the connector reads. The same behaviour at the CPU build's
128-token blocks is tested on real engines in test_engine.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvconnector import compat
from kvconnector.config import ConnectorConfig
from kvconnector.keys import ChunkKey, Fingerprint, chunk_hashes, partial_chunk_hash
from kvconnector.lookups import Lookups
from kvconnector.metadata import WorkerReport
from kvconnector.scheduler import SchedulerHalf
from tests.conftest import prompt
from tests.scheduler_fakes import FakeRedis, FakeRequest, blocks_of, step_output

BS, CHUNK = 16, 64  # 4 blocks per chunk
FP = Fingerprint(model="m", revision="", model_config_digest="d", dtype="float32",
                 kv_layout="chunk", block_size=BS, num_layers=1, num_kv_heads=2, head_size=8,
                 tp_size=1, chunk_size=CHUNK, namespace="")


@pytest.fixture
def half(monkeypatch) -> SchedulerHalf:
    monkeypatch.setattr(compat, "fingerprint", lambda *a: FP)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=256, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
    config = ConnectorConfig(chunk_size=CHUNK, memory_capacity=64 * spec.real_page_size_bytes * 4)
    return SchedulerHalf(config, vllm_config, kv)


def run_request(half: SchedulerHalf, req: FakeRequest, block_ids: list[int], outputs: int,
                status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED) -> list:
    """Prefill in one step, decode ``outputs - 1`` steps, finish. Returns each step's plan."""
    rid = req.request_id
    n, ext = half.get_num_new_matched_tokens(req, 0)
    half.update_state_after_alloc(req, blocks_of(block_ids), n)
    req.status = RequestStatus.RUNNING
    plans = [half.build_meta(step_output({rid: req.num_tokens - n}, {rid: block_ids},
                                         {rid: block_ids}))]
    req.num_computed_tokens = req.num_tokens
    req.all_token_ids.append(7)
    for i in range(outputs - 1):
        plans.append(half.build_meta(step_output({rid: 1}, {rid: block_ids})))
        req.num_computed_tokens += 1
        req.all_token_ids.append(100 + i)
    req.status = status
    half.request_finished(req, block_ids)
    return plans


def saved(plans) -> list[tuple[int, list[int]]]:
    return [(t.index, t.block_ids) for p in plans for t in p.saves]


def test_prompt_and_finished_request_store_their_last_full_blocks(half):
    a = FakeRequest("a", prompt(1, 100))  # 6 full blocks: chunk 0 and 2 blocks of chunk 1
    plans = run_request(half, a, list(range(10, 18)), outputs=20)
    # Prefill: chunk 0, then the prompt's 2 blocks of chunk 1; nothing while decoding.
    assert saved(plans) == [(0, [10, 11, 12, 13]), (1, [14, 15, -1, -1])]
    # Finished with 119 tokens computed (7 blocks): chunk 1's first 3 blocks, planned for
    # the next step, since vLLM already took the blocks back.
    assert half.has_pending_saves()
    nxt = half.build_meta(step_output({}, {}, {"b": [16, 40]}))
    assert [(t.index, t.block_ids) for t in nxt.finished_saves] == [(1, [14, 15, 16, -1])]
    assert nxt.fence == {"a"}, "block 16 handed out again while its save is queued"
    assert not half.has_pending_saves()
    h = chunk_hashes(a.all_token_ids, CHUNK, FP.digest())[0]
    assert nxt.finished_saves[0].chunk_hash == partial_chunk_hash(h, a.all_token_ids[64:112])


def test_repeated_prompt_and_next_turn_reload_all_but_the_last_block(half):
    a = FakeRequest("a", prompt(1, 100))
    run_request(half, a, list(range(10, 18)), outputs=20)
    half.build_meta(step_output({}, {}))
    again = FakeRequest("again", prompt(1, 100))
    assert half.get_num_new_matched_tokens(again, 0) == (96, False)  # 6 of 7 blocks
    half.update_state_after_alloc(again, blocks_of(list(range(30, 37))), 96)
    plan = half.build_meta(step_output({"again": 4}, {"again": list(range(30, 37))}))
    assert [(t.index, t.block_ids) for t in plan.loads] == [
        (0, [30, 31, 32, 33]), (1, [34, 35, -1, -1])]
    # Turn 2: a's prompt and answer (120 tokens, 119 computed) and a new message.
    turn2 = FakeRequest("turn2", a.all_token_ids + prompt(2, 10))
    assert half.get_num_new_matched_tokens(turn2, 0) == (112, False)  # a's 7 full blocks


def test_partial_keys_never_equal_full_chunk_keys():
    tokens = prompt(3, 2 * CHUNK)
    full = chunk_hashes(tokens, CHUNK, FP.digest())
    assert partial_chunk_hash(full[0], tokens[CHUNK:]) != full[1]
    assert partial_chunk_hash(full[0], tokens[CHUNK:CHUNK + BS]) != \
        partial_chunk_hash(full[0], tokens[CHUNK:CHUNK + 2 * BS])


def test_aborted_request_saves_nothing_at_finish(half):
    a = FakeRequest("a", prompt(1, 100))
    run_request(half, a, list(range(10, 18)), outputs=20, status=RequestStatus.FINISHED_ABORTED)
    assert not half.has_pending_saves()


def test_partial_needs_the_chunks_before_it(half):
    a = FakeRequest("a", prompt(1, 100))
    for i in range(half.index.num_slots):  # a full pool cannot store chunk 0 ...
        half.index.allocate(i.to_bytes(16, "big"))
    plans = run_request(half, a, list(range(10, 18)), outputs=2)
    assert saved(plans) == []  # ... so its partial (unreachable) is not stored either
    assert not half.has_pending_saves()


def test_failed_partial_load_is_not_offered_again(half):
    run_request(half, FakeRequest("a", prompt(1, 100)), list(range(10, 18)), outputs=2)
    half.build_meta(step_output({}, {}))
    b = FakeRequest("b", prompt(1, 100))
    assert half.get_num_new_matched_tokens(b, 0) == (96, False)
    half.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=WorkerReport(failed_loads={"b": 1})))
    assert half.get_num_new_matched_tokens(b, 0) == (64, False)


def test_outstanding_is_empty_after_the_finish_saves_ran(half):
    run_request(half, FakeRequest("a", prompt(1, 100)), list(range(10, 18)), outputs=20)
    assert half.outstanding()["planned_finished_saves"] == 1
    half.build_meta(step_output({}, {}))
    assert all(v == 0 for v in half.outstanding().values()), half.outstanding()


def test_partial_chunk_found_in_redis(half):
    tokens = prompt(1, 100)
    h0 = chunk_hashes(tokens, CHUNK, FP.digest())[0]
    stored = {str(ChunkKey(FP.digest(), 0, h0)),
              str(ChunkKey(FP.digest(), 0, partial_chunk_hash(h0, tokens[64:80])))}
    redis = FakeRedis(stored)
    half.prefix.lookups = Lookups(redis, 1.0)
    half.get_num_new_matched_tokens(FakeRequest("other", prompt(3, 40)), 0)  # not alone
    req = FakeRequest("r", tokens)
    assert half.get_num_new_matched_tokens(req, 0) == (None, False)  # asked, not answered
    redis.gate.set()
    deadline = time.monotonic() + 5
    while (answer := half.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert answer == (80, True)  # chunk 0 and 1 block of chunk 1, loaded asynchronously
    assert len(redis.asked) == 1 and len(redis.asked[0]) == 3  # 1 full, 2 partial
    half.update_state_after_alloc(req, blocks_of(list(range(7))), 80)
    plan = half.build_meta(step_output({}, {}))
    assert [(t.index, t.block_ids, t.source) for t in plan.async_loads] == [
        (0, [0, 1, 2, 3], "redis"), (1, [4, -1, -1, -1], "redis")]
    half.prefix.lookups.shutdown()


def test_a_lone_request_waits_for_its_redis_answer_others_ask_again(half, monkeypatch):
    """With no other request in the engine, the first match waits (briefly) for Redis:
    vLLM would otherwise spin an idle step before asking again. With another request
    live, the scheduler never waits on the network."""
    tokens = prompt(1, 100)
    h0 = chunk_hashes(tokens, CHUNK, FP.digest())[0]
    redis = FakeRedis({str(ChunkKey(FP.digest(), 0, h0))})
    threading.Timer(0.05, redis.gate.set).start()  # Redis answers 50 ms after asked
    half.lookups = half.prefix.lookups = Lookups(redis, 1.0)
    monkeypatch.setattr("kvconnector.scheduler.IDLE_WAIT_S", 5.0)  # a slow machine too
    try:
        assert half.get_num_new_matched_tokens(FakeRequest("r", tokens), 0) == (64, False)
        redis.gate.clear()  # answered only once the test lets it
        other = FakeRequest("s", prompt(2, 100))
        assert half.get_num_new_matched_tokens(other, 0) == (None, False)
        redis.gate.set()
    finally:
        half.prefix.lookups.shutdown()


def test_vllm_s_own_full_hit_asks_no_tier(half):
    """When vLLM's prefix cache already holds every block a load could fill (all but the
    last token's), nothing is looked up: no hashing of the tiers, and above all no Redis
    question, whose answer would hold the request back a step (or a wait when alone)."""
    tokens = prompt(1, 100)
    redis = FakeRedis(set())  # would answer only once the gate opens
    half.lookups = half.prefix.lookups = Lookups(redis, 1.0)
    try:
        assert half.get_num_new_matched_tokens(FakeRequest("r", tokens), 96) == (0, False)
        assert half.get_num_new_matched_tokens(FakeRequest("s", tokens), 80) == (None, False)
        redis.gate.set()  # vLLM's hit one block short: Redis is asked about that block
        half.prefix.lookups.wait(5)
        assert len(redis.asked) == 1
    finally:
        half.prefix.lookups.shutdown()


def _redis_hit(half: SchedulerHalf, req: FakeRequest, others: int = 0):
    """``req``'s answer once Redis (holding chunk 0 and one block of chunk 1) answered."""
    tokens = req.all_token_ids
    h0 = chunk_hashes(tokens, CHUNK, FP.digest())[0]
    redis = FakeRedis({str(ChunkKey(FP.digest(), 0, h0)),
                       str(ChunkKey(FP.digest(), 0, partial_chunk_hash(h0, tokens[64:80])))})
    redis.gate.set()
    half.lookups = half.prefix.lookups = Lookups(redis, 1.0)
    for i in range(others):
        half.get_num_new_matched_tokens(FakeRequest(f"other{i}", prompt(3 + i, 40)), 0)
    deadline = time.monotonic() + 5
    while (answer := half.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return answer


def test_a_lone_request_fetches_its_redis_hit_before_its_own_step(half):
    """Alone in the engine, a Redis hit loads like a memory hit: promoted into slots that the
    worker fills before the forward (no step parked in WAITING_FOR_REMOTE_KVS, nothing left
    arriving). With another request live it is parked, as before."""
    req = FakeRequest("r", prompt(1, 100))
    try:
        assert _redis_hit(half, req) == (80, False)
        half.update_state_after_alloc(req, blocks_of(list(range(7))), 80)
        plan = half.build_meta(step_output({"r": 20}, {"r": list(range(7))},
                                           {"r": list(range(7))}))
        assert not plan.async_loads
        assert [(t.index, t.block_ids, t.source) for t in plan.loads] == [
            (0, [0, 1, 2, 3], "redis"), (1, [4, -1, -1, -1], "redis")]
        assert all(t.slot >= 0 for t in plan.loads)
        assert half.outstanding()["arriving"] == 0  # nothing waits for a report
        assert all(t.chunk_hash in half.index for t in plan.loads)
    finally:
        half.prefix.lookups.shutdown()


def test_a_lone_request_over_the_sync_fetch_bound_is_parked(half):
    half.prefix.sync_fetch_max_bytes = half.prefix.chunk_bytes  # the hit needs two chunks
    try:
        assert _redis_hit(half, FakeRequest("r", prompt(1, 100))) == (80, True)
    finally:
        half.prefix.lookups.shutdown()


def test_a_lone_request_waits_for_chunks_still_arriving_for_another(half):
    """A chunk promoted for a parked request is not readable until that request's fetch is
    reported: a lone request sharing it is parked too, never loads it before it arrives."""
    first = FakeRequest("first", prompt(1, 100))
    try:
        assert _redis_hit(half, first, others=1) == (80, True)
        half.update_state_after_alloc(first, blocks_of(list(range(7))), 80)
        half.build_meta(step_output({}, {}))
        first.status = RequestStatus.FINISHED_ABORTED
        half.request_finished(first, list(range(7)))  # aborted while parked
        half.request_finished(FakeRequest("other0", prompt(3, 40)), [])
        second = FakeRequest("second", prompt(1, 100))
        assert half.get_num_new_matched_tokens(second, 0) == (80, True)
        half.update_state_after_alloc(second, blocks_of(list(range(10, 17))), 80)
        plan = half.build_meta(step_output({}, {}))
        assert [t.source for t in plan.async_loads] == ["memory", "memory"]
        assert not plan.loads
    finally:
        half.prefix.lookups.shutdown()


def test_a_step_that_schedules_nothing_waits_for_the_redis_answers(half, monkeypatch):
    """While requests only wait for Redis, vLLM runs steps with nothing to compute: such a
    step (and only such a step) waits for the answers asked, so the next step finds them."""
    tokens = prompt(1, 100)
    h0 = chunk_hashes(tokens, CHUNK, FP.digest())[0]
    redis = FakeRedis({str(ChunkKey(FP.digest(), 0, h0))})
    half.lookups = half.prefix.lookups = Lookups(redis, 1.0)
    monkeypatch.setattr("kvconnector.scheduler.IDLE_WAIT_S", 5.0)
    try:
        half.get_num_new_matched_tokens(FakeRequest("other", prompt(3, 40)), 0)  # not alone
        req = FakeRequest("r", tokens)
        assert half.get_num_new_matched_tokens(req, 0) == (None, False)
        busy = step_output({"other": 40}, {"other": [9]})
        threading.Timer(0.3, redis.gate.set).start()  # Redis answers 0.3 s after asked
        start = time.monotonic()
        assert not half.build_meta(busy).idle  # a step that computes never waits
        assert time.monotonic() - start < 0.25
        assert half.build_meta(step_output({}, {})).idle  # waits for the answer
        assert half.get_num_new_matched_tokens(req, 0) == (64, True)
    finally:
        redis.gate.set()
        half.prefix.lookups.shutdown()


def test_a_request_that_opts_out_neither_loads_nor_stores(half):
    """``kv_transfer_params: {"kvconnector": false}``: the chunks held for its prompt are
    not offered, and none of its own are stored."""
    a = FakeRequest("a", prompt(1, 100))
    run_request(half, a, list(range(10, 18)), outputs=2)
    half.build_meta(step_output({}, {}))
    out = FakeRequest("out", prompt(1, 100), params={"kvconnector": False})
    assert half.get_num_new_matched_tokens(out, 0) == (0, False)
    fresh = FakeRequest("fresh", prompt(3, 100), params={"kvconnector": False})
    plans = run_request(half, fresh, list(range(40, 48)), outputs=5)
    plans.append(half.build_meta(step_output({}, {})))
    assert saved(plans) == [] and not any(p.finished_saves for p in plans)
    again = FakeRequest("again", prompt(1, 100), params={"kvconnector": True})
    assert half.get_num_new_matched_tokens(again, 0) == (96, False)
