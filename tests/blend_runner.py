"""Runs a real vLLM engine (CPU build) through a list of blend steps; used by the blend
tests and the blend benchmark.

Usage: python tests/blend_runner.py SPEC.json OUT.json. Steps the prefix tests also use
come from tests/engine_runner.py; this adds per-request blend settings, first-token
logprobs and timing, and tampering with stored documents.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.engine_runner import (  # noqa: E402
    _arrivals,
    _flush_tiers,
    _noise_kv,
    _run_to_completion,
    _scheduler_outstanding,
    _stress,
    _worker_outstanding,
    _worker_totals,
    cached_by_source,
    engine_kwargs,
)


def _generate(llm, step: dict) -> list[dict]:
    """One request at a time; ``params`` go to the connector as ``kv_transfer_params``."""
    from vllm import SamplingParams

    outs = []
    for i, p in enumerate(step["prompts"]):
        params = step.get("params")
        if isinstance(params, list):
            params = params[i]
        sp = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8),
                            ignore_eos=True, logprobs=step.get("logprobs"),
                            extra_args={"kv_transfer_params": params} if params else None)
        start = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        out = {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
               "seconds": seconds}
        if step.get("logprobs") is not None:
            first = o.outputs[0].logprobs[0]
            out["logprobs"] = {str(t): lp.logprob for t, lp in first.items()}
        outs.append(out)
    return outs


def _drain_copies(worker) -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().worker.copies.drain()
    return True


def _doc_slots(worker, doc_tokens: list[int]) -> list[int]:
    """Memory slots holding the pieces of a document (tokens as they appear in a prompt)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvconnector.blend.segments import documents
    from kvconnector.keys import ChunkKey, request_seed

    half = get_kv_transfer_group().worker
    sep = [-1]  # a document followed by a separator: the document's own key
    (doc,) = documents(list(doc_tokens) + sep + [0], sep, request_seed(half.fingerprint, None),
                       half.config.chunk_size)
    return [half.pool.slot_holding(ChunkKey(half.fingerprint, half.tp_rank, h))
            for h in doc.pieces]


