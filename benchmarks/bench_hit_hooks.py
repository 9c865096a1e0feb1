"""What a memory hit costs in kvconnector's own code, call by call, against vLLM's own hit.

    python benchmarks/bench_hit_hooks.py                    # tiny Mistral, bf16, 1k and 4k
    python benchmarks/bench_hit_hooks.py --lengths 1024 --prompts 20
    python benchmarks/bench_hit_hooks.py --lengths 1024 --detail   # the calls inside too

The engine runs in this benchmark's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
every call kvconnector's scheduler and worker halves get from vLLM can be timed one by one.
Per prompt: a miss that stores it, then vLLM's own prefix-cache hit, ``reset_prefix_cache()``
and the same prompt's memory hit (each after a pause and a 16-token request, as in
``bench_hit_paired.py``). For each hit it records the time to its first token and the time
spent in kvconnector's calls; the difference of the two hits' calls is what the memory hit
adds in kvconnector's code. A hit's time to first token varies by more than that from one
hit to the next on this machine, which is why the calls are timed on their own.

Not the multi-process engine that users run (``bench_hit_paired.py`` measures that); the
per-call times include the cold caches each call meets after a forward pass.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import random
import statistics
import time
from collections import defaultdict

from common import (
    add_model_args,
    connector,
    engine,
    in_fresh_process,
    random_prompt,
    resolve_model,
    timed_generate,
    write_results,
)

SCHEDULER_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_meta",
                   "update_connector_output", "request_finished")
WORKER_CALLS = ("load",)  # the copy's share of it is timed apart
CALLS = (*SCHEDULER_CALLS, *WORKER_CALLS)
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "get_kv_connector_stats",
         "get_external_cache_hit_sources", "take_events", "has_pending_push_work",
         "bind_connector_metadata", "handle_preemptions", "start_load_kv",
         "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
         "get_block_ids_with_load_errors", "build_connector_worker_meta")


# --detail: inner calls timed too (module, class or None for a module function, names).
DETAIL = (
    ("kvconnector.connector", "KVConnector",
     ("start_load_kv", "get_kv_connector_stats", "wait_for_save", "get_finished",
      "build_connector_worker_meta", "get_block_ids_with_load_errors", "handle_preemptions")),
    ("kvconnector.block_copies", "BlockCopies", ("load",)),
    ("kvconnector.block_copies", None, ("block_runs",)),
    ("kvconnector.worker_store", "WorkerStore", ("check",)),
    ("kvconnector.kernels.batched", "PagedCopier", ("scatter", "_pairs", "_check")),
    ("kvconnector.ledger", "Ledger", ("loaded", "count", "observe")),
    ("kvconnector.background", "CopyThread", ("wait_for_slots",)),
    ("kvconnector.worker", "WorkerHalf", ("_by_layer", "_fetch", "take_stats")),
    ("kvconnector.prefix", "PrefixReuse", ("match", "_held", "_memory_partial", "plan_loads")),
    ("kvconnector.request_state", "RequestState", ("chunk_hashes", "partial_hash")),
    ("kvconnector.request_state", None, ("chunk_hashes",)),
    ("kvconnector.keys", None, ("token_bytes",)),
    ("kvconnector.scheduler", "SchedulerHalf", ("_state", "take_stats")),
    ("kvconnector.saves", "SavePlanner", ("plan_finish", "plan_step")),
    ("kvconnector.store.memory", "MemoryIndex", ("count_prefix", "use")),
)


def _time_details(calls: dict[str, list[float]]) -> None:
    """Wrap ``DETAIL``'s calls (before the engine starts, in its process)."""
    import importlib

    for module, cls, names in DETAIL:
        owner = importlib.import_module(module)
        if cls is not None:
            owner = getattr(owner, cls)
        for name in names:
            label = f"{module.rsplit('.', 1)[-1]}.{cls + '.' if cls else ''}{name}"
            setattr(owner, name, _timed(calls, label, getattr(owner, name)))


