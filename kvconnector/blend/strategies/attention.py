"""``attention``: at the check layer, the loaded tokens that the prompt's last
``QUERY_WINDOW`` tokens attend to most (their attention summed over queries and heads) are
recomputed: the K/V the question and the answer will read. The prompt's tail after the
range is computed up to the check layer for these queries only (``needs_tail``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvconnector.blend.strategies.base import Check, Strategy, register

if TYPE_CHECKING:
    import torch

#: Prompt tokens whose queries pick the recomputed tokens; a prompt's last tokens stand for
#: the answer's queries. On the test models 1 to 8 are within 0.03 on the first token and
#: the whole answer, 16 and more worse (docs/benchmarks.md section 7); a few queries are
#: kept as a steadier signal than one.
QUERY_WINDOW = 8


def attention_mass(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, scale: float,
                   window: int | None) -> torch.Tensor:
    """``[T]``: the causal attention that queries ``[A, Hq, D]`` at positions ``q_pos``
    pay each key of ``[T, Hkv, D]`` (positions ``0 .. T-1``), summed over queries and
    heads."""
    import torch

    hq, hkv = q.shape[1], k.shape[1]
    kk = k.float().repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("ahd,thd->hat", q.float(), kk) * scale
    k_pos = torch.arange(k.shape[0], device=q.device)
    mask = k_pos[None] <= q_pos[:, None]
    if window is not None:
        mask &= (q_pos[:, None] - k_pos[None]) < window
    return scores.masked_fill(~mask, -math.inf).softmax(-1).sum((0, 1))


@register
class Attention(Strategy):
    name = "attention"
    needs_tail = True

    def score(self, at: Check) -> torch.Tensor:
        """The attention the prompt's last ``QUERY_WINDOW`` queries (of the candidates,
        then the tail's) pay each candidate, over the whole prompt's keys with the
        candidates' fresh ones."""
        import torch

        assert at.tail is not None
        wq = torch.cat([at.q, at.tail.q])[-QUERY_WINDOW:]
        wpos = torch.cat([at.positions, at.tail.pos])[-QUERY_WINDOW:]
        keys = torch.cat(([at.ctx[0]] if at.ctx is not None else []) +
                         [at.loaded[0], at.tail.k])
        keys[at.start + at.active] = at.k.to(at.loaded.dtype)
        n = at.loaded.shape[1]
        return attention_mass(wq, wpos, keys, at.scale, at.window)[at.start:at.start + n][
            at.active]
