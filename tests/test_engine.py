"""Real vLLM engine (CPU build) on a tiny random-weight Mistral: output with KV loaded from
the store must equal a run without the connector, token for token."""

from __future__ import annotations

import pytest

from tests.conftest import prompt, run_engine
from tests.redis_server import RedisServer

pytestmark = pytest.mark.engine

CHUNK = 256
BLOCK = 128  # the CPU build's block size
P1 = prompt(1, 700)  # 2 full chunks and 1 full block of chunk 2 (640 tokens), 60 more
P1_HIT = 640  # a repeat reloads all of P1 but its last (partial) block
P2 = prompt(2, 1100)  # 4 full chunks
P3 = P2[:2 * CHUNK] + prompt(3, 600)  # shares exactly 2 chunks with P2
T1 = prompt(4, 400)  # chat turn 1 prompt; its answer runs into chunk 2
ANSWER = 300  # T1 + answer: 700 tokens, 699 computed: 5 full blocks
CHURN = [prompt(100 + i, 600) for i in range(10)]
MEM = {"memory_capacity": "64MiB"}
QUEUED = {**MEM, "inline_save_max_kib": 0}  # every save on the copy thread (the fence tests)


def _delta(after: dict, before: dict, key: str) -> float:
    return after[key] - before[key]


@pytest.fixture(scope="module")
def fp32_run(tiny_model, tmp_path_factory):
    steps = [
        {"op": "generate", "prompts": [P1]},  # 0: cold, stores P1's chunks
        {"op": "generate", "prompts": [P1]},  # 1: repeat, loads them
        {"op": "totals"},  # 2
        {"op": "generate", "prompts": [P2]},  # 3
        {"op": "totals"},  # 4
        {"op": "generate", "prompts": [P3]},  # 5: shares 2 chunks with P2
        {"op": "totals"},  # 6
        {"op": "foreign", "prompt": P1, "chunk": 0},  # 7: its slot now holds another key
        {"op": "generate", "prompts": [P1]},  # 8: refused -> recomputed
        {"op": "totals"},  # 9
        {"op": "generate", "prompts": [T1], "max_tokens": ANSWER},  # 10: chat turn 1
    ]
    results = run_engine(tmp_path_factory.mktemp("fp32"), {
        "model": tiny_model, "connector": MEM, "steps": steps})
    answer = results[10][0]["tokens"]
    t2 = T1 + answer + prompt(5, 50)
    turn2 = run_engine(tmp_path_factory.mktemp("fp32-chat"), {
        "model": tiny_model, "connector": MEM, "steps": [
            {"op": "generate", "prompts": [T1], "max_tokens": ANSWER},
            {"op": "generate", "prompts": [t2]},
            {"op": "totals"}]})
    return results, t2, turn2


@pytest.fixture(scope="module")
def fp32_baseline(tiny_model, tmp_path_factory, fp32_run):
    _, t2, _ = fp32_run
    res = run_engine(tmp_path_factory.mktemp("fp32-base"), {
        "model": tiny_model, "connector": None, "steps": [
            {"op": "generate", "prompts": [P1, P2, P3, t2]},
            {"op": "generate", "prompts": [T1], "max_tokens": ANSWER}]})
    (p1, p2, p3, t2_out), (t1,) = res
    return {"P1": p1["tokens"], "P2": p2["tokens"], "P3": p3["tokens"],
            "T2": t2_out["tokens"], "T1": t1["tokens"]}


def test_repeated_prompt_loads_from_store_fp32(fp32_run, fp32_baseline):
    results, _, _ = fp32_run
    cold, warm, totals = results[0][0], results[1][0], results[2]
    assert cold["cached"] == 0
    # 2 full chunks and the prompt's last full block (a partial chunk): all but the last
    # block, which vLLM computes (it needs one prompt token left).
    assert warm["cached"] == P1_HIT == (len(P1) - 1) // BLOCK * BLOCK
    assert totals["saved_chunks"] == 3 and totals["loaded_chunks"] == 3
    assert totals["loaded_tokens"] == P1_HIT and totals["loaded_bytes"] > 0
    assert cold["tokens"] == fp32_baseline["P1"]
    assert warm["tokens"] == fp32_baseline["P1"]


