"""``kvconnector verify``: read every stored value and check it as an engine would.

With the engines' MAC key, a value's MAC is checked first, against the value's own header:
a value it vouches for was written by a holder of the key and is never deleted for what a
descriptor says, and only descriptors signed with the key are used at all (anyone who can
write to Redis can write a descriptor; the fingerprint's fields are no secret)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields
from typing import Any

import redis

from kvconnector.cli.inventory import CliError, Target, classify, glob_escape, scan
from kvconnector.keys import Fingerprint
from kvconnector.store import codec, descriptor
from kvconnector.store.codec import CorruptValue, ExpectedChunk

MAX_BATCH_BYTES = 64 << 20  # values read per round trip


@dataclass
class Problem:
    key: str
    reason: str
    detail: str


@dataclass
class Report:
    checked: int = 0
    checked_bytes: int = 0
    vanished: int = 0  # deleted between the SCAN and the read
    problems: list[Problem] = field(default_factory=list)
    deleted: int = 0
    warnings: list[str] = field(default_factory=list)
    # fingerprint -> signed values (valid MAC) that differ from its signed descriptor: kept
    differ: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def reasons(self) -> dict[str, int]:
        return dict(Counter(p.reason for p in self.problems))


def _own_expected(chunk_key: str, header: memoryview) -> ExpectedChunk:
    f = codec.unpack_header(header)
    return ExpectedChunk(chunk_key, f["layout"], f["dtype"], tuple(f["shape"]), f["nbytes"])


def check_value(chunk_key: str, value: bytes, desc: descriptor.Descriptor | None,
                mac_key: bytes | None) -> CorruptValue | None:
    """What is wrong with the value stored under ``chunk_key`` (the key without the
    prefix), or None.

    With ``mac_key`` the value is held to its own header (key, field types, payload
    length) and its MAC, never to ``desc``: a valid MAC means a holder of the key wrote it
    (``differs_from`` compares it with a trusted descriptor). Without a key, with the
    fingerprint's descriptor the header is held to what its engines expect; without one,
    to itself; then the checksum."""
    mv = memoryview(value)
    try:
        header_len = codec.check_prefix(mv[:codec.PREFIX_LEN], mv.nbytes)
        header = mv[codec.PREFIX_LEN:codec.PREFIX_LEN + header_len]
        if desc is not None and mac_key is None:
            expected = desc.expected(chunk_key, codec.unpack_header(header))
        else:
            expected = _own_expected(chunk_key, header)
        checked = codec.check_header(header, expected)
        codec.check_payload(checked, mv[codec.PREFIX_LEN + header_len:], mac_key)
    except CorruptValue as c:
        return c
    return None


def differs_from(chunk_key: str, value: bytes, desc: descriptor.Descriptor) -> str | None:
    """How the header of a value that passed ``check_value`` differs from what ``desc``
    says its engines expect (a ``CorruptValue`` reason), or None."""
    mv = memoryview(value)
    try:
        header_len = codec.check_prefix(mv[:codec.PREFIX_LEN], mv.nbytes)
        header = mv[codec.PREFIX_LEN:codec.PREFIX_LEN + header_len]
        codec.check_header(header, desc.expected(chunk_key, codec.unpack_header(header)))
    except CorruptValue as c:
        return c.reason
    return None


def _descriptors(target: Target, report: Report, delete: bool, progress: bool | None,
                 mac_key: bytes | None) -> dict[str, descriptor.Descriptor]:
    """Trusted descriptors by fingerprint; broken ones (with ``mac_key``: unsigned or
    badly signed ones too) are problems, never used."""
    known = {f.name for f in fields(Fingerprint)}
    out: dict[str, descriptor.Descriptor] = {}
    pattern = f"{glob_escape(target.prefix)}:{descriptor.TAG}:*"
    for client, keys in scan(target, pattern, progress, "descriptors"):
        mine = [(k, c) for k in keys if (c := classify(target.prefix, k)) is not None]
        pipe = client.pipeline(transaction=False)
        for k, _ in mine:  # not MGET: a cluster node refuses keys of several slots
            pipe.get(k)
        values = pipe.execute() if mine else []
        bad = []
        for (key, (_, fp, _)), value in zip(mine, values, strict=True):
            if value is None:
                continue
            try:
                desc = descriptor.decode(value, mac_key=mac_key)
            except ValueError as e:
                bad.append(key)
                report.problems.append(Problem(key.decode(), "descriptor", str(e)))
                continue
            if set(desc.fingerprint) != known:
                report.warnings.append(
                    f"{key.decode()}: written by another kvconnector version; its chunks "
                    "are checked against their own headers")
            elif not desc.matches(fp):
                bad.append(key)
                report.problems.append(Problem(key.decode(), "descriptor",
                                               "its fields do not hash to its fingerprint"))
            else:
                out[fp] = desc
        if delete and bad:
            report.deleted += _unlink(client, bad)
    return out


def _unlink(client: redis.Redis, keys: list[bytes]) -> int:
    pipe = client.pipeline(transaction=False)
    for k in keys:  # one key per command: a cluster node refuses multi-slot UNLINK
        pipe.unlink(k)
    return sum(int(n) for n in pipe.execute(raise_on_error=False) if isinstance(n, int))


def verify(target: Target, *, mac_key: bytes | None = None, delete: bool = False,
           progress: bool | None = None) -> Report:
    report = Report()
    try:
        descs = _descriptors(target, report, delete, progress, mac_key)
        head = len(target.prefix) + 1
        for client, keys in scan(target, glob_escape(target.prefix) + ":*", progress,
                                 "verify"):
            chunks = [(k, c[1]) for k in keys
                      if (c := classify(target.prefix, k)) and c[0] == "chunk"]
            if not chunks:
                continue
            pipe = client.pipeline(transaction=False)
            for k, _ in chunks:
                pipe.strlen(k)
            sizes = pipe.execute()
            bad: list[bytes] = []
            batch: list[tuple[bytes, str]] = []
            batch_bytes = 0
            for (key, fp), size in zip(chunks, sizes, strict=True):
                batch.append((key, fp))
                batch_bytes += int(size or 0)
                if batch_bytes >= MAX_BATCH_BYTES:
                    bad += _check_batch(client, batch, descs, mac_key, head, report)
                    batch, batch_bytes = [], 0
            if batch:
                bad += _check_batch(client, batch, descs, mac_key, head, report)
            if delete and bad:
                report.deleted += _unlink(client, bad)
    except redis.RedisError as e:
        raise CliError(f"{target.safe_url}: {type(e).__name__}: {e}") from None
    for fp, reasons in sorted(report.differ.items()):
        report.warnings.append(
            f"{sum(reasons.values())} value(s) of fingerprint {fp} carry a valid MAC but "
            f"differ from its signed descriptor ({', '.join(sorted(reasons))}); kept")
    return report


def _check_batch(client: redis.Redis, batch: list[tuple[bytes, str]],
                 descs: dict[str, descriptor.Descriptor], mac_key: bytes | None, head: int,
                 report: Report) -> list[bytes]:
    pipe = client.pipeline(transaction=False)
    for key, _ in batch:
        pipe.get(key)
    bad = []
    for (key, fp), value in zip(batch, pipe.execute(), strict=True):
        if value is None:
            report.vanished += 1
            continue
        report.checked += 1
        report.checked_bytes += len(value)
        desc = descs.get(fp)
        problem = check_value(key[head:].decode(), value, desc, mac_key)
        if problem is not None:
            bad.append(key)
            report.problems.append(Problem(key.decode(), problem.reason, problem.detail))
        elif mac_key is not None and desc is not None:
            reason = differs_from(key[head:].decode(), value, desc)
            if reason is not None:
                report.differ[fp][reason] += 1
    return bad


def report_json(report: Report) -> dict[str, Any]:
    return {"checked": report.checked, "checked_bytes": report.checked_bytes,
            "vanished": report.vanished, "bad": len(report.problems),
            "reasons": report.reasons(), "deleted": report.deleted,
            "problems": [p.__dict__ for p in report.problems], "warnings": report.warnings}
