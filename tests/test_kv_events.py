"""KV events for KV-aware routers: with vLLM's ``kv_events_config``, a subscriber sees the
blocks kvconnector's memory ("CPU") and disk ("DISK") tiers store, under vLLM's own block
hashes, and their removal when a tier evicts them."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import prompt, run_engine
from tests.redis_server import free_port

pytestmark = pytest.mark.engine

CHUNK_FILE = (256 << 10) + 4096
P1, P2, P3 = prompt(31, 700), prompt(32, 600), prompt(33, 600)


class Subscriber:
    """vLLM's ZMQ KV event stream, decoded, on a thread of the test process."""

    def __init__(self, port: int) -> None:
        import zmq

        self.events: list = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _, _, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            self.events += decoder.decode(payload).events

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def test_routers_see_the_tiers_blocks_come_and_go(tiny_model, tmp_path):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    port = free_port()
    sub = Subscriber(port)
    try:
        extra = {"memory_capacity": "512KiB", "disk_path": str(tmp_path / "kv"),
                 "disk_capacity": 3 * CHUNK_FILE}
        run_engine(tmp_path / "e", {
            "model": tiny_model, "connector": extra, "prefix_caching": True,
            "llm": {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                         "endpoint": f"tcp://*:{port}"}},
            "steps": [{"op": "sleep", "seconds": 1.0},
                      {"op": "generate", "prompts": [P1]}, {"op": "flush"},
                      {"op": "generate", "prompts": [P2, P3]}, {"op": "flush"},
                      {"op": "generate", "prompts": [P3]}, {"op": "sleep", "seconds": 1.0}]})
    finally:
        sub.close()
    stored = [e for e in sub.events if isinstance(e, BlockStored)]
    removed = [e for e in sub.events if isinstance(e, BlockRemoved)]
    gpu = {h: e for e in stored if e.medium == "GPU" for h in e.block_hashes}
    by_medium = {m: [e for e in stored if e.medium == m] for m in ("CPU", "DISK")}
    # P1: two full chunks of 2 blocks and a partial chunk of 1 block, in both tiers.
    first = {m: es[:3] for m, es in by_medium.items()}
    for medium, events in first.items():
        assert [len(e.block_hashes) for e in events] == [2, 2, 1], medium
        tokens = [t for e in events for t in e.token_ids]
        assert tokens == P1[:640], medium
        for e in events:  # vLLM's own hashes of the same blocks, with the same tokens
            for h in e.block_hashes:
                assert h in gpu, f"{medium}: a block vLLM never announced"
        assert events[1].parent_block_hash == events[0].block_hashes[-1]
    # 512 KiB hold 2 chunks, 3 files on disk: P1's chunks go from both tiers.
    p1_blocks = {h for e in first["CPU"] for h in e.block_hashes}
    gone = {m: {h for e in removed if e.medium == m for h in e.block_hashes}
            for m in ("CPU", "DISK")}
    assert p1_blocks & gone["CPU"] and p1_blocks & gone["DISK"]
    announced = {m: {h for e in by_medium[m] for h in e.block_hashes} for m in gone}
    assert gone["CPU"] <= announced["CPU"] and gone["DISK"] <= announced["DISK"]
