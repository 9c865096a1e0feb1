"""Whether blending a request pays: its compute against full prefill's, estimated from the
layer count, the strategy and how much of the prompt stored documents cover.

Tokens no document covers go through every layer; how far the loaded ones go is the
strategy's estimate (``Strategy.loaded_work``): for a picking strategy, every token up to
the check layer, then the picked share through the remaining layers.
Its own work outside vLLM's forward pass (loading, re-rotation, selection) comes on top:
measured at 0.1-0.15 of full prefill's time (docs/blend.md), which is why a request whose
estimate comes near full prefill is served as usual.
"""

from __future__ import annotations

from kvconnector.blend.config import BlendConfig
from kvconnector.blend.strategies import STRATEGIES


def compute_share(config: BlendConfig, num_layers: int, prompt_tokens: int,
                  loaded_tokens: int, loaded_docs: int) -> float:
    """Estimated layer-token work of blending, as a share of full prefill's for the
    ``prompt_tokens`` vLLM would otherwise compute, ``loaded_tokens`` of them in
    ``loaded_docs`` stored documents."""
    if prompt_tokens <= 0:
        return 1.0
    loaded = min(loaded_tokens, prompt_tokens)
    per_loaded = STRATEGIES[config.strategy].loaded_work(config, num_layers, loaded,
                                                         loaded_docs)
    return (prompt_tokens - loaded + loaded * per_loaded) / prompt_tokens
