"""Connector settings read from ``kv_connector_extra_config``, checked at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconnector.blend.config import BLEND_KEYS, BlendConfig
from kvconnector.config_schema import (
    ConfigError,
    human_size,
    parse,
    parse_size,
    setting,
    settings,
)
from kvconnector.lmcache_config import translate
from kvconnector.store.codec import MIN_SECRET_BYTES
from kvconnector.store.redis_url import checked_url

__all__ = ["ConfigError", "ConnectorConfig", "parse_size"]

# Secrets are named by an environment variable or a file, never given in the config:
# vLLM prints kv_connector_extra_config in its start-up log.
_SECRETS = ("redis_password", "chunk_mac_key")
_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
_PATH = {"pattern": r"(?s).+", "expected": "a non-empty string", "optional": True}

_DISK_KEYS = ("disk_capacity", "disk_direct_io", "disk_write_threads")

DEFAULT_CHUNK_SIZE = 256
DEFAULT_MEMORY_CAPACITY = 2 << 30
# A lone request's fetch before its forward: whole, ~60 ms at the 1.0-1.2 GB/s of a Redis
# connection here; layer by layer, mostly hidden behind the forward (benchmarks.md 20).
SYNC_FETCH_MIB = 64
SYNC_FETCH_BY_LAYER_MIB = 256
# With fewer layers the forward waits for too much of the load (benchmarks.md 20: a 2-layer
# model's Redis hits took 1.56-1.75x vLLM's own hit by layer, 1.46-1.49x whole).
BY_LAYER_MIN_LAYERS = 8


def _is_cluster(url: str) -> bool:
    try:
        return checked_url(url, False)[1]
    except ValueError:  # opening the store names what is wrong with the URL
        return False


@dataclass(frozen=True)
class ConnectorConfig:
    """Every knob kvconnector has: each ``setting`` is a key of ``kv_connector_extra_config``
    (kvconnector/config_schema.py); ``blending`` holds the ``blend*`` keys."""

    chunk_size: int = setting(
        DEFAULT_CHUNK_SIZE, "int", "Tokens per stored chunk; a multiple of the engine's "
        "block size.", lo=1)
    memory_capacity: int = setting(
        DEFAULT_MEMORY_CAPACITY, "size", "Bytes of host memory for stored chunks (per "
        "worker), taken once at start-up.")
    namespace: str = setting(
        "", "text", "Extra key part: deployments with different namespaces never share "
        "chunks.", pattern=r"[A-Za-z0-9_.-]*", expected="letters, digits, '_', '.' or '-'")
    save_decode_chunks: bool = setting(
        True, "bool", "Also store chunks that contain generated tokens (multi-turn chat "
        "reuse).")
    redis_url: str | None = setting(
        None, "url", "Redis behind the memory tier: redis://, rediss:// (TLS), unix://, "
        "redis+cluster://.", choices=_SCHEMES, optional=True)
    redis_key_prefix: str = setting(
        "kvc", "text", "Prefix of every Redis key, so deployments can share one Redis "
        "without mixing.", pattern=r"[A-Za-z0-9_.:-]+",
        expected="letters, digits, '_', '.', ':' or '-'")
    redis_ttl_s: float | None = setting(
        None, "number", "Expiry of stored chunks in Redis; none by default (Redis's own "
        "eviction applies).", optional=True)
    redis_lookup_budget_ms: float = setting(
        50.0, "number", "Time the scheduler may spend asking Redis what it holds for one "
        "request; over it is a miss.", optional=True)
    redis_key_mirror: bool = setting(
        False, "bool", "The scheduler keeps the list of this model's keys in Redis, fed by "
        "Redis's keyspace notifications (turned on with CONFIG SET where they are off), and "
        "answers lookups from it without a round trip. Not for Redis Cluster.")
    redis_password_env: str | None = setting(
        None, "text", "Name of an environment variable holding the Redis password (kept "
        "out of vLLM's logs, which print this config).", **_PATH)
    redis_password_file: str | None = setting(
        None, "text", "A file holding the Redis password (for mounted secrets).", **_PATH)
    sync_fetch_max_mib: int | None = setting(
        None, "int", "A request alone in the engine loads up to this many MiB from the disk or "
        "Redis before its own step's forward instead of waiting a step for them (a request "
        "arriving in that step waits as long); 0: always wait a step. Default: 256 where "
        "Redis loads go layer by layer beside the forward (CPU build, load_by_layer), else "
        "64.", lo=0, optional=True)
    inline_save_max_kib: int = setting(
        1024, "int", "CPU build: a step's saves of at most this many KiB are copied into the "
        "memory tier on the worker's thread right after the forward pass (a small copy costs "
        "less there than handed to the copy thread); larger ones run on the copy thread, "
        "held for the next forward pass, on a core vLLM left spare. 0: every save on the "
        "copy thread.", lo=0)
    load_by_layer: bool | str = setting(
        "auto", "choice", "CPU build: a step's load from Redis (or a big one from memory) is "
        "read and copied a few layers at a time on a spare core while the forward runs, each "
        "chunk verified before the step ends; false: whole chunks before the forward. "
        "\"auto\": for models of 8 layers or more.", choices=("auto", True, False))
    disk_path: str | None = setting(
        None, "text", "A directory for the disk tier, behind memory and before Redis; off "
        "when absent. Kept across restarts; the engines of one host may share it.", **_PATH)
    disk_capacity: int | None = setting(
        None, "size", "Bytes of chunk files disk_path may hold (the least recently used go "
        "first); checked against the file system's free space at start-up. Default: half "
        "of the free space then, at most 1TiB.", optional=True)
    disk_direct_io: bool = setting(
        True, "bool", "Read and write chunk files with O_DIRECT, bypassing the page cache "
        "(where the file system allows it); false goes through it, which then keeps recent "
        "chunks.")
    disk_write_threads: int = setting(
        1, "int", "Threads writing chunk files (more for several NVMe devices).", lo=1)
    chunk_mac_key_env: str | None = setting(
        None, "text", "Name of an environment variable holding a secret shared by the "
        "engines that share Redis or a disk directory: values are signed, unsigned ones are "
        "misses.", **_PATH)
    chunk_mac_key_file: str | None = setting(
        None, "text", "A file holding that secret.", **_PATH)
    blending: BlendConfig = field(default_factory=BlendConfig)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra, _ = translate(dict(extra or {}))  # LMCache settings -> these keys
        known = set(settings(cls)) | BLEND_KEYS
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; "
                f"valid keys: {sorted(known)} (and, for an LMCache configuration, "
                f"lmcache_config_file and lmcache.<key>)")
        blending = BlendConfig.from_extra_config(
            {k: v for k, v in extra.items() if k in BLEND_KEYS})
        for secret in _SECRETS:
            env, path = extra.get(f"{secret}_env"), extra.get(f"{secret}_file")
            if env is not None and path is not None:
                raise ConfigError(f"give {secret}_env or {secret}_file, not both")
            stores = ("redis_url",) if secret == "redis_password" else ("redis_url",
                                                                        "disk_path")
            if (env is not None or path is not None) and not any(extra.get(k) for k in stores):
                raise ConfigError(f"{secret}_{'env' if env else 'file'} needs "
                                  f"{' or '.join(stores)}")
        for key in _DISK_KEYS:
            if extra.get(key) is not None and not extra.get("disk_path"):
                raise ConfigError(f"{key} needs disk_path (the disk tier's directory)")
        config = cls(blending=blending, **parse(cls, extra))
        if config.redis_key_mirror and not config.redis_url:
            raise ConfigError("redis_key_mirror needs redis_url")
        if config.redis_key_mirror and _is_cluster(config.redis_url):
            raise ConfigError("redis_key_mirror does not work with Redis Cluster (each node "
                              "notifies only of its own keys); leave it off")
        for secret in _SECRETS:
            config.secret(secret)  # present and usable now, not at the first Redis call
        return config

    def secret(self, name: str) -> bytes | None:
        """The secret ``name`` ("redis_password" or "chunk_mac_key") from the environment
        variable or file the config names; None if it names neither. Never logged."""
        env, path = getattr(self, f"{name}_env"), getattr(self, f"{name}_file")
        if env is not None:
            value = os.environ.get(env)
            if not value:
                raise ConfigError(f"{name}_env: the environment variable {env} is not set "
                                  "(or empty) in this process")
            data = value.encode()
        elif path is not None:
            try:
                data = Path(path).read_bytes().rstrip(b"\r\n")
            except OSError as e:
                raise ConfigError(f"{name}_file: cannot read {path}: {e.strerror}") from None
            if not data:
                raise ConfigError(f"{name}_file: {path} is empty")
        else:
            return None
        if name == "chunk_mac_key" and len(data) < MIN_SECRET_BYTES:
            raise ConfigError(f"{name}: the secret has {len(data)} bytes; use at least "
                              f"{MIN_SECRET_BYTES} (e.g. 32 random bytes, base64-encoded)")
        return data

    def by_layer(self, num_layers: int) -> bool:
        """Whether loads go layer by layer (where the worker copies on the host)."""
        if self.load_by_layer == "auto":
            return num_layers >= BY_LAYER_MIN_LAYERS
        return bool(self.load_by_layer)

    def sync_fetch_max_bytes(self, by_layer: bool) -> int:
        """``sync_fetch_max_mib`` in bytes; ``by_layer``: Redis loads go layer by layer."""
        mib = self.sync_fetch_max_mib
        if mib is None:
            mib = SYNC_FETCH_BY_LAYER_MIB if by_layer and self.redis_url else SYNC_FETCH_MIB
        return mib << 20

    def memory_slots(self, chunk_bytes: int) -> int:
        """How many chunks of ``chunk_bytes`` the memory tier holds; at least one."""
        if self.memory_capacity < chunk_bytes:
            raise ConfigError(
                f"memory_capacity={human_size(self.memory_capacity)} holds no chunk: one "
                f"chunk of {self.chunk_size} tokens is {human_size(chunk_bytes)} for this "
                f"model; use at least {human_size(chunk_bytes, up=True)!r} (or a smaller "
                "chunk_size)")
        return self.memory_capacity // chunk_bytes

    def check_memory_available(self, available: int, total: int,
                               kv_cache_bytes: int | None = None) -> None:
        """Refuse a memory tier larger than the memory this machine can give now (the pool
        is touched at start-up: too large a pool gets the process killed). Checked again
        once vLLM holds its KV cache (``kv_cache_bytes``), which on the CPU build is sized
        from the machine's memory and may leave too little."""
        if self.memory_capacity <= available:
            return
        msg = (f"memory_capacity={human_size(self.memory_capacity)} is more than this "
               f"machine can give: {human_size(available)} available now, of "
               f"{human_size(total)}")
        if kv_cache_bytes is None:
            raise ConfigError(f"{msg}; lower it (it is taken per worker, at start-up)")
        raise ConfigError(
            f"{msg}, once vLLM took {human_size(kv_cache_bytes)} for its KV cache; lower "
            "memory_capacity or vLLM's KV cache (kv_cache_memory_bytes, or "
            "VLLM_CPU_KVCACHE_SPACE on the CPU build)")

    def check_block_size(self, block_size: int) -> None:
        if self.chunk_size % block_size:
            valid = [block_size * k for k in (1, 2, 4, 8, 16) if block_size * k <= 4096]
            raise ConfigError(
                f"chunk_size={self.chunk_size} is not a multiple of the engine's "
                f"block_size={block_size}; valid choices include {valid}")
