"""The selective recompute: fill a request's blended range with KV, layer by layer.

For tokens ``[start, end)`` (the blended range; vLLM's own prefix hit before it is read as
exact context):

- every token that no loaded document covers (separators, documents not in the store, the
  start of the question) is recomputed at every layer;
- the request's strategy (blend/strategies/) says which other tokens are computed from
  layer 0 ("epic": each document's first tokens) and at which check layers it picks: there
  it scores the tokens still computed ("cacheblend": K/V deviation from the loaded;
  "attention": the attention of the prompt's last queries, the prompt's tail after the
  range being carried up to the last check layer for them, never written), and the
  ``ratio`` share of loaded tokens it scores highest go on (ratio 0 is full reuse: no
  check layer, nothing else recomputed);
- with ``sink_tokens``, the first tokens of every loaded document join the pick on top of
  the ratio;
- with a ``refine_layer`` after the check layer (gradual filtering, as in the CacheBlend
  paper), the picked tokens are scored again there by the same strategy and narrowed to
  the ``refine_ratio`` share: the first pick is made wide, at a shallow layer, the second
  at a layer whose attention says more.

From then on only the recomputed tokens are carried through the layers; their queries
attend over every key of the request (loaded or fresh), and their fresh K/V replace the
loaded ones. Each layer's K/V for the whole range is written into the request's blocks
before the next layer reads it, and all of it before vLLM's forward pass runs. With ratio
1.0 every token is recomputed and the result is vLLM's full prefill up to rounding.

The range is computed densely per request over vLLM's own modules. Attention runs on the
request's pages through vLLM's own kernel where the worker has one (CPU), otherwise through
torch's attention over gathered K/V (the same code on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvconnector.blend.families import BlendLayer, BlendModel
from kvconnector.blend.pages import TokenPages
from kvconnector.blend.plan import BlendJob
from kvconnector.blend.rope import ReRotator
from kvconnector.blend.strategies import STRATEGIES, Check

# Attention scores materialised per query chunk (elements): bounds the blend's memory.
_SCORE_ELEMENTS = 1 << 24
_SPAN = 512  # positions covered by one chunk of queries


@dataclass
class LoadedPiece:
    """Stored K/V ``[layers, 2, tokens, H, D]`` for range tokens ``offset ...``, computed at
    positions ``stored_pos ...``."""

    offset: int  # relative to the range start; negative if the piece starts before it
    data: torch.Tensor
    stored_pos: int


class Sources:
    """The loaded K/V of the range, per layer, moved to the range's positions."""

    def __init__(self, num_tokens: int, start: int, pieces: list[LoadedPiece],
                 doc_starts: list[int], rotator: ReRotator, kv_shape: tuple[int, int],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.n, self.start = num_tokens, start
        self.kv_shape = kv_shape
        self.device, self.dtype = device, dtype
        self.pieces: list[tuple[LoadedPiece, int, int]] = []  # piece, first, last row used
        self.has_kv = torch.zeros(num_tokens, dtype=torch.bool)
        to_pos = torch.arange(start, start + num_tokens)
        from_pos = to_pos.clone()  # rows no piece covers stay where they are
        for p in pieces:
            lo, hi = max(0, -p.offset), min(p.data.shape[2], num_tokens - p.offset)
            if hi > lo:
                self.pieces.append((p, lo, hi))
                self.has_kv[p.offset + lo:p.offset + hi] = True
                from_pos[p.offset + lo:p.offset + hi] = torch.arange(p.stored_pos + lo,
                                                                     p.stored_pos + hi)
        # One rotation of the whole range per layer, its cos/sin computed once per blend.
        self.move = rotator.mover(from_pos, to_pos, device)
        self.doc_starts = doc_starts  # range-relative starts of the loaded documents
        self.has_kv = self.has_kv.to(device)

    @property
    def loaded_tokens(self) -> int:
        return int(self.has_kv.sum())

    def doc_heads(self, n: int) -> torch.Tensor:
        """Mask of the first ``n`` tokens of every loaded document inside the range."""
        mask = torch.zeros(self.n, dtype=torch.bool, device=self.device)
        for s in self.doc_starts:
            if s >= 0:  # a document that starts before the range starts in exact context
                mask[s:s + n] = True
        return mask & self.has_kv

    def layer(self, layer: int) -> torch.Tensor:
        """``[2, tokens, H, D]``: loaded K (re-rotated) and V, zeros where nothing is loaded."""
        kv = torch.zeros((2, self.n, *self.kv_shape), dtype=self.dtype, device=self.device)
        for p, lo, hi in self.pieces:
            kv[:, p.offset + lo:p.offset + hi].copy_(p.data[layer, :, lo:hi],
                                                     non_blocking=True)
        kv[0] = self.move(kv[0])
        return kv


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           scale: float, window: int | None) -> torch.Tensor:
    """Causal attention of queries ``[A, Hq, D]`` at ascending positions ``q_pos`` over
    keys and values ``[T, Hkv, D]`` at positions ``0 .. T-1``; returns ``[A, Hq * D]``.

    Queries go in chunks of nearby positions, each over the keys up to its last query
    only, so scattered queries cost about what they would in a causal prefill."""
    a, hq, d = q.shape
    out = torch.empty((a, hq, d), dtype=q.dtype, device=q.device)
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    k_pos = torch.arange(k.shape[0], device=q.device)
    rows = max(1, _SCORE_ELEMENTS // max(1, hq * k.shape[0]))
    first, last = int(q_pos[0]), int(q_pos[-1])
    edges = torch.arange(first - first % _SPAN, last + _SPAN + 1, _SPAN, device=q.device)
    bounds = torch.searchsorted(q_pos, edges).tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        for s in range(lo, hi, rows):
            e = min(hi, s + rows)
            qp = q_pos[s:e]
            t = int(qp[-1]) + 1  # later keys are masked for every query of the chunk
            k0 = max(0, int(qp[0]) - window + 1) if window is not None else 0
            mask = k_pos[None, k0:t] <= qp[:, None]
            if window is not None:
                mask &= (qp[:, None] - k_pos[None, k0:t]) < window
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1)[None], kt[:, :, k0:t], vt[:, :, k0:t],
                attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
            out[s:e] = o[0].transpose(0, 1)
    return out.reshape(a, hq * d)


