"""Transfer counters, reported through vLLM's connector stats (logged as 'KV Transfer metrics')."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "loaded_chunks", "loaded_tokens", "loaded_bytes", "load_seconds", "load_errors",
    "saved_chunks", "saved_tokens", "saved_bytes", "save_seconds", "save_errors",
    "hit_tokens", "evictions", "redis_loaded_chunks", "redis_misses",
)


@dataclass
class TransferStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def add(self, **counts: float) -> None:
        for k, v in counts.items():
            self.data[k] = self.data.get(k, 0) + v

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> TransferStats:
        out = TransferStats(dict(self.data))
        out.add(**other.data)
        return out

    def reduce(self) -> dict[str, int | float]:
        d = dict(self.data)
        for op in ("load", "save"):
            secs, nbytes = d.get(f"{op}_seconds", 0), d.get(f"{op}_bytes", 0)
            d[f"{op}_GBps"] = round(nbytes / secs / 1e9, 3) if secs else 0.0
            d[f"{op}_seconds"] = round(secs, 4)
        return d

    def is_empty(self) -> bool:
        return not any(self.data.values())
