"""What each LMCache configuration key becomes in kvconnector: ``RULES``, the source of
the LMCache table in ``docs/operations.md``. kvconnector/lmcache_config.py reads the
LMCache sources and applies these rules."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvconnector.config_schema import ConfigError, Setting, check

GIB = 1 << 30
_NO_THRESHOLDS = ("kvconnector's blend picks the tokens to recompute by ratio "
                  "(blend_recompute_ratios), not by threshold; remove blend_thresholds")


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


def _checked(kind: str, **spec: Any) -> Callable[[str, Any], Any]:
    """The shared checker (config_schema.check) for an LMCache value."""
    setting = Setting(kind, **spec)
    return lambda key, v: check(key, setting, v)


_POSITIVE_INT = _checked("int", lo=1)


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




def _disk_path(key: str, v: Any) -> str | None:
    """LMCache's ``local_disk``: a path, or a ``file://`` URL of one."""
    if v is None:
        return None
    path = v.removeprefix("file://") if isinstance(v, str) else ""
    if not path:
        raise ConfigError(f"{key}: expected a directory path (or file:///path), got {v!r}; "
                          "set it to the disk tier's directory")
    return path


def _disk_gib(key: str, v: Any) -> int | None:
    """LMCache's ``max_local_disk_size`` (GiB; 0, its default, leaves kvconnector's)."""
    if v in (0, 0.0, None) and not isinstance(v, bool):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{key}: expected a positive size in GB (LMCache counts GiB), got "
                          f"{v!r}; set it to the disk tier's capacity, or 0 for kvconnector's "
                          "default")
    return int(v * GIB)

_NO_PD = "disaggregated prefill is not kvconnector's job (use vLLM's P2P connectors); remove it"
_NO_CONTROLLER = ("LMCache's controller and P2P sharing have no equivalent: engines share "
                  "chunks through Redis; remove it")

RULES: dict[str, Rule] = {
    # Mapped.
    "chunk_size": Rule(256, "chunk_size", _POSITIVE_INT, apply_default=True),
    "max_local_cpu_size": Rule(5.0, "memory_capacity", _gib_to_bytes, apply_default=True),
    "save_decode_cache": Rule(False, "save_decode_chunks", _checked("bool"),
                              apply_default=True),
    "remote_url": Rule(None, "redis_url"),  # see _remote_url
    "enable_blending": Rule(False, "blend", _checked("bool")),
    "blend_special_str": Rule(" # # ", "blend_separator",
                               _checked("text", expected="a string")),
    "blend_recompute_ratios": Rule(None, "blend_recompute_ratio", _one_number(float)),
    "blend_check_layers": Rule(None, "blend_check_layer", _one_number(int)),
    "blend_min_tokens": Rule(256, "blend_min_tokens", _POSITIVE_INT),
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
    "local_disk": Rule(None, "disk_path", _disk_path),
    "max_local_disk_size": Rule(0.0, "disk_capacity", _disk_gib),
    # kvconnector keeps each TP rank's files apart by itself (r<rank> in the path).
    "local_disk_path_sharding": Rule("by_gpu", also_ok=("by_rank", None)),
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
VALKEY_KEYS = ("valkey_mode", "valkey_database", "valkey_username", "valkey_password")


def is_default(rule: Rule, v: Any) -> bool:
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
