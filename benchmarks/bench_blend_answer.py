"""Blend quality beyond the first token: does the selection serve the whole answer?

    python benchmarks/bench_blend_answer.py [--trials 32] [--answer 16]

``bench_blend.py`` measures the first answer token, which vLLM's API returns in full. The
``attention`` strategy picks the tokens to recompute by the prompt's last 8 queries, so
that metric alone could flatter it: later answer tokens ask other questions of the
documents. vLLM cannot force an answer token by token, so this runs kvconnector's own
selective recompute (``kvconnector.blend.recompute.run_blend``, the code the worker runs)
on the quality test model's weights loaded with transformers, without an engine:

1. the storing prompt is prefilled (transformers); its documents' K/V are the store;
2. the reordered prompt is blended by ``run_blend`` into paged K/V (block size 16), per
   strategy, with the prompt's tail after the range as the worker would get it;
3. the rest of the prompt and full prefill's greedy answer are then computed over those
   pages (teacher forcing: what vLLM does after a blend, token by token);
4. every answer position's next-token distribution is compared (KL) with transformers'
   full prefill of prompt + answer.

The first token's numbers cross-check this harness against the engine's in
``bench_blend.py``. Writes docs/results/blend_answer.json and .png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import ROOT, pyplot, write_results

sys.path.insert(0, str(ROOT))

from kvconnector.blend.families import Geometry  # noqa: E402
from kvconnector.blend.pages import TokenPages  # noqa: E402
from kvconnector.blend.plan import BlendJob  # noqa: E402
from kvconnector.blend.recompute import LoadedPiece, Sources, attend, run_blend  # noqa: E402
from kvconnector.blend.segments import find_segments  # noqa: E402
from kvconnector.blend.strategies import attention  # noqa: E402
from kvconnector.layout import describe  # noqa: E402
from tests import blend_quality  # noqa: E402
from tests.blend_models import build_model, tiny_tokenizer_dir  # noqa: E402

BLOCK = 16
STRATEGIES = {"full reuse (ratio 0)": ("cacheblend", 0.0),
              "cacheblend 0.15": ("cacheblend", 0.15),
              "attention 0.15": ("attention", 0.15),
              "ratio 1.0": ("attention", 1.0)}
GROUPS = {"first": (0, 1), "2-4": (1, 4), "5-8": (4, 8), "9-16": (8, 16), "17-32": (16, 32)}


class Layer:
    """A transformers Llama decoder layer in the shape ``run_blend`` drives."""

    def __init__(self, layer, rotary) -> None:
        self.layer, self.a, self.rotary = layer, layer.self_attn, rotary

    def norm_in(self, h, residual):
        r = h if residual is None else h + residual
        return self.layer.input_layernorm(r), r

    def qkv(self, x, positions):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        t, d = x.shape[0], self.a.head_dim
        q = self.a.q_proj(x).view(t, -1, d)
        k = self.a.k_proj(x).view(t, -1, d)
        cos, sin = self.rotary(x, positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
        return q, k, self.a.v_proj(x).view(t, -1, d)

    def post(self, o, residual):
        r = self.a.o_proj(o) + residual
        return self.layer.mlp(self.layer.post_attention_layernorm(r)), r


class Model:
    def __init__(self, path: str) -> None:
        from transformers import LlamaForCausalLM

        self.hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        m, c = self.hf.model, self.hf.config
        self.layers = [Layer(layer, m.rotary_emb) for layer in m.layers]
        self.geometry = Geometry(c.num_hidden_layers, c.num_attention_heads,
                                 c.num_key_value_heads, c.head_dim, c.head_dim ** -0.5, None)
        self.embed = m.embed_tokens
        self.device, self.dtype = torch.device("cpu"), torch.float32

    def mover(self, from_pos: torch.Tensor, to_pos: torch.Tensor, device):
        """Re-rotates keys from ``from_pos[i]`` to ``to_pos[i]``."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        def move(key):
            cos, sin = self.hf.model.rotary_emb(key, (to_pos - from_pos)[None])
            return apply_rotary_pos_emb(key, key, cos[0], sin[0], unsqueeze_dim=1)[1]
        return move

    def logprobs(self, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Full prefill: next-token logprobs at every position, and per layer K/V."""
        out = self.hf(torch.tensor([tokens]), use_cache=True)
        kv = [torch.stack([lay.keys[0], lay.values[0]]).transpose(1, 2)
              for lay in out.past_key_values.layers]
        return out.logits[0].log_softmax(-1), kv


def answer_kl(model: Model, store: list[int], ask: list[int], n_answer: int
              ) -> dict[str, list[float]]:
    toks = list(ask)
    for _ in range(n_answer):  # full prefill's greedy answer
        toks.append(int(model.logprobs(toks)[0][-1].argmax()))
    ref = model.logprobs(toks)[0][len(ask) - 1:-1]
    _, stored = model.logprobs(store)
    at = {tuple(store[a:b]): a for a, b in find_segments(store, blend_quality.SEP)[:-1]}
    end = (len(ask) - 1) // BLOCK * BLOCK
    pieces, doc_starts = [], []
    for a, b in find_segments(ask, blend_quality.SEP)[:-1]:
        p = at.get(tuple(ask[a:b]))
        if p is not None and a < end:
            data = torch.stack([kv[:, p:p + b - a] for kv in stored])
            pieces.append(LoadedPiece(a, data, p))
            doc_starts.append(a)
    g = model.geometry
    out = {}
    for name, (strategy, ratio) in STRATEGIES.items():
        blocks = (len(toks) + BLOCK - 1) // BLOCK
        caches = [torch.zeros((blocks, g.num_kv_heads, BLOCK, 2 * g.head_size))
                  for _ in range(g.num_layers)]
        pages = TokenPages(caches, describe(caches[0], num_kv_heads=g.num_kv_heads,
                                            head_size=g.head_size),
                           BLOCK, g.num_kv_heads, g.head_size)
        sources = Sources(end, 0, pieces, doc_starts, model, (g.num_kv_heads, g.head_size),
                          model.device, model.dtype)
        job = BlendJob("r", 0, end, ask[:end], list(range(end // BLOCK)), [], strategy, ratio,
                       1, 32, tail_ids=ask[end:])
        run_blend(model, pages, job, sources, BLOCK)
        out[name] = rest_kl(model, pages, toks, end, len(ask), ref)
    return out


def rest_kl(model: Model, pages: TokenPages, toks: list[int], end: int, n_prompt: int,
            ref: torch.Tensor) -> list[float]:
    """What vLLM does after the blend: the prompt's rest and the answer over the pages."""
    g = model.geometry
    pos = torch.arange(end, len(toks))
    h, residual = model.embed(torch.tensor(toks[end:])), None
    ids = pages.kernel_ids(list(range(end // BLOCK)))
    for li, layer in enumerate(model.layers):
        x, residual = layer.norm_in(h, residual)
        q, k, v = layer.qkv(x, pos)
        kv = pages.read(li, ids)
        o = attend(q, torch.cat([kv[0], k]), torch.cat([kv[1], v]), pos, g.scale, None)
        h, residual = layer.post(o, residual)
    h = h + residual
    lp = model.hf.lm_head(model.hf.model.norm(h)).log_softmax(-1)[n_prompt - 1 - end:-1]
    return [float((r.exp() * (r - b)).sum()) for r, b in zip(ref, lp, strict=True)]


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, per_pos in result["kl_by_position"].items():
        ax.plot(range(1, len(per_pos) + 1), per_pos, marker=".", label=name)
    ax.set_xlabel("answer token")
    ax.set_ylabel("KL from full prefill (mean over trials)")
    ax.set_title("Blend quality along the answer (teacher forced)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--answer", type=int, default=32, help="answer tokens")
    p.add_argument("--seed", type=int, default=1000, help="first trial's seed (the "
                   "engine's quality table uses 1000)")
    p.add_argument("--layers", type=int, default=3, help="layers of the peaked test model "
                   "(3: the one bench_blend.py and the quality test use)")
    p.add_argument("--window", type=int, default=None, help="prompt tokens whose queries pick "
                   f"the tokens (attention; default {attention.QUERY_WINDOW})")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.window is not None:
        attention.QUERY_WINDOW = args.window
    cache = ROOT / ".cache"
    name = "tiny-llama-peaked" + ("" if args.layers == 3 else f"-l{args.layers}")
    path = build_model(cache / name, tiny_tokenizer_dir(cache), arch="llama",
                       num_layers=args.layers, qk_scale=4.0, logit_scale=8.0, local_bias=3.0)
    model = Model(path)
    per: dict[str, list[list[float]]] = {k: [] for k in STRATEGIES}
    with torch.inference_mode():
        for i, (store, ask) in enumerate(blend_quality.trials(args.trials, args.seed), 1):
            for k, kls in answer_kl(model, store, ask, args.answer).items():
                per[k].append(kls)
            print(f"\rtrial {i}/{args.trials}", end="", flush=True)
    print()
    by_pos = {k: torch.tensor(v).mean(0).tolist() for k, v in per.items()}
    groups = {k: {g: sum(v[a:b]) / len(v[a:b]) for g, (a, b) in GROUPS.items()
                  if b <= len(v)} for k, v in by_pos.items()}
    names = list(next(iter(groups.values())))
    print(f"\nKL from full prefill by answer token, mean over {args.trials} trials, "
          f"model {path}")
    print("| strategy | " + " | ".join(names) + " | all |")
    print("|---|" + "---:|" * (len(names) + 1))
    for k, gr in groups.items():
        print(f"| {k} | " + " | ".join(f"{gr[n]:.4f}" for n in names)
              + f" | {sum(by_pos[k]) / len(by_pos[k]):.4f} |")
    reuse = by_pos["full reuse (ratio 0)"]
    for k in ("cacheblend 0.15", "attention 0.15"):
        share = {g: sum(by_pos[k][a:b]) / sum(reuse[a:b]) for g, (a, b) in GROUPS.items()
                 if b <= len(reuse)}
        print(f"{k}, gap as a share of full reuse's: "
              + ", ".join(f"{g} {v:.2f}" for g, v in share.items())
              + f", whole answer {sum(by_pos[k]) / sum(reuse):.2f}")
    if max(by_pos["ratio 1.0"]) > 1e-3:
        raise SystemExit("ratio 1.0 is not full prefill: this harness is broken")
    out = write_results(args.out, "blend_answer", {
        "model": path, "layers": args.layers, "window": attention.QUERY_WINDOW,
        "trials": args.trials, "seed": args.seed, "block_size": BLOCK,
        "kl_by_position": by_pos, "kl_by_group": groups})
    print(f"results: {out}")
    plot({"kl_by_position": by_pos}, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
