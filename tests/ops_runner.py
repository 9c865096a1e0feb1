"""Runs a real vLLM engine through a list of steps, some of which wait for (or signal) the
test through files, so that engines in separate processes can take turns; used by
test_operations.py.

Usage: python tests/ops_runner.py SPEC.json OUT.json. Steps that touch the connector reuse
tests/engine_runner.py's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.engine_runner import (  # noqa: E402
    _flush_tiers,
    _redis_stats,
    _worker_totals,
    connector_config,
)


def _wait(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} from the test within {timeout_s} s")
        time.sleep(0.05)


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="float32", kv_cache_memory_bytes=64 << 20,
              enable_prefix_caching=False, max_model_len=4096, enforce_eager=True, seed=0,
              kv_transfer_config=connector_config(spec["connector"]))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    signals = Path(spec["signals"])
    results: list = []
    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            outs = []
            for p in step["prompts"]:
                o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
                outs.append({"tokens": list(o.outputs[0].token_ids),
                             "cached": o.num_cached_tokens})
            results.append(outs)
        elif op == "flush":
            results.append(llm.collective_rpc(_flush_tiers))
        elif op == "totals":
            results.append(llm.collective_rpc(_worker_totals)[0])
        elif op == "redis_stats":
            results.append(llm.collective_rpc(_redis_stats)[0])
        elif op == "signal":
            (signals / step["name"]).touch()
            results.append(True)
        elif op == "wait":
            _wait(signals / step["name"], step.get("timeout_s", 240))
            results.append(True)
        else:
            raise ValueError(f"unknown step {op}")
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
