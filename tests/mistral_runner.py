"""Runs a real vLLM engine on Mistral-7B (or its stand-in) through a list of steps, with
text and chat prompts through the model's own tokenizer; used by test_mistral7b.py.

Usage: python tests/mistral_runner.py SPEC.json OUT.json. Steps that touch the connector's
internals reuse tests/engine_runner.py's.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.engine_runner import (  # noqa: E402
    _corrupt,
    _flush_tiers,
    _foreign,
    _redis_keys,
    _redis_stats,
    _worker_totals,
    engine_kwargs,
)


def _worker_geometry(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    half = get_kv_transfer_group().worker
    spec = half.spec
    return {"layers": len(half.layers), "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
            "dtype": str(spec.dtype).removeprefix("torch."),
            "page_size_bytes": spec.page_size_bytes, "num_slots": half.num_slots,
            "pool_slots": half.pool.num_slots, "chunk_bytes": half.pool.chunk_bytes,
            "pool_bytes": half.pool.num_slots * half.pool.chunk_bytes,
            "chunk_shape": list(half.pool.chunk_shape),
            "layer_tensor_bytes": [t.numel() * t.element_size() for t in half.layers],
            "device": str(half.layers[0].device)}


def _geometry(llm) -> dict:
    workers = llm.collective_rpc(_worker_geometry)
    out = {"workers": workers}
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is not None:  # in-process engine: the scheduler is reachable
        sched = core.scheduler
        out["kv_cache_blocks"] = sched.kv_cache_config.num_blocks
        out["scheduler_slots"] = sched.connector.scheduler.index.num_slots
    return out


def _result(out) -> dict:
    return {"prompt": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids),
            "text": out.outputs[0].text, "cached": out.num_cached_tokens or 0}


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(spec, dtype=spec.get("dtype", "bfloat16"),
                              kv_cache_memory_bytes=spec["kv_cache_bytes"],
                              load_format=spec.get("load_format", "auto"),
                              enable_prefix_caching=False))
    results: list = []
    for step in spec["steps"]:
        op = step["op"]
        sp = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 16),
                            ignore_eos=True)
        if op == "tokenize":
            tok = llm.get_tokenizer()
            results.append({"ids": [tok.encode(t) for t in step["texts"]],
                            "bos": tok.bos_token_id, "eos": tok.eos_token_id,
                            "vocab": len(tok)})
        elif op == "chat":
            results.append(_result(llm.chat(step["messages"], sp, use_tqdm=False)[0]))
        elif op == "generate":
            if "continue" in step:  # the next chat turn: prompt + answer of an earlier step
                prev = results[step["continue"]]
                prompt = prev["prompt"] + prev["tokens"] + step["suffix"]
            else:
                prompt = step["prompt"]
            out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
            results.append(_result(out))
        elif op == "totals":
            per_rank = llm.collective_rpc(_worker_totals)
            results.append({k: sum(r[k] for r in per_rank) for k in per_rank[0]})
        elif op == "corrupt":  # a chunk of an earlier step's prompt
            prompt = results[step["step"]]["prompt"]
            results.append(llm.collective_rpc(
                _corrupt, args=(prompt, step["chunk"], step.get("reseal", False))))
        elif op == "foreign":  # a chunk of an earlier step's prompt, sealed as another
            prompt = results[step["step"]]["prompt"]
            results.append(llm.collective_rpc(_foreign, args=(prompt, step["chunk"])))
        elif op == "redis_keys":  # the Redis keys of an earlier step's prompt
            results.append(_redis_keys(llm, {"prompts": [results[step["step"]]["prompt"]]}))
        elif op == "flush":
            results.append(llm.collective_rpc(_flush_tiers))
        elif op == "redis_stats":
            results.append(llm.collective_rpc(_redis_stats)[0])
        elif op == "geometry":
            results.append(_geometry(llm))
        else:
            raise ValueError(f"unknown step {op}")
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
