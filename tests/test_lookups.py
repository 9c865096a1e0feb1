"""Redis lookups as the scheduler asks them (``kvconnector/lookups.py``), against a real
redis-server: on the lookup thread, or (a request alone in the engine) sent and read on the
asking thread when the reply comes within the wait, and handed to the thread when not."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from redis_server import LatencyProxy, RedisClusterServers, RedisServer, free_port  # noqa: E402

from kvconnector.keys import ChunkKey  # noqa: E402
from kvconnector.lookups import Lookups  # noqa: E402
from kvconnector.store.redis_store import RedisStore  # noqa: E402

FP = bytes.fromhex("00112233445566778899aabbccddeeff")
KEYS = [ChunkKey(FP, 0, i.to_bytes(16, "big")) for i in range(4)]


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_server(server):
    with server.client() as c:
        c.flushall()
        c.set(RedisStore.from_url(server.url).redis_key(KEYS[0]), b"v")
        c.set(RedisStore.from_url(server.url).redis_key(KEYS[1]), b"v")
    return server


class Interpret:
    """How many leading keys are held, and the thread that read the reply."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def __call__(self, found: list[bool]) -> int:
        self.threads.append(threading.current_thread().name)
        return next((i for i, ok in enumerate(found) if not ok), len(found))


def lookups_of(url: str, budget_s: float = 2.0) -> tuple[RedisStore, Lookups]:
    store = RedisStore.from_url(url, timeout_s=2.0)
    return store, Lookups(store, budget_s)


def test_a_lone_question_is_answered_in_the_call_that_asks_it(redis_server):
    store, lookups = lookups_of(redis_server.url)
    interpret = Interpret()
    try:
        assert store.exists_many(KEYS[:1], 1.0) == [True]  # a connection open to reuse
        before = store.snapshot()
        asked, answer = lookups.answer(None, "q", KEYS, interpret, 0, wait_s=1.0)
        assert answer == 2 and asked is not None and asked.answer.done()
        assert interpret.threads == [threading.current_thread().name]
        after = store.snapshot()
        assert (after["lookups"], after["lookup_hits"]) == (before["lookups"] + 1,
                                                            before["lookup_hits"] + 2)
        assert after["inline_lookups"] == before["inline_lookups"] + 1
        # the same question again is the answer at hand, not another round trip
        assert lookups.answer(asked, "q", KEYS, interpret, 0, wait_s=1.0) == (asked, 2)
        assert store.snapshot()["lookups"] == after["lookups"]
    finally:
        lookups.shutdown()
        store.close()


def test_without_the_wait_or_an_open_connection_the_lookup_thread_asks(redis_server):
    store, lookups = lookups_of(redis_server.url)
    interpret = Interpret()
    try:
        # no connection yet: connecting could wait, so the thread asks
        asked, _ = lookups.answer(None, "q1", KEYS, interpret, 0, wait_s=1.0)
        lookups.wait(5.0)
        assert lookups.answer(asked, "q1", KEYS, interpret, 0)[1] == 2
        asked, _ = lookups.answer(None, "q2", KEYS[1:], interpret, 0)  # no wait: the thread
        lookups.wait(5.0)
        assert lookups.answer(asked, "q2", KEYS[1:], interpret, 0)[1] == 1
        assert [t.startswith("kvconnector-lookup") for t in interpret.threads] == [True, True]
    finally:
        lookups.shutdown()
        store.close()


def test_a_frozen_redis_holds_the_asking_call_only_for_its_wait(redis_server):
    """The reply not there within the wait: the lookup thread reads it under the lookup's
    whole budget, and the short wait itself is no fault (no timeout, no backoff)."""
    store, lookups = lookups_of(redis_server.url, budget_s=5.0)
    interpret = Interpret()
    try:
        assert store.exists_many(KEYS[:1], 1.0) == [True]
        redis_server.freeze()
        try:
            start = time.monotonic()
            asked, answer = lookups.answer(None, "q", KEYS, interpret, 0, wait_s=0.02)
            held = time.monotonic() - start
            assert answer is None and asked is not None
            assert held < 0.5, f"the asking call waited {held:.3f} s for a frozen Redis"
            lookups.wait(0.05)
            assert not asked.answer.done()
        finally:
            redis_server.thaw()
        lookups.wait(5.0)
        assert lookups.answer(asked, "q", KEYS, interpret, 0)[1] == 2
        assert interpret.threads and interpret.threads[0].startswith("kvconnector-lookup")
        stats = store.snapshot()
        assert (stats["timeouts"], stats["backoffs"], stats["errors"]) == (0, 0, 0)
        assert stats["inline_lookups"] == 0 and stats["lookups"] == 2
    finally:
        lookups.shutdown()
        store.close()


