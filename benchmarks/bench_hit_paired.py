"""A hit against vLLM's own prefix-cache hit of the same prompt in the same engine.

    python benchmarks/bench_hit_paired.py                 # tiny Mistral, bf16, 1k-16k tokens
    python benchmarks/bench_hit_paired.py --model .cache/smollm2 --lengths 2048,4096
    python benchmarks/bench_hit_paired.py --disk          # a disk hit instead of a Redis hit

``bench_peers.py`` compares engines: each configuration runs in engines of its own, and two
engines of one configuration differ by 10-15% on this machine, more than the 5% the memory
hit's goal allows. Here every engine measures all three hits of each prompt, one after
another, with kvconnector (memory tier and Redis) attached and vLLM's prefix cache on:

1. **Redis**: the prompt is new to this engine and a first engine stored it in Redis, so
   kvconnector fetches it from Redis (its chunks land in the memory tier);
2. **vLLM**: the same prompt again: vLLM's own prefix-cache hit (kvconnector's hooks run
   and find nothing more to load);
3. **memory**: ``reset_prefix_cache()`` empties vLLM's prefix cache (not kvconnector's),
   and the same prompt loads from kvconnector's memory tier.

With ``--disk`` the engines have a disk tier instead of Redis, and the first hit reads the
files a first engine wrote into the same directory.

With ``--example``, as many engines again run vLLM's ``ExampleConnector`` (safetensors files
in a temporary folder) instead of kvconnector, on the same prompts: the first request of a
prompt is a miss that stores it, then vLLM's own hit, ``reset_prefix_cache()``, and the
ExampleConnector's hit. Its ratio is over vLLM's hit in its own engine, as kvconnector's are.
``--floor`` does the same with ``floor_connector.py``: the least a connector can do for a
memory hit (the same prompt's blocks kept in the worker, copied back in one copy per run of
blocks), so kvconnector's memory hit can be told apart from what any connector costs here.
With Redis, its engines first read each prompt from Redis (one ``GET`` of the whole prompt,
written there by a first floor engine) as kvconnector's first hit does ("floor-redis").

Each hit follows the same pause (``--pause``) and 16-token request (which also flushes the
connector's timers), as in ``bench_peers.py``. A ratio is a prompt's hit time over its vLLM
hit time in the same engine; the ratio per length is the median over every prompt and engine. The
engine's speed cancels out; what vLLM's connector machinery costs its own hit does not show
here (``bench_peers.py --floors`` measures that between engines). Every hit's first token
must equal vLLM's own hit's.

With vLLM's stat loggers on (the default here), each hit's time to first token is also split
at the engine core's timestamps (``common.ttft_stages``: submit, wait, step, output), and
the report gives each stage's extra over vLLM's own hit of the same prompt: where a hit's
extra lands, hooks or not.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time

from bench_peers import fill_disk, fill_redis
from common import (
    ROOT,
    STAGES,
    add_model_args,
    connector,
    connector_seconds,
    engine,
    in_fresh_process,
    median_interval,
    random_prompt,
    ratio_plot,
    redis_for,
    resolve_model,
    timed_generate,
    ttft_stages,
    write_results,
)

TIERS = ("redis", "disk", "vllm", "memory", "example", "floor-redis", "floor")
GOALS = {"memory": 1.05, "redis": 1.25}


def run_engine(model: str, args, kvt: dict, prompts: dict[int, list[list[int]]],
               lower: str | None, reloaded: str = "memory") -> dict:
    """Per length, per prompt: each tier's hit time, first token and connector timers."""
    max_len = max(prompts) + 64
    out: dict[int, list[dict]] = {}

    with engine(model, args, kvt, max_len, enable_prefix_caching=True,
                max_num_batched_tokens=max_len, disable_log_stats=not args.log_stats) as llm:

        def settle() -> dict[str, float]:
            time.sleep(args.pause)
            timed_generate(llm, [random_prompt(random.Random(8), 16, 400)], 1)
            return connector_seconds()

        def hit(p: list[int]) -> dict:
            before = settle()
            start = time.monotonic()
            secs, outs = timed_generate(llm, [p], 1)
            split = ttft_stages(outs[0], start, time.monotonic())
            after = settle()
            return {"s": secs, "cached": outs[0].num_cached_tokens or 0,
                    "token": outs[0].outputs[0].token_ids[0], "stages": split,
                    "phases": {k: v - before.get(k, 0.0) for k, v in after.items()
                               if v - before.get(k, 0.0) > 0}}

        timed_generate(llm, [random_prompt(random.Random(9), 300, 400)], 1)
        for n, group in prompts.items():
            out[n] = []
            for p in group:
                rec = {}
                if lower is not None:
                    rec[lower] = hit(p)
                else:
                    timed_generate(llm, [p], 1)  # a miss: kvconnector stores the prompt
                rec["vllm"] = hit(p)
                if not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM did not reset its prefix cache")
                rec[reloaded] = hit(p)
                out[n].append(rec)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16", redis=True)
    p.add_argument("--no-redis", dest="redis", action="store_false")
    p.add_argument("--disk", action="store_true",
                   help="a disk hit instead of a Redis hit (engines with a disk tier)")
    # 16000, not 16384: the tiny model's 16384 positions also hold the generated token.
    p.add_argument("--lengths", default="1024,4096,16000")
    p.add_argument("--prompts", type=int, default=4, help="distinct prompts per length")
    p.add_argument("--engines", type=int, default=3, help="fresh engines, each on every prompt")
    p.add_argument("--pause", type=float, default=0.3,
                   help="seconds of idle engine before the 16-token request that precedes "
                        "each hit (0: hits follow each other as in a busy server)")
    p.add_argument("--key-mirror", action="store_true",
                   help="the engines answer Redis lookups from their key mirror "
                        "(redis_key_mirror)")
    p.add_argument("--example", action="store_true",
                   help="also as many engines with vLLM's ExampleConnector, whose hit after "
                        "reset_prefix_cache() is paired with vLLM's own hit the same way")
    p.add_argument("--floor", action="store_true",
                   help="also as many engines with floor_connector.py (the least a connector "
                        "does for a hit: from memory, and from Redis with a Redis tier), "
                        "paired with vLLM's own hit the same way")
    p.add_argument("--whole-loads", action="store_true",
                   help="kvconnector's loads whole before the forward (load_by_layer false), "
                        "not layer by layer beside it")
    p.add_argument("--no-log-stats", dest="log_stats", action="store_false",
                   help="vLLM's stat loggers off (as LLM() has them by default): no phase "
                        "timers then")
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    if args.disk:
        args.redis, args.redis_url = False, None
    with redis_for(args) as args:
        (ROOT / ".cache").mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=ROOT / ".cache", prefix="bench-hit-disk-") as d:
            bench(args, d if args.disk else None)


