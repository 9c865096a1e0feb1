"""Seeded random workloads for differential tests: prompts that share prefixes in random
ways, asked in random batches with aborts, through engines with small memory tiers, a
disk tier (of a few chunk files, in one directory per seed) and Redis behind them or not,
compared token for token with vLLM alone; some engines start with damaged chunk files,
and some cap each request's prefill per step.

``tests/test_differential.py`` runs a few seeds in CI; ``scripts/differential.py`` runs as
many as time allows. A failure names its seed: ``workload(seed)`` rebuilds it exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import run_engine

CHUNK_BYTES = 256 << 10  # one 256-token chunk of the tiny test model (fp32)
CHUNK_FILE = CHUNK_BYTES + 4096  # its file in the disk tier
MAX_MODEL_LEN = 4096
MAX_TOKENS = 24


@dataclass
class Workload:
    seed: int
    prompts: list[list[int]]
    max_model_len: int = MAX_MODEL_LEN
    # Per engine: its spec (connector, KV budget, vLLM's prefix cache) and its batches of
    # (prompt index, max_tokens, abort after that many steps or None).
    engines: list[dict] = field(default_factory=list)
    batches: list[list[list[tuple[int, int, int | None]]]] = field(default_factory=list)


def _cut(rng: random.Random, n: int) -> int:
    """Where a later prompt leaves an earlier one: on a chunk, on a block, or anywhere."""
    kind = rng.random()
    if kind < 0.5 and n >= 256:
        return 256 * rng.randint(1, n // 256)
    if kind < 0.75 and n >= 128:
        return 128 * rng.randint(1, n // 128)
    return rng.randint(1, n)


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    def fresh(k: int) -> list[int]:
        return [rng.randrange(4, 400) for _ in range(k)]

    limit = MAX_MODEL_LEN - MAX_TOKENS - 1
    out: list[list[int]] = []
    for _ in range(n):
        r = rng.random()
        if out and r < 0.6:  # shares a prefix with an earlier prompt, then goes its own way
            parent = rng.choice(out)
            p = parent[:_cut(rng, len(parent))] + fresh(rng.randint(1, 1500))
        else:
            p = fresh(rng.randint(200, 3000))
        out.append(p[:limit])
    return out


def _engine(rng: random.Random, redis_url: str | None, prefix: str) -> dict:
    """A connector engine: a memory tier of 1-6 chunks; Redis behind it or not."""
    extra: dict = {"memory_capacity": CHUNK_BYTES * rng.randint(1, 6)}
    if redis_url is not None:
        extra.update(redis_url=redis_url, redis_key_prefix=prefix)
    return {"connector": extra, "prefix_caching": rng.random() < 0.5,
            # A small KV cache preempts requests of concurrent batches.
            "kv_cache_bytes": rng.choice([64 << 20, 6 << 20]), "max_model_len": MAX_MODEL_LEN}


def _batches(rng: random.Random, n_prompts: int, n_requests: int,
             ) -> list[list[tuple[int, int, int | None]]]:
    batches: list[list[tuple[int, int, int | None]]] = []
    left = n_requests
    while left:
        size = min(left, rng.choice([1, 1, 2, 3, 4]))
        batch = []
        for _ in range(size):
            abort = rng.randint(1, 6) if rng.random() < 0.1 else None
            batch.append((rng.randrange(n_prompts), rng.randint(1, MAX_TOKENS), abort))
        batches.append(batch)
        left -= size
    return batches


def _disk(rng: random.Random, disk_dir: Path | None, extra: dict) -> None:
    """About half the engines get a disk tier of 1-12 chunk files in ``disk_dir`` (one
    per seed: what one engine writes, the next may read). Its own generator, so that a
    seed's prompts and batches are those it had before the disk tier existed."""
    if disk_dir is not None and rng.random() < 0.5:
        extra.update(disk_path=str(disk_dir), disk_capacity=CHUNK_FILE * rng.randint(1, 12))


