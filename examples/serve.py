"""Serving demo: vLLM's OpenAI-compatible server with kvconnector, and a few chat requests
about one long report: the same question twice, another question, then a second turn.
Prints, per request, the prompt tokens, how many came from the store, and the latency.

    python examples/serve.py                  # Mistral-7B stand-in, built offline
    python examples/serve.py --model mistralai/Mistral-7B-Instruct-v0.2

vLLM's own prefix cache is turned off so that every reused token is kvconnector's.
The stand-in has random weights: its answers are meaningless text.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model path or name (default: the Mistral-7B stand-in)")
    p.add_argument("--report-sentences", type=int, default=120,
                   help="length of the shared report (about 16 tokens a sentence)")
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--memory-capacity", default="1GiB", help="kvconnector host memory")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="vLLM's own KV budget (default: 256 MiB for the stand-in)")
    p.add_argument("--port", type=int, default=0, help="default: a free port")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    kvt = {"kv_connector": "kvconnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"memory_capacity": args.memory_capacity}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(args.port),
           "--kv-transfer-config", json.dumps(kvt), "--no-enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-model-len", "8192"]
    if args.kv_cache_memory_bytes:
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")}
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                tail = log_path.read_text()[-3000:]
                raise SystemExit(f"the server did not start; end of {log_path}:\n{tail}") from None
            time.sleep(1)


def chat(base: str, model: str, messages: list[dict], max_tokens: int) -> tuple[dict, float]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.loads(r.read())
    return reply, time.perf_counter() - start


def kvconnector_metrics(base: str) -> list[str]:
    """kvconnector's lines of the server's Prometheus /metrics, summed over labels we skip."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    wanted = {"vllm:kvconnector_hit_tokens_total": "tier",
              "vllm:kvconnector_saved_chunks_total": None,
              "vllm:kvconnector_loaded_chunks_total": None,
              "vllm:kvconnector_memory_slots_used": None, "vllm:kvconnector_memory_slots": None}
    lines = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                label = wanted[sample.name]
                extra = f"{{{label}={sample.labels[label]}}}" if label else ""
                lines.append(f"  {sample.name}{extra} {sample.value:.0f}")
    return lines


def main() -> None:
    args = parse_args()
    from kvconnector.standin import build_mistral_standin, sample_text

    model = args.model
    if model is None:
        print("model: the Mistral-7B stand-in in .cache/ (built on first use, about 15 s)")
        model = str(build_mistral_standin(os.path.join(".cache", "mistral-7b-standin")))
        args.kv_cache_memory_bytes = args.kv_cache_memory_bytes or 256 << 20
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.port = args.port or free_port()
    base = f"http://127.0.0.1:{args.port}"
    log_path = Path(tempfile.mkdtemp(prefix="kvconnector-serve-")) / "server.log"
    print(f"starting vLLM's OpenAI server with kvconnector (log: {log_path})")
    start = time.perf_counter()
    proc = start_server(model, args, log_path)
    try:
        wait_healthy(proc, base, log_path, timeout=900)
        print(f"server ready in {time.perf_counter() - start:.0f} s\n")
        system = {"role": "system", "content": "Answer from this report only.\n\n"
                  + sample_text(0, args.report_sentences)}
        q1 = {"role": "user", "content": "Which machine kept a record of every letter?"}
        q2 = {"role": "user", "content": "What did they measure after moving the bridge?"}
        q3 = {"role": "user", "content": "Say that again in one short sentence."}
        print(f"{'request':<20} {'prompt tokens':>13} {'from store':>10} {'latency':>9}  answer")
        answers = {}
        for name, messages in [("question 1", [system, q1]), ("question 1 again", [system, q1]),
                               ("question 2", [system, q2]), ("question 1, turn 2", None)]:
            if messages is None:  # the client sends the first answer back as text
                messages = [system, q1, {"role": "assistant", "content": answers["question 1"]},
                            q3]
            reply, seconds = chat(base, model, messages, args.answer_tokens)
            usage = reply["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            answers[name] = reply["choices"][0]["message"]["content"] or ""
            print(f"{name:<20} {usage['prompt_tokens']:>13} {cached:>10} {seconds:>8.2f}s  "
                  f"{answers[name][:40]!r}")
        same = answers["question 1"] == answers["question 1 again"]
        print(f"\nthe repeated question got the same answer from stored KV: {same}")
        print(f"\nkvconnector on the server's {base}/metrics (all of them: docs/operations.md):")
        print("\n".join(kvconnector_metrics(base)))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
