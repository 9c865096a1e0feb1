"""A Redis hit's fetch, outside vLLM, by how many GETs are kept unanswered.

    python benchmarks/bench_fetch_window.py              # 16 x 128 KiB, 4 x 128 KiB, 8 x 1 MiB
    python benchmarks/bench_fetch_window.py --cases 16x128,8x2048 --windows 1,2,4,8,16

redis-server builds a whole pipeline's replies before it writes the first, so with every GET
sent at once the client waits for all of them; with fewer unanswered it reads one value while
the server builds the next, at one more round trip per value. This measures
``RedisTier.fetch`` (the worker's path: GETs into pool slots, each value checked) at each
window, as in the engine on a 2-core machine: the client on the first core, redis-server on
the last (where the benchmarks put it), with a process spinning on ``sched_yield`` there as
vLLM's engine-core process does while its worker runs (``--no-spinner``: without it). Every
fetch writes slots not written before, for the first rounds (fresh pages, as a hit of a new
prompt has), and follows a 50 ms pause. Prints the median fetch per window and case;
``reply_window`` / ``value_window`` in ``kvconnector/store/redis_wire.py`` are what the
store uses.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from common import ROOT, local_redis, write_results


def spin(stop, core: int) -> None:
    os.sched_setaffinity(0, {core})
    while not stop.is_set():
        for _ in range(1000):
            os.sched_yield()


def measure(url: str, chunk_kib: int, n: int, windows: list[int], rounds: int) -> dict[int, float]:
    import torch

    from kvconnector.keys import ChunkKey
    from kvconnector.store import SlotPool, redis_wire
    from kvconnector.store.redis_store import RedisStore
    from kvconnector.store.tiering import RedisTier

    shape = (chunk_kib * 1024 // 2,)  # bf16 elements
    redis = RedisStore.from_url(url, key_prefix=f"bench-window-{chunk_kib}", timeout_s=10.0)
    pool = SlotPool(n, shape, torch.bfloat16, checksums=True)
    writer = RedisTier(redis, pool, "chunk")
    keys = [ChunkKey(b"w" * 16, 0, bytes([i]) * 16) for i in range(n)]
    for slot, key in enumerate(keys):
        pool.begin_write(slot).copy_(torch.randn(shape).to(torch.bfloat16))
        pool.end_write(slot, key)
        writer.offload(slot, key)
    if not writer.flush(60):
        raise RuntimeError("the values did not reach Redis")
    saved = redis_wire.REPLY_BYTES_IN_FLIGHT, redis_wire.VALUE_BYTES_WANTED
    out = {}
    try:
        for w in windows:
            # value_window then answers w
            redis_wire.REPLY_BYTES_IN_FLIGHT = redis_wire.VALUE_BYTES_WANTED = w * pool.chunk_bytes
            fresh = 8
            reader = SlotPool(n * fresh, shape, torch.bfloat16, checksums=True)
            tier = RedisTier(redis, reader, "chunk")
            times = []
            for r in range(rounds):
                time.sleep(0.05)
                base = n * (r % fresh)
                start = time.perf_counter()
                got = tier.fetch([(base + i, k, 0) for i, k in enumerate(keys)])
                times.append(time.perf_counter() - start)
                if not all(got):
                    raise RuntimeError(f"a fetch missed {got.count(False)} values")
            out[w] = statistics.median(times[1:])
    finally:
        redis_wire.REPLY_BYTES_IN_FLIGHT, redis_wire.VALUE_BYTES_WANTED = saved
        redis.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="16x128,4x128,8x1024",
                   help="values x KiB each, comma-separated (tiny model: 128 KiB chunks)")
    p.add_argument("--windows", default="1,2,4,16")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--no-spinner", dest="spinner", action="store_false")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: the client's and redis-server's")
    windows = [int(x) for x in args.windows.split(",")]
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    os.sched_setaffinity(0, {cores[0]})
    results = []
    with local_redis("reserved") as server:
        stop, spinner = mp.Event(), None
        if args.spinner:
            spinner = mp.Process(target=spin, args=(stop, cores[-1]), daemon=True)
            spinner.start()
        try:
            for n, kib in cases:
                got = measure(server.url, kib, n, [w for w in windows if w <= n], args.rounds)
                results.append({"values": n, "kib": kib,
                                "ms": {w: s * 1000 for w, s in got.items()}})
                print(f"{n} x {kib} KiB: " + ", ".join(
                    f"{w} in flight {s * 1000:.2f} ms" for w, s in got.items()), flush=True)
        finally:
            stop.set()
            if spinner is not None:
                spinner.join(5)
    out = write_results(args.out and ROOT / args.out, "fetch_window",
                        {"spinner": args.spinner, "rounds": args.rounds, "cases": results})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