class Profile:
    """cProfile over kvconnector's calls of the memory hits only (``--profile``)."""

    def __init__(self) -> None:
        self.on = False  # during a memory hit
        self.depth = 0  # calls within calls (the copy runs inside the load)
        self.profiler = cProfile.Profile()

    def enter(self) -> None:
        if self.on and self.depth == 0:
            self.profiler.enable()
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.on and self.depth == 0:
            self.profiler.disable()

    def top(self, hits: int, rows: int = 30) -> list[dict]:
        """The functions that took most of the hits' time in themselves, per hit."""
        stats = pstats.Stats(self.profiler)
        out = []
        for (file, line, func), (_, calls, own, cumulative, _) in stats.stats.items():
            if file == __file__:
                continue  # this script's own timing wrappers
            out.append({"function": f"{os.path.basename(file)}:{line}:{func}",
                        "calls_per_hit": calls / hits, "own_us_per_hit": own / hits * 1e6,
                        "cumulative_us_per_hit": cumulative / hits * 1e6})
        return sorted(out, key=lambda r: -r["own_us_per_hit"])[:rows]


def _timed(calls: dict[str, list[float]], name: str, fn, profile: Profile | None = None):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if profile is not None:
            profile.enter()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            calls[name].append(time.perf_counter() - start)
            if profile is not None:
                profile.leave()
    return timed


