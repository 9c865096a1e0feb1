"""A process that runs engine test runs one after another, so that vLLM is imported once
per test session instead of once per run (about 10 s each on 2 cores).

Started by ``tests/conftest.py``'s ``run_engine``; reads one JSON job a line on stdin
(``runner``, ``spec``, ``out``, ``log``, ``env``), runs ``tests/<runner>.main(spec, out)``
with stdout and stderr sent to the job's log and the job's environment, shuts down every
engine the run made, and answers one JSON line on its own channel. A job that fails leaves
the process to be replaced (its state is not trusted after that)."""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import tempfile
import traceback

_ENGINES: list = []


def _track_engines() -> None:
    """Remember every ``LLM`` a run makes, to shut it down once the run is over."""
    from vllm import LLM

    init = LLM.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _ENGINES.append(self)

    LLM.__init__ = tracked


def _close_engines() -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    while _ENGINES:
        llm = _ENGINES.pop()
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            traceback.print_exc()
        del llm
    ensure_kv_transfer_shutdown()
    gc.collect()


def _run(job: dict) -> dict:
    saved_env = dict(os.environ)
    os.environ.update(job["env"])
    tempfile.tempdir = None  # TMPDIR is the job's
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        runner = importlib.import_module(f"tests.{job['runner']}")
        runner.main(job["spec"], job["out"])
        return {"ok": True}
    except BaseException:
        traceback.print_exc()
        return {"ok": False}
    finally:
        try:
            _close_engines()
        except Exception:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in (log, *saved_fds):
            os.close(fd)
        os.environ.clear()
        os.environ.update(saved_env)
        tempfile.tempdir = None


def main() -> None:
    reply = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    import vllm  # noqa: F401  (the cost this process exists to pay once)

    _track_engines()
    reply.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        result = _run(json.loads(line))
        reply.write(json.dumps(result) + "\n")
        if not result["ok"]:
            break


if __name__ == "__main__":
    main()
