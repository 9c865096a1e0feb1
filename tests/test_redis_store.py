"""RedisStore and its codec against real redis-server processes (see tests/redis_server.py)."""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import time
import zlib
from pathlib import Path

import msgpack
import pytest
import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from redis_server import LatencyProxy, RedisClusterServers, RedisServer, free_port  # noqa: E402

from kvconnector.keys import ChunkKey  # noqa: E402
from kvconnector.store import codec  # noqa: E402
from kvconnector.store.codec import CorruptValue, ExpectedChunk  # noqa: E402
from kvconnector.store.memory import SlotPool  # noqa: E402
from kvconnector.store.redis_store import RedisStore  # noqa: E402
from kvconnector.store.redis_url import redact_url  # noqa: E402

FP = bytes.fromhex("00112233445566778899aabbccddeeff")
OTHER_FP = bytes.fromhex("ffeeddccbbaa99887766554433221100")


# ---- fixtures and helpers -------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_server(server):
    """The module's server, emptied and with fresh command stats."""
    with server.client() as c:
        c.flushall()
        c.config_resetstat()
    return server


@pytest.fixture
def store(redis_server):
    s = RedisStore.from_url(redis_server.url, timeout_s=2.0)
    yield s
    s.close()


def chunk_key(i: int, fp: bytes = FP, rank: int = 0) -> str:
    return str(ChunkKey(fp, rank, i.to_bytes(16, "big")))


