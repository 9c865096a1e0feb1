"""Connector settings read from ``kv_connector_extra_config``, checked at start-up."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvconnector.blend.config import BLEND_KEYS, BlendConfig, BlendConfigError
from kvconnector.store.codec import MIN_SECRET_BYTES

# Secrets are named by an environment variable or a file, never given in the config:
# vLLM prints kv_connector_extra_config in its start-up log.
_SECRETS = ("redis_password", "chunk_mac_key")

DEFAULT_CHUNK_SIZE = 256
DEFAULT_MEMORY_CAPACITY = 2 << 30

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` entry is unknown or has a bad value."""


def _human(n: int, up: bool = False) -> str:
    """A size as the config would be written, e.g. '4MiB' (rounded up with ``up``)."""
    for unit, m in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            q = -(-n // m) if up else n / m
            return f"{q:g}{unit}" if up or n % m == 0 else f"{q:.1f}{unit}"
    return f"{n}B"


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string such as ``"512MiB"`` or ``"4GB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)) and m[2].lower() in _UNITS:
        size = int(float(m[1]) * _UNITS[m[2].lower()])
    else:
        raise ConfigError(
            f"{key}: expected a size such as 1073741824, '512MiB' or '4GB' "
            f"(units: {', '.join(u for u in _UNITS if u)}), got {value!r}")
    if size <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class ConnectorConfig:
    """Every knob kvconnector has. Each field is a key of ``kv_connector_extra_config``."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Tokens per stored chunk; a multiple of the engine's block size."""
    memory_capacity: int = DEFAULT_MEMORY_CAPACITY
    """Bytes of host memory for stored chunks (per worker), taken once at start-up."""
    namespace: str = ""
    """Extra key part: deployments with different namespaces never share chunks."""
    save_decode_chunks: bool = True
    """Also store chunks that contain generated tokens (multi-turn chat reuse)."""
    redis_url: str | None = None
    """Redis behind the memory tier: redis://, rediss:// (TLS), unix://, redis+cluster://."""
    redis_key_prefix: str = "kvc"
    """Prefix of every Redis key, so deployments can share one Redis without mixing."""
    redis_ttl_s: float | None = None
    """Expiry of stored chunks in Redis; none by default (Redis's own eviction applies)."""
    redis_lookup_budget_ms: float = 50.0
    """Time the scheduler may spend asking Redis what it holds for one request; over it is
    a miss."""
    redis_password_env: str | None = None
    """Name of an environment variable holding the Redis password (kept out of vLLM's
    logs, which print this config)."""
    redis_password_file: str | None = None
    """A file holding the Redis password (the same, for mounted secrets)."""
    chunk_mac_key_env: str | None = None
    """Name of an environment variable holding a secret shared by the engines that share
    Redis: every value is then signed, and values without a valid signature are misses."""
    chunk_mac_key_file: str | None = None
    """A file holding that secret."""
    blending: BlendConfig = field(default_factory=BlendConfig)
    """The ``blend*`` keys (kvconnector/blend/config.py), not a key itself."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        from kvconnector.lmcache_config import translate  # LMCache settings -> these keys

        extra, _ = translate(dict(extra or {}))
        known = {f.name for f in fields(cls)} - {"blending"} | BLEND_KEYS
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; "
                f"valid keys: {sorted(known)} (and, for an LMCache configuration, "
                f"lmcache_config_file and lmcache.<key>)")
        values: dict[str, Any] = {}
        try:
            values["blending"] = BlendConfig.from_extra_config(
                {k: v for k, v in extra.items() if k in BLEND_KEYS})
        except BlendConfigError as e:
            raise ConfigError(str(e)) from None
        if "chunk_size" in extra:
            v = extra["chunk_size"]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"chunk_size: expected a positive int, got {v!r}")
            values["chunk_size"] = v
        if "memory_capacity" in extra:
            values["memory_capacity"] = parse_size("memory_capacity", extra["memory_capacity"])
        if "namespace" in extra:
            v = extra["namespace"]
            if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_.-]*", v):
                raise ConfigError(
                    f"namespace: expected letters, digits, '_', '.' or '-', got {v!r}")
            values["namespace"] = v
        if "save_decode_chunks" in extra:
            v = extra["save_decode_chunks"]
            if not isinstance(v, bool):
                raise ConfigError(f"save_decode_chunks: expected true or false, got {v!r}")
            values["save_decode_chunks"] = v
        if extra.get("redis_url") is not None:
            v = extra["redis_url"]
            schemes = ("redis://", "rediss://", "unix://", "redis+cluster://",
                       "rediss+cluster://")
            if not isinstance(v, str) or not v.startswith(schemes):
                raise ConfigError(f"redis_url: expected a URL starting with one of {schemes}")
            values["redis_url"] = v
        if "redis_key_prefix" in extra:
            v = extra["redis_key_prefix"]
            if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]+", v):
                raise ConfigError(
                    f"redis_key_prefix: expected letters, digits, '_', '.', ':' or '-', "
                    f"got {v!r}")
            values["redis_key_prefix"] = v
        for secret in _SECRETS:
            env, path = extra.get(f"{secret}_env"), extra.get(f"{secret}_file")
            if env is not None and path is not None:
                raise ConfigError(f"give {secret}_env or {secret}_file, not both")
            if env is not None or path is not None:
                if not extra.get("redis_url"):
                    raise ConfigError(f"{secret}_{'env' if env else 'file'} needs redis_url")
                for key, v in ((f"{secret}_env", env), (f"{secret}_file", path)):
                    if v is not None:
                        if not isinstance(v, str) or not v:
                            raise ConfigError(f"{key}: expected a non-empty string, got {v!r}")
                        values[key] = v
        for key in ("redis_ttl_s", "redis_lookup_budget_ms"):
            if extra.get(key) is not None:
                v = extra[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                    raise ConfigError(f"{key}: expected a positive number, got {v!r}")
                values[key] = float(v)
        config = cls(**values)
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

    def memory_slots(self, chunk_bytes: int) -> int:
        """How many chunks of ``chunk_bytes`` the memory tier holds; at least one."""
        if self.memory_capacity < chunk_bytes:
            raise ConfigError(
                f"memory_capacity={_human(self.memory_capacity)} holds no chunk: one chunk "
                f"of {self.chunk_size} tokens is {_human(chunk_bytes)} for this model; use "
                f"at least {_human(chunk_bytes, up=True)!r} (or a smaller chunk_size)")
        return self.memory_capacity // chunk_bytes

    def check_memory_available(self, available: int, total: int) -> None:
        """Refuse a memory tier larger than the memory this machine can give now (the pool
        is touched at start-up: too large a pool gets the process killed)."""
        if self.memory_capacity > available:
            raise ConfigError(
                f"memory_capacity={_human(self.memory_capacity)} is more than this machine "
                f"can give: {_human(available)} available now, of {_human(total)}; lower it "
                f"(it is taken per worker, at start-up)")

    def check_block_size(self, block_size: int) -> None:
        if self.chunk_size % block_size:
            valid = [block_size * k for k in (1, 2, 4, 8, 16) if block_size * k <= 4096]
            raise ConfigError(
                f"chunk_size={self.chunk_size} is not a multiple of the engine's "
                f"block_size={block_size}; valid choices include {valid}")
