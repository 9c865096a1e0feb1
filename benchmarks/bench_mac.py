"""What the chunk MAC costs: signing and verifying a chunk, and a Redis round trip of signed
chunks against unsigned ones, in one run.

    .venv/bin/python benchmarks/bench_mac.py [--sizes 256K,2M,32M] [--depth 4] \
        [--seconds 1] [--out docs/results/mac.json]

Per chunk size: ``xxh3`` (the checksum every unsigned Redis read checks) and ``blake3 MAC``
(what a signed one checks instead), in GB/s on one core; then ``RedisStore.get_many`` of
``depth`` chunks into caller buffers and ``put_many`` (header encoding included, as the
worker's put thread does it: the checksum is known, a MAC is computed), with and without
``chunk_mac_key``, against a local redis-server. The ratio signed / unsigned is the MAC's
cost where users feel it; ``--rounds`` repeats everything and reports medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_redis import human, parse_size, timed  # noqa: E402
from kvconnector.store import codec  # noqa: E402
from kvconnector.store.redis_store import RedisStore  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

MAC_KEY = codec.mac_key(b"benchmark-secret-of-32-characters")


def gbps(fn, nbytes: int, seconds: float) -> float:
    return timed(fn, 1, seconds) * nbytes / 1e9


def bench_size(url: str, size: int, depth: int, seconds: float) -> dict:
    payloads = [memoryview(os.urandom(size)) for _ in range(depth)]
    exps = [codec.ExpectedChunk(f"{'cd' * 16}:0:{i:032x}", "chunk", "uint8", (size,), size)
            for i in range(depth)]
    header = codec.check_header(codec.encode_header(exps[0], payloads[0], mac_key=MAC_KEY)[
        codec.PREFIX_LEN:], exps[0])
    out: dict = {
        "xxh3_GBps": gbps(lambda: codec.checksum(payloads[0]), size, seconds),
        "mac_GBps": gbps(lambda: codec.check_payload(header, payloads[0], MAC_KEY), size,
                         seconds)}
    outs = [bytearray(size) for _ in range(depth)]
    digests = [codec.checksum(p) for p in payloads]
    for name, key in (("unsigned", None), ("signed", MAC_KEY)):
        with RedisStore.from_url(url, key_prefix=f"bench-{name}", timeout_s=30.0,
                                 mac_key=key) as store:
            def put(key: bytes | None = key) -> None:
                # As the worker's put thread: the checksum is known from the memory tier.
                items = [(e.key, codec.encode_header(e, p, xxh3=d, mac_key=key), p)
                         for e, p, d in zip(exps, payloads, digests, strict=True)]
                assert store.put_many(items) == depth

            def get():
                got = store.get_many([e.key for e in exps], exps, out=outs)
                assert all(g is not None for g in got)

            out[f"put_{name}_per_s"] = timed(put, depth, seconds)
            out[f"get_{name}_per_s"] = timed(get, depth, seconds)
            assert store.snapshot()["corrupt"] == 0
    out["put_ratio"] = out["put_signed_per_s"] / out["put_unsigned_per_s"]
    out["get_ratio"] = out["get_signed_per_s"] / out["get_unsigned_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256K,2M,32M")
    ap.add_argument("--depth", type=int, default=4, help="chunks per call")
    ap.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version()},
              "when": time.strftime("%Y-%m-%d %H:%M"), "depth": args.depth, "results": {}}
    with RedisServer() as server:
        for size in sizes:
            rounds = [bench_size(server.url, size, args.depth, args.seconds)
                      for _ in range(args.rounds)]
            report["results"][human(size)] = r = {
                k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
            print(f"{human(size):>8}  xxh3 {r['xxh3_GBps']:.2f} GB/s  MAC "
                  f"{r['mac_GBps']:.2f} GB/s  get signed/unsigned {r['get_ratio']:.2f}  "
                  f"put signed/unsigned {r['put_ratio']:.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