def make_chunk(i: int, nbytes: int, *, fp: bytes = FP, seed: int | None = None):
    """(ExpectedChunk, payload bytes) for a chunk of ``nbytes`` random bytes."""
    payload = os.urandom(nbytes) if seed is None else \
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    exp = ExpectedChunk(chunk_key(i, fp), "chunk", "bfloat16", (2, nbytes // 4, 1, 1),
                        nbytes)
    return exp, payload


def item(exp: ExpectedChunk, payload) -> tuple[str, bytes, memoryview]:
    return exp.key, codec.encode_header(exp, payload), memoryview(payload)


def header_dict(exp: ExpectedChunk, payload: bytes) -> dict:
    return {"v": codec.FORMAT_VERSION, "key": exp.key, "layout": exp.layout,
            "dtype": exp.dtype, "shape": list(exp.shape), "nbytes": exp.nbytes,
            "xxh3": codec.checksum(payload)}


def raw_value(header: dict | bytes, payload: bytes, magic: bytes = codec.MAGIC,
              header_len: int | None = None) -> bytes:
    hb = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    n = len(hb) if header_len is None else header_len
    return magic + struct.pack("<I", n) + hb + payload


# ---- codec ----------------------------------------------------------------------------

def _variant(name: str, exp: ExpectedChunk, payload: bytes) -> bytes:
    good = header_dict(exp, payload)
    if name == "too_short":
        return b"KVC"
    if name == "bad_magic":
        return raw_value(good, payload, magic=b"PKL4")
    if name == "header_too_long":
        return raw_value(good, payload, header_len=codec.MAX_HEADER_LEN + 1)
    if name == "truncated_header":
        return raw_value(good, b"", header_len=4000)[:100]
    if name == "header_unpack":
        return raw_value(b"\xc1" * 16, payload)
    if name == "header_huge_str":
        return raw_value(dict(good, layout="x" * (codec.MAX_STR_LEN + 1)), payload)
    if name == "header_not_map":
        return raw_value([1, 2, 3], payload)
    if name == "missing_field":
        return raw_value({k: v for k, v in good.items() if k != "xxh3"}, payload)
    if name == "extra_field":
        return raw_value(dict(good, pickle="cos\nsystem\n"), payload)
    if name == "ill_typed":
        return raw_value(dict(good, nbytes=str(exp.nbytes)), payload)
    if name == "bool_as_int":
        return raw_value(dict(good, v=True), payload)
    if name == "version":
        return raw_value(dict(good, v=codec.FORMAT_VERSION + 1), payload)
    if name == "crc32_format":  # as format version 1 wrote it
        old = {k: v for k, v in good.items() if k != "xxh3"}
        return raw_value(dict(old, v=1, crc32=zlib.crc32(payload)), payload)
    if name == "other_fingerprint":
        return raw_value(dict(good, key=exp.key.replace(FP.hex(), OTHER_FP.hex())), payload)
    if name == "layout":
        return raw_value(dict(good, layout="mla"), payload)
    if name == "dtype":
        return raw_value(dict(good, dtype="float16"), payload)
    if name == "shape":
        return raw_value(dict(good, shape=[exp.shape[0] * 2, *exp.shape[1:]]), payload)
    if name == "nbytes":
        return raw_value(dict(good, nbytes=exp.nbytes + 1), payload)
    if name == "truncated":
        return raw_value(good, payload)[:-10]
    if name == "too_large":
        return raw_value(good, payload) + b"\0" * 10
    if name == "corrupt_byte":
        value = bytearray(raw_value(good, payload))
        value[-100] ^= 0x40
        return bytes(value)
    raise AssertionError(name)


VARIANTS = {  # variant -> reason
    "too_short": "too_short", "bad_magic": "bad_magic", "header_too_long": "header_too_long",
    "truncated_header": "truncated", "header_unpack": "header_unpack",
    "header_huge_str": "header_unpack", "header_not_map": "header_fields",
    "missing_field": "header_fields", "extra_field": "header_fields",
    "ill_typed": "header_fields", "bool_as_int": "header_fields", "version": "version",
    "crc32_format": "version",
    "other_fingerprint": "key", "layout": "layout", "dtype": "dtype", "shape": "shape",
    "nbytes": "nbytes", "truncated": "truncated", "too_large": "too_large",
    "corrupt_byte": "checksum",
}


def test_codec_round_trip_and_layout():
    exp, payload = make_chunk(1, 4096)
    header = codec.encode_header(exp, payload)
    magic, hlen = struct.unpack_from("<4sI", header)
    assert magic == b"KVC1" and hlen == len(header) - 8
    fields = msgpack.unpackb(header[8:])
    assert fields == header_dict(exp, payload)
    value = header + payload
    view = codec.parse(value, exp)
    assert isinstance(view, memoryview) and view.obj is value  # a view, not a copy
    assert bytes(view) == payload
    assert codec.encode(exp, payload) == value
    assert codec.parse(memoryview(bytearray(value)), exp).tobytes() == payload


def test_codec_checksum_matches_memory_tier():
    t = torch.randn(2, 16, 4, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    raw = t.view(torch.uint8).reshape(-1).numpy()
    assert codec.checksum(raw) == codec.checksum(bytes(raw)) == codec.checksum(memoryview(raw))
    pool = SlotPool(1, tuple(t.shape), torch.bfloat16)
    pool.begin_write(0).copy_(t)
    sealed = codec.checksum(pool.slot_bytes(0))  # what a put of the slot hashes
    assert sealed == codec.checksum(raw) and sealed > 0xFFFFFFFF  # all 64 bits are kept
    exp = ExpectedChunk(chunk_key(3), "chunk", "bfloat16", tuple(t.shape), raw.nbytes)
    # a known checksum (the memory tier's) avoids reading the payload again
    assert codec.encode_header(exp, xxh3=sealed) == codec.encode_header(exp, raw)
    with pytest.raises(ValueError):
        codec.encode_header(exp, raw[:-1])
    with pytest.raises(ValueError):
        codec.encode_header(exp)


def test_codec_checksum_catches_every_single_bit_flip_of_a_value():
    """XXH3-64 does not promise this as a CRC does (any change escapes with a probability
    of about 2**-64); every single-bit flip of one 64 KiB payload is checked anyway, and all
    give distinct checksums."""
    buf = bytearray(make_chunk(1, 64 * 1024, seed=1)[1])
    seen = {codec.checksum(buf)}
    for i in range(len(buf)):
        for bit in range(8):
            buf[i] ^= 1 << bit
            seen.add(codec.checksum(buf))
            buf[i] ^= 1 << bit
    assert len(seen) == 1 + 8 * len(buf)


@pytest.mark.parametrize("digest", [0, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 0xFFFFFFFF,
                                    0x100000000, 2**63, 2**64 - 1])
@pytest.mark.parametrize("signed", [False, True])
def test_codec_header_short_cut_agrees_with_the_full_check(digest, signed):
    """Headers as encode_header writes them are checked by comparing bytes; the result must
    be what unpacking gives, and any other chunk's header must not pass."""
    exp, payload = make_chunk(5, 4096)
    header = codec.encode_header(exp, payload, mac_key=b"m" * 32) if signed else \
        codec.encode_header(exp, xxh3=digest)
    fields = msgpack.unpackb(header[codec.PREFIX_LEN:])
    assert codec._fast_header(header[codec.PREFIX_LEN:], exp) == fields
    assert codec.check_header(header[codec.PREFIX_LEN:], exp) == fields
    other, _ = make_chunk(6, 4096)
    assert codec._fast_header(header[codec.PREFIX_LEN:], other) is None
    with pytest.raises(CorruptValue, match="key"):
        codec.check_header(header[codec.PREFIX_LEN:], other)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_codec_rejects(variant):
    exp, payload = make_chunk(7, 4096, seed=7)
    with pytest.raises(CorruptValue) as info:
        codec.parse(_variant(variant, exp, payload), exp)
    assert info.value.reason == VARIANTS[variant]
    assert info.value.reason in codec.REASONS


def test_codec_checks_in_order():
    exp, payload = make_chunk(7, 4096, seed=7)
    good = header_dict(exp, payload)
    # bad magic wins over a too-long header and a truncated payload
    bad = raw_value(good, payload, magic=b"XXXX", header_len=1 << 30)[:-5]
    with pytest.raises(CorruptValue, match="bad_magic"):
        codec.parse(bad, exp)
    # the header limit is checked before anything is unpacked
    bad = raw_value(b"\xc1", payload, header_len=codec.MAX_HEADER_LEN + 1)
    with pytest.raises(CorruptValue, match="header_too_long"):
        codec.parse(bad, exp)
    # version before key before shape before payload length
    bad = raw_value(dict(good, v=9, key="x", shape=[1]), payload[:-1])
    with pytest.raises(CorruptValue, match="version"):
        codec.parse(bad, exp)
    bad = raw_value(dict(good, key="x", shape=[1]), payload[:-1])
    with pytest.raises(CorruptValue, match="key"):
        codec.parse(bad, exp)
    bad = raw_value(dict(good, shape=[1]), payload[:-1])
    with pytest.raises(CorruptValue, match="shape"):
        codec.parse(bad, exp)


# ---- round trips ----------------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [4, 4096, 16 * 1024 + 4, 64 * 1024, 2 * 2**20])
def test_round_trip(store, redis_server, nbytes):
    chunks = [make_chunk(i, nbytes) for i in range(3)]
    assert store.put_many([item(e, p) for e, p in chunks]) == 3
    got = store.get_many([e.key for e, _ in chunks], [e for e, _ in chunks])
    assert [bytes(g) for g in got] == [p for _, p in chunks]
    s = store.snapshot()
    assert (s["puts"], s["gets"], s["hits"], s["misses"]) == (3, 3, 3, 0)
    assert s["put_bytes"] == s["get_bytes"] == 3 * nbytes
    assert redis_server.command_calls("set") == 3 and redis_server.command_calls("get") == 3


def test_round_trip_tensors_into_out_buffers(store):
    src = torch.randn(4, 2, 32, 2, 16).to(torch.bfloat16)  # 4 chunks of [2, 32, 2, 16]
    exps, items = [], []
    for i in range(4):
        raw = src[i].view(torch.uint8).reshape(-1).numpy()
        exp = ExpectedChunk(chunk_key(i), "chunk", "bfloat16", tuple(src[i].shape), raw.nbytes)
        exps.append(exp)
        items.append((exp.key, codec.encode_header(exp, xxh3=codec.checksum(raw)),
                      memoryview(raw)))
    assert store.put_many(items) == 4
    dst = torch.zeros_like(src)
    outs = [memoryview(dst[i].view(torch.uint8).reshape(-1).numpy()) for i in range(4)]
    got = store.get_many([e.key for e in exps], exps, out=outs)
    assert all(g is not None for g in got)
    assert torch.equal(dst, src)  # payloads landed directly in the destination tensor
    with pytest.raises(ValueError):
        store.get_many([exps[0].key], [exps[0]], out=[bytearray(10)])


# GET writes for five values: about 256 KiB unanswered, at least two values, at most 2 MiB.
@pytest.mark.parametrize("nbytes, sends", [(16 * 1024, 1), (64 * 1024, 2), (128 * 1024, 4),
                                           (1536 * 1024, 5)])
def test_values_are_asked_for_a_few_at_a_time(store, redis_server, monkeypatch,
                                              nbytes, sends):
    """redis-server builds a whole pipeline's replies before it writes the first: GETs go
    out as replies come in, so that the client reads a value while the server builds the
    next. A miss and a corrupt value among them keep the connection in sync."""
    from kvconnector.store import redis_wire

    chunks = [make_chunk(i, nbytes, seed=i) for i in range(5)]
    store.put_many([item(*chunks[i]) for i in (0, 2, 4)])
    bad_exp, bad_payload = chunks[3]
    redis_server.client().set(store.redis_key(bad_exp.key),
                              _variant("corrupt_byte", bad_exp, bad_payload))
    send = redis_wire.Wire.send
    calls = []
    monkeypatch.setattr(redis_wire.Wire, "send",
                        lambda self, bufs: (calls.append(len(bufs)), send(self, bufs))[1])
    got = store.get_many([e.key for e, _ in chunks], [e for e, _ in chunks])
    assert [None if g is None else bytes(g) for g in got] == [
        chunks[0][1], None, chunks[2][1], None, chunks[4][1]]
    assert len(calls) == sends + 1  # and the DEL of the corrupt value
    s = store.snapshot()
    assert s["hits"] == 3 and s["corrupt"] == 1 and s["errors"] == 0


def test_missing_keys_are_misses(store):
    exp, payload = make_chunk(1, 1024)
    store.put_many([item(exp, payload)])
    other, _ = make_chunk(2, 1024)
    assert [g is None for g in store.get_many([exp.key, other.key], [exp, other])] == [
        False, True]
    s = store.snapshot()
    assert s["hits"] == 1 and s["misses"] == 1 and s["errors"] == 0


def test_exists_prefix(store, redis_server):
    chunks = [make_chunk(i, 256) for i in range(6)]
    stored = [0, 1, 2, 4, 5]
    store.put_many([item(*chunks[i]) for i in stored])
    keys = [e.key for e, _ in chunks]
    assert store.exists_prefix(keys, 1.0) == 3
    assert store.exists_prefix(keys[:2], 1.0) == 2
    assert store.exists_prefix(keys[3:], 1.0) == 0
    assert store.exists_prefix(keys[4:], 1.0) == 2
    assert store.exists_prefix([], 1.0) == 0
    # one EXISTS per key, all sent in one pipeline (no MULTI, no per-key round trips)
    assert redis_server.command_calls("exists") == 6 + 2 + 3 + 2
    s = store.snapshot()
    assert s["lookups"] == 4 and s["lookup_hits"] == 3 + 2 + 0 + 2


def test_exists_prefix_is_one_round_trip(redis_server):
    rtt = 0.25  # two round trips would take 0.5 s, the 20 one per key 5 s
    with LatencyProxy(redis_server.port, delay_s=rtt) as proxy:
        store = RedisStore.from_url(proxy.url)
        try:
            chunks = [make_chunk(i, 64) for i in range(20)]
            store.put_many([item(e, p) for e, p in chunks])
            keys = [e.key for e, _ in chunks]
            store.exists_prefix(keys, 2.0)  # connection made
            t0 = time.monotonic()
            assert store.exists_prefix(keys, 2.0) == 20
            elapsed = time.monotonic() - t0
            assert rtt <= elapsed < 2 * rtt, elapsed
            t0 = time.monotonic()
            got = store.get_many(keys, [e for e, _ in chunks])
            assert all(g is not None for g in got)
            assert time.monotonic() - t0 < 2 * rtt
            # a budget below one round trip: a miss, on time
            t0 = time.monotonic()
            assert store.exists_prefix(keys, 0.05) == 0
            assert time.monotonic() - t0 < rtt
            assert store.snapshot()["timeouts"] == 1
        finally:
            store.close()


def test_ttl(redis_server):
    exp, payload = make_chunk(1, 100)
    c = redis_server.client()
    with RedisStore.from_url(redis_server.url, ttl_s=100) as s:
        s.put_many([item(exp, payload)])
        assert 90 <= c.ttl(s.redis_key(exp.key)) <= 100
    with RedisStore.from_url(redis_server.url, ttl_s=1.5, key_prefix="px") as s:
        s.put_many([item(exp, payload)])
        assert 0 < c.pttl(s.redis_key(exp.key)) <= 1500
    with RedisStore.from_url(redis_server.url, key_prefix="none") as s:
        s.put_many([item(exp, payload)])
        assert c.ttl(s.redis_key(exp.key)) == -1
    with pytest.raises(ValueError):
        RedisStore.from_url(redis_server.url, ttl_s=0)


def test_key_prefix_isolation(redis_server):
    exp, payload = make_chunk(1, 100)
    a = RedisStore.from_url(redis_server.url, key_prefix="deploy-a")
    b = RedisStore.from_url(redis_server.url, key_prefix="deploy-b")
    try:
        assert a.put_many([item(exp, payload)]) == 1
        assert a.exists_prefix([exp.key], 1.0) == 1
        assert b.exists_prefix([exp.key], 1.0) == 0
        assert b.get_many([exp.key], [exp]) == [None]
        keys = redis_server.client().keys("*")
        assert keys == [f"deploy-a:{exp.key}".encode()]
    finally:
        a.close()
        b.close()


def test_concurrent_threads(store):
    errors = []

    def work(t: int) -> None:
        try:
            for j in range(10):
                exp, payload = make_chunk(t * 100 + j, 8192 + t)
                assert store.put_many([item(exp, payload)]) == 1
                assert bytes(store.get_many([exp.key], [exp])[0]) == payload
                assert store.exists_prefix([exp.key], 1.0) == 1
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.snapshot()["hits"] == 60


# ---- corrupt values -------------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_corrupt_value_detected_counted_deleted(store, redis_server, variant):
    exp, payload = make_chunk(9, 64 * 1024, seed=9)
    good_exp, good_payload = make_chunk(10, 4096)
    store.put_many([item(good_exp, good_payload)])
    c = redis_server.client()
    c.set(store.redis_key(exp.key), _variant(variant, exp, payload))
    got = store.get_many([exp.key, good_exp.key], [exp, good_exp])
    assert got[0] is None
    assert bytes(got[1]) == good_payload  # the connection stayed in sync after the bad one
    s = store.snapshot()
    assert s["corrupt"] == 1 and s["corrupt_deleted"] == 1
    assert s["corrupt_reasons"] == {VARIANTS[variant]: 1}
    assert s["misses"] == 1 and s["hits"] == 1 and s["errors"] == 0
    assert c.exists(store.redis_key(exp.key)) == 0
    assert c.exists(store.redis_key(good_exp.key)) == 1


def test_huge_foreign_value_is_drained_not_kept(store, redis_server):
    exp, payload = make_chunk(9, 4096)
    c = redis_server.client()
    c.set(store.redis_key(exp.key), raw_value(header_dict(exp, payload), b"x" * (8 << 20)))
    other, other_payload = make_chunk(11, 4096)
    store.put_many([item(other, other_payload)])
    got = store.get_many([exp.key, other.key], [exp, other])
    assert got[0] is None and bytes(got[1]) == other_payload
    assert store.snapshot()["corrupt_reasons"] == {"too_large": 1}


def test_wrong_type_is_a_miss_not_an_exception(store, redis_server):
    exp, _ = make_chunk(1, 64)
    redis_server.client().rpush(store.redis_key(exp.key), b"x")
    assert store.get_many([exp.key], [exp]) == [None]
    s = store.snapshot()
    assert s["errors"] == 1 and s["misses"] == 1 and not store.in_backoff


# ---- authenticated values -------------------------------------------------------------

MAC_KEY = codec.mac_key(b"a-shared-secret-of-32-characters")


def test_codec_mac_round_trip_and_forgery():
    exp, payload = make_chunk(5, 4096, seed=5)
    value = codec.encode(exp, payload, mac_key=MAC_KEY)
    assert bytes(codec.parse(value, exp, mac_key=MAC_KEY)) == payload
    assert bytes(codec.parse(value, exp)) == payload  # readers without a key check the checksum
    # What anyone with write access can make: right key and checksum, no (or a wrong) MAC.
    forged = [codec.encode(exp, payload),
              codec.encode(exp, payload, mac_key=codec.mac_key(b"another-secret-16b")),
              value[:-1] + bytes([value[-1] ^ 1])]
    for bad in forged:
        with pytest.raises(CorruptValue) as info:
            codec.parse(bad, exp, mac_key=MAC_KEY)
        assert info.value.reason == "mac"
    # The MAC covers the header too: another chunk's signed value is refused by key first,
    # and a header edited to claim this key no longer matches its MAC.
    other, other_payload = make_chunk(6, 4096, seed=6)
    signed_other = codec.encode(other, other_payload, mac_key=MAC_KEY)
    with pytest.raises(CorruptValue, match="key"):
        codec.parse(signed_other, exp, mac_key=MAC_KEY)
    fields = msgpack.unpackb(signed_other[8:codec.PREFIX_LEN + struct.unpack_from(
        "<4sI", signed_other)[1]])
    fields.update(key=exp.key, xxh3=codec.checksum(other_payload))
    with pytest.raises(CorruptValue, match="mac"):
        codec.parse(raw_value(fields, other_payload), exp, mac_key=MAC_KEY)
    with pytest.raises(ValueError, match="at least 16"):
        codec.mac_key(b"short")


def test_store_with_mac_key_loads_only_signed_values(redis_server):
    exp, payload = make_chunk(1, 64 * 1024, seed=1)
    forged_exp, forged_payload = make_chunk(2, 64 * 1024, seed=2)
    with RedisStore.from_url(redis_server.url, mac_key=MAC_KEY) as s:
        prefix = codec.encode_header(exp, payload, mac_key=MAC_KEY)
        assert s.put_many([(exp.key, prefix, payload)]) == 1
        redis_server.client().set(s.redis_key(forged_exp.key),
                                  codec.encode(forged_exp, forged_payload))
        got = s.get_many([exp.key, forged_exp.key], [exp, forged_exp])
        assert bytes(got[0]) == payload and got[1] is None
        assert s.snapshot()["corrupt_reasons"] == {"mac": 1}


def test_store_with_mac_key_signs_the_descriptors_it_writes(redis_server):
    """Issue 21: descriptors went out unsigned, so a reader with the MAC key could not tell
    an engine's from a forged one. The tier hands them to put_many as (key, b"", value)."""
    from kvconnector.keys import Fingerprint
    from kvconnector.store import descriptor

    fingerprint = Fingerprint("m", "", "d", "float32", "chunk", 16, 2, 2, 32, 1, 256, "ns")
    exp, _ = make_chunk(1, 4096)
    dkey = descriptor.descriptor_key(fingerprint.digest().hex())
    c = redis_server.client()
    with RedisStore.from_url(redis_server.url, mac_key=MAC_KEY) as s:
        assert s.put_many([(dkey, b"", descriptor.encode(fingerprint, exp))]) == 1
        value = c.get(s.redis_key(dkey))
        d = descriptor.decode(value, mac_key=MAC_KEY)
        assert d.signed and d.shape == exp.shape and d.matches(fingerprint.digest().hex())
        assert descriptor.decode(value).nbytes == exp.nbytes  # readers without a key
        with pytest.raises(ValueError, match="MAC"):
            descriptor.decode(value, mac_key=codec.mac_key(b"not-the-engines-key"))
        # one the tier signed itself goes out as it is
        signed = descriptor.encode(fingerprint, exp, mac_key=MAC_KEY)
        assert s.put_many([(dkey, b"", signed)]) == 1 and c.get(s.redis_key(dkey)) == signed
    with RedisStore.from_url(redis_server.url) as s:  # no key: written as given
        plain = descriptor.encode(fingerprint, exp)
        assert s.put_many([(dkey, b"", plain)]) == 1 and c.get(s.redis_key(dkey)) == plain


@pytest.mark.parametrize("bad_mac", ["é" * 64, "z" * 64, 12345, ["a", "b"]],
                         ids=["non_ascii", "non_hex", "int", "list"])
@pytest.mark.parametrize("keyed", [True, False], ids=["with_key", "without_key"])
def test_malformed_mac_field_is_a_deleted_miss_not_a_backoff(redis_server, bad_mac, keyed):
    """Issue 21: a mac of non-ASCII text passed the header checks and made
    hmac.compare_digest raise, which the store took for a connection fault (backoff on
    every fetch, the value never deleted)."""
    exp, payload = make_chunk(1, 64 * 1024, seed=1)
    good_exp, good_payload = make_chunk(2, 4096, seed=2)
    fields = dict(header_dict(exp, payload), mac=bad_mac)
    with RedisStore.from_url(redis_server.url, mac_key=MAC_KEY if keyed else None,
                             backoff_initial_s=30.0) as s:
        c = redis_server.client()
        c.set(s.redis_key(exp.key), raw_value(fields, payload))
        assert s.put_many([(good_exp.key, codec.encode_header(good_exp, good_payload,
                                                              mac_key=MAC_KEY),
                            good_payload)]) == 1
        for _ in range(2):
            got = s.get_many([exp.key, good_exp.key], [exp, good_exp])
            assert got[0] is None and bytes(got[1]) == good_payload
        snap = s.snapshot()
        assert not snap["in_backoff"] and snap["backoffs"] == 0 and snap["errors"] == 0
        assert snap["corrupt"] == 1 and snap["corrupt_deleted"] == 1
        assert snap["corrupt_reasons"] == {"header_fields": 1}
        assert snap["hits"] == 2 and snap["misses"] == 2
        assert c.exists(s.redis_key(exp.key)) == 0


# ---- URLs and logs --------------------------------------------------------------------

def test_url_password_db_and_unix_socket():
    with RedisServer(password="s3cret-pw", unixsocket=True) as srv:
        exp, payload = make_chunk(1, 1000)
        url = f"redis://:s3cret-pw@127.0.0.1:{srv.port}/3"
        with RedisStore.from_url(url) as s:
            assert s.put_many([item(exp, payload)]) == 1
            assert bytes(s.get_many([exp.key], [exp])[0]) == payload
        assert srv.client(db=3).exists(f"kvc:{exp.key}") == 1
        assert srv.client(db=0).dbsize() == 0
        unix = f"unix://{srv.unix_path}?db=2&password=s3cret-pw"
        with RedisStore.from_url(unix, key_prefix="u") as s:
            assert s._connections.pool.connection_class is redis.UnixDomainSocketConnection
            assert s.put_many([item(exp, payload)]) == 1
            assert s.exists_prefix([exp.key], 1.0) == 1
        assert srv.client(db=2).exists(f"u:{exp.key}") == 1
        # a wrong password costs misses, not exceptions
        with RedisStore.from_url(f"redis://:nope@127.0.0.1:{srv.port}") as s:
            assert s.put_many([item(exp, payload)]) == 0
            assert s.get_many([exp.key], [exp]) == [None]
            assert s.snapshot()["errors"] == 1 and s.in_backoff


def test_url_schemes():
    s = RedisStore.from_url("rediss://:pw@127.0.0.1:1/0")
    assert s._connections.pool.connection_class is redis.SSLConnection
    assert s._connections.pool.connection_kwargs["password"] == "pw"
    s.close()
    s = RedisStore.from_url("redis+cluster://127.0.0.1:1")
    assert s.cluster and s.url == "redis://127.0.0.1:1"
    s.close()
    for bad in ("http://127.0.0.1", "127.0.0.1:6379", "unix+cluster:///tmp/x"):
        with pytest.raises(ValueError):
            RedisStore.from_url(bad)
    with pytest.raises(ValueError):
        RedisStore.from_url("unix:///tmp/x.sock", cluster=True)


@pytest.mark.parametrize("url, expected", [
    # the userinfo goes as a whole (tests/test_redaction.py has the hostile cases)
    ("redis://:hunter2@host:6379/1", "redis://***@host:6379/1"),
    ("redis://user:hunter2@host:6379", "redis://***@host:6379"),
    ("rediss://user:p%40ss@host", "rediss://***@host"),
    ("redis://user@host:6379", "redis://***@host:6379"),  # may be a password
    ("redis://host:6379/0", "redis://host:6379/0"),
    ("unix:///run/redis.sock?db=2&password=hunter2", "unix:///run/redis.sock?db=2&password=***"),
    ("redis+cluster://:hunter2@h1:7000", "redis+cluster://***@h1:7000"),
    ("redis://:hun/ter#2@host:6379", "redis://***@host:6379"),
    ("redis://:hun@ter2@host:6379", "redis://***@host:6379"),
    ("redis://u:hunter2@host/0?password=hunter2&x=1", "redis://***@host/0?password=***&x=1"),
])
def test_redact_url(url, expected):
    assert redact_url(url) == expected
    assert "hunter2" not in redact_url(url) and "ter2" not in redact_url(url)


def test_passwords_never_logged(caplog):
    port = free_port()  # nothing listens there
    caplog.set_level(logging.DEBUG, logger="kvconnector.store.redis")
    exp, payload = make_chunk(1, 100)
    for url in (f"redis://admin:hunter2-secret@127.0.0.1:{port}/0",
                "unix:///nonexistent/redis.sock?password=hunter2-secret"):
        with RedisStore.from_url(url, backoff_initial_s=0.01) as s:
            assert s.put_many([item(exp, payload)]) == 0
            assert s.exists_prefix([exp.key], 0.5) == 0
            time.sleep(0.02)
            assert s.get_many([exp.key], [exp]) == [None]
            assert "hunter2" not in repr(s)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "***" in text and "failed" in text
    assert "hunter2" not in text



def test_password_from_the_environment_and_a_warning_for_one_in_the_url(
        redis_server, monkeypatch, caplog):
    from kvconnector.config import ConnectorConfig
    from kvconnector.store import open_redis

    exp, payload = make_chunk(1, 100)
    with RedisServer(password="hunter2-secret") as srv:
        monkeypatch.setenv("KVC_TEST_REDIS_PW", "hunter2-secret")
        cfg = ConnectorConfig.from_extra_config(
            {"redis_url": f"redis://127.0.0.1:{srv.port}",
             "redis_password_env": "KVC_TEST_REDIS_PW"})
        with open_redis(cfg, for_lookups=True) as s:
            assert s.put_many([item(exp, payload)]) == 1
        assert "redis_url carries a password" not in caplog.text
        cfg = ConnectorConfig.from_extra_config({"redis_url": srv.url})
        with open_redis(cfg, for_lookups=True) as s:
            assert s.exists_prefix([exp.key], 1.0) == 1
    assert "redis_url carries a password" in caplog.text and "redis_password_env" in caplog.text
    assert "hunter2" not in caplog.text


# ---- faults ---------------------------------------------------------------------------

def _count_connects(monkeypatch) -> list[int]:
    """Counts real socket connection attempts made by redis-py."""
    calls = [0]
    original = redis.connection.Connection._connect

    def counting(self):
        calls[0] += 1
        return original(self)

    monkeypatch.setattr(redis.connection.Connection, "_connect", counting)
    return calls


def test_absent_at_start_backs_off(monkeypatch):
    attempts = _count_connects(monkeypatch)
    exp, payload = make_chunk(1, 4096)
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}", backoff_initial_s=60.0)
    for i in range(200):
        op = i % 3
        if op == 0:
            assert store.exists_prefix([exp.key], 0.5) == 0
        elif op == 1:
            assert store.get_many([exp.key], [exp]) == [None]
        else:
            assert store.put_many([item(exp, payload)]) == 0
    s = store.snapshot()
    store.close()
    assert attempts[0] == 1, attempts  # not one per call
    assert s["errors"] == attempts[0] and s["in_backoff"]
    assert s["skipped_in_backoff"] >= 200 - attempts[0]
    assert s["put_failed"] == 66 and s["misses"] == 67 and s["puts"] == 0


def test_backoff_grows_and_probes_once(monkeypatch):
    attempts = _count_connects(monkeypatch)
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}", backoff_initial_s=0.05,
                                backoff_max_s=0.2, seed=1)
    exp, _ = make_chunk(1, 64)
    t_end = time.monotonic() + 1.0
    calls = 0
    while time.monotonic() < t_end:
        store.exists_prefix([exp.key], 0.1)
        calls += 1
        time.sleep(0.001)
    s = store.snapshot()
    store.close()
    # delays 0.05, 0.1, 0.2, 0.2, ... (+-20%): about 6 probes in a second, not `calls`
    assert 3 <= attempts[0] <= 9, attempts
    assert s["reconnects"] == attempts[0] - 1
    assert calls > 50 and s["skipped_in_backoff"] == calls - attempts[0]


