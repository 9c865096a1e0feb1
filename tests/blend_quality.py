"""Blend quality, measured: the first-token distribution of reordered-document prompts
against full prefill (KL divergence, top-1 agreement), per strategy. Used by the quality
test and by benchmarks/bench_blend.py.

Each trial stores four documents from one prompt (system prompt A, documents in order,
question A), then asks a prompt with system prompt B, the same documents shuffled and
question B: every document is reused at another position after other context.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

SEP = [4, 5]  # token ids that random documents below never contain

STRATEGIES: dict[str, dict] = {
    "full reuse (ratio 0)": {"blend_recompute_ratio": 0.0},
    "cacheblend 0.05": {"blend_strategy": "cacheblend", "blend_recompute_ratio": 0.05},
    "cacheblend 0.15": {"blend_strategy": "cacheblend", "blend_recompute_ratio": 0.15},
    "cacheblend 0.3": {"blend_strategy": "cacheblend", "blend_recompute_ratio": 0.3},
    "attention 0.05": {"blend_strategy": "attention", "blend_recompute_ratio": 0.05},
    "attention 0.15": {"blend_strategy": "attention", "blend_recompute_ratio": 0.15},
    "attention 0.3": {"blend_strategy": "attention", "blend_recompute_ratio": 0.3},
    "epic (32 tokens)": {"blend_strategy": "epic", "blend_epic_tokens": 32},
    "ratio 1.0": {"blend_recompute_ratio": 1.0},
}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(6, 400) for _ in range(n)]


def _join(segments: list[list[int]]) -> list[int]:
    out: list[int] = []
    for i, s in enumerate(segments):
        out += (SEP if i else []) + s
    return out


def trials(n: int, seed: int = 1000) -> list[tuple[list[int], list[int]]]:
    """``n`` (storing prompt, reordered prompt) pairs."""
    out = []
    for t in range(n):
        rng = random.Random(seed + t)
        docs = [_tokens(rng, rng.randrange(150, 350)) for _ in range(4)]
        store = _join([[1] + _tokens(rng, 40), *docs, _tokens(rng, 30)])
        shuffled = docs[:]
        rng.shuffle(shuffled)
        out.append((store, _join([[1] + _tokens(rng, 50), *shuffled, _tokens(rng, 40)])))
    return out


def vocab_size(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def blend_steps(pairs: list[tuple[list[int], list[int]]], vocab: int) -> list[dict]:
    steps: list[dict] = []
    for store, ask in pairs:
        steps.append({"op": "generate", "prompts": [store], "max_tokens": 1})
        steps.append({"op": "generate", "prompts": [ask] * len(STRATEGIES), "max_tokens": 1,
                      "logprobs": vocab, "params": list(STRATEGIES.values())})
    return steps


def baseline_steps(pairs: list[tuple[list[int], list[int]]], vocab: int) -> list[dict]:
    return [{"op": "generate", "prompts": [ask for _, ask in pairs], "max_tokens": 1,
             "logprobs": vocab}]


def kl(p: dict[str, float], q: dict[str, float]) -> float:
    """KL(p || q) of two full next-token distributions given as logprobs."""
    return sum(math.exp(lp) * (lp - q[t]) for t, lp in p.items())


def score(blend_results: list, baseline_results: list) -> dict[str, dict[str, float]]:
    """Per strategy: mean and max KL from full prefill, and top-1 agreement."""
    base = baseline_results[0]
    asked = blend_results[1::2]
    table = {}
    for si, name in enumerate(STRATEGIES):
        kls = [kl(b["logprobs"], a[si]["logprobs"]) for a, b in zip(asked, base, strict=True)]
        agree = sum(a[si]["tokens"][0] == b["tokens"][0] for a, b in zip(asked, base,
                                                                         strict=True))
        table[name] = {"kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
                       "top1": agree / len(kls), "trials": len(kls)}
    return table


def format_table(table: dict[str, dict[str, float]]) -> str:
    lines = ["| strategy | KL from full prefill (mean) | KL (max) | top-1 agreement |",
             "|---|---:|---:|---:|"]
    for name, r in table.items():
        lines.append(f"| {name} | {r['kl_mean']:.4f} | {r['kl_max']:.4f} | "
                     f"{r['top1'] * r['trials']:.0f}/{r['trials']:.0f} |")
    return "\n".join(lines)
