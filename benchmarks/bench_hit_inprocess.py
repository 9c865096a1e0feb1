"""A hit's TTFT with vLLM's engine loop and its worker in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no process waits on another by spinning, which on a
2-core machine takes a core from redis-server while a hit's chunks are fetched.

    python benchmarks/bench_hit_inprocess.py --tier vllm,memory,redis --tokens 4096
    python benchmarks/bench_hit_inprocess.py --tier memory --timeline

Each tier runs in a fresh process, one after another, on the same prompts. ``vllm``: vLLM's
own prefix-cache hit (no connector; the floor). ``memory``: the engine stores the prompts,
then serves them from memory. ``redis``: a first engine stores the prompts in a local
redis-server, then an engine with an empty memory tier serves them from Redis. Prints each
hit's TTFT (a one-token generation), their median leaving out the first, and the ratio to
``vllm`` when it ran; ``--timeline`` also prints how long each hit's fetch from Redis took
and when each of the connector's hooks ran during the last hit. To compare code before and
after a change, copy this script into the other checkout's ``benchmarks/`` and run it
there: ``common.py`` puts the checkout it lives in first on the path (``PYTHONPATH`` alone
does not switch it).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

from common import (  # noqa: E402 - the environment must be set before vLLM is imported
    add_model_args,
    connector,
    engine,
    in_fresh_process,
    random_prompt,
    redis_for,
    resolve_model,
    timed_generate,
    write_results,
)

HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "start_load_kv", "get_finished", "update_connector_output", "request_finished")


def fill(model: str, args, kvt: dict, prompts: list[list[int]]) -> int:
    with engine(model, args, kvt, args.tokens + 64, enable_prefix_caching=False,
                max_num_batched_tokens=args.tokens + 64) as llm:
        for p in prompts:
            timed_generate(llm, [p], 1)
        time.sleep(3)  # the Redis puts drain
    return len(prompts)


def record_hooks(events: list[tuple[float, str]], fetches: list[float]) -> None:
    """When each hook is called, and how long each fetch from the disk or Redis takes."""
    from kvconnector.connector import KVConnector
    from kvconnector.worker_store import WorkerStore

    for name in HOOKS:
        hook = getattr(KVConnector, name)

        def timed(self, *a, _hook=hook, _name=name, **kw):
            events.append((time.perf_counter(), _name))
            return _hook(self, *a, **kw)

        setattr(KVConnector, name, timed)
    fetch = WorkerStore.fetch

    def timed_fetch(self, wanted):
        start = time.perf_counter()
        try:
            return fetch(self, wanted)
        finally:
            if wanted:
                fetches.append(time.perf_counter() - start)

    WorkerStore.fetch = timed_fetch


def measure(model: str, args, tier: str, prompts: list[list[int]], vocab: int) -> dict:
    """Hits of ``prompts`` in an engine in this process: times, and the last hit's hooks."""
    extra = {"memory_capacity": args.memory_capacity}
    if tier == "redis":
        extra["redis_url"] = args.redis_url
        in_fresh_process(fill, model, args, connector(extra), prompts)
    events: list[tuple[float, str]] = []
    fetches: list[float] = []
    if args.timeline and tier != "vllm":
        record_hooks(events, fetches)
    times = []
    start = 0.0
    with engine(model, args, None if tier == "vllm" else connector(extra), args.tokens + 64,
                enable_prefix_caching=tier == "vllm",
                max_num_batched_tokens=args.tokens + 64) as llm:
        timed_generate(llm, [random_prompt(random.Random(9), 300, vocab)], 1)
        if tier != "redis":
            for q in prompts:
                timed_generate(llm, [q], 1)
        fetches.clear()  # those of the timed hits only
        for q in prompts:
            events.clear()
            start = time.perf_counter()
            secs, _ = timed_generate(llm, [q], 1)
            times.append(secs)
    return {"ttft_s": times, "median_s": statistics.median(times[1:] or times),
            "timeline": [((t - start) * 1e3, name) for t, name in events],
            "fetch_s": fetches}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16")
    p.add_argument("--tier", default="redis",
                   help="comma-separated, each in a fresh process: vllm (vLLM's own "
                        "prefix-cache hit, no connector), memory, redis")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--timeline", action="store_true")
    args = p.parse_args()
    tiers = args.tier.split(",")
    if unknown := set(tiers) - {"vllm", "memory", "redis"}:
        p.error(f"--tier: unknown {sorted(unknown)}; choose from vllm, memory, redis")
    args.redis = "redis" in tiers
    with redis_for(args) as args:
        model, vocab = resolve_model(args)
        rng = random.Random(0)
        prompts = [random_prompt(rng, args.tokens, vocab) for _ in range(args.prompts)]
        runs = {tier: in_fresh_process(measure, model, args, tier, prompts, vocab)
                for tier in tiers}
    floor = runs["vllm"]["median_s"] if "vllm" in runs else None
    for tier, run in runs.items():
        ratio = f" ({run['median_s'] / floor:.2f}x vLLM's own hit)" if floor else ""
        print(f"{tier} hits, {args.tokens} tokens: "
              + " ".join(f"{t * 1e3:.1f}" for t in run["ttft_s"])
              + f" ms; median {run['median_s'] * 1e3:.1f} ms{ratio}")
        if run["fetch_s"]:
            print("  fetches (WorkerStore.fetch, each hit): "
                  + " ".join(f"{t * 1e3:.1f}" for t in run["fetch_s"]) + " ms")
        for t, name in run["timeline"]:
            print(f"  {t:8.2f} ms  {name}")
    out = write_results(args.out, "hit_inprocess",
                        {"tokens": args.tokens, "prompts": args.prompts, "runs": runs})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