def workload(seed: int, redis_url: str | None, n_prompts: int = 8, n_requests: int = 14,
             n_engines: int = 3, disk_dir: Path | None = None) -> Workload:
    """Engines of seed ``seed``: each runs its own random sequence over the same prompts.
    With ``redis_url``, about two in three share one Redis key prefix per seed (what one
    engine stores, the next may load), and about half of those answer lookups from the key
    mirror; the others have no Redis. With ``disk_dir``, about half have a disk tier
    there."""
    rng = random.Random(seed)
    disk_rng = random.Random(f"disk{seed}")
    mirror_rng = random.Random(f"key-mirror{seed}")  # half the Redis engines: the key mirror
    fault_rng = random.Random(f"faults{seed}")
    w = Workload(seed, _prompts(rng, n_prompts))
    for _ in range(n_engines):
        url = redis_url if redis_url is not None and rng.random() < 0.67 else None
        w.engines.append(_engine(rng, url, f"diff{seed}"))
        _disk(disk_rng, disk_dir, w.engines[-1]["connector"])
        if url is not None and mirror_rng.random() < 0.5:
            w.engines[-1]["connector"]["redis_key_mirror"] = True
        _faults(fault_rng, w.engines[-1])
        w.batches.append(_batches(rng, n_prompts, n_requests))
    return w


def _faults(rng: random.Random, engine: dict) -> None:
    """About a third of the engines with a disk tier find a byte damaged in about a quarter
    of its chunk files before each batch (loads of them fail and are recomputed), as do
    about a third of those with Redis in a quarter of its values, and a
    third of all engines cap each request's prefill at 64 tokens a step
    (``long_prefill_token_threshold``): a failed load's blocks are then recomputed over
    several steps while other requests run."""
    if "disk_path" in engine["connector"] and rng.random() < 0.33:
        engine["damage_disk_files"] = 0.25
    if "redis_url" in engine["connector"] and rng.random() < 0.33:
        engine["damage_redis_values"] = 0.25
    if rng.random() < 0.33:
        engine["llm"] = {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 64}


BLEND_SEPARATOR = [3, 4]  # ids no generated content uses (tokens are 4..399, never 3)
BLEND_MAX_MODEL_LEN = 2048


def blend_workload(seed: int, redis_url: str | None, n_prompts: int = 8,
                   n_requests: int = 12, n_engines: int = 2,
                   disk_dir: Path | None = None) -> Workload:
    """Prompts of a system prompt and 2-4 of 6 documents, in random orders and overlaps,
    then a question, served by blend at ratio 1.0 (every token recomputed: vLLM alone's
    tokens) through memory tiers of 1-8 pieces, Redis behind them or not.

    About a quarter of the engines blend at ratio 0 instead: their answers are approximate
    and not compared, but what they store is read by the engines after them, and a fifth
    have blend off: every answer of theirs must be vLLM alone's, whatever blended engines
    stored before. About a third run with a small KV cache (preemptions, allocations that
    fail), and a third with chunked prefill off (a request matched but left for a later
    step)."""
    rng = random.Random(seed)
    disk_rng = random.Random(f"disk{seed}")
    # Generators of their own: a seed's prompts and batches are those it had before.
    kind_rng, pressure_rng = random.Random(f"kind{seed}"), random.Random(f"pressure{seed}")

    def fresh(k: int) -> list[int]:
        return [rng.randrange(5, 400) for _ in range(k)]

    systems = [[1] + fresh(rng.randint(10, 80)) for _ in range(2)]
    docs = [fresh(rng.randint(60, 400)) for _ in range(6)]
    prompts = []
    for _ in range(n_prompts):
        parts = [rng.choice(systems), *rng.sample(docs, rng.randint(2, 4)),
                 fresh(rng.randint(5, 60))]
        joined: list[int] = []
        for i, part in enumerate(parts):
            joined += (BLEND_SEPARATOR if i else []) + part
        prompts.append(joined[:BLEND_MAX_MODEL_LEN - MAX_TOKENS - 1])
    w = Workload(seed, prompts, BLEND_MAX_MODEL_LEN)
    for _ in range(n_engines):
        extra: dict = {"memory_capacity": CHUNK_BYTES * rng.randint(1, 8), "blend": True,
                       "blend_separator_ids": BLEND_SEPARATOR, "blend_recompute_ratio": 1.0,
                       "blend_max_cost": 1.0, "blend_min_tokens": rng.choice([1, 128])}
        if redis_url is not None and rng.random() < 0.67:
            extra.update(redis_url=redis_url, redis_key_prefix=f"blend{seed}")
        _disk(disk_rng, disk_dir, extra)
        engine = {"connector": extra, "prefix_caching": rng.random() < 0.5,
                  "kv_cache_bytes": 64 << 20, "max_model_len": BLEND_MAX_MODEL_LEN}
        kind = kind_rng.random()
        if kind < 0.25:
            extra["blend_recompute_ratio"] = 0.0
            engine["approximate"] = True
        elif kind < 0.45:
            for key in [k for k in extra if k.startswith("blend")]:
                del extra[key]
        if pressure_rng.random() < 0.33:
            engine["kv_cache_bytes"] = 6 << 20
        if pressure_rng.random() < 0.33:
            engine["llm"] = {"enable_chunked_prefill": False,
                             "max_num_batched_tokens": BLEND_MAX_MODEL_LEN}
        w.engines.append(engine)
        w.batches.append(_batches(rng, n_prompts, n_requests))
    return w


