"""Real engines sharing one real Redis: cross-process reuse, and Redis faults that must cost
misses only (every request completes with the baseline's tokens)."""

from __future__ import annotations

import pytest

from tests.conftest import prompt, run_engine
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.engine

CHUNK = 256
P1, P2, P3, P4 = prompt(11, 700), prompt(12, 600), prompt(13, 800), prompt(14, 600)
# P1: 2 full chunks and a partial chunk of 1 block (128 tokens on CPU), P2-P4 full chunks
# only (their last full block ends a chunk): a hit on P1 is 3 chunks, all but its last block.
P1_HIT, P2_HIT = 640, 2 * CHUNK


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory):
    res = run_engine(tmp_path_factory.mktemp("redis-base"), {
        "model": tiny_model, "connector": None,
        "steps": [{"op": "generate", "prompts": [P1, P2, P3, P4]}]})
    return [r["tokens"] for r in res[0]]


@pytest.fixture
def redis_server():
    with RedisServer(unixsocket=True) as server:
        yield server


def test_second_engine_serves_first_engines_chunks(tiny_model, tmp_path_factory, baseline,
                                                   redis_server):
    """The first engine writes over TCP, the second reads over the server's unix socket:
    one Redis, two ways to it (docs/benchmarks.md sections 15 and 17 measure both)."""
    extra = {"memory_capacity": "64MiB", "redis_url": redis_server.url,
             "redis_key_prefix": "e2e", "load_by_layer": True}  # "auto" skips 2 layers
    first = run_engine(tmp_path_factory.mktemp("redis-a"), {
        "model": tiny_model, "connector": extra, "steps": [
            {"op": "generate", "prompts": [P1]}, {"op": "flush"}, {"op": "redis_stats"}]})
    assert first[2]["puts"] >= 2
    assert len(redis_server.client().keys("e2e:*")) >= 2
    over_unix = {**extra, "redis_url": redis_server.unix_url}
    second = run_engine(tmp_path_factory.mktemp("redis-b"), {
        "model": tiny_model, "connector": over_unix, "log_stats": True, "steps": [
            {"op": "generate", "prompts": [P1]}, {"op": "totals"},
            {"op": "cached_by_source"},
            {"op": "generate", "prompts": [P2]}, {"op": "generate", "prompts": [P3]},
            {"op": "generate", "prompts": [P4]}, {"op": "scheduler_redis_stats"}]})
    out, totals = second[0][0], second[1]
    assert second[2] == {"external_unspecified": P1_HIT}  # vLLM's label for a remote store
    # P1, the first, opened the scheduler's connection on the lookup thread; P2-P4, each
    # alone in the engine, were asked on the scheduler's thread (unless a reply took over
    # 5 ms on a loaded machine each time) and computed as vLLM alone computes them
    assert [second[i][0]["tokens"] for i in (3, 4, 5)] == baseline[1:]
    assert second[6]["lookups"] == 4 and second[6]["inline_lookups"] >= 1, second[6]
    assert out["cached"] == P1_HIT  # the partial chunk is in Redis too
    assert totals["redis_loaded_chunks"] == 3 and totals["load_errors"] == 0
    # the hit's breakdown (issue 24): the fetch, the copy into vLLM's blocks, and how long
    # the forward waited for its layers (the hit was read layer by layer during it)
    assert totals["phase_seconds.redis_fetch"] > 0 and totals["phase_seconds.load_copy"] > 0
    assert totals["layer_loads"] == 1 and "phase_seconds.layer_wait" in totals
    assert first[0][0]["tokens"] == baseline[0]
    assert out["tokens"] == baseline[0]


