"""What a step's save costs the thread that asks for it, on tensors shaped like the tiny
model's CPU cache, with and without a Redis tier behind the memory pool. No vLLM.

    python benchmarks/bench_save_path.py                 # 4 chunks a step, 600 rounds a mode

A 1024-token miss saves four 128 KiB chunks, small enough to be gathered on the worker's own
thread (``inline_save_max_kib``): whatever that thread does for them is on the request's
path. Each round runs a stand-in forward pass (matrix products for ``--forward-ms``, which
also leave the caches as a forward pass does) with the write gate open, as vLLM's forward
does (``placement.py``: held Redis puts run then, on the other core), then times
``BlockCopies.save`` of the step's chunks. Modes take turns by blocks of rounds, in one
process:

* ``memory``: the memory pool alone;
* ``memory + Redis``: the same with a ``RedisTier`` behind it (a redis-server of
  ``tests/redis_server.py`` on the other core), so each sealed chunk is queued for a put.

Medians over each mode's rounds, microseconds; the difference is what Redis adds to a save
on the request's path (docs/benchmarks.md section 50: the checksum moved to the put thread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import write_results  # noqa: E402

MODES = ("memory", "memory + Redis")


def make_saver(tiers_for, copies_kw: dict):
    """A ``BlockCopies`` over a tiny-model-shaped CPU cache and a pool whose tiers
    ``tiers_for(pool)`` gives."""
    from kvconnector import block_copies
    from kvconnector.background import CopyThread
    from kvconnector.kernels.batched import PagedCopier
    from kvconnector.layout import describe_layers
    from kvconnector.ledger import Ledger
    from kvconnector.store import SlotPool
    from kvconnector.worker_store import WorkerStore
    from tests.layouts import make_case

    kv = make_case("cpu-pages", num_blocks=256, block_size=128, heads=2, head_size=32,
                   dtype=torch.bfloat16, use_vllm=False)
    layout = describe_layers({f"l{i}": t for i, t in enumerate(kv.layers)}, **kv.describe_kw)
    pool = SlotPool(copies_kw["slots"], (len(kv.layers), *layout.chunk_shape(2)), layout.dtype)
    tiers = tiers_for(pool, layout.family)
    ledger, copies = Ledger(), CopyThread()
    store = WorkerStore(pool, tiers, b"f" * 16, 0, ledger)
    kbs = layout.kernel_block_size
    saver = block_copies.BlockCopies(PagedCopier(kv.layers, layout), kv.layers, kbs, kbs,
                                     store, ledger, copies, 1 << 20)
    return saver, ledger, copies, tiers, pool.chunk_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=4, help="chunks a step saves")
    p.add_argument("--rounds", type=int, default=600, help="rounds per mode")
    p.add_argument("--block", type=int, default=50, help="rounds of a mode in a row")
    p.add_argument("--forward-ms", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from kvconnector.metadata import ChunkTransfer
    from kvconnector.placement import WritePlacement
    from kvconnector.store.redis_store import RedisStore
    from kvconnector.store.tiering import RedisTier
    from tests.redis_server import RedisServer

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("bench_save_path.py needs two cores: the saving thread's and the puts'")
    torch.set_num_threads(1)
    gate = threading.Event()
    slots = 4096
    with RedisServer() as server:
        for task in os.listdir(f"/proc/{server.proc.pid}/task"):
            os.sched_setaffinity(int(task), {cores[1]})
        os.sched_setaffinity(0, {cores[0]})

        def redis_tier(pool, family):
            return [RedisTier(RedisStore.from_url(server.url), pool, family,
                              placement=WritePlacement({cores[1]}, gate))]

        savers = {"memory": make_saver(lambda pool, family: [], {"slots": slots}),
                  "memory + Redis": make_saver(redis_tier, {"slots": slots})}
        x, w = torch.randn(256, 512), torch.randn(512, 512)

        def forward() -> None:
            gate.set()
            end = time.perf_counter() + args.forward_ms / 1000
            while time.perf_counter() < end:
                x.matmul(w)
            gate.clear()

        times: dict[str, list[float]] = {m: [] for m in MODES}
        serial = 0
        for block in range(2 * args.rounds // args.block):
            mode = MODES[block % 2]
            saver, ledger, _, _, _ = savers[mode]
            for _ in range(args.block):
                base = (serial * args.chunks) % slots
                step = [ChunkTransfer("r", c, serial.to_bytes(8, "little") + bytes([c]) * 8,
                                      (base + c) % slots, [2 * c + 1, 2 * c + 2])
                        for c in range(args.chunks)]
                serial += 1
                forward()
                start = time.perf_counter()
                saver.save(step)
                times[mode].append(time.perf_counter() - start)
                ledger.take_stats()
        gate.set()
        for _, _, copies, tiers, _ in savers.values():
            for tier in tiers:
                tier.flush(10)
                tier.close(5)
            copies.close(5)
        chunk_bytes = savers["memory"][4]

    medians = {m: statistics.median(v[args.block:]) * 1e6 for m, v in times.items()}
    print(f"a step's save of {args.chunks} chunks ({chunk_bytes >> 10} KiB each) on the saving "
          f"thread, median over {args.rounds} rounds a mode (microseconds):")
    for m in MODES:
        print(f"  {m:16s} {medians[m]:8.1f}")
    print(f"  Redis adds       {medians['memory + Redis'] - medians['memory']:8.1f}")
    path = write_results(args.out, "save_path", {
        "chunks": args.chunks, "chunk_bytes": chunk_bytes, "rounds": args.rounds,
        "forward_ms": args.forward_ms, "median_us": medians})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
