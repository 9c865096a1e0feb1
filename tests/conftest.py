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
    # vLLM compiles some ops with torch.compile even with enforce_eager (the vocabulary
    # embedding under TP, for one). Its cache and the 150 MB header it precompiles first,
    # even when the kernels are cached, live in TMPDIR: every engine (a fresh TMPDIR) spent
    # about 20 s of a core compiling them again.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE / "torchinductor"))
    env.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
    env.update(TMPDIR=str(tmp), HF_HUB_OFFLINE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
               PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="INFO",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc of test functions
    core = worker_core()
    if core is not None:  # one OpenMP thread: two engines' teams on 2 cores would throttle
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core))
    return env


def worker_core() -> int | None:
    """The core this pytest-xdist worker's engines compute on: one each. An in-process
    engine otherwise takes every core for its OpenMP team, and two such teams on 2 cores
    spin-wait for each other (kvconnector/threads.py); vLLM's automatic binding (engines
    in their own processes) would put every worker's engine on the same core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not worker.startswith("gw") or len(cores) < 2:
        return None
    return cores[int(worker[2:]) % len(cores)]


# Modules by how long they take (engines started, tokens computed), slowest first: a
# parallel run hands each worker whole modules in this order (scripts/test.sh turns off
# xdist's own order, by number of tests), and one that started last would keep its worker
# busy after the other had run out of work.
SLOW_MODULES = ("test_mistral7b", "test_differential", "test_smollm2", "test_tensor_parallel",
                "test_blend_engine", "test_disk_engine", "test_engine", "test_operations",
                "test_redis_engine", "test_multiprocess", "test_server", "test_lifecycle",
                "test_redis_faults")


def pytest_collection_modifyitems(config, items) -> None:
    def rank(item) -> int:
        name = item.path.stem
        return SLOW_MODULES.index(name) if name in SLOW_MODULES else len(SLOW_MODULES)

    items.sort(key=rank)  # stable: each module's tests keep their order


HOSTED_RUNNERS = ("engine_runner.py", "blend_runner.py", "differential_runner.py",
                  "mistral_runner.py")
HOST_JOBS = 24  # runs per host process before a fresh one (memory, leaked state)


class EngineHost:
    """One ``tests/engine_host.py`` process that runs in-process engine runs one after
    another: vLLM is imported once, not once per run. ``KVCONNECTOR_TEST_FRESH_PROCESS=1``
    gives every run its own process again."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.replies = None
        self.jobs = 0

    def _start(self, tmp: Path, timeout: float) -> None:
        import select

        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "engine_host.py"), str(write_fd)],
            env=engine_env(tmp / "host"), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, pass_fds=(write_fd,), text=True)
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.jobs = 0
        if not select.select([self.replies], [], [], timeout)[0] or not self.replies.readline():
            self.stop()
            raise RuntimeError("the engine host did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.replies.close()
        self.proc = None

    def run(self, tmp: Path, runner: str, spec_path: Path, out_path: Path,
            timeout: float) -> bool:
        """Run one job; False if it failed (the host is then replaced)."""
        import select

        if self.proc is None or self.proc.poll() is not None or self.jobs >= HOST_JOBS:
            self.stop()
            self._start(tmp, timeout)
        env = engine_env(tmp)
        job = {"runner": runner.removesuffix(".py"), "spec": str(spec_path),
               "out": str(out_path), "log": str(tmp / "engine.log"),
               "env": {k: env[k] for k in ("TMPDIR", "VLLM_ENABLE_V1_MULTIPROCESSING")}}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        self.jobs += 1
        if not select.select([self.replies], [], [], timeout)[0]:
            self.stop()
            raise TimeoutError
        line = self.replies.readline()
        ok = bool(line) and json.loads(line)["ok"]
        if not ok:
            self.stop()
        return ok


_HOST = EngineHost()


@pytest.fixture(scope="session", autouse=True)
def _stop_engine_host():
    yield
    _HOST.stop()


_ENGINE_KEYS = ("model", "connector", "prefix_caching", "dtype", "llm", "kv_cache_bytes",
                "max_model_len", "tp", "policy", "env")


def _log_engines(spec: dict, runner: str) -> None:
    """With ``KVCONNECTOR_TEST_ENGINE_LOG=FILE``, one line per engine a run starts: the
    test and the engine's configuration (steps left out), to find engines started twice
    for the same configuration (``scripts/engine_reuse.py``)."""
    log = os.environ.get("KVCONNECTOR_TEST_ENGINE_LOG")
    if not log:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    engines = spec.get("engines") or [spec]
    with open(log, "a") as f:
        for e in engines:
            config = {k: e.get(k, spec.get(k)) for k in _ENGINE_KEYS}
            f.write(json.dumps({"test": test, "runner": runner, "config": config},
                               sort_keys=True) + "\n")


def run_engine(tmp: Path, spec: dict, *, multiprocess: bool = False, timeout: int = 600,
               runner: str = "engine_runner.py", fresh: bool = False):
    """Run tests/engine_runner.py (or another runner) and return its step results: in the
    session's engine host where the run allows (in-process engines), else (or ``fresh``:
    an engine alongside the host's) in a fresh process."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps(spec))
    _log_engines(spec, runner)
    hosted = (not multiprocess and not fresh and runner in HOSTED_RUNNERS
              and spec.get("tp", 1) == 1
              and os.environ.get("KVCONNECTOR_TEST_FRESH_PROCESS") != "1")
    if hosted:
        try:
            ok = _HOST.run(tmp, runner, spec_path, out_path, timeout)
        except TimeoutError:
            log = (tmp / "engine.log").read_text(errors="replace")
            raise RuntimeError(f"engine run did not finish within {timeout} s (a request "
                               f"that never finishes?):\n{log[-3000:]}") from None
        if not ok:
            log = (tmp / "engine.log").read_text(errors="replace")
            raise RuntimeError(f"engine run failed:\n{log[-6000:]}")
        return json.loads(out_path.read_text())
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
