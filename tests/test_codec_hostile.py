"""The codec against hostile values (issue 21): whatever a value holds, reading it either
gives the payload or raises ``CorruptValue``, never another exception (which a store would
take for a connection fault). A seeded corpus of valid values, mutated, and of valid
headers with hostile fields, through ``parse``, ``check_header`` and ``check_payload``."""

from __future__ import annotations

import random
import struct

import msgpack
import pytest

from kvconnector.store import codec
from kvconnector.store.codec import CorruptValue, ExpectedChunk

MAC_KEY = codec.mac_key(b"a-shared-secret-of-32-characters")
KEY = "00112233445566778899aabbccddeeff:0:" + "ab" * 16

# The mac field as a hostile writer might set it; each one must be a header_fields miss.
BAD_MACS = {
    "non_ascii_str": "é" * 64,  # 64 characters: hmac.compare_digest raised TypeError
    "non_ascii_one": "0" * 63 + "\u00ff",
    "non_hex_ascii": "z" * 64,
    "upper_hex": "AB" * 32,
    "short_hex": "ab" * 31,
    "long_hex": "ab" * 33,
    "int": 12345,
    "bytes": b"\x00" * 64,
    "list": ["a", "b"],
    "none": None,
    "bool": True,
    "float": 1.5,
    "map": {"a": 1},
}


def chunk(nbytes: int = 256, shape: tuple[int, ...] = (2, 4, 8)) -> tuple[ExpectedChunk, bytes]:
    payload = bytes(random.Random(nbytes).randrange(256) for _ in range(nbytes))
    return ExpectedChunk(KEY, "kv", "bfloat16", shape, nbytes), payload


def fields_of(value: bytes) -> dict:
    (n,) = struct.unpack_from("<I", value, 4)
    return msgpack.unpackb(value[codec.PREFIX_LEN:codec.PREFIX_LEN + n])


def value_with(fields: dict, payload: bytes) -> bytes:
    header = msgpack.packb(fields, use_bin_type=True)
    return codec.PREFIX.pack(codec.MAGIC, len(header)) + header + payload


def outcome(value: bytes, exp: ExpectedChunk, mac_key: bytes | None) -> bytes | str:
    """The payload parse returns, or the reason of its CorruptValue; anything else fails."""
    try:
        return bytes(codec.parse(value, exp, mac_key=mac_key))
    except CorruptValue as c:
        assert c.reason in codec.REASONS, c.reason
        return c.reason


@pytest.mark.parametrize("mac_key", [MAC_KEY, None], ids=["with_key", "without_key"])
@pytest.mark.parametrize("name", sorted(BAD_MACS))
def test_a_malformed_mac_field_is_a_corrupt_value(name, mac_key):
    exp, payload = chunk()
    fields = fields_of(codec.encode(exp, payload, mac_key=MAC_KEY))
    fields[codec.MAC_FIELD] = BAD_MACS[name]
    # bytes fail the unpack (no bin type in a header), everything else the field checks
    want = "header_unpack" if name == "bytes" else "header_fields"
    assert outcome(value_with(fields, payload), exp, mac_key) == want
    with pytest.raises(CorruptValue):
        codec.check_header(msgpack.packb(fields, use_bin_type=True), exp)
    # A caller that hands check_payload such a header itself gets a CorruptValue too
    # (a reader without a key checks the checksum, which is right).
    if mac_key is not None:
        with pytest.raises(CorruptValue):
            codec.check_payload(fields, memoryview(payload), mac_key)
    else:
        codec.check_payload(fields, memoryview(payload), mac_key)


def test_a_well_formed_mac_still_reads():
    exp, payload = chunk()
    signed = codec.encode(exp, payload, mac_key=MAC_KEY)
    assert outcome(signed, exp, MAC_KEY) == payload
    assert outcome(signed, exp, None) == payload
    fields = fields_of(signed)
    fields[codec.MAC_FIELD] = "0" * 64  # well formed, wrong
    assert outcome(value_with(fields, payload), exp, MAC_KEY) == "mac"
    assert outcome(value_with(fields, payload), exp, None) == payload  # checksum only


# ---- fuzzing ---------------------------------------------------------------------------

HOSTILE_VALUES = [
    None, True, False, 0, -1, 1, 2**63, 2**64 - 1, -(2**63), 1.0, float("nan"), "", "é" * 64,
    "\x00" * 10, "x" * 600, "ab" * 32, b"", b"\x00" * 8, [], [1, 2], [-1], ["a"], [[1]],
    [2**64 - 1] * 8, list(range(9)), {}, {"k": 1}, {1: 2},
]
NAMES = sorted([*codec.FIELDS, codec.MAC_FIELD])


