"""Chunks promoted from Redis into memory slots whose fetch the workers have not reported
done, and the slots parked blends read from."""

from __future__ import annotations

from collections.abc import Iterable

from kvconnector.store.memory import MemoryIndex


class Fetches:
    """From the plan that fetches a chunk into its slot until the workers report the request
    received, the chunk is in the memory index, but only a job queued behind the fetch on the
    copy thread may read it (an asynchronous load). A parked blend reads its slots on the
    worker's main thread, outside the copy thread's order: they are held until then."""

    def __init__(self, index: MemoryIndex) -> None:
        self._index = index
        self._arriving: dict[bytes, int] = {}
        self._by_request: dict[str, list[bytes]] = {}
        self._held: dict[str, list[int]] = {}

    def __contains__(self, chunk_hash: bytes) -> bool:
        return chunk_hash in self._arriving

    def promote(self, req_id: str, chunk_hash: bytes) -> None:
        self._arriving[chunk_hash] = self._arriving.get(chunk_hash, 0) + 1
        self._by_request.setdefault(req_id, []).append(chunk_hash)

    def hold(self, req_id: str, slots: list[int]) -> None:
        for slot in slots:
            self._index.hold(slot)
        self._held[req_id] = slots

    def received(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            for h in self._by_request.pop(req_id, ()):
                if self._arriving[h] > 1:
                    self._arriving[h] -= 1
                else:
                    del self._arriving[h]
            for slot in self._held.pop(req_id, ()):
                self._index.release(slot)

    def outstanding(self) -> dict[str, int]:
        return {"arriving": len(self._arriving), "held_slots": len(self._held)}
