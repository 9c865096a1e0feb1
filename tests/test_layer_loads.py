"""A load from Redis layer by layer (``layer_loads.py``) against a real redis-server and the
CPU backend's KV pages, without an engine: the layers the forward waits for must hold the
chunks' bytes, a chunk that fails its last check must be reported (and its slot left
unsealed), and a layer vLLM never waited for must fail the whole load."""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from layouts import make_case  # noqa: E402
from redis_server import LatencyProxy, RedisServer  # noqa: E402

from kvconnector.kernels.batched import PagedCopier, block_runs  # noqa: E402
from kvconnector.layer_loads import LayerLoads, layer_groups  # noqa: E402
from kvconnector.layout import describe_layers  # noqa: E402
from kvconnector.ledger import Ledger  # noqa: E402
from kvconnector.metadata import ChunkTransfer  # noqa: E402
from kvconnector.store import ChunkCorrupt, SlotPool, codec  # noqa: E402
from kvconnector.store.codec import PREFIX_LEN  # noqa: E402
from kvconnector.store.redis_store import RedisStore  # noqa: E402
from kvconnector.store.tiering import RedisTier  # noqa: E402
from kvconnector.worker_store import WorkerStore  # noqa: E402

LAYERS, BPC, SLOTS = 12, 2, 6
TIME_LIMIT_S = 60
FP = b"f" * 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
# (chunk hash, block ids): three whole chunks, one with its blocks reversed
CHUNKS = [(bytes([i]) * 16, ids) for i, ids in enumerate([[0, 1], [5, 4], [2, 3]])]


