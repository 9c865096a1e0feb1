"""CacheBlend example: documents reused wherever they appear in the prompt.

A system prompt, three documents and a question, separated by the separator (" # # "):

    request 1: system, doc 1, doc 2, doc 3, question 1   (cold: each document is stored)
    request 2: system, doc 2, doc 1, doc 3, question 2   (reordered: blended)
    request 3: system, doc 2, doc 1, doc 3, question 3   (blended again)

Prints each request's generation time, the tokens served from the store and the answer.
With prefix reuse alone, requests 2 and 3 would reuse only the system prompt.

    python examples/blend.py                                    # tiny Mistral, CPU
    python examples/blend.py --model mistralai/Mistral-7B-Instruct-v0.2   # on a GPU

The default model is the tiny random-weight Mistral (kvconnector/tiny_model.py): the
answers are meaningless text, the mechanics are real. Nothing in vLLM is patched: blend is
one config key. Times here say little: on a 2-layer model the check layer is half the
model, and a process's first blend pays one-time costs; benchmarks/bench_blend.py measures
TTFT (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import random
import time

SEPARATOR = " # # "
SYSTEM = "You are a careful assistant. Answer from the documents only."
QUESTIONS = ["Which document mentions the cache first?",
             "What do the documents say about the engine?",
             "Summarise the second document in one sentence."]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model path or name (default: the tiny Mistral, built "
                                   "offline in .cache/)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--doc-words", type=int, default=400, help="words per document")
    p.add_argument("--strategy", default="attention",
                   choices=["attention", "cacheblend", "epic"])
    p.add_argument("--ratio", type=float, default=0.15, help="blend_recompute_ratio")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--memory-capacity", default="2GiB", help="kvconnector host memory")
    p.add_argument("--redis-url", default=None, help="also store documents in Redis")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="vLLM's own KV budget (default: 256 MiB for the tiny model)")
    return p.parse_args()


def documents(n_words: int) -> list[str]:
    from kvconnector.tiny_model import _WORDS

    rng = random.Random(0)
    return [" ".join(rng.choice(_WORDS) for _ in range(n_words)) for _ in range(3)]


def prompt_ids(tokenizer, docs: list[str], order: list[int], question: str) -> list[int]:
    """``system sep doc sep doc sep doc sep question`` as token ids. Each part is tokenized
    on its own, so the separator's ids appear exactly as blend looks for them (text joined
    first could tokenize differently at the seams)."""
    sep = tokenizer.encode(SEPARATOR, add_special_tokens=False)
    ids = tokenizer.encode(SYSTEM)  # with the BOS token, as a prompt starts
    for i in order:
        ids += sep + tokenizer.encode(docs[i], add_special_tokens=False)
    return ids + sep + tokenizer.encode(question, add_special_tokens=False)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    model = args.model
    if model is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from kvconnector.tiny_model import build_tiny_mistral

        model = str(build_tiny_mistral(os.path.join(".cache", "tiny-mistral")))
        if args.kv_cache_memory_bytes is None:
            args.kv_cache_memory_bytes = 256 << 20
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = documents(args.doc_words)
    requests = [prompt_ids(tokenizer, docs, order, q)
                for order, q in zip([[0, 1, 2], [1, 0, 2], [1, 0, 2]], QUESTIONS, strict=True)]
    extra = {"memory_capacity": args.memory_capacity, "blend": True,
             "blend_separator": SEPARATOR, "blend_strategy": args.strategy,
             "blend_recompute_ratio": args.ratio}
    if args.redis_url:
        extra["redis_url"] = args.redis_url
    llm = LLM(model=model, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=max(map(len, requests)) + args.max_tokens + 64,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              kv_transfer_config={"kv_connector": "kvconnector", "kv_role": "kv_both",
                                  "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": extra})
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": tokenizer.encode("warm up")}], sp, use_tqdm=False)
    print(f"\nmodel {args.model or 'tiny Mistral (random weights)'}, strategy {args.strategy}"
          + (f" {args.ratio}" if args.strategy != "epic" else ""))
    for i, ids in enumerate(requests, 1):
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        print(f"\nrequest {i}: {len(ids)} prompt tokens, generated in {seconds:.3f} s, "
              f"{out.num_cached_tokens or 0} tokens served from the store")
        print(f"  question: {QUESTIONS[i - 1]}")
        print(f"  answer:   {out.outputs[0].text.strip()[:120]!r}")
    del llm


if __name__ == "__main__":
    main()
