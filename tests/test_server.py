"""The OpenAI-compatible server (multi-process, as users run it) with the connector JSON,
loaded by its short name through the vllm.general_plugins entry point."""

from __future__ import annotations

import re
import time

import pytest

from tests.conftest import prompt
from tests.openai_server import OpenAIServer, cached_tokens

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    kvt = {"kv_connector": "kvconnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"memory_capacity": "64MiB"}}
    with OpenAIServer(tiny_model, tmp_path_factory.mktemp("server"), kvt, args=[
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "4096"],
            env={"VLLM_LOG_STATS_INTERVAL": "1"}) as s:
        yield s


def test_second_completion_is_served_from_store(server):
    body = {"prompt": prompt(7, 700), "max_tokens": 16, "temperature": 0}
    first = server.post("/v1/completions", body)
    second = server.post("/v1/completions", body)
    assert [cached_tokens(r) for r in (first, second)] == [0, 512]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    # The connector's counters reach vLLM's periodic stats log.
    deadline = time.time() + 20
    loaded = re.compile(r"KV Transfer metrics: .*loaded_tokens=[1-9]")
    while not loaded.search(server.log()) and time.time() < deadline:
        server.post("/v1/completions", {**body, "max_tokens": 1})
        time.sleep(1.5)
    assert loaded.search(server.log())
