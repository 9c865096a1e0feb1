"""Shared pieces of the engine benchmarks: model choice, prompts, engines, output files."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import platform
import random
import signal
import sys
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# This checkout's kvconnector, in this process and in every engine process it starts, even
# where the environment has another checkout installed in editable mode.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# vLLM's CPU backend reserves one more core for any engine with a kv_transfer_config; on a
# small machine that reservation exceeds the cores and is dropped, so the engine with a
# connector would compute on more cores than the one without. Same reservation for both.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


def add_model_args(p) -> None:
    p.add_argument("--model", help="model path or name (default: the tiny random Mistral)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="vLLM's KV budget (default 1 GiB for the tiny model, 4 GiB for "
                        "--model: vLLM's CPU build would otherwise size it from the "
                        "machine's memory and leave none for the connector)")
    p.add_argument("--memory-capacity", default="2GiB", help="kvconnector host memory")
    p.add_argument("--connector-config", type=json.loads, default={}, metavar="JSON",
                   help="more kv_connector_extra_config keys for every kvconnector tier "
                        "(e.g. '{\"inline_save_max_kib\": 0}')")
    p.add_argument("--redis-url", default=None, help="also measure a Redis tier")
    p.add_argument("--redis", action="store_true",
                   help="start a local redis-server (tests/redis_server.py) for the Redis tier")
    p.add_argument("--redis-cpus", default="reserved",
                   help="cores for that redis-server: 'reserved' (default: those vLLM's CPU "
                        "worker leaves to its engine-core process, as a one-machine "
                        "deployment should place it), 'any' (wherever the kernel puts it), "
                        "or a list such as 1,3")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")


def resolve_model(args) -> tuple[str, int]:
    """Model path and a safe token-id range for synthetic prompts."""
    if args.model is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from kvconnector.tiny_model import build_tiny_mistral

        if args.kv_cache_memory_bytes is None:
            args.kv_cache_memory_bytes = 1 << 30
        return str(build_tiny_mistral(ROOT / ".cache" / "tiny-mistral")), 400
    from transformers import AutoConfig

    if args.kv_cache_memory_bytes is None:
        args.kv_cache_memory_bytes = 4 << 30
    return args.model, min(AutoConfig.from_pretrained(args.model).vocab_size, 30000)


@contextmanager
def redis_for(args):
    """Yields ``args`` with ``redis_url`` set when ``--redis`` asked for a local server, and
    ``redis_unix_url``: the same server's unix socket (None for a server given by URL)."""
    args.redis_unix_url = None
    if not args.redis:
        yield args
        return
    with local_redis(args.redis_cpus) as server:
        args.redis_url = server.url
        args.redis_unix_url = server.unix_url
        args.redis_cpus_used = sorted(os.sched_getaffinity(server.proc.pid))
        yield args


@contextmanager
def local_redis(cpus: str, maxmemory: str | None = None):
    """A redis-server of tests/redis_server.py (with a unix socket) on the cores ``cpus``
    names (``redis_cpus``); with ``maxmemory``, one that evicts the least recently used
    keys beyond it, as a Redis run as a cache is."""
    from tests.redis_server import RedisServer

    extra = ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"] if maxmemory else []
    with RedisServer(unixsocket=True, extra_args=extra) as server:
        if chosen := redis_cpus(cpus):
            for task in os.listdir(f"/proc/{server.proc.pid}/task"):  # its threads too
                os.sched_setaffinity(int(task), chosen)
        yield server


def fill_to_maxmemory(url: str, value_bytes: int) -> int:
    """Fill a Redis with ``maxmemory`` set until it evicts: from then on it holds as much
    as it ever will, and a new value takes memory an evicted one freed, as in a Redis cache
    that has run for a while. A Redis that is still growing takes new pages from the
    kernel for every value; on these VMs each new page costs about 10 us of zeroing (a
    growing redis-server spent 1.2 ms a 1024-token tiny-model miss in ``clear_page``,
    docs/benchmarks.md section 22). Filler keys: ``bench-filler:*``. Returns their count."""
    import redis

    client = redis.Redis.from_url(url)
    if not int(client.config_get("maxmemory")["maxmemory"]):
        raise ValueError("fill_to_maxmemory needs a Redis with maxmemory set")
    value, n = os.urandom(value_bytes), 0
    while not client.info("stats")["evicted_keys"]:
        pipe = client.pipeline(transaction=False)
        for _ in range(8):
            pipe.set(f"bench-filler:{n}", value)
            n += 1
        pipe.execute()
    return n