def _mutate(rng: random.Random, value: bytes) -> bytes:
    b = bytearray(value)
    kind = rng.randrange(8)
    if kind == 0 and b:  # flip bits
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == 1 and b:  # random bytes, mostly in the header
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(min(len(b), 200))] = rng.randrange(256)
    elif kind == 2:  # cut
        del b[rng.randrange(len(b) + 1):]
    elif kind == 3:  # insert
        i = rng.randrange(len(b) + 1)
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == 4 and len(b) >= codec.PREFIX_LEN:  # another header length
        n = rng.choice([0, 1, rng.randrange(len(b)), codec.MAX_HEADER_LEN, 2**32 - 1])
        struct.pack_into("<I", b, 4, n)
    elif kind == 5 and len(b) > 12:  # delete a slice of the header
        i = rng.randrange(codec.PREFIX_LEN, min(len(b), 200))
        del b[i:i + rng.randint(1, 8)]
    elif kind == 6:  # the header replaced by random msgpack-ish bytes
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        b = bytearray(codec.PREFIX.pack(codec.MAGIC, len(junk)) + junk + b[-32:])
    else:  # two mutations
        b = bytearray(_mutate(rng, _mutate(rng, bytes(b))))
    return bytes(b)


def _hostile_fields(rng: random.Random, good: dict) -> dict:
    fields = dict(good)
    for _ in range(rng.randint(1, 3)):
        what = rng.randrange(10)
        if what < 7:
            fields[rng.choice(NAMES)] = rng.choice(HOSTILE_VALUES)
        elif what < 8:
            fields.pop(rng.choice(NAMES), None)
        elif what < 9:
            fields[rng.choice(["x", "pickle", "", "mac2"])] = rng.choice(HOSTILE_VALUES)
        else:
            fields[codec.MAC_FIELD] = "".join(chr(rng.randrange(32, 0x3000)) for _ in range(64))
    return fields


def _corpus() -> list[tuple[ExpectedChunk, bytes, bytes, bytes | None]]:
    """(expected, payload, valid value, its MAC key) for a few geometries, signed or not."""
    out = []
    for nbytes, shape in ((0, (0,)), (1, (1,)), (256, (2, 4, 8)), (4096, (2, 2, 1024))):
        exp, payload = chunk(nbytes, shape)
        out.append((exp, payload, codec.encode(exp, payload), None))
        out.append((exp, payload, codec.encode(exp, payload, mac_key=MAC_KEY), MAC_KEY))
    return out


def test_fuzz_mutated_values_only_ever_raise_corrupt_value():
    rng = random.Random(2121)
    reasons: set[str] = set()
    for exp, payload, good, key in _corpus():
        for _ in range(600):
            value = _mutate(rng, good)
            for reader_key in (key, MAC_KEY if key is None else None):
                got = outcome(value, exp, reader_key)
                if isinstance(got, str):
                    reasons.add(got)
                elif reader_key is not None:
                    # What a keyed reader accepts is exactly what the key's holder wrote.
                    assert got == payload
    assert {"bad_magic", "truncated", "header_unpack", "header_fields", "mac"} <= reasons


def test_fuzz_hostile_headers_only_ever_raise_corrupt_value():
    rng = random.Random(21)
    for exp, payload, good, _ in _corpus():
        fields0 = fields_of(good)
        for _ in range(400):
            fields = _hostile_fields(rng, fields0)
            try:
                header = msgpack.packb(fields, use_bin_type=True)
            except (TypeError, ValueError, OverflowError):
                continue  # not even msgpack
            value = codec.PREFIX.pack(codec.MAGIC, len(header)) + header + payload
            for reader_key in (None, MAC_KEY):
                got = outcome(value, exp, reader_key)
                if reader_key is not None and not isinstance(got, str):
                    assert got == payload
                try:
                    checked = codec.check_header(header, exp)
                except CorruptValue:
                    continue
                try:
                    codec.check_payload(checked, memoryview(payload), reader_key)
                except CorruptValue:
                    pass
            # check_payload on its own, with whatever mapping it is given
            for reader_key in (None, MAC_KEY):
                try:
                    codec.check_payload(fields, memoryview(payload), reader_key)
                except CorruptValue:
                    pass


def test_fuzz_random_bytes_only_ever_raise_corrupt_value():
    rng = random.Random(7)
    exp, _ = chunk()
    for _ in range(2000):
        n = rng.choice([0, 3, 8, 9, 16, 64, 300])
        body = bytes(rng.randrange(256) for _ in range(n))
        value = (codec.MAGIC + body) if rng.random() < 0.7 else body
        outcome(value, exp, rng.choice([None, MAC_KEY]))
        try:
            codec.unpack_header(body)
        except CorruptValue:
            pass
