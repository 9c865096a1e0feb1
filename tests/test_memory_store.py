from __future__ import annotations

import random

import pytest
import torch

from kvconnector.keys import ChunkKey
from kvconnector.store import ChunkCorrupt, MemoryIndex, SlotPool
from kvconnector.store.codec import checksum


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_lookup_has_no_side_effects_and_counts_the_leading_run():
    idx = MemoryIndex(4)
    for i in (0, 1, 3):
        idx.allocate(h(i))
    assert idx.count_prefix([h(0), h(1), h(2), h(3)]) == 2
    assert idx.count_prefix([h(0), h(1), h(2), h(3)]) == 2
    assert idx.count_prefix([h(9)]) == 0


def test_lru_eviction_order_and_touch():
    idx = MemoryIndex(3)
    for i in range(3):
        idx.allocate(h(i))
    idx.touch(h(0))  # 1 is now the least recently used
    idx.unpin_all()
    idx.allocate(h(3))
    assert h(1) not in idx and all(h(i) in idx for i in (0, 2, 3))
    assert idx.evictions == 1


def test_pinned_slots_survive_and_a_full_pinned_pool_refuses():
    idx = MemoryIndex(2)
    idx.allocate(h(0))
    idx.allocate(h(1))
    idx.use(h(0))
    idx.use(h(1))
    assert idx.allocate(h(2)) is None
    idx.unpin_all()
    assert idx.allocate(h(2)) is not None


def test_one_plan_never_names_a_slot_twice():
    """Slots allocated since the last plan was built are pinned: with one or two slots, a
    step that saves many chunks gets as many slots as there are, then None (issue 19: all
    eleven chunks of one prompt were planned into slot 0)."""
    for num_slots in (1, 2, 3):
        idx = MemoryIndex(num_slots)
        for step in range(3):
            slots = [idx.allocate(h(step * 100 + i)) for i in range(11)]
            named = [s for s in slots if s is not None]
            assert len(named) == num_slots and len(set(named)) == num_slots
            assert slots[num_slots:] == [None] * (11 - num_slots)
            idx.unpin_all()


def test_held_slots_outlive_eviction_drop_and_reset():
    """A held slot is planned for nothing else until released, even once its chunk is
    dropped or the index is cleared (a cache reset while a blend waits on Redis)."""
    idx = MemoryIndex(2)
    a = idx.allocate(h(0))
    idx.hold(a)
    idx.unpin_all()
    idx.clear()
    assert h(0) not in idx
    b = idx.allocate(h(1))
    assert b != a and idx.allocate(h(2)) is None
    idx.unpin_all()
    assert idx.allocate(h(3)) not in (a, None)  # evicts h(1), never the held slot
    idx.unpin_all()
    idx.release(a)
    assert idx.allocate(h(4)) == a
    idx.unpin_all()
    c = idx.slot_of(h(4))
    idx.use(h(4))
    idx.drop(h(4))  # dropped while a plan still names it: not free before the plan is built
    assert idx.allocate(h(5)) != c
    idx.unpin_all()
    assert idx.allocate(h(6)) == c  # free again once that plan was built


def test_capacity_is_never_exceeded_under_churn():
    rng = random.Random(0)
    idx = MemoryIndex(16)
    live: dict[bytes, int] = {}
    named_this_step: list[int | None] = []
    for step in range(5000):
        k = h(rng.randrange(64))
        if k in idx:
            if rng.random() < 0.3:
                idx.drop(k)
            else:
                idx.use(k)
        else:
            slot = idx.allocate(k)
            if slot is None:
                assert idx.pinned == 16
                continue
            assert 0 <= slot < 16
            named_this_step.append(slot)
        if step % 7 == 0:
            idx.unpin_all()
            named_this_step = []
        assert len(set(named_this_step)) == len(named_this_step)  # one chunk per slot a plan
        assert len(idx) <= 16
        live = {key: idx.slot_of(key) for key in map(h, range(64)) if key in idx}
        assert len(set(live.values())) == len(live)  # no two chunks share a slot
    assert idx.evictions > 0


def test_empty_index_is_a_config_error():
    with pytest.raises(ValueError, match="memory_capacity"):
        MemoryIndex(0)


def _key(i: int) -> ChunkKey:
    return ChunkKey(b"f" * 16, 0, h(i))


def test_pool_round_trip_and_checks():
    pool = SlotPool(3, (2, 2, 8, 2, 4), torch.bfloat16)
    assert pool.chunk_bytes == 2 * 2 * 8 * 2 * 4 * 2
    assert pool.buffer.is_pinned() == torch.cuda.is_available()
    buf = pool.begin_write(1)
    buf.copy_(torch.randn(buf.shape).to(buf.dtype))
    pool.end_write(1, _key(5))
    assert torch.equal(pool.read(1, _key(5)), buf)
    assert pool.slot_holding(_key(5)) == 1
    with pytest.raises(ChunkCorrupt, match="does not hold"):
        pool.read(1, _key(6))
    with pytest.raises(ChunkCorrupt, match="does not hold"):
        pool.read(0, _key(5))
    with pytest.raises(ChunkCorrupt, match="no slot"):
        pool.read(-1, _key(5))
    pool.end_write(2, _key(6))
    pool.end_write(2, _key(7))  # the slot now holds another chunk
    with pytest.raises(ChunkCorrupt, match="does not hold"):
        pool.read(2, _key(6))


def test_memory_reads_check_the_key_not_the_bytes():
    """Slot bytes never leave the worker process, so neither a read nor the seal hashes
    them (a Redis put does, on its own thread, and its readers check it)."""
    pool = SlotPool(1, (64,), torch.float32)
    buf = pool.begin_write(0)
    buf.copy_(torch.arange(64.0))
    digest = checksum(buf.numpy())
    pool.end_write(0, _key(1), digest)
    assert pool.header(0).checksum == digest
    pool.end_write(0, _key(1))
    assert pool.header(0).checksum is None and pool.header(0).for_redis
    assert torch.equal(pool.read(0, _key(1)), torch.arange(64.0))
    pool.end_write(0, _key(1), for_redis=False)  # fetched from Redis: not sent back
    assert not pool.header(0).for_redis


def test_interrupted_write_is_never_readable():
    pool = SlotPool(1, (4,), torch.float32)
    pool.begin_write(0)
    pool.end_write(0, _key(1))
    pool.begin_write(0)  # a save that failed half-way never reaches end_write
    with pytest.raises(ChunkCorrupt):
        pool.read(0, _key(1))


def test_a_slot_is_not_rewritten_while_a_redis_put_reads_it():
    """The Redis put thread reads a sealed slot under a lease: a save or fetch into that
    slot waits for it, so a value never goes out with bytes other than those sealed."""
    import threading

    pool = SlotPool(1, (1024,), torch.float32)
    pool.begin_write(0).fill_(1.0)
    pool.end_write(0, _key(1))
    sealed = pool.header(0)
    assert pool.lease(0, _key(2)) is None  # another chunk's put: nothing to send
    assert pool.lease(0, _key(1)) is sealed
    writing = threading.Event()

    def rewrite() -> None:
        pool.begin_write(0).fill_(2.0)
        writing.set()

    writer = threading.Thread(target=rewrite)
    writer.start()
    assert not writing.wait(0.3)  # still leased: the write has not started
    assert torch.equal(pool.slot(0), torch.ones(1024))  # the bytes a put reads
    pool.end_lease(0)
    assert writing.wait(10)
    writer.join(10)
    assert pool.header(0) is None and pool.lease(0, _key(1)) is None
