"""The OpenAI-compatible server (multi-process, as users run it) with the connector JSON,
loaded by its short name through the vllm.general_plugins entry point."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import engine_env, prompt

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    port = _free_port()
    kvt = {"kv_connector": "kvconnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"memory_capacity": "64MiB"}}
    env = engine_env(tmp, multiprocess=True)
    env["VLLM_LOG_STATS_INTERVAL"] = "1"
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
         "--port", str(port), "--host", "127.0.0.1", "--kv-transfer-config", json.dumps(kvt),
         "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
         "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "4096"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("server did not start:\n"
                                   + (tmp / "server.log").read_text()[-4000:]) from None
            time.sleep(1)
    yield base, tmp / "server.log"
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_second_completion_is_served_from_store(server, tiny_model):
    base, log_path = server
    body = {"model": tiny_model, "prompt": prompt(7, 700), "max_tokens": 16,
            "temperature": 0}
    first = _post(base + "/v1/completions", body)
    second = _post(base + "/v1/completions", body)
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
              for r in (first, second)]
    assert cached == [0, 512]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    # The connector's counters reach vLLM's periodic stats log.
    deadline = time.time() + 20
    loaded = re.compile(r"KV Transfer metrics: .*loaded_tokens=[1-9]")
    while not loaded.search(log_path.read_text()) and time.time() < deadline:
        _post(base + "/v1/completions", {**body, "max_tokens": 1})
        time.sleep(1.5)
    assert loaded.search(log_path.read_text())
