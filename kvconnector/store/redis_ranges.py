"""Chunks read from Redis a byte range at a time, so a hit's first layers can be used while
its last are still on the wire (``layer_loads.py``).

A value is read as: its header (``GETRANGE`` of its first bytes, with ``STRLEN``), checked
as a whole GET checks it; then ranges of its payload, in any order, into the caller's
buffers; then, once every byte is in, the payload's checksum or MAC. Until that last check
passes, what arrived is unverified: the caller must be able to take back whatever it did
with it (a load reports its blocks as failed and vLLM recomputes them, dropping the step's
token). A value rewritten between the header and the ranges fails the last check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvconnector.store import codec
from kvconnector.store.codec import CorruptValue, ExpectedChunk
from kvconnector.store.redis_store import RedisStore
from kvconnector.store.redis_wire import ReplyError, Wire, bulk, reply_window

_HEAD_BYTES = codec.PREFIX_LEN + codec.MAX_HEADER_LEN


@dataclass(frozen=True)
class Head:
    """A value's checked header and where its payload starts in the value."""

    header: Mapping[str, Any]
    offset: int


def _getrange(rkey: bytes, start: int, end: int) -> bytes:
    return b"*4\r\n$8\r\nGETRANGE\r\n" + bulk(rkey) + bulk(b"%d" % start) + bulk(b"%d" % end)


def read_heads(store: RedisStore, keys: Sequence[Any], expected: Sequence[ExpectedChunk],
               deadline: float | None = None) -> list[Head | None]:
    """Each value's header, one round trip. None: not stored, not answered, or corrupt
    (counted and deleted, as ``get_many`` does)."""
    if len(keys) != len(expected):
        raise ValueError(f"{len(keys)} keys but {len(expected)} expected chunks")
    rkeys = [store.redis_key(k) for k in keys]
    heads: list[Head | None] = [None] * len(keys)
    corrupt: list[tuple[int, CorruptValue]] = []
    errors: list[str] = []

    def read(w: Wire, i: int) -> None:
        first: bytes | None = None
        try:
            n = w.read_bulk_len()
            if n >= 0:
                first = w.read_bytes(n)
                w.read_crlf()
        except ReplyError as e:
            errors.append(str(e))
        try:
            length = w.read_simple()
        except ReplyError as e:
            errors.append(str(e))
            return
        if not first or not isinstance(length, int):
            return  # not stored
        try:
            header_len = codec.check_prefix(first[:codec.PREFIX_LEN], length)
            offset = codec.PREFIX_LEN + header_len
            header = codec.check_header(first[codec.PREFIX_LEN:offset], expected[i])
            codec.check_payload_len(header, length - offset)
        except CorruptValue as c:
            corrupt.append((i, c))
            return
        heads[i] = Head(header, offset)

    cmds = [_getrange(k, 0, _HEAD_BYTES - 1) + b"*2\r\n$6\r\nSTRLEN\r\n" + bulk(k)
            for k in rkeys]
    answered = store._connections.call("get", rkeys, cmds, read, deadline)
    store._note_reply_errors(errors)
    corrupt = [(i, c) for i, c in corrupt if answered[i]]
    if corrupt:
        store._drop_corrupt([rkeys[i] for i, _ in corrupt], [c for _, c in corrupt])
    heads = [h if a else None for h, a in zip(heads, answered, strict=True)]
    missing = heads.count(None)
    store._count(gets=missing, misses=missing)
    return heads


def read_ranges(store: RedisStore, keys: Sequence[Any], starts: Sequence[int],
                outs: Sequence[memoryview], deadline: float | None = None) -> list[bool]:
    """Bytes ``starts[i]`` onwards of value ``keys[i]``'s payload into ``outs[i]`` (its
    whole length), one pipeline. False where the range did not arrive whole."""
    rkeys = [store.redis_key(k) for k in keys]
    got = [False] * len(keys)
    errors: list[str] = []

    def read(w: Wire, i: int) -> None:
        try:
            n = w.read_bulk_len()
        except ReplyError as e:
            errors.append(str(e))
            return
        if n != outs[i].nbytes:  # the value shrank or went: skip what came
            w.skip(max(n, 0) + 2 if n >= 0 else 0)
            return
        w.read_into(outs[i])
        w.read_crlf()
        got[i] = True

    cmds = [_getrange(k, s, s + o.nbytes - 1) for k, s, o in zip(rkeys, starts, outs,
                                                                  strict=True)]
    window = reply_window(max((o.nbytes for o in outs), default=1))
    answered = store._connections.call("get", rkeys, cmds, read, deadline, window)
    store._note_reply_errors(errors)
    return [g and a for g, a in zip(got, answered, strict=True)]


def check_payloads(store: RedisStore, keys: Sequence[Any], heads: Sequence[Head],
                   payloads: Sequence[memoryview]) -> list[bool]:
    """The last check of values read by ranges: each whole payload against its header's
    checksum (or MAC). A value that fails is counted and deleted; hits are counted."""
    ok = [True] * len(keys)
    bad: list[tuple[bytes, CorruptValue]] = []
    for i, (key, head, payload) in enumerate(zip(keys, heads, payloads, strict=True)):
        try:
            codec.check_payload(head.header, payload, store.mac_key)
        except CorruptValue as c:
            ok[i] = False
            bad.append((store.redis_key(key), c))
    if bad:
        store._drop_corrupt([k for k, _ in bad], [c for _, c in bad])
    hits = sum(ok)
    store._count(gets=len(keys), hits=hits, misses=len(keys) - hits,
                 get_bytes=sum(p.nbytes for p, g in zip(payloads, ok, strict=True) if g))
    return ok