def chunk_bytes(model: str, dtype: str, chunk_tokens: int = 256) -> int:
    """Bytes of one stored chunk of ``model`` (every layer's K and V)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    itemsize = 4 if dtype in ("float32", "float") else 2
    return cfg.num_hidden_layers * 2 * chunk_tokens * kv_heads * head_dim * itemsize


def redis_cpus(spec: str) -> set[int]:
    """The cores ``--redis-cpus`` names; empty for 'any'. 'reserved': the last
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` cores this process may use, which vLLM's CPU worker
    leaves to its engine-core process (one worker per engine, as in these benchmarks). On a
    machine as small as these VMs the compute core is otherwise shared: the kernel put a
    redis-server beside the forward pass while the engine-core process spun on the other."""
    if spec == "any":
        return set()
    if spec == "reserved":
        cores = sorted(os.sched_getaffinity(0))
        n = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"))
        return set(cores[-n:]) if 0 < n < len(cores) else set()
    try:
        return {int(c) for c in spec.split(",")}
    except ValueError:
        raise SystemExit(f"--redis-cpus: expected 'reserved', 'any' or core numbers such "
                         f"as 1,3, got {spec!r}") from None


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


def median_interval(groups: list[list[float]], level: float = 0.9, rounds: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval for the median of ``groups`` (one list per engine): engines are
    resampled, then values within each, since two engines differ more than two values of
    one engine do."""
    groups = [g for g in groups if g]
    if not groups:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    meds = []
    for _ in range(rounds):
        pick = [rng.choice(groups) for _ in groups]
        values = [rng.choice(g) for g in pick for _ in g]
        values.sort()
        mid = len(values) // 2
        meds.append(values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2)
    meds.sort()
    tail = (1 - level) / 2
    return meds[int(tail * (rounds - 1))], meds[int((1 - tail) * (rounds - 1))]


def connector(extra: dict) -> dict:
    return {"kv_connector": "kvconnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def tier_connectors(args, disk_path: str | None,
                    full_redis_url: str | None = None) -> dict[str, dict]:
    """kvconnector's configuration for each tier a miss benchmark compares: memory, then
    memory + Redis (``args.redis_url``; with ``args.key_mirror`` also the same with the
    scheduler's key mirror), memory + a full Redis (with ``args.key_mirror`` also with the
    mirror), memory + disk."""
    extra = {"memory_capacity": args.memory_capacity, **getattr(args, "connector_config", {})}
    tiers = {"memory": connector(extra)}
    if args.redis_url:
        tiers["memory + Redis"] = connector({**extra, "redis_url": args.redis_url})
        if getattr(args, "key_mirror", False):
            tiers["memory + Redis, key mirror"] = connector(
                {**extra, "redis_url": args.redis_url, "redis_key_mirror": True})
    if full_redis_url:
        tiers["memory + full Redis"] = connector({**extra, "redis_url": full_redis_url})
        if getattr(args, "key_mirror", False):
            tiers["memory + full Redis, key mirror"] = connector(
                {**extra, "redis_url": full_redis_url, "redis_key_mirror": True})
    if disk_path is not None:
        tiers["memory + disk"] = connector({**extra, "disk_path": disk_path})
    return tiers


def rotated_order(names: list[str], engines: int) -> list[str]:
    """Each name ``engines`` times, one engine of each in turn, the first one rotating, so
    that no configuration always runs first (or right after another one)."""
    return [t for e in range(engines) for t in names[e % len(names):] + names[:e % len(names)]]


def _exit_on_sigterm() -> None:
    """``kill`` stops a benchmark as Ctrl-C does, through its ``finally`` blocks (the
    Redis servers it started, its engines' processes)."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        with suppress(psutil.Error):
            proc.kill()


def _child(fn, args, kwargs, results) -> None:
    try:
        results.put(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - re-raised in the parent
        results.put(("error", repr(e)))
        raise


def in_fresh_process(fn, *args, **kwargs):
    """Run ``fn`` in a new process and return its result.

    Every engine configuration gets its own process: vLLM's CPU worker sets thread counts
    and core binding per process, and a second engine built in the same process was seen to
    get twice the cores of the first, which made any comparison between them meaningless.
    A benchmark stopped meanwhile (Ctrl-C, ``kill``) takes the child and its engine's
    processes with it: left behind, an engine core and its worker went on computing
    through the next run (docs/benchmarks.md section 42).
    """
    _exit_on_sigterm()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, kwargs, results))
    proc.start()
    try:
        status, value = results.get()
        proc.join()
    except BaseException:
        _kill_tree(proc.pid)
        raise
    if status != "ok":
        raise RuntimeError(f"benchmark child failed: {value}")
    return value


@contextmanager
def engine(model: str, args, kv_transfer_config: dict | None, max_model_len: int, **kw):
    from vllm import LLM

    llm = LLM(model=model, dtype=args.dtype, max_model_len=max_model_len,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              kv_transfer_config=kv_transfer_config, **kw)
    try:
        yield llm
    finally:
        # Shut the engine's processes down here: a caller that still holds the LLM when its
        # process exits (a spawned benchmark child) otherwise waits for them forever.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def timed_generate(llm, prompts: list[list[int]], max_tokens: int):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - start, outs


STAGES = ("submit", "wait", "step", "output")


def ttft_stages(out, start: float, end: float) -> list[float] | None:
    """A request's TTFT split at the engine core's timestamps (``time.monotonic``, one clock
    for every process here): submit (to the engine core's queue), wait (to being scheduled),
    step (to its first token), output (back to the caller); None without vLLM's request
    stats (its stat loggers off)."""
    m = getattr(out, "metrics", None)
    if m is None or not getattr(m, "first_token_ts", 0.0):
        return None
    return [m.queued_ts - start, m.scheduled_ts - m.queued_ts,
            m.first_token_ts - m.scheduled_ts, end - m.first_token_ts]


def connector_seconds() -> dict[str, float]:
    """The connector's own timers so far, from this process's Prometheus registry (where
    vLLM records an offline engine's stats; ``LLM.get_metrics`` rounds counters down to
    whole numbers): seconds per hook on vLLM's threads, and the copy thread's busy time."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == "vllm:kvconnector_phase_seconds_total":
                phase = sample.labels["phase"]
                out[phase] = out.get(phase, 0.0) + sample.value
    return out


def connector_counts() -> dict[str, float]:
    """The connector's counters so far, as ``connector_seconds`` reads its timers: per
    family without ``vllm:kvconnector_`` and ``_total``, a label's value after a dot
    (``redis_errors.timeout``)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            name = sample.name
            if not (name.startswith("vllm:kvconnector_") and name.endswith("_total")):
                continue
            name = name[len("vllm:kvconnector_"):-len("_total")]
            if name == "phase_seconds":
                continue
            own = [v for k, v in sample.labels.items() if k not in ("model_name", "engine")]
            key = ".".join([name, *own])
            out[key] = out.get(key, 0.0) + sample.value
    return out


def machine() -> dict:
    import torch

    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__}
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001 - the record is best effort
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info.update(_cpu_model())
    return info


def _cpu_model() -> dict:
    """The CPU's name and its bf16 support: shared VMs here change hosts; a bf16 model's
    prefill ran 4.4x slower on one without AMX (docs/benchmarks.md section 34), and 11-14x
    slower again on one without AVX-512 (section 38)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    names = [line.split(":", 1)[1].strip() for line in text.splitlines()
             if line.startswith("model name")]
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return {"cpu_model": names[0] if names else "", "amx": "amx_bf16" in flags,
            "avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags}


def pyplot():
    """matplotlib's pyplot drawing to files, or None (said once) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def ratio_plot(path, lengths: list[int], lines: dict[str, dict[int, float]], *,
               ylabel: str, title: str, goals: dict[str, float],
               dots: dict[str, dict[int, list[float]]] | None = None) -> None:
    """Ratios against prompt length, one line per entry of ``lines`` (and its ``dots``,
    e.g. each engine's own), a dashed line per goal, saved to ``path``."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ratio in lines.items():
        line = ax.plot(lengths, [ratio[n] for n in lengths], marker="o", label=name)[0]
        for n in lengths:
            points = (dots or {}).get(name, {}).get(n, [])
            ax.scatter([n] * len(points), points, color=line.get_color(), alpha=0.35, s=14)
    for i, (label, goal) in enumerate(goals.items()):
        ax.axhline(goal, color=("red", "purple")[i % 2], ls="--", lw=0.8, label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def write_results(path: Path | None, name: str, payload: dict) -> Path:
    path = path or ROOT / "docs" / "results" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=1))
    return path