def test_shared_prefix_loads_exactly_the_shared_chunks(fp32_run, fp32_baseline):
    results, _, _ = fp32_run
    before, after = results[4], results[6]
    p3 = results[5][0]
    assert p3["cached"] == 2 * CHUNK
    assert _delta(after, before, "loaded_chunks") == 2
    assert p3["tokens"] == fp32_baseline["P3"]


def test_slot_holding_another_key_is_refused(fp32_run, fp32_baseline):
    """A memory slot is loaded only if it is sealed under the chunk's key."""
    results, _, _ = fp32_run
    assert results[7] == [True]
    before, after = results[6], results[9]
    assert _delta(after, before, "load_errors") >= 1
    assert results[8][0]["tokens"] == fp32_baseline["P1"]


def test_corrupt_value_in_redis_is_detected_and_recomputed(tiny_model, tmp_path_factory,
                                                           fp32_baseline):
    """Corruption where it can happen (bytes that left the process): one flipped payload
    bit in a Redis value is caught by its checksum, the value deleted, its blocks recomputed."""
    with RedisServer() as server:
        extra = {**MEM, "redis_url": server.url, "redis_lookup_budget_ms": 10_000}
        writer = run_engine(tmp_path_factory.mktemp("redis-flip-w"), {
            "model": tiny_model, "connector": extra, "steps": [
                {"op": "generate", "prompts": [P1]}, {"op": "flush"},
                {"op": "redis_keys", "prompts": [P1]}]})
        key = writer[2][0][0]  # P1's chunk 0
        client = server.client()
        value = bytearray(client.get(key))
        value[-1000] ^= 0x10  # a payload bit, far from the header
        client.set(key, bytes(value))
        # The reader recomputes chunk 0 and stores it again (intact) over the deleted value.
        reader = run_engine(tmp_path_factory.mktemp("redis-flip-r"), {
            "model": tiny_model, "connector": extra, "steps": [
                {"op": "generate", "prompts": [P1]}, {"op": "totals"},
                {"op": "redis_stats"}]})
    out, totals, stats = reader[0][0], reader[1], reader[2]
    assert stats["corrupt_reasons"] == {"checksum": 1} and stats["corrupt_deleted"] == 1
    assert totals["load_errors"] == 1
    # A lone request's Redis hit loads before its step; vLLM counts it as cached when it
    # schedules the request and keeps that count after the load failed (recomputed).
    assert out["cached"] == P1_HIT
    assert out["tokens"] == fp32_baseline["P1"]


def test_a_request_that_opts_out_stores_and_loads_nothing(tiny_model, tmp_path_factory,
                                                          fp32_baseline):
    """``kv_transfer_params: {"kvconnector": false}`` keeps a request out of the cache;
    the requests around it are cached as usual."""
    out = {"kvconnector": False}
    res = run_engine(tmp_path_factory.mktemp("opt-out"), {
        "model": tiny_model, "connector": MEM, "steps": [
            {"op": "generate", "prompts": [P1], "kv_transfer_params": out},  # 0
            {"op": "totals"},  # 1: nothing stored
            {"op": "generate", "prompts": [P1]},  # 2: a miss: stores P1
            {"op": "generate", "prompts": [P1], "kv_transfer_params": out},  # 3: not loaded
            {"op": "totals"},  # 4
            {"op": "generate", "prompts": [P1]},  # 5: loaded
        ]})
    assert res[1]["saved_chunks"] == 0
    assert res[4]["saved_chunks"] == 3 and res[4]["loaded_chunks"] == 0
    assert res[0][0]["cached"] == res[2][0]["cached"] == res[3][0]["cached"] == 0
    assert res[5][0]["cached"] == P1_HIT
    assert all(res[i][0]["tokens"] == fp32_baseline["P1"] for i in (0, 2, 3, 5))


def test_chat_turn2_reuses_turn1_prompt_and_answer(fp32_run, fp32_baseline):
    results, t2, turn2 = fp32_run
    assert results[10][0]["tokens"] == fp32_baseline["T1"]
    turn2_out = turn2[1][0]
    # Turn 1's prompt and answer: 700 tokens, KV of 699, so 5 full blocks (640 tokens):
    # chunks 0-1 and 1 block of chunk 2 (all answer tokens), stored when turn 1 finished.
    assert turn2_out["cached"] == (len(T1) + ANSWER - 1) // BLOCK * BLOCK == 640
    assert turn2[2]["loaded_chunks"] == 3
    assert turn2_out["tokens"] == fp32_baseline["T2"]