def test_reset_hides_redis_chunks_from_this_engine_only(tiny_model, tmp_path_factory, baseline,
                                                        redis_server):
    """After a cache reset the engine finds none of the chunks stored before it, Redis
    included; an engine that did not reset still finds them."""
    extra = {"memory_capacity": "64MiB", "redis_url": redis_server.url}
    first = run_engine(tmp_path_factory.mktemp("redis-reset"), {
        "model": tiny_model, "connector": extra, "steps": [
            {"op": "generate", "prompts": [P1]}, {"op": "flush"},
            {"op": "reset_prefix_cache", "reset_connector": True},
            {"op": "generate", "prompts": [P1]}, {"op": "flush"}, {"op": "totals"}]})
    assert first[2] is True
    assert first[3][0]["cached"] == 0 and first[5]["redis_loaded_chunks"] == 0
    assert first[3][0]["tokens"] == baseline[0]
    assert len(redis_server.client().keys("kvc:*")) >= 4  # both generations' chunks
    other = run_engine(tmp_path_factory.mktemp("redis-reset-other"), {
        "model": tiny_model, "connector": extra, "steps": [
            {"op": "generate", "prompts": [P1]}, {"op": "totals"}]})
    assert other[0][0]["cached"] == P1_HIT and other[1]["redis_loaded_chunks"] == 3
    assert other[0][0]["tokens"] == baseline[0]


def test_frozen_redis_holds_up_only_the_request_that_needs_it(tiny_model, tmp_path_factory,
                                                                baseline):
    """Lookups and loads from Redis are asynchronous: with Redis frozen (SIGSTOP) a request
    that needs nothing from it completes, and the one that does is then served from Redis.
    A scheduler that waited on the network could only have given up on Redis (a miss)."""
    port = free_port()
    short = prompt(15, 100)  # under one chunk: nothing to look up
    extra = {"memory_capacity": "1MiB",  # 4 fp32 chunks: P1 leaves memory, stays in Redis
             "redis_url": f"redis://127.0.0.1:{port}", "redis_lookup_budget_ms": 60_000}
    res = run_engine(tmp_path_factory.mktemp("redis-frozen"), {
        "model": tiny_model, "connector": extra, "steps": [
            {"op": "redis_server", "port": port, "action": "start"},  # 0
            {"op": "generate", "prompts": [P1, P2, P3, P4]},  # 1
            {"op": "flush"},  # 2
            {"op": "totals"},  # 3
            {"op": "redis_server", "port": port, "action": "freeze"},  # 4
            {"op": "race", "slow": P1, "fast": short, "port": port},  # 5
            {"op": "totals"}]})  # 6
    race, before, after = res[5], res[3], res[6]
    assert "fast" in race and not race["slow_done_first"]
    assert race["slow"]["cached"] == P1_HIT
    assert race["slow"]["tokens"] == baseline[0]
    assert after["redis_loaded_chunks"] - before["redis_loaded_chunks"] == 3
    assert after["load_errors"] == 0


def test_redis_faults_cost_misses_not_requests(tiny_model, tmp_path_factory, baseline):
    port = free_port()
    extra = {"memory_capacity": "64MiB", "redis_url": f"redis://127.0.0.1:{port}"}
    res = run_engine(tmp_path_factory.mktemp("redis-faults"), {
        "model": tiny_model, "connector": extra, "steps": [
            {"op": "generate", "prompts": [P1]},  # 0: Redis absent at start
            {"op": "redis_stats"},  # 1
            {"op": "redis_server", "port": port, "action": "start"},  # 2
            {"op": "sleep", "seconds": 2.5},  # 3: past the reconnect backoff
            {"op": "generate", "prompts": [P2]},  # 4: reconnects, stores P2
            {"op": "flush"}, {"op": "redis_stats"},  # 5, 6
            {"op": "redis_server", "port": port, "action": "kill"},  # 7: dies mid-run
            {"op": "generate", "prompts": [P1, P2, P3]},  # 8: memory hits, Redis misses
            # 9: its chunks queue right behind P3's, whose put failed: one pipeline a
            # step's saves, so this is the put that must wait out the backoff
            {"op": "generate", "prompts": [prompt(15, 600)]},
            {"op": "flush"}, {"op": "redis_stats"},  # 10, 11
            {"op": "redis_server", "port": port, "action": "restart"},  # 12: empty again
            {"op": "sleep", "seconds": 2.5},  # 13
            {"op": "generate", "prompts": [P4]},  # 14: new chunks go to Redis again
            {"op": "flush"}, {"op": "redis_stats"},  # 15, 16
        ]})
    absent, up, killed, back = res[1], res[6], res[11], res[16]
    assert [r["tokens"] for r in res[0]] == baseline[:1]
    assert absent["errors"] >= 1 and absent["puts"] == 0
    assert up["puts"] >= 2  # P2's chunks reached Redis once it was up
    assert [r["tokens"] for r in res[8]] == baseline[:3]
    # The memory tier still serves while Redis is down.
    assert [r["cached"] for r in res[8][:2]] == [P1_HIT, P2_HIT]
    assert killed["errors"] > up["errors"]
    assert back["puts"] > killed["puts"]  # reconnected after the restart
    assert [r["tokens"] for r in res[14]] == baseline[3:]
    assert back["reconnects"] >= 2  # after the first start and after the restart
    # No storm: failed attempts stay a handful; the rest were skipped during backoff.
    assert back["errors"] <= 5 and back["skipped_in_backoff"] >= 1


