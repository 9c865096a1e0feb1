"""The ``kvconnector`` command without an engine: ``config``, usage errors, and the checks
``verify`` applies to a value. test_operations.py runs it on what real engines stored."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import msgpack
import pytest

from kvconnector.cli import main
from kvconnector.cli.inventory import classify
from kvconnector.cli.verify import check_value
from kvconnector.keys import ChunkKey, Fingerprint
from kvconnector.store import codec, descriptor
from kvconnector.store.codec import ExpectedChunk
from tests.conftest import ROOT
from tests.redis_server import free_port

KVT = {"kv_connector": "kvconnector", "kv_role": "kv_both",
       "kv_load_failure_policy": "recompute"}
FP = Fingerprint("m", "", "d", "float32", "chunk", 16, 2, 2, 32, 1, 256, "ns")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_config_prints_defaults_sources_and_warnings(capsys):
    rc, out, _ = run(capsys, "config", json.dumps(
        {**KVT, "kv_load_failure_policy": "fail",
         "kv_connector_extra_config": {"memory_capacity": "8GiB"}}))
    assert rc == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "8589934592 (8.0 GiB)" in lines["memory_capacity"]
    assert lines["memory_capacity"].endswith("kv_connector_extra_config")
    assert lines["chunk_size"].split()[1:] == ["256", "default"]
    assert "kv_load_failure_policy is not \"recompute\"" in out


def test_config_json_from_a_file_with_an_lmcache_file(capsys, tmp_path):
    lm = tmp_path / "lmcache.yaml"
    lm.write_text('chunk_size: 512\nremote_url: "redis://:pw-in-file@cache:6379"\n')
    kvt = tmp_path / "kvt.json"
    kvt.write_text(json.dumps({**KVT, "kv_connector_extra_config": {}}))
    rc, out, _ = run(capsys, "config", f"@{kvt}", "--lmcache", str(lm), "--json")
    got = json.loads(out)
    assert rc == 0 and got["ok"]
    assert got["settings"]["chunk_size"] == 512
    assert got["sources"]["chunk_size"] == f"LMCache file {lm} (chunk_size)"
    assert got["settings"]["redis_url"] == "redis://***@cache:6379"
    assert "pw-in-file" not in out


def test_config_errors_name_the_key(capsys, tmp_path, monkeypatch):
    rc, out, err = run(capsys, "config", '{"memory_capacity": "lots"}')
    assert rc == 2 and "memory_capacity" in err and "would not start" in err
    monkeypatch.delenv("KVC_NOT_SET", raising=False)
    rc, out, _ = run(capsys, "config", "--json", json.dumps(
        {"redis_url": "redis://h:1", "redis_password_env": "KVC_NOT_SET"}))
    assert rc == 2 and "KVC_NOT_SET is not set" in json.loads(out)["error"]
    monkeypatch.setenv("KVC_SET", "secret-value")
    rc, out, _ = run(capsys, "config", json.dumps(
        {"redis_url": "redis://h:1", "redis_password_env": "KVC_SET"}))
    assert rc == 0 and "KVC_SET (set in this environment)" in out and "secret-value" not in out
    lm = tmp_path / "bad.yaml"
    lm.write_text("use_layerwise: true\nremote_serde: cachegen\n")
    rc, _, err = run(capsys, "config", "{}", "--lmcache", str(lm))
    assert rc == 2 and "use_layerwise" in err and "remote_serde" in err


def test_usage_errors(capsys):
    assert run(capsys, "purge", "redis://127.0.0.1:1")[0] == 2
    rc, _, err = run(capsys, "stats", "http://example.com")
    assert rc == 2 and "unsupported URL" in err
    rc, _, err = run(capsys, "stats", f"redis://:hunter2@127.0.0.1:{free_port()}")
    assert rc == 2 and "Connection" in err and "hunter2" not in err and "***" in err
    rc, _, err = run(capsys, "verify", "redis://127.0.0.1:1", "--mac-key-env", "KVC_NOPE")
    assert rc == 2 and "KVC_NOPE" in err and "--mac-key-env" in err


def test_console_entry_point():
    """``python -m kvconnector.cli`` (the ``kvconnector`` script calls the same main)."""
    p = subprocess.run([sys.executable, "-m", "kvconnector.cli", "--help"],
                       capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and "stats" in p.stdout and "purge" in p.stdout
    text = (ROOT / "pyproject.toml").read_text()
    assert 'kvconnector = "kvconnector.cli:main"' in text


def test_descriptor_round_trip_and_checks():
    chunk = ExpectedChunk("", "kv", "float32", (2, 2, 256, 2, 32), 262144)
    value = descriptor.encode(FP, chunk, now=5.0)
    d = descriptor.decode(value)
    assert (d.model, d.namespace, d.shape, d.nbytes, d.written_at) == ("m", "ns",
                                                                       chunk.shape, 262144, 5.0)
    assert d.matches(FP.digest().hex()) and not d.matches("00" * 16)
    key = ChunkKey(FP.digest(), 0, b"\x01" * 16)
    assert d.expected(str(key)) == ExpectedChunk(str(key), *[getattr(chunk, f) for f in
                                                              ("layout", "dtype", "shape",
                                                               "nbytes")])
    for bad in (b"", b"KVC1" + value[4:], value[:-3], value + b"x" * 9000):
        with pytest.raises(ValueError):
            descriptor.decode(bad)


def test_classify_keys():
    fp = FP.digest().hex()
    h = "ab" * 16
    assert classify("kvc", f"kvc:{fp}:3:{h}".encode()) == ("chunk", fp, 3)
    assert classify("kvc", f"kvc:fp:{fp}".encode()) == ("descriptor", fp, -1)
    for other in (f"kvc2:{fp}:0:{h}", f"kvc:{fp}:0:{h}x", "kvc:not-ours", f"x:kvc:fp:{fp}"):
        assert classify("kvc", other.encode()) is None, other
    assert classify("a:b", f"a:b:{fp}:0:{h}".encode()) == ("chunk", fp, 0)


def test_check_value_as_an_engine_would():
    key = str(ChunkKey(FP.digest(), 0, b"\x02" * 16))
    payload = bytes(range(256)) * 16
    chunk = ExpectedChunk(key, "kv", "float32", (4, 256), len(payload))
    good = codec.encode(chunk, payload)
    desc = descriptor.decode(descriptor.encode(FP, chunk))
    assert check_value(key, good, desc, None) is None
    assert check_value(key, good, None, None) is None  # no descriptor: held to itself
    flipped = good[:-1] + bytes([good[-1] ^ 1])
    assert check_value(key, flipped, desc, None).reason == "checksum"
    old = msgpack.packb({"v": 1, "key": key, "layout": "kv", "dtype": "float32",
                         "shape": [4, 256], "nbytes": len(payload), "crc32": zlib.crc32(payload)})
    old_value = codec.PREFIX.pack(codec.MAGIC, len(old)) + old + payload  # format 1 (CRC32)
    assert check_value(key, old_value, desc, None).reason == "version"
    assert check_value(key, old_value, None, None).reason == "version"
    assert check_value(key, good[:-5], None, None).reason == "truncated"
    assert check_value(key[:-1] + "f", good, None, None).reason == "key"
    other = descriptor.decode(descriptor.encode(FP, ExpectedChunk("", "kv", "bfloat16",
                                                                  (4, 256), len(payload))))
    assert check_value(key, good, other, None).reason == "dtype"
    mac = codec.mac_key(b"a-shared-secret-of-32-characters")
    assert check_value(key, good, desc, mac).reason == "mac"
    assert check_value(key, codec.encode(chunk, payload, mac_key=mac), desc, mac) is None


def test_check_value_accepts_a_partial_chunk_of_the_descriptors_shape():
    """A partial chunk holds the first tokens of a chunk: fewer along the token axis
    (dimension 2) than the descriptor's chunk, and nothing else different."""
    key = str(ChunkKey(FP.digest(), 0, b"\x03" * 16))
    full = ExpectedChunk("", "kv", "float32", (2, 2, 256, 2, 4), 2 * 2 * 256 * 2 * 4 * 4)
    desc = descriptor.decode(descriptor.encode(FP, full))
    part = bytes(range(256)) * 32  # 64 of the 256 tokens, 8 KiB
    ok = codec.encode(ExpectedChunk(key, "kv", "float32", (2, 2, 64, 2, 4), len(part)), part)
    assert check_value(key, ok, desc, None) is None
    for shape in ((2, 2, 64, 4, 2), (2, 2, 512, 2, 4)):  # another axis; more than a chunk
        bad = codec.encode(ExpectedChunk(key, "kv", "float32", shape, len(part) * shape[2]
                                         // 64), part * (shape[2] // 64))
        assert check_value(key, bad, desc, None).reason == "shape"


# ---- verify against a real redis-server ------------------------------------------------

MAC_SECRET = "a-shared-secret-of-32-characters"


@pytest.fixture(scope="module")
def redis_srv():
    from tests.redis_server import RedisServer

    with RedisServer() as srv:
        yield srv


@pytest.fixture
def empty_redis(redis_srv):
    with redis_srv.client() as c:
        c.flushall()
    return redis_srv


def _chunk(i: int, nbytes: int = 4096) -> tuple[ExpectedChunk, bytes]:
    key = str(ChunkKey(FP.digest(), 0, i.to_bytes(16, "big")))
    payload = bytes((i * 7 + j) % 251 for j in range(nbytes))
    return ExpectedChunk(key, "kv", "float32", (4, nbytes // 16), nbytes), payload


def _verify_json(capsys, url: str, *extra: str) -> tuple[int, dict]:
    rc, out, err = run(capsys, "verify", url, "--json", "--no-progress", *extra)
    assert rc in (0, 1), err
    return rc, json.loads(out)


@pytest.mark.parametrize("bad_mac", ["é" * 64, 7, ["a"]], ids=["non_ascii", "int", "list"])
def test_verify_reports_a_malformed_mac_field_instead_of_crashing(capsys, monkeypatch,
                                                                   empty_redis, bad_mac):
    """Issue 21: a mac field of non-ASCII text crashed ``verify`` (TypeError in
    hmac.compare_digest)."""
    monkeypatch.setenv("KVC_TEST_MAC", MAC_SECRET)
    mac = codec.mac_key(MAC_SECRET.encode())
    c = empty_redis.client()
    good, good_payload = _chunk(1)
    c.set(f"kvc:{good.key}", codec.encode(good, good_payload, mac_key=mac))
    bad, payload = _chunk(2)
    fields = msgpack.unpackb(codec.encode_header(bad, payload, mac_key=mac)[codec.PREFIX_LEN:])
    fields["mac"] = bad_mac
    header = msgpack.packb(fields, use_bin_type=True)
    c.set(f"kvc:{bad.key}", codec.PREFIX.pack(codec.MAGIC, len(header)) + header + payload)
    for keyed in (("--mac-key-env", "KVC_TEST_MAC"), ()):
        rc, report = _verify_json(capsys, empty_redis.url, *keyed)
        assert rc == 1 and report["checked"] == 2
        assert [p["key"] for p in report["problems"]] == [f"kvc:{bad.key}"]
        assert report["reasons"] == {"header_fields": 1}
    rc, report = _verify_json(capsys, empty_redis.url, "--mac-key-env", "KVC_TEST_MAC",
                              "--delete")
    assert rc == 1 and report["deleted"] == 1
    assert c.exists(f"kvc:{bad.key}") == 0 and c.exists(f"kvc:{good.key}") == 1


def test_verify_with_a_mac_key_never_deletes_valid_chunks_for_a_forged_descriptor(
        capsys, monkeypatch, empty_redis):
    """Issue 21: anyone who can write to Redis could plant a descriptor with another
    shape under a fingerprint (its fields are no secret), and ``verify --delete`` with the
    MAC key then deleted every valid chunk of it: the header was held to the descriptor
    before the MAC was checked."""
    monkeypatch.setenv("KVC_TEST_MAC", MAC_SECRET)
    mac = codec.mac_key(MAC_SECRET.encode())
    c = empty_redis.client()
    fp = FP.digest().hex()
    chunks = [_chunk(i) for i in range(3)]
    for exp, payload in chunks:
        c.set(f"kvc:{exp.key}", codec.encode(exp, payload, mac_key=mac))
    unsigned, payload = _chunk(9)  # right checksum, no MAC: verify must still find it
    c.set(f"kvc:{unsigned.key}", codec.encode(unsigned, payload))
    real = chunks[0][0]
    forged_geometry = ExpectedChunk("", real.layout, real.dtype,
                                    (real.shape[0] * 2, real.shape[1] // 2), real.nbytes)
    forgeries = {
        "unsigned": descriptor.encode(FP, forged_geometry),
        "other key": descriptor.encode(FP, forged_geometry,
                                       mac_key=codec.mac_key(b"not-the-engines-key")),
    }
    for name, forged in forgeries.items():
        c.set(f"kvc:fp:{fp}", forged)
        rc, report = _verify_json(capsys, empty_redis.url, "--mac-key-env", "KVC_TEST_MAC",
                                  "--delete")
        bad = {p["key"]: p["reason"] for p in report["problems"]}
        assert rc == 1, name
        assert bad.get(f"kvc:{unsigned.key}", "mac") == "mac", name
        assert set(bad) <= {f"kvc:fp:{fp}", f"kvc:{unsigned.key}"}, (name, bad)
        assert bad[f"kvc:fp:{fp}"] == "descriptor", name
        for exp, _ in chunks:
            assert c.exists(f"kvc:{exp.key}") == 1, name  # every valid chunk is kept
    assert c.exists(f"kvc:{unsigned.key}") == 0 and c.exists(f"kvc:fp:{fp}") == 0
    # A descriptor signed with the engines' key is trusted and used ...
    c.set(f"kvc:fp:{fp}", descriptor.encode(FP, real.__class__("", *[
        getattr(real, f) for f in ("layout", "dtype", "shape", "nbytes")]), mac_key=mac))
    rc, report = _verify_json(capsys, empty_redis.url, "--mac-key-env", "KVC_TEST_MAC")
    assert rc == 0 and report["checked"] == 3 and not report["problems"]
    assert not report["warnings"]
    # A signed descriptor that disagrees with signed values: they are kept, and said so.
    c.set(f"kvc:fp:{fp}", descriptor.encode(FP, forged_geometry, mac_key=mac))
    rc, report = _verify_json(capsys, empty_redis.url, "--mac-key-env", "KVC_TEST_MAC",
                              "--delete")
    assert rc == 0 and not report["problems"] and report["deleted"] == 0
    assert len(report["warnings"]) == 1 and "3 value(s)" in report["warnings"][0]
    assert "(shape)" in report["warnings"][0]
    assert all(c.exists(f"kvc:{exp.key}") for exp, _ in chunks)
    # ... and still read, as before, by a verify without a key (old descriptors too).
    c.set(f"kvc:fp:{fp}", descriptor.encode(FP, forged_geometry))
    rc, report = _verify_json(capsys, empty_redis.url)
    assert rc == 1 and report["reasons"] == {"shape": 3}  # held to the (unsigned) descriptor


def test_signed_descriptors():
    mac = codec.mac_key(MAC_SECRET.encode())
    chunk = ExpectedChunk("", "kv", "float32", (2, 2, 256, 2, 32), 262144)
    signed = descriptor.encode(FP, chunk, now=5.0, mac_key=mac)
    plain = descriptor.encode(FP, chunk, now=5.0)
    d = descriptor.decode(signed, mac_key=mac)
    assert d.signed and d.shape == chunk.shape and d.matches(FP.digest().hex())
    assert descriptor.decode(signed) == descriptor.decode(plain)  # readers without a key
    assert descriptor.sign(plain, mac) == signed
    other = codec.mac_key(b"not-the-engines-key")
    body = msgpack.unpackb(signed[4:])
    tampered = descriptor.MAGIC + msgpack.packb(
        dict(body, chunk=dict(body["chunk"], shape=[4, 256])), use_bin_type=True)
    for bad, why in ((plain, "unsigned"), (descriptor.encode(FP, chunk, mac_key=other), "MAC"),
                     (tampered, "MAC"),
                     (descriptor.MAGIC + msgpack.packb(dict(body, mac="é" * 64)), "MAC"),
                     (descriptor.MAGIC + msgpack.packb(dict(body, mac=7)), "MAC")):
        with pytest.raises(ValueError, match=why):
            descriptor.decode(bad, mac_key=mac)
    # check_value with a key: the MAC first; a valid chunk is never held to a descriptor
    key = str(ChunkKey(FP.digest(), 0, b"\x02" * 16))
    payload = bytes(range(256)) * 16
    exp = ExpectedChunk(key, "kv", "float32", (4, 256), len(payload))
    good = codec.encode(exp, payload, mac_key=mac)
    liar = descriptor.decode(descriptor.encode(FP, ExpectedChunk("", "kv", "float32", (8, 128),
                                                                 len(payload))))
    assert check_value(key, good, liar, mac) is None
    assert check_value(key, codec.encode(exp, payload), liar, mac).reason == "mac"
    assert check_value(key, good, liar, None).reason == "shape"  # no key: as before