def test_loaded_kv_is_really_used(tiny_model, tmp_path_factory, fp32_baseline):
    """Control: noise sealed with a valid checksum changes the output, so the equality
    in the other tests is not the engine silently recomputing."""
    res = run_engine(tmp_path_factory.mktemp("sealed"), {
        "model": tiny_model, "connector": MEM, "steps": [
            {"op": "generate", "prompts": [P2]},
            {"op": "corrupt", "prompt": P2, "chunk": 0, "reseal": True},
            {"op": "corrupt", "prompt": P2, "chunk": 1, "reseal": True},
            {"op": "generate", "prompts": [P2]},
            {"op": "totals"}]})
    assert res[3][0]["cached"] == 4 * CHUNK
    assert res[4]["load_errors"] == 0
    assert res[3][0]["tokens"] != fp32_baseline["P2"]


def test_repeated_prompt_bf16(tiny_model, tmp_path_factory):
    steps = [{"op": "generate", "prompts": [P1]}, {"op": "generate", "prompts": [P1]},
             {"op": "totals"}]
    base = run_engine(tmp_path_factory.mktemp("bf16-base"), {
        "model": tiny_model, "dtype": "bfloat16", "connector": None, "steps": steps[:1]})
    res = run_engine(tmp_path_factory.mktemp("bf16"), {
        "model": tiny_model, "dtype": "bfloat16", "connector": MEM, "steps": steps})
    assert res[1][0]["cached"] == P1_HIT and res[2]["loaded_chunks"] == 3
    assert res[0][0]["tokens"] == base[0][0]["tokens"]
    assert res[1][0]["tokens"] == base[0][0]["tokens"]


def test_more_prompts_than_kv_budget_hit_the_store(tiny_model, tmp_path_factory):
    """vLLM's own prefix cache is on but too small: revisits come from the store."""
    spec = {"model": tiny_model, "prefix_caching": True, "kv_cache_bytes": 3 << 20,
            "max_model_len": 1024, "steps": [
                {"op": "generate", "prompts": CHURN}, {"op": "totals"},
                {"op": "generate", "prompts": CHURN}, {"op": "totals"}]}
    res = run_engine(tmp_path_factory.mktemp("churn"), {**spec, "connector": MEM})
    base = run_engine(tmp_path_factory.mktemp("churn-base"), {**spec, "connector": None,
                                                             "steps": spec["steps"][:1]})
    first, revisit = res[0], res[2]
    loaded = res[3]["loaded_chunks"] - res[1]["loaded_chunks"]
    assert all(r["cached"] >= 2 * CHUNK for r in revisit)
    assert loaded >= 2 * 6  # at most ~4 prompts fit in vLLM's 3 MiB KV cache
    assert [r["tokens"] for r in first] == [b["tokens"] for b in base[0]]
    assert [r["tokens"] for r in revisit] == [b["tokens"] for b in base[0]]


BAD_CONFIGS = [
    ({"chunk_sise": 256}, "unknown kv_connector_extra_config key(s) ['chunk_sise']"),
    ({"chunk_size": 200}, "chunk_size=200 is not a multiple of the engine's block_size=128"),
    ({"memory_capacity": "1KiB"}, "memory_capacity=1KiB holds no chunk: one chunk of 256 "
                                  "tokens is 256KiB for this model; use at least '256KiB'"),
    ({"memory_capacity": "10TB"}, "memory_capacity=9.1TiB is more than this machine can give"),
]


@pytest.fixture(scope="module")
def start_errors(tiny_model, tmp_path_factory):
    """Every bad config, then a good one, started in turn in one process of their own."""
    return run_engine(tmp_path_factory.mktemp("badcfg"), {
        "model": tiny_model, "start_errors": [c for c, _ in BAD_CONFIGS] + [MEM]}, fresh=True)


@pytest.mark.parametrize("index", range(len(BAD_CONFIGS)),
                         ids=[m.split(" ")[0] for _, m in BAD_CONFIGS])
def test_bad_config_stops_engine_start(start_errors, index):
    assert BAD_CONFIGS[index][1] in (start_errors[index] or "the engine started")


