"""vLLM's KV events (``vllm.distributed.kv_events``), built for the connector's tiers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with
    ``enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def block_stored(request: Request, first_block: int, num_blocks: int, block_size: int,
                 medium: str) -> Any:
    """``BlockStored`` for blocks ``[first_block, first_block + num_blocks)`` of a request,
    under vLLM's own block hashes (as its GPU events give them); None when vLLM has not
    hashed them at this block size."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = request.block_hashes
    if len(hashes) < first_block + num_blocks:
        return None
    parent = maybe_convert_block_hash(hashes[first_block - 1]) if first_block else None
    start = first_block * block_size
    lora = request.lora_request
    return BlockStored(
        block_hashes=[maybe_convert_block_hash(h)
                      for h in hashes[first_block:first_block + num_blocks]],
        parent_block_hash=parent,
        token_ids=list(request.all_token_ids[start:start + num_blocks * block_size]),
        block_size=block_size, lora_id=lora.adapter_id if lora else None, medium=medium,
        lora_name=lora.name if lora else None)


def block_removed(block_hashes: list[Any], medium: str) -> Any:
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=list(block_hashes), medium=medium)