def test_killed_then_restarted(monkeypatch):
    attempts = _count_connects(monkeypatch)
    exp, payload = make_chunk(1, 256 * 1024)
    with RedisServer() as srv:
        store = RedisStore.from_url(srv.url, backoff_initial_s=0.5, backoff_max_s=1.0, seed=0)
        assert store.put_many([item(exp, payload)]) == 1
        assert store.exists_prefix([exp.key], 1.0) == 1
        srv.kill()
        # the pooled connection is dead: misses from here on, and no exception
        assert store.get_many([exp.key], [exp]) == [None]
        assert store.in_backoff
        before = attempts[0]
        for _ in range(100):
            assert store.exists_prefix([exp.key], 1.0) == 0
            assert store.put_many([item(exp, payload)]) == 0
        assert attempts[0] - before <= 1
        srv.start()  # same port, empty
        deadline = time.monotonic() + 5.0
        stored = 0
        while not stored and time.monotonic() < deadline:
            stored = store.put_many([item(exp, payload)])
            time.sleep(0.01)
        assert stored == 1
        assert not store.in_backoff
        assert bytes(store.get_many([exp.key], [exp])[0]) == payload
        assert store.exists_prefix([exp.key], 1.0) == 1
        s = store.snapshot()
        store.close()
    assert s["reconnects"] >= 1 and s["backoffs"] >= 1 and s["skipped_in_backoff"] >= 150
    assert attempts[0] < 20


