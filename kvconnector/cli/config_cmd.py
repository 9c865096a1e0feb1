"""``kvconnector config``: the settings an engine would run with, where each came from, and
what is wrong, from a ``--kv-transfer-config`` JSON (or just its extra config)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvconnector.cli.inventory import CliError
from kvconnector.cli.output import human_bytes
from kvconnector.config import ConfigError, ConnectorConfig
from kvconnector.lmcache_config import translate
from kvconnector.plugin import SHORT_NAME
from kvconnector.store.redis_url import redact_url

_SECRETS = ("redis_password", "chunk_mac_key")


@dataclass
class Effective:
    settings: dict[str, Any] = field(default_factory=dict)  # key -> printable value
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    lmcache_accepted: list[str] = field(default_factory=list)


def read_input(text: str | None) -> dict[str, Any]:
    """The JSON from ``text`` (inline JSON, ``@file``, a file path) or stdin (``-``)."""
    if text is None or text == "-":
        if sys.stdin.isatty():
            raise CliError("give the kv-transfer config as an argument (JSON or a file), "
                           "or pipe it in")
        raw, where = sys.stdin.read(), "stdin"
    elif text.lstrip().startswith("{"):
        raw, where = text, "the argument"
    else:
        path = Path(text[1:] if text.startswith("@") else text)
        try:
            raw, where = path.read_text(), str(path)
        except OSError as e:
            raise CliError(f"cannot read {path}: {e.strerror}") from None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise CliError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CliError(f"{where}: expected a JSON object")
    return data


def _printable(cfg: ConnectorConfig, name: str) -> Any:
    value = getattr(cfg, name)
    if name == "memory_capacity":
        return f"{value} ({human_bytes(value)})"
    if name == "redis_url" and value is not None:
        return redact_url(value)
    return value


def effective(data: dict[str, Any]) -> Effective:
    """Raises ConfigError exactly where an engine would refuse to start."""
    out = Effective()
    if "kv_connector_extra_config" in data or "kv_connector" in data:
        extra = dict(data.get("kv_connector_extra_config") or {})
        connector = data.get("kv_connector")
        if connector not in (SHORT_NAME, "KVConnector"):
            out.warnings.append(f"kv_connector is {connector!r}: kvconnector is "
                                f"\"{SHORT_NAME}\" (or \"KVConnector\" with "
                                "kv_connector_module_path \"kvconnector.connector\")")
        if data.get("kv_role") != "kv_both":
            out.warnings.append(f"kv_role is {data.get('kv_role')!r}: use \"kv_both\" "
                                "(kvconnector saves and loads)")
        if data.get("kv_load_failure_policy") != "recompute":
            out.warnings.append("kv_load_failure_policy is not \"recompute\": kvconnector "
                                "runs with \"recompute\" all the same (a chunk that cannot "
                                "be loaded is recomputed, never a failed request) and warns "
                                "at start-up")
    else:
        extra = dict(data)
    own, translation = translate(extra)
    cfg = ConnectorConfig.from_extra_config(own)
    out.lmcache_accepted = translation.accepted
    for f in fields(ConnectorConfig):
        out.settings[f.name] = _printable(cfg, f.name)
        if f.name in extra:
            out.sources[f.name] = "kv_connector_extra_config"
        elif f.name in translation.sources:
            out.sources[f.name] = translation.sources[f.name]
        else:
            out.sources[f.name] = "default"
    for secret in _SECRETS:
        env = getattr(cfg, f"{secret}_env")
        if env is not None:  # from_extra_config checked it is set here
            out.settings[f"{secret}_env"] = f"{env} (set in this environment)"
    if cfg.redis_url is None:
        out.warnings.append("no redis_url: chunks stay in this engine's host memory")
    if os.environ.get("LMCACHE_CONFIG_FILE") and "lmcache_config_file" not in extra:
        out.warnings.append("LMCACHE_CONFIG_FILE is set but not used: to run that LMCache "
                            "configuration, add \"lmcache_config_file\": "
                            "\"$LMCACHE_CONFIG_FILE\"")
    return out


def as_json(eff: Effective | None, error: ConfigError | None) -> dict[str, Any]:
    if error is not None:
        return {"ok": False, "error": str(error)}
    assert eff is not None
    return {"ok": True, "settings": eff.settings, "sources": eff.sources,
            "warnings": eff.warnings, "lmcache_accepted": eff.lmcache_accepted}
