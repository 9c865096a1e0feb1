"""kvconnector's stats and Prometheus metrics without an engine: aggregation across workers
and steps, what reaches vLLM's registry, and the Redis client counters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from kvconnector.connector import KVConnector
from kvconnector.metadata import ChunkTransfer
from kvconnector.metrics import COUNTERS, GAUGE_FAMILIES, HISTOGRAMS, StoreTap, hit_tokens_by_tier
from kvconnector.stats import MAX_SAMPLES, TransferStats
from kvconnector.store.redis_store import RedisStore
from tests.redis_server import free_port

LABELS = {"model_name": "m", "engine": "0"}


@pytest.fixture
def prom():
    unregister_vllm_metrics()
    metrics = KVConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        {Counter: Counter, Gauge: Gauge, Histogram: Histogram}, ["model_name", "engine"],
        {0: ["m", "0"]})
    yield metrics
    unregister_vllm_metrics()


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {**LABELS, **labels})


def test_stats_aggregate_counters_samples_and_gauges():
    a, b = TransferStats(), TransferStats()
    a.add(loaded_chunks=2, **{"load_errors.checksum": 1})
    a.observe(load_batch_seconds=0.5)
    a.set_gauges(memory_slots_used=3)
    b.add(loaded_chunks=1, **{"load_errors.checksum": 2, "load_errors.missing": 1})
    b.observe(load_batch_seconds=0.25)
    b.set_gauges(memory_slots_used=5)
    out = a.aggregate(b)
    assert out.data["loaded_chunks"] == 3
    assert out.data["load_errors.checksum"] == 3 and out.data["load_errors.missing"] == 1
    assert out.data["samples"]["load_batch_seconds"] == [0.5, 0.25]
    assert out.data["gauges"]["memory_slots_used"] == 5  # the newer report wins
    assert a.data["samples"]["load_batch_seconds"] == [0.5]  # inputs unchanged
    out.add(**{"phase_seconds.start_load_kv": 0.25, "phase_seconds.get_finished": 0.125,
               "phase_seconds.copy_thread": 4.0, "phase_seconds.redis_fetch": 0.2,
               "phase_seconds.load_copy": 0.05})
    reduced = out.reduce()
    assert reduced["memory_slots_used"] == 5 and "samples" not in reduced
    # vLLM's log line: the hooks' time on vLLM's threads as one total, no per-hook keys;
    # a load's parts (a fetch, the copy) are inside a hook or the copy thread: not added twice
    assert reduced["hook_seconds"] == 0.375 and not any("phase" in k for k in reduced)
    assert all(isinstance(v, (int, float)) for v in reduced.values())


def test_stats_aggregate_as_vllm_accumulates_steps():
    """vLLM's log line keeps ``acc = acc.aggregate(step)``: the first result has data of its
    own, later ones grow it in place; no step's report changes (Prometheus reads them)."""
    steps = []
    for i in range(4):
        s = TransferStats()
        s.add(loaded_chunks=i + 1)
        s.observe(load_batch_seconds=float(i))
        s.set_gauges(memory_slots_used=i)
        steps.append(s)
    acc = steps[0]
    for s in steps[1:]:
        acc = acc.aggregate(s)
    assert acc is not steps[0]
    assert acc.data["loaded_chunks"] == 10
    assert acc.data["samples"]["load_batch_seconds"] == [0.0, 1.0, 2.0, 3.0]
    assert acc.data["gauges"]["memory_slots_used"] == 3
    for i, s in enumerate(steps):
        assert s.data["loaded_chunks"] == i + 1
        assert s.data["samples"]["load_batch_seconds"] == [float(i)]
        assert s.data["gauges"]["memory_slots_used"] == i
    again = acc.aggregate(steps[1])
    assert again is acc and acc.data["loaded_chunks"] == 12
    for _ in range(MAX_SAMPLES):
        acc = acc.aggregate(steps[2])
    assert len(acc.data["samples"]["load_batch_seconds"]) == MAX_SAMPLES
    # A step's report rebuilt from its data (as vLLM's loggers do) owns nothing.
    rebuilt = KVConnector.build_kv_connector_stats(acc.data)
    assert rebuilt.aggregate(steps[0]) is not rebuilt


def test_stats_empty_and_capped():
    s = TransferStats()
    assert s.is_empty()
    s.set_gauges(memory_slots=4)
    assert not s.is_empty()
    s = TransferStats()
    s.observe(chunk_save_seconds=0.1)
    assert not s.is_empty()
    for _ in range(MAX_SAMPLES + 10):
        s.observe(chunk_save_seconds=0.1)
    assert len(s.data["samples"]["chunk_save_seconds"]) == MAX_SAMPLES


