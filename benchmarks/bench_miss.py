"""What a miss costs a lone request: TTFT of prompts seen for the first time, with the
connector (memory; memory + Redis; memory + disk) against vLLM alone, by prompt length, and
where the connector's time went (its own phase timers), length by length.

    python benchmarks/bench_miss.py                  # tiny Mistral, 1k-16k tokens, all tiers
    python benchmarks/bench_miss.py --model .cache/smollm2 --dtype bfloat16 --lengths 1024,4096,8000
    python benchmarks/bench_miss.py --no-redis --buffered-disk   # disk writes direct or buffered
    python benchmarks/bench_miss.py --no-disk --redis-anywhere   # where redis-server runs

Each engine runs in its own fresh process; the configurations take turns (``--rounds``
times each, in a rotated order every round) to spread this machine's noise over all of
them. An engine sends one request at a time, a one-token generation, ``--prompts`` distinct
prompts per length, longest last; every prompt is new to every engine, so the connector
saves every chunk (and queues it for Redis or disk) and never loads one. Saving a prompt
runs after its step, so its cost lands on the requests that follow, as in serving. vLLM's
prefix cache is on everywhere (its default); nothing is reused from it either. The ratio per
length is the median TTFT of a configuration over all its prompts against vLLM alone's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from contextlib import ExitStack

from common import (
    ROOT,
    add_model_args,
    connector,
    connector_seconds,
    engine,
    in_fresh_process,
    local_redis,
    random_prompt,
    ratio_plot,
    redis_for,
    resolve_model,
    rotated_order,
    timed_generate,
    write_results,
)

ALONE = "vLLM alone"
GOAL = 1.03


def run_config(model: str, args, kvt: dict | None, lengths: list[int], seed: int,
               vocab: int) -> dict:
    """TTFT of each new prompt, and the connector's phase seconds, per length."""
    rng = random.Random(seed)
    ttft: dict[int, list[float]] = {}
    phases: dict[int, dict[str, float]] = {}
    with engine(model, args, kvt, max(lengths) + 16, enable_prefix_caching=True,
                disable_log_stats=False) as llm:
        timed_generate(llm, [random_prompt(rng, 300, vocab)], 1)
        for n in lengths:
            before = connector_seconds()
            ttft[n] = []
            for _ in range(args.prompts):
                secs, outs = timed_generate(llm, [random_prompt(rng, n, vocab)], 1)
                assert (outs[0].num_cached_tokens or 0) == 0, "a new prompt hit a cache"
                ttft[n].append(secs)
            if kvt:
                time.sleep(0.3)  # the timers reach the metrics a few times a second
                timed_generate(llm, [random_prompt(rng, 16, vocab)], 1)
                after = connector_seconds()
                phases[n] = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {"ttft": ttft, "phases": phases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16", redis=True)
    p.add_argument("--no-redis", dest="redis", action="store_false")
    p.add_argument("--no-disk", dest="disk", action="store_false")
    p.add_argument("--buffered-disk", action="store_true",
                   help="also the disk tier through the page cache (disk_direct_io false)")
    # 16000, not 16384: the tiny model's 16384 positions also hold the generated token.
    p.add_argument("--lengths", default="1024,4096,8192,16000")
    p.add_argument("--prompts", type=int, default=3, help="distinct prompts per length")
    p.add_argument("--rounds", type=int, default=2, help="engines per configuration")
    p.add_argument("--plot", default=None)
    p.add_argument("--redis-anywhere", action="store_true",
                   help="also a second local redis-server left wherever the kernel puts it "
                        "(--redis-cpus any), as its own configuration in the same run")
    with redis_for(p.parse_args()) as args, ExitStack() as stack:
        args.redis_anywhere_url = None
        if args.redis and args.redis_anywhere:
            args.redis_anywhere_url = stack.enter_context(local_redis("any")).url
        (ROOT / ".cache").mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=ROOT / ".cache", prefix="bench-miss-disk-") as d:
            bench(args, d if args.disk else None)


def bench(args, disk_path: str | None) -> None:
    from tqdm import tqdm

    model, vocab = resolve_model(args)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    extra = {"memory_capacity": args.memory_capacity}
    configs: dict[str, dict | None] = {ALONE: None, "memory": connector(extra)}
    if args.redis_url:
        configs["memory + Redis"] = connector({**extra, "redis_url": args.redis_url})
    if args.redis_anywhere_url:
        configs["memory + Redis, server anywhere"] = connector(
            {**extra, "redis_url": args.redis_anywhere_url})
    if disk_path is not None:
        configs["memory + disk"] = connector({**extra, "disk_path": disk_path})
        if args.buffered_disk:
            configs["memory + disk, buffered"] = connector(
                {**extra, "disk_path": disk_path, "disk_direct_io": False})
    names = list(configs)
    order = rotated_order(names, args.rounds)
    ttft: dict[str, dict[int, list[float]]] = {c: {n: [] for n in lengths} for c in names}
    phases: dict[str, dict[int, dict[str, float]]] = {c: {} for c in names}
    rounds: dict[str, list[dict[int, float]]] = {c: [] for c in names}
    for i, name in enumerate(tqdm(order, desc="engines")):
        res = in_fresh_process(run_config, model, args, configs[name], lengths, 1000 + i, vocab)
        rounds[name].append({n: statistics.median(res["ttft"][n]) for n in lengths})
        for n in lengths:
            ttft[name][n] += res["ttft"][n]
            for k, v in res["phases"].get(n, {}).items():
                per = phases[name].setdefault(n, {})
                per[k] = per.get(k, 0.0) + v
    med = {c: {n: statistics.median(ttft[c][n]) for n in lengths} for c in names}
    ratio = {c: {n: med[c][n] / med[ALONE][n] for n in lengths} for c in names}

    print(f"\nmiss TTFT, median of {args.prompts} prompts x {args.rounds} engines, {model} "
          f"({args.dtype}); ratio to {ALONE}, goal at most {GOAL}x")
    print(f"{'tokens':>7} " + " ".join(f"{c:>22}" for c in names))
    for n in lengths:
        cells = [f"{med[ALONE][n]:.4f} s"] + [f"{med[c][n]:.4f} s ({ratio[c][n]:.3f}x)"
                                                for c in names[1:]]
        print(f"{n:>7} " + " ".join(f"{x:>22}" for x in cells))
    for c in names[1:]:
        for n in lengths:
            total = sum(ttft[c][n])
            parts = sorted(phases[c].get(n, {}).items(), key=lambda kv: -kv[1])
            print(f"  {c}, {n} tokens: connector time in {total:.2f} s of requests: " + ", ".join(
                f"{k} {v * 1000:.1f} ms ({v / total * 100:.1f}%)" for k, v in parts[:6]))
    out = write_results(args.out, "miss", {
        "model": model, "dtype": args.dtype, "lengths": lengths, "prompts": args.prompts,
        "rounds": args.rounds, "order": order,
        "redis_cpus": getattr(args, "redis_cpus_used", None), "ttft_s": ttft, "median_s": med,
        "ratio": ratio, "per_engine_median_s": rounds, "connector_seconds": phases})
    print(f"results: {out}")
    ratio_plot(args.plot or out.with_suffix(".png"), lengths,
               {c: ratio[c] for c in names[1:]}, goals={f"goal ({GOAL}x)": GOAL},
               ylabel=f"miss TTFT / {ALONE}",
               title=f"A miss against {ALONE} ({model.rstrip('/').split('/')[-1]}, "
                     f"{args.dtype})")

if __name__ == "__main__":
    main()