def test_slow_server_lookup_bounded(redis_server):
    exp, payload = make_chunk(1, 1024)
    store = RedisStore.from_url(redis_server.url, backoff_initial_s=0.2)
    try:
        store.put_many([item(exp, payload)])
        assert store.exists_prefix([exp.key], 0.5) == 1
        redis_server.freeze()  # stopped until thawed: no race with a busy machine
        try:
            for i in range(3):
                t0 = time.monotonic()
                assert store.exists_prefix([exp.key], 0.05) == 0
                assert time.monotonic() - t0 < 1.0  # the budget is the feature (generous)
                # one lookup over budget is not an outage; three in a row is
                assert store.in_backoff == (i == 2)
            assert store.exists_prefix([exp.key], 0.05) == 0  # skipped: no round trip
            s = store.snapshot()
            assert s["timeouts"] == 3 and s["skipped_in_backoff"] == 1
        finally:
            redis_server.thaw()
        deadline, found = time.monotonic() + 10, 0
        while not found and time.monotonic() < deadline:  # until the backoff lets a probe
            found = store.exists_prefix([exp.key], 1.0)
            time.sleep(0.02)
        assert found == 1 and not store.in_backoff
    finally:
        store.close()


def test_hung_server_get_times_out(redis_server):
    exp, payload = make_chunk(1, 1024)
    store = RedisStore.from_url(redis_server.url, timeout_s=0.3, backoff_initial_s=5.0)
    try:
        store.put_many([item(exp, payload)])
        redis_server.freeze()
        try:
            t0 = time.monotonic()
            assert store.get_many([exp.key], [exp]) == [None]
            assert 0.25 < time.monotonic() - t0 < 3.0  # the timeout is the feature
            assert store.in_backoff  # a get timing out is an outage
            assert store.put_many([item(exp, payload)]) == 0  # skipped: no round trip
        finally:
            redis_server.thaw()
        s = store.snapshot()
        assert s["timeouts"] == 1 and s["skipped_in_backoff"] == 1
    finally:
        store.close()


