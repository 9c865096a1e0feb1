"""Transfer counters, reported through vLLM's connector stats: logged as 'KV Transfer metrics'
and exported on the server's ``/metrics`` (``kvconnector/metrics.py``).

``data`` holds counters (summed when stats are aggregated; a name ``"family.label"``, such
as ``"load_errors.checksum"``, is one labelled series of ``family``), plus two optional
entries: ``SAMPLES`` (latency observations for histograms) and ``GAUGES`` (the latest value
wins). Everything in it is a str-keyed dict of numbers or lists, so it crosses vLLM's
process boundaries as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "loaded_chunks", "loaded_tokens", "loaded_bytes", "load_seconds", "load_errors",
    "saved_chunks", "saved_tokens", "saved_bytes", "save_seconds", "save_errors",
    "hit_tokens", "evictions", "redis_loaded_chunks", "redis_misses",
)
SAMPLES = "samples"
GAUGES = "gauges"
# Per stats object; vLLM's log line aggregates a whole interval, the histograms one step.
MAX_SAMPLES = 10_000
PHASE = "phase_seconds."
# Phases that run beside vLLM's threads, not on them (worker.py's background threads).
BACKGROUND_PHASES = ("copy_thread", "disk_writes", "redis_writes")
# Parts of a load, timed inside a hook (start_load_kv) or the copy thread: not added again.
LOAD_PHASES = ("disk_fetch", "redis_fetch", "load_copy")


@dataclass
class TransferStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    # Whether ``data`` is this object's alone, made by ``aggregate`` (see there).
    _owned: bool = field(default=False, init=False, repr=False, compare=False)

    def add(self, **counts: float) -> None:
        for k, v in counts.items():
            self.data[k] = self.data.get(k, 0) + v

    def observe(self, **seconds: float) -> None:
        """One latency observation per keyword (a histogram sample)."""
        samples = self.data.setdefault(SAMPLES, {})
        for name, value in seconds.items():
            self._extend(samples, name, [value])

    def observe_many(self, name: str, values: list[float]) -> None:
        self._extend(self.data.setdefault(SAMPLES, {}), name, values)

    def set_gauges(self, **values: float) -> None:
        self.data.setdefault(GAUGES, {}).update(values)

    @staticmethod
    def _extend(samples: dict[str, list[float]], name: str, values: list[float]) -> None:
        kept = samples.setdefault(name, [])
        kept.extend(values[:MAX_SAMPLES - len(kept)])

    def counters(self) -> dict[str, float]:
        return {k: v for k, v in self.data.items() if k not in (SAMPLES, GAUGES)}

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)
        self._owned = False

    def aggregate(self, other: KVConnectorStats) -> TransferStats:
        """``self`` and ``other`` together. vLLM keeps the result and aggregates into it
        again each step (its log line's accumulator), so a result is made once with data of
        its own and later grows in place: copying every sample kept so far at each step
        would cost a step tens of microseconds once the interval's samples pile up. Inputs
        that do not own their data (a step's report, still read by the Prometheus
        histograms) are never changed."""
        out = self if self._owned else TransferStats.copy_of(self)
        samples = out.data.setdefault(SAMPLES, {})
        for name, values in other.data.get(SAMPLES, {}).items():
            out._extend(samples, name, values)
        out.set_gauges(**other.data.get(GAUGES, {}))  # ``other`` is the newer report
        out.add(**other.counters())
        return out

    @staticmethod
    def copy_of(stats: TransferStats) -> TransferStats:
        out = TransferStats(stats.counters())
        out.data[SAMPLES] = {k: list(v) for k, v in stats.data.get(SAMPLES, {}).items()}
        out.set_gauges(**stats.data.get(GAUGES, {}))
        out._owned = True
        return out

    def reduce(self) -> dict[str, int | float]:
        """vLLM's log line: the per-hook timers (on /metrics) become one total, the time
        the connector's hooks took on vLLM's own threads."""
        d: dict[str, int | float] = {}
        hooks = 0.0
        for k, v in self.counters().items():
            if not k.startswith(PHASE):
                d[k] = v
            elif k[len(PHASE):] not in BACKGROUND_PHASES + LOAD_PHASES:
                hooks += v
        if hooks:
            d["hook_seconds"] = round(hooks, 4)
        for op in ("load", "save"):
            secs, nbytes = d.get(f"{op}_seconds", 0), d.get(f"{op}_bytes", 0)
            d[f"{op}_GBps"] = round(nbytes / secs / 1e9, 3) if secs else 0.0
            d[f"{op}_seconds"] = round(secs, 4)
        d.update(self.data.get(GAUGES, {}))
        return d

    def is_empty(self) -> bool:
        """Nothing to report (asked on both halves every step: no copies made)."""
        for k, v in self.data.items():
            if k == SAMPLES:
                if any(v.values()):
                    return False
            elif v:
                return False
        return True
