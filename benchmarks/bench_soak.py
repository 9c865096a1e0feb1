"""Soak: many requests through one engine with a small memory tier and Redis behind it
(saves, hits from memory and Redis, evictions, aborts mixed); the process's resident memory
sampled along the way. LMCache users report host memory that grows with a Redis tier
(LMCache issue 2017); this shows whether kvconnector's does.

    .venv/bin/python benchmarks/bench_soak.py --redis [--requests 2000]

Writes docs/results/soak.json and soak.png: resident memory against requests served, and
the growth after warm-up (the goal: under 2%).
"""

from __future__ import annotations

import argparse
import os
import random
import time

from common import (
    ROOT,
    add_model_args,
    connector,
    pyplot,
    redis_for,
    resolve_model,
    write_results,
)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=300, help="requests before the baseline")
    ap.add_argument("--sample-every", type=int, default=50)
    ap.set_defaults(memory_capacity="4MiB", kv_cache_memory_bytes=64 << 20)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker in this process
    model, vocab = resolve_model(args)
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    with redis_for(args) as args:
        extra = {"memory_capacity": args.memory_capacity}
        if args.redis_url:
            extra["redis_url"] = args.redis_url
        llm = LLM(model=model, dtype=args.dtype, max_model_len=4096, enforce_eager=True,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                  kv_transfer_config=connector(extra), enable_prefix_caching=False)
        engine = llm.llm_engine
        rng = random.Random(0)
        prefixes = [[rng.randrange(10, vocab - 1) for _ in range(rng.choice([256, 512, 1024]))]
                    for _ in range(60)]
        samples: list[tuple[int, int]] = []
        done = aborted = 0
        start = time.monotonic()
        with tqdm(total=args.requests, desc="soak", unit="req") as bar:
            while done < args.requests:
                batch = []
                for _ in range(min(4, args.requests - done)):
                    p = rng.choice(prefixes) + [rng.randrange(10, vocab - 1)
                                                for _ in range(rng.randint(1, 600))]
                    rid = f"r{done + len(batch)}"
                    engine.add_request(rid, {"prompt_token_ids": p}, SamplingParams(
                        temperature=0, max_tokens=rng.randint(1, 16), ignore_eos=True))
                    batch.append(rid)
                to_abort = [r for r in batch if rng.random() < 0.1]
                steps = 0
                while engine.has_unfinished_requests():
                    engine.step()
                    steps += 1
                    if steps == 2 and to_abort:
                        engine.abort_request(to_abort)
                aborted += len(to_abort)
                before = done
                done += len(batch)
                bar.update(len(batch))
                if done // args.sample_every != before // args.sample_every:
                    samples.append((done, rss_bytes()))
        seconds = time.monotonic() - start
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        totals = dict(get_kv_transfer_group().worker.totals.data)
    base = next(rss for n, rss in samples if n >= args.warmup)
    growth = (samples[-1][1] - base) / base
    peak = (max(rss for n, rss in samples if n >= args.warmup) - base) / base
    print(f"soak: {done} requests ({aborted} aborted) in {seconds:.0f} s; resident memory "
          f"{base / 2**20:.0f} MiB after {args.warmup} requests, {samples[-1][1] / 2**20:.0f} "
          f"MiB at the end: {growth:+.2%} (peak {peak:+.2%}); goal under +2%")
    print("connector: " + ", ".join(f"{k} {totals.get(k, 0):.0f}" for k in (
        "saved_chunks", "loaded_chunks", "redis_loaded_chunks", "redis_chunks.put",
        "load_errors")))
    out = write_results(args.out, "soak", {
        "requests": done, "aborted": aborted, "seconds": seconds, "warmup": args.warmup,
        "memory_capacity": args.memory_capacity, "redis": bool(args.redis_url),
        "samples": samples, "growth_after_warmup": growth, "peak_after_warmup": peak,
        "connector_totals": {k: v for k, v in totals.items() if not isinstance(v, dict)}})
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([n for n, _ in samples], [r / 2**20 for _, r in samples], marker=".")
        ax.axvline(args.warmup, color="grey", linestyle=":", label="end of warm-up")
        ax.axhline(base * 1.02 / 2**20, color="red", linestyle="--", label="+2% goal")
        ax.set_xlabel("requests served")
        ax.set_ylabel("resident memory (MiB)")
        ax.set_title(f"Soak: memory tier {args.memory_capacity}"
                     f"{' + Redis' if args.redis_url else ''}, {aborted} aborts")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"results: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
