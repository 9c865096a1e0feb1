"""Blend on the scheduler half alone: what reaches the worker's ``BlendJob``, and the slots
a parked blend reads across a cache reset.

Unit tests: ``SchedulerHalf`` and ``BlendScheduler`` are real; vLLM's engine objects are
the small fakes of tests/scheduler_fakes.py. The blend itself is tested on real engines in
test_blend_engine.py and test_smollm2.py."""

from __future__ import annotations

import time
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvconnector import compat
from kvconnector.blend.config import REQUEST_KEYS, BlendConfig
from kvconnector.blend.families import BlendUnsupported
from kvconnector.blend.plan import BlendJob
from kvconnector.blend.segments import documents
from kvconnector.config import ConnectorConfig
from kvconnector.keys import ChunkKey, Fingerprint, request_seed
from kvconnector.lookups import Lookups
from kvconnector.scheduler import SchedulerHalf
from tests.conftest import prompt
from tests.scheduler_fakes import FakeRedis, FakeRequest, blocks_of, step_output

BS, CHUNK, LAYERS = 16, 64, 30
SEP = [1, 2]  # prompt() draws tokens from 4 on: never a separator by chance
FP = Fingerprint(model="m", revision="", model_config_digest="d", dtype="float32",
                 kv_layout="chunk", block_size=BS, num_layers=LAYERS, num_kv_heads=2,
                 head_size=8, tp_size=1, chunk_size=CHUNK, namespace="")
DOC_A, DOC_B = prompt(11, 150), prompt(12, 150)  # 3 pieces of 63 tokens each


def blend_half(monkeypatch, slots: int = 64, tp: int = 1, **extra) -> SchedulerHalf:
    monkeypatch.setattr(compat, "fingerprint", lambda *a: FP)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=256, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    model = SimpleNamespace(dtype=torch.float32,
                            hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
                            get_num_layers=lambda parallel: LAYERS)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        lora_config=None, cache_config=SimpleNamespace(cache_dtype="auto"), model_config=model)
    chunk_bytes = LAYERS * spec.real_page_size_bytes * CHUNK // BS
    config = ConnectorConfig.from_extra_config({
        "chunk_size": CHUNK, "memory_capacity": slots * chunk_bytes, "blend": True,
        "blend_separator_ids": SEP, "blend_min_tokens": 64, "blend_max_cost": 1.0, **extra})
    return SchedulerHalf(config, vllm_config, kv)


def rag(docs: list[list[int]], question: int) -> list[int]:
    tokens: list[int] = []
    for d in docs:
        tokens += d + SEP
    return tokens + prompt(question, 40)