def run(model: str, tmp: Path, w: Workload, timeout: int = 900) -> list[str]:
    """Run the workload's engines and vLLM alone in one process; the differences, as
    readable lines (empty: every finished request got vLLM alone's tokens)."""
    longest = {i: max((mt for bs in w.batches for b in bs for j, mt, _ in b if j == i),
                      default=1) for i in range(len(w.prompts))}
    baseline = {"connector": None, "max_model_len": w.max_model_len,
                "batches": [[{"prompt": w.prompts[i], "max_tokens": mt}]
                            for i, mt in sorted(longest.items())]}
    engines = [baseline] + [
        {**e, "batches": [[{"prompt": w.prompts[i], "max_tokens": mt, "abort_after": a}
                           for i, mt, a in b] for b in bs]}
        for e, bs in zip(w.engines, w.batches, strict=True)]
    res = run_engine(tmp, {"model": model, "engines": engines, "timeout_s": timeout - 30},
                     runner="differential_runner.py", timeout=timeout)
    expected = {i: out[0]["tokens"] for (i, _), out in
                zip(sorted(longest.items()), res[0]["outputs"], strict=True)}
    problems = []
    for n, (e, bs, r) in enumerate(zip(w.engines, w.batches, res[1:], strict=True)):
        for b, (batch, outs) in enumerate(zip(bs, r["outputs"], strict=True)):
            for (i, mt, abort), out in zip(batch, outs, strict=True):
                if abort is None and out is None:
                    problems.append(f"seed {w.seed} engine {n} batch {b}: prompt {i} never "
                                    f"finished")
                elif (out is not None and not e.get("approximate")
                      and out["tokens"] != expected[i][:mt]):
                    damaged = "".join(f", {what} damaged" for what in ("disk_files", "redis_values")
                                      if e.get(f"damage_{what}"))
                    problems.append(
                        f"seed {w.seed} engine {n} ({e['connector']}, prefix_caching="
                        f"{e['prefix_caching']}, KV {e['kv_cache_bytes'] >> 20} MiB, "
                        f"{e.get('llm', {})}{damaged}) batch {b}: prompt {i} ({len(w.prompts[i])} "
                        f"tokens, {out['cached']} cached) gave {out['tokens']}, vLLM alone "
                        f"{expected[i][:mt]}")
        held = {k: v for k, v in r["outstanding"].get("scheduler", {}).items() if v}
        held.update({k: v for wk in r["outstanding"].get("workers", []) for k, v in wk.items()
                     if v})
        if held:
            problems.append(f"seed {w.seed} engine {n}: state left after the run: {held}")
    return problems


def total(res_dir: Path, counter: str) -> float:
    """A connector counter summed over the engines of the last run."""
    import json

    res = json.loads((res_dir / "out.json").read_text())
    return sum(r["totals"].get(counter, 0) for r in res[1:])


def cached_tokens(res_dir: Path) -> int:
    """Tokens the connector engines of the last run got from a cache (vLLM's or ours)."""
    import json

    res = json.loads((res_dir / "out.json").read_text())
    return sum(o["cached"] for r in res[1:] for outs in r["outputs"] for o in outs if o)