def test_the_good_config_after_them_starts(start_errors):
    assert start_errors[-1] is None


def test_a_small_step_s_saves_do_not_wait_for_a_stuck_copy_thread(tiny_model, tmp_path_factory,
                                                                   fp32_baseline):
    """The copy thread stuck (a fetch that hangs, say): a step's saves of at most
    ``inline_save_max_kib`` (P1's three chunks) are made on the worker's thread right after
    the forward pass, so they are in memory when the request finishes and the next request
    loads them; larger ones queue on the copy thread (tests/test_worker_parts.py)."""
    from kvconnector.config import ConnectorConfig

    assert 3 * 256 <= ConnectorConfig().inline_save_max_kib  # three fp32 chunks, in KiB
    res = run_engine(tmp_path_factory.mktemp("gate"), {
        "model": tiny_model, "connector": MEM, "steps": [
            {"op": "copy_gate", "close": True},  # 0: the copy thread is stuck from here
            {"op": "generate", "prompts": [P1]},  # 1: must finish anyway
            {"op": "totals"},  # 2
            {"op": "outstanding"},  # 3
            {"op": "generate", "prompts": [P1]},  # 4: loads what the worker saved
            {"op": "totals"},  # 5
            {"op": "copy_gate", "close": False},  # 6
            {"op": "outstanding"}]})  # 7
    assert res[1][0]["tokens"] == fp32_baseline["P1"]
    assert res[2]["saved_chunks"] == 3, "the saves waited for the copy thread"
    assert res[3]["workers"][0]["copy_jobs"] == 0  # nothing queued behind the stuck job
    assert res[4][0]["cached"] == P1_HIT
    assert res[4][0]["tokens"] == fp32_baseline["P1"]
    assert res[5]["saved_chunks"] == 3 and res[5]["loaded_chunks"] == 3
    assert all(v == 0 for v in res[7]["scheduler"].values()), res[7]
    assert all(v == 0 for w in res[7]["workers"] for v in w.values()), res[7]


def test_fenced_request_waits_for_its_queued_saves(tiny_model, tmp_path_factory):
    """vLLM may hand a finished or preempted request's blocks to another request, so
    ``handle_preemptions`` must return only once the copies reading them are done."""
    res = run_engine(tmp_path_factory.mktemp("fence-wait"), {
        "model": tiny_model, "connector": QUEUED, "steps": [
            {"op": "copy_gate", "close": True},
            {"op": "generate", "prompts": [P1]},
            {"op": "fence_wait"},
            {"op": "totals"}]})
    wait, totals = res[2], res[3]
    assert wait["pending_requests"] == 1
    assert not wait["returned_while_queued"]
    assert wait["returned"] and totals["saved_chunks"] == 3


def test_no_state_leaks_after_preemptions_and_aborts(tiny_model, tmp_path_factory):
    prompts = [prompt(200 + i, 600) for i in range(12)]
    spec = {"model": tiny_model, "kv_cache_bytes": 3 << 20, "max_model_len": 1024,
            "prefix_caching": True, "steps": [
                {"op": "stress", "prompts": prompts, "max_tokens": 160,
                 "abort_after_steps": 6},
                {"op": "outstanding", "drain": True}]}
    res = run_engine(tmp_path_factory.mktemp("stress"), {**spec, "connector": MEM})
    stress, outstanding = res
    assert stress["resumed"] > 0, "the workload was meant to preempt requests"
    assert len(stress["tokens"]) == len(prompts) - len(stress["aborted"])
    assert all(v == 0 for v in outstanding["scheduler"].values()), outstanding
    assert all(v == 0 for w in outstanding["workers"] for v in w.values()), outstanding
    # Requests that survived preemption (and reloads from the store) still match vLLM alone.
    finished = [i for i in range(len(prompts)) if f"stress-{i}" in stress["tokens"]]
    base = run_engine(tmp_path_factory.mktemp("stress-base"), {
        "model": tiny_model, "connector": None, "max_model_len": 1024, "steps": [
            {"op": "generate", "prompts": [prompts[i] for i in finished],
             "max_tokens": 160}]})
    assert [stress["tokens"][f"stress-{i}"] for i in finished] == [
        b["tokens"] for b in base[0]]
