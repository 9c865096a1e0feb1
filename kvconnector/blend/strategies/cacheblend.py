"""``cacheblend`` (the CacheBlend paper's pick): at the check layer the fresh K/V of every
token is compared with its loaded (re-rotated) K/V, and the loaded tokens that deviate most
are recomputed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconnector.blend.strategies.base import Check, Strategy, register

if TYPE_CHECKING:
    import torch


@register
class CacheBlend(Strategy):
    name = "cacheblend"

    def score(self, at: Check) -> torch.Tensor:
        """Squared distance of the fresh K and V from the loaded, per candidate."""
        k, v = at.loaded[0, at.active], at.loaded[1, at.active]
        return ((at.k.float() - k.float()) ** 2).sum((1, 2)) + (
            (at.v.float() - v.float()) ** 2).sum((1, 2))
