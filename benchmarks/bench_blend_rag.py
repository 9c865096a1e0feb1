"""Blend quality on a real trained model: RAG prompts of real English text with one planted
fact, documents stored in one order and asked in another.

    python benchmarks/bench_blend_rag.py                       # 64 prompts of ~2k tokens
    python benchmarks/bench_blend_rag.py --tokens 6144 --prompts 16 --settings "..."

Model: SmolLM2-135M-Instruct (kvconnector/smollm2.py, built offline), bf16. Documents:
the reference text of Python's own help topics (``pydoc_data.topics``, shipped with every
Python, not written by us), 3-8 per prompt. One document carries a planted fact ("The
access code for the boiler room is 4417."); the question asks for it. Each prompt's
documents are stored by a first request (another system prompt, the documents in one
order), then asked with the documents shuffled, once per setting.

Per setting: accuracy (the fact's value in the greedy answer), answers identical to vLLM
alone's, the KL of the first answer token from vLLM alone's (over vLLM alone's top-20
tokens; a missing token counts at the setting's 20th logprob) and TTFT (vLLM's own
first-token latency). The TTFT ratio is against full prefill in the same engine (blend off
for that request): on the CPU build an engine without a connector schedules differently
(bench_blend.py). Engines run in processes of their own; each writes a line per prompt as
it goes, so a run that stops is resumed by running it again with the same ``--out``.

Writes docs/results/blend_rag_<tokens>.json and .png (accuracy against TTFT).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

from common import ROOT, pyplot, write_results

CACHE = ROOT / ".cache"
SEPARATOR = " # # "
SYSTEM_STORE = "Read the following documents."
SYSTEM_ASK = "Answer the question using only the documents below."
RATIOS = (0.05, 0.15, 0.3, 0.5)
FULL = "full prefill"
ALONE = "vLLM alone"
#: name -> kv_transfer_params of the asking request (epic's ratio sets its tokens per
#: document, see ``_params``).
SETTINGS: dict[str, dict] = {
    FULL: {"blend": False},
    "ratio 1.0": {"blend_strategy": "attention", "blend_recompute_ratio": 1.0},
    "full reuse": {"blend_strategy": "attention", "blend_recompute_ratio": 0.0},
    **{f"{s} {r}": {"blend_strategy": s, "blend_recompute_ratio": r}
       for s in ("attention", "cacheblend", "epic") for r in RATIOS},
    **{f"attention {r} +sink16": {"blend_strategy": "attention", "blend_recompute_ratio": r,
                                  "blend_sink_tokens": 16} for r in (0.05, 0.15, 0.3)},
    **{f"attention {r} @layer4": {"blend_strategy": "attention", "blend_recompute_ratio": r,
                                  "blend_check_layer": 4} for r in (0.15, 0.3)},
    # Gradual filtering: pick wide at layer 1, narrow at a deeper layer.
    **{f"{s} 0.5 >{n}@{layer}": {"blend_strategy": s, "blend_recompute_ratio": 0.5,
                                 "blend_refine_layer": layer, "blend_refine_ratio": n}
       for s in ("attention", "cacheblend") for n in (0.15, 0.3) for layer in (4, 8)},
    # Picks in groups of consecutive tokens (runs the CPU attention kernel serves cheaply).
    **{f"attention 0.5 >{n}@8 g{g}": {"blend_strategy": "attention", "blend_recompute_ratio": 0.5,
                                      "blend_refine_layer": 8, "blend_refine_ratio": n,
                                      "blend_group_tokens": g}
       for n in (0.15, 0.3) for g in (1, 8, 16)},
}

PLACES = ["boiler room", "east archive", "north tower", "map room", "old library", "lab 7",
          "garden shed", "server hall", "wine cellar", "clock tower", "west gate",
          "music room", "chapel", "harbour office", "observatory", "print shop"]
NAMES = ["Marta", "Olusegun", "Keiko", "Bram", "Ines", "Tomasz", "Aiyana", "Farid", "Lotte",
         "Rafael", "Sunniva", "Dmitri", "Amara", "Jonas", "Priya", "Emeka"]
#: (fact, question): {p} a place, {n} a name, {v} the value asked for. Numbers only: asked
#: for a planted word (a password, a pet's name) the 135M model answers rarely even with
#: full prefill (1-2 of 8 in a probe), which would leave nothing for blend to lose.
FACTS = [
    ("The access code for the {p} is {v}.", "What is the access code for the {p}?"),
    ("{n}'s locker number is {v}.", "What is {n}'s locker number?"),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="prompt length, about")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated subset of: {', '.join(SETTINGS)}")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="results JSON (default docs/results)")
    p.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def _topics() -> list[str]:
    import pydoc_data.topics

    texts = [" ".join(t.split()) for t in pydoc_data.topics.topics.values()]
    return [t for t in texts if len(t) > 3000]


def _fact(rng: random.Random) -> tuple[str, str, str]:
    fact, question = rng.choice(FACTS)
    value = str(rng.randrange(1000, 10000))
    fill = {"p": rng.choice(PLACES), "n": rng.choice(NAMES), "v": value}
    return fact.format(**fill), question.format(**fill), value


def _document(tok, text: str, rng: random.Random, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of ``text`` from a random sentence on, ending a sentence."""
    sentences = text.split(". ")
    out: list[str] = []
    i = rng.randrange(max(1, len(sentences) // 2))
    while i < len(sentences) and len(tok.encode(". ".join(out))) < n_tokens:
        out.append(sentences[i])
        i += 1
    return ". ".join(out).rstrip(".") + "."


def make_prompts(tok, n: int, tokens: int, seed: int) -> list[dict]:
    topics = _topics()
    prompts = []
    for i in range(n):
        rng = random.Random(seed * 100003 + tokens * 7 + i)
        n_docs = rng.randint(3, 8)
        doc_tokens = (tokens - 120) // n_docs
        docs = [_document(tok, t, rng, doc_tokens) for t in rng.sample(topics, n_docs)]
        fact, question, answer = _fact(rng)
        j = rng.randrange(n_docs)
        s = docs[j].split(". ")
        k = rng.randrange(1, max(2, len(s)))
        docs[j] = ". ".join(s[:k] + [fact.rstrip(".")] + s[k:])
        order = list(range(n_docs))
        while order == list(range(n_docs)):
            rng.shuffle(order)
        prompts.append({
            "store": _chat(tok, SYSTEM_STORE, docs, "Summarize the documents."),
            "ask": _chat(tok, SYSTEM_ASK, [docs[o] for o in order], question),
            "answer": answer, "question": question, "fact_doc": order.index(j),
            "docs": n_docs, "doc_tokens": doc_tokens})
    return prompts


def _chat(tok, system: str, docs: list[str], question: str) -> list[int]:
    # Separators on both sides of every document: each is a segment of its own.
    context = SEPARATOR + SEPARATOR.join(docs) + SEPARATOR
    messages = [{"role": "system", "content": system + context},
                {"role": "user", "content": question}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def _params(name: str, prompt: dict) -> dict:
    params = dict(SETTINGS[name])
    if params.get("blend_strategy") == "epic":  # the ratio's share of every document
        params["blend_epic_tokens"] = math.ceil(params.pop("blend_recompute_ratio")
                                                * prompt["doc_tokens"])
    return params


# --- one engine, in its own process ------------------------------------------------------

def run_engine(kind: str, work: Path, settings: list[str], args) -> None:
    """Writes ``work/<kind>.jsonl``: a line per prompt, skipping prompts already there."""
    sys.path.insert(0, str(ROOT))
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from tests.engine_runner import engine_kwargs

    spec = json.loads((work / "spec.json").read_text())
    prompts = spec["prompts"]
    path = work / f"{kind}.jsonl"
    done = len(path.read_text().splitlines()) if path.exists() else 0
    connector = None if kind == ALONE else {
        "memory_capacity": "2GiB", "blend": True, "blend_separator": SEPARATOR,
        "blend_max_cost": 1.0}  # measure every setting blended, ratio 1.0 included
    llm = LLM(**engine_kwargs({"model": spec["model"], "dtype": args.dtype,
                               "kv_cache_bytes": 512 << 20, "log_stats": True,
                               "max_model_len": 8192, "connector": connector},
                              max_logprobs=20))

    def ask(ids: list[int], params: dict | None, max_tokens: int) -> dict:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=20,
                            extra_args={"kv_transfer_params": params} if params else None)
        o = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        first = o.outputs[0].logprobs[0] if o.outputs[0].logprobs else {}
        return {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                "ttft": o.metrics.first_token_latency if o.metrics else None,
                "logprobs": {str(t): lp.logprob for t, lp in first.items()}}

    ask(prompts[0]["store"][:600], None, 1)  # one-time costs of a first request
    with path.open("a") as f:
        for p in tqdm(prompts[done:], desc=kind, initial=done, total=len(prompts)):
            row: dict = {}
            if kind == ALONE:
                row[ALONE] = ask(p["ask"], None, args.answer_tokens)
            else:
                ask(p["store"], None, 1)
                # Full prefill last: it saves the asked prompt under prefix keys.
                for name in [s for s in settings if s != FULL] + [FULL]:
                    row[name] = ask(p["ask"], _params(name, p), args.answer_tokens)
            f.write(json.dumps(row) + "\n")
            f.flush()


# --- scoring -----------------------------------------------------------------------------

def _kl(ref: dict[str, float], got: dict[str, float]) -> float:
    floor = min(got.values()) if got else -30.0
    return sum(math.exp(lp) * (lp - got.get(t, floor)) for t, lp in ref.items())


def score(prompts: list[dict], rows: dict[str, list[dict]], tok) -> dict:
    alone = [r[ALONE] for r in rows[ALONE]]
    names = list(rows["blend"][0])
    table: dict[str, dict] = {}
    reference: list[bool] = []
    for name in [ALONE] + names:
        outs = alone if name == ALONE else [r[name] for r in rows["blend"]]
        correct = [p["answer"].lower() in tok.decode(o["tokens"], skip_special_tokens=True)
                   .lower() for p, o in zip(prompts, outs, strict=False)]
        reference = reference or correct  # vLLM alone's, the first scored
        same = [o["tokens"] == a["tokens"] for o, a in zip(outs, alone, strict=False)]
        kls = [_kl(a["logprobs"], o["logprobs"]) for o, a in zip(outs, alone, strict=False)]
        ttft = [o["ttft"] for o in outs if o["ttft"] is not None]
        full = [r[FULL]["ttft"] for r in rows["blend"]]
        ratio = [o["ttft"] / f for o, f in zip(outs, full, strict=False) if o["ttft"] and f]
        table[name] = {"prompts": len(outs), "accuracy": sum(correct) / len(outs),
                       "lost": sum(r and not c for r, c in zip(reference, correct, strict=False)),
                       "gained": sum(c and not r for r, c in zip(reference, correct, strict=False)),
                       "identical": sum(same) / len(outs), "kl_mean": statistics.fmean(kls),
                       "ttft_s": statistics.median(ttft) if ttft else None,
                       "ttft_vs_full": statistics.median(ratio) if ratio else None,
                       "cached": statistics.median(o["cached"] for o in outs)}
    return table


def format_table(table: dict) -> str:
    lines = ["| setting | accuracy | lost / gained vs vLLM alone | identical to vLLM alone "
             "| KL first token | TTFT (s) | TTFT / full prefill |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in table.items():
        ratio = f"{r['ttft_vs_full']:.2f}" if r["ttft_vs_full"] else ""
        lines.append(f"| {name} | {100 * r['accuracy']:.1f}% | {r['lost']} / {r['gained']} | "
                     f"{100 * r['identical']:.0f}% | "
                     f"{r['kl_mean']:.3f} | {r['ttft_s']:.2f} | {ratio} |")
    return "\n".join(lines)


def _series(name: str) -> tuple[str, float] | None:
    """("attention @layer4", 0.15) for "attention 0.15 @layer4"; None for a lone setting."""
    words = name.split()
    if len(words) < 2 or words[0] not in ("attention", "cacheblend", "epic"):
        return None
    try:
        ratio = float(words[1])
    except ValueError:
        return None
    return " ".join([words[0], *words[2:]]), ratio


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5.5))
    series: dict[str, list[tuple[float, float, float]]] = {}
    lone = 0
    for name, r in result["table"].items():
        if r["ttft_vs_full"] is None:
            continue
        x, y = r["ttft_vs_full"], 100 * r["accuracy"]
        s = _series(name)
        if s is None:
            ax.scatter(x, y, marker="*", s=90, color="black", zorder=3)
            ax.annotate(name, (x, y), fontsize=8, xytext=(-20, -12 if lone % 2 else 6),
                        textcoords="offset points")
            lone += 1
        else:
            series.setdefault(s[0], []).append((s[1], x, y))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", ms=4, label=label)
        for ratio, x, y in pts:
            ax.annotate(f"{ratio:g}", (x, y), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    full = result["table"][FULL]["accuracy"] * 100
    ax.axhline(full, color="grey", lw=0.8, ls="--")
    ax.axhspan(full - 2, full, color="green", alpha=0.08, label="within 2 points of full")
    ax.set_xlabel("TTFT / full prefill (same engine, median); numbers: recompute ratio")
    ax.set_ylabel("answers with the planted fact (%)")
    ax.set_title(f"Blend on SmolLM2-135M-Instruct, {result['prompts']} RAG prompts of "
                 f"~{result['tokens']} tokens (one prompt = {100 / result['prompts']:.1f} "
                 "points)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    args = parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; known: {list(SETTINGS)}")
    if FULL not in settings:
        settings.append(FULL)  # the TTFT baseline
    if args.engine:
        run_engine(args.engine, args.work, settings, args)
        return
    from transformers import AutoTokenizer

    from kvconnector.smollm2 import build_smollm2

    model = str(build_smollm2(CACHE / "smollm2"))
    tok = AutoTokenizer.from_pretrained(model)
    out = args.out or ROOT / "docs" / "results" / f"blend_rag_{args.tokens}.json"
    work = CACHE / f"{out.stem}.work"
    work.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(tok, args.prompts, args.tokens, args.seed)
    spec = {"model": model, "prompts": prompts, "settings": settings}
    spec_path = work / "spec.json"
    if spec_path.exists() and json.loads(spec_path.read_text()) != spec:
        raise SystemExit(f"{work} holds a run with other prompts or settings: remove it")
    spec_path.write_text(json.dumps(spec))
    for kind in (ALONE, "blend"):
        rows_file = work / f"{kind}.jsonl"
        if rows_file.exists() and len(rows_file.read_text().splitlines()) >= len(prompts):
            continue  # measured already: only scored again
        cmd = [sys.executable, __file__, "--engine", kind, "--work", str(work),
               "--settings", ",".join(settings), "--dtype", args.dtype,
               "--answer-tokens", str(args.answer_tokens)]
        subprocess.run(cmd, check=True)
    rows = {k: [json.loads(x) for x in (work / f"{k}.jsonl").read_text().splitlines()]
            for k in (ALONE, "blend")}
    table = score(prompts, rows, tok)
    result = {"model": model, "dtype": args.dtype, "tokens": args.tokens,
              "prompt_tokens_median": statistics.median(len(p["ask"]) for p in prompts),
              "prompts": len(prompts), "table": table}
    print(format_table(table))
    write_results(out, "blend_rag", result)
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
