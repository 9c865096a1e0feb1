"""The put queue behind the disk and Redis tiers (store/tiering.py), and Redis's batches of
puts against a real redis-server."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from redis_server import RedisServer  # noqa: E402

from kvconnector.keys import ChunkKey  # noqa: E402
from kvconnector.placement import WritePlacement  # noqa: E402
from kvconnector.store import SlotPool  # noqa: E402
from kvconnector.store.redis_store import RedisStore  # noqa: E402
from kvconnector.store.tiering import PutQueue, RedisTier  # noqa: E402

KEY = ChunkKey(b"f" * 16, 0, b"h" * 16)


def test_flush_gives_up_on_a_stuck_copy_and_says_so():
    release, made = threading.Event(), []

    def put(chunks: list[tuple[int, ChunkKey, int]]) -> None:
        release.wait(10)
        made.extend(slot for slot, _, _ in chunks)

    q = PutQueue("test", put)
    key = ChunkKey(b"f" * 16, 0, b"h" * 16)
    q.offload(0, key)
    q.offload(1, key)
    assert q.flush(0.2) is False and q.queued == 2  # stuck: the caller hears of it
    release.set()
    assert q.flush(5) is True and made == [0, 1] and q.queued == 0
    assert q.flush(0) is True  # nothing queued: at once
    assert q.close(5)


def test_a_gated_put_waits_for_a_forward_pass_or_its_hold_limit():
    """Queued between forward passes, a put waits for the next to begin (the worker's
    ``write_gate``), and goes after ``hold_s`` if none does; queued during one,
    it goes at once."""
    made: list[tuple[int, float]] = []
    gate = threading.Event()
    q = PutQueue("test", lambda chunks: made.extend((s, time.monotonic()) for s, _, _ in chunks),
                 placement=WritePlacement(gate=gate, hold_s=5.0))
    q.offload(0, KEY)
    time.sleep(0.2)
    assert made == []  # no forward pass yet: held
    opened = time.monotonic()
    gate.set()
    assert q.flush(5) and [s for s, _ in made] == [0] and made[0][1] >= opened
    q.offload(1, KEY)  # the forward pass still runs: no wait
    assert q.flush(1) and [s for s, _ in made] == [0, 1]
    gate.clear()
    assert q.close(5)

    made.clear()
    q = PutQueue("test", lambda chunks: made.extend((s, time.monotonic()) for s, _, _ in chunks),
                 placement=WritePlacement(gate=threading.Event(), hold_s=0.3))
    queued = time.monotonic()
    q.offload(2, KEY)
    assert q.flush(5) and [s for s, _ in made] == [2]
    assert made[0][1] - queued >= 0.3  # no forward pass came: the hold limit let it go
    assert q.close(5)


def _until_taken(q: PutQueue) -> None:
    deadline = time.monotonic() + 5
    while q._queue.qsize():
        assert time.monotonic() < deadline, "the put thread took nothing"
        time.sleep(0.001)


def _blocked_queue(batch: int) -> tuple[PutQueue, threading.Event, list[list[int]]]:
    """A queue whose first put waits for ``release``: what is offloaded meanwhile queues."""
    release, batches = threading.Event(), []

    def put(chunks: list[tuple[int, ChunkKey, int]]) -> None:
        if not batches:
            release.wait(10)
        batches.append([slot for slot, _, _ in chunks])

    return PutQueue("test", put, batch=batch), release, batches


@pytest.mark.parametrize("batch, want", [(1, [[0], [1], [2], [3], [4]]),
                                         (3, [[0], [1, 2, 3], [4]]),
                                         (16, [[0], [1, 2, 3, 4]])])
def test_chunks_queued_together_are_put_together_up_to_the_batch(batch, want):
    q, release, batches = _blocked_queue(batch)
    q.offload(0, KEY)
    _until_taken(q)  # the thread took chunk 0 and waits in its put
    for slot in range(1, 5):
        q.offload(slot, KEY)
    release.set()
    assert q.flush(5) and q.queued == 0
    assert batches == want
    assert q.close(5)


def test_a_stopping_queue_drops_what_is_queued_behind_a_running_batch():
    q, release, batches = _blocked_queue(16)
    q.offload(0, KEY)
    _until_taken(q)
    q.offload(1, KEY)
    q.offload(2, KEY)
    closing = threading.Thread(target=lambda: q.close(0.2))
    closing.start()
    closing.join(5)  # gave up waiting for the stuck put, dropped 1 and 2
    assert q.dropped == 2
    release.set()
    for t in q._threads:
        t.join(5)
    assert batches == [[0]] and not any(t.is_alive() for t in q._threads)


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


def test_redis_puts_a_batch_in_one_pipeline_and_every_chunk_reads_back(server):
    """Four sealed slots queued behind a running put go to Redis in one pipeline; a slot
    reused before its turn is left out of it, and the others still arrive intact."""
    shape, slots = (2, 2, 16, 2, 8), 8
    redis = RedisStore.from_url(server.url, key_prefix="batch", timeout_s=2.0)
    pool = SlotPool(slots, shape, torch.float32)
    tier = RedisTier(redis, pool, "chunk")
    release, pipelines = threading.Event(), []
    put_many = redis.put_many

    def watched_put_many(items):
        if not pipelines:
            release.wait(10)
        pipelines.append(len(items))
        return put_many(items)

    redis.put_many = watched_put_many
    keys = [ChunkKey(b"f" * 16, 0, bytes([i]) * 16) for i in range(5)]
    gen = torch.Generator().manual_seed(1)
    for slot, key in enumerate(keys):
        pool.begin_write(slot).copy_(torch.randn(shape, generator=gen))
        pool.end_write(slot, key)
        tier.offload(slot, key)
        if slot == 0:
            _until_taken(tier._puts)
    pool.begin_write(3)  # slot 3 is written again before its put: no longer keys[3]
    release.set()
    assert tier.flush(10)
    assert pipelines == [1, 3]  # chunk 0, then 1, 2 and 4 together
    reader = SlotPool(slots, shape, torch.float32)
    got = RedisTier(redis, reader, "chunk").fetch([(i, k, 0) for i, k in enumerate(keys)])
    assert got == [True, True, True, False, True]
    for i in (0, 1, 2, 4):
        assert torch.equal(reader.read(i, keys[i]), pool.buffer[i])
    tier.close(5)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_the_redis_write_thread_runs_on_the_cores_it_is_given(server):
    """On the CPU build the worker hands it the cores vLLM left spare: its copies into
    socket buffers then stay off the forward pass's core."""
    core = max(os.sched_getaffinity(0))
    redis = RedisStore.from_url(server.url, key_prefix="cores", timeout_s=2.0)
    pool = SlotPool(2, (2, 2, 16, 2, 8), torch.float32)
    tier = RedisTier(redis, pool, "chunk", placement=WritePlacement({core}))
    try:
        (thread,) = tier._puts._threads
        assert os.sched_getaffinity(thread.native_id) == {core}
    finally:
        tier.close(5)
