"""The scheduler's mirror of this model's Redis keys (``store/redis_mirror.py``) against a real
redis-server: it follows every way a key comes and goes, stops answering whenever it may
have missed a change, and lookups then ask Redis again."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from redis_server import RedisServer  # noqa: E402

from kvconnector.keys import ChunkKey  # noqa: E402
from kvconnector.lookups import Lookups  # noqa: E402
from kvconnector.store.redis_mirror import RedisKeyMirror, missing_flags  # noqa: E402
from kvconnector.store.redis_store import RedisStore  # noqa: E402

FP = bytes.fromhex("00112233445566778899aabbccddeeff")
OTHER_FP = bytes.fromhex("ffeeddccbbaa99887766554433221100")


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_server(server):
    with server.client() as c:
        c.flushall()
        c.config_set("notify-keyspace-events", "")
    return server


@pytest.fixture
def store(redis_server):
    s = RedisStore.from_url(redis_server.url, timeout_s=2.0)
    yield s
    s.close()


def rkey(store: RedisStore, i: int, fp: bytes = FP) -> bytes:
    return store.redis_key(ChunkKey(fp, 0, i.to_bytes(16, "big")))


def eventually(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def mirror_of(store: RedisStore, **kw) -> RedisKeyMirror:
    m = RedisKeyMirror(store.mirror_client, store.key_space(FP), **kw)
    eventually(lambda: m.synced or m.given_up is not None)
    assert m.synced, m.given_up
    return m


def test_missing_flags():
    assert missing_flags("") == "E$gxe"
    assert missing_flags("AE") == ""
    assert missing_flags("KEA") == ""
    assert missing_flags("Ex") == "$ge"
    assert missing_flags("KA") == "E"


def test_it_starts_with_the_keys_there_and_follows_every_change(store, redis_server):
    c = redis_server.client()
    for i in range(5):
        c.set(rkey(store, i), b"v")
    c.set(rkey(store, 100, OTHER_FP), b"v")  # another model's key: not this mirror's
    c.set(b"unrelated", b"v")
    m = mirror_of(store)
    try:
        assert len(m) == 5
        assert "E" in c.config_get("notify-keyspace-events")["notify-keyspace-events"]
        assert m.answer([rkey(store, i) for i in range(6)]) == [True] * 5 + [False]
        c.set(rkey(store, 5), b"v")
        c.delete(rkey(store, 0))
        c.set(rkey(store, 6), b"v", px=50)  # expires
        c.rename(rkey(store, 1), rkey(store, 7))
        c.unlink(rkey(store, 2))
        eventually(lambda: m.answer([rkey(store, i) for i in range(8)])
                   == [False, False, False, True, True, True, False, True])
        assert m.answer([rkey(store, 100, OTHER_FP)]) == [False]
        m.forget([rkey(store, 3)])  # a fetch found it missing (a flush has no events)
        assert m.answer([rkey(store, 3)]) == [False]
    finally:
        m.close()


def test_evicted_keys_leave_the_mirror(store, redis_server):
    c = redis_server.client()
    m = mirror_of(store)
    try:
        c.config_set("maxmemory-policy", "allkeys-lru")
        c.config_set("maxmemory", "4mb")
        for i in range(200):
            c.set(rkey(store, i), b"x" * 100_000)
        held = set(c.keys(store.key_space(FP) + b"*"))
        assert len(held) < 200  # some were evicted
        eventually(lambda: len(m) == len(held)
                   and m.answer(sorted(held)) == [True] * len(held))
    finally:
        c.config_set("maxmemory", "0")
        m.close()


def test_without_leave_to_turn_notifications_on_it_gives_up(store, redis_server):
    m = RedisKeyMirror(store.mirror_client, store.key_space(FP), turn_on=False)
    try:
        eventually(lambda: m.given_up is not None)
        assert "lacks" in m.given_up
        assert m.answer([rkey(store, 0)]) is None
    finally:
        m.close()


def test_a_dropped_subscription_stops_answers_until_rebuilt(store, redis_server):
    c = redis_server.client()
    c.set(rkey(store, 0), b"v")
    m = mirror_of(store, retry_s=(0.2, 0.2))
    try:
        assert m.resyncs == 1
        c.client_kill_filter(_type="pubsub")
        c.set(rkey(store, 1), b"v")  # may be missed while unsubscribed: the rescan finds it
        eventually(lambda: m.resyncs == 2 and m.synced)
        assert m.answer([rkey(store, 0), rkey(store, 1)]) == [True, True]
    finally:
        m.close()


def test_notifications_turned_off_elsewhere_stop_answers(store, redis_server, monkeypatch):
    monkeypatch.setattr("kvconnector.store.redis_mirror.CHECK_EVERY_S", 0.1)
    c = redis_server.client()
    m = mirror_of(store, retry_s=(60.0, 60.0))
    try:
        c.config_set("notify-keyspace-events", "")
        eventually(lambda: not m.synced)
        assert m.answer([rkey(store, 0)]) is None
    finally:
        m.close()


def test_a_server_going_away_stops_answers():
    with RedisServer() as srv:
        s = RedisStore.from_url(srv.url, timeout_s=0.5)
        m = mirror_of(s, retry_s=(0.1, 0.1))
        try:
            srv.kill()
            eventually(lambda: not m.synced)
            assert m.answer([rkey(s, 0)]) is None
            srv.start()  # empty, notifications off: the mirror turns them on again
            srv.client().set(rkey(s, 3), b"v")
            eventually(lambda: m.synced and m.answer([rkey(s, 3)]) == [True], timeout=10)
        finally:
            m.close()
            s.close()


def test_too_many_keys_and_it_gives_up(store, redis_server):
    c = redis_server.client()
    for i in range(20):
        c.set(rkey(store, i), b"v")
    m = RedisKeyMirror(store.mirror_client, store.key_space(FP), max_keys=10)
    try:
        eventually(lambda: m.given_up is not None)
        assert "more than 10 keys" in m.given_up and m.answer([rkey(store, 0)]) is None
    finally:
        m.close()


def test_lookups_answer_from_the_mirror_at_once_and_ask_redis_without_it(store, redis_server):
    c = redis_server.client()
    keys = [ChunkKey(FP, 0, i.to_bytes(16, "big")) for i in range(3)]
    c.set(store.redis_key(keys[0]), b"v")
    c.set(store.redis_key(keys[1]), b"v")

    def leading(found: list[bool]) -> int:
        return next((i for i, ok in enumerate(found) if not ok), len(found))

    m = mirror_of(store)
    lookups = Lookups(store, 1.0, m)
    try:
        asked, answer = lookups.answer(None, "q", keys, leading, 0)
        assert (asked, answer) == (None, 2)  # no question left pending: answered now
        before = store.snapshot()
        lookups.forget([keys[1]])
        assert lookups.answer(None, "q", keys, leading, 0)[1] == 1
        after = store.snapshot()
        assert after["lookups"] == before["lookups"] + 1  # counted as a lookup
        assert after["mirror_lookups"] == before["mirror_lookups"] + 1
        m.synced = False  # out of sync: Redis is asked, on the lookup thread
        asked, answer = lookups.answer(None, "q", keys, leading, 0)
        assert asked is not None
        lookups.wait(2.0)
        assert lookups.answer(asked, "q", keys, leading, 0)[1] == 2
        assert store.snapshot()["mirror_lookups"] == after["mirror_lookups"]
    finally:
        lookups.shutdown()
