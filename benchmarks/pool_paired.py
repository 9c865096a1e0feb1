"""Paired runs pooled: the median ratio over every engine of several result files.

    python benchmarks/pool_paired.py docs/results/hit_paired_tiny_floor_*.json
    python benchmarks/pool_paired.py docs/results/miss_paired_tiny_disk_gate*.json
    python benchmarks/pool_paired.py docs/results/load_paired_tiny_36*.json

One ``bench_hit_paired.py`` run of a few engines cannot tell 1.03x from 1.07x on this
machine: its 90% interval is often 15 points wide. Each hit's ratio is over vLLM's own hit
of the same prompt in the same engine, so engines of runs on different days can be pooled;
the interval resamples engines, then hits within each (``common.median_interval``).

``bench_miss_paired.py`` runs pool the same way. A miss is not paired with one request that
opts out, so each miss's ratio is over the median of its engine's requests that opted out
at that length; the interval then leaves out how much that median itself varies, and is
somewhat narrower than it should be.

``bench_load_paired.py`` runs pool as misses do, with throughput turned over: each round that
used kvconnector gives its engine's median rate of the rounds that opted out over its own
rate (above 1: the connector is slower), listed at its prompt length. Its interval is
somewhat too narrow for the same reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import median_interval


def engine_groups(result: dict, tier: str, length: str) -> list[list[float]]:
    """The run's ratios of ``tier`` at ``length``, one list per engine (in run order)."""
    ratios = result["ratios"].get(tier, {}).get(length, [])
    engines = len(result["ratio_per_engine"].get(tier, {}).get(length, []))
    if not ratios or not engines:
        return []
    per = len(ratios) // engines
    return [ratios[i:i + per] for i in range(0, per * engines, per)]


def miss_groups(result: dict, tier: str, length: str) -> list[list[float]]:
    """Each engine's misses of ``tier`` at ``length``, over the engine's median request that
    opted out."""
    groups = []
    for engine in result["ttft_s"].get(tier, []):
        times = engine.get(length)
        if times and times["kvconnector"] and times["opted out"]:
            base = statistics.median(times["opted out"])
            groups.append([t / base for t in times["kvconnector"]])
    return groups


def load_groups(result: dict, tier: str) -> list[list[float]]:
    """Each engine's rounds of ``tier`` that used kvconnector: the engine's median rate of
    the rounds that opted out over the round's rate."""
    groups = []
    for engine in result["runs"].get(tier, []):
        rates = engine["rates"]
        if rates["kvconnector"] and rates["opted out"]:
            base = statistics.median(rates["opted out"])
            groups.append([base / r for r in rates["kvconnector"]])
    return groups


def pooled_groups(path: Path) -> dict[tuple[str, int], list[list[float]]]:
    result = json.loads(path.read_text())
    kind = result.get("benchmark")
    if kind == "hit_paired":
        return {(tier, int(length)): engine_groups(result, tier, length)
                for tier, by_length in result["ratios"].items() for length in by_length}
    if kind == "miss_paired":
        return {(tier, int(length)): miss_groups(result, tier, length)
                for tier, engines in result["ttft_s"].items()
                for length in (engines[0] if engines else {}) if length.isdigit()}
    if kind == "load_paired":
        return {(f"{tier} (load)", int(result["prompt_tokens"])): load_groups(result, tier)
                for tier in result["runs"]}
    raise SystemExit(f"{path}: not a bench_hit_paired.py, bench_miss_paired.py or "
                     "bench_load_paired.py result")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path,
                   help="bench_hit_paired.py, bench_miss_paired.py or bench_load_paired.py "
                        "JSON files")
    args = p.parse_args()
    pooled: dict[tuple[str, int], list[list[float]]] = {}
    for path in args.results:
        for where, groups in pooled_groups(path).items():
            pooled.setdefault(where, []).extend(groups)
    print(f"{'tier':>26} {'tokens':>7} {'engines':>8} {'values':>6} {'median':>7} "
          f"{'90% interval':>13}")
    for (tier, length), groups in sorted(pooled.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        values = [x for g in groups for x in g]
        lo, hi = median_interval(groups)
        print(f"{tier:>26} {length:>7} {len(groups):>8} {len(values):>6} "
              f"{statistics.median(values):>6.3f}x {lo:>6.3f}-{hi:.3f}")


if __name__ == "__main__":
    main()
