"""The vLLM versions and modes kvconnector accepts, and what it tells vLLM about itself."""

from __future__ import annotations

import logging

import pytest

from kvconnector import compat
from kvconnector.config import ConfigError


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.33.0", "0.33.2.dev7+g1234abc"])
def test_supported_vllm_versions_start(version):
    compat.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0"])
def test_other_vllm_versions_are_refused_with_a_clear_message(version, monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(compat.UnsupportedVLLM) as e:
        compat.check_vllm_version(version)
    assert f"kvconnector supports vLLM 0.32, 0.33, but vLLM {version} is installed" in str(
        e.value)
    assert compat.ALLOW_UNTESTED_ENV in str(e.value)


def test_untested_vllm_can_be_allowed_explicitly(monkeypatch, caplog):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="kvconnector.compat"):
        compat.check_vllm_version("0.34.0")
    assert "vLLM 0.34.0 is installed" in caplog.text


def test_the_installed_vllm_is_supported():
    compat.check_vllm_version()


def test_sleep_mode_is_refused_at_start_up(tiny_model):
    """vLLM refuses enable_sleep_mode on CPU itself, so the flag is set on a real config
    after it is built, as it would be on a GPU."""
    from vllm.config import ModelConfig, VllmConfig

    model_config = ModelConfig(model=tiny_model)
    compat.check_sleep_mode(VllmConfig(model_config=model_config))
    model_config.enable_sleep_mode = True
    with pytest.raises(ConfigError, match="does not support vLLM's sleep mode"):
        compat.check_sleep_mode(VllmConfig(model_config=model_config))


@pytest.mark.parametrize(("part", "value", "reason"), [
    ("parallel_config", {"tensor_parallel_size": 2},
     "tensor parallelism (TP=2) is not supported yet"),
    ("parallel_config", {"pipeline_parallel_size": 2},
     "pipeline parallelism (PP=2) is not supported"),
    ("cache_config", {"cache_dtype": "fp8"}, "the KV cache dtype fp8 differs from the model dtype"),
])
def test_blend_names_what_it_cannot_serve_from_vllms_own_config(tiny_model, part, value, reason):
    """Real vLLM configs, built as an engine builds them, without starting one."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    model_config = ModelConfig(model=tiny_model)
    assert compat.blend_unsupported_reason(VllmConfig(model_config=model_config)) is None
    kinds = {"parallel_config": ParallelConfig, "cache_config": CacheConfig}
    config = VllmConfig(model_config=model_config, **{part: kinds[part](**value)})
    assert compat.blend_unsupported_reason(config) == reason


def test_hits_are_labelled_host_memory_disk_and_external():
    labels = compat.hit_source_labels()
    assert {tier: label.value for tier, label in labels.items()} == {
        "memory": "host", "disk": "disk", "redis": "external_unspecified"}


def _spare_in_a_bound_child(world_size: int, queue) -> None:
    """As vLLM's CPU worker: bound to one core, a child of a process that may use all."""
    import os
    from types import SimpleNamespace

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size,
                                                          data_parallel_size=1))
    queue.put(compat.spare_cores(cfg))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_lone_cpu_worker_finds_the_cores_vllm_left_spare(world_size):
    """A worker bound to one core, under a parent on all of them: the others are spare,
    unless other ranks of the same engine compute there."""
    import multiprocessing
    import os

    allowed = os.sched_getaffinity(0)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_spare_in_a_bound_child, args=(world_size, queue))
    child.start()
    spare = queue.get(timeout=30)
    child.join(30)
    want = allowed - {min(allowed)} if world_size == 1 else set()
    assert spare == want