def run_engine(model: str, args, kvt: dict, prompts: dict[int, list[list[int]]]) -> dict:
    from kvconnector import scheduler, worker
    from kvconnector.kernels import batched

    calls: dict[str, list[float]] = defaultdict(list)
    profile = Profile() if args.profile else None
    for name in SCHEDULER_CALLS:
        setattr(scheduler.SchedulerHalf, name,
                _timed(calls, name, getattr(scheduler.SchedulerHalf, name), profile))
    for name in WORKER_CALLS:
        setattr(worker.WorkerHalf, name,
                _timed(calls, name, getattr(worker.WorkerHalf, name), profile))
    batched._copy_all = _timed(calls, "copy", batched._copy_all, profile)
    if args.detail:
        _time_details(calls)
    if profile is not None:  # every hook vLLM calls, the ones timed above included
        from kvconnector.connector import KVConnector

        for name in HOOKS:
            setattr(KVConnector, name, _timed(defaultdict(list), name,
                                              getattr(KVConnector, name), profile))

    def settle() -> None:
        time.sleep(args.pause)
        timed_generate(llm, [random_prompt(random.Random(8), 16, 400)], 1)
        calls.clear()

    def hit(p: list[int], profiled: bool = False) -> dict:
        settle()
        if profile is not None:
            profile.on = profiled
        secs, outs = timed_generate(llm, [p], 1)
        if profile is not None:
            profile.on = False
        return {"s": secs, "token": outs[0].outputs[0].token_ids[0],
                "cached": outs[0].num_cached_tokens or 0,
                "calls": {k: sum(v) for k, v in calls.items()},
                "counts": {k: len(v) for k, v in calls.items()}}

    out: dict[int, list[dict]] = {}
    profiled = 0
    max_len = max(prompts) + 64
    with engine(model, args, kvt, max_len, enable_prefix_caching=True,
                max_num_batched_tokens=max_len) as llm:
        timed_generate(llm, [random_prompt(random.Random(9), 300, 400)], 1)
        for n, group in prompts.items():
            out[n] = []
            for p in group:
                timed_generate(llm, [p], 1)  # a miss: kvconnector stores the prompt
                rec = {"vllm": hit(p)}
                if not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM did not reset its prefix cache")
                warm = len(out[n]) >= args.warmup
                rec["memory"] = hit(p, profiled=warm)
                profiled += warm
                out[n].append(rec)
    if profile is not None:
        return {"hits": out, "profile": profile.top(max(1, profiled))}
    return {"hits": out}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16")
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--prompts", type=int, default=12, help="distinct prompts per length")
    p.add_argument("--warmup", type=int, default=2,
                   help="leading prompts of each length left out of the medians")
    p.add_argument("--pause", type=float, default=0.3)
    p.add_argument("--profile", action="store_true",
                   help="also profile kvconnector's calls in the memory hits (cProfile, "
                        "which slows them: its times are for ranking, not for the ratios)")
    p.add_argument("--detail", action="store_true",
                   help="also time the calls inside the hooks (DETAIL), each on its own; "
                        "their wrappers add about a microsecond each")
    args = p.parse_args()
    if args.prompts <= args.warmup:
        raise SystemExit(f"--prompts ({args.prompts}) must exceed --warmup ({args.warmup})")
    lengths = [int(n) for n in args.lengths.split(",")]
    model, vocab = resolve_model(args)
    rng = random.Random(5)
    prompts = {n: [random_prompt(rng, n, vocab) for _ in range(args.prompts)]
               for n in lengths}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the child's engine in its process
    got = in_fresh_process(run_engine, model, args,
                           connector({"memory_capacity": args.memory_capacity}), prompts)
    runs = got["hits"]

    summary: dict[int, dict] = {}
    print(f"{'tokens':>6} {'vLLM hit':>9} {'memory hit':>10} {'ratio':>6} "
          f"{'calls, vLLM':>11} {'calls, memory':>13} {'extra':>7} {'extra/hit':>9}")
    for n in lengths:
        recs = runs[n][args.warmup:]
        differ = sum(r["memory"]["token"] != r["vllm"]["token"] for r in runs[n])
        if differ:
            raise SystemExit(f"{differ} memory hits of {n} tokens gave another first token "
                             "than vLLM's own hit")
        short = sum(r["memory"]["cached"] < r["vllm"]["cached"] for r in runs[n])
        if short:
            raise SystemExit(f"{short} memory hits of {n} tokens loaded less than vLLM's own "
                             "hit held: --memory-capacity too small for the prompts?")
        s = {t: _median([r[t]["s"] for r in recs]) for t in ("vllm", "memory")}
        total = {t: _median([sum(r[t]["calls"].get(k, 0.0) for k in CALLS) for r in recs])
                 for t in ("vllm", "memory")}
        per_call = {k: _median([r["memory"]["calls"].get(k, 0.0) for r in recs])
                    for k in (*CALLS, "copy")}
        extra = _median([sum(r["memory"]["calls"].get(k, 0.0) for k in CALLS)
                         - sum(r["vllm"]["calls"].get(k, 0.0) for k in CALLS) for r in recs])
        summary[n] = {"vllm_hit_s": s["vllm"], "memory_hit_s": s["memory"],
                      "ratio": s["memory"] / s["vllm"], "calls_s": total,
                      "memory_calls_s": per_call, "extra_calls_s": extra,
                      "extra_over_vllm_hit": extra / s["vllm"],
                      "hit_s_spread": {t: [min(r[t]["s"] for r in recs),
                                           max(r[t]["s"] for r in recs)]
                                       for t in ("vllm", "memory")}}
        print(f"{n:>6} {s['vllm'] * 1e3:>7.2f}ms {s['memory'] * 1e3:>8.2f}ms "
              f"{s['memory'] / s['vllm']:>6.3f} {total['vllm'] * 1e3:>9.3f}ms "
              f"{total['memory'] * 1e3:>11.3f}ms {extra * 1e3:>5.3f}ms {extra / s['vllm']:>9.3f}")
    print("a memory hit's calls (ms, medians):")
    for n in lengths:
        print(f"  {n}: " + ", ".join(f"{k} {v * 1e3:.3f}"
                                    for k, v in summary[n]["memory_calls_s"].items()))
    if args.detail:
        for n in lengths:
            recs = runs[n][args.warmup:]
            names = sorted({k for r in recs for t in ("vllm", "memory") for k in r[t]["calls"]})
            summary[n]["detail_us"] = {
                k: {t: _median([r[t]["calls"].get(k, 0.0) for r in recs]) * 1e6
                    for t in ("vllm", "memory")} for k in names}
            print(f"{n} tokens, every call timed (us, medians; vLLM's own hit, memory hit):")
            for k, v in summary[n]["detail_us"].items():
                print(f"  {k:<42} {v['vllm']:>8.1f} {v['memory']:>8.1f}")
    if "profile" in got:
        print("profiled (every length's memory hits pooled, per hit; cProfile's overhead in):")
        print(f"  {'own us':>8} {'cum us':>8} {'calls':>6}  function")
        for r in got["profile"]:
            print(f"  {r['own_us_per_hit']:>8.1f} {r['cumulative_us_per_hit']:>8.1f} "
                  f"{r['calls_per_hit']:>6.1f}  {r['function']}")
    path = write_results(args.out, "hit_hooks", {
        "model": model, "lengths": lengths, "prompts": args.prompts, "warmup": args.warmup,
        "summary": summary, "runs": runs, "profile": got.get("profile")})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
