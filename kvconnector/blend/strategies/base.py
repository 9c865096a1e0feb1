"""What a blend's selection strategy is: which loaded tokens it recomputes, and where it
picks them. One strategy is one subclass of ``Strategy`` in a file of its own, registered
with ``register``; ``blend_strategy`` (blend/config.py) accepts the registered names.

A strategy sees tensors only as arguments: this module and the strategies import torch
where they compute, so that reading the config (and the ``kvconnector`` command) does not
load torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class Knobs(Protocol):
    """The settings a strategy reads: a ``BlendConfig`` or a ``BlendJob``."""

    recompute_ratio: float
    check_layer: int
    refine_layer: int
    refine_ratio: float
    sink_tokens: int
    epic_tokens: int


class Tail(Protocol):
    """The prompt's tokens after the range at a check layer (``Strategy.needs_tail``)."""

    q: torch.Tensor  # [tail tokens, Hq, D]
    k: torch.Tensor  # [tail tokens, Hkv, D]
    pos: torch.Tensor


@dataclass
class Check:
    """A check layer as ``Strategy.score`` sees it, before the fresh K/V of the computed
    tokens replace the loaded. Rows of ``loaded`` are the range's tokens."""

    active: torch.Tensor  # the range tokens still computed, ascending: the candidates
    q: torch.Tensor  # their fresh queries [A, Hq, D], keys and values [A, Hkv, D]
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # their prompt positions
    loaded: torch.Tensor  # [2, range tokens, Hkv, D]: loaded K (re-rotated) and V, zeros
    start: int  # the range's first prompt position
    scale: float
    window: int | None
    ctx: torch.Tensor | None = None  # [2, start, Hkv, D]: K/V before the range (needs_tail)
    tail: Tail | None = None  # needs_tail


class Strategy:
    """The default is a picking strategy: every token is computed up to the check layer;
    there ``score`` ranks the loaded tokens and the ``recompute_ratio`` share that ranks
    highest goes on through the later layers (narrowed again to ``refine_ratio`` at a later
    ``refine_layer``). Tokens no document covers, and each document's first ``sink_tokens``,
    are always computed; ratio 0 computes only them, ratio 1 every token."""

    name = ""
    #: ``score`` reads the queries of the prompt's tokens after the range: the recompute
    #: carries them up to the last check layer (``Check.tail``, ``Check.ctx``).
    needs_tail = False

    def first(self, knobs: Knobs, must: torch.Tensor,
              heads: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """Mask of the range tokens computed from layer 0; ``must``: those no loaded
        document covers; ``heads(n)``: the first ``n`` tokens of every loaded document."""
        return must if knobs.recompute_ratio == 0 else must.new_ones(must.shape)

    def checks(self, knobs: Knobs, num_layers: int, loaded: int) -> dict[int, float]:
        """Check layer -> share of the ``loaded`` tokens kept from there on."""
        if not 0 < knobs.recompute_ratio < 1 or not loaded:
            return {}
        first = min(knobs.check_layer, num_layers - 1)
        checks = {first: knobs.recompute_ratio}
        refine = min(knobs.refine_layer, num_layers - 1)
        if refine > first and knobs.refine_ratio < knobs.recompute_ratio:
            checks[refine] = knobs.refine_ratio  # gradual filtering: narrow the pick
        return checks

    def score(self, at: Check) -> torch.Tensor:
        """Per candidate (``at.active``): higher is recomputed first."""
        raise NotImplementedError(f"blend strategy {self.name!r} has check layers but no score")

    def loaded_work(self, knobs: Knobs, num_layers: int, loaded: int, loaded_docs: int
                    ) -> float:
        """For blend/cost.py: the layers a loaded token is computed through on average, as a
        share of all layers, for ``loaded`` tokens in ``loaded_docs`` documents."""
        if knobs.recompute_ratio == 0:
            return 0.0
        dense = min(knobs.check_layer, num_layers - 1) + 1  # every token up to the check
        sinks = knobs.sink_tokens * loaded_docs / loaded if loaded else 0.0
        picked = min(1.0, knobs.recompute_ratio + sinks)
        refine = min(knobs.refine_layer, num_layers - 1) + 1
        if refine > dense and knobs.refine_ratio < knobs.recompute_ratio:
            narrow = min(1.0, knobs.refine_ratio + sinks)
            layers = dense + picked * (refine - dense) + narrow * (num_layers - refine)
        else:
            layers = dense + picked * (num_layers - dense)
        return layers / num_layers


#: Name -> strategy, in registration order (the order ``blend_strategy``'s error lists).
STRATEGIES: dict[str, Strategy] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls.name`` a value of ``blend_strategy``."""
    if not cls.name or cls.name in STRATEGIES:
        raise ValueError(f"a blend strategy needs a name of its own, got {cls.name!r}")
    STRATEGIES[cls.name] = cls()
    return cls
