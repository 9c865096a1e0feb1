"""A hit, side by side: kvconnector against vLLM's own prefix cache (the floor), vLLM's
ExampleConnector (the peer that runs on the CPU build) and recomputing, in one run.

    python benchmarks/bench_peers.py                 # tiny Mistral, bf16, 1k-16k tokens
    python benchmarks/bench_peers.py --lengths 1024,2048 --repeats 1   # a quick look

Every configuration runs in its own fresh process, on the same prompts, one after another:

* ``recompute``: vLLM alone, prefix cache off (every request computes its prompt);
* ``vllm prefix cache``: vLLM alone, prefix cache on; the hit is the second request of the
  same prompt, whose KV is still where attention reads it: the floor a hit can approach;
* ``ExampleConnector``: vLLM's example connector (safetensors files in a temporary folder);
* ``kvconnector memory``: the second request of a prompt loads it from host memory;
* ``kvconnector redis``: a second engine, with an empty memory tier, loads what a first
  engine wrote to a local redis-server (over TCP on loopback);
* ``kvconnector redis, server anywhere`` (``--redis-anywhere``): the same from a second
  local redis-server left wherever the kernel puts it; the first runs where
  ``--redis-cpus`` says (by default on the core vLLM's worker leaves to its engine-core
  process, where a one-machine deployment should put it);
* ``kvconnector redis, unix socket`` (``--unix-socket``): the same, with another fresh
  engine reading the same chunks over the first server's unix socket (only with the server
  this script starts);
* ``kvconnector disk``: a second engine, with an empty memory tier, loads what a first
  engine wrote to its disk tier (a directory under the repository's ``.cache``), the files'
  pages dropped from the page cache before it starts (reads are O_DIRECT by default);
* with ``--floors``, two more floors: vLLM's own prefix-cache hit with a connector attached
  that does nothing (``idle_connector.py``: what vLLM's connector machinery alone costs a
  hit), and with kvconnector attached (its hit is still vLLM's own; kvconnector's hooks run);
* with ``--parked``, the Redis and disk hits again with ``sync_fetch_max_mib: 0``: parked in
  WAITING_FOR_REMOTE_KVS for a step like any other request's, not fetched before the lone
  request's own step (the default).

Every engine prefills a prompt in one step (``max_num_batched_tokens`` = the longest
prompt): ExampleConnector keeps only the last step of a prompt prefilled in several steps
and then fails to load it (a shape mismatch that stops the engine, seen at 8192 tokens).
vLLM's own prefix cache is off for every connector, so each hit is the connector's. TTFT is
the latency of a one-token generation of one request; per length the median over
``--repeats`` distinct prompts and ``--rounds`` engines a configuration (engines of one
configuration differ by 10-30% on this machine; the rounds take turns; each engine's own
median and phase timers are kept too, ``per_engine``); every engine runs
with vLLM's stats on, which carry kvconnector's phase timers (its breakdown of each hit is
printed); every engine pauses for 0.3 s and serves a 16-token request just before and after
each timed hit (which flushes the timers), so every hit follows the same sequence. After
the timed hit, each prompt is generated once more (a hit again) for ``--check-tokens``
greedy tokens, which must equal ``recompute``'s.
vLLM's ``OffloadingConnector`` and ``SimpleCPUOffloadConnector`` are started too (prefix
cache on, as they expect); the report records what they do on this machine.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import (
    add_model_args,
    connector,
    connector_seconds,
    engine,
    in_fresh_process,
    local_redis,
    pyplot,
    random_prompt,
    redis_for,
    resolve_model,
    timed_generate,
    write_results,
)

FLOOR = "vllm prefix cache"
REFUSING_PEERS = {
    "OffloadingConnector": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}},
    "SimpleCPUOffloadConnector": {"kv_connector": "SimpleCPUOffloadConnector",
                                  "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}},
}


def run_config(model: str, args, kvt: dict | None, prompts: dict[int, list[list[int]]],
               prefix_caching: bool, fill_first: bool) -> dict:
    """TTFT of each prompt's hit (after a first request that fills the cache when
    ``fill_first``), the greedy tokens of one more request of it, and for kvconnector where
    a hit's time went (its phase timers, per hit)."""
    max_len = max(prompts) + args.check_tokens + 64
    ttft: dict[int, list[float]] = {}
    cached: dict[int, list[int]] = {}
    tokens: dict[int, list[list[int]]] = {}
    phases: dict[int, dict[str, float]] = {}
    ours = bool(kvt) and kvt["kv_connector"] == "kvconnector"

    def timers() -> dict[str, float]:
        """The timers after a short request whose step carries what earlier ones left
        (its own hooks: well under a millisecond). Every configuration runs the same
        pause and request before and after its timed hit, so that each hit follows the
        same sequence (it moves vLLM's own hit by about 0.7 ms on the tiny model)."""
        time.sleep(0.3)
        timed_generate(llm, [random_prompt(random.Random(8), 16, 400)], 1)
        return connector_seconds() if ours else {}

    with engine(model, args, kvt, max_len, enable_prefix_caching=prefix_caching,
                max_num_batched_tokens=max_len, disable_log_stats=False) as llm:
        timed_generate(llm, [random_prompt(random.Random(9), 300, 400)], 1)
        for n, group in prompts.items():
            times, cached[n], tokens[n] = [], [], []
            phases[n] = {}
            for p in group:
                if fill_first:
                    timed_generate(llm, [p], 1)
                before = timers()
                secs, outs = timed_generate(llm, [p], 1)
                for k, v in timers().items():
                    phases[n][k] = phases[n].get(k, 0.0) + (v - before.get(k, 0.0)) / len(group)
                times.append(secs)
                cached[n].append(outs[0].num_cached_tokens or 0)
                _, outs = timed_generate(llm, [p], args.check_tokens)
                tokens[n].append(list(outs[0].outputs[0].token_ids))
            ttft[n] = times
    return {"ttft": ttft, "cached": cached, "tokens": tokens, "phases": phases}