def bench(args, disk_root: str | None) -> None:
    from tqdm import tqdm

    model, vocab = resolve_model(args)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    extra = {"memory_capacity": args.memory_capacity}
    if args.whole_loads:
        extra["load_by_layer"] = False
    lower = "disk" if disk_root else "redis" if args.redis_url else None
    if args.redis_url:
        extra["redis_url"] = args.redis_url
        if args.key_mirror:
            extra["redis_key_mirror"] = True
    engines = []
    for e in tqdm(range(args.engines), desc="engines"):
        rng = random.Random(100 + e)  # new prompts for every engine: each one's first
        prompts = {n: [random_prompt(rng, n, vocab) for _ in range(args.prompts)]
                   for n in lengths}  # request of a prompt must miss vLLM's cache
        chunks = sum(len(q) // 256 for group in prompts.values() for q in group)
        kvt = connector(extra)
        if lower == "redis":
            import redis

            redis.Redis.from_url(args.redis_url).flushall()  # fill_redis counts the keys
            in_fresh_process(fill_redis, model, args, kvt, prompts, chunks)
        elif lower == "disk":
            directory = f"{disk_root}/{e}"  # a fresh directory: fill_disk counts the files
            kvt = connector({**extra, "disk_path": directory})
            in_fresh_process(fill_disk, model, args, kvt, prompts, directory, chunks)
        engines.append(in_fresh_process(run_engine, model, args, kvt, prompts, lower))
        if lower == "disk":
            shutil.rmtree(directory)
        if args.example:
            with tempfile.TemporaryDirectory(prefix="kvc-example-connector-") as folder:
                example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": folder}}
                engines.append(in_fresh_process(run_engine, model, args, example, prompts,
                                                None, "example"))
        if args.floor:
            floor = {"kv_connector": "FloorConnector", "kv_connector_module_path":
                     "floor_connector", "kv_role": "kv_both"}
            floor_lower = None
            if lower == "redis":
                import redis

                floor["kv_connector_extra_config"] = {"redis_url": args.redis_url}
                redis.Redis.from_url(args.redis_url).flushall()
                in_fresh_process(fill_redis, model, args, floor, prompts,
                                 sum(len(g) for g in prompts.values()))  # a value a prompt
                floor_lower = "floor-redis"
            engines.append(in_fresh_process(run_engine, model, args, floor, prompts,
                                            floor_lower, "floor"))
    tiers = [t for t in TIERS if t in ("vllm", "memory") or t == lower
             or (t == "example" and args.example) or (t == "floor" and args.floor)
             or (t == "floor-redis" and args.floor and lower == "redis")]
    report(args, model, lengths, tiers, engines)


def report(args, model: str, lengths: list[int], tiers: list[str],
           engines: list[dict]) -> None:
    loaded = [t for t in tiers if t != "vllm"]
    ratios: dict[str, dict[int, list[float]]] = {t: {n: [] for n in lengths} for t in loaded}
    by_engine: dict[str, dict[int, list[list[float]]]] = {t: {n: [] for n in lengths}
                                                          for t in loaded}
    secs: dict[str, dict[int, list[float]]] = {t: {n: [] for n in lengths} for t in tiers}
    phases: dict[str, dict[int, dict[str, float]]] = {t: {n: {} for n in lengths}
                                                      for t in loaded}
    differ: list[str] = []
    short: list[str] = []  # hits that loaded less than vLLM's own hit held: not hits
    stage_extra: dict[str, dict[int, list[list[float]]]] = {t: {n: [] for n in lengths}
                                                            for t in loaded}
    for e, runs in enumerate(engines):
        for n in lengths:
            recs = runs[n]
            for t in tiers:
                secs[t][n] += [r[t]["s"] for r in recs if t in r]
            for t in loaded:
                if t not in recs[0]:
                    continue  # kvconnector's engines, ExampleConnector's or the floor's
                stage_extra[t][n] += [[a - b for a, b in zip(r[t]["stages"], r["vllm"]["stages"],
                                                             strict=True)]
                                      for r in recs if r[t].get("stages") and r["vllm"].get(
                                          "stages")]
                mine = [r[t]["s"] / r["vllm"]["s"] for r in recs]
                ratios[t][n] += mine
                by_engine[t][n].append(mine)
                for r in recs:
                    for k, v in r[t]["phases"].items():
                        phases[t][n][k] = phases[t][n].get(k, 0.0) + v / (
                            len(recs) * sum(t in runs_[n][0] for runs_ in engines))
                    if r[t]["token"] != r["vllm"]["token"]:
                        differ.append(f"engine {e}, {n} tokens, {t}")
                    if r[t]["cached"] < r["vllm"]["cached"]:
                        short.append(f"engine {e}, {n} tokens, {t}: {r[t]['cached']} of "
                                     f"{r['vllm']['cached']}")
    med = {t: {n: statistics.median(ratios[t][n]) for n in lengths} for t in loaded}
    per_engine = {t: {n: [statistics.median(g) for g in by_engine[t][n]] for n in lengths}
                  for t in loaded}
    interval = {t: {n: median_interval(by_engine[t][n]) for n in lengths} for t in loaded}
    print(f"\na hit against vLLM's own hit of the same prompt in the same engine; {model} "
          f"({args.dtype}), {args.prompts} prompts x {len(per_engine['memory'][lengths[0]])} "
          "engines per length and connector")
    print(f"{'tokens':>7} {'vLLM hit':>10} " + " ".join(
        f"{t + ' hit':>12} {'ratio':>7} {'90% interval':>13} {'per engine':>22}"
        for t in loaded))
    for n in lengths:
        cells = [f"{statistics.median(secs['vllm'][n]) * 1000:>8.2f}ms"]
        for t in loaded:
            spread = ", ".join(f"{x:.2f}" for x in per_engine[t][n])
            cells.append(f"{statistics.median(secs[t][n]) * 1000:>10.2f}ms "
                         f"{med[t][n]:>6.3f}x {interval[t][n][0]:>6.3f}-{interval[t][n][1]:.3f}"
                         f" {spread:>22}")
        print(f"{n:>7} " + " ".join(cells))
    print("goals: " + ", ".join(f"{t} at most {g}x" for t, g in GOALS.items() if t in loaded))
    print("90% interval: of the median ratio, engines and then hits resampled (bootstrap)")
    print("first tokens: " + ("all equal to vLLM's own hit's" if not differ
                              else "DIFFER in " + "; ".join(differ)))
    if short:
        print("LOADED LESS than vLLM's own hit held (timed as hits, they were not): "
              + "; ".join(short))
    print("where a hit's time went (ms per hit, the connector's phase timers):")
    for t in loaded:
        for n in lengths:
            parts = sorted(phases[t][n].items(), key=lambda kv: -kv[1])[:6]
            if not parts:
                continue  # ExampleConnector and the floor have no phase timers
            print(f"  {t}, {n} tokens: " + ", ".join(f"{k} {v * 1000:.2f}" for k, v in parts))
    stage_ms = {t: {n: [statistics.median(d[j] for d in stage_extra[t][n]) * 1000
                        for j in range(len(STAGES))]
                    for n in lengths if stage_extra[t][n]} for t in loaded}
    if any(stage_ms.values()):
        print("where the extra time lands: a hit's stage minus that of vLLM's own hit of the "
              "same prompt, ms (median over hits)")
        print(f"{'tier':>12} {'tokens':>7} " + " ".join(f"{s:>8}" for s in STAGES))
        for t in loaded:
            for n, row in stage_ms[t].items():
                print(f"{t:>12} {n:>7} " + " ".join(f"{x:>+8.3f}" for x in row))
    out = write_results(args.out, "hit_paired", {
        "model": model, "dtype": args.dtype, "lengths": lengths, "prompts": args.prompts,
        "engines": len(engines), "pause_s": args.pause, "key_mirror": args.key_mirror,
        "redis_cpus": getattr(args, "redis_cpus_used", None),
        "ratio_median": med, "ratio_median_interval_90": interval,
        "ratio_per_engine": per_engine, "ratios": ratios,
        "seconds": secs, "phases_per_hit_s": phases, "stages": list(STAGES),
        "stage_extra_ms": stage_ms, "tokens_differ": differ,
        "loaded_less": short})
    print(f"results: {out}")
    ratio_plot(args.plot or out.with_suffix(".png"), lengths,
               {f"{t} hit": med[t] for t in loaded},
               dots={f"{t} hit": per_engine[t] for t in loaded},
               goals={f"{t} goal ({g}x)": g for t, g in GOALS.items() if t in loaded},
               ylabel="hit TTFT / vLLM's own hit, same engine",
               title=f"Paired hits ({model.rstrip('/').split('/')[-1]}, {args.dtype}); "
                     "dots: engines")

if __name__ == "__main__":
    main()
