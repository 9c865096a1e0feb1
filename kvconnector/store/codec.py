"""The format of one chunk stored as one value in a remote key-value store (Redis).

A value is::

    b"KVC1" | header length (uint32, little-endian) | msgpack header | raw payload

The header is a msgpack map with exactly these fields:

    ``v``       format version (int, ``FORMAT_VERSION``)
    ``key``     the chunk key string, ``str(ChunkKey)``: fingerprint hex, rank, chain hash hex
    ``layout``  the layout name (str)
    ``dtype``   the dtype name (str)
    ``shape``   the chunk shape (list of non-negative ints)
    ``nbytes``  the payload length in bytes (int)
    ``xxh3``    XXH3-64 of the payload (unsigned 64-bit int, ``checksum``; the memory tier
                seals slots bound for Redis with the same value)

and, when the writer has a MAC key (``mac_key``), one more:

    ``mac``     keyed BLAKE3 over the other fields and the payload (64 lowercase hex digits)

The checksum catches accidents (a bit flipped in memory or on the wire, a value cut
short). XXH3-64 hashes about 100 GB/s on one core here, zlib's CRC32 6 GB/s. Unlike a CRC
it does not guarantee to catch every single-bit flip, but any given change of the payload
escapes it with a probability of about 2**-64 (Cyan4973/xxHash issue 229). Format version 1
carried a CRC32 (field ``crc32``); its values live under other keys
(``keys.FORMAT_VERSION``), and one read all the same fails the version check: a miss. The
checksum does not stop anyone who can write to Redis: a forged value under another chunk's
key with a matching checksum passes every other check. A reader with a MAC key accepts only
values whose MAC it can verify, so only holders of the secret can place chunks it will load.

The header goes first so that the payload can be sent as its own buffer, never copied into
one joined value (``encode_header``), and so that a reader can check everything but the
checksum before it reads the payload (``check_prefix``/``check_header``/``check_payload``,
which ``parse`` chains). Nothing here unpickles: the header is msgpack with small limits.

Whatever a value holds, these checks either accept it or raise ``CorruptValue``: a reader
counts and deletes such a value as a miss. Any other exception would leave the decoder as
if it were the reader's own fault (a store takes it for a connection error), so the header
checks hold every field to its exact type and form (``mac``: 64 lowercase hex digits), and
each check turns anything unforeseen into a ``CorruptValue`` as a last resort.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import msgpack
import xxhash

MAGIC = b"KVC1"
FORMAT_VERSION = 2
PREFIX = struct.Struct("<4sI")  # magic, header length
PREFIX_LEN = PREFIX.size  # 8
MAX_HEADER_LEN = 4096
MAX_STR_LEN = 512
MAX_DIMS = 8
FIELDS = frozenset({"v", "key", "layout", "dtype", "shape", "nbytes", "xxh3"})
MAC_FIELD = "mac"
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
_U64 = 2**64 - 1
_MAC_CONTEXT = "kvconnector chunk MAC v1"
_HEX_DIGITS = b"0123456789abcdef"  # a MAC field is 2 * MAC_BYTES of them (hexdigest())

#: Every ``CorruptValue.reason``, in the order ``parse`` checks them.
REASONS = ("too_short", "bad_magic", "header_too_long", "truncated", "header_unpack",
           "version", "header_fields", "key", "layout", "dtype", "shape", "nbytes",
           "too_large", "checksum", "mac")


class CorruptValue(ValueError):
    """A stored value that must not be used; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _unforeseen(reason: str, e: Exception) -> CorruptValue:
    """What a check raises for any other exception it meets in a value (a case the field
    checks missed): every check raises nothing but ``CorruptValue``."""
    return CorruptValue(reason, f"{type(e).__name__}: {e}")


def is_mac(x: Any) -> bool:
    """Whether ``x`` has the form of a MAC field: 64 lowercase hex digits (a str)."""
    return (isinstance(x, str) and len(x) == 2 * MAC_BYTES and x.isascii()
            and not x.encode("ascii").translate(None, _HEX_DIGITS))


@dataclass(frozen=True)
class ExpectedChunk:
    """What the reader expects under a key; a value that differs in anything is corrupt."""

    key: str
    layout: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _as_bytes_view(payload: Any) -> memoryview:
    mv = payload if isinstance(payload, memoryview) else memoryview(payload)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")  # raises TypeError for non-contiguous buffers
    return mv