def fill_redis(model: str, args, kvt: dict, prompts: dict[int, list[list[int]]],
               chunks: int) -> int:
    """A first engine stores every prompt; returns once Redis holds all their chunks."""
    import redis

    max_len = max(prompts) + 64
    with engine(model, args, kvt, max_len, enable_prefix_caching=False,
                max_num_batched_tokens=max_len) as llm:
        for group in prompts.values():
            for p in group:
                timed_generate(llm, [p], 1)
        client = redis.Redis.from_url(kvt["kv_connector_extra_config"]["redis_url"])
        deadline = time.monotonic() + 120
        while client.dbsize() < chunks and time.monotonic() < deadline:
            time.sleep(0.2)
        return client.dbsize()


def fill_disk(model: str, args, kvt: dict, prompts: dict[int, list[list[int]]],
              directory: str, chunks: int) -> int:
    """A first engine stores every prompt; returns once the disk holds all their chunks."""
    from pathlib import Path

    max_len = max(prompts) + 64
    with engine(model, args, kvt, max_len, enable_prefix_caching=False,
                max_num_batched_tokens=max_len) as llm:
        for group in prompts.values():
            for p in group:
                timed_generate(llm, [p], 1)
        deadline = time.monotonic() + 120
        while (n := len(list(Path(directory).rglob("*.kvc")))) < chunks and \
                time.monotonic() < deadline:
            time.sleep(0.2)
    return n


def parked(kvt: dict) -> dict:
    """The same connector with every disk or Redis hit parked a step."""
    return {**kvt, "kv_connector_extra_config": {**kvt["kv_connector_extra_config"],
                                                 "sync_fetch_max_mib": 0}}


