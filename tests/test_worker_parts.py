"""The worker half's parts blend shares with it: the ledger, the store, block-id expansion
(no engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvconnector.kernels import kernel_block_ids
from kvconnector.ledger import Ledger
from kvconnector.store import ChunkCorrupt, SlotPool
from kvconnector.worker_store import WorkerStore

ROOT = Path(__file__).resolve().parent.parent


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_kernel_block_ids_expand_each_block_and_keep_holes():
    assert kernel_block_ids([3, 0], 1) == [3, 0]
    assert kernel_block_ids([2, -1, 0], 2) == [4, 5, -1, -1, 0, 1]
    assert kernel_block_ids([], 4) == []


def test_ledger_reports_once_and_then_is_empty():
    ledger = Ledger()
    ledger.load_failed("r", 3, [7, 8], [h(1)])
    ledger.load_failed("r", 1, [9])
    ledger.bad_chunks([h(2)])
    ledger.received("p")
    ledger.count(loaded_chunks=2)
    assert ledger.outstanding() == {"load_errors": 3, "bad_chunks": 2, "failed_loads": 1,
                                    "received": 1, "fetches": 0}
    report = ledger.take_report()
    assert report is not None
    assert report.bad_chunks == {h(1), h(2)} and report.failed_loads == {"r": 1}
    assert ledger.take_load_errors() == {7, 8, 9}
    assert ledger.take_received() == {"p"}
    stats = ledger.take_stats()
    assert stats is not None and stats.data["loaded_chunks"] == 2
    assert ledger.take_report() is None and ledger.take_stats() is None
    assert not any(ledger.outstanding().values())
    assert ledger.totals.data["loaded_chunks"] == 2  # totals are never taken


class FakeTier:
    def __init__(self, pool: SlotPool, arrive: set[int], name: str = "redis") -> None:
        self.pool, self.arrive, self.name = pool, arrive, name
        self.offloaded: list[int] = []
        self.asked: list[int] = []

    def fetch(self, wanted):
        for slot, key, _ in wanted:
            self.asked.append(slot)
            self.pool.begin_write(slot)
            if slot in self.arrive:
                self.pool.end_write(slot, key, for_redis=False)
        return [slot in self.arrive for slot, _, _ in wanted]

    def offload(self, slot, key, blocks=0):
        self.offloaded.append(slot)


class FakeStream:
    def __init__(self) -> None:
        self.synced = 0

    def synchronize(self) -> None:
        self.synced += 1


def test_store_fetch_counts_and_waits_for_the_copy_stream():
    pool = SlotPool(4, (2, 8), torch.float32)
    ledger, stream = Ledger(), FakeStream()
    store = WorkerStore(pool, [FakeTier(pool, {1})], b"f" * 16, 0, ledger, stream)
    store.fetch([(1, h(1), "redis", 0), (2, h(2), "redis", 0)])
    assert stream.synced == 1
    store.read(1, h(1))
    with pytest.raises(ChunkCorrupt):
        store.read(2, h(2))  # did not arrive: unsealed
    stats = ledger.take_stats()
    assert stats is not None
    assert stats.data["redis_loaded_chunks"] == 1 and stats.data["redis_misses"] == 1
    assert stats.data["phase_seconds.redis_fetch"] > 0  # a hit's breakdown (issue 24)
    store.fetch([])
    assert stream.synced == 1  # nothing wanted: no wait, nothing counted
    assert ledger.take_stats() is None


def test_store_seal_keys_the_slot_and_offloads_it():
    pool = SlotPool(2, (2, 8), torch.float32)
    tier = FakeTier(pool, set())
    store = WorkerStore(pool, [tier], b"f" * 16, 1, Ledger())
    store.begin_write(0).fill_(1.0)
    store.seal(0, h(5))
    assert pool.slot_holding(store.key(h(5))) == 0 and tier.offloaded == [0]
    assert WorkerStore(pool, [], b"f" * 16, 1, Ledger()).read(0, h(5)).sum() == 16


def test_store_fetch_asks_the_disk_then_redis_and_writes_redis_chunks_to_disk():
    """A chunk the scheduler found on disk is asked of the disk, then of Redis if the disk
    fails it; one found in Redis only is never asked of the disk, and once it arrives it is
    written to the disk."""
    pool = SlotPool(4, (2, 8), torch.float32)
    ledger = Ledger()
    disk, redis = FakeTier(pool, {0}, "disk"), FakeTier(pool, {1, 2}, "redis")
    store = WorkerStore(pool, [disk, redis], b"f" * 16, 0, ledger)
    store.fetch([(0, h(0), "disk", 0), (1, h(1), "disk", 0), (2, h(2), "redis", 0),
                 (3, h(3), "redis", 0)])
    assert disk.asked == [0, 1] and redis.asked == [1, 2, 3]
    assert sorted(disk.offloaded) == [1, 2] and redis.offloaded == []
    for slot in (0, 1, 2):
        store.read(slot, h(slot))
    data = ledger.take_stats().data
    assert (data["disk_loaded_chunks"], data["disk_misses"]) == (1, 1)
    assert (data["redis_loaded_chunks"], data["redis_misses"]) == (2, 1)


def test_blend_worker_is_a_plug_in_of_the_worker_half():
    """blend/worker.py imports nothing of the half and touches no private name of it."""
    tree = ast.parse((ROOT / "kvconnector/blend/worker.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "kvconnector.worker" not in imported
    assert not [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Attribute) and n.value.attr in ("half", "store",
                                                                            "ledger")
                and n.attr.startswith("_")]


def test_an_idle_step_waits_for_a_fetch_in_flight_and_only_then():
    import threading
    import time

    ledger = Ledger()
    start = time.perf_counter()
    ledger.wait_for_fetch(1.0)  # nothing in flight: no wait
    assert time.perf_counter() - start < 0.1
    ledger.start_fetch(lambda: None)
    ledger.start_fetch(lambda: None)
    with pytest.raises(RuntimeError):  # a fetch that could not be queued is not counted
        ledger.start_fetch(lambda: (_ for _ in ()).throw(RuntimeError("shut down")))
    threading.Timer(0.05, ledger.fetch_over).start()
    start = time.perf_counter()
    ledger.wait_for_fetch(5.0)  # returns when one of the two ends, not at the timeout
    assert 0.04 < time.perf_counter() - start < 2.0
    assert ledger.outstanding()["fetches"] == 1
    start = time.perf_counter()
    ledger.wait_for_fetch(0.05)  # the other never ends: the timeout bounds the wait
    assert 0.04 < time.perf_counter() - start < 2.0
    ledger.fetch_over()
    assert ledger.outstanding()["fetches"] == 0


def test_get_finished_waits_only_in_a_step_that_scheduled_nothing():
    """The hook passes the plan's ``idle`` to the worker half, which waits only then (the
    wait itself: test_lookups.py); no plan bound (vLLM's shutdown path): no wait."""
    from kvconnector.connector import KVConnector
    from kvconnector.metadata import StepPlan

    asked: list[bool] = []

    class Half:
        def finished_loading(self, idle: bool = False) -> set[str]:
            asked.append(idle)
            return {"r"} if idle else set()

        def forward_began(self, plan: StepPlan) -> None:  # bind_connector_metadata's call
            pass

    conn = object.__new__(KVConnector)  # the hook alone: no engine behind it
    conn._worker, conn._phases, conn._connector_metadata = Half(), {}, None
    assert conn.get_finished(set()) == (None, None)
    conn.bind_connector_metadata(StepPlan(idle=True))
    assert conn.get_finished(set()) == (None, {"r"})
    conn.bind_connector_metadata(StepPlan(idle=False))
    assert conn.get_finished(set()) == (None, None)
    assert asked == [False, True, False]


def test_only_a_step_that_computes_lets_held_writes_go():
    """A bound plan that schedules tokens sets the worker's ``write_gate`` (saves, Redis
    puts and disk writes wait for it); an idle step's plan does not."""
    import threading

    from kvconnector.metadata import StepPlan
    from kvconnector.worker import WorkerHalf

    half = object.__new__(WorkerHalf)  # the method alone: no engine behind it
    half.write_gate = threading.Event()
    half.forward_began(StepPlan(idle=True))
    assert not half.write_gate.is_set()
    half.forward_began(StepPlan(idle=False))
    assert half.write_gate.is_set()


@pytest.mark.parametrize("case", ["small", "large", "a fetch writes its slot",
                                  "a put reads its slot"])
def test_a_small_cpu_save_is_made_before_it_returns_others_on_the_copy_thread(case):
    """On the CPU build a step's saves up to ``inline_save_max_kib`` are gathered and
    sealed on the thread that asks, before ``save`` returns, while the copy thread is busy
    with another slot's job (a fetch). Larger ones, and small ones into a slot a fetch is
    still writing or a Redis put still reads, queue on the copy thread, so that the forward's
    thread never waits on them (a hung Redis). Either way the slots end up holding what the
    reference gather gives (block_copies.py says why)."""
    import threading
    import time

    from layouts import make_case

    from kvconnector import block_copies
    from kvconnector.background import CopyThread
    from kvconnector.kernels import reference
    from kvconnector.kernels.batched import PagedCopier
    from kvconnector.layout import describe_layers
    from kvconnector.metadata import ChunkTransfer

    kv = make_case("cpu-pages", num_blocks=12)
    layout = describe_layers({f"l{i}": t for i, t in enumerate(kv.layers)}, **kv.describe_kw)
    kbs = layout.kernel_block_size
    pool = SlotPool(3, (len(kv.layers), *layout.chunk_shape(2)), layout.dtype)
    ledger, copies, fetching = Ledger(), CopyThread(), threading.Event()
    store = WorkerStore(pool, [], b"f" * 16, 0, ledger)
    blocks = block_copies.BlockCopies(PagedCopier(kv.layers, layout), kv.layers, kbs, kbs,
                                      store, ledger, copies,
                                      (1 if case == "large" else 2) * pool.chunk_bytes)
    fetch_slot = 0 if case == "a fetch writes its slot" else 2
    if case == "a put reads its slot":
        store.begin_write(0)
        store.seal(0, h(9))
        assert pool.lease(0, store.key(h(9))) is not None
    copies.submit(lambda: fetching.wait(30), ["parked"], [fetch_slot])
    queued = case != "small"
    try:
        saving = threading.Thread(target=blocks.save, daemon=True, args=(
            [ChunkTransfer("r", 0, h(1), 0, [3, 4]), ChunkTransfer("r", 1, h(2), 1, [7, -1])],))
        saving.start()
        saving.join(10)  # a save that waited on the fetch or the lease would hang here
        assert not saving.is_alive(), "save waited for another user of its slots"
        assert copies.busy("r") is queued
        if queued:
            with pytest.raises(ChunkCorrupt):
                store.read(0, h(1))  # queued behind the fetch: not written yet
            fetching.set()
            if case == "a put reads its slot":
                time.sleep(0.2)
                assert copies.busy("r")  # waits for the put to end its lease
                pool.end_lease(0)
            deadline = time.monotonic() + 10
            while copies.busy("r"):
                assert time.monotonic() < deadline, "the queued save never ran"
                time.sleep(0.01)
        want = torch.zeros(2, *pool.chunk_shape, dtype=layout.dtype)
        reference.gather(kv.layers, layout, torch.tensor([[3, 4], [7, -1]]), want)
        assert torch.equal(store.read(0, h(1)), want[0])
        assert torch.equal(store.read(1, h(2)), want[1])  # the -1 block zeroed
        stats = ledger.take_stats()
        assert stats is not None and stats.data["saved_chunks"] == 2
    finally:
        fetching.set()
        assert copies.close(5.0)
