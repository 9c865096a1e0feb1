"""What a Redis lookup's round trip costs, asked on the caller's thread and through
kvconnector's lookup thread (``kvconnector/lookups.py``), outside vLLM.

    python benchmarks/bench_lookup_rtt.py              # 400 lookups of each kind per core
    python benchmarks/bench_lookup_rtt.py --lookups 1000 --keys 8

A local redis-server runs on the reserved core (``--redis-cpus``, as in the other
benchmarks). The caller runs on each core in turn: core 1 is where vLLM's engine core and
its scheduler run on the CPU build. Each lookup is one ``RedisStore.exists_many`` of
``--keys`` keys that Redis does not hold, as a miss's lookup is; "thread" asks it through
kvconnector's ``Lookups`` on its lookup thread and waits for the answer, as the scheduler
does for a request among others; "inline" asks it as the scheduler asks for a request alone
in the engine (sent and read on the asking thread when the reply comes within
``IDLE_WAIT_S``); "empty hand-off" sends the lookup thread a question that asks nothing:
the hand-off alone. A pause between lookups lets both threads sleep, as they do between requests.

In the engine, a lookup's share of ``get_num_new_matched_tokens`` is its phase timer's
difference between a Redis hit and a memory hit (``bench_hit_paired.py``); this measures the
pieces of it on their own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from itertools import count
from pathlib import Path

from common import local_redis, write_results

from kvconnector.keys import ChunkKey
from kvconnector.lookups import Lookups
from kvconnector.metadata import IDLE_WAIT_S
from kvconnector.store.redis_store import RedisStore


def timed(call, n: int, pause_s: float) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
        time.sleep(pause_s)
    return out[n // 10:]  # the first ones open connections and warm caches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lookups", type=int, default=400)
    p.add_argument("--keys", type=int, default=5, help="keys a lookup asks (a 1k prompt: 5)")
    p.add_argument("--pause", type=float, default=0.002)
    p.add_argument("--redis-cpus", default="1")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results: dict[str, dict[str, float]] = {}
    with local_redis(args.redis_cpus) as server:
        store = RedisStore.from_url(server.url)
        keys = [ChunkKey(b"f" * 16, 0, os.urandom(16)) for _ in range(args.keys)]
        lookups, questions = Lookups(store, 0.05), count()

        def through_lookups(keys: list[ChunkKey], wait_s: float = 0.0) -> None:
            asked, answer = lookups.answer(None, next(questions), keys, any, None, wait_s)
            if answer is None:
                lookups.wait(0.05)
                lookups.answer(asked, asked.question if asked else None, keys, any, None)

        kinds = {
            "direct": lambda: store.exists_many(keys, 0.05),
            "thread": lambda: through_lookups(keys),
            "inline": lambda: through_lookups(keys, IDLE_WAIT_S),
            "empty hand-off": lambda: through_lookups([]),
        }
        for core in sorted(os.sched_getaffinity(0)):
            os.sched_setaffinity(0, {core})
            for kind, call in kinds.items():
                ts = sorted(timed(call, args.lookups, args.pause))
                results[f"core {core}, {kind}"] = {
                    "median_us": statistics.median(ts) * 1e6,
                    "p10_us": ts[len(ts) // 10] * 1e6, "p90_us": ts[len(ts) * 9 // 10] * 1e6}
        lookups.shutdown()
    print(f"a lookup of {args.keys} keys, redis-server on cores {args.redis_cpus}; us")
    for name, r in results.items():
        print(f"  {name:28s} median {r['median_us']:6.0f}  p10 {r['p10_us']:6.0f}  "
              f"p90 {r['p90_us']:6.0f}")
    path = write_results(Path(args.out) if args.out else None, "lookup_rtt",
                         {"keys": args.keys, "lookups": args.lookups, "pause_s": args.pause,
                          "redis_cpus": args.redis_cpus, "results": results})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
