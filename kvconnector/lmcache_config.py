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
``docs/operations.md`` has the table; ``RULES`` is its source.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvconnector.config import ConfigError

logger = logging.getLogger("kvconnector.lmcache_config")

FILE_KEY = "lmcache_config_file"
EXTRA_PREFIX = "lmcache."
ENV_PREFIX = "LMCACHE_"
GIB = 1 << 30
_NO_THRESHOLDS = ("kvconnector's blend picks the tokens to recompute by ratio "
                  "(blend_recompute_ratios), not by threshold; remove blend_thresholds")


def _positive_int(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{key}: expected a positive integer, got {v!r}")
    return v


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true or false, got {v!r}")
    return v


def _gib_to_bytes(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{key}: expected a positive size in GB (LMCache counts GiB), got "
                          f"{v!r}; kvconnector always keeps chunks in host memory")
    return int(v * GIB)


def _one_number(kind: type) -> Callable[[str, Any], Any]:
    """LMCache takes a list (one value per layer); kvconnector one value."""
    def convert(key: str, v: Any) -> Any:
        if isinstance(v, list):
            if len(v) != 1:
                raise ConfigError(f"{key}: kvconnector takes one value, got {v!r}")
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {v!r}")
        return kind(v)
    return convert


def _str(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{key}: expected a string, got {v!r}")
    return v


@dataclass(frozen=True)
class Rule:
    """What one LMCache key becomes.

    ``target``: the kvconnector key it maps to (``convert`` turns the value into one).
    Without a target the key is accepted at ``default`` (LMCache's) or at a value in
    ``also_ok``, and refused otherwise with ``refusal``."""

    default: Any = None
    target: str | None = None
    convert: Callable[[str, Any], Any] | None = None
    apply_default: bool = False  # LMCache's default differs from kvconnector's: apply it
    refusal: str = "it has no equivalent in kvconnector; remove it"
    also_ok: tuple[Any, ...] = ()


_NO_DISK = ("kvconnector has no disk tier: remove it, and use Redis (remote_url) as the "
            "second tier")
_NO_PD = "disaggregated prefill is not kvconnector's job (use vLLM's P2P connectors); remove it"
_NO_CONTROLLER = ("LMCache's controller and P2P sharing have no equivalent: engines share "
                  "chunks through Redis; remove it")

RULES: dict[str, Rule] = {
    # Mapped.
    "chunk_size": Rule(256, "chunk_size", _positive_int, apply_default=True),
    "max_local_cpu_size": Rule(5.0, "memory_capacity", _gib_to_bytes, apply_default=True),
    "save_decode_cache": Rule(False, "save_decode_chunks", _bool, apply_default=True),
    "remote_url": Rule(None, "redis_url"),  # see _remote_url
    "enable_blending": Rule(False, "blend", _bool),
    "blend_special_str": Rule(" # # ", "blend_separator", _str),
    "blend_recompute_ratios": Rule(None, "blend_recompute_ratio", _one_number(float)),
    "blend_check_layers": Rule(None, "blend_check_layer", _one_number(int)),
    "blend_min_tokens": Rule(256, "blend_min_tokens", _positive_int),
    # Accepted where the value asks for what kvconnector does; refused otherwise.
    "local_cpu": Rule(True, refusal="kvconnector always keeps chunks in host memory, with "
                      "Redis behind it; remove local_cpu: false and bound the memory with "
                      "max_local_cpu_size"),
    "remote_serde": Rule("naive", refusal="kvconnector stores chunks bit-exact and "
                         "uncompressed; remove remote_serde (or set it to naive)"),
    "use_layerwise": Rule(False, refusal="kvconnector moves all layers of a chunk at once; "
                          "remove use_layerwise"),
    # kvconnector always stores the full blocks after the last full chunk: either value
    # is served at least as well as LMCache would.
    "save_unfull_chunk": Rule(False, also_ok=(True,)),
    "cache_policy": Rule("LRU", refusal="kvconnector's memory tier evicts the least recently "
                         "used chunk (Redis evicts by its maxmemory-policy); remove it"),
    "pre_caching_hash_algorithm": Rule(
        "builtin", also_ok=("sha256", "sha256_cbor", "sha256_cbor_64bit", "xxhash",
                            "xxhash_cbor", "sha256_cbor_hex"),
        refusal="kvconnector keys chunks with its own blake2b chain, the same in every "
        "process; remove it"),
    "local_disk": Rule(None, refusal=_NO_DISK),
    "max_local_disk_size": Rule(0.0, also_ok=(0,), refusal=_NO_DISK),
    "local_disk_path_sharding": Rule("by_gpu", refusal=_NO_DISK),
    "blend_thresholds": Rule(None, refusal=_NO_THRESHOLDS),
    "extra_config": Rule(None),  # see _extra_config
    "enable_p2p": Rule(False, refusal=_NO_CONTROLLER),
    "enable_controller": Rule(False, refusal=_NO_CONTROLLER),
    "enable_pd": Rule(False, refusal=_NO_PD),
    "lmcache_instance_id": Rule(None, refusal=_NO_CONTROLLER),
}
# LMCache keys without an equivalent, with their defaults: accepted at the default only.
for _key, _default in {
    "local_cpu_use_hugepages": False, "reserve_local_cpu_size": 0.0, "retrieve_locations": None,
    "store_location": None, "p2p_host": None, "p2p_init_ports": None, "p2p_lookup_ports": None,
    "mp_host": None, "mp_port": 5555, "controller_pull_url": None,
    "controller_reply_url": None, "lmcache_worker_ports": None, "lmcache_worker_ids": None,
    "lmcache_worker_heartbeat_delay_time": 10, "lmcache_worker_heartbeat_time": None,
    "pd_role": None, "pd_buffer_size": None, "pd_buffer_device": None, "pd_peer_host": None,
    "pd_peer_init_port": None, "pd_peer_alloc_port": None, "pd_peer_query_port": None,
    "pd_proxy_host": None, "pd_proxy_port": None, "pd_allocation_timeout_sec": math.inf,
    "pd_shutdown_timeout_sec": 5.0, "pd_condition_poll_interval_sec": 0.005,
    "pd_max_prefill_len": 0, "pd_backend_mode": "async", "pd_skip_proxy_notification": False,
    "pd_bidirectional": False, "transfer_channel": None, "nixl_backends": None,
    "nixl_buffer_size": None, "nixl_buffer_device": None, "gds_path": None,
    "gds_path_sharding": "by_gpu", "gds_buffer_size": None, "maru_path": None,
    "maru_pool_size": 4.0, "use_gds": True, "gds_backend": "cufile",
    "audit_actual_remote_url": None, "internal_api_server_host": "0.0.0.0",
    "blocking_timeout_secs": 10, "external_lookup_client": None, "py_enable_gc": True,
    "cost_aware_half_life_seconds": 60.0, "cost_aware_ewma_alpha": 0.2, "numa_mode": None,
    "enable_async_loading": False, "internal_api_server_enabled": False,
    "internal_api_server_port_start": 6999, "priority_limit": None,
    "internal_api_server_include_index_list": None,
    "internal_api_server_socket_path_prefix": None, "runtime_plugin_locations": None,
    "storage_plugins": None, "remote_storage_plugins": None, "lookup_timeout_ms": 3000,
    "min_retrieve_tokens": 0, "hit_miss_ratio": None, "lookup_server_worker_ids": None,
    "enable_scheduler_bypass_lookup": False, "script_allowed_imports": None,
    "enable_lazy_memory_allocator": False, "lazy_memory_initial_ratio": 0.2,
    "lazy_memory_expand_trigger_ratio": 0.5, "lazy_memory_step_ratio": 0.1,
    "lazy_memory_safe_size": 0.0, "enable_chunk_statistics": False,
    "chunk_statistics_auto_start_statistics": False,
    "chunk_statistics_auto_exit_timeout_hours": 0.0,
    "chunk_statistics_auto_exit_target_unique_chunks": 0,
    "chunk_statistics_strategy": "memory_bloom_filter", "enable_kv_events": False,
    "use_gpu_connector_v3": False, "pin_timeout_sec": 300, "pin_check_interval_sec": 30,
    "remote_config_url": None, "app_id": None, "enable_hidden_state_cache": False,
    "max_hidden_state_cpu_size": 2.0, "hidden_state_layers": None,
    "hidden_states_retrieve_mode": "prefix_strict",
}.items():
    RULES.setdefault(_key, Rule(_default))
# LMCache's old names for some keys.
ALIASES = {"enable_xpyd": "enable_pd", "nixl_peer_host": "pd_peer_host",
           "nixl_peer_init_port": "pd_peer_init_port",
           "nixl_peer_alloc_port": "pd_peer_alloc_port", "nixl_proxy_host": "pd_proxy_host",
           "nixl_proxy_port": "pd_proxy_port", "nixl_role": "pd_role",
           "controller_url": "controller_pull_url",
           "lmcache_worker_port": "lmcache_worker_ports",
           "plugin_locations": "runtime_plugin_locations",
           "external_backends": "storage_plugins"}
# Keys LMCache's vLLM connector reads from kv_connector_extra_config without the prefix.
VLLM_ADAPTER_KEYS: dict[str, Rule] = {
    "discard_partial_chunks": Rule(False, also_ok=(True,)),  # kvconnector always discards
    "skip_last_n_tokens": Rule(0),
}
_VALKEY_KEYS = ("valkey_mode", "valkey_database", "valkey_username", "valkey_password")


@dataclass
class Translation:
    """kvconnector keys from an LMCache configuration, and where each came from."""

    extra: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    accepted: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.sources or self.accepted)


def _kvconnector_keys() -> set[str]:
    from kvconnector.blend.config import BLEND_KEYS
    from kvconnector.config import ConnectorConfig

    return {f.name for f in fields(ConnectorConfig)} - {"blending"} | BLEND_KEYS


def _is_default(rule: Rule, v: Any) -> bool:
    """Whether ``v`` is LMCache's default of the key (or another value that asks for what
    kvconnector does anyway)."""
    for ok in (rule.default, *rule.also_ok):
        if isinstance(v, bool) or isinstance(ok, bool):
            if v is ok:
                return True
        elif isinstance(v, (int, float)) and isinstance(ok, (int, float)):
            if float(v) == float(ok):
                return True
        elif v == ok:
            return True
    return False


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
        known = _kvconnector_keys()
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
                if rule.target is not None and rule.target in known and (
                        given or apply_default):
                    self._map(out, rule.target, rule.convert(key, value) if rule.convert
                              else value, f"{source} ({key})", own_keys)
                elif not given:
                    continue
                elif _is_default(rule, value):
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
            if sub not in _VALKEY_KEYS:
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
        if not _is_default(rule, value):
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
