"""kvconnector's Prometheus metrics on vLLM's ``/metrics`` (``build_prom_metrics``), and the
pieces of ``TransferStats`` that feed them: hit tokens by tier, Redis client counters.

Every metric carries vLLM's own labels (``model_name``, ``engine``); some add one of
their own (``tier``, ``reason``, ``op``, ``kind``). ``docs/operations.md`` lists them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvconnector.stats import GAUGES, SAMPLES

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import VllmConfig

    from kvconnector.metadata import ChunkTransfer
    from kvconnector.store.disk_tier import DiskTier
    from kvconnector.store.redis_store import RedisStore
    from kvconnector.store.tiering import RedisTier

logger = logging.getLogger("kvconnector.metrics")

PREFIX = "vllm:kvconnector_"  # vLLM unregisters "vllm:" collectors when it rebuilds its own
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Family:
    """One exported metric: the stats entry it reads, and its extra label if any."""

    entry: str
    doc: str
    label: str | None = None

    @property
    def name(self) -> str:
        return PREFIX + self.entry


COUNTERS = (
    Family("hit_tokens", "Prompt tokens served from kvconnector's store, by the tier that "
           "held them (memory, disk, redis).", "tier"),
    Family("loaded_chunks", "Chunks copied from the memory tier into vLLM's KV cache."),
    Family("loaded_bytes", "Bytes copied from the memory tier into vLLM's KV cache."),
    Family("layer_loads", "Loads made layer by layer while the forward pass ran (load_by_layer)."),
    Family("saved_chunks", "Chunks copied out of vLLM's KV cache into the memory tier."),
    Family("saved_bytes", "Bytes copied out of vLLM's KV cache into the memory tier."),
    Family("load_errors", "Chunk loads that failed and were recomputed, by reason: missing "
           "(no slot), not_in_slot (never arrived, e.g. a Redis miss or a failed save), "
           "layer_not_awaited (a layer-by-layer load vLLM did not wait for), error.",
           "reason"),
    Family("save_errors", "Chunk saves that failed (the chunk is a later miss)."),
    Family("corrupt_values", "Redis values that failed a codec check and were deleted, by "
           "reason (checksum, mac, key, truncated, ...).", "reason"),
    Family("evictions", "Chunks evicted from the memory tier (least recently used)."),
    Family("redis_chunks", "Chunks read from (op=get) or written to (op=put) Redis.", "op"),
    Family("redis_bytes", "Payload bytes read from (op=get) or written to (op=put) Redis.",
           "op"),
    Family("redis_errors", "Failed Redis calls, by kind: error (connection lost or refused, "
           "error reply), timeout, busy (no free connection).", "kind"),
    Family("redis_backoffs", "Times a Redis client entered backoff after a fault (calls are "
           "misses meanwhile)."),
    Family("redis_reconnects", "Probes that tried Redis again after a backoff."),
    Family("redis_mirror_lookups", "Lookups answered from the Redis key mirror without asking "
           "Redis (redis_key_mirror)."),
    Family("redis_inline_lookups", "Redis lookups of a request alone in the engine read on the "
           "scheduler's thread (the reply came within 5 ms), not the lookup thread's."),
    Family("redis_dropped_puts", "Chunks not sent to Redis because the put queue was full."),
    Family("disk_chunks", "Chunk files read (op=get) or written (op=put) by the disk tier.",
           "op"),
    Family("disk_bytes", "Payload bytes read (op=get) or written (op=put) by the disk tier.",
           "op"),
    Family("disk_errors", "Disk tier faults, by kind: io (a read or write failed), full (a "
           "write refused for want of space: writes pause, then retry), no_room (nothing "
           "could be evicted to make room).", "kind"),
    Family("disk_corrupt_files", "Chunk files that failed a check and were deleted, by reason "
           "(checksum, mac, key, truncated, ...).", "reason"),
    Family("disk_evictions", "Chunk files evicted from the disk tier (least recently used)."),
    Family("disk_dropped_puts", "Chunks not written to disk: the write queue was full, or "
           "writes were paused after the file system refused one."),
    Family("phase_seconds", "Time spent in each of kvconnector's vLLM hooks, by hook (what "
           "the connector costs on vLLM's own threads: the scheduler's, and the worker's "
           "around the forward pass), and busy time of the worker's background threads "
           "(phase=copy_thread, disk_writes, redis_writes).", "phase"),
    Family("blend_requests", "Requests served by blend (documents reused at any position)."),
    Family("blend_loaded_tokens", "Blended tokens whose stored KV was reused."),
    Family("blend_recomputed_tokens", "Blended tokens recomputed (selected, or in no stored "
           "document)."),
    Family("blend_failures", "Blends that failed; vLLM recomputed their range."),
    Family("blend_prefix_unready", "Blends not run because vLLM's prefix-cache hit held "
           "blocks another request computed in the same step; vLLM recomputed their range."),
    Family("blend_doc_errors", "Stored documents a blend could not use (recomputed)."),
    Family("blend_saved_docs", "Documents stored for later blends."),
    Family("blend_unsegmented", "Requests with blend on whose prompt holds no separator "
           "(served by prefix reuse)."),
    Family("blend_declined", "Requests served as usual because blending them would cost "
           "about what full prefill does (blend_max_cost)."),
)
HISTOGRAMS = (
    Family("load_batch_seconds", "Time to check a batch of chunks in the memory tier (one step's "
           "synchronous loads, or one parked request's) and copy them into vLLM's KV cache."),
    Family("chunk_save_seconds", "Time to copy one chunk out of vLLM's KV cache into the memory "
           "tier and seal it (on the CPU build, the time of its step's whole copy)."),
    Family("redis_fetch_seconds", "Time to fetch one request's chunks from Redis (one "
           "pipeline) into memory slots."),
    Family("disk_fetch_seconds", "Time to read one request's chunk files from the disk tier "
           "into memory slots."),
    Family("blend_seconds", "Time to blend one request's range (load, select, recompute)."),
    Family("layer_wait_seconds", "Time the forward pass waited for its layers in one "
           "layer-by-layer load: the part of the load it did not hide."),
)
GAUGE_FAMILIES = (
    Family("memory_slots_used", "Memory-tier slots holding a chunk (or planned to)."),
    Family("memory_slots", "Memory-tier slots in all (memory_capacity / chunk bytes)."),
    Family("disk_write_queue", "Chunks waiting to be written to the disk tier."),
    Family("disk_files", "Chunk files this worker's disk tier knows of (its index)."),
)


def hit_tokens_by_tier(loads: Iterable[ChunkTransfer], block_size: int) -> dict[str, int]:
    """Tokens a step's loads bring in, by the tier they come from."""
    out: dict[str, int] = {}
    for t in loads:
        out[t.source] = out.get(t.source, 0) + block_size * sum(b >= 0 for b in t.block_ids)
    return out


