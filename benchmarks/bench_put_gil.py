"""What a Redis put made from a thread of the forward's own process costs that forward, against
the same put made from another process.

    python benchmarks/bench_put_gil.py                # 600 rounds, 4 x 128 KiB a put

No vLLM here. The main thread runs a stand-in forward pass on one core: small torch ops with
Python between them (a 2-layer model's forward is short ops and Python; vLLM's own forward
releases the GIL for more of its time than this loop does, so this is the worst case). Each
odd round, as the forward starts, something else starts on the other core, beside a
redis-server pinned there too:

* ``nothing``: a thread of this process wakes and does nothing (what waking it costs);
* ``python``: that thread runs 0.3 ms of pure Python (what holding the GIL that long costs);
* ``thread``: that thread makes the put, ``RedisStore.put_many`` of four 128 KiB values, as
  kvconnector's put thread does;
* ``process``: that thread hands the put over a pipe to a child process, which makes the same
  ``put_many`` and answers when done.

Each mode's number is the median, over its rounds, of an odd round's forward time minus the
even round's before it (nothing on the other core): what the work beside it cost the forward.
Modes take turns by blocks of rounds, so the machine's drift hits them alike.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from multiprocessing import get_context
from pathlib import Path

import common

MODES = ("nothing", "python", "thread", "process")
VALUES = 4
VALUE_BYTES = 128 << 10


# One payload, made once; its checksum is taken for every value, as kvconnector's put
# thread hashes a leased slot's bytes (the seal does not, on the forward's thread).
PAYLOAD = memoryview(random.Random(0).randbytes(VALUE_BYTES))


def _items(serial: int) -> list:
    """A put's items, as the put thread builds them: a header per value, then the send."""
    from kvconnector.store.codec import ExpectedChunk, encode_header

    expected = ExpectedChunk("k", "bench", "uint8", (VALUE_BYTES,), VALUE_BYTES)
    return [(f"gil:{serial}:{i}", encode_header(expected, PAYLOAD), PAYLOAD)
            for i in range(VALUES)]


def _child(url: str, core: int, conn) -> None:
    """The ``process`` mode's putter: one put per message, answered when made."""
    from kvconnector.store.redis_store import RedisStore

    os.sched_setaffinity(0, {core})
    store = RedisStore.from_url(url)
    while (serial := conn.recv()) is not None:
        conn.send(store.put_many(_items(serial)))


class Beside:
    """The work that runs beside a forward, on a thread of this process on ``core``."""

    def __init__(self, url: str, core: int) -> None:
        from kvconnector.store.redis_store import RedisStore

        self.core = core
        self.store = RedisStore.from_url(url)
        self.mode = "nothing"
        self.serial = 0
        self.stored = 0
        self._go = threading.Event()
        self._done = threading.Event()
        self._pipe, child_end = get_context("spawn").Pipe()
        self._child = get_context("spawn").Process(target=_child, args=(url, core, child_end),
                                                   daemon=True)
        self._child.start()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        os.sched_setaffinity(0, {self.core})
        _items(0)  # the checksum, before any round
        while True:
            self._go.wait()
            self._go.clear()
            self.serial += 1
            if self.mode == "python":
                end = time.perf_counter() + 0.0003
                while time.perf_counter() < end:
                    pass
            elif self.mode == "thread":
                self.stored += self.store.put_many(_items(self.serial))
            elif self.mode == "process":
                self._pipe.send(self.serial)
                self.stored += self._pipe.recv()
            self._done.set()

    def start(self) -> None:
        self._go.set()

    def wait(self) -> None:
        self._done.wait()
        self._done.clear()

    def close(self) -> None:
        self._pipe.send(None)
        self._child.join(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=600, help="pairs of rounds per mode")
    p.add_argument("--block", type=int, default=20, help="pairs of a mode in a row")
    p.add_argument("--ops", type=int, default=300, help="op groups in one forward")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch

    from tests.redis_server import RedisServer

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("bench_put_gil.py needs two cores: the forward's and the put's")
    forward_core, other_core = cores[0], cores[1]
    torch._C.set_num_threads(1)
    with RedisServer() as server:
        os.sched_setaffinity(server.proc.pid, {other_core})
        beside = Beside(server.url, other_core)
        os.sched_setaffinity(0, {forward_core})
        x, w = torch.randn(64, 256), torch.randn(256, 256)

        def forward() -> float:
            start = time.perf_counter()
            y = x
            for _ in range(args.ops):
                y = torch.nn.functional.silu(y @ w) * 0.01
                _ = [i * 2 for i in range(50)]
            return time.perf_counter() - start

        for _ in range(20):
            forward()
        extra: dict[str, list[float]] = {m: [] for m in MODES}
        alone: list[float] = []
        done = {m: 0 for m in MODES}
        while any(n < args.rounds for n in done.values()):
            for mode in MODES:
                beside.mode = mode
                for _ in range(min(args.block, args.rounds - done[mode])):
                    base = forward()
                    time.sleep(0.005)
                    beside.start()
                    with_work = forward()
                    beside.wait()
                    time.sleep(0.005)
                    alone.append(base * 1e3)
                    extra[mode].append((with_work - base) * 1e3)
                    done[mode] += 1
        beside.close()
    expected = VALUES * args.rounds * 2
    if beside.stored != expected:
        sys.exit(f"only {beside.stored} of {expected} values were stored")
    print(f"forward alone: median {statistics.median(alone):.2f} ms "
          f"(cores: forward {forward_core}, beside it {other_core} with redis-server)")
    print(f"{'beside the forward':>20}  {'median extra':>12}  {'mean extra':>10}")
    summary = {}
    for mode in MODES:
        med, mean = statistics.median(extra[mode]), statistics.mean(extra[mode])
        summary[mode] = {"median_extra_ms": med, "mean_extra_ms": mean}
        print(f"{mode:>20}  {med:>+9.3f} ms  {mean:>+7.3f} ms")
    out = common.write_results(args.out, "put_gil", {
        "args": {k: str(v) for k, v in vars(args).items()},
        "forward_ms": statistics.median(alone), "summary": summary, "extra_ms": extra})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
