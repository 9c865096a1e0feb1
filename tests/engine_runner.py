"""Runs a real vLLM engine (CPU build) through a list of steps; used by the engine tests.

Usage: python tests/engine_runner.py SPEC.json OUT.json. Each engine lives in its own
process, as vLLM expects (spawn, global connector state).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def connector_config(extra: dict, short_name: bool = False,
                     policy: str | None = "recompute") -> dict:
    """``policy``: vLLM's kv_load_failure_policy; None leaves vLLM's default."""
    cfg = {"kv_connector": "KVConnector", "kv_connector_module_path": "kvconnector.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if policy is not None:
        cfg["kv_load_failure_policy"] = policy
    if short_name:
        cfg = {**cfg, "kv_connector": "kvconnector"}
        del cfg["kv_connector_module_path"]
    return cfg


def _worker_totals(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(get_kv_transfer_group().worker.totals.data)


def _every_load_to_the_helper(worker) -> list[int]:
    """Sends every load, however small, half to the load helper (``kernels/batched.py``),
    and fills vLLM's KV cache with noise, so that a half left uncopied shows in the answer
    (else a freed block may still hold the same KV); the helper's cores, empty where the
    worker has none to spare."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvconnector.kernels import batched

    batched.HELPER_MIN_BYTES = 0
    half = get_kv_transfer_group().worker
    _noise_kv(worker)
    return sorted(half._spare_cores) if half.blocks.copier._helper is not None else []


def _corrupt(worker, prompt: list[int], chunk: int, reseal: bool) -> bool:
    """Overwrite one stored chunk's slot with noise. Memory slots are not re-checked on
    loads (docs/architecture.md, "Integrity"), so the noise is loaded: the control showing
    that loaded KV is really used. ``reseal``: seal the slot again under its key."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvconnector.keys import ChunkKey, chunk_hashes, request_seed

    half = get_kv_transfer_group().worker
    seed = request_seed(half.fingerprint, None)
    h = chunk_hashes(prompt, half.config.chunk_size, seed)[chunk]
    key = ChunkKey(half.fingerprint, half.tp_rank, h)
    slot = half.pool.slot_holding(key)
    if slot is None:
        return False
    data = half.pool.slot(slot)
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(data.shape, generator=gen).to(data.dtype) * 4
    data.copy_(noise)
    if reseal:
        half.pool.end_write(slot, key)
    return True


def _foreign(worker, prompt: list[int], chunk: int) -> bool:
    """Seal the slot holding one stored chunk as holding another chunk, as a save of
    another chunk into that slot would: loads of the first chunk must refuse it."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvconnector.keys import ChunkKey, chunk_hashes, request_seed

    half = get_kv_transfer_group().worker
    seed = request_seed(half.fingerprint, None)
    h = chunk_hashes(prompt, half.config.chunk_size, seed)[chunk]
    slot = half.pool.slot_holding(ChunkKey(half.fingerprint, half.tp_rank, h))
    if slot is None:
        return False
    half.pool.end_write(slot, ChunkKey(half.fingerprint, half.tp_rank, bytes(16)))
    return True