def test_chunks_computed_over_a_failed_load_are_never_stored(tiny_model, tmp_path_factory,
                                                             baseline, redis_server):
    """A step whose memory load fails still runs its forward pass over the blocks that were
    never filled, and vLLM recomputes afterwards: the chunks that step computed must not be
    saved (they reached Redis under exact keys, and a second engine served them)."""
    extra = {"memory_capacity": "64MiB", "redis_url": redis_server.url,
             "redis_key_prefix": "failed-load"}
    first = run_engine(tmp_path_factory.mktemp("failed-load-a"), {
        "model": tiny_model, "connector": extra, "steps": [
            {"op": "generate", "prompts": [P1[:300]]},  # stores chunk 0
            {"op": "foreign", "prompt": P1[:300], "chunk": 0},  # its slot: another chunk
            {"op": "generate", "prompts": [P1]},  # loads chunk 0 (fails), computes 1, 2
            {"op": "flush"}, {"op": "totals"}]})
    assert first[1] == [True] and first[4]["load_errors"] == 1
    assert first[2][0]["tokens"] == baseline[0]
    second = run_engine(tmp_path_factory.mktemp("failed-load-b"), {
        "model": tiny_model, "connector": extra, "steps": [
            {"op": "generate", "prompts": [P1]}, {"op": "totals"}]})
    assert second[0][0]["cached"] == P1_HIT and second[1]["redis_loaded_chunks"] == 3
    assert second[0][0]["tokens"] == baseline[0]


def test_a_chunk_on_its_way_from_redis_is_not_read_before_it_arrives(tiny_model, tmp_path,
                                                                     baseline, redis_server):
    """Requests of one step that share a prefix held in Redis only: the first promotes the
    chunks into memory slots (a fetch on the copy thread); the others, finding them in
    the index, read them in a job behind that fetch. Before, they read the slots at once,
    still holding older chunks: caught by the key check, but every hit was recomputed."""
    extra = {"memory_capacity": "64MiB", "redis_url": redis_server.url,
             "redis_key_prefix": "arriving"}
    shared = [[{"prompt": P1 + prompt(40 + i, 50), "max_tokens": 4} for i in range(3)]]
    res = run_engine(tmp_path, {"model": tiny_model, "engines": [
        {"connector": extra, "batches": [[{"prompt": P1, "max_tokens": 8}]]},  # to Redis
        {"connector": extra, "batches": shared}]}, runner="differential_runner.py")
    assert res[0]["outputs"][0][0]["tokens"] == baseline[0]
    outs, totals = res[1]["outputs"][0], res[1]["totals"]
    assert [o["cached"] for o in outs] == [P1_HIT] * 3, outs
    assert totals["load_errors"] == 0 and totals["redis_loaded_chunks"] >= 3, totals


