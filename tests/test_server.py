"""The OpenAI-compatible server (multi-process, as users run it) with the connector JSON,
loaded by its short name through the vllm.general_plugins entry point."""

from __future__ import annotations

import re
import time

import pytest

from tests.conftest import prompt
from tests.openai_server import OpenAIServer, cached_tokens
from tests.redis_server import RedisServer

pytestmark = pytest.mark.engine


PASSWORD = "pw-9f2c7e41-never-in-logs"


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer(password=PASSWORD) as r:
        yield r


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, redis_server):
    """The password reaches the connector through an environment variable, the documented
    way: vLLM prints kv_connector_extra_config (redis_url included) at start-up."""
    extra = {"memory_capacity": "64MiB", "redis_url": f"redis://127.0.0.1:{redis_server.port}",
             "redis_password_env": "KVC_REDIS_PASSWORD"}
    kvt = {"kv_connector": "kvconnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    with OpenAIServer(tiny_model, tmp_path_factory.mktemp("server"), kvt, args=[
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "4096"],
            env={"VLLM_LOG_STATS_INTERVAL": "1", "KVC_REDIS_PASSWORD": PASSWORD}) as s:
        yield s


def test_second_completion_is_served_from_store(server):
    body = {"prompt": prompt(7, 700), "max_tokens": 16, "temperature": 0}
    first = server.post("/v1/completions", body)
    second = server.post("/v1/completions", body)
    assert [cached_tokens(r) for r in (first, second)] == [0, 640]  # to its last full block
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    # The connector's counters reach vLLM's periodic stats log.
    deadline = time.time() + 20
    loaded = re.compile(r"KV Transfer metrics: .*loaded_tokens=[1-9]")
    while not loaded.search(server.log()) and time.time() < deadline:
        server.post("/v1/completions", {**body, "max_tokens": 1})
        time.sleep(1.5)
    assert loaded.search(server.log())


def test_redis_password_never_reaches_the_log(server, redis_server):
    deadline = time.time() + 30
    with redis_server.client() as c:  # the server's chunks reached Redis: it authenticated
        while not c.keys("kvc:*") and time.time() < deadline:
            time.sleep(0.5)
        assert c.keys("kvc:*")
    log = server.log()
    assert f"127.0.0.1:{redis_server.port}" in log  # vLLM did print the connector config
    assert PASSWORD not in log