def drop_page_cache(directory: str) -> None:
    """Evict the chunk files' pages (clean pages: no root needed)."""
    import os
    from pathlib import Path

    os.sync()
    for f in Path(directory).rglob("*.kvc"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def refusal(model: str, args, kvt: dict) -> str:
    """What a peer does on this machine: its error, or how much a repeated prompt reused.
    In-process, so that the root cause is the exception itself."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    p = random_prompt(random.Random(5), 1024, 400)
    try:
        with engine(model, args, kvt, 2048, enable_prefix_caching=True) as llm:
            timed_generate(llm, [p], 1)
            _, outs = timed_generate(llm, [p], 1)
            return f"started; a repeated 1024-token prompt reused " \
                   f"{outs[0].num_cached_tokens or 0} tokens"
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.set_defaults(dtype="bfloat16", redis=True)
    p.add_argument("--no-redis", dest="redis", action="store_false")
    p.add_argument("--no-disk", dest="disk", action="store_false",
                   help="do not measure the disk tier")
    # 16000, not 16384: the tiny model's 16384 positions must also hold the checked tokens.
    p.add_argument("--lengths", default="1024,2048,4096,8192,16000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="fresh engines per configuration, taking turns (each round starts "
                        "one configuration later); a TTFT is the median over all of them")
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--floors", action="store_true",
                   help="also vLLM's own hit with an idle connector and with kvconnector attached")
    p.add_argument("--parked", action="store_true",
                   help="also measure Redis and disk hits parked a step (sync_fetch_max_mib 0)")
    p.add_argument("--unix-socket", action="store_true",
                   help="also the Redis hit over the server's unix socket")
    p.add_argument("--redis-anywhere", action="store_true",
                   help="also the Redis hit from a second local redis-server on any core")
    p.add_argument("--whole-loads", action="store_true",
                   help="also the memory and Redis hits loaded whole before the forward "
                        "(load_by_layer false), as before section 20")
    p.add_argument("--sync-mib", type=int, default=None,
                   help="also the Redis hit with sync_fetch_max_mib set to this")
    with redis_for(p.parse_args()) as args:
        bench(args)


def bench(args) -> None:
    from contextlib import ExitStack

    from tqdm import tqdm

    model, vocab = resolve_model(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)
    prompts = {n: [random_prompt(rng, n, vocab) for _ in range(args.repeats)] for n in lengths}
    extra = {"memory_capacity": args.memory_capacity}
    with ExitStack() as stack:
        example = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvc-example-connector-"))
        # (name, kv_transfer_config, vLLM's prefix cache, fill first, before each engine)
        configs: list[tuple] = [
            ("recompute", None, False, False, None),
            (FLOOR, None, True, True, None),
            ("ExampleConnector", {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"shared_storage_path": example}},
             False, True, None),
            ("kvconnector memory", connector(extra), False, True, None),
        ]
        if args.whole_loads:
            configs.append(("kvconnector memory, whole before the forward",
                            connector({**extra, "load_by_layer": False}), False, True, None))
        if args.floors:
            # vLLM's engine processes import the idle connector by module name.
            here = str(Path(__file__).resolve().parent)
            os.environ["PYTHONPATH"] = os.pathsep.join(
                p for p in (here, os.environ.get("PYTHONPATH")) if p)
            configs += [(f"{FLOOR}, idle connector",
                         {"kv_connector": "IdleConnector", "kv_role": "kv_both",
                          "kv_connector_module_path": "idle_connector"}, True, True, None),
                        (f"{FLOOR}, kvconnector", connector(extra), True, True, None)]
        if args.redis_url:
            with_redis = connector({**extra, "redis_url": args.redis_url})
            chunks = sum(len(q) // 256 for group in prompts.values() for q in group)
            stored = in_fresh_process(fill_redis, model, args, with_redis, prompts, chunks)
            if stored < chunks:
                print(f"warning: Redis holds {stored} of {chunks} chunks")
            configs.append(("kvconnector redis", with_redis, False, False, None))
            if args.whole_loads:
                configs.append(("kvconnector redis, whole before the forward",
                                connector({**extra, "redis_url": args.redis_url,
                                           "load_by_layer": False}), False, False, None))
            if args.sync_mib is not None:
                configs.append((f"kvconnector redis, sync up to {args.sync_mib} MiB",
                                connector({**extra, "redis_url": args.redis_url,
                                           "sync_fetch_max_mib": args.sync_mib}),
                                False, False, None))
            if args.redis_anywhere:
                url = stack.enter_context(local_redis("any")).url
                anywhere = connector({**extra, "redis_url": url})
                in_fresh_process(fill_redis, model, args, anywhere, prompts, chunks)
                configs.append(("kvconnector redis, server anywhere", anywhere, False, False,
                                None))
            if args.unix_socket and args.redis_unix_url:  # the same chunks, over the socket
                configs.append(("kvconnector redis, unix socket",
                                connector({**extra, "redis_url": args.redis_unix_url}),
                                False, False, None))
            if args.parked:
                configs.append(("kvconnector redis, parked", parked(with_redis), False, False,
                                None))
        if args.disk:
            from common import ROOT

            (ROOT / ".cache").mkdir(exist_ok=True)
            d = stack.enter_context(tempfile.TemporaryDirectory(dir=ROOT / ".cache",
                                                                prefix="bench-peers-disk-"))
            with_disk = connector({**extra, "disk_path": d})
            chunks = sum(-(-(len(q) - 1) // 256) for group in prompts.values() for q in group)
            stored = in_fresh_process(fill_disk, model, args, with_disk, prompts, d, chunks)
            if stored < chunks:
                print(f"warning: the disk holds {stored} of {chunks} chunk files")
            configs.append(("kvconnector disk", with_disk, False, False,
                            lambda: drop_page_cache(d)))
            if args.parked:
                configs.append(("kvconnector disk, parked", parked(with_disk), False, False,
                                lambda: drop_page_cache(d)))
        runs: dict[str, dict] = {}
        for r in range(args.rounds):  # each round starts one configuration later
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for name, kvt, prefix, fill, before in tqdm(order, desc=f"round {r + 1}"):
                if before is not None:
                    before()
                merge(runs.setdefault(name, {}), in_fresh_process(
                    run_config, model, args, kvt, prompts, prefix, fill), args.rounds)
        runs = {name: runs[name] for name, *_ in configs}
    for r in runs.values():
        r["ttft"] = {n: statistics.median(t) for n, t in r["ttft"].items()}
    refused = {name: in_fresh_process(refusal, model, args, kvt)
               for name, kvt in REFUSING_PEERS.items()}
    report(args, model, lengths, runs, refused)


def merge(into: dict, run: dict, rounds: int) -> None:
    """One engine's results into its configuration's: every hit's time, the phase timers
    averaged over the rounds; the tokens of every round must be the same (else the
    configuration is marked, and the report shows its tokens as differing). Each engine's
    own median TTFT and phases are kept too, to tell an outlying engine from a slow setup."""
    into.setdefault("engines", []).append(
        {n: {"ttft_s": statistics.median(t), "phases": run["phases"].get(n, {})}
         for n, t in run["ttft"].items()})
    if "ttft" not in into:
        into.update({"ttft": run["ttft"], "cached": run["cached"], "tokens": run["tokens"],
                     "phases": {n: {k: v / rounds for k, v in p.items()}
                                for n, p in run["phases"].items()}})
        return
    for n in run["ttft"]:
        into["ttft"][n] += run["ttft"][n]
        into["cached"][n] += run["cached"][n]
        if run["tokens"][n] != into["tokens"][n]:
            into.setdefault("rounds_differ", set()).add(n)
        for k, v in run["phases"].get(n, {}).items():
            into["phases"][n][k] = into["phases"][n].get(k, 0.0) + v / rounds


def report(args, model: str, lengths: list[int], runs: dict, refused: dict) -> None:
    floor = runs[FLOOR]["ttft"]
    truth = runs["recompute"]["tokens"]
    floor_tokens = runs[FLOOR]["tokens"]
    names = list(runs)

    def differ(name: str) -> set[int]:
        """Lengths whose tokens differed between the configuration's engines."""
        return runs[name].get("rounds_differ", set())

    table = {name: {n: {"ttft_s": r["ttft"][n], "vs_floor": r["ttft"][n] / floor[n],
                        "cached_tokens": r["cached"][n],
                        "same_tokens": r["tokens"][n] == truth[n]
                        and n not in differ("recompute") | differ(name),
                        "same_tokens_as_floor": r["tokens"][n] == floor_tokens[n]
                        and n not in differ(FLOOR) | differ(name)}
                    for n in lengths}
             for name, r in runs.items()}
    print(f"\nhit TTFT (s) and ratio to vLLM's own prefix-cache hit; model {model} "
          f"({args.dtype}), median of {args.repeats} prompts x {args.rounds} engines")
    print(f"{'tokens':>7} " + " ".join(f"{k:>24}" for k in names))
    for n in lengths:
        cells = [f"{table[k][n]['ttft_s']:.4f} ({table[k][n]['vs_floor']:.2f}x)"
                 + ("" if table[k][n]["same_tokens"] else " !")
                 + ("" if table[k][n]["same_tokens_as_floor"] else " ~") for k in names]
        print(f"{n:>7} " + " ".join(f"{c:>24}" for c in cells))
    print("'!': greedy tokens differ from recompute; '~': from vLLM's own prefix-cache hit "
          "(which computes the same last block)")
    print("\nwhere a kvconnector hit's time went, per hit (ms; redis_fetch, disk_fetch and "
          "load_copy are parts of start_load_kv, or of copy_thread for a parked hit)")
    for name, r in runs.items():
        for n in lengths:
            parts = sorted(r.get("phases", {}).get(n, {}).items(), key=lambda kv: -kv[1])
            if parts:
                print(f"  {name}, {n} tokens, TTFT {r['ttft'][n] * 1000:.1f}: " + ", ".join(
                    f"{k} {v * 1000:.2f}" for k, v in parts if v >= 5e-5))
                if len(r["engines"]) > 1:
                    print("    per engine: " + ", ".join(_engine_cell(e[n]) for e in r["engines"]))
    for name, why in refused.items():
        print(f"{name}: {why}")
    out = write_results(args.out, "peers", {"model": model, "dtype": args.dtype,
                                            "lengths": lengths, "repeats": args.repeats,
                                            "rounds": args.rounds,
                                            "redis_cpus": getattr(args, "redis_cpus_used",
                                                                  None),
                                            "results": table, "refused": refused,
                                            "connector_seconds_per_hit": {
                                                name: r.get("phases", {})
                                                for name, r in runs.items()},
                                            "per_engine": {name: r["engines"]
                                                           for name, r in runs.items()}})
    print(f"results: {out}")
    plot(out.with_suffix(".png"), model, lengths, table)


def _engine_cell(e: dict) -> str:
    """One engine's median TTFT of a length, with its fetch, if it had one (ms)."""
    fetch = sum(v for k, v in e["phases"].items() if k.endswith("_fetch"))
    return f"{e['ttft_s'] * 1000:.1f}" + (f" (fetch {fetch * 1000:.1f})" if fetch else "")


def plot(path, model: str, lengths: list[int], table: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, per_len) in enumerate(table.items()):
        color = f"C{i}"  # the same colour for a configuration in both panels
        ax.plot(lengths, [per_len[n]["ttft_s"] for n in lengths], marker="o", label=name,
                color=color)
        if name != "recompute":
            bx.plot(lengths, [per_len[n]["vs_floor"] for n in lengths], marker="o",
                    label=name, color=color)
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xlabel("prompt tokens")
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT of a hit (s)")
    bx.set_ylabel("x vLLM's own prefix-cache hit")
    for goal in (1.05, 1.25):  # issue 24's goals: a memory hit, a Redis hit
        bx.axhline(goal, color="grey", linestyle="--", linewidth=1)
    ax.legend(fontsize=8)
    fig.suptitle(f"A hit side by side ({model.rsplit('/', 1)[-1]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
