"""What the connector costs when nothing is reused: throughput of a workload of distinct
prompts with the connector (saving every chunk, never hitting) against vLLM without it,
in the same run. Rounds alternate between the two engines to spread machine noise.

    python benchmarks/bench_miss_overhead.py [--model M] [--prompts 32 --prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
from contextlib import ExitStack

from common import (
    add_model_args,
    connector,
    engine,
    random_prompt,
    resolve_model,
    timed_generate,
    write_results,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    from tqdm import tqdm

    model, vocab = resolve_model(args)
    rng = random.Random(1)
    max_len = args.prompt_tokens + args.output_tokens + 16
    extra = {"memory_capacity": args.memory_capacity}
    if args.redis_url:
        extra["redis_url"] = args.redis_url
    names = ["no connector", "connector (all misses)"]
    tput: dict[str, list[float]] = {n: [] for n in names}
    with ExitStack() as stack:
        llms = {names[0]: stack.enter_context(engine(model, args, None, max_len,
                                                     enable_prefix_caching=True)),
                names[1]: stack.enter_context(engine(model, args, connector(extra), max_len,
                                                     enable_prefix_caching=True))}
        for llm in llms.values():
            timed_generate(llm, [random_prompt(rng, 200, vocab)], 4)
        for r in tqdm(range(args.rounds), desc="rounds"):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                prompts = [random_prompt(rng, args.prompt_tokens, vocab)
                           for _ in range(args.prompts)]
                secs, outs = timed_generate(llms[name], prompts, args.output_tokens)
                assert all((o.num_cached_tokens or 0) == 0 for o in outs), "unexpected reuse"
                tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids)
                             for o in outs)
                tput[name].append(tokens / secs)
    med = {n: statistics.median(v) for n, v in tput.items()}
    ratio = med[names[1]] / med[names[0]]
    print(f"\nthroughput (prompt+output tokens/s), median of {args.rounds} rounds, {model}")
    for n in names:
        print(f"  {n:<24} {med[n]:>10.0f}   rounds: {[round(x) for x in tput[n]]}")
    print(f"  connector / none: {ratio:.3f} ({(1 - ratio) * 100:+.1f}% slower; goal <= 3%)")
    out = write_results(args.out, "miss_overhead", {
        "model": model, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "tokens_per_s": tput, "median": med,
        "ratio": ratio})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
