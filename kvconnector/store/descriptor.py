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
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

from kvconnector.keys import Fingerprint
from kvconnector.store.codec import ExpectedChunk

MAGIC = b"KVCD"
VERSION = 1
TAG = "fp"
REFRESH_S = 60.0
MAX_LEN = 8192


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

    @property
    def model(self) -> str:
        return str(self.fingerprint.get("model", ""))

    @property
    def namespace(self) -> str:
        return str(self.fingerprint.get("namespace", ""))

    def expected(self, key: str) -> ExpectedChunk:
        """What an engine of this fingerprint expects of the value under chunk ``key``."""
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


def encode(fingerprint: Fingerprint, chunk: ExpectedChunk, now: float | None = None) -> bytes:
    body = {"v": VERSION, "fingerprint": asdict(fingerprint),
            "chunk": {"layout": chunk.layout, "dtype": chunk.dtype,
                      "shape": [int(d) for d in chunk.shape], "nbytes": int(chunk.nbytes)},
            "written_at": time.time() if now is None else now}
    return MAGIC + msgpack.packb(body, use_bin_type=True)


def decode(value: bytes) -> Descriptor:
    """Raises ValueError for anything but a well-formed descriptor."""
    if len(value) > MAX_LEN or not value.startswith(MAGIC):
        raise ValueError("not a kvconnector descriptor")
    try:
        body = msgpack.unpackb(value[len(MAGIC):], raw=False, max_bin_len=0, max_ext_len=0,
                               max_str_len=1024, max_array_len=16, max_map_len=32)
        chunk = body["chunk"]
        desc = Descriptor(dict(body["fingerprint"]), str(chunk["layout"]), str(chunk["dtype"]),
                          tuple(int(d) for d in chunk["shape"]), int(chunk["nbytes"]),
                          float(body["written_at"]))
    except Exception as e:  # msgpack raises several types; a missing field is KeyError
        raise ValueError(f"bad descriptor: {type(e).__name__}: {e}") from None
    if body.get("v") != VERSION:
        raise ValueError(f"descriptor version {body.get('v')!r}, expected {VERSION}")
    return desc