def test_hit_tokens_by_tier_counts_only_blocks_loaded():
    loads = [ChunkTransfer("r", 0, b"a", 1, [-1, 7]), ChunkTransfer("r", 1, b"b", 2, [8, 9]),
             ChunkTransfer("r", 2, b"c", 3, [10, 11], source="redis"),
             ChunkTransfer("r", 3, b"d", 0, [12, -1], source="disk")]
    assert hit_tokens_by_tier(loads, 128) == {"memory": 384, "redis": 256, "disk": 128}


def test_prom_metrics_record_a_step(prom):
    s = TransferStats()
    s.add(loaded_chunks=2, loaded_bytes=1000, load_errors=3, hit_tokens=768,
          **{"hit_tokens.memory": 512, "hit_tokens.redis": 256, "load_errors.checksum": 2,
             "load_errors.not_in_slot": 1, "corrupt_values.mac": 1, "redis_backoffs": 1,
             "someone_elses_counter": 5})
    s.observe(load_batch_seconds=0.002, redis_fetch_seconds=0.3)
    s.observe(load_batch_seconds=0.004)
    s.set_gauges(memory_slots_used=3, memory_slots=4)
    prom.observe(s.data, 0)
    prom.observe(s.data, 0)  # counters accumulate, gauges are set
    assert value("vllm:kvconnector_hit_tokens_total", tier="memory") == 1024
    assert value("vllm:kvconnector_hit_tokens_total", tier="redis") == 512
    assert value("vllm:kvconnector_loaded_chunks_total") == 4
    assert value("vllm:kvconnector_load_errors_total", reason="checksum") == 4
    assert value("vllm:kvconnector_load_errors_total", reason="not_in_slot") == 2
    assert value("vllm:kvconnector_corrupt_values_total", reason="mac") == 2
    assert value("vllm:kvconnector_redis_backoffs_total") == 2
    assert value("vllm:kvconnector_load_batch_seconds_count") == 4
    assert value("vllm:kvconnector_load_batch_seconds_sum") == pytest.approx(0.012)
    assert value("vllm:kvconnector_load_batch_seconds_bucket", le="0.0025") == 2
    assert value("vllm:kvconnector_redis_fetch_seconds_count") == 2
    assert value("vllm:kvconnector_memory_slots_used") == 3
    assert value("vllm:kvconnector_memory_slots") == 4


def test_every_family_is_registered_under_vllms_prefix(prom):
    names = {m.name for m in REGISTRY.collect()}
    for f in (*COUNTERS, *HISTOGRAMS, *GAUGE_FAMILIES):
        assert f.name.startswith("vllm:kvconnector_")  # unregistered with vLLM's own
        assert f.name in names


def test_store_tap_reports_increments_of_a_real_client():
    """A store pointed at a port nobody listens on: its first call fails and backs off."""
    store = RedisStore(f"redis://127.0.0.1:{free_port()}", backoff_initial_s=0.05)
    tap = StoreTap()
    assert tap.counts(store) == {}
    store.exists_prefix(["a", "b"], 1.0)
    first = tap.counts(store)
    assert first["redis_errors.error"] == 1 and first["redis_backoffs"] == 1
    assert tap.counts(store) == {}  # nothing new since
    store.exists_prefix(["a"], 1.0)  # still in backoff: skipped, no new error
    assert "redis_errors.error" not in tap.counts(store)
    store.close()


def test_a_fault_while_gathering_stats_costs_the_report_not_the_engine(caplog):
    from kvconnector.connector import KVConnector

    class Broken:
        def take_stats(self):
            raise RuntimeError("dictionary changed size during iteration")

    connector = object.__new__(KVConnector)  # only the routing to a half is under test
    connector._worker, connector._scheduler = Broken(), None
    assert connector.get_kv_connector_stats() is None
    assert "gathering transfer stats failed" in caplog.text


def test_hooks_add_their_time_to_the_phase_timers():
    """``phase_seconds``: what each vLLM hook costs on vLLM's own thread (issue 24)."""
    import time

    from kvconnector.connector import _timed

    class Half:
        def __init__(self) -> None:
            self._phases: dict[str, float] = {}

        @_timed
        def build_connector_meta(self) -> int:
            time.sleep(0.01)
            return 5

        @_timed
        def get_finished(self) -> None:
            raise RuntimeError("a hook that fails still took its time")

    h = Half()
    assert h.build_connector_meta() == 5 and h.build_connector_meta() == 5
    with pytest.raises(RuntimeError):
        h.get_finished()
    assert h._phases["build_connector_meta"] >= 0.02 and "get_finished" in h._phases
    assert "phase_seconds" in {f.entry for f in COUNTERS}