def _damage_doc(worker, doc_tokens: list[int], how: str) -> int:
    """Damage a stored document's memory slots. ``lose``: the slots no longer hold the
    document (a failed save, a slot reused for another chunk), which the worker must
    notice; ``noise``: its KV overwritten with noise, slot headers kept (bytes the memory
    tier vouches for, so they are served: a control that loaded KV is really used)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    half = get_kv_transfer_group().worker
    n = 0
    for slot in _doc_slots(worker, doc_tokens):
        if slot is None:
            continue
        if how == "lose":
            half.pool.begin_write(slot)  # never sealed again
        else:
            data, _ = half.blend._piece(half.pool.slot(slot))
            gen = torch.Generator().manual_seed(7)
            data.copy_((torch.randn(data.shape, generator=gen) * 4).to(data.dtype))
        n += 1
    return n


def _layer0_rerotation(worker, tokens: list[int], p: int, q: int) -> dict:
    """Layer 0's keys of ``tokens`` computed at positions ``p...`` and moved to ``q...``,
    against the keys computed at ``q...`` (layer 0's keys do not depend on context)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    model = get_kv_transfer_group().worker.blend.model
    layer, ids = model.layers[0], torch.tensor(tokens)

    def keys_at(pos: int) -> torch.Tensor:
        x, _ = layer.norm_in(model.embed(ids), None)
        return layer.qkv(x, torch.arange(pos, pos + len(tokens)))[1]

    with torch.inference_mode():
        kp, kq = keys_at(p), keys_at(q)
        moved = model.rotator.move(kp, p, q)
    return {"moved": float((moved - kq).abs().max()), "not_moved": float((kp - kq).abs().max()),
            "largest": float(kq.abs().max())}


def _metrics(llm) -> dict:
    """kvconnector's Prometheus metrics as vLLM's reader sees them (needs "log_stats"):
    counters by name, histograms as their count."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvconnector_blend"):
            name = m.name.removeprefix("vllm:kvconnector_")
            out[name] = out.get(name, 0) + (m.count if hasattr(m, "count") else m.value)
    return out


_RUN_BLEND: list = []


def _break_blend(worker, broken: bool) -> bool:
    """Make every blend fail (as a bug in it would), or work again."""
    from kvconnector.blend import worker as blend_worker

    if not _RUN_BLEND:
        _RUN_BLEND.append(blend_worker.run_blend)

    def fail(*args, **kwargs):
        raise RuntimeError("injected: a blend that fails")

    blend_worker.run_blend = fail if broken else _RUN_BLEND[0]
    return True


def _memory_loads_by_layer(worker, late_s: float = 0.0) -> bool:
    """Sends every load from memory layer by layer, however small (the tiny models' loads
    are far below ``LAYER_MIN_BYTES``; in a one-process engine the worker has no spare core
    of its own, so one is made up), each ``late_s`` late (so that whatever reads its blocks
    before waiting for them reads them unwritten, not just early), and fills vLLM's KV
    cache with noise; whether this worker loads layer by layer at all (``load_by_layer``).
    ``main`` puts ``LAYER_MIN_BYTES`` back when the run ends (a hosted run shares it)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvconnector import worker as worker_half

    half = get_kv_transfer_group().worker
    if half.layer_loads is None:
        return False
    worker_half.LAYER_MIN_BYTES = 0
    half._spare_cores = half._spare_cores or {0}
    _noise_kv(worker)
    loads, load = half.layer_loads, half.layer_loads._load

    def late(*args):
        time.sleep(late_s)
        return load(*args)

    loads._load = late
    return True


def _evicted_while_waiting(llm, step: dict) -> dict:
    """``filler`` (one token) and then ``prompt`` in one step, which has no room for the
    second: it is matched (blended from vLLM's hit, its hashes salted from there) but left
    waiting. Then the blocks of its hit from block ``evict_from`` on leave vLLM's prefix
    cache, as a block pool under pressure would evict them, and both run to the end. The
    answers by name, and where the blend salted the waiting request's hashes after each of
    its first two matches."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    states = scheduler.connector.scheduler._requests
    out: dict = {}

    def run_step() -> None:
        for o in engine.step():
            if o.finished:
                out[o.request_id] = {"tokens": list(o.outputs[0].token_ids),
                                     "cached": o.num_cached_tokens or 0}

    sp = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8), ignore_eos=True)
    engine.add_request("filler", {"prompt_token_ids": step["filler"]},
                       SamplingParams(temperature=0, max_tokens=1))
    rid = engine.add_request("waited", {"prompt_token_ids": step["prompt"]}, sp)  # vLLM's id
    run_step()
    waited = scheduler.requests[rid]
    salted = [states[rid].blend.salted_at]
    unscheduled = waited.num_computed_tokens == 0
    pool = scheduler.kv_cache_manager.block_pool
    evicted = set()
    for h in waited.block_hashes[step["evict_from"]:salted[0] // scheduler.block_size]:
        blocks = pool.get_cached_block(h, [0])
        if blocks:
            evicted.add(blocks[0].block_id)
    pool.evict_blocks(evicted)
    run_step()
    salted.append(states[rid].blend.salted_at if rid in states else None)
    out.update(_run_to_completion(engine, time.monotonic() + 120))
    return {**out, "unscheduled": unscheduled, "evicted": len(evicted), "salted_at": salted}


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    from vllm import LLM

    from kvconnector import worker as worker_half

    llm = LLM(**engine_kwargs(spec, max_logprobs=spec.get("max_logprobs", 20)))
    layer_min_bytes = worker_half.LAYER_MIN_BYTES  # lowered by memory_loads_by_layer
    try:
        results = _steps(llm, spec["steps"])
    finally:  # a hosted run shares the module with the runs after it
        worker_half.LAYER_MIN_BYTES = layer_min_bytes
    json.dump(results, open(out_path, "w"))


def _steps(llm, steps: list[dict]) -> list:
    results: list = []
    for step in steps:
        op = step["op"]
        if op == "generate":
            results.append(_generate(llm, step))
        elif op == "totals":
            llm.collective_rpc(_drain_copies)  # count the saves queued so far
            per_rank = llm.collective_rpc(_worker_totals)
            results.append({k: sum(r.get(k, 0) for r in per_rank) for k in per_rank[0]})
        elif op == "damage_doc":
            results.append(llm.collective_rpc(_damage_doc, args=(step["doc"], step["how"]))[0])
        elif op == "layer0_rerotation":
            results.append(llm.collective_rpc(
                _layer0_rerotation, args=(step["tokens"], step["p"], step["q"]))[0])
        elif op == "stress":
            results.append(_stress(llm, step))
        elif op == "outstanding":
            results.append({"scheduler": _scheduler_outstanding(llm),
                            "workers": llm.collective_rpc(_worker_outstanding,
                                                          args=(step.get("drain", False),))})
        elif op == "flush":
            results.append(llm.collective_rpc(_flush_tiers))
        elif op == "cached_by_source":
            results.append(cached_by_source(llm))
        elif op == "metrics":
            results.append(_metrics(llm))
        elif op == "reset_prefix_cache":
            results.append(llm.reset_prefix_cache())
        elif op == "memory_loads_by_layer":
            results.append(llm.collective_rpc(_memory_loads_by_layer,
                                              args=(step.get("late_s", 0.0),))[0])
        elif op == "arrivals":
            results.append(_arrivals(llm, step))
        elif op == "evicted_while_waiting":
            results.append(_evicted_while_waiting(llm, step))
        elif op == "break_blend":
            results.append(llm.collective_rpc(_break_blend, args=(step["broken"],))[0])
        else:
            raise ValueError(f"unknown step {op}")
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
