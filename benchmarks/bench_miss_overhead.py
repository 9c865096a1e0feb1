"""What the connector costs when nothing is reused: throughput of a workload of distinct
prompts with the connector (saving every chunk, never hitting) against vLLM without it.

    python benchmarks/bench_miss_overhead.py [--model M] [--prompts 24 --prompt-tokens 1024]

Each engine runs in its own fresh process, one at a time, alternating between the two
configurations (none, connector, none, connector, ...) to spread machine noise; each engine
measures ``--rounds-per-engine`` rounds of fresh prompts after a warm-up.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import (
    add_model_args,
    connector,
    connector_seconds,
    engine,
    in_fresh_process,
    random_prompt,
    resolve_model,
    timed_generate,
    write_results,
)


def run_engine(model: str, args, kvt: dict | None, seed: int, vocab: int,
               env: dict[str, str] | None = None) -> dict:
    import os

    os.environ.update(env or {})  # this process is the engine's: its workers inherit it
    rng = random.Random(seed)
    max_len = args.prompt_tokens + args.output_tokens + 16
    rates, seconds = [], 0.0
    with engine(model, args, kvt, max_len, enable_prefix_caching=True,
                disable_log_stats=False) as llm:
        timed_generate(llm, [random_prompt(rng, args.prompt_tokens, vocab)], 4)
        before = connector_seconds() if kvt else {}
        for _ in range(args.rounds_per_engine):
            prompts = [random_prompt(rng, args.prompt_tokens, vocab)
                       for _ in range(args.prompts)]
            secs, outs = timed_generate(llm, prompts, args.output_tokens)
            assert all((o.num_cached_tokens or 0) == 0 for o in outs), "unexpected reuse"
            tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
            rates.append(tokens / secs)
            seconds += secs
        phases = {}
        if kvt:
            time.sleep(0.3)  # the timers reach the metrics a few times a second
            timed_generate(llm, [random_prompt(rng, 16, vocab)], 1)
            after = connector_seconds()
            phases = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {"rates": rates, "seconds": seconds, "phases": phases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--engines", type=int, default=3, help="fresh engines per configuration")
    p.add_argument("--rounds-per-engine", type=int, default=2)
    p.add_argument("--disk", action="store_true",
                   help="also a connector with a disk tier behind memory (a temporary "
                   "directory under .cache), in the same run")
    args = p.parse_args()
    if args.disk:
        import tempfile

        from common import ROOT

        (ROOT / ".cache").mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=ROOT / ".cache", prefix="bench-miss-disk-") as d:
            bench(args, d)
    else:
        bench(args, None)


def bench(args, disk_path: str | None) -> None:
    from tqdm import tqdm

    model, vocab = resolve_model(args)
    extra = {"memory_capacity": args.memory_capacity}
    if args.redis_url:
        extra["redis_url"] = args.redis_url
    configs = {"no connector": (None, None), "connector (all misses)": (connector(extra), None)}
    if disk_path is not None:
        configs["connector + disk tier"] = (connector({**extra, "disk_path": disk_path}), None)
    tput: dict[str, list[float]] = {n: [] for n in configs}
    phases: dict[str, dict[str, float]] = {}
    measured: dict[str, float] = {}
    order = [name for _ in range(args.engines) for name in configs]
    for i, name in enumerate(tqdm(order, desc="engines")):
        kvt, env = configs[name]
        res = in_fresh_process(run_engine, model, args, kvt, 100 + i, vocab, env)
        tput[name] += res["rates"]
        if res["phases"]:
            measured.setdefault(name, 0.0)
            measured[name] += res["seconds"]
            for k, v in res["phases"].items():
                phases.setdefault(name, {})[k] = phases.get(name, {}).get(k, 0.0) + v
    names = list(configs)
    med = {n: statistics.median(v) for n, v in tput.items()}
    ratio = med[names[1]] / med[names[0]]
    print(f"\nthroughput (prompt+output tokens/s), {args.prompts} x {args.prompt_tokens}-token "
          f"prompts, {args.output_tokens} output tokens, {model}")
    for n in names:
        print(f"  {n:<24} median {med[n]:>8.0f}   all: {[round(x) for x in tput[n]]}")
    change = f"{(1 - ratio) * 100:.1f}% slower" if ratio < 1 else f"{(ratio - 1) * 100:.1f}% faster"
    print(f"  connector / none: {ratio:.3f} ({change}; goal: at most 3% slower)")
    for n in names[2:]:
        print(f"  {n} / none: {med[n] / med[names[0]]:.3f}, / connector: "
              f"{med[n] / med[names[1]]:.3f}")
    for name, secs in measured.items():
        print(f"  where the time of '{name}' went ({secs:.1f} s of measured rounds; hooks run "
              "on vLLM's threads, copy and write threads beside them):")
        for k, v in sorted(phases[name].items(), key=lambda x: -x[1]):
            print(f"    {k:<32} {v * 1000:8.1f} ms  {v / secs * 100:5.2f}%")
    out = write_results(args.out, "miss_overhead", {
        "model": model, "configs": list(configs), "redis": bool(args.redis_url),
        "prompts": args.prompts,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "tokens_per_s": tput, "median": med,
        "ratio": ratio, "connector_seconds": phases, "measured_seconds": measured})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
