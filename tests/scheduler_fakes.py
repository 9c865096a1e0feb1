"""Small fakes of vLLM's Request, blocks and SchedulerOutput, and of Redis's existence
check, carrying only what the connector's scheduler half reads: for unit tests of the real
``SchedulerHalf`` at block sizes or timings a real engine on the CPU build cannot run."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from vllm.v1.request import RequestStatus


class FakeRequest:
    def __init__(self, rid: str, tokens: list[int], block_size: int = 16,
                 params: dict[str, Any] | None = None) -> None:
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.prompt_token_ids = list(tokens)
        self.kv_transfer_params = params
        # vLLM's per-block prefix hashes (a blend salts them: compat.mark_approximate).
        self.block_hashes = [bytes([i % 256]) * 32 for i in range(len(tokens) // block_size)]
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.cache_salt = None
        self.lora_request = None
        self.mm_features: list = []
        self.prompt_embeds = None
        self.pooling_params = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


def step_output(scheduled: dict[str, int], blocks: dict[str, list[int]],
                new: dict[str, list[int]] | None = None) -> SimpleNamespace:
    """The fields of vLLM's SchedulerOutput the connector reads."""
    new = new or {}
    return SimpleNamespace(
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda r: (blocks[r],)),
        scheduled_new_reqs=[SimpleNamespace(block_ids=(ids,)) for ids in new.values()],
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=[], resumed_req_ids=set()),
        new_block_ids_to_zero=None, kv_cache_block_copies=None)


def blocks_of(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


class FakeRedis:
    def __init__(self, keys: set[str]) -> None:
        self.keys = keys
        self.asked: list[list[str]] = []
        self.gate = threading.Event()

    def exists_many(self, keys, budget_s):
        self.gate.wait(5)
        self.asked.append([str(k) for k in keys])
        return [str(k) in self.keys for k in keys]

    def exists_prefix(self, keys, budget_s):
        found = self.exists_many(keys, budget_s)
        return found.index(False) if False in found else len(found)

    def start_exists(self, keys, budget_s):
        return None  # asked on the lookup thread only (inline lookups: test_lookups.py)

    def close(self) -> None:
        pass