def _worker_outstanding(worker, drain: bool) -> dict:
    """What the worker half still holds; ``drain``: once the copies queued so far ran (the
    last step may have queued the saves of a request that finished in the step before)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    half = get_kv_transfer_group().worker
    if drain:
        half.copies.drain()
    return half.outstanding()


def _stress(llm, step: dict) -> dict:
    """Many concurrent requests in a small KV cache (preemptions), some aborted mid-run."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=step["max_tokens"], ignore_eos=True)
    ids = [f"stress-{i}" for i in range(len(step["prompts"]))]
    for rid, p in zip(ids, step["prompts"], strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    aborted = ids[::3]
    tokens: dict[str, list[int]] = {}
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        n += 1
        if n == step["abort_after_steps"]:
            engine.abort_request(aborted)
    scheduler = engine.engine_core.engine_core.scheduler
    # A server's engine loop keeps stepping while finished requests still hold blocks for
    # their saves; the offline loop above stops as soon as the last output is out.
    drain_steps = 0
    while scheduler.has_requests() and drain_steps < 10_000:
        engine.step()
        drain_steps += 1
    return {"steps": n, "drain_steps": drain_steps, "aborted": aborted, "tokens": tokens,
            "resumed": scheduler.connector.scheduler.resumed_requests}


def _race(llm, step: dict) -> dict:
    """Request ``slow`` (which needs a frozen Redis) and ``fast`` (which needs nothing from
    it) together; once ``fast`` is done, thaw Redis and finish ``slow``."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("slow", {"prompt_token_ids": step["slow"]}, sp)
    engine.add_request("fast", {"prompt_token_ids": step["fast"]}, sp)
    out: dict = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = {"tokens": list(o.outputs[0].token_ids),
                                     "cached": o.num_cached_tokens}
        if "fast" in out and "slow_done_first" not in out:
            out["slow_done_first"] = "slow" in out
            _SERVERS[step["port"]].thaw()
    return out


def _arrivals(llm, step: dict) -> dict:
    """Request ``first`` (with ``with_first`` beside it, if given) for one engine step; then
    abort ``first`` if ``abort``; then request ``later``; run everything to the end. The
    answers by name, and ``first``'s too unless aborted."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8), ignore_eos=True)
    out: dict = {}

    def run_step() -> None:
        for o in engine.step():
            if o.finished:
                out[o.request_id] = {"tokens": list(o.outputs[0].token_ids),
                                     "cached": o.num_cached_tokens}

    engine.add_request("first", {"prompt_token_ids": step["first"]}, sp)
    if "with_first" in step:
        engine.add_request("with_first", {"prompt_token_ids": step["with_first"]}, sp)
    run_step()
    if step.get("abort"):
        engine.abort_request(["first"])
    if "later" in step:
        engine.add_request("later", {"prompt_token_ids": step["later"]}, sp)
    for _ in range(10_000):  # a request that never finishes fails the run, not CI's clock
        if not engine.has_unfinished_requests():
            return out
        run_step()
    raise RuntimeError(f"requests still unfinished after 10000 steps: {sorted(out)} done")


def _noise_kv(worker) -> bool:
    """vLLM's KV cache filled with noise: a block read before anything wrote it shows."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    for layer in get_kv_transfer_group().worker.layers:
        layer.normal_()
    return True


_GATE = threading.Event()


def _copy_gate(worker, close: bool, after_s: float = 0.0) -> bool:
    """Closed: a job that blocks the worker's copy thread, so every later save or async load
    stays queued until the gate opens (``after_s`` seconds from now)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if close:
        _GATE.clear()
        get_kv_transfer_group().worker.copies.submit(_GATE.wait, [], [])
    elif after_s:
        threading.Timer(after_s, _GATE.set).start()
    else:
        _GATE.set()
    return True


def _fence_wait(worker) -> dict:
    """With a finished request's saves stuck behind the closed copy gate, tell the worker the
    request's blocks are handed out again: ``handle_preemptions`` must not return before
    those saves ran."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvconnector.metadata import StepPlan

    half = get_kv_transfer_group().worker
    pending = list(half.copies._by_request)
    plan = StepPlan(fence=set(pending))
    waiter = threading.Thread(target=half.handle_preemptions, args=(plan,))
    waiter.start()
    waiter.join(0.5)
    returned_while_queued = not waiter.is_alive()
    _GATE.set()
    waiter.join(30)
    return {"pending_requests": len(pending), "returned_while_queued": returned_while_queued,
            "returned": not waiter.is_alive()}


def _break_fetch(worker) -> bool:
    """Make every later Redis fetch raise, as an unexpected bug in the store would."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    def fetch(wanted):
        raise RuntimeError("injected: a fetch that raises")

    get_kv_transfer_group().worker.redis_tier.fetch = fetch
    return True


def _scale_weight(worker, name: str, factor: float) -> bool:
    """Change the engine's weights in place, as an RL weight sync does."""
    import torch

    params = dict(worker.model_runner.model.named_parameters())
    with torch.no_grad():
        params[name].mul_(factor)
    return True


def _scheduler_outstanding(llm) -> dict:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler.outstanding()


def _flush_tiers(worker) -> bool:
    """Wait for the copies queued to the disk and Redis; whether Redis is configured."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    half = get_kv_transfer_group().worker
    half.copies.drain()  # the saves queued so far have sealed their slots
    if half.disk_tier is not None:
        assert half.disk_tier.flush(), "copies to the disk tier still running"
    if half.redis_tier is not None:
        assert half.redis_tier.flush(), "copies to Redis still running"
    return half.redis_tier is not None


def _disk_stats(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker.disk_tier.snapshot()


def _disk_paths(llm, step: dict) -> list[list[str]]:
    """The file of every full chunk of each prompt (TP rank 0), for tests that damage
    them."""
    from kvconnector.keys import ChunkKey, chunk_hashes, request_seed
    from kvconnector.store.disk_files import chunk_path

    half = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
    seed = request_seed(half.fingerprint, None)
    return [[str(chunk_path(Path(half.config.disk_path), ChunkKey(half.fingerprint, 0, h)))
             for h in chunk_hashes(p, half.config.chunk_size, seed)]
            for p in step["prompts"]]


_FSIZE = None


def _file_size_limit(limit: int | None) -> bool:
    """Limit the size of files this process writes (the kernel refuses larger ones with
    EFBIG, as a full disk refuses them); None lifts it. Also lifted when the run ends."""
    import resource

    global _FSIZE
    if _FSIZE is None:
        _FSIZE = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, _FSIZE[1]) if limit else _FSIZE)
    return True


def _redis_stats(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker.redis_tier.redis.snapshot()


def _redis_keys(llm, step: dict) -> list[list[str]]:
    """The Redis key of every full chunk of each prompt (TP rank ``step["rank"]``, default
    0), for tests that tamper with stored values."""
    from kvconnector.keys import ChunkKey, chunk_hashes, request_seed

    half = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
    seed = request_seed(half.fingerprint, None)
    prefix = half.config.redis_key_prefix
    return [[f"{prefix}:{ChunkKey(half.fingerprint, step.get('rank', 0), h)}"
             for h in chunk_hashes(p, half.config.chunk_size, seed)]
            for p in step["prompts"]]


def _run_to_completion(engine, deadline: float,
                       aborts: dict[int, list[str]] | None = None) -> dict:
    """Step until every request finished: tokens and cached tokens per request id.
    ``aborts``: step count -> request ids aborted after that many steps."""
    out: dict = {}
    steps = 0
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests still unfinished: {sorted(out)} done")
        for o in engine.step():
            if o.finished:
                out[o.request_id] = {"tokens": list(o.outputs[0].token_ids),
                                     "cached": o.num_cached_tokens or 0}
        steps += 1
        if aborts and steps in aborts:
            engine.abort_request([r for r in aborts[steps] if r not in out])
    return out


def _fault_while_parked(llm, step: dict) -> dict:
    """Requests whose hit is in Redis wait (copy thread held by the gate) until all of them
    are parked in WAITING_FOR_REMOTE_KVS, i.e. the lookup said the chunks are there; then
    Redis is killed (``kill``) or time passes (``sleep``, keys expiring), the gate opens and
    every request must finish within ``timeout_s``."""
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    deadline = time.monotonic() + step.get("timeout_s", 60)
    llm.collective_rpc(_copy_gate, args=(True,))
    ids = [f"parked-{i}" for i in range(len(step["prompts"]))]
    for rid, p in zip(ids, step["prompts"], strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)

    def statuses() -> list[RequestStatus | None]:
        # vLLM appends a random suffix to each request id inside the engine.
        by_id = {r.request_id.rsplit("-", 1)[0]: r.status for r in scheduler.requests.values()}
        return [by_id.get(r) for r in ids]

    # Step until the scheduler has every request and every lookup has answered.
    while time.monotonic() < deadline and any(
            s in (None, RequestStatus.WAITING) for s in statuses()):
        engine.step()
    n_parked = statuses().count(RequestStatus.WAITING_FOR_REMOTE_KVS)
    if step["fault"] == "kill":
        os.kill(step["pid"], signal.SIGKILL)
    else:
        time.sleep(step["seconds"])
    llm.collective_rpc(_copy_gate, args=(False,))
    out = _run_to_completion(engine, time.monotonic() + step.get("timeout_s", 60))
    return {"parked": n_parked, "tokens": [out[r]["tokens"] for r in ids]}


def _shutdown_connector(worker) -> dict:
    """The worker half's shutdown, timed, with whatever is still queued for Redis."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    half = get_kv_transfer_group().worker
    queued = half.redis_tier.queued
    start = time.monotonic()
    half.shutdown()
    return {"queued": queued, "seconds": time.monotonic() - start,
            "dropped": half.redis_tier.dropped_puts}


def main(spec_path: str, out_path: str) -> None:
    try:
        _main(spec_path, out_path)
    finally:
        _GATE.set()  # a copy thread left waiting on the gate would block the exit
        if _FSIZE is not None:
            _file_size_limit(None)
        for server in _SERVERS.values():
            server.stop()


_SERVERS: dict = {}


def _redis_server(port: int, action: str) -> bool:
    """Start, kill or restart a redis-server this process owns (fault tests)."""
    from tests.redis_server import RedisServer

    server = _SERVERS.setdefault(port, RedisServer(port=port))
    {"start": server.start, "kill": server.kill, "restart": server.restart,
     "freeze": server.freeze}[action]()
    return True


def engine_kwargs(spec: dict, **overrides) -> dict:
    """vLLM ``LLM`` arguments from a test spec (each runner's own on top)."""
    kw = dict(model=spec["model"], dtype=spec.get("dtype", "float32"),
              kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
              enable_prefix_caching=spec.get("prefix_caching", False),
              max_model_len=spec.get("max_model_len", 4096), enforce_eager=True, seed=0,
              disable_log_stats=not spec.get("log_stats", False))
    kw.update(spec.get("llm", {}))  # any other LLM argument (load_format, quantization)
    if spec.get("tp", 1) > 1:  # one worker process per rank
        kw.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    kw.update(overrides)
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = connector_config(spec["connector"],
                                                    policy=spec.get("policy", "recompute"))
    return kw


def cached_by_source(llm) -> dict:
    """vLLM's own per-tier count of cached prompt tokens (needs the spec's "log_stats")."""
    return {m.labels["source"]: m.value for m in llm.get_metrics()
            if m.name == "vllm:prompt_tokens_cached_by_source" and m.value}


def _start_errors(spec: dict) -> list[str | None]:
    """Each of ``spec["start_errors"]`` (connector configs) given to an engine start in
    turn: the error each start raised, with its causes, or None where it started. Meant for
    a process of its own (``run_engine(..., fresh=True)``): a failed start may leave state
    behind."""
    import traceback

    from vllm import LLM
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    errors: list[str | None] = []
    for connector in spec["start_errors"]:
        try:
            llm = LLM(**engine_kwargs({**spec, "connector": connector}))
        except Exception as e:
            errors.append("".join(traceback.format_exception(e)))
        else:
            llm.llm_engine.engine_core.shutdown()
            del llm
            errors.append(None)
        # vLLM keeps the worker's connector and the process group in globals, which a
        # failed start leaves set: the next start would reuse them.
        ensure_kv_transfer_shutdown()
        cleanup_dist_env_and_memory()
    return errors


def _main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    os.environ.update(spec.get("env", {}))  # e.g. secrets the connector config names
    if "start_errors" in spec:
        json.dump(_start_errors(spec), open(out_path, "w"))
        return
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(spec))
    results = []
    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            extra = ({"kv_transfer_params": step["kv_transfer_params"]}
                     if "kv_transfer_params" in step else None)
            sp = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8),
                                ignore_eos=True, extra_args=extra)
            outs = []
            for p in step["prompts"]:
                start = time.perf_counter()
                o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
                outs.append({"tokens": list(o.outputs[0].token_ids),
                             "cached": o.num_cached_tokens})
                if step.get("timed"):
                    outs[-1]["seconds"] = time.perf_counter() - start
            results.append(outs)
        elif op == "totals":
            per_rank = llm.collective_rpc(_worker_totals)
            results.append({k: sum(r[k] for r in per_rank) for k in per_rank[0]})
        elif op == "corrupt":
            results.append(llm.collective_rpc(
                _corrupt, args=(step["prompt"], step["chunk"], step.get("reseal", False))))
        elif op == "foreign":
            results.append(llm.collective_rpc(_foreign, args=(step["prompt"], step["chunk"])))
        elif op == "stress":
            results.append(_stress(llm, step))
        elif op == "outstanding":
            results.append({"scheduler": _scheduler_outstanding(llm),
                            "workers": llm.collective_rpc(
                                _worker_outstanding, args=(step.get("drain", False),))})
        elif op == "every_load_to_the_helper":
            results.append(llm.collective_rpc(_every_load_to_the_helper)[0])
        elif op == "flush":
            results.append(llm.collective_rpc(_flush_tiers))
        elif op == "disk_stats":
            results.append(llm.collective_rpc(_disk_stats)[0])
        elif op == "disk_paths":
            results.append(_disk_paths(llm, step))
        elif op == "file_size_limit":
            results.append(_file_size_limit(step["bytes"]))
        elif op == "wait_for_files":
            deadline = time.monotonic() + step.get("timeout_s", 120)
            while (len(list(Path(step["dir"]).rglob("*.kvc"))) < step["count"]
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            results.append(len(list(Path(step["dir"]).rglob("*.kvc"))))
        elif op == "redis_stats":
            results.append(llm.collective_rpc(_redis_stats)[0])
        elif op == "redis_server":
            results.append(_redis_server(step["port"], step["action"]))
        elif op == "arrivals":
            results.append(_arrivals(llm, step))
        elif op == "noise_kv":
            results.append(llm.collective_rpc(_noise_kv))
        elif op == "race":
            results.append(_race(llm, step))
        elif op == "copy_gate":
            results.append(llm.collective_rpc(
                _copy_gate, args=(step["close"], step.get("after_s", 0.0))))
        elif op == "fence_wait":
            results.append(llm.collective_rpc(_fence_wait)[0])
        elif op == "redis_keys":
            results.append(_redis_keys(llm, step))
        elif op == "scheduler_redis_stats":  # the lookups' store (the key mirror's counts)
            results.append(llm.llm_engine.engine_core.engine_core.scheduler.connector
                           .scheduler.redis.snapshot())
        elif op == "redis_flushall":  # a flush sends no keyspace notification per key
            import redis
            results.append(redis.Redis.from_url(step["url"]).flushall())
        elif op == "fault_while_parked":
            results.append(_fault_while_parked(llm, step))
        elif op == "shutdown_connector":
            results.append(llm.collective_rpc(_shutdown_connector)[0])
        elif op == "sleep":
            time.sleep(step["seconds"])
            results.append(True)
        elif op == "break_fetch":
            results.append(llm.collective_rpc(_break_fetch))
        elif op == "scale_weight":
            results.append(llm.collective_rpc(_scale_weight,
                                              args=(step["name"], step["factor"])))
        elif op == "reset_prefix_cache":
            results.append(llm.reset_prefix_cache(
                reset_connector=step.get("reset_connector", False)))
        elif op == "scheduler_attr":
            results.append(getattr(llm.llm_engine.engine_core.engine_core.scheduler,
                                   step["name"]))
        elif op == "cached_by_source":
            results.append(cached_by_source(llm))
        elif op == "sleep_wake":
            llm.sleep(level=step.get("level", 1))
            results.append(llm.wake_up())
        else:
            raise ValueError(f"unknown step {op}")
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    if json.loads(Path(sys.argv[1]).read_text()).get("tp", 1) > 1:
        # At exit vLLM waits its 5 s grace period for TP workers that do not stop when
        # told (with or without a connector), then kills them; the results are written.
        import multiprocessing

        for worker in multiprocessing.active_children():
            worker.kill()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