# ---- cluster --------------------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [32 * 1024, 1536 * 1024])  # one pipeline; a few at a time
def test_cluster_round_trip(nbytes):
    with RedisClusterServers(3) as cl:
        store = RedisStore.from_url(cl.cluster_url, key_prefix="kvc")
        try:
            chunks = [make_chunk(i, nbytes + i) for i in range(30)]
            assert store.put_many([item(e, p) for e, p in chunks]) == 30
            per_node = [n.client().dbsize() for n in cl.nodes]
            assert sum(per_node) == 30 and sum(1 for n in per_node if n) >= 2, per_node
            keys = [e.key for e, _ in chunks]
            assert store.exists_prefix(keys, 2.0) == 30
            got = store.get_many(keys, [e for e, _ in chunks])
            assert [bytes(g) for g in got] == [p for _, p in chunks]
            # a corrupt value on whichever node holds it is found and deleted there
            rk = store.redis_key(keys[5])
            c = redis.RedisCluster.from_url(cl.url)
            c.set(rk, b"garbage")
            assert store.exists_prefix(keys, 2.0) == 30
            got = store.get_many(keys, [e for e, _ in chunks])
            assert got[5] is None and all(g is not None for i, g in enumerate(got) if i != 5)
            assert c.exists(rk) == 0
            c.close()
            assert store.exists_prefix(keys, 2.0) == 5
            s = store.snapshot()
            assert s["corrupt_deleted"] == 1 and s["errors"] == 0
        finally:
            store.close()


