"""The selective recompute: fill a request's blended range with KV, layer by layer.

For tokens ``[start, end)`` (the blended range; vLLM's own prefix hit before it is read as
exact context):

- every token that no loaded document covers (separators, documents not in the store, the
  start of the question) is recomputed at every layer;
- "cacheblend": layers below the check layer are computed for every token; at the check
  layer the fresh K/V of every token is compared with its loaded (re-rotated) K/V, and the
  ``ratio`` share of loaded tokens that deviate most join the recomputed set (ratio 0 is
  full reuse: no check layer, nothing else recomputed);
- "attention": as cacheblend, but the tokens picked at the check layer are those the
  prompt's last ``QUERY_WINDOW`` tokens attend to most (their attention summed over
  queries and heads): the KV the question and the answer will read. The prompt's tail
  after the range is computed up to the check layer for these queries only, never written;
- with ``sink_tokens``, the first tokens of every loaded document join the attention or
  cacheblend pick on top of the ratio;
- with a ``refine_layer`` after the check layer (gradual filtering, as in the CacheBlend
  paper), the picked tokens are scored again there by the same strategy and narrowed to
  the ``refine_ratio`` share: the first pick is made wide, at a shallow layer, the second
  at a layer whose attention says more;
- "epic": the first ``epic_tokens`` tokens of every loaded document join it, from layer 0.

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

# Attention scores materialised per query chunk (elements): bounds the blend's memory.
_SCORE_ELEMENTS = 1 << 24
_SPAN = 512  # positions covered by one chunk of queries
#: Prompt tokens whose queries pick the recomputed tokens ("attention"); a prompt's last
#: tokens stand for the answer's queries. On the test models 1 to 8 are within 0.03 on the
#: first token and the whole answer, 16 and more worse (docs/benchmarks.md section 7); a
#: few queries are kept as a steadier signal than one.
QUERY_WINDOW = 8


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
        self.rotator, self.kv_shape = rotator, kv_shape
        self.device, self.dtype = device, dtype
        self.pieces: list[tuple[LoadedPiece, int, int]] = []  # piece, first, last row used
        self.has_kv = torch.zeros(num_tokens, dtype=torch.bool)
        for p in pieces:
            lo, hi = max(0, -p.offset), min(p.data.shape[2], num_tokens - p.offset)
            if hi > lo:
                self.pieces.append((p, lo, hi))
                self.has_kv[p.offset + lo:p.offset + hi] = True
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
            src = p.data[layer, :, lo:hi].to(self.device, non_blocking=True)
            a, b = p.offset + lo, p.offset + hi
            kv[0, a:b] = self.rotator.move(src[0], p.stored_pos + lo, self.start + a)
            kv[1, a:b] = src[1]
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


def attention_mass(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, scale: float,
                   window: int | None) -> torch.Tensor:
    """``[T]``: the causal attention that queries ``[A, Hq, D]`` at positions ``q_pos``
    pay each key of ``[T, Hkv, D]`` (positions ``0 .. T-1``), summed over queries and
    heads."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.float().repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("ahd,thd->hat", q.float(), kk) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    mask = k_pos[None] <= q_pos[:, None]
    if window is not None:
        mask &= (q_pos[:, None] - k_pos[None]) < window
    return scores.masked_fill(~mask, -math.inf).softmax(-1).sum((0, 1))


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
    """The prompt's tokens after the range, carried up to the check layer only so that the
    prompt's last queries can pick the tokens to recompute ("attention"); their K/V is
    never written (vLLM computes these tokens itself)."""

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

    def mass(self, q: torch.Tensor, q_pos: torch.Tensor, ctx: torch.Tensor | None,
             kv: torch.Tensor, start: int, scale: float, window: int | None) -> torch.Tensor:
        """Per range token: the attention the prompt's last ``QUERY_WINDOW`` queries (of
        the range's ``q`` at ``q_pos``, then the tail's) pay it."""
        wq = torch.cat([q, self.q])[-QUERY_WINDOW:]
        wpos = torch.cat([q_pos, self.pos])[-QUERY_WINDOW:]
        keys, _ = self.keys(ctx, kv)
        return attention_mass(wq, wpos, keys, scale, window)[start:start + kv.shape[1]]


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
    checks: dict[int, float] = {}  # layer -> share of the loaded tokens kept from there on
    if job.strategy == "epic":
        active = (must | sources.doc_heads(job.epic_tokens)).nonzero().squeeze(1)
    elif job.recompute_ratio == 0:  # full reuse: only what nothing covers
        active = must.nonzero().squeeze(1)
    else:
        active = torch.arange(n, device=dev)
        if job.recompute_ratio < 1 and n_loaded:
            first = min(job.check_layer, g.num_layers - 1)
            checks[first] = job.recompute_ratio
            refine = min(job.refine_layer, g.num_layers - 1)
            if refine > first and job.refine_ratio < job.recompute_ratio:
                checks[refine] = job.refine_ratio  # gradual filtering: narrow the pick
    last_check = max(checks, default=None)
    forced = must | sources.doc_heads(job.sink_tokens) if job.sink_tokens else must
    tail = _Tail(model, job) if checks and job.strategy == "attention" else None
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
        if li in checks and job.strategy == "cacheblend":  # deviation from the loaded K/V
            score = ((k.float() - kv[0, active].float()) ** 2).sum((1, 2)) + (
                (v.float() - kv[1, active].float()) ** 2).sum((1, 2))
        kv[0, active], kv[1, active] = k, v
        pages.write(li, range_ids, kv)
        ctx = pages.read(li, ctx_ids) if tail is not None and job.start else None
        if tail is not None:
            tail.qkv(layer)
            if li in checks:
                score = tail.mass(q, positions[active], ctx, kv, job.start, g.scale,
                                  g.sliding_window)[active]
            if li != last_check:
                tail.attend(layer, ctx, kv, g.scale, g.sliding_window)
        if li in checks:  # keep the forced tokens and the top share of the loaded ones
            keep = forced[active]
            score[keep] = math.inf
            n_pick = min(len(active), int(keep.sum()) + math.ceil(checks[li] * n_loaded))
            pick = torch.topk(score, n_pick).indices.sort().values
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
