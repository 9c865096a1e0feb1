"""The ``blend*`` keys of ``kv_connector_extra_config``, checked at start-up, and their
per-request overrides (``kv_transfer_params``)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger("kvconnector.blend.config")

STRATEGIES = ("cacheblend", "attention", "epic")

#: Every config key this module owns, and the subset a request may override.
BLEND_KEYS = frozenset({"blend", "blend_separator", "blend_separator_ids",
                        "blend_recompute_ratio", "blend_check_layer", "blend_strategy",
                        "blend_epic_tokens", "blend_sink_tokens", "blend_min_tokens",
                        "blend_max_cost", "blend_refine_layer", "blend_refine_ratio"})
REQUEST_KEYS = frozenset({"blend", "blend_recompute_ratio", "blend_check_layer",
                          "blend_strategy", "blend_epic_tokens", "blend_sink_tokens",
                          "blend_min_tokens", "blend_refine_layer", "blend_refine_ratio"})


class BlendConfigError(ValueError):
    """A ``blend*`` value is invalid; the message names the key."""


def _int(key: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BlendConfigError(f"{key}: expected an int >= {lo}, got {v!r}")
    return v


def _ratio(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not 0 <= v <= 1:
        raise BlendConfigError(f"{key}: expected a number from 0 to 1, got {v!r}")
    return float(v)


def _parse(extra: dict[str, Any]) -> dict[str, Any]:
    """Field values from config keys (only those present)."""
    values: dict[str, Any] = {}
    if "blend" in extra:
        if not isinstance(extra["blend"], bool):
            raise BlendConfigError(f"blend: expected true or false, got {extra['blend']!r}")
        values["enabled"] = extra["blend"]
    if "blend_separator" in extra:
        v = extra["blend_separator"]
        if not isinstance(v, str) or not v:
            raise BlendConfigError(f"blend_separator: expected a non-empty string, got {v!r}")
        values["separator"] = v
    if extra.get("blend_separator_ids") is not None:
        v = extra["blend_separator_ids"]
        if (not isinstance(v, (list, tuple)) or not v
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in v)):
            raise BlendConfigError(
                f"blend_separator_ids: expected a non-empty list of token ids, got {v!r}")
        values["separator_ids"] = tuple(v)
    if "blend_recompute_ratio" in extra:
        values["recompute_ratio"] = _ratio("blend_recompute_ratio", extra["blend_recompute_ratio"])
    if "blend_check_layer" in extra:
        values["check_layer"] = _int("blend_check_layer", extra["blend_check_layer"], 0)
    if "blend_strategy" in extra:
        v = extra["blend_strategy"]
        if v not in STRATEGIES:
            raise BlendConfigError(f"blend_strategy: expected one of {list(STRATEGIES)}, "
                                   f"got {v!r}")
        values["strategy"] = v
    if "blend_epic_tokens" in extra:
        values["epic_tokens"] = _int("blend_epic_tokens", extra["blend_epic_tokens"], 0)
    if "blend_sink_tokens" in extra:
        values["sink_tokens"] = _int("blend_sink_tokens", extra["blend_sink_tokens"], 0)
    if "blend_refine_layer" in extra:
        values["refine_layer"] = _int("blend_refine_layer", extra["blend_refine_layer"], 0)
    if "blend_refine_ratio" in extra:
        values["refine_ratio"] = _ratio("blend_refine_ratio", extra["blend_refine_ratio"])
    if "blend_max_cost" in extra:
        values["max_cost"] = _ratio("blend_max_cost", extra["blend_max_cost"])
    if "blend_min_tokens" in extra:
        values["min_tokens"] = _int("blend_min_tokens", extra["blend_min_tokens"], 0)
    return values


@dataclass(frozen=True)
class BlendConfig:
    """Non-prefix reuse of documents (CacheBlend); see docs/blend.md."""

    enabled: bool = False
    """``blend``: store each document of a separated prompt under its own key and reuse
    it at any position."""
    separator: str = " # # "
    """``blend_separator``: the text between segments, tokenized alone (no special tokens)."""
    separator_ids: tuple[int, ...] | None = None
    """``blend_separator_ids``: the separator as token ids; wins over ``separator``."""
    recompute_ratio: float = 0.5
    """``blend_recompute_ratio``: share of reused tokens recomputed (attention,
    cacheblend)."""
    check_layer: int = 1
    """``blend_check_layer``: layer at which the tokens to recompute are picked (every
    token is computed up to it)."""
    strategy: str = "attention"
    """``blend_strategy``: "attention" (the reused tokens the prompt's last tokens attend
    to most at the check layer), "cacheblend" (the paper's: the reused tokens whose K/V
    deviates most at the check layer) or "epic" (the first ``epic_tokens`` of every reused
    document)."""
    epic_tokens: int = 32
    """``blend_epic_tokens``: tokens recomputed at the start of each document (epic)."""
    min_tokens: int = 256
    """``blend_min_tokens``: below this many reusable document tokens a request is served
    by prefix reuse alone."""
    sink_tokens: int = 0
    """``blend_sink_tokens``: the first tokens of every moved document, recomputed on top of
    the ``recompute_ratio`` share (attention, cacheblend): computed at the start of a
    prompt, a document's first tokens act as an attention sink that misleads once moved."""
    refine_layer: int = 8
    """``blend_refine_layer``: if after the check layer, the picked tokens are scored
    again at this layer (same strategy) and narrowed to ``refine_ratio`` (attention,
    cacheblend; gradual filtering). 0: one pick only. The defaults (0.5 at layer 1, 0.3
    from layer 8) lost the fewest answers per TTFT on a trained model (docs/blend.md)."""
    refine_ratio: float = 0.3
    """``blend_refine_ratio``: share of the loaded tokens recomputed after the refine
    layer (below ``recompute_ratio``)."""
    max_cost: float = 0.85
    """``blend_max_cost``: a request whose blend would cost more than this share of full
    prefill's compute (estimated from the layers, the strategy and the stored share of the
    prompt, blend/cost.py) is served as usual: blending it would be no faster. 1 blends
    whatever it costs (ratio 1.0 for exactness checks). Not a per-request key."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> BlendConfig:
        unknown = sorted(set(extra) - BLEND_KEYS)
        if unknown:
            raise BlendConfigError(f"unknown blend key(s) {unknown}; valid: {sorted(BLEND_KEYS)}")
        return cls(**_parse(extra))

    def for_request(self, params: dict[str, Any] | None) -> BlendConfig:
        """This config with a request's ``kv_transfer_params`` overrides applied. A bad
        override is logged and ignored: it never fails the request."""
        if not params:
            return self
        wanted = {k: v for k, v in params.items() if k in REQUEST_KEYS}
        if not wanted:
            return self
        try:
            parsed = _parse(wanted)
        except BlendConfigError as e:
            logger.warning("kvconnector: ignoring the request's blend override: %s", e)
            return self
        if parsed.get("min_tokens", self.min_tokens) < self.min_tokens:
            # A lower bound would have the worker blend (a dense recompute) prompts the
            # deployment serves by plain prefill: a request may only ask for less blending.
            logger.warning("kvconnector: ignoring the request's blend_min_tokens=%d: below "
                           "the deployment's %d", parsed.pop("min_tokens"), self.min_tokens)
        return replace(self, **parsed)

    def salt(self) -> bytes:
        """Tells KV blended with these settings apart from exact KV and from KV blended
        with others (compat.mark_approximate)."""
        return (f"kvconnector-blend:{self.strategy}:{self.recompute_ratio!r}:"
                f"{self.check_layer}:{self.epic_tokens}:{self.sink_tokens}:{self.refine_layer}:"
                f"{self.refine_ratio!r}").encode()
