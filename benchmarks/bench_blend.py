"""CacheBlend: TTFT and quality in one run.

    python benchmarks/bench_blend.py                         # tiny models on this machine
    python benchmarks/bench_blend.py --model mistralai/Mistral-7B-Instruct-v0.2 --dtype bfloat16

TTFT: prompts of 4k and 8k tokens made of 4-8 documents. Each engine first sees the
documents in one order after one system prompt (not timed), then a prompt with the
documents in another order after another system prompt: its TTFT (a one-token generation)
is what is measured, for full prefill (no connector), prefix-only kvconnector (blend off:
only a shared prefix could be reused, and there is none), attention and cacheblend at 0.15
and epic. Every
engine runs in its own process; the median over ``--repeats`` distinct document sets.

On vLLM's CPU build an engine without a KV connector was measured about 2x slower at the
very same prefill than one with a connector (a vLLM CPU scheduling/threading quirk, not work
the connector does). So the blend engine also times a full prefill itself (blend turned off
for that request), and the speed-up is given against that, in the same engine.

Quality: tests/blend_quality.py's table (KL from full prefill and top-1 agreement of the
first token, per strategy) on a peaked-attention test model.

Writes docs/results/blend.json and blend.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

from common import ROOT, pyplot, write_results

sys.path.insert(0, str(ROOT))

from tests import blend_quality  # noqa: E402
from tests.blend_models import build_model, tiny_tokenizer_dir  # noqa: E402
from tests.conftest import run_engine  # noqa: E402

CACHE = ROOT / ".cache"
SEP = blend_quality.SEP
SAME_ENGINE = "full prefill, blend engine"
STRATEGIES = {SAME_ENGINE: {"blend": False},
              "attention 0.15": {"blend_strategy": "attention", "blend_recompute_ratio": 0.15},
              "cacheblend 0.15": {"blend_strategy": "cacheblend", "blend_recompute_ratio": 0.15},
              "epic": {"blend_strategy": "epic"}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="TTFT model (default: the tiny Mistral with --layers)")
    p.add_argument("--layers", type=int, default=8, help="layers of the default TTFT model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quality-trials", type=int, default=32)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(6, vocab) for _ in range(n)]


def _join(segments: list[list[int]]) -> list[int]:
    out: list[int] = []
    for i, s in enumerate(segments):
        out += (SEP if i else []) + s
    return out


def prompt_set(n: int, seed: int, vocab: int) -> dict[str, list[int]]:
    """One document set at length ``n``: the prompt that stores it and, per configuration,
    the reordered prompt to time (each after a system prompt of its own, so no
    configuration finds another's system prompt stored)."""
    rng = random.Random(seed)
    n_docs = max(4, min(8, n // 1000))
    doc_len = (n - 200) // n_docs
    docs = [_tokens(rng, doc_len, vocab) for _ in range(n_docs)]
    out = {"store": _join([[1] + _tokens(rng, 80, vocab), *docs, _tokens(rng, 60, vocab)])}
    shuffled = docs[::-1]
    for name in ("full prefill", "prefix-only kvconnector", *STRATEGIES):
        out[name] = _join([[1] + _tokens(rng, 80, vocab), *shuffled, _tokens(rng, 60, vocab)])
    return out


def ttft(model: str, args, vocab: int, tmp: Path) -> dict:
    lengths = [int(x) for x in args.lengths.split(",")]
    sets = {n: [prompt_set(n, 100 * n + r, vocab) for r in range(args.repeats)]
            for n in lengths}
    warm = prompt_set(2048, 7, vocab)  # first requests of an engine pay one-time costs
    spec = {"model": model, "dtype": args.dtype, "max_model_len": max(lengths + [2048]) + 256,
            "kv_cache_bytes": 512 << 20}
    blend = {"memory_capacity": "2GiB", "blend": True, "blend_separator_ids": SEP}
    configs = {"full prefill": None, "prefix-only kvconnector": {"memory_capacity": "2GiB"},
               "blend": blend}
    times: dict[str, dict[int, list[float]]] = {}
    cached: dict[str, dict[int, list[int]]] = {}
    for cname, extra in configs.items():
        names = list(STRATEGIES) if cname == "blend" else [cname]
        steps = []
        for s in [warm] + [s for n in lengths for s in sets[n]]:
            steps.append({"op": "generate", "prompts": [s["store"]], "max_tokens": 1})
            steps.append({"op": "generate", "prompts": [s[k] for k in names], "max_tokens": 1,
                          "params": [STRATEGIES.get(k, {}) for k in names]})
        print(f"TTFT: {cname} ...", flush=True)
        res = run_engine(tmp / cname.replace(" ", "-"), {
            **spec, "connector": extra, "steps": steps}, runner="blend_runner.py",
            timeout=7200)
        timed = iter(res[3::2])  # skip the warm-up pair
        for n in lengths:
            for _ in range(args.repeats):
                for k, r in zip(names, next(timed), strict=True):
                    times.setdefault(k, {}).setdefault(n, []).append(r["seconds"])
                    cached.setdefault(k, {}).setdefault(n, []).append(r["cached"])
    med = {k: {n: statistics.median(v) for n, v in per.items()} for k, per in times.items()}
    return {"lengths": lengths, "ttft_s": med, "all_s": times, "cached_tokens": cached,
            "documents": {n: max(4, min(8, n // 1000)) for n in lengths}}


def quality(trials: int, tmp: Path) -> dict:
    model = build_model(CACHE / "tiny-llama-peaked", tiny_tokenizer_dir(CACHE), arch="llama",
                        num_layers=3, qk_scale=4.0, logit_scale=8.0, local_bias=3.0)
    pairs, vocab = blend_quality.trials(trials), blend_quality.vocab_size(model)
    spec = {"model": model, "max_model_len": 2048, "max_logprobs": vocab}
    print("quality ...", flush=True)
    res = run_engine(tmp / "quality", {
        **spec, "steps": blend_quality.blend_steps(pairs, vocab),
        "connector": {"memory_capacity": "256MiB", "blend": True, "blend_min_tokens": 200,
                      "blend_max_cost": 1.0, "blend_separator_ids": SEP}},
        runner="blend_runner.py", timeout=7200)
    base = run_engine(tmp / "quality-base", {
        **spec, "steps": blend_quality.baseline_steps(pairs, vocab), "connector": None},
        runner="blend_runner.py", timeout=7200)
    return {"model": model, "table": blend_quality.score(res, base)}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = [k for k in ("ttft", "quality") if k in result]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, panel in zip(axes, panels, strict=True):
        if panel == "ttft":
            t = result["ttft"]
            names = list(t["ttft_s"])
            width = 0.8 / len(names)
            for i, k in enumerate(names):
                ax.bar([j + i * width for j in range(len(t["lengths"]))],
                       [t["ttft_s"][k][n] for n in t["lengths"]], width, label=k)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(t["lengths"]))],
                          [f"{n} tokens" for n in t["lengths"]])
            ax.set_ylabel("TTFT (s)")
            ax.set_title("TTFT, reordered documents")
            ax.legend(fontsize=8)
        else:
            table = result["quality"]["table"]
            ax.barh(list(table), [r["kl_mean"] for r in table.values()])
            ax.invert_yaxis()
            ax.set_xlabel("KL from full prefill, first token (mean)")
            ax.set_title("Quality (peaked test model)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    args = parse_args()
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-blend-") as tmp:
        if not args.skip_ttft:
            if args.model:
                from transformers import AutoConfig

                model, vocab = args.model, min(AutoConfig.from_pretrained(args.model).vocab_size,
                                               30000)
            else:
                from kvconnector.tiny_model import build_tiny_mistral

                model = str(build_tiny_mistral(CACHE / f"tiny-mistral-l{args.layers}",
                                               num_layers=args.layers))
                vocab = 400
            result["ttft"] = {"model": model, **ttft(model, args, vocab, Path(tmp))}
        if not args.skip_quality:
            result["quality"] = quality(args.quality_trials, Path(tmp))
    if "ttft" in result:
        t = result["ttft"]
        print(f"\nTTFT (s), median of {args.repeats}, model {t['model']}")
        ratios = ("attention 0.15", "cacheblend 0.15")
        print("| prompt tokens | " + " | ".join(t["ttft_s"]) + " | "
              + " | ".join(f"{k} / full" for k in ratios) + " |")
        print("|---:|" + "---:|" * (len(t["ttft_s"]) + len(ratios)))
        for n in t["lengths"]:
            full = t["ttft_s"][SAME_ENGINE][n]
            row = " | ".join(f"{t['ttft_s'][k][n]:.3f}" for k in t["ttft_s"])
            print(f"| {n} | {row} | "
                  + " | ".join(f"{t['ttft_s'][k][n] / full:.2f}" for k in ratios) + " |")
    if "quality" in result:
        print(f"\nquality, model {result['quality']['model']}")
        print(blend_quality.format_table(result["quality"]["table"]))
    out = write_results(args.out, "blend", result)
    print(f"results: {out}")
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
