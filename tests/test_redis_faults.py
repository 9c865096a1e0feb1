"""Redis values that cannot be loaded after the lookup said they were there: every request
must still finish, with the baseline's tokens, and within a time limit (a hang fails the
test instead of stalling CI). Each fault costs one failed load per request, then a miss."""

from __future__ import annotations

import pytest

from tests.conftest import prompt, run_engine
from tests.redis_server import RedisServer

pytestmark = pytest.mark.engine

CHUNK = 256
SWAP_A, SWAP_B, EMPTY, HUGE, INTACT = (prompt(300 + i, 600) for i in range(5))
PARKED = [prompt(310 + i, 600) for i in range(12)]  # the kill between lookup and fetch
TIMEOUT_S = 180  # a request that never finishes ends the engine run here


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory):
    res = run_engine(tmp_path_factory.mktemp("faults-base"), {
        "model": tiny_model, "connector": None,
        "steps": [{"op": "generate", "prompts": [SWAP_A, SWAP_B, EMPTY, HUGE, INTACT,
                                                 *PARKED]}]})
    return [r["tokens"] for r in res[0]]


@pytest.fixture(scope="module")
def tampered(tiny_model, tmp_path_factory):
    """A first engine stores every prompt in Redis; the test damages the first chunk of
    some; a second engine (empty memory) asks for all of them, then Redis is killed while
    twelve requests wait for chunks it said it held."""
    with RedisServer() as server:
        # A generous lookup budget: every lookup must answer, however busy the machine.
        extra = {"memory_capacity": "64MiB", "redis_url": server.url,
                 "redis_lookup_budget_ms": 10_000}
        prompts = [SWAP_A, SWAP_B, EMPTY, HUGE, INTACT, *PARKED]
        writer = run_engine(tmp_path_factory.mktemp("faults-writer"), {
            "model": tiny_model, "connector": extra, "steps": [
                {"op": "generate", "prompts": prompts}, {"op": "flush"},
                {"op": "redis_keys", "prompts": prompts}]})
        keys = writer[2]
        c = server.client()
        a, b = c.get(keys[0][0]), c.get(keys[1][0])
        c.set(keys[0][0], b)  # well-formed values under each other's keys
        c.set(keys[1][0], a)
        c.set(keys[2][0], b"")
        c.set(keys[3][0], c.get(keys[3][0]) + bytes(20 << 20))  # 20 MB more than it says
        reader = run_engine(tmp_path_factory.mktemp("faults-reader"), {
            "model": tiny_model, "connector": extra, "steps": [
                {"op": "generate", "prompts": [SWAP_A, SWAP_B, EMPTY, HUGE, INTACT]},  # 0
                {"op": "totals"}, {"op": "redis_stats"},  # 1, 2
                {"op": "fault_while_parked", "prompts": PARKED, "fault": "kill",
                 "pid": server.proc.pid},  # 3
                {"op": "totals"}]}, timeout=TIMEOUT_S)  # 4
        return writer, reader


def test_damaged_first_chunks_cost_one_recompute(tampered, baseline):
    writer, reader = tampered
    outs, totals, stats = reader[0], reader[1], reader[2]
    assert [r["tokens"] for r in writer[0]] == baseline
    assert [r["tokens"] for r in outs] == baseline[:5]
    assert outs[4]["cached"] == 2 * CHUNK, "the intact prompt is served from Redis"
    assert [r["cached"] for r in outs[:4]] == [0, 0, 0, 0]
    # One failed load per damaged prompt: never planned again for the same request.
    assert totals["load_errors"] == 4, totals
    reasons = stats["corrupt_reasons"]
    assert reasons.get("key") == 2 and reasons.get("too_short") == 1, reasons
    assert reasons.get("too_large") == 1, reasons


def test_redis_killed_between_lookup_and_fetch(tampered, baseline):
    _, reader = tampered
    parked, before, after = reader[3], reader[1], reader[4]
    assert parked["parked"] == len(PARKED), "the lookup was meant to find every chunk"
    assert parked["tokens"] == baseline[5:]
    # Both chunks of each request failed once, and were never planned again.
    assert after["load_errors"] - before["load_errors"] == 2 * len(PARKED)


def test_keys_expiring_while_the_request_waits(tiny_model, tmp_path_factory, baseline):
    """No fault at all: a TTL shorter than the wait. The first prompt leaves the 4-chunk
    memory tier, so its hit is in Redis only; its keys expire while its load is queued."""
    with RedisServer() as server:
        extra = {"memory_capacity": "1MiB", "redis_url": server.url, "redis_ttl_s": 4,
                 "redis_lookup_budget_ms": 10_000}
        res = run_engine(tmp_path_factory.mktemp("faults-ttl"), {
            "model": tiny_model, "connector": extra, "steps": [
                {"op": "generate", "prompts": [SWAP_A, SWAP_B, EMPTY]},  # 0
                {"op": "flush"},  # 1
                {"op": "fault_while_parked", "prompts": [SWAP_A], "fault": "sleep",
                 "seconds": 4.5},  # 2
                {"op": "totals"}, {"op": "redis_stats"}]}, timeout=TIMEOUT_S)
    parked, totals, stats = res[2], res[3], res[4]
    assert parked["parked"] == 1, "the lookup was meant to find the chunks in Redis"
    assert parked["tokens"] == baseline[:1]
    assert stats["misses"] >= 2 and totals["load_errors"] >= 1