def test_a_value_damaged_in_its_last_layer_is_caught_after_a_layer_by_layer_load(
        tiny_model, tmp_path_factory, baseline, redis_server):
    """A lone request's Redis hit is read layer by layer while its forward runs, before its
    checksum can be checked: bytes damaged in a value's last layer are used by that forward,
    caught before the step ends, and vLLM recomputes the chunk's blocks and drops the step's
    token. The answer is the baseline's; the same load whole before the forward too."""
    extra = {"memory_capacity": "64MiB", "redis_url": redis_server.url,
             "redis_key_prefix": "damaged-late"}
    first = run_engine(tmp_path_factory.mktemp("damaged-late-a"), {
        "model": tiny_model, "connector": extra, "steps": [
            {"op": "generate", "prompts": [P2]}, {"op": "flush"},
            {"op": "redis_keys", "prompts": [P2]}]})
    key = first[2][0][1]  # P2's second chunk
    client = redis_server.client()
    good = client.get(key)
    runs = {}
    for by_layer in (True, False):
        client.set(key, good[:-3] + bytes([good[-3] ^ 0xFF]) + good[-2:])
        runs[by_layer] = run_engine(tmp_path_factory.mktemp("damaged-late-b"), {
            "model": tiny_model, "connector": {**extra, "load_by_layer": by_layer},
            "steps": [{"op": "generate", "prompts": [P2]}, {"op": "totals"},
                      {"op": "redis_stats"}]})
    for by_layer, (outs, totals, stats) in runs.items():
        assert outs[0]["tokens"] == baseline[1], by_layer
        assert totals["load_errors"] == 1 and totals["redis_loaded_chunks"] == 1, totals
        assert stats["corrupt_reasons"] == {"checksum": 1}, stats
        assert totals.get("layer_loads", 0) == (1 if by_layer else 0), totals


def test_the_key_mirror_answers_lookups_and_a_flush_costs_only_a_miss(tiny_model, tmp_path,
                                                                      baseline, redis_server):
    """With ``redis_key_mirror`` the scheduler answers lookups from its list of Redis's keys.
    A ``FLUSHALL`` sends no notification per key, so the list still offers P2's chunks: the
    fetch finds nothing, and the request is recomputed with vLLM's tokens."""
    extra = {"memory_capacity": "1MiB",  # 4 fp32 chunks: P3 and P4 push P1 and P2 out
             "redis_url": redis_server.url, "redis_key_prefix": "mirror",
             "redis_key_mirror": True}
    res = run_engine(tmp_path, {
        "model": tiny_model, "connector": extra, "steps": [
            {"op": "generate", "prompts": [P1, P2]},  # 0
            {"op": "flush"}, {"op": "generate", "prompts": [P3, P4]},  # 1, 2
            {"op": "flush"}, {"op": "totals"},  # 3, 4
            {"op": "generate", "prompts": [P1]},  # 5: from Redis
            {"op": "totals"}, {"op": "scheduler_redis_stats"},  # 6, 7
            {"op": "redis_flushall", "url": redis_server.url},  # 8
            {"op": "generate", "prompts": [P2]},  # 9: offered, not found, recomputed
            {"op": "totals"}, {"op": "scheduler_redis_stats"}]})  # 10, 11
    assert [r["tokens"] for r in res[0] + res[2]] == baseline
    before, hit, flushed = res[4], res[6], res[10]
    assert res[5][0]["tokens"] == baseline[0] and res[5][0]["cached"] == P1_HIT
    assert hit["redis_loaded_chunks"] - before.get("redis_loaded_chunks", 0) >= 1
    assert hit["load_errors"] == 0
    # every request after the first few was looked up in the mirror, none asked Redis
    assert res[7]["mirror_lookups"] >= 3 and res[7]["lookups"] - res[7]["mirror_lookups"] <= 2
    assert res[9][0]["tokens"] == baseline[1]
    assert flushed["load_errors"] >= 1 and res[11]["mirror_lookups"] > res[7]["mirror_lookups"]
