"""What a miss costs, measured inside one engine: new prompts that use kvconnector against
new prompts that opt out of it (``kv_transfer_params: {"kvconnector": false}``).

    python benchmarks/bench_miss_paired.py                 # tiny Mistral, 1k-16k tokens
    python benchmarks/bench_miss_paired.py --model .cache/smollm2 --lengths 1024,4096,8000

``bench_miss.py`` compares engines with and without the connector, and two engines of one
configuration differ by more than the 3% the goal allows (section 21 of
docs/benchmarks.md). Here each engine has kvconnector attached and serves, per length,
blocks of ``--block`` new prompts one at a time: a block that uses kvconnector (its lookups
run, every chunk is saved and queued for Redis or the disk) and a block that opts out (the
connector's hooks still run, and do nothing for it), taking turns ``--pairs`` times. A
save runs after its request's step, so its cost lands on the next request of the block, as
in a stream of misses; the first request of each block follows the other kind and is left
out. The ratio is an engine's median TTFT of the requests that use kvconnector over its
median of those that opt out; per length the median over the engines.

What vLLM's connector machinery costs a request whatever the connector does is in both
halves, so it does not show here; ``bench_miss.py`` measures it between engines
(``vLLM alone``).

``--full-redis 256mb`` adds a tier with a second local Redis that evicts beyond that size
and is filled to it before each engine (``common.fill_to_maxmemory``): a Redis cache that
has run for a while, against the first one, which grows through the run. With
``--key-mirror`` that Redis is also a tier with the key mirror.

``--floor`` adds engines with ``floor_connector.py`` (memory, and memory + Redis with a Redis
tier): the least a connector can do on a miss (every layer's blocks copied once after the
prompt's step; with Redis, the prompt written as one value from a thread of its own), its
misses paired with requests that opt out of it in the same way. What a miss costs any
connector here, beside what kvconnector's costs.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time

from common import (
    ROOT,
    STAGES,
    add_model_args,
    chunk_bytes,
    connector_counts,
    connector_seconds,
    engine,
    fill_to_maxmemory,
    in_fresh_process,
    local_redis,
    random_prompt,
    ratio_plot,
    redis_for,
    resolve_model,
    rotated_order,
    tier_connectors,
    ttft_stages,
    write_results,
)

GOAL = 1.03
KINDS = ("kvconnector", "opted out")
def run_engine(model: str, args, kvt: dict, lengths: list[int], seed: int,
               vocab: int) -> dict:
    """Per length and kind, the TTFT of every request but the first of each block (and
    with ``--stages`` its stages, under ``f"{kind} stages"``)."""
    from vllm import SamplingParams

    params = {
        "kvconnector": SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        "opted out": SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                    extra_args={"kv_transfer_params": {"kvconnector": False}}),
    }
    rng = random.Random(seed)
    out: dict[int, dict[str, list]] = {}
    extra = {"disable_log_stats": False} if args.stages else {}
    with engine(model, args, kvt, max(lengths) + 16, enable_prefix_caching=True,
                **extra) as llm:
        llm.generate([{"prompt_token_ids": random_prompt(rng, 300, vocab)}],
                     params["opted out"], use_tqdm=False)
        for n in lengths:
            out[n] = {k: [] for k in KINDS} | {f"{k} stages": [] for k in KINDS}
            for pair in range(args.pairs):
                for kind in (KINDS if pair % 2 == 0 else KINDS[::-1]):
                    before = connector_seconds() if args.stages else {}
                    for i in range(args.block):
                        prompt = {"prompt_token_ids": random_prompt(rng, n, vocab)}
                        start = time.monotonic()
                        outs = llm.generate([prompt], params[kind], use_tqdm=False)
                        end = time.monotonic()
                        assert (outs[0].num_cached_tokens or 0) == 0, "a new prompt hit a cache"
                        if i:
                            out[n][kind].append(end - start)
                            if (split := ttft_stages(outs[0], start, end)) is not None:
                                out[n][f"{kind} stages"].append(split)
                    if args.stages:  # a block's timers, about (the last step's come later)
                        after = connector_seconds()
                        phases = out[n].setdefault(f"{kind} phases", {})  # type: ignore[arg-type]
                        for k, v in after.items():
                            phases[k] = phases.get(k, 0.0) + (v - before.get(k, 0.0)) / (
                                args.block * args.pairs)
        if args.stages:
            out["counters"] = connector_counts()  # type: ignore[index]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16", redis=True)
    p.add_argument("--no-redis", dest="redis", action="store_false")
    p.add_argument("--no-disk", dest="disk", action="store_false")
    # 16000, not 16384: the tiny model's 16384 positions also hold the generated token.
    p.add_argument("--lengths", default="1024,4096,16000")
    p.add_argument("--block", type=int, default=5, help="requests of one kind in a row")
    p.add_argument("--pairs", type=int, default=2, help="blocks of each kind per length")
    p.add_argument("--engines", type=int, default=2, help="engines per tier")
    p.add_argument("--full-redis", metavar="MAXMEMORY", default=None,
                   help="also a tier with a Redis that evicts beyond MAXMEMORY (e.g. 256mb), "
                        "filled to it before each engine")
    p.add_argument("--key-mirror", action="store_true",
                   help="also memory + Redis with redis_key_mirror (lookups answered from "
                        "the scheduler's list of Redis's keys)")
    p.add_argument("--floor", action="store_true",
                   help="also engines with floor_connector.py (the least a connector does "
                        "on a miss), memory and, with Redis, memory + Redis")
    p.add_argument("--stages", action="store_true",
                   help="split each TTFT at the engine core's timestamps (vLLM's request "
                        "stats on) and print where a miss's extra time lands")
    p.add_argument("--plot", default=None)
    with redis_for(p.parse_args()) as args, contextlib.ExitStack() as stack:
        args.full_redis_url = None
        if args.full_redis:
            args.full_redis_url = stack.enter_context(
                local_redis(args.redis_cpus, args.full_redis)).url
        (ROOT / ".cache").mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=ROOT / ".cache", prefix="bench-miss-disk-") as d:
            bench(args, d if args.disk else None)


def bench(args, disk_path: str | None) -> None:
    from tqdm import tqdm

    model, vocab = resolve_model(args)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    tiers = tier_connectors(args, disk_path, args.full_redis_url)
    if args.floor:
        floor = {"kv_connector": "FloorConnector", "kv_connector_module_path": "floor_connector",
                 "kv_role": "kv_both"}
        tiers["floor"] = floor
        if args.redis_url:
            tiers["floor + Redis"] = {**floor, "kv_connector_extra_config": {
                "redis_url": args.redis_url}}
    order = rotated_order(list(tiers), args.engines)
    runs: dict[str, list[dict]] = {t: [] for t in tiers}
    for i, tier in enumerate(tqdm(order, desc="engines")):
        if tier.startswith("memory + full Redis"):
            fill_to_maxmemory(args.full_redis_url, chunk_bytes(model, args.dtype))
        runs[tier].append(in_fresh_process(run_engine, model, args, tiers[tier], lengths,
                                           2000 + i, vocab))
    per_engine = {t: {n: [statistics.median(r[n]["kvconnector"]) /
                          statistics.median(r[n]["opted out"]) for r in runs[t]]
                      for n in lengths} for t in tiers}
    ratio = {t: {n: statistics.median(per_engine[t][n]) for n in lengths} for t in tiers}
    opted = {t: {n: statistics.median([s for r in runs[t] for s in r[n]["opted out"]])
                 for n in lengths} for t in tiers}
    print(f"\na miss that uses kvconnector against one that opts out, in the same engine; "
          f"{model} ({args.dtype}); {args.pairs} x {args.block - 1} requests of each kind "
          f"per length and engine, {args.engines} engines per tier; goal at most {GOAL}x")
    print(f"{'tokens':>7} " + " ".join(f"{t:>34}" for t in tiers))
    for n in lengths:
        cells = [f"{ratio[t][n]:.3f}x ({', '.join(f'{x:.3f}' for x in per_engine[t][n])}; "
                 f"{opted[t][n] * 1000:.1f} ms)" for t in tiers]
        print(f"{n:>7} " + " ".join(f"{c:>34}" for c in cells))
    print("(per engine in brackets, then the median TTFT of the requests that opted out)")
    extra = stage_deltas(runs, lengths) if args.stages else {}
    if extra:
        print("\nwhere the extra time lands: median stage of the requests that use kvconnector "
              "minus that of those that opt out, ms (medians over each tier's engines)")
        print(f"{'tier':>28} {'tokens':>7} " + " ".join(f"{s:>8}" for s in STAGES))
        for t, per_n in extra.items():
            for n, deltas in per_n.items():
                print(f"{t:>28} {n:>7} " + " ".join(f"{d * 1000:>+8.3f}" for d in deltas))
        print("\nthe connector's timers, ms a request (a block's timers over its requests; "
              "medians over each tier's engines)")
        for t, engines in runs.items():
            for n in lengths:
                for kind in KINDS:
                    per = [r[n].get(f"{kind} phases", {}) for r in engines]
                    names = sorted({k for p in per for k, v in p.items() if v > 1e-5})
                    if names:
                        print(f"{t:>28} {n:>7} {kind:>11}: " + ", ".join(
                            f"{k} {statistics.median(p.get(k, 0.0) for p in per) * 1000:.3f}"
                            for k in names))
        print("\nRedis lookups read on the scheduler's thread, and Redis timeouts, per engine:")
        for t, engines in runs.items():
            counts = [r.get("counters", {}) for r in engines]
            if any("redis_inline_lookups" in c or "redis_errors.timeout" in c for c in counts):
                print(f"{t:>28} " + ", ".join(
                    f"{c.get('redis_inline_lookups', 0):.0f} inline, "
                    f"{c.get('redis_errors.timeout', 0):.0f} timeouts" for c in counts))
    out = write_results(args.out, "miss_paired", {
        "model": model, "dtype": args.dtype, "lengths": lengths, "block": args.block,
        "pairs": args.pairs, "engines": args.engines, "order": order,
        "redis_cpus": getattr(args, "redis_cpus_used", None),
        "full_redis_maxmemory": args.full_redis, "ratio": ratio, "stage_deltas_s": extra,
        "ratio_per_engine": per_engine, "opted_out_median_s": opted, "ttft_s": runs})
    print(f"results: {out}")
    ratio_plot(args.plot or out.with_suffix(".png"), lengths, ratio, dots=per_engine,
               goals={f"goal ({GOAL}x)": GOAL}, ylabel="miss TTFT / opted out, same engine",
               title=f"Paired misses ({model.rstrip('/').split('/')[-1]}, {args.dtype}); "
                     "dots: engines")


def stage_deltas(runs: dict[str, list[dict]], lengths: list[int]
                 ) -> dict[str, dict[int, list[float]]]:
    """Per tier and length, the median (over engines) of each stage's median for the
    requests that use kvconnector minus that for those that opt out."""
    out: dict[str, dict[int, list[float]]] = {}
    for t, engines in runs.items():
        for n in lengths:
            per_engine = []
            for r in engines:
                use, opt = r[n]["kvconnector stages"], r[n]["opted out stages"]
                if use and opt:
                    per_engine.append([statistics.median(u[j] for u in use)
                                       - statistics.median(o[j] for o in opt)
                                       for j in range(len(STAGES))])
            if per_engine:
                out.setdefault(t, {})[n] = [statistics.median(e[j] for e in per_engine)
                                            for j in range(len(STAGES))]
    return out


if __name__ == "__main__":
    main()
