"""The least a connector can do for a hit: a floor to measure kvconnector against.

``bench_hit_paired.py --floor`` runs engines with this connector. It keeps whole prompts in
the worker's memory, keyed by the prompt's tokens, and on a hit of the same prompt copies
the blocks back in one slice copy per run of blocks and layer, before the forward pass.
With ``kv_connector_extra_config: {"redis_url": ...}`` it also writes each prompt to Redis
as one value (every layer's blocks, from a thread of its own, as kvconnector's puts run),
its scheduler half knows the prompts Redis held when it started (one ``SCAN``, no lookups
after), and a hit of one of those that it does not hold is one ``GET`` before the forward
pass. It has none of what a product needs: no chunks (only the same prompt hits), no checks
of what it loads, no bound on its memory, no tiers, no eviction, no metrics, no tensor
parallelism, and its scheduler half assumes that every save it asks for happens. What it costs over
vLLM's own prefix-cache hit is what vLLM's connector calls, a lookup and one copy cost any
connector in this engine on this machine. A request with ``kv_transfer_params:
{"kvconnector": false}`` opts out of it as of kvconnector (``bench_miss_paired.py --floor``
pairs its misses with those).

vLLM names it by module path: ``{"kv_connector": "FloorConnector",
"kv_connector_module_path": "floor_connector"}`` with this folder on ``sys.path``.
"""

from __future__ import annotations

import queue
import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass
class Transfer:
    key: int
    block_ids: list[int]  # vLLM's blocks, in the prompt's order
    first: int  # index of the first of them among the prompt's stored blocks
    redis: bool = False  # read from Redis first


@dataclass
class FloorMeta(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(offset in ids, first block id, length) of each run of consecutive block ids."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and b == out[-1][1] + out[-1][2]:
            off, first, n = out[-1]
            out[-1] = (off, first, n + 1)
        else:
            out.append((i, b, 1))
    return out


class FloorConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block = vllm_config.cache_config.block_size
        self._saved: set[int] = set()  # scheduler: prompts the worker holds
        self._asked: dict[str, tuple[int, int, int]] = {}  # req id: key, computed, tokens
        self._opted_out: set[str] = set()  # scheduler: requests not to save
        self._loads: list[Transfer] = []
        self._pages: dict[str, torch.Tensor] = {}  # worker: vLLM's KV, per layer
        self._held: dict[int, dict[str, torch.Tensor]] = {}  # worker: key -> layer -> blocks
        self._ratio = 1  # kernel blocks per vLLM block
        url = self._kv_transfer_config.get_from_extra_config("redis_url", None)
        self._redis = redis.Redis.from_url(url) if url else None
        self._in_redis: set[int] = set()
        if self._redis is not None:
            self._redis.ping()  # the connection is open before the first hit
            self._in_redis = {int(k.split(b":")[1]) for k in self._redis.scan_iter(b"floor:*")}
        self._writes: queue.Queue[tuple[int, dict[str, torch.Tensor]] | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    # scheduler half

    def _stored(self, tokens: list[int]) -> tuple[int, int]:
        n = (len(tokens) - 1) // self._block * self._block  # vLLM computes the last token
        return hash(tuple(tokens[:n])), n

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if (request.kv_transfer_params or {}).get("kvconnector") is False:
            self._opted_out.add(request.request_id)
            return 0, False
        key, n = self._stored(list(request.prompt_token_ids or []))
        if (key not in self._saved and key not in self._in_redis) or n <= num_computed_tokens:
            return 0, False
        self._asked[request.request_id] = (key, num_computed_tokens, n)
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        asked = self._asked.pop(request.request_id, None)
        if asked is None or num_external_tokens == 0:
            return
        key, computed, n = asked
        first = computed // self._block
        ids = blocks.get_block_ids()[0][first:n // self._block]
        self._loads.append(Transfer(key, list(ids), first, key not in self._saved))
        self._saved.add(key)  # the worker holds it from this step on

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = FloorMeta(loads=self._loads)
        self._loads = []
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._opted_out:
                self._opted_out.discard(req.req_id)
                continue
            tokens = list(req.prompt_token_ids or [])
            key, n = self._stored(tokens)
            whole = (scheduler_output.num_scheduled_tokens[req.req_id]
                     >= len(tokens) - req.num_computed_tokens)
            if n and whole and key not in self._saved:
                meta.saves.append(Transfer(key, list(req.block_ids[0][:n // self._block]), 0))
                self._saved.add(key)
        return meta

    # worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._pages = dict(kv_caches)  # each [kernel blocks, heads, tokens, content]
        self._ratio = self._block // next(iter(kv_caches.values())).shape[2]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FloorMeta)
        for t in meta.loads:
            if t.redis:
                self._fetch(t.key)
            held = self._held[t.key]
            r = self._ratio
            for off, first, n in _runs(t.block_ids):
                src = slice((t.first + off) * r, (t.first + off + n) * r)
                for name, pages in self._pages.items():
                    pages[first * r:(first + n) * r].copy_(held[name][src])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FloorMeta)
        for t in meta.saves:
            r = self._ratio
            ids = torch.tensor([b * r + i for b in t.block_ids for i in range(r)])
            self._held[t.key] = {name: pages.index_select(0, ids)
                                 for name, pages in self._pages.items()}
            if self._redis is not None:
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                    name="floor-redis-put")
                    self._writer.start()
                self._writes.put((t.key, self._held[t.key]))

    def _write_loop(self) -> None:
        assert self._redis is not None
        while (item := self._writes.get()) is not None:
            key, held = item
            self._redis.set(b"floor:%d" % key,
                            b"".join(memoryview(v.view(torch.uint8).reshape(-1).numpy())
                                     for v in held.values()))

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(10)

    def _fetch(self, key: int) -> None:
        assert self._redis is not None
        data = self._redis.get(b"floor:%d" % key)
        if data is None:  # the floor has no misses to fall back on: the benchmark is off
            raise RuntimeError(f"floor:{key} left Redis after start-up (flushed, or evicted)")
        with warnings.catch_warnings():  # read only: copied from, never written
            warnings.simplefilter("ignore")
            raw = torch.frombuffer(data, dtype=torch.uint8)
        held, at, size = {}, 0, len(data) // len(self._pages)
        for name, pages in self._pages.items():
            block = raw[at:at + size].view(pages.dtype)
            held[name] = block.view(-1, *pages.shape[1:])
            at += size
        self._held[key] = held
