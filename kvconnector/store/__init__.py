"""Where chunks live. The memory tier is split across the two vLLM processes:
``MemoryIndex`` (scheduler) decides which chunk sits in which slot and what to evict;
``SlotPool`` (each worker) holds the bytes and checks them on every read. Behind it, when
configured: a directory on local disk (``disk_*.py``), shared by the engines of one host
and kept across restarts, then Redis, shared by every engine that points at it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvconnector.config import ConnectorConfig
    from kvconnector.keys import Fingerprint
    from kvconnector.placement import WritePlacement
    from kvconnector.store.disk_tier import DiskTier
    from kvconnector.store.memory import ChunkCorrupt, MemoryIndex, SlotPool
    from kvconnector.store.redis_mirror import RedisKeyMirror
    from kvconnector.store.redis_store import RedisStore

__all__ = ["ChunkCorrupt", "MemoryIndex", "SlotPool", "open_disk", "open_mirror", "open_redis"]

logger = logging.getLogger("kvconnector.store")


def __getattr__(name: str) -> Any:
    # The memory tier needs torch; the codec and Redis tools (the CLI) do not.
    if name in ("ChunkCorrupt", "MemoryIndex", "SlotPool"):
        from kvconnector.store import memory

        return getattr(memory, name)
    raise AttributeError(name)


def open_redis(config: ConnectorConfig, *, for_lookups: bool = False) -> RedisStore | None:
    """The Redis tier of this process, if configured (connects lazily, never raises later).

    ``for_lookups``: the scheduler's client, whose every call (connecting included) must fit
    the lookup budget."""
    if not config.redis_url:
        return None
    from kvconnector.store import codec
    from kvconnector.store.redis_store import RedisStore
    from kvconnector.store.redis_url import url_has_password

    kw: dict[str, Any] = {}
    if for_lookups:
        kw["connect_timeout_s"] = config.redis_lookup_budget_ms / 1000
        if url_has_password(config.redis_url):
            logger.warning("kvconnector: redis_url carries a password, and vLLM prints "
                           "kv_connector_extra_config in its start-up log; give it with "
                           "redis_password_env or redis_password_file instead")
    password = config.secret("redis_password")
    if password is not None:
        kw["password"] = password.decode()
    secret = config.secret("chunk_mac_key")
    if secret is not None:
        kw["mac_key"] = codec.mac_key(secret)
    return RedisStore.from_url(config.redis_url, key_prefix=config.redis_key_prefix,
                               ttl_s=config.redis_ttl_s, **kw)


def open_mirror(config: ConnectorConfig, store: RedisStore,
                fingerprint: bytes) -> RedisKeyMirror | None:
    """The scheduler's mirror of the store's keys of ``fingerprint`` (this model), if
    ``redis_key_mirror`` is on."""
    if not config.redis_key_mirror:
        return None
    from kvconnector.store.redis_mirror import RedisKeyMirror

    return RedisKeyMirror(store.mirror_client, store.key_space(fingerprint))


def open_disk(config: ConnectorConfig, capacity: int, pool: SlotPool, layout_name: str,
              fingerprint: Fingerprint, blocks_per_chunk: int, track_gone: bool,
              placement: WritePlacement) -> DiskTier:
    """This worker's disk tier (``config.disk_path``, checked at start-up); its writes run
    as ``placement`` says."""
    from kvconnector.store import codec
    from kvconnector.store.disk_tier import DiskTier

    secret = config.secret("chunk_mac_key")
    assert config.disk_path is not None
    return DiskTier(config.disk_path, capacity, pool, layout_name,
                    mac_key=codec.mac_key(secret) if secret is not None else None,
                    direct_io=config.disk_direct_io, write_threads=config.disk_write_threads,
                    fingerprint=fingerprint, blocks_per_chunk=blocks_per_chunk,
                    track_gone=track_gone, placement=placement)