def test_an_idle_step_waits_for_the_answers_asked_and_no_longer():
    """``wait``: until the last question is answered (a round trip of 50 ms here), and at
    most its timeout (a Redis that does not answer)."""
    with RedisServer() as srv, LatencyProxy(srv.port, 0.05) as proxy:
        store, lookups = lookups_of(proxy.url)
        interpret = Interpret()
        try:
            start = time.perf_counter()
            lookups.wait(1.0)  # nothing asked: no wait
            assert time.perf_counter() - start < 0.1
            asked, answer = lookups.answer(None, "q1", KEYS, interpret, 0)
            assert answer is None
            lookups.wait(5.0)  # returns when answered, not at the timeout
            assert asked is not None and asked.answer.done()
            assert lookups.answer(asked, "q1", KEYS, interpret, 0)[1] == 0
            srv.freeze()
            try:
                asked, _ = lookups.answer(None, "q2", KEYS, interpret, 0)
                start = time.perf_counter()
                lookups.wait(0.05)  # Redis does not answer: the timeout bounds the wait
                assert time.perf_counter() - start < 0.5 and not asked.answer.done()
            finally:
                srv.thaw()
        finally:
            lookups.shutdown()
            store.close()


def test_a_store_in_backoff_is_not_asked_inline_and_answers_a_miss():
    store, lookups = lookups_of(f"redis://127.0.0.1:{free_port()}")
    interpret = Interpret()
    try:
        assert store.exists_many(KEYS, 0.5) == [False] * 4  # refused: backoff
        assert store.in_backoff
        assert store.start_exists(KEYS, 1.0) is None
        asked, _ = lookups.answer(None, "q", KEYS, interpret, 7, wait_s=1.0)
        lookups.wait(5.0)
        assert lookups.answer(asked, "q", KEYS, interpret, 7)[1] == 0
        assert interpret.threads[0].startswith("kvconnector-lookup")
    finally:
        lookups.shutdown()
        store.close()


def test_a_cluster_is_not_asked_inline():
    """A cluster's call may have to learn its slots first (a round trip to wait for)."""
    with RedisClusterServers(3) as cluster:
        store = RedisStore.from_url(cluster.cluster_url, timeout_s=2.0)
        try:
            assert store.exists_many(KEYS, 2.0) == [False] * 4
            assert store.start_exists(KEYS, 1.0) is None
        finally:
            store.close()


def test_a_reply_stalled_midway_holds_the_asking_call_only_for_its_wait():
    """Redis sends the first byte of its replies and stalls: the asking call waits for the
    whole replies, not for their first bytes, and then only for its wait."""
    with RedisServer() as srv, LatencyProxy(srv.port, 0.0) as proxy:
        with srv.client() as c:
            c.set(RedisStore.from_url(srv.url).redis_key(KEYS[0]), b"v")
        store, lookups = lookups_of(proxy.url, budget_s=5.0)
        interpret = Interpret()
        try:
            assert store.exists_many(KEYS[:1], 2.0) == [True]  # a connection to reuse
            proxy.reply_stall_s = 0.5
            start = time.monotonic()
            asked, answer = lookups.answer(None, "q", KEYS, interpret, 0, wait_s=0.02)
            held = time.monotonic() - start
            assert answer is None and asked is not None
            assert held < 0.3, f"the asking call waited {held:.3f} s for a stalled reply"
            lookups.wait(5.0)
            assert lookups.answer(asked, "q", KEYS, interpret, 0)[1] == 1
            assert interpret.threads[0].startswith("kvconnector-lookup")
            stats = store.snapshot()
            assert (stats["timeouts"], stats["errors"], stats["inline_lookups"]) == (0, 0, 0)
        finally:
            lookups.shutdown()
            store.close()


def test_a_reply_handed_to_a_busy_lookup_thread_is_not_late_for_its_wait_there(redis_server):
    """The lookup thread is busy past the budget when a lone request's reply is handed to
    it: the reply, in time, is its answer, and no timeout is counted against Redis."""
    store, lookups = lookups_of(redis_server.url, budget_s=0.3)
    busy = threading.Event()

    def slow(found: list[bool]) -> int:
        busy.set()
        time.sleep(0.6)  # the thread busy twice the budget
        return len(found)

    interpret = Interpret()
    try:
        assert store.exists_many(KEYS[:1], 2.0) == [True]
        lookups.answer(None, "q1", KEYS[:1], slow, 0)
        assert busy.wait(5.0)  # q1's reply read, its connection free again
        redis_server.freeze()
        try:
            asked, answer = lookups.answer(None, "q2", KEYS, interpret, 0, wait_s=0.01)
            assert answer is None and asked is not None
            time.sleep(0.05)
        finally:
            redis_server.thaw()
        lookups.wait(5.0)
        assert lookups.answer(asked, "q2", KEYS, interpret, 0)[1] == 2
        stats = store.snapshot()
        assert (stats["timeouts"], stats["errors"]) == (0, 0), stats
    finally:
        lookups.shutdown()
        store.close()
