"""Engines whose KV bytes differ never load each other's chunks, even under one model path
and one Redis: other weights written over the model, random ("dummy") weights, another
dtype. Everything that changes the KV is in the keys' fingerprint (issue 21)."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import prompt, run_engine
from tests.redis_server import RedisServer

pytestmark = pytest.mark.engine

P = prompt(900, 700)  # two full chunks and a block


def _rewrite_weights(model_dir) -> None:
    """Other weights under the same path, as a fine-tune saved over the original would be."""
    import torch
    from safetensors.torch import load_file, save_file

    for f in model_dir.glob("*.safetensors"):
        tensors = {k: (v * 1.01).contiguous() if v.is_floating_point() else v
                   for k, v in load_file(f).items()}
        save_file(tensors, f, metadata={"format": "pt"})
    assert torch  # the import above is what safetensors.torch needs


def test_engines_that_compute_other_kv_never_share_chunks(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    req = [[{"prompt": P, "max_tokens": 4}]]
    with RedisServer() as redis:
        extra = {"memory_capacity": "64MiB", "redis_url": redis.url}
        same = {"connector": extra, "batches": req}
        first = run_engine(tmp_path / "first", {"model": str(model), "engines": [
            same,  # stores P in Redis
            same,  # control: a new engine of the same model loads it
            {**same, "llm": {"load_format": "dummy"}},
            {**same, "dtype": "bfloat16"},
        ]}, runner="differential_runner.py")
        _rewrite_weights(model)
        second = run_engine(tmp_path / "second", {"model": str(model), "engines": [same]},
                            runner="differential_runner.py")
    cached = [r["outputs"][0][0]["cached"] for r in first + second]
    assert cached[:2] == [0, 640], cached
    assert cached[2:] == [0, 0, 0], "dummy weights, bf16, new weights: nothing to share"
    assert first[1]["totals"]["redis_loaded_chunks"] == 3
