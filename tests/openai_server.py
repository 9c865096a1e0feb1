"""vLLM's OpenAI-compatible server in a child process (multi-process, as users run it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tests.conftest import engine_env
from tests.redis_server import free_port


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def cached_tokens(response: dict) -> int:
    return (response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class OpenAIServer:
    """``with OpenAIServer(model, tmp, kv_transfer_config) as s: s.post("/v1/...", body)``"""

    def __init__(self, model: str, tmp: Path, kv_transfer_config: dict, *,
                 args: Sequence[str] = (), env: dict[str, str] | None = None,
                 start_timeout: float = 240) -> None:
        self.model, self.tmp = model, tmp
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        self._cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                     "--model", model, "--port", str(self.port), "--host", "127.0.0.1",
                     "--kv-transfer-config", json.dumps(kv_transfer_config), *args]
        self._env = {**engine_env(tmp, multiprocess=True), **(env or {})}
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None

    def start(self) -> OpenAIServer:
        log = open(self.log_path, "w")
        self._proc = subprocess.Popen(self._cmd, env=self._env, stdout=log,
                                      stderr=subprocess.STDOUT)
        deadline = time.time() + self._start_timeout
        while True:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
                return self
            except OSError:
                if self._proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError("server did not start:\n"
                                       + self.log_path.read_text()[-4000:]) from None
                time.sleep(1)

    def post(self, path: str, body: dict) -> dict:
        return post(self.base + path, {"model": self.model, **body})

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
