"""Prefix reuse demo: many questions over one long shared document, with and without
kvconnector. Prints time to first token (TTFT) for both and checks the answers match.

    python examples/reuse.py                      # tiny random-weight Mistral, built offline
    python examples/reuse.py --model mistralai/Mistral-7B-Instruct-v0.2 --prefix-tokens 6000
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import random
import statistics
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model path or name (default: build a tiny Mistral)")
    p.add_argument("--prefix-tokens", type=int, default=3072, help="shared prefix length")
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--question-tokens", type=int, default=48)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--memory-capacity", default="1GiB", help="kvconnector host memory")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="vLLM's own KV budget (default: 256 MiB for the tiny model)")
    return p.parse_args()


def make_prompts(tokenizer_vocab: int, args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    lo, hi = 10, min(tokenizer_vocab, 30000) - 1
    prefix = [rng.randrange(lo, hi) for _ in range(args.prefix_tokens)]
    return [prefix + [rng.randrange(lo, hi) for _ in range(args.question_tokens)]
            for _ in range(args.questions)]


def run(model: str, prompts: list[list[int]], args: argparse.Namespace,
        kv_transfer_config: dict | None) -> tuple[list[float], list[list[int]], list[int]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=args.prefix_tokens + args.question_tokens + 64,
              kv_transfer_config=kv_transfer_config,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    sp = SamplingParams(temperature=0, max_tokens=1)
    ttfts, answers, cached = [], [], []
    for p in prompts:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        ttfts.append(time.perf_counter() - start)
        answers.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens or 0)
    del llm  # shuts the engine's processes down, so this process can exit
    gc.collect()
    return ttfts, answers, cached


def _child(queue, *args) -> None:
    queue.put(run(*args))


def run_in_fresh_process(*args):
    """One engine per process: vLLM's CPU worker binds threads to cores per process, so two
    engines built one after the other in one process would not get the same cores."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, *args))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    args = parse_args()
    # vLLM's CPU backend reserves an extra core for engines with a KV connector (and drops
    # the reservation on small machines): give both runs the same cores.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1" if not args.model else "0")
    model = args.model
    if model is None:
        from kvconnector.tiny_model import build_tiny_mistral

        model = str(build_tiny_mistral(os.path.join(".cache", "tiny-mistral")))
        vocab = 400
        if args.kv_cache_memory_bytes is None:
            args.kv_cache_memory_bytes = 256 << 20
    else:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts = make_prompts(vocab, args)
    kvt = {"kv_connector": "kvconnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"memory_capacity": args.memory_capacity}}
    base_ttft, base_answers, _ = run_in_fresh_process(model, prompts, args, None)
    kvc_ttft, kvc_answers, cached = run_in_fresh_process(model, prompts, args, kvt)

    print(f"\nmodel {model}: {args.questions} prompts = {args.prefix_tokens}-token shared "
          f"prefix + {args.question_tokens}-token question\n")
    print(f"{'prompt':>6} {'TTFT no cache (s)':>18} {'TTFT kvconnector (s)':>21} "
          f"{'tokens from store':>18}")
    for i, (a, b, c) in enumerate(zip(base_ttft, kvc_ttft, cached, strict=True)):
        print(f"{i:>6} {a:>18.3f} {b:>21.3f} {c:>18}")
    warm_base, warm_kvc = statistics.median(base_ttft[1:]), statistics.median(kvc_ttft[1:])
    print(f"\nmedian TTFT after the first prompt: {warm_base:.3f} s without, {warm_kvc:.3f} s "
          f"with kvconnector ({warm_base / warm_kvc:.1f}x faster)")
    same = base_answers == kvc_answers
    print(f"greedy answers identical: {same}")
    if not same:
        raise SystemExit("answers differ between the runs")


if __name__ == "__main__":
    main()
