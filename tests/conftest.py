from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 400) for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kvconnector.tiny_model import build_tiny_mistral

    return str(build_tiny_mistral(CACHE / "tiny-mistral"))


@pytest.fixture(scope="session")
def tiny_mla_model() -> str:
    from kvconnector.tiny_model import build_tiny_deepseek

    return str(build_tiny_deepseek(CACHE / "tiny-deepseek"))


def engine_env(tmp: Path, multiprocess: bool = False) -> dict[str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(TMPDIR=str(tmp), HF_HUB_OFFLINE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
               PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="INFO",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc of test functions
    return env


def run_engine(tmp: Path, spec: dict, *, multiprocess: bool = False, timeout: int = 600,
               runner: str = "engine_runner.py"):
    """Run tests/engine_runner.py (or another runner) in a fresh process and return its step
    results."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps(spec))
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / runner), str(spec_path),
             str(out_path)], env=engine_env(tmp, multiprocess), capture_output=True,
            text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                      for x in (e.stdout, e.stderr))
        (tmp / "engine.log").write_text(log)
        raise RuntimeError(f"engine run did not finish within {timeout} s (a request that "
                           f"never finishes?):\n{log[-3000:]}") from None
    (tmp / "engine.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"engine run failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out_path.read_text())
