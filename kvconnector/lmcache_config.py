"""LMCache configurations, read as kvconnector settings.

An LMCache user points kvconnector at what they have:

* ``"lmcache_config_file": "/path/lmcache.yaml"`` in ``kv_connector_extra_config`` (the file
  ``LMCACHE_CONFIG_FILE`` names; ``"$LMCACHE_CONFIG_FILE"`` works: variables are expanded),
  together with the ``LMCACHE_<KEY>`` environment variables LMCache reads over that file;
* LMCache's keys in ``kv_connector_extra_config`` itself, as LMCache's vLLM connector takes
  them: ``"lmcache.chunk_size": 256`` and so on.

Precedence, lowest first, as in LMCache: LMCache's defaults of the mapped keys, the file,
``LMCACHE_*`` variables, ``lmcache.*`` keys; kvconnector's own keys override all of them.

Each LMCache key is mapped (it has an equivalent), accepted (its value asks for what
kvconnector does anyway, e.g. LMCache's default of a key without an equivalent), or refused
with a message naming the key and what to do. Every refusal is reported at once.
``docs/operations.md`` has the table; ``RULES`` (kvconnector/lmcache_rules.py) is its
source. This module reads the sources and applies the rules; it imports nothing of
kvconnector's config but the schema's error, so ``config`` can import it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconnector.config_schema import ConfigError
from kvconnector.lmcache_rules import (
    ALIASES,
    RULES,
    VALKEY_KEYS,
    VLLM_ADAPTER_KEYS,
    Rule,
    is_default,
)

__all__ = ["RULES", "Translation", "translate"]

logger = logging.getLogger("kvconnector.lmcache_config")

FILE_KEY = "lmcache_config_file"
EXTRA_PREFIX = "lmcache."
ENV_PREFIX = "LMCACHE_"


@dataclass
class Translation:
    """kvconnector keys from an LMCache configuration, and where each came from."""

    extra: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    accepted: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.sources or self.accepted)


def _from_env_text(rule: Rule, text: str) -> Any:
    """An ``LMCACHE_*`` variable's text as a value of its key, parsed as LMCache does."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    if isinstance(rule.default, bool):
        return text.lower() in ("true", "1")
    try:
        return json.loads(text)  # numbers, lists, null
    except ValueError:
        pass
    try:
        return [json.loads(p) for p in text.split(",")] if "," in text else text
    except ValueError:
        return text


def _remote_url(url: Any, extra_config: dict[str, Any]) -> str:
    """LMCache's ``remote_url`` as a kvconnector ``redis_url``."""
    if not isinstance(url, str):
        raise ConfigError(f"remote_url: expected a URL string, got {url!r}")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss", "unix"):
        return url
    if scheme == "valkey":
        mode = extra_config.get("valkey_mode", "standalone")
        if extra_config.get("valkey_password"):
            raise ConfigError(
                "extra_config.valkey_password: kvconnector reads secrets from an "
                "environment variable or a file: move it there, set redis_password_env (or "
                "redis_password_file) in kv_connector_extra_config, and remove it here")
        user = extra_config.get("valkey_username") or ""
        hosts = [h.strip() for h in url[len("valkey://"):].split(",") if h.strip()]
        if not hosts:
            raise ConfigError(f"remote_url: no host in {url!r}")
        auth = f"{user}@" if user else ""
        if mode == "cluster":
            return f"redis+cluster://{auth}{hosts[0]}"  # the other nodes are discovered
        if mode != "standalone":
            raise ConfigError(f"extra_config.valkey_mode: expected standalone or "
                              f"cluster, got {mode!r}")
        db = extra_config.get("valkey_database")
        return f"redis://{auth}{hosts[0]}" + (f"/{int(db)}" if db is not None else "")
    if scheme == "redis-sentinel":
        raise ConfigError("remote_url: Redis Sentinel is not supported: point it at "
                          "the primary (redis://host:port), or use Redis Cluster "
                          "(redis+cluster://host:port)")
    if scheme == "lm":
        raise ConfigError("remote_url: lm:// is LMCache's own cache server; kvconnector "
                          "stores chunks in Redis: run Redis and set remote_url: "
                          "redis://host:port")
    raise ConfigError(f"remote_url: kvconnector's remote tier is Redis (redis://, "
                      f"rediss://, unix://, valkey://); "
                      f"{repr(scheme) if scheme else 'a URL with no scheme'} is not supported")


