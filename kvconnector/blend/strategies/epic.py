"""``epic`` (EPIC's pick): the first ``epic_tokens`` tokens of every loaded document are
recomputed at every layer, from layer 0; no check layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvconnector.blend.strategies.base import Knobs, Strategy, register

if TYPE_CHECKING:
    import torch


@register
class Epic(Strategy):
    name = "epic"

    def first(self, knobs: Knobs, must: torch.Tensor,
              heads: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return must | heads(knobs.epic_tokens)

    def checks(self, knobs: Knobs, num_layers: int, loaded: int) -> dict[int, float]:
        return {}

    def loaded_work(self, knobs: Knobs, num_layers: int, loaded: int, loaded_docs: int
                    ) -> float:
        return min(1.0, knobs.epic_tokens * loaded_docs / loaded) if loaded else 1.0
