"""A hit's TTFT with vLLM's engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
where the engine's loop, the connector's threads and the caller share one GIL.

    python benchmarks/bench_hit_inprocess.py --tier redis --tokens 4096 --prompts 8
    python benchmarks/bench_hit_inprocess.py --tier memory --timeline

``redis``: a first engine (in a fresh process) stores the prompts in a local redis-server,
then an engine here with an empty memory tier serves them from Redis. ``memory``: one engine
here stores, then serves them from memory. Prints each hit's TTFT (a one-token generation)
and their median, leaving out the first; ``--timeline`` also prints when each of the
connector's hooks ran during the last hit. To compare code before and after a change, copy
this script into the other checkout's ``benchmarks/`` and run it there: ``common.py`` puts
the checkout it lives in first on the path (``PYTHONPATH`` alone does not switch it).
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


def record_hooks(events: list[tuple[float, str]]) -> None:
    from kvconnector.connector import KVConnector

    for name in HOOKS:
        hook = getattr(KVConnector, name)

        def timed(self, *a, _hook=hook, _name=name, **kw):
            events.append((time.perf_counter(), _name))
            return _hook(self, *a, **kw)

        setattr(KVConnector, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16")
    p.add_argument("--tier", choices=("memory", "redis"), default="redis")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--timeline", action="store_true")
    args = p.parse_args()
    args.redis = args.tier == "redis"
    with redis_for(args) as args:
        model, vocab = resolve_model(args)
        rng = random.Random(0)
        prompts = [random_prompt(rng, args.tokens, vocab) for _ in range(args.prompts)]
        extra = {"memory_capacity": args.memory_capacity}
        if args.tier == "redis":
            extra["redis_url"] = args.redis_url
            in_fresh_process(fill, model, args, connector(extra), prompts)
        events: list[tuple[float, str]] = []
        if args.timeline:
            record_hooks(events)
        times = []
        with engine(model, args, connector(extra), args.tokens + 64,
                    enable_prefix_caching=False,
                    max_num_batched_tokens=args.tokens + 64) as llm:
            timed_generate(llm, [random_prompt(random.Random(9), 300, vocab)], 1)
            if args.tier == "memory":
                for q in prompts:
                    timed_generate(llm, [q], 1)
            for q in prompts:
                events.clear()
                start = time.perf_counter()
                secs, _ = timed_generate(llm, [q], 1)
                times.append(secs)
    median = statistics.median(times[1:] or times)
    print(f"{args.tier} hits, {args.tokens} tokens: " + " ".join(f"{t * 1e3:.1f}" for t in times)
          + f" ms; median {median * 1e3:.1f} ms")
    for t, name in events:
        print(f"  {(t - start) * 1e3:8.2f} ms  {name}")
    out = write_results(args.out, f"hit_inprocess_{args.tier}",
                        {"tier": args.tier, "tokens": args.tokens, "ttft_s": times,
                         "median_s": median})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