class _Reader:
    """Collects the LMCache settings of every source, then translates them."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[Any, str]] = {}  # canonical key -> (value, source)
        self.errors: list[str] = []

    def put(self, key: Any, value: Any, source: str) -> None:
        if not isinstance(key, str):
            self.errors.append(f"{source}: key {key!r} is not a string")
            return
        key = ALIASES.get(key, key)
        if key not in RULES:
            self.errors.append(f"{source}: {key!r} is not a key of LMCache's configuration "
                               f"(v1); remove it")
            return
        self.values[key] = (value, source)

    def read_file(self, path_text: str) -> None:
        import yaml

        path = Path(os.path.expandvars(os.path.expanduser(path_text)))
        if "$" in str(path):
            raise ConfigError(f"{FILE_KEY}: {path_text!r} names an environment variable that "
                              "is not set in this process")
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as e:
            raise ConfigError(f"{FILE_KEY}: cannot read {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{FILE_KEY}: {path} is not valid YAML: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{FILE_KEY}: {path} must hold a mapping of LMCache keys")
        for key, value in data.items():
            self.put(key, value, f"LMCache file {path}")

    def read_env(self) -> None:
        for key, rule in RULES.items():
            text = os.environ.get(ENV_PREFIX + key.upper())
            if text is not None:
                self.values[key] = (_from_env_text(rule, text), f"${ENV_PREFIX}{key.upper()}")

    def translate(self, own_keys: set[str]) -> Translation:
        out = Translation()
        extra_config = self.values.get("extra_config", ({}, ""))[0] or {}
        if not isinstance(extra_config, dict):
            self.errors.append(f"{self.values['extra_config'][1]}: extra_config must be a "
                               "mapping")
            extra_config = {}
        blending = self.values.get("enable_blending", (False,))[0] is True
        for key, rule in RULES.items():
            if key == "extra_config":
                continue
            given = key in self.values
            # LMCache's blend defaults (e.g. its separator) come with enable_blending.
            apply_default = rule.apply_default or (
                blending and key.startswith("blend_") and rule.default is not None)
            value, source = self.values.get(key, (rule.default, "LMCache default"))
            try:
                if key == "remote_url":
                    if value not in (None, ""):
                        self._map(out, "redis_url", _remote_url(value, extra_config),
                                  f"{source} (remote_url)", own_keys)
                    continue
                if rule.target is not None and (given or apply_default):
                    self._map(out, rule.target, rule.convert(key, value) if rule.convert
                              else value, f"{source} ({key})", own_keys)
                elif not given:
                    continue
                elif is_default(rule, value):
                    out.accepted.append(f"{key} ({source}): nothing to do in kvconnector")
                else:
                    self.errors.append(f"{source}: {key}={value!r}: {rule.refusal}")
            except ConfigError as e:
                self.errors.append(f"{source}: {e}")
        self._check_extra_config(extra_config)
        return out

    def _check_extra_config(self, extra_config: dict[str, Any]) -> None:
        """LMCache's ``extra_config``: only the Valkey keys have a meaning here, with a
        valkey:// remote_url (``_remote_url`` reads them)."""
        source = self.values.get("extra_config", (None, ""))[1]
        valkey = str(self.values.get("remote_url", ("",))[0]).startswith("valkey://")
        for sub in sorted(extra_config):
            if sub not in VALKEY_KEYS:
                self.errors.append(f"{source}: extra_config.{sub}: it has no equivalent in "
                                   "kvconnector; remove it")
            elif not valkey:
                self.errors.append(f"{source}: extra_config.{sub}: it needs a valkey:// "
                                   "remote_url; remove it")

    @staticmethod
    def _map(out: Translation, target: str, value: Any, source: str,
             own_keys: set[str]) -> None:
        if target in own_keys:  # kvconnector's own key wins
            out.accepted.append(f"{source}: overridden by kvconnector's {target}")
            return
        out.extra[target] = value
        out.sources[target] = source


def translate(extra: dict[str, Any]) -> tuple[dict[str, Any], Translation]:
    """``kv_connector_extra_config`` with its LMCache settings turned into kvconnector keys.

    Returns the new extra config (kvconnector keys only) and what was translated; raises
    ``ConfigError`` listing every LMCache setting that has no meaning here."""
    own = {k: v for k, v in extra.items()
           if k != FILE_KEY and not k.startswith(EXTRA_PREFIX) and k not in VLLM_ADAPTER_KEYS}
    lmcache_keys = {k: v for k, v in extra.items() if k.startswith(EXTRA_PREFIX)}
    adapter_keys = {k: v for k, v in extra.items() if k in VLLM_ADAPTER_KEYS}
    if extra.get(FILE_KEY) is None and not lmcache_keys and not adapter_keys:
        return own, Translation()
    reader = _Reader()
    if extra.get(FILE_KEY) is not None:
        if not isinstance(extra[FILE_KEY], str) or not extra[FILE_KEY]:
            raise ConfigError(f"{FILE_KEY}: expected a path, got {extra[FILE_KEY]!r}")
        reader.read_file(extra[FILE_KEY])
    reader.read_env()
    for key, value in lmcache_keys.items():
        reader.put(key[len(EXTRA_PREFIX):], value, f"kv_connector_extra_config {key}")
    for key, value in adapter_keys.items():
        rule = VLLM_ADAPTER_KEYS[key]
        if not is_default(rule, value):
            reader.errors.append(f"kv_connector_extra_config {key}={value!r}: "
                                 f"{rule.refusal}")
    result = reader.translate(set(own))
    if reader.errors:
        raise ConfigError("this LMCache configuration has settings kvconnector cannot honour:\n"
                          + "\n".join(f"  - {e}" for e in reader.errors))
    if result.sources:
        logger.info("kvconnector: from the LMCache configuration: %s", ", ".join(
            f"{k} <- {s}" for k, s in result.sources.items()))
    return {**result.extra, **own}, result