def test_a_dead_cluster_node_costs_only_its_own_keys():
    """Issue 21: each node backs off on its own. With one of three nodes killed, the keys
    of the two live nodes keep being served (before, the whole store backed off: every
    key a miss); once the node is back, the store writes to it again."""
    from redis.crc import key_slot

    with RedisClusterServers(3) as cl:
        store = RedisStore.from_url(cl.cluster_url, key_prefix="kvc", backoff_initial_s=0.2)
        try:
            chunks = [make_chunk(i, 4096 + i) for i in range(30)]
            expected = [e for e, _ in chunks]
            keys = [e.key for e in expected]
            on_dead = [cl.node_for_slot(key_slot(store.redis_key(k))) is cl.nodes[1]
                       for k in keys]
            assert 0 < sum(on_dead) < 30
            assert store.put_many([item(e, p) for e, p in chunks]) == 30
            cl.nodes[1].kill()
            for _ in range(3):  # the failing call, then calls that skip the dead node
                got = store.get_many(keys, expected)
                assert [g is None for g in got] == on_dead
                assert all(bytes(g) == p for g, (_, p) in zip(got, chunks, strict=True)
                           if g is not None)
            assert store.exists_many(keys, 2.0) == [not d for d in on_dead]
            assert store.put_many([item(e, p) for e, p in chunks]) == 30 - sum(on_dead)
            s = store.snapshot()
            assert s["errors"] == 1 and s["backoffs"] == 1 and s["in_backoff"]
            assert s["skipped_in_backoff"] >= 3
            cl.nodes[1].restart()  # back, empty; it serves once it has rejoined (~2 s)
            deadline, stored = time.monotonic() + 30, 0
            while stored < 30 and time.monotonic() < deadline:
                stored = store.put_many([item(e, p) for e, p in chunks])
                time.sleep(0.05)
            assert stored == 30 and not store.in_backoff
            assert all(g is not None for g in store.get_many(keys, expected))
        finally:
            store.close()


def test_cluster_absent_at_start(monkeypatch):
    attempts = _count_connects(monkeypatch)
    store = RedisStore.from_url(f"redis+cluster://127.0.0.1:{free_port()}")
    exp, payload = make_chunk(1, 64)
    for _ in range(50):
        assert store.exists_prefix([exp.key], 0.5) == 0
        assert store.put_many([item(exp, payload)]) == 0
        assert store.get_many([exp.key], [exp]) == [None]
    s = store.snapshot()
    store.close()
    assert 1 <= attempts[0] <= 3 and s["errors"] == 1 and s["skipped_in_backoff"] == 149
