"""TTFT against prompt length: no connector, connector miss, hit from memory (and Redis).

    python benchmarks/bench_ttft.py                       # tiny Mistral on this machine
    python benchmarks/bench_ttft.py --model mistralai/Mistral-7B-Instruct-v0.2 --redis-url redis://...

TTFT is the latency of a one-token generation of a single request. Each length is measured
``--repeats`` times on distinct prompts; the median is reported. Writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from common import (
    add_model_args,
    connector,
    engine,
    in_fresh_process,
    pyplot,
    random_prompt,
    redis_for,
    resolve_model,
    timed_generate,
    write_results,
)


def measure(llm, prompts: list[list[int]]) -> tuple[float, list[int]]:
    times, cached = [], []
    for p in prompts:
        secs, outs = timed_generate(llm, [p], max_tokens=1)
        times.append(secs)
        cached.append(outs[0].num_cached_tokens or 0)
    return statistics.median(times), cached


def run_config(model: str, args, kvt: dict | None, lengths: list[int],
               prompts: dict[int, list[list[int]]], repeat: bool) -> dict:
    """One engine: TTFT of every prompt (and again, if ``repeat``: hits)."""
    rng = random.Random(9)
    first, second, first_cached, cached = {}, {}, {}, {}
    with engine(model, args, kvt, max(lengths) + 64, enable_prefix_caching=False) as llm:
        timed_generate(llm, [random_prompt(rng, 300, 400)], 1)
        for n in lengths:
            first[n], first_cached[n] = measure(llm, prompts[n])
            if repeat:
                second[n], cached[n] = measure(llm, prompts[n])
    return {"first": first, "second": second, "first_cached": first_cached, "cached": cached}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--lengths", default="512,1024,2048,4096,8192")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plot", type=Path, default=None)
    with redis_for(p.parse_args()) as args:
        bench(args)


def bench(args) -> None:
    from tqdm import tqdm

    model, vocab = resolve_model(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)
    prompts = {n: [random_prompt(rng, n, vocab) for _ in range(args.repeats)] for n in lengths}
    extra = {"memory_capacity": args.memory_capacity}
    if args.redis_url:
        extra["redis_url"] = args.redis_url
    configs = [("none", None, False), ("connector", connector(extra), True)]
    if args.redis_url:  # a fresh engine has an empty memory tier: its hits come from Redis
        configs.append(("redis", connector(extra), False))
    runs = {name: in_fresh_process(run_config, model, args, kvt, lengths, prompts, repeat)
            for name, kvt, repeat in tqdm(configs, desc="engines")}
    results = {"no connector": runs["none"]["first"],
               "connector miss": runs["connector"]["first"],
               "hit from memory": runs["connector"]["second"]}
    cached = {"hit from memory": runs["connector"]["cached"]}
    if args.redis_url:
        results["hit from redis"] = runs["redis"]["first"]
        cached["hit from redis"] = runs["redis"]["first_cached"]

    print(f"\nTTFT (s), median of {args.repeats}, model {model}")
    names = list(results)
    print(f"{'tokens':>7} " + " ".join(f"{n:>16}" for n in names))
    for n in lengths:
        print(f"{n:>7} " + " ".join(f"{results[k][n]:>16.4f}" for k in names))
    out = write_results(args.out, "ttft", {"model": model, "lengths": lengths,
                                           "ttft_s": results, "cached_tokens": cached})
    for k, per_len in cached.items():
        print(f"  cached tokens, {k}: {per_len}")
    print(f"results: {out}")
    plot = args.plot or out.with_suffix(".png")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in names:
        ax.plot(lengths, [results[k][n] for n in lengths], marker="o", label=k)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"TTFT vs prompt length ({Path(model).name})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
