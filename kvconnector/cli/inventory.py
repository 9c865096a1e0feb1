"""What kvconnector holds in a Redis (or Redis Cluster): connecting, SCANning every primary,
telling chunk keys from descriptors, and the per-fingerprint inventory.

Keys under a deployment's prefix ``P``::

    P:{fingerprint hex}:{tp rank}:{chain hash hex}   a chunk (store/redis_store.py)
    P:fp:{fingerprint hex}                            its descriptor (store/descriptor.py)

Anything else under ``P:`` is not kvconnector's and is never touched. Only SCAN is used
(never KEYS), on each primary of a cluster.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis

from kvconnector.keys import HASH_BYTES
from kvconnector.store import descriptor
from kvconnector.store.redis_url import redact_url, url_userinfo_problem

SCAN_COUNT = 1000
_HEX = rf"[0-9a-f]{{{2 * HASH_BYTES}}}"
_CHUNK = re.compile(rf"^(?P<fp>{_HEX}):(?P<rank>\d+):{_HEX}$".encode())
_DESCRIPTOR = re.compile(rf"^{descriptor.TAG}:(?P<fp>{_HEX})$".encode())
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


class CliError(Exception):
    """A problem the user can fix (bad URL, unreachable Redis, missing secret)."""


@dataclass
class Target:
    """The Redis deployment a command works on: one client per primary."""

    safe_url: str
    prefix: str
    cluster: bool
    clients: list[redis.Redis]
    names: list[str]

    def close(self) -> None:
        for c in self.clients:
            c.close()


def connect(url: str, prefix: str, password: str | None = None) -> Target:
    """Clients for ``url``: a single server, or (``redis+cluster://``, or a server that says
    it is a cluster node) every primary of the cluster."""
    safe = redact_url(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix", *_CLUSTER_SCHEMES):
        raise CliError(f"unsupported URL {safe!r}: use redis://, rediss://, unix://, "
                       "redis+cluster:// or rediss+cluster://")
    problem = url_userinfo_problem(url)
    if problem is not None:
        problem = problem.replace("redis_password_env / redis_password_file",
                                  "--password-env / --password-file")
        raise CliError(f"{safe}: {problem}")
    kw: dict[str, Any] = {"socket_timeout": 30, "socket_connect_timeout": 5, "protocol": 2}
    if password is not None:
        kw["password"] = password
    cluster = scheme in _CLUSTER_SCHEMES
    if cluster:
        url = _CLUSTER_SCHEMES[scheme] + url[len(scheme):]
    try:
        if not cluster:
            single = redis.Redis.from_url(url, **kw)
            if single.info("cluster").get("cluster_enabled") != 1:
                return Target(safe, prefix, False, [single], [safe])
            single.close()
        from redis.cluster import RedisCluster

        rc = RedisCluster.from_url(url, **kw)
        primaries = rc.get_primaries()
        return Target(safe, prefix, True, [rc.get_redis_connection(n) for n in primaries],
                      [n.name for n in primaries])
    except redis.AuthenticationError as e:
        raise CliError(f"{safe}: authentication failed ({e}); give the password with "
                       "--password-env or --password-file") from None
    except redis.RedisError as e:
        raise CliError(f"{safe}: {type(e).__name__}: {e}") from None
    except ValueError as e:  # redis-py's URL parser; its message may quote the password
        raise CliError(f"{safe}: not a valid Redis URL ({type(e).__name__})") from None


def glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class Progress:
    """A tqdm bar on stderr when it is a terminal (or forced); otherwise nothing."""

    def __init__(self, enabled: bool | None, total: int | None, desc: str, unit: str) -> None:
        self._bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr,
                             dynamic_ncols=True, leave=False)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def scan(target: Target, pattern: str, progress: bool | None = None,
         desc: str = "scanning") -> Iterator[tuple[redis.Redis, list[bytes]]]:
    """(client, keys) batches of every key matching ``pattern`` on every primary. The bar
    counts keys examined against DBSIZE (SCAN examines about COUNT keys a call)."""
    try:
        total = sum(int(c.dbsize()) for c in target.clients)
    except redis.RedisError as e:
        raise CliError(f"{target.safe_url}: {type(e).__name__}: {e}") from None
    bar = Progress(progress, total, desc, "key")
    seen = 0
    try:
        for client, name in zip(target.clients, target.names, strict=True):
            cursor = 0
            while True:
                try:
                    cursor, keys = client.scan(cursor, match=pattern, count=SCAN_COUNT)
                except redis.RedisError as e:
                    raise CliError(f"{name}: SCAN failed: {type(e).__name__}: {e}") from None
                step = min(SCAN_COUNT, max(total - seen, 0))
                seen += step
                bar.update(step)
                if keys:
                    yield client, keys
                if cursor == 0:
                    break
    finally:
        bar.close()


def classify(prefix: str, key: bytes) -> tuple[str, str, int] | None:
    """("chunk", fingerprint hex, rank) or ("descriptor", fingerprint hex, -1) for
    kvconnector's keys under ``prefix``; None for anything else."""
    head = prefix.encode() + b":"
    if not key.startswith(head):
        return None
    rest = key[len(head):]
    if m := _CHUNK.match(rest):
        return "chunk", m["fp"].decode(), int(m["rank"])
    if m := _DESCRIPTOR.match(rest):
        return "descriptor", m["fp"].decode(), -1
    return None