class Tap:
    """A store's running totals (its ``snapshot()``) as the increments since the last call,
    named as ``TransferStats`` counters: ``PLAIN`` maps snapshot fields to counters, and the
    per-reason counts of corrupt values in ``CORRUPT`` become ``{family}.{reason}``."""

    PLAIN: dict[str, str] = {}
    CORRUPT: tuple[str, str] = ("", "")

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def increments(self, snap: dict[str, Any], **more: float) -> dict[str, float]:
        now: dict[str, float] = {name: snap[k] for k, name in self.PLAIN.items()}
        field, family = self.CORRUPT
        for reason, n in snap[field].items():
            now[f"{family}.{reason}"] = n
        now.update(more)
        out = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last = now
        return out


class StoreTap(Tap):
    """A Redis client's counters (of a store, or of a worker's tier: its store and the
    puts it dropped)."""

    PLAIN = {"puts": "redis_chunks.put", "put_bytes": "redis_bytes.put",
             "hits": "redis_chunks.get", "get_bytes": "redis_bytes.get",
             "errors": "redis_errors.error", "timeouts": "redis_errors.timeout",
             "busy": "redis_errors.busy", "backoffs": "redis_backoffs",
             "reconnects": "redis_reconnects", "mirror_lookups": "redis_mirror_lookups",
             "inline_lookups": "redis_inline_lookups"}
    CORRUPT = ("corrupt_reasons", "corrupt_values")

    def counts(self, source: RedisStore | RedisTier | None) -> dict[str, float]:
        if source is None:
            return {}
        store = getattr(source, "redis", source)
        return self.increments(store.snapshot(),
                               redis_dropped_puts=getattr(source, "dropped_puts", 0))


class DiskTap(Tap):
    """A worker's disk tier counters, and its gauges."""

    PLAIN = {"hits": "disk_chunks.get", "get_bytes": "disk_bytes.get",
             "puts": "disk_chunks.put", "put_bytes": "disk_bytes.put",
             "io_errors": "disk_errors.io", "full": "disk_errors.full",
             "put_no_room": "disk_errors.no_room", "evictions": "disk_evictions",
             "dropped_puts": "disk_dropped_puts"}
    CORRUPT = ("corrupt", "disk_corrupt_files")

    def counts(self, tier: DiskTier) -> tuple[dict[str, float], dict[str, float]]:
        snap = tier.snapshot()
        return (self.increments(snap),
                {"disk_write_queue": snap["queued"], "disk_files": snap["files"]})


class PromMetrics(KVConnectorPromMetrics):
    """Registers kvconnector's metrics once per server and records each step's stats."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Counter] = {
            f.entry: self._counter_cls(name=f.name, documentation=f.doc,
                                       labelnames=self._labels(f))
            for f in COUNTERS}
        self._histograms: dict[str, Histogram] = {
            f.entry: self._histogram_cls(name=f.name, documentation=f.doc,
                                         labelnames=self._labels(f), buckets=LATENCY_BUCKETS)
            for f in HISTOGRAMS}
        self._gauges: dict[str, Gauge] = {
            f.entry: self._gauge_cls(name=f.name, documentation=f.doc,
                                     labelnames=self._labels(f),
                                     multiprocess_mode="mostrecent")
            for f in GAUGE_FAMILIES}
        self._labelled = {f.entry for f in COUNTERS if f.label}
        self._children: dict[tuple[str, int, str | None], Any] = {}

    def _labels(self, family: Family) -> list[str]:
        return self._labelnames + ([family.label] if family.label else [])

    def _child(self, metric: Any, entry: str, engine_idx: int, label: str | None) -> Any:
        key = (entry, engine_idx, label)
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx])
            child = self._children[key] = metric.labels(
                *values, *([label] if label is not None else []))
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key == SAMPLES:
                for entry, samples in value.items():
                    hist = self._histograms.get(entry)
                    if hist is not None:
                        child = self._child(hist, entry, engine_idx, None)
                        for s in samples:
                            child.observe(s)
            elif key == GAUGES:
                for entry, v in value.items():
                    gauge = self._gauges.get(entry)
                    if gauge is not None:
                        self._child(gauge, entry, engine_idx, None).set(v)
            elif value:
                entry, _, label = key.partition(".")
                counter = self._counters.get(entry)
                # A labelled family exports its labelled entries only (the plain one, e.g.
                # "load_errors", is their sum, kept for vLLM's log line).
                if counter is None or bool(label) != (entry in self._labelled) or value < 0:
                    continue
                self._child(counter, entry, engine_idx, label or None).inc(value)
