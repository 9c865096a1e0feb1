"""Whether blending a request pays: its compute against full prefill's, estimated from the
layer count, the strategy and how much of the prompt stored documents cover.

Blend computes every token up to the check layer, then the picked share of the loaded
tokens through the remaining layers; tokens no document covers go through every layer.
Its own work outside vLLM's forward pass (loading, re-rotation, selection) comes on top:
measured at 0.1-0.15 of full prefill's time (docs/blend.md), which is why a request whose
estimate comes near full prefill is served as usual.
"""

from __future__ import annotations

from kvconnector.blend.config import BlendConfig


def compute_share(config: BlendConfig, num_layers: int, prompt_tokens: int,
                  loaded_tokens: int, loaded_docs: int) -> float:
    """Estimated layer-token work of blending, as a share of full prefill's for the
    ``prompt_tokens`` vLLM would otherwise compute, ``loaded_tokens`` of them in
    ``loaded_docs`` stored documents."""
    if prompt_tokens <= 0:
        return 1.0
    loaded = min(loaded_tokens, prompt_tokens)
    if config.strategy == "epic":
        per_loaded = min(1.0, config.epic_tokens * loaded_docs / loaded) if loaded else 1.0
    elif config.recompute_ratio == 0:
        per_loaded = 0.0
    else:
        dense = min(config.check_layer, num_layers - 1) + 1  # every token up to the check
        sinks = config.sink_tokens * loaded_docs / loaded if loaded else 0.0
        picked = min(1.0, config.recompute_ratio + sinks)
        refine = min(config.refine_layer, num_layers - 1) + 1
        if refine > dense and config.refine_ratio < config.recompute_ratio:
            narrow = min(1.0, config.refine_ratio + sinks)
            layers = dense + picked * (refine - dense) + narrow * (num_layers - refine)
        else:
            layers = dense + picked * (num_layers - dense)
        per_loaded = layers / num_layers
    return (prompt_tokens - loaded + loaded * per_loaded) / prompt_tokens