@dataclass
class Group:
    """The chunks of one fingerprint."""

    fingerprint: str
    chunks: int = 0
    bytes: int = 0
    ranks: set[int] = field(default_factory=set)
    idle_s: list[int] = field(default_factory=list)  # min, max (OBJECT IDLETIME)
    ttl_s: list[float] = field(default_factory=list)  # min, max of those with a TTL
    descriptor: descriptor.Descriptor | None = None
    descriptor_error: str | None = None
    has_descriptor_key: bool = False

    def _span(self, span: list, value: float | None) -> None:
        if value is None:
            return
        if not span:
            span.extend([value, value])
        else:
            span[0], span[1] = min(span[0], value), max(span[1], value)

    def add_chunk(self, rank: int, nbytes: int, idle: int | None, ttl_ms: int | None) -> None:
        self.chunks += 1
        self.bytes += nbytes
        self.ranks.add(rank)
        self._span(self.idle_s, idle)
        self._span(self.ttl_s, ttl_ms / 1000 if ttl_ms is not None and ttl_ms >= 0 else None)

    def to_json(self) -> dict[str, Any]:
        d = self.descriptor
        return {"fingerprint": self.fingerprint, "model": d.model if d else None,
                "namespace": d.namespace if d else None,
                "descriptor": None if d is None else {
                    **d.fingerprint, "chunk_layout": d.layout, "chunk_dtype": d.dtype,
                    "chunk_shape": list(d.shape), "chunk_nbytes": d.nbytes,
                    "written_at": d.written_at},
                "descriptor_error": self.descriptor_error,
                "chunks": self.chunks, "bytes": self.bytes, "ranks": sorted(self.ranks),
                "newest_idle_s": self.idle_s[0] if self.idle_s else None,
                "oldest_idle_s": self.idle_s[1] if self.idle_s else None,
                "ttl_s_min": self.ttl_s[0] if self.ttl_s else None,
                "ttl_s_max": self.ttl_s[1] if self.ttl_s else None}


@dataclass
class Inventory:
    groups: dict[str, Group] = field(default_factory=dict)
    other_keys: int = 0
    scanned_at: float = field(default_factory=time.time)

    def group(self, fp: str) -> Group:
        g = self.groups.get(fp)
        if g is None:
            g = self.groups[fp] = Group(fp)
        return g

    @property
    def chunks(self) -> int:
        return sum(g.chunks for g in self.groups.values())

    @property
    def bytes(self) -> int:
        return sum(g.bytes for g in self.groups.values())


def _reply(x: Any) -> Any:
    return None if isinstance(x, Exception) else x


def take_inventory(target: Target, progress: bool | None = None) -> Inventory:
    """Every chunk and descriptor under the prefix: sizes, ages, what each fingerprint is."""
    inv = Inventory()
    pattern = glob_escape(target.prefix) + ":*"
    for client, keys in scan(target, pattern, progress, "stats"):
        pipe = client.pipeline(transaction=False)
        parsed = []
        for key in keys:
            kind = classify(target.prefix, key)
            if kind is None:
                inv.other_keys += 1
                continue
            parsed.append((key, kind))
            if kind[0] == "chunk":
                pipe.strlen(key)
                pipe.object("idletime", key)
                pipe.pttl(key)
            else:
                pipe.get(key)
        try:
            replies = iter(pipe.execute(raise_on_error=False))
        except redis.RedisError as e:
            raise CliError(f"{target.safe_url}: {type(e).__name__}: {e}") from None
        for _key, (what, fp, rank) in parsed:
            group = inv.group(fp)
            if what == "chunk":
                nbytes, idle, ttl = (_reply(next(replies)) for _ in range(3))
                if nbytes:  # 0: deleted since the SCAN
                    group.add_chunk(rank, int(nbytes), idle, ttl)
            else:
                value = _reply(next(replies))
                if value is None:
                    continue
                group.has_descriptor_key = True
                try:
                    group.descriptor = descriptor.decode(value)
                    if not group.descriptor.matches(fp):
                        group.descriptor_error = "its fields do not hash to its fingerprint"
                except ValueError as e:
                    group.descriptor_error = str(e)
    return inv