def checksum(payload: Any) -> int:
    """XXH3-64 of a contiguous buffer (bytes, memoryview, numpy array), as the header's
    ``xxh3`` field carries it."""
    return xxhash.xxh3_64_intdigest(_as_bytes_view(payload))


def mac_key(secret: bytes) -> bytes:
    """The MAC key for a shared secret (at least ``MIN_SECRET_BYTES`` bytes)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret has {len(secret)} bytes; use at least "
                         f"{MIN_SECRET_BYTES}")
    return blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()


def _mac(key: bytes, fields: Mapping[str, Any], payload: Any) -> str:
    signed = msgpack.packb([fields[f] for f in sorted(FIELDS)], use_bin_type=True)
    h = blake3.blake3(signed, key=key)
    h.update(payload)
    return h.hexdigest()


def encode_header(chunk: ExpectedChunk, payload: Any = None, *,
                  xxh3: int | None = None, mac_key: bytes | None = None) -> bytes:
    """The value's prefix (magic, header length, header) for ``payload``.

    Pass ``xxh3`` when the payload's checksum is already known (the memory tier keeps it);
    otherwise it is computed here and ``payload`` is required. With ``mac_key`` the header
    also carries the value's MAC (``payload`` required). The payload itself is not copied:
    send it as a separate buffer after the prefix.
    """
    if (xxh3 is None or mac_key is not None) and payload is None:
        raise ValueError("encode_header needs the payload to checksum or sign it")
    if payload is not None:
        nbytes = _as_bytes_view(payload).nbytes
        if nbytes != chunk.nbytes:
            raise ValueError(f"payload has {nbytes} bytes, chunk {chunk.key} expects "
                             f"{chunk.nbytes}")
    if xxh3 is None:
        xxh3 = checksum(payload)
    fields: dict[str, Any] = {
        "v": FORMAT_VERSION, "key": chunk.key, "layout": chunk.layout, "dtype": chunk.dtype,
        "shape": [int(d) for d in chunk.shape], "nbytes": int(chunk.nbytes),
        "xxh3": int(xxh3) & _U64,
    }
    if mac_key is not None:
        fields[MAC_FIELD] = _mac(mac_key, fields, _as_bytes_view(payload))
    header = msgpack.packb(fields, use_bin_type=True)
    if len(header) > MAX_HEADER_LEN:
        raise ValueError(f"header of {len(header)} bytes exceeds {MAX_HEADER_LEN}")
    return PREFIX.pack(MAGIC, len(header)) + header


def encode(chunk: ExpectedChunk, payload: Any, *, mac_key: bytes | None = None) -> bytes:
    """A whole value as one bytes object (tests and tools; the store sends pieces)."""
    return encode_header(chunk, payload, mac_key=mac_key) + bytes(_as_bytes_view(payload))


def check_prefix(prefix: bytes | memoryview, value_len: int) -> int:
    """Check the first ``PREFIX_LEN`` bytes of a value of ``value_len`` bytes.

    Returns the header length. The limit is checked before anything is unpacked.
    """
    try:
        return _check_prefix(prefix, value_len)
    except CorruptValue:
        raise
    except Exception as e:
        raise _unforeseen("bad_magic", e) from None


def _check_prefix(prefix: bytes | memoryview, value_len: int) -> int:
    if value_len < PREFIX_LEN or len(prefix) < PREFIX_LEN:
        raise CorruptValue("too_short", f"{value_len} bytes")
    magic, header_len = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptValue("bad_magic", repr(bytes(magic)))
    if header_len > MAX_HEADER_LEN:
        raise CorruptValue("header_too_long", f"{header_len} > {MAX_HEADER_LEN}")
    if value_len < PREFIX_LEN + header_len:
        raise CorruptValue("truncated", f"{value_len} bytes cannot hold a header of "
                                        f"{header_len}")
    return header_len


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool


_FIELD_TYPES = {
    "v": _is_int, "nbytes": lambda x: _is_int(x) and x >= 0,
    "xxh3": lambda x: _is_int(x) and 0 <= x <= _U64,
    "key": lambda x: isinstance(x, str), "layout": lambda x: isinstance(x, str),
    "dtype": lambda x: isinstance(x, str),
    "shape": lambda x: isinstance(x, list) and len(x) <= MAX_DIMS
    and all(_is_int(d) and d >= 0 for d in x),
}


_LABELS = {name: msgpack.packb(name) for name in (*FIELDS, MAC_FIELD)}
_TAILS: dict[tuple[str, str, tuple[int, ...], int], bytes] = {}
_INTS = {0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8}  # msgpack uint8..64 markers -> bytes after


def _expected_head(expected: ExpectedChunk) -> bytes:
    """What ``encode_header`` writes for ``expected`` from the "key" label to the "xxh3"
    label included (the map size and version come before it)."""
    geometry = (expected.layout, expected.dtype, tuple(expected.shape), expected.nbytes)
    tail = _TAILS.get(geometry)
    if tail is None:
        tail = b"".join((
            _LABELS["layout"], msgpack.packb(expected.layout), _LABELS["dtype"],
            msgpack.packb(expected.dtype), _LABELS["shape"],
            msgpack.packb([int(d) for d in expected.shape]), _LABELS["nbytes"],
            msgpack.packb(int(expected.nbytes)), _LABELS["xxh3"]))
        if len(_TAILS) < 64:
            _TAILS[geometry] = tail
    return _LABELS["key"] + msgpack.packb(expected.key) + tail


_VERSION = _LABELS["v"] + msgpack.packb(FORMAT_VERSION)
_MAC_VALUE = _LABELS[MAC_FIELD] + b"\xd9\x40"  # "mac", then a str8 of 64 characters


def _fast_header(header: bytes, expected: ExpectedChunk) -> dict[str, Any] | None:
    """The header's fields if its bytes are exactly what ``encode_header`` writes for
    ``expected`` (any checksum, an optional MAC); None sends it through the full check."""
    n = len(header)
    if n < 2 or header[0] not in (0x87, 0x88) or not header.startswith(_VERSION, 1):
        return None
    head = _expected_head(expected)
    at = 1 + len(_VERSION)
    if not header.startswith(head, at):
        return None
    at += len(head)
    if at >= n:
        return None
    marker = header[at]
    if marker < 0x80:
        digest, at = marker, at + 1
    elif marker in _INTS and at + 1 + _INTS[marker] <= n:
        width = _INTS[marker]
        digest, at = int.from_bytes(header[at + 1:at + 1 + width], "big"), at + 1 + width
    else:
        return None
    fields: dict[str, Any] = {
        "v": FORMAT_VERSION, "key": expected.key, "layout": expected.layout,
        "dtype": expected.dtype, "shape": list(expected.shape), "nbytes": expected.nbytes,
        "xxh3": digest}
    if header[0] == 0x87:
        return fields if at == n else None
    if header.startswith(_MAC_VALUE, at) and n == at + len(_MAC_VALUE) + 2 * MAC_BYTES:
        mac = header[at + len(_MAC_VALUE):]
        if mac.translate(None, _HEX_DIGITS):
            return None  # the full check says what is wrong with it
        fields[MAC_FIELD] = mac.decode("ascii")
        return fields
    return None


def unpack_header(header: bytes | memoryview) -> Mapping[str, Any]:
    """Unpack a header with strict limits and check its fields and version (not what they
    say: ``check_header`` compares that with what the reader expects)."""
    try:
        return _unpack_header(header)
    except CorruptValue:
        raise
    except Exception as e:
        raise _unforeseen("header_fields", e) from None


def _unpack_header(header: bytes | memoryview) -> Mapping[str, Any]:
    try:
        fields = msgpack.unpackb(
            header, raw=False, use_list=True, strict_map_key=True,
            max_bin_len=0, max_ext_len=0, max_str_len=MAX_STR_LEN,
            max_array_len=MAX_DIMS, max_map_len=len(FIELDS) + 1)
    except Exception as e:  # msgpack raises several types (limits, format, extra data)
        raise CorruptValue("header_unpack", f"{type(e).__name__}: {e}") from None
    if not isinstance(fields, dict):
        raise CorruptValue("header_fields", f"header is a {type(fields).__name__}")
    version = fields.get("v")
    if _is_int(version) and version != FORMAT_VERSION:
        # Another format's fields differ from these: its version is what is wrong.
        raise CorruptValue("version", f"{version} != {FORMAT_VERSION}")
    names = set(fields)
    if names - {MAC_FIELD} != FIELDS:
        raise CorruptValue("header_fields", f"missing {sorted(FIELDS - names)}, "
                                            f"extra {sorted(map(str, names - FIELDS))}")
    if MAC_FIELD in names and not is_mac(fields[MAC_FIELD]):
        # Not only a wrong type: hmac.compare_digest raises for non-ASCII text.
        raise CorruptValue("header_fields", f"bad {MAC_FIELD}: not {2 * MAC_BYTES} "
                                            "lowercase hex digits")
    for name, ok in _FIELD_TYPES.items():
        if not ok(fields[name]):
            raise CorruptValue("header_fields", f"bad {name}: {fields[name]!r}")
    return fields


def check_header(header: bytes | memoryview, expected: ExpectedChunk) -> Mapping[str, Any]:
    """Unpack a header with strict limits and compare it with what the reader expects.

    Headers byte for byte as this module writes them for ``expected`` take a short cut
    (a comparison instead of an unpack: a few microseconds per value); anything else is
    unpacked and checked field by field."""
    try:
        fast = _fast_header(bytes(header), expected)
        if fast is not None:
            return fast
        return _compare_header(unpack_header(header), expected)
    except CorruptValue:
        raise
    except Exception as e:
        raise _unforeseen("header_fields", e) from None


def _compare_header(fields: Mapping[str, Any], expected: ExpectedChunk) -> Mapping[str, Any]:
    if fields["key"] != expected.key:
        raise CorruptValue("key", f"value holds {fields['key']}, expected {expected.key}")
    for name in ("layout", "dtype"):
        if fields[name] != getattr(expected, name):
            raise CorruptValue(name, f"{fields[name]} != {getattr(expected, name)}")
    if tuple(fields["shape"]) != tuple(expected.shape):
        raise CorruptValue("shape", f"{fields['shape']} != {list(expected.shape)}")
    if fields["nbytes"] != expected.nbytes:
        raise CorruptValue("nbytes", f"{fields['nbytes']} != {expected.nbytes}")
    return fields


def check_payload_len(header: Mapping[str, Any], payload_len: int) -> None:
    try:
        nbytes = header["nbytes"]
        if payload_len < nbytes:
            raise CorruptValue("truncated", f"payload {payload_len} < {nbytes} bytes")
        if payload_len > nbytes:
            raise CorruptValue("too_large", f"payload {payload_len} > {nbytes} bytes")
    except CorruptValue:
        raise
    except Exception as e:
        raise _unforeseen("header_fields", e) from None


def check_payload(header: Mapping[str, Any], payload: memoryview,
                  mac_key: bytes | None = None) -> None:
    """The payload's length, then its MAC when the reader has a key (which makes the
    checksum redundant), else its XXH3-64."""
    check_payload_len(header, payload.nbytes)
    try:
        if mac_key is not None:
            mac = header.get(MAC_FIELD)
            if mac is None:
                raise CorruptValue("mac", "the value carries no MAC")
            # A malformed mac (check_header refuses them; a header from elsewhere may
            # carry one) makes compare_digest raise TypeError: a "mac" CorruptValue below.
            if not hmac.compare_digest(_mac(mac_key, header, payload), mac):
                raise CorruptValue("mac", "the MAC does not match")
            return
        digest = checksum(payload)
        if digest != header["xxh3"]:
            raise CorruptValue("checksum", f"xxh3 {digest:#018x} != {header['xxh3']:#018x}")
    except CorruptValue:
        raise
    except Exception as e:
        raise _unforeseen("checksum" if mac_key is None else "mac", e) from None


def parse(value: bytes | bytearray | memoryview, expected: ExpectedChunk, *,
          mac_key: bytes | None = None) -> memoryview:
    """Validate a whole value; return its payload as a view (no copy) or raise
    ``CorruptValue``. Checks, in order: length, magic, header length limit, header
    (unpack, fields, version, key, layout, dtype, shape, nbytes), payload length, then
    the MAC (with ``mac_key``) or the checksum.
    """
    mv = _as_bytes_view(value)
    header_len = check_prefix(mv[:PREFIX_LEN], mv.nbytes)
    end = PREFIX_LEN + header_len
    header = check_header(mv[PREFIX_LEN:end], expected)
    payload = mv[end:]
    check_payload(header, payload, mac_key)
    return payload
