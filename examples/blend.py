"""CacheBlend example: documents reused wherever they appear in the prompt.

Three documents (Python's own help text, with one fact planted in the second) and a
question, in a chat prompt whose documents are separated by " # # ":

    request 1: doc 1, doc 2, doc 3, question 1   (cold: each document is stored)
    request 2: doc 3, doc 2, doc 1, question 2   (reordered: blended)
    request 3: doc 2, doc 3, doc 1, question 2   (reordered again: blended)

Each of requests 2 and 3 is asked twice, blended and with blend off for that request (full
prefill in the same engine), and prints both answers and times. With prefix reuse alone,
reordered documents would reuse nothing.

    python examples/blend.py                      # SmolLM2-135M-Instruct, built offline
    python examples/blend.py --model mistralai/Mistral-7B-Instruct-v0.2   # on a GPU

The default model is SmolLM2-135M-Instruct (kvconnector/smollm2.py): a real trained model,
so the answers are real. Nothing in vLLM is patched: blend is one config key. A process's
first blend pays one-time costs; benchmarks/bench_blend_rag.py measures quality and TTFT
over many prompts (docs/blend.md).
"""

from __future__ import annotations

import argparse
import os
import time

SEPARATOR = " # # "
SYSTEM = "Answer the question using only the documents below."
FACT = "The access code for the boiler room is 4417."
QUESTIONS = ["What are the documents about?", "What is the access code for the boiler room?"]
TOPICS = ("exceptions", "with", "for")  # pydoc_data.topics: help text shipped with Python


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model path or name (default: SmolLM2-135M-Instruct, "
                                   "built offline in .cache/)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--doc-words", type=int, default=500, help="words per document")
    p.add_argument("--strategy", default="attention",
                   choices=["attention", "cacheblend", "epic"])
    p.add_argument("--ratio", type=float, default=None,
                   help="blend_recompute_ratio (default: the connector's)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--memory-capacity", default="2GiB", help="kvconnector host memory")
    p.add_argument("--redis-url", default=None, help="also store documents in Redis")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="vLLM's own KV budget (default: 256 MiB for the default model)")
    return p.parse_args()


def documents(n_words: int) -> list[str]:
    import pydoc_data.topics

    docs = [" ".join(pydoc_data.topics.topics[t].split()[:n_words]) for t in TOPICS]
    words = docs[1].split()
    docs[1] = " ".join(words[:len(words) // 2] + [FACT] + words[len(words) // 2:])
    return docs


def chat_ids(tokenizer, docs: list[str], question: str) -> list[int]:
    # A separator before and after every document: each is a segment of its own.
    context = SEPARATOR + SEPARATOR.join(docs) + SEPARATOR
    messages = [{"role": "system", "content": SYSTEM + context},
                {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    model = args.model
    if model is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from kvconnector.smollm2 import build_smollm2

        model = str(build_smollm2(os.path.join(".cache", "smollm2")))
        if args.kv_cache_memory_bytes is None:
            args.kv_cache_memory_bytes = 256 << 20
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = documents(args.doc_words)
    requests = [chat_ids(tokenizer, [docs[i] for i in order], q)
                for order, q in zip([[0, 1, 2], [2, 1, 0], [1, 2, 0]],
                                    [QUESTIONS[0], QUESTIONS[1], QUESTIONS[1]], strict=True)]
    extra: dict = {"memory_capacity": args.memory_capacity, "blend": True,
                   "blend_separator": SEPARATOR, "blend_strategy": args.strategy}
    if args.ratio is not None:
        extra["blend_recompute_ratio"] = args.ratio
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
    print(f"\nmodel {model}, strategy {args.strategy}")

    def ask(ids: list[int], blend: bool) -> tuple[str, float, int]:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                extra_args={"kv_transfer_params": {"blend": blend}})
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        return (out.outputs[0].text.strip(), time.perf_counter() - start,
                out.num_cached_tokens or 0)

    for i, ids in enumerate(requests, 1):
        q = QUESTIONS[0] if i == 1 else QUESTIONS[1]
        print(f"\nrequest {i}: {len(ids)} prompt tokens; question: {q}")
        runs = [("stored", True)] if i == 1 else [("blended", True), ("full prefill", False)]
        for name, blend in runs:
            text, seconds, cached = ask(ids, blend)
            print(f"  {name:>12}: {seconds:.2f} s, {cached} tokens from the store: {text!r}")


if __name__ == "__main__":
    main()