@pytest.fixture(autouse=True)
def time_limit():
    """A load whose layers never come would hang its test: end the run instead (exit code 1;
    tried with a loader that never marks its layers). A waited layer blocks without a
    timeout of its own, by design: the loader always ends within its Redis deadline."""
    faulthandler.dump_traceback_later(TIME_LIMIT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


def _kv():
    case = make_case("cpu-pages", num_layers=LAYERS, num_blocks=8, seed=3)
    layout = describe_layers(dict(zip(NAMES, case.layers, strict=True)), **case.describe_kw)
    for t in case.layers:
        t.zero_()
    return case.layers, layout


class Parts:
    """A writer's pool put every chunk in Redis; a reader's empty pool loads them."""

    def __init__(self, url: str, prefix: str, reader_url: str | None = None,
                 writer_mac: bytes | None = None, reader_mac: bytes | None = None) -> None:
        self.layers, layout = _kv()
        shape = (LAYERS, *layout.chunk_shape(BPC))
        self.redis = RedisStore.from_url(url, key_prefix=prefix, timeout_s=1.0,
                                         mac_key=writer_mac)
        writer_pool = SlotPool(SLOTS, shape, layout.dtype)
        writer_tier = RedisTier(self.redis, writer_pool, layout.family, blocks_per_chunk=BPC)
        writer = WorkerStore(writer_pool, [writer_tier], FP, 0, Ledger())
        gen = torch.Generator().manual_seed(5)
        self.want = [t.clone() for t in self.layers]
        want_copier = PagedCopier(self.want, layout)
        for slot, (h, ids) in enumerate(CHUNKS):
            writer.begin_write(slot).copy_(torch.randn(shape, generator=gen).to(layout.dtype))
            writer.seal(slot, h)
            want_copier.scatter(writer_pool.buffer, block_runs([(slot, ids)]))
        assert writer_tier.flush(10)
        if reader_url is not None or reader_mac is not None:
            self.redis = RedisStore.from_url(reader_url or url, key_prefix=prefix,
                                             timeout_s=1.0, mac_key=reader_mac)
        self.pool = SlotPool(SLOTS, shape, layout.dtype)
        self.tier = RedisTier(self.redis, self.pool, layout.family, blocks_per_chunk=BPC)
        self.ledger = Ledger()
        self.store = WorkerStore(self.pool, [self.tier], FP, 0, self.ledger)
        self.loads = LayerLoads(NAMES, PagedCopier(self.layers, layout), self.store,
                                self.tier, self.ledger, lambda ids: ids, 16, set())
        # the reader's slots: 3, 4, 5
        self.transfers = [ChunkTransfer("r", i, h, 3 + i, ids, "redis")
                          for i, (h, ids) in enumerate(CHUNKS)]

    def rkey(self, i: int) -> bytes:
        return self.redis.redis_key(self.store.key(CHUNKS[i][0]))

    def forward(self, skip: int | None = None) -> list[tuple[ChunkTransfer, str]]:
        self.loads.start(self.transfers)
        for i, name in enumerate(NAMES):
            if i != skip:
                self.loads.wait(name)
        return self.loads.finish()


@pytest.fixture
def parts(server, request):
    p = Parts(server.url, request.node.name.replace("[", "_").replace("]", "_"))
    yield p
    p.loads.close()
    p.redis.close()


@pytest.mark.parametrize("growing", [False, True], ids=["redis", "memory"])
def test_groups_cover_every_layer_once(growing):
    for n in (1, 2, 9, 10, 11, 30, 64):
        groups = layer_groups(n, growing=growing)
        assert [k for a, b in groups for k in range(a, b)] == list(range(n))
        assert len(groups) <= 10
        if growing:  # a load from memory: the forward waits for its first layer only
            assert groups[0] == (0, 1)


def test_each_layer_waited_for_holds_its_bytes_and_the_chunks_are_sealed(parts):
    seen: list[bool] = []
    parts.loads.start(parts.transfers)
    for i, name in enumerate(NAMES):
        parts.loads.wait(name)
        # what the forward reads of layer i once its wait returns
        seen.append(torch.equal(parts.layers[i], parts.want[i]))
    assert parts.loads.finish() == []
    assert all(seen)
    for t in parts.transfers:
        parts.store.read(t.slot, t.chunk_hash)  # sealed: a later memory hit may read it
    totals = parts.ledger.totals.data
    assert totals["layer_loads"] == 1 and totals["redis_loaded_chunks"] == 3
    assert totals["loaded_chunks"] == 3 and totals["redis_misses"] == 0


def _copy_threads(loads: LayerLoads) -> list[int]:
    """Records the thread of every layer-group copy the load makes."""
    seen: list[int] = []
    copier = loads._copier
    scatter = copier.layer_scatter

    def layer_scatter(pool, runs):
        copy = scatter(pool, runs)

        def recorded(first: int, last: int) -> None:
            seen.append(threading.get_ident())
            copy(first, last)
        return recorded
    copier.layer_scatter = layer_scatter
    return seen


@pytest.mark.parametrize("forward_waits", [True, False], ids=["forward-waits", "loader-ahead"])
def test_a_group_is_copied_by_the_forward_when_it_waits_for_it(parts, forward_waits):
    """A forward that waits for a group's bytes copies them itself, and the loader goes on
    fetching; a loader ahead of the forward copies every group (layer_loads.py)."""
    seen = _copy_threads(parts.loads)
    ranges = parts.loads._ranges
    parts.loads._ranges = lambda *a: (time.sleep(0.05 if forward_waits else 0), ranges(*a))[1]
    parts.loads.start(parts.transfers)
    if not forward_waits:
        parts.loads._job.result()  # every group fetched and copied
    for name in NAMES:
        parts.loads.wait(name)
    assert parts.loads.finish() == []
    assert all(torch.equal(a, b) for a, b in zip(parts.layers, parts.want, strict=True))
    me = threading.get_ident()
    assert len(seen) == len(layer_groups(LAYERS))
    assert set(seen) == {me} if forward_waits else me not in seen
    copied = parts.ledger.totals.data.get("phase_seconds.load_copy_forward", 0.0)
    assert (copied > 0) is forward_waits


@pytest.mark.parametrize("forward_waits", [True, False], ids=["forward-waits", "loader-ahead"])
def test_a_copy_that_fails_fails_the_load_not_the_step(parts, forward_waits):
    """On the forward's thread (it waits for every group) or on the loader's."""
    threads_seen: list[int] = []

    def broken(pool, runs):
        def copy(first: int, last: int) -> None:
            threads_seen.append(threading.get_ident())
            raise RuntimeError("copy broke")
        return copy
    parts.loads._copier.layer_scatter = broken
    ranges = parts.loads._ranges
    parts.loads._ranges = lambda *a: (time.sleep(0.05 if forward_waits else 0), ranges(*a))[1]
    parts.loads.start(parts.transfers)
    if not forward_waits:
        parts.loads._job.result()
    for name in NAMES:
        parts.loads.wait(name)  # returns, whichever thread's copy broke
    failed = parts.loads.finish()
    assert (threading.get_ident() in threads_seen) is forward_waits
    assert sorted((t.index, why) for t, why in failed) == [(0, "error"), (1, "error"),
                                                          (2, "error")]


def test_a_payload_damaged_in_its_last_layer_is_reported_after_the_forward(server, parts):
    client = server.client()
    value = client.get(parts.rkey(1))
    client.setrange(parts.rkey(1), len(value) - 3, bytes([value[-3] ^ 0xFF]))
    failed = parts.forward()
    assert [(t.index, why) for t, why in failed] == [(1, "not_in_slot")]
    with pytest.raises(ChunkCorrupt):
        parts.store.read(parts.transfers[1].slot, parts.transfers[1].chunk_hash)
    for t in (parts.transfers[0], parts.transfers[2]):
        parts.store.read(t.slot, t.chunk_hash)
    stats = parts.redis.snapshot()
    assert stats["corrupt_reasons"] == {"checksum": 1} and stats["corrupt_deleted"] == 1
    assert client.exists(parts.rkey(1)) == 0


def test_a_damaged_header_or_a_missing_value_fails_only_its_chunk(server, parts):
    client = server.client()
    client.setrange(parts.rkey(0), PREFIX_LEN + 4, b"\xff")
    client.delete(parts.rkey(2))
    failed = parts.forward()
    assert sorted((t.index, why) for t, why in failed) == [(0, "not_in_slot"), (2, "not_in_slot")]
    for i in range(LAYERS):
        assert torch.equal(parts.layers[i][4:6], parts.want[i][4:6])  # chunk 1 loaded
        assert not parts.layers[i][:4].any()  # chunks 0 and 2: nothing written


def test_a_layer_never_waited_for_fails_the_whole_load_and_turns_it_off(parts):
    failed = parts.forward(skip=4)
    assert sorted((t.index, why) for t, why in failed) == [
        (0, "layer_not_awaited"), (1, "layer_not_awaited"), (2, "layer_not_awaited")]
    assert parts.loads.enabled is False


def test_redis_gone_mid_load_ends_the_load_and_fails_its_chunks(server, request):
    """The forward never waits on a Redis that went away: each layer's wait returns, every
    chunk is reported, none is sealed, and later layers are left alone."""
    with LatencyProxy(server.port, 0.05) as proxy:
        p = Parts(server.url, request.node.name, reader_url=proxy.url)
        try:
            p.loads.start(p.transfers)
            p.loads.wait(NAMES[0])
            proxy.close()
            start = time.monotonic()
            for name in NAMES[1:]:
                p.loads.wait(name)
            failed = p.loads.finish()
            assert time.monotonic() - start < 5
        finally:
            p.loads.close()
            p.redis.close()
    assert sorted(t.index for t, _ in failed) == [0, 1, 2]
    for t in p.transfers:
        with pytest.raises(ChunkCorrupt):
            p.store.read(t.slot, t.chunk_hash)
    assert not p.layers[LAYERS - 1].any()


def test_a_load_from_memory_alone_goes_layer_by_layer_too(parts, monkeypatch):
    """Without Redis (the chunks already in memory slots), layer by layer is only the copy,
    in growing groups: the forward waits for the first layer alone."""
    from kvconnector import layer_loads

    asked: list[bool] = []
    groups = layer_loads.layer_groups
    monkeypatch.setattr(layer_loads, "layer_groups", lambda n, growing=False: (
        asked.append(growing) or groups(n, growing=growing)))
    for t in parts.transfers:  # what the reader's Redis load would have left in its slots
        assert parts.store.fetch([(t.slot, t.chunk_hash, "redis", 0)]) is None
        parts.store.read(t.slot, t.chunk_hash)
    for t in parts.layers:
        t.zero_()
    memory = LayerLoads(NAMES, parts.loads._copier, parts.store, None, parts.ledger,
                        lambda ids: ids, 16, set())
    try:
        loads = [ChunkTransfer("m", t.index, t.chunk_hash, t.slot, t.block_ids)
                 for t in parts.transfers]
        assert not any(memory.ranged(t) for t in loads)
        memory.start(loads)
        seen = []
        for i, name in enumerate(NAMES):
            memory.wait(name)
            seen.append(torch.equal(parts.layers[i], parts.want[i]))
        assert memory.finish() == [] and all(seen)
        assert asked == [True]
    finally:
        memory.close()


def test_with_a_shared_secret_only_values_signed_with_it_are_kept(server, request):
    """The last check is the MAC when the reader has a key: values signed with another
    secret arrive, are used by the forward, and are all reported; with the same secret,
    none is."""
    name = request.node.name
    for reader_secret, failures in ((b"s" * 32, 0), (b"t" * 32, 3)):
        p = Parts(server.url, f"{name}-{failures}", writer_mac=codec.mac_key(b"s" * 32),
                  reader_mac=codec.mac_key(reader_secret))
        try:
            failed = p.forward()
            stats = p.redis.snapshot()
        finally:
            p.loads.close()
            p.redis.close()
        assert len(failed) == failures
        assert stats["corrupt_reasons"] == ({"mac": 3} if failures else {})
