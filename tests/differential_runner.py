"""Runs one workload through several real vLLM engines (CPU build), one after another in
this process, and returns every engine's greedy tokens; used by the differential tests.

Usage: python tests/differential_runner.py SPEC.json OUT.json. The spec names the model,
a list of ``engines`` (``engine_runner.engine_kwargs`` specs without steps) and, per engine,
the ``batches`` it runs: lists of requests ``{"prompt", "max_tokens", "abort_after"}``
added together and stepped until done (``abort_after``: aborted after that many steps).
One process for all engines: importing vLLM costs more than starting an engine in it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.engine_runner import (  # noqa: E402
    _flush_tiers,
    _run_to_completion,
    _scheduler_outstanding,
    _worker_outstanding,
    _worker_totals,
    engine_kwargs,
)


def run_batch(engine, batch: list[dict], tag: str, deadline: float) -> list[dict]:
    """The batch's requests together; the finished ones' tokens and cached tokens."""
    from vllm import SamplingParams

    ids = [f"{tag}-{i}" for i in range(len(batch))]
    for rid, r in zip(ids, batch, strict=True):
        sp = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
        engine.add_request(rid, {"prompt_token_ids": r["prompt"]}, sp)
    aborts: dict[int, list[str]] = {}
    for rid, r in zip(ids, batch, strict=True):
        if r.get("abort_after") is not None:
            aborts.setdefault(r["abort_after"], []).append(rid)
    done = _run_to_completion(engine, deadline, aborts)
    return [None if batch[i].get("abort_after") is not None else done.get(rid)
            for i, rid in enumerate(ids)]


def _drain(llm) -> dict:
    """Let finished requests' saves run (a server keeps stepping while they hold blocks),
    then what the connector still holds: all zero once every request has finished."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for _ in range(10_000):
        if not scheduler.has_requests():
            break
        llm.llm_engine.step()
    if scheduler.connector is None:
        return {}
    llm.collective_rpc(_worker_outstanding, args=(True,))  # the copies queue the puts
    llm.collective_rpc(_flush_tiers)
    return {"scheduler": _scheduler_outstanding(llm),
            "workers": llm.collective_rpc(_worker_outstanding, args=(True,))}


def _totals(llm) -> dict:
    """The workers' counters, and the scheduler's Redis lookups' as ``lookup_*``."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if connector is None:
        return {}
    per_rank = llm.collective_rpc(_worker_totals)
    out = {k: sum(r[k] for r in per_rank) for k in per_rank[0]}
    redis = connector.scheduler.redis
    if redis is not None:
        out.update({f"lookup_{k}": v for k, v in redis.snapshot().items()
                    if isinstance(v, int)})
    return out


_DAMAGED: set[str | bytes] = set()  # files and Redis keys


def _damage_files(disk_path: str, share: float, seed: int) -> None:
    """One byte of the KV payload flipped in about ``share`` of the chunk files (each at
    most once: a file flipped twice at one place would be whole again)."""
    import random
    from pathlib import Path

    from kvconnector.store.disk_files import HEAD_BYTES

    rng = random.Random(seed)
    for path in sorted(Path(disk_path).rglob("*.kvc")):
        if str(path) in _DAMAGED:
            continue
        if rng.random() < share and path.stat().st_size > HEAD_BYTES:
            _DAMAGED.add(str(path))
            with open(path, "r+b") as f:
                f.seek(rng.randrange(HEAD_BYTES, path.stat().st_size))
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x10]))


def _damage_values(url: str, prefix: str, share: float, seed: int) -> None:
    """One byte past the header flipped in about ``share`` of the chunk values under
    ``prefix`` (each at most once)."""
    import random

    import redis

    rng = random.Random(seed)
    client = redis.Redis.from_url(url)
    for key in sorted(client.scan_iter(match=f"{prefix}:*", count=1000)):
        if b":fp:" in key or key in _DAMAGED or rng.random() >= share:
            continue
        size = client.strlen(key)
        if size < 4096:
            continue
        _DAMAGED.add(key)
        at = rng.randrange(size // 2, size)
        byte = client.getrange(key, at, at)
        if byte:
            client.setrange(key, at, bytes([byte[0] ^ 0x10]))


def _close(llm) -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    del llm
    ensure_kv_transfer_shutdown()
    gc.collect()


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    _DAMAGED.clear()  # a hosted run shares the module with the runs before it
    from vllm import LLM

    results = []
    deadline = time.monotonic() + spec.get("timeout_s", 600)
    for n, eng in enumerate(spec["engines"]):
        llm = LLM(**engine_kwargs({"model": spec["model"], **eng}))
        outs = []
        for b, batch in enumerate(eng["batches"]):
            if eng.get("damage_disk_files"):  # what earlier engines and batches wrote
                _damage_files(eng["connector"]["disk_path"], eng["damage_disk_files"],
                              n * 1000 + b)
            if eng.get("damage_redis_values"):
                c = eng["connector"]
                _damage_values(c["redis_url"], c["redis_key_prefix"],
                               eng["damage_redis_values"], n * 1000 + b)
            outs.append(run_batch(llm.llm_engine, batch, f"e{n}b{b}", deadline))
        results.append({"outputs": outs, "outstanding": _drain(llm), "totals": _totals(llm)})
        _close(llm)
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
