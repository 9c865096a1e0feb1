"""The ``blend*`` keys of ``kv_connector_extra_config``, checked at start-up, and their
per-request overrides (``kv_transfer_params``). Each key is one ``setting`` below
(kvconnector/config_schema.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from kvconnector.blend.strategies import STRATEGIES
from kvconnector.config_schema import ConfigError, parse, setting, settings

logger = logging.getLogger("kvconnector.blend.config")


class BlendConfigError(ConfigError):
    """A ``blend*`` value is invalid; the message names the key."""


@dataclass(frozen=True)
class BlendConfig:
    """Non-prefix reuse of documents (CacheBlend); see docs/blend.md. A field ``x`` is the
    key ``blend_x`` (``enabled`` is ``blend``)."""

    enabled: bool = setting(
        False, "bool", "Store each document of a separated prompt under its own key and "
        "reuse it at any position.", key="blend", request=True)
    separator: str = setting(
        " # # ", "text", "The text between segments, tokenized alone (no special tokens).",
        pattern=r"(?s).+", expected="a non-empty string")
    separator_ids: tuple[int, ...] | None = setting(
        None, "ids", "The separator as token ids; wins over ``separator``.", optional=True)
    recompute_ratio: float = setting(
        0.5, "ratio", "Share of reused tokens recomputed (attention, cacheblend).",
        request=True)
    check_layer: int = setting(
        1, "int", "Layer at which the tokens to recompute are picked (every token is "
        "computed up to it).", request=True)
    strategy: str = setting(
        "attention", "choice", '"attention" (the reused tokens the prompt\'s last tokens '
        'attend to most at the check layer), "cacheblend" (the paper\'s: those whose K/V '
        'deviates most there) or "epic" (the first ``epic_tokens`` of every reused '
        "document); or a strategy registered in blend/strategies/.", choices=STRATEGIES,
        request=True)
    epic_tokens: int = setting(
        32, "int", "Tokens recomputed at the start of each document (epic).", request=True)
    min_tokens: int = setting(
        256, "int", "Below this many reusable document tokens a request is served by prefix "
        "reuse alone; a request may only raise it.", request=True)
    sink_tokens: int = setting(
        0, "int", "The first tokens of every moved document, recomputed on top of the "
        "``recompute_ratio`` share (attention, cacheblend): computed at the start of a "
        "prompt, they act as an attention sink that misleads once moved.", request=True)
    refine_layer: int = setting(
        8, "int", "If after the check layer, the picked tokens are scored again here and "
        "narrowed to ``refine_ratio`` (gradual filtering); 0: one pick only. The defaults "
        "(0.5 at layer 1, 0.3 from layer 8) lost the fewest answers per TTFT on a trained "
        "model (docs/blend.md).", request=True)
    refine_ratio: float = setting(
        0.3, "ratio", "Share of the loaded tokens recomputed after the refine layer (below "
        "``recompute_ratio``).", request=True)
    group_tokens: int = setting(
        16, "int", "Tokens picked together: at a check layer the share is taken in aligned "
        "groups of this many consecutive tokens, ranked by their summed score. vLLM's CPU "
        "attention kernel streams every key once per run of consecutive queries, so "
        "scattered picks cost about as much attention as recomputing everything; 1: token "
        "by token.", request=True, lo=1)
    max_cost: float = setting(
        0.85, "ratio", "A request whose blend would cost more than this share of full "
        "prefill's compute (blend/cost.py) is served as usual; 1 blends whatever it costs. "
        "Deployment only.")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> BlendConfig:
        unknown = sorted(set(extra) - BLEND_KEYS)
        if unknown:
            raise BlendConfigError(f"unknown blend key(s) {unknown}; valid: {sorted(BLEND_KEYS)}")
        return cls(**parse(cls, extra, "blend_", BlendConfigError))

    def for_request(self, params: dict[str, Any] | None) -> BlendConfig:
        """This config with a request's ``kv_transfer_params`` overrides applied. A bad
        override is logged and ignored: it never fails the request."""
        if not params:
            return self
        wanted = {k: v for k, v in params.items() if k in REQUEST_KEYS}
        if not wanted:
            return self
        try:
            parsed = parse(BlendConfig, wanted, "blend_", BlendConfigError)
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
                f"{self.refine_ratio!r}:{self.group_tokens}").encode()


#: Every config key this module owns, and the subset a request may override.
BLEND_KEYS = frozenset(settings(BlendConfig, "blend_"))
REQUEST_KEYS = frozenset(k for k, (_, s) in settings(BlendConfig, "blend_").items()
                         if s.request)
