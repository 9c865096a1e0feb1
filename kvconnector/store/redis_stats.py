"""The counters of one ``RedisStore`` (exported as metrics by ``kvconnector/metrics.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RedisStoreStats:
    """Counters since the store was made. ``puts``/``put_failed``, ``gets``, ``hits`` and
    ``misses`` count chunks, ``put_bytes``/``get_bytes`` their payload bytes; ``lookups``
    counts ``exists_prefix`` calls (``mirror_lookups`` of them the key mirror answered,
    ``inline_lookups`` read on the asking thread: ``kvconnector/lookups.py``) and
    ``lookup_hits`` the chunks they found. ``errors``, ``timeouts``, ``busy`` (no free
    connection in time) and ``skipped_in_backoff`` count calls (``errors`` also counts
    error replies); ``backoffs`` how often the store entered backoff and ``reconnects``
    the probes that tried Redis again after one."""

    puts: int = 0
    put_bytes: int = 0
    put_failed: int = 0
    gets: int = 0
    get_bytes: int = 0
    hits: int = 0
    misses: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    corrupt: int = 0
    corrupt_deleted: int = 0
    corrupt_reasons: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    timeouts: int = 0
    busy: int = 0
    backoffs: int = 0
    reconnects: int = 0
    skipped_in_backoff: int = 0
    mirror_lookups: int = 0
    inline_lookups: int = 0
