"""What a fingerprint stands for, stored once per deployment next to its chunks in Redis.

A chunk's Redis key names its fingerprint only as a one-way digest, so tools could not tell
which model or namespace a chunk belongs to. Every engine that writes chunks also writes
(and refreshes at least every ``REFRESH_S``, with the chunks' TTL) one small descriptor::

    key:   f"{redis_key_prefix}:fp:{fingerprint_hex}"
    value: b"KVCD" | msgpack {"v": 1, "fingerprint": {Fingerprint fields},
                              "chunk": {"layout", "dtype", "shape", "nbytes"},
                              "written_at": unix seconds}

``chunk`` is exactly what the engine's readers expect of each value's header, so
``kvconnector verify`` checks a value the way an engine would. Chunk values are unchanged:
engines of any version read each other's chunks as before. Nothing here unpickles.

With a MAC key (``chunk_mac_key``, ``codec.mac_key``), the writer signs the descriptor with
the same key as its chunks: one more field in the map, ``"mac"``, keyed BLAKE3 (64 lowercase
hex digits) over the msgpack of the other fields, under a key derived from the chunk MAC key
for descriptors only. A reader with the key (``decode(value, mac_key=...)``) refuses an
unsigned or badly signed descriptor: anyone who can write to Redis can write one, and the
fingerprint's fields are no secret. Readers without a key ignore the field, so older
kvconnectors read signed descriptors, and unsigned ones are read as before.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import blake3
import msgpack

from kvconnector.keys import Fingerprint
from kvconnector.store.codec import MAC_FIELD, ExpectedChunk, is_mac

MAGIC = b"KVCD"
VERSION = 1
TAG = "fp"
REFRESH_S = 60.0
MAX_LEN = 8192
_MAC_CONTEXT = "kvconnector descriptor MAC v1"


def descriptor_key(fingerprint_hex: str) -> str:
    """The descriptor's key, without the deployment's key prefix."""
    return f"{TAG}:{fingerprint_hex}"


@dataclass(frozen=True)
class Descriptor:
    fingerprint: dict[str, Any]
    layout: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    written_at: float
    signed: bool = False  # its MAC was checked (decode with a mac_key)

    @property
    def model(self) -> str:
        return str(self.fingerprint.get("model", ""))

    @property
    def namespace(self) -> str:
        return str(self.fingerprint.get("namespace", ""))

    def expected(self, key: str, header: Mapping[str, Any] | None = None) -> ExpectedChunk:
        """What an engine of this fingerprint expects of the value under chunk ``key``:
        a whole chunk, or, where the value's ``header`` says it holds a partial chunk (the
        first tokens of one: fewer along the token axis, dimension 2, nothing else
        different), that part of one."""
        shape = tuple(header["shape"]) if header is not None else self.shape
        if (len(shape) == len(self.shape) >= 3 and 0 < shape[2] < self.shape[2]
                and shape[:2] == self.shape[:2] and shape[3:] == self.shape[3:]):
            return ExpectedChunk(key, self.layout, self.dtype, shape,
                                 self.nbytes // self.shape[2] * shape[2])
        return ExpectedChunk(key, self.layout, self.dtype, self.shape, self.nbytes)

    def matches(self, fingerprint_hex: str) -> bool:
        """Whether the fields really hash to ``fingerprint_hex`` (False for fields this
        version of kvconnector does not know)."""
        known = {f.name for f in fields(Fingerprint)}
        if set(self.fingerprint) != known:
            return False
        try:
            return Fingerprint(**self.fingerprint).digest().hex() == fingerprint_hex
        except TypeError:
            return False


def _mac(mac_key: bytes, body: dict[str, Any]) -> str:
    """The MAC of a descriptor's fields (all but ``mac``), under a key of its own derived
    from the chunk MAC key (a descriptor's MAC can never stand for a chunk's)."""
    key = blake3.blake3(mac_key, derive_key_context=_MAC_CONTEXT).digest()
    signed = msgpack.packb({k: v for k, v in body.items() if k != MAC_FIELD},
                           use_bin_type=True)
    return blake3.blake3(signed, key=key).hexdigest()


def encode(fingerprint: Fingerprint, chunk: ExpectedChunk, now: float | None = None, *,
           mac_key: bytes | None = None) -> bytes:
    """The descriptor's value; signed when ``mac_key`` (``codec.mac_key``) is given."""
    body: dict[str, Any] = {
        "v": VERSION, "fingerprint": asdict(fingerprint),
        "chunk": {"layout": chunk.layout, "dtype": chunk.dtype,
                  "shape": [int(d) for d in chunk.shape], "nbytes": int(chunk.nbytes)},
        "written_at": time.time() if now is None else now}
    if mac_key is not None:
        body[MAC_FIELD] = _mac(mac_key, body)
    return MAGIC + msgpack.packb(body, use_bin_type=True)


def _unpack(value: bytes) -> dict[str, Any]:
    if len(value) > MAX_LEN or not value.startswith(MAGIC):
        raise ValueError("not a kvconnector descriptor")
    try:
        body = msgpack.unpackb(value[len(MAGIC):], raw=False, max_bin_len=0, max_ext_len=0,
                               max_str_len=1024, max_array_len=16, max_map_len=32)
    except Exception as e:  # msgpack raises several types
        raise ValueError(f"bad descriptor: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise ValueError(f"bad descriptor: a {type(body).__name__}, not a map")
    return body


def is_descriptor(value: Any) -> bool:
    """Whether ``value`` (a bytes-like object) starts like a descriptor."""
    return bytes(memoryview(value)[:len(MAGIC)]) == MAGIC


def sign(value: bytes, mac_key: bytes) -> bytes:
    """``value`` (a descriptor, signed or not) signed with ``mac_key``; the same value if it
    already is. Raises ValueError for anything but a well-formed descriptor."""
    body = _unpack(value)
    decode(value)  # well formed
    body[MAC_FIELD] = _mac(mac_key, body)
    return MAGIC + msgpack.packb(body, use_bin_type=True)


def decode(value: bytes, mac_key: bytes | None = None) -> Descriptor:
    """Raises ValueError for anything but a well-formed descriptor, and, with ``mac_key``,
    for one that is not signed with it (unsigned, or another MAC): never use such a one."""
    body = _unpack(value)
    try:
        chunk = body["chunk"]
        desc = Descriptor(dict(body["fingerprint"]), str(chunk["layout"]), str(chunk["dtype"]),
                          tuple(int(d) for d in chunk["shape"]), int(chunk["nbytes"]),
                          float(body["written_at"]), mac_key is not None)
    except Exception as e:  # a missing field is KeyError, a wrong type TypeError
        raise ValueError(f"bad descriptor: {type(e).__name__}: {e}") from None
    if body.get("v") != VERSION:
        raise ValueError(f"descriptor version {body.get('v')!r}, expected {VERSION}")
    if mac_key is not None:
        mac = body.get(MAC_FIELD)
        if mac is None:
            raise ValueError("unsigned descriptor (the MAC key is set: it must carry a MAC)")
        if not is_mac(mac) or not hmac.compare_digest(_mac(mac_key, body), mac):
            raise ValueError("the descriptor's MAC does not match")
    return desc
