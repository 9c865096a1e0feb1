"""Where the whole machine's CPU goes during a steady stream of one kind of request.

    python benchmarks/bench_stream_profile.py --kind miss --tier redis --tokens 1024
    python benchmarks/bench_stream_profile.py --kind hit --tier redis --tokens 1024
    python benchmarks/bench_stream_profile.py --kind vllm-hit --tokens 1024

One engine (this process, its engine-core and worker processes) serves requests one at a
time for ``--seconds`` while ``perf record -a`` samples every core; the report gives the
requests' median TTFT and each thread's CPU per request, kvconnector's threads by their
names (``kvc-copy``, ``kvc-redis-put``, ``kvc-lookup``, ...), redis-server's included,
which the connector's own timers cannot see. It needs ``perf`` and the right to sample
every process (root, or ``kernel.perf_event_paranoid`` at -1).

Kinds: ``miss`` (new prompts; kvconnector looks them up and stores them), ``opted-out``
(new prompts that opt out of kvconnector), ``hit`` (prompts stored first, then asked
again with a memory tier too small to keep them, so each hit comes from ``--tier``; with
``--tier memory`` the memory tier holds them all), ``vllm-hit`` (vLLM's own prefix cache;
kvconnector attached with its memory tier).

vLLM's engine-core process and its worker spin while they wait for each other (vLLM's
shared-memory queue polls with ``sched_yield``), so their CPU is not all work; compare a
kind against ``opted-out`` or ``vllm-hit`` of the same length.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time

from common import (
    ROOT,
    add_model_args,
    chunk_bytes,
    connector,
    engine,
    fill_to_maxmemory,
    local_redis,
    random_prompt,
    resolve_model,
    write_results,
)

KINDS = ("miss", "opted-out", "hit", "vllm-hit")
TIERS = ("memory", "redis", "full-redis", "disk")
PERF_HZ = 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16")
    p.add_argument("--kind", choices=KINDS, default="miss")
    p.add_argument("--tier", choices=TIERS, default="memory",
                   help="kvconnector's tier behind memory (full-redis: a Redis that evicts, "
                        "filled to --full-redis-maxmemory first)")
    p.add_argument("--full-redis-maxmemory", default="256mb")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=12.0, help="the sampled window")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts stored before a hit stream (default: enough for the window, "
                        "from a first timed request)")
    args = p.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("bench_stream_profile.py needs `perf` (linux-tools) on PATH")
    with contextlib.ExitStack() as stack:
        model, vocab = resolve_model(args)
        extra: dict = {"memory_capacity": args.memory_capacity}
        if args.tier == "redis" and args.redis_url:
            extra["redis_url"] = args.redis_url  # a server of the caller's
        elif args.tier in ("redis", "full-redis"):
            maxmemory = args.full_redis_maxmemory if args.tier == "full-redis" else None
            server = stack.enter_context(local_redis(args.redis_cpus, maxmemory))
            extra["redis_url"] = server.url
            if maxmemory:
                fill_to_maxmemory(server.url, chunk_bytes(model, args.dtype))
        elif args.tier == "disk":
            (ROOT / ".cache").mkdir(exist_ok=True)
            extra["disk_path"] = stack.enter_context(
                tempfile.TemporaryDirectory(dir=ROOT / ".cache", prefix="bench-stream-disk-"))
        if args.kind == "hit" and args.tier != "memory":
            # Room for one request's chunks (they land in slots) but not for the stream's.
            extra["memory_capacity"] = (args.tokens // 256 + 4) * chunk_bytes(model, args.dtype)
        report(args, model, *stream(args, model, vocab, connector(extra)))


def stream(args, model: str, vocab: int, kvt: dict) -> tuple[list[float], str, float]:
    """TTFTs inside the sampled window, the perf data file, and the share of perf's samples
    that fell while the requests ran (perf also sampled its own start and stop)."""
    from vllm import SamplingParams

    plain = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    opted = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                           extra_args={"kv_transfer_params": {"kvconnector": False}})
    rng = random.Random(11)
    with engine(model, args, kvt, args.tokens + 16,
                enable_prefix_caching=args.kind == "vllm-hit") as llm:
        def ask(prompt: list[int], params=plain) -> float:
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            return time.perf_counter() - start

        first = [ask(random_prompt(rng, args.tokens, vocab)) for _ in range(5)][-1]
        stored: list[list[int]] = []
        if args.kind in ("hit", "vllm-hit"):
            n = args.prompts or int(args.seconds / (first / 2)) + 20
            stored = [random_prompt(rng, args.tokens, vocab) for _ in range(n)]
            for prompt in stored:
                ask(prompt)
            time.sleep(2)  # the lower tier's writes land
        data = tempfile.NamedTemporaryFile(prefix="kvc-perf-", suffix=".data", delete=False).name
        perf = subprocess.Popen(["perf", "record", "-a", "-e", "cpu-clock", "-F", str(PERF_HZ),
                                 "-o", data], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        perf_start = time.monotonic()
        time.sleep(0.5)  # perf is sampling
        ttfts: list[float] = []
        start = time.monotonic()
        end = start + args.seconds
        next_stored = iter(stored)
        while time.monotonic() < end:
            if stored:
                prompt = next(next_stored, None)
                if prompt is None:
                    break
                ttfts.append(ask(prompt))
            else:
                ttfts.append(ask(random_prompt(rng, args.tokens, vocab),
                                 opted if args.kind == "opted-out" else plain))
        stop = time.monotonic()
        perf.send_signal(signal.SIGINT)
        perf.wait(60)
        if stop < end:
            print(f"the {len(stored)} stored prompts ran out before the window's end: "
                  f"pass --prompts")
        return ttfts, data, (stop - start) / (stop - perf_start)


def cpu_by_thread(data: str) -> dict[str, float]:
    """Samples per thread name (comm) over every core; idle is ``swapper``."""
    out = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", "comm",
                          "-g", "none", "-n"], capture_output=True, text=True, check=True).stdout
    samples: dict[str, float] = {}
    for line in out.splitlines():
        m = re.match(r"\s*[\d.]+%\s+(\d+)\s+(.+?)\s*$", line)
        if m:
            samples[m.group(2)] = samples.get(m.group(2), 0) + int(m.group(1))
    return samples


def report(args, model: str, ttfts: list[float], data: str, share: float) -> None:
    samples = cpu_by_thread(data)
    os.unlink(data)
    requests = len(ttfts)
    ms = {name: n * share / PERF_HZ / requests * 1000 for name, n in samples.items()}
    print(f"\n{args.kind}, tier {args.tier}, {args.tokens} tokens, {model} ({args.dtype}): "
          f"{requests} requests in the window, median TTFT "
          f"{statistics.median(ttfts) * 1000:.2f} ms")
    print("CPU per request by thread (ms; idle cores are 'swapper'):")
    for name, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        if v >= 0.005:
            print(f"  {name:<20} {v:8.3f}")
    out = write_results(args.out, "stream_profile", {
        "model": model, "dtype": args.dtype, "kind": args.kind, "tier": args.tier,
        "tokens": args.tokens, "requests": requests, "seconds": args.seconds,
        "ttft_median_s": statistics.median(ttfts), "ttfts_s": ttfts,
        "cpu_ms_per_request": ms, "perf_hz": PERF_HZ})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