def pick_top(score: torch.Tensor, active: torch.Tensor, n: int, group: int) -> torch.Tensor:
    """Indices (ascending) into ``active`` (ascending token indices) of the ``n`` best
    scored, or, with ``group`` > 1, of the best aligned groups of ``group`` tokens by their
    summed score, as many groups as it takes to reach ``n`` tokens."""
    if group == 1 or n <= 0 or n >= len(active):
        return torch.topk(score, max(0, n)).indices.sort().values
    ids, members = torch.unique_consecutive(active // group, return_inverse=True)
    totals = torch.zeros(len(ids), dtype=torch.float64, device=score.device)
    totals.index_add_(0, members, score.to(torch.float64))  # a forced token's inf wins
    order = torch.argsort(totals, descending=True, stable=True)
    sizes = torch.bincount(members, minlength=len(ids))[order]
    taken = int(torch.searchsorted(torch.cumsum(sizes, 0), n)) + 1
    chosen = torch.zeros(len(ids), dtype=torch.bool, device=score.device)
    chosen[order[:taken]] = True
    return chosen[members].nonzero().squeeze(1)


@dataclass
class BlendResult:
    tokens: int  # the range
    loaded: int  # tokens a stored document covered
    recomputed: int  # tokens carried through every layer


#: ``attend(q, kv_layer, kernel block table, q_pos, scale, window)``: attention over the
#: request's paged K/V (vLLM's own kernel where the platform has one).
PagedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float,
                           "int | None"], torch.Tensor]