def store_documents(half: SchedulerHalf, tokens: list[int]) -> None:
    """Prefill a request whose documents are saved in memory (the workers' copies are not
    run: the index is what the scheduler half reads)."""
    req = FakeRequest("store", tokens, BS)
    ids = list(range(-(-len(tokens) // BS)))
    assert half.get_num_new_matched_tokens(req, 0) == (0, False)
    plan = half.build_meta(step_output({"store": len(tokens)}, {"store": ids}, {"store": ids}))
    assert len(plan.doc_saves) == 2, "the two documents are saved once computed"
    req.num_computed_tokens = len(tokens)
    req.all_token_ids.append(7)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    half.request_finished(req, ids)


def blend_job(half: SchedulerHalf, req: FakeRequest, first_block: int = 100) -> BlendJob:
    """Match, allocate and plan ``req``: its blend job."""
    deadline = time.monotonic() + 5
    while (hit := half.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline, "Redis never answered"
        time.sleep(0.01)
    n, _ = hit
    assert n > 0, "the stored documents were not offered as a blend"
    ids = list(range(first_block, first_block + -(-req.num_prompt_tokens // BS)))
    half.update_state_after_alloc(req, blocks_of(ids), n)
    plan = half.build_meta(step_output({}, {}) if hit[1] else
                           step_output({req.request_id: req.num_prompt_tokens - n},
                                       {req.request_id: ids}, {req.request_id: ids}))
    assert len(plan.blends) == 1
    return plan.blends[0]


# Each per-request blend key, the BlendJob field it becomes, and a value unlike its default.
OVERRIDES = {"blend_strategy": ("strategy", "cacheblend"),
             "blend_recompute_ratio": ("recompute_ratio", 0.4),
             "blend_check_layer": ("check_layer", 3),
             "blend_epic_tokens": ("epic_tokens", 7),
             "blend_sink_tokens": ("sink_tokens", 5),
             "blend_refine_layer": ("refine_layer", 12),
             "blend_refine_ratio": ("refine_ratio", 0.2),
             "blend_group_tokens": ("group_tokens", 4)}
# Keys that decide whether a request is blended rather than how.
NOT_IN_JOB = {"blend", "blend_min_tokens"}


def test_blend_refuses_tensor_parallelism_at_start_up(monkeypatch):
    """The scheduler half is built at engine start; test_compat.py checks the reason on real
    vLLM configs, test_blend_engine.py that a refusal ends an engine's start."""
    with pytest.raises(BlendUnsupported) as e:
        blend_half(monkeypatch, tp=2)
    assert "blend is on but cannot serve this engine" in str(e.value)
    assert "tensor parallelism (TP=2) is not supported yet" in str(e.value)
    assert "Set blend to false" in str(e.value)


def test_every_per_request_blend_key_is_covered_here():
    assert set(OVERRIDES) | NOT_IN_JOB == REQUEST_KEYS
    job_fields = {f.name for f in fields(BlendJob)}
    defaults = BlendConfig()
    for key, (name, value) in OVERRIDES.items():
        assert name in job_fields, key
        assert getattr(defaults, key.removeprefix("blend_")) != value, key


def test_the_deployment_blend_settings_reach_the_job(monkeypatch):
    deployment = {key: value for key, (_, value) in OVERRIDES.items()}
    half = blend_half(monkeypatch, **deployment)
    store_documents(half, rag([DOC_A, DOC_B], 1))
    job = blend_job(half, FakeRequest("r", rag([DOC_B, DOC_A], 2), BS))
    assert {name: getattr(job, name) for name, _ in OVERRIDES.values()} == dict(
        OVERRIDES.values())
    assert {d.start for d in job.docs} == {0, len(DOC_B) + len(SEP)}


def test_a_requests_blend_overrides_reach_its_job_and_no_other(monkeypatch):
    half = blend_half(monkeypatch)
    store_documents(half, rag([DOC_A, DOC_B], 1))
    params = {key: value for key, (_, value) in OVERRIDES.items()}
    job = blend_job(half, FakeRequest("r", rag([DOC_B, DOC_A], 2), BS, params))
    assert {name: getattr(job, name) for name, _ in OVERRIDES.values()} == dict(
        OVERRIDES.values())
    plain = blend_job(half, FakeRequest("s", rag([DOC_B, DOC_A], 3), BS), first_block=150)
    defaults = BlendConfig()
    assert {name: getattr(plain, name) for name, _ in OVERRIDES.values()} == {
        name: getattr(defaults, key.removeprefix("blend_")) for key, (name, _) in
        OVERRIDES.items()}


def test_a_parked_blend_keeps_its_slots_across_a_cache_reset(monkeypatch):
    """Hole 3 of issue 20: a blend parked on a Redis fetch reads its slots once the fetch
    is reported, on the worker's main thread. A cache reset meanwhile forgets every chunk;
    the slots the blend reads must not be handed to new chunks before it is received."""
    half = blend_half(monkeypatch, slots=12)
    tokens = rag([DOC_B, DOC_A], 2)
    seed = request_seed(half._seed, None)  # the documents' keys, as this engine writes them
    stored = {str(ChunkKey(FP.digest(), 0, h))
              for d in documents(tokens, SEP, seed, CHUNK) for h in d.pieces}
    redis = FakeRedis(stored)
    redis.gate.set()
    half.lookups = half.prefix.lookups = half.blend.lookups = Lookups(redis, 1.0)
    try:
        half.get_num_new_matched_tokens(FakeRequest("other", prompt(3, 40), BS), 0)
        job = blend_job(half, FakeRequest("r", tokens, BS))
        assert job.load_async and len(job.slots) == 6, "parked on the Redis fetch"
        half.reset()
        # New requests fill the memory tier (12 slots) with chunks and documents.
        taken: set[int] = set()
        for i in range(4):
            fresh = rag([prompt(20 + 2 * i, 150), prompt(21 + 2 * i, 150)], 30 + i)
            ids = list(range(200, 200 + -(-len(fresh) // BS)))
            rid = f"fill{i}"
            half.get_num_new_matched_tokens(FakeRequest(rid, fresh, BS), 0)
            plan = half.build_meta(step_output({rid: len(fresh)}, {rid: ids}, {rid: ids}))
            taken |= {t.slot for t in plan.saves} | {
                slot for s in plan.doc_saves for _, _, slot in s.pieces}
        assert taken, "the fill saved nothing: the test shows nothing"
        assert not taken & set(job.slots), "a parked blend's slot was reused before it ran"
        half.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
        assert half.outstanding()["held_slots"] == 0
    finally:
        half.lookups.shutdown()


def test_a_request_not_scheduled_when_matched_is_salted_from_its_later_hit(monkeypatch):
    """vLLM may not schedule a request the blend matched (no room in the step) and evict
    part of its prefix-cache hit before it does. Its blocks from the new, shorter hit on
    are blended, so their hashes must be salted from there, as a request matched only
    then would have them: blocks under plain hashes would give exact requests blended KV."""
    half = blend_half(monkeypatch)
    store_documents(half, rag([DOC_A, DOC_B], 1))
    tokens = rag([DOC_B, DOC_A], 2)
    waited, fresh, plain = (FakeRequest(r, tokens, BS) for r in ("waited", "fresh", "plain"))
    assert half.get_num_new_matched_tokens(waited, 4 * BS)[0] > 0  # not scheduled
    assert half.get_num_new_matched_tokens(waited, BS)[0] > 0  # 3 blocks evicted meanwhile
    assert half.get_num_new_matched_tokens(fresh, BS)[0] > 0
    assert waited.block_hashes == fresh.block_hashes
    assert waited.block_hashes[0] == plain.block_hashes[0]
    assert all(w != p for w, p in zip(waited.block_hashes[1:], plain.block_hashes[1:],
                                      strict=True))


def test_a_request_whose_later_hit_reaches_its_salted_blocks_is_never_stored(monkeypatch):
    """Matched but not scheduled, and a step later vLLM's hit goes past where its hashes
    were salted: that is a twin's blended KV (tests/test_differential.py runs the engine
    case). Served as blended: nothing loaded for it, nothing of it saved."""
    half = blend_half(monkeypatch)
    store_documents(half, rag([DOC_A, DOC_B], 1))
    req = FakeRequest("twin", rag([DOC_B, DOC_A], 2), BS)
    assert half.get_num_new_matched_tokens(req, BS)[0] > 0  # not scheduled
    assert half.get_num_new_matched_tokens(req, 12 * BS) == (0, False)
    ids = list(range(-(-req.num_prompt_tokens // BS)))
    plan = half.build_meta(step_output({"twin": req.num_prompt_tokens - 12 * BS}, {"twin": ids},
                                       {"twin": ids}))
    assert not plan.saves and not plan.loads and not plan.blends