class _Tail:
    """The prompt's tokens after the range, carried up to the last check layer only so
    that the prompt's last queries can pick the tokens to recompute (a strategy's
    ``needs_tail``); their K/V is never written (vLLM computes these tokens itself)."""

    def __init__(self, model: BlendModel, job: BlendJob) -> None:
        dev = model.device
        self.pos = torch.arange(job.end, job.end + len(job.tail_ids), device=dev)
        self.h = model.embed(torch.tensor(job.tail_ids, dtype=torch.long, device=dev))
        self.residual: torch.Tensor | None = None
        self.q: torch.Tensor  # this layer's, set by ``qkv``
        self.k: torch.Tensor
        self.v: torch.Tensor

    def qkv(self, layer: BlendLayer) -> None:
        x, self.residual = layer.norm_in(self.h, self.residual)
        self.q, self.k, self.v = layer.qkv(x, self.pos)

    def attend(self, layer: BlendLayer, ctx: torch.Tensor | None, kv: torch.Tensor,
               scale: float, window: int | None) -> None:
        keys, values = self.keys(ctx, kv)
        o = attend(self.q, keys, values, self.pos, scale, window)
        self.h, self.residual = layer.post(o, self.residual)

    def keys(self, ctx: torch.Tensor | None, kv: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the whole prompt: context, range, tail."""
        parts = [ctx] if ctx is not None else []
        keys = torch.cat([p[0] for p in parts] + [kv[0], self.k])
        return keys, torch.cat([p[1] for p in parts] + [kv[1], self.v])


def run_blend(model: BlendModel, pages: TokenPages, job: BlendJob, sources: Sources,
              block_size: int, paged: PagedAttention | None = None) -> BlendResult:
    """Fill the job's range; ``paged`` attends over the pages (already holding the layer's
    K/V for the whole request), otherwise torch attention over gathered K/V."""
    g = model.geometry
    dev = model.device
    n = job.end - job.start
    positions = torch.arange(job.start, job.end, device=dev)
    tokens = torch.tensor(job.token_ids, dtype=torch.long, device=dev)
    ctx_ids = pages.kernel_ids(job.block_ids[:job.start // block_size])
    range_ids = pages.kernel_ids(job.block_ids[job.start // block_size:job.end // block_size])
    table = pages.kernel_ids(job.block_ids[:job.end // block_size]).to(torch.int32)
    must = ~sources.has_kv
    n_loaded = n - int(must.sum())
    strategy = STRATEGIES[job.strategy]
    active = strategy.first(job, must, sources.doc_heads).nonzero().squeeze(1)
    checks = strategy.checks(job, g.num_layers, n_loaded)  # layer -> share kept from there
    last_check = max(checks, default=None)
    forced = must | sources.doc_heads(job.sink_tokens) if job.sink_tokens else must
    tail = _Tail(model, job) if checks and strategy.needs_tail else None
    h = model.embed(tokens[active]) if active.numel() else None
    residual: torch.Tensor | None = None
    last = g.num_layers - 1
    for li, layer in enumerate(model.layers):
        kv = sources.layer(li)
        if h is None:  # nothing left to recompute: the loaded K/V is the answer
            pages.write(li, range_ids, kv)
            continue
        x, residual = layer.norm_in(h, residual)
        q, k, v = layer.qkv(x, positions[active])
        ctx = pages.read(li, ctx_ids) if tail is not None and job.start else None
        if tail is not None:
            tail.qkv(layer)
        if li in checks:  # scored before the fresh K/V replace the loaded
            score = strategy.score(Check(active, q, k, v, positions[active], kv, job.start,
                                         g.scale, g.sliding_window, ctx, tail))
        kv[0, active], kv[1, active] = k, v
        pages.write(li, range_ids, kv)
        if tail is not None and li != last_check:
            tail.attend(layer, ctx, kv, g.scale, g.sliding_window)
        if li in checks:  # keep the forced tokens and the top share of the loaded ones
            keep = forced[active]
            score[keep] = math.inf
            n_pick = min(len(active), int(keep.sum()) + math.ceil(checks[li] * n_loaded))
            pick = pick_top(score, active, n_pick, job.group_tokens)
            q, residual, active = q[pick], residual[pick], active[pick]
            if li == last_check:
                tail = None
            if not active.numel():
                h = None
                continue
        if li == last:
            break
        if paged is not None:
            o = paged(q, pages.layers[li], table, positions[active], g.scale,
                      g.sliding_window)
        else:
            keys, values = kv[0], kv[1]
            if job.start:
                ctx = pages.read(li, ctx_ids) if ctx is None else ctx
                keys, values = torch.cat([ctx[0], keys]), torch.cat([ctx[1], values])
            o = attend(q, keys, values, positions[active], g.scale, g.sliding_window)
        h, residual = layer.post(o, residual)
    return BlendResult(n, n_loaded, int(active.numel()))
