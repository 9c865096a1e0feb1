"""Host-memory tier: a fixed pool of chunk slots, LRU over chunk hashes."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvconnector.keys import ChunkKey

logger = logging.getLogger("kvconnector.store.memory")


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of this machine's memory: MemAvailable, not free pages."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


class ChunkCorrupt(RuntimeError):
    """A slot does not hold the chunk asked for (another key, or none); it must not be used.

    ``reason``: "missing" (no slot) or "not_in_slot" (the slot holds no sealed copy of it)."""

    def __init__(self, message: str, reason: str = "not_in_slot") -> None:
        super().__init__(message)
        self.reason = reason


class MemoryIndex:
    """Scheduler-side map of chunk hash -> slot, with LRU eviction.

    The scheduler owns placement so that both processes agree on it without shared memory:
    a chunk is listed from the step its save is planned, and a worker executes its steps in
    order, so any later load finds the bytes in place.

    A slot is pinned from the moment a step's plan names it (a save or fetch into it, a
    load out of it) until that plan is built: one plan never names a slot for two chunks,
    which would have the worker write both into it and seal each under its own key.
    ``hold`` keeps a slot out of every plan for longer (a parked blend reads its slots on
    the worker's main thread, outside the copy thread's order), across evictions, drops and
    cache resets alike: a slot forgotten while pinned or held is reused only once free.
    """

    def __init__(self, num_slots: int,
                 on_forget: Callable[[bytes], None] | None = None) -> None:
        if num_slots <= 0:
            raise ValueError("the memory store holds no chunk: raise memory_capacity")
        self.num_slots = num_slots
        self._on_forget = on_forget  # told of every chunk evicted, dropped or cleared
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._held: dict[int, int] = {}  # slot -> holders
        self._forgotten: set[int] = set()  # no chunk, but pinned or held: not free yet
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, chunk_hash: bytes) -> bool:
        return chunk_hash in self._slots

    @property
    def pinned(self) -> int:
        return len(self._pinned) + len(self._held)

    def _busy(self, slot: int) -> bool:
        return slot in self._pinned or slot in self._held

    def count_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading chunks are stored. No side effects (vLLM may ask repeatedly)."""
        n = 0
        for h in hashes:
            if h not in self._slots:
                break
            n += 1
        return n

    def slot_of(self, chunk_hash: bytes) -> int | None:
        return self._slots.get(chunk_hash)

    def use(self, chunk_hash: bytes) -> int:
        """Mark a chunk as read now: most recently used, pinned for this step."""
        slot = self._slots[chunk_hash]
        self._slots.move_to_end(chunk_hash)
        self._pinned.add(slot)
        return slot

    def touch(self, chunk_hash: bytes) -> None:
        self._slots.move_to_end(chunk_hash)

    def allocate(self, chunk_hash: bytes) -> int | None:
        """A slot for a new chunk, pinned for this step, evicting the least recently used
        chunk whose slot no plan names. None when every slot is pinned or held."""
        if chunk_hash in self._slots:
            raise KeyError("chunk already stored")
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if not self._busy(s)), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self.evictions += 1
            if self._on_forget is not None:
                self._on_forget(victim)
        self._slots[chunk_hash] = slot
        self._pinned.add(slot)
        return slot

    def _release_slot(self, slot: int) -> None:
        if self._busy(slot):
            self._forgotten.add(slot)
        else:
            self._free.append(slot)

    def drop(self, chunk_hash: bytes) -> None:
        slot = self._slots.pop(chunk_hash, None)
        if slot is not None:
            self._release_slot(slot)
            if self._on_forget is not None:
                self._on_forget(chunk_hash)

    def hold(self, slot: int) -> None:
        """Keep ``slot`` out of every plan until ``release``, whatever happens to its chunk."""
        self._held[slot] = self._held.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        n = self._held.pop(slot, 0) - 1
        if n > 0:
            self._held[slot] = n
        self._settle(slot)

    def _settle(self, slot: int) -> None:
        if slot in self._forgotten and not self._busy(slot):
            self._forgotten.discard(slot)
            self._free.append(slot)

    def unpin_all(self) -> None:
        pinned, self._pinned = self._pinned, set()
        for slot in pinned:
            self._settle(slot)

    def clear(self) -> None:
        """Forget every chunk (a cache reset). Slots no plan names are free at once; the
        others once their plan is built or their holder releases them."""
        self._forgotten.update(s for s in self._slots.values() if self._busy(s))
        if self._on_forget is not None:
            for h in self._slots:
                self._on_forget(h)
        self._slots.clear()
        self._free = [s for s in range(self.num_slots - 1, -1, -1)
                      if s not in self._forgotten]


PAGE = 4096


def _aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised tensor whose memory starts on a page: slots of whole pages can then
    be read into with O_DIRECT (the disk tier), which needs aligned buffers."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # Pinned memory needs the same care: torch's pinned tensors were not page aligned on an
    # H100 machine (torch 2.11, CUDA 13).
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    offset = -raw.data_ptr() % PAGE
    return raw[offset:offset + nbytes].view(dtype).view(shape)


@dataclass(frozen=True)
class SlotHeader:
    key: ChunkKey
    checksum: int | None = None  # XXH3-64 of the bytes (codec.checksum), where known
    # Made here, so a copy goes to Redis; False for a chunk fetched from Redis or the disk.
    for_redis: bool = True


class SlotPool:
    """Worker-side bytes of the memory tier: one allocation of ``num_slots`` chunks.

    Pinned when CUDA is present (fast, asynchronous host copies). Every slot carries the
    key it holds; ``read`` refuses a slot sealed under another key, or not sealed at all
    (a write in progress or failed). Slot bytes are not re-checked on read: they never
    leave this process (docs/architecture.md, "Integrity"), so nothing may write a slot
    while another thread reads it: the copy thread runs the scheduler's plans in order,
    and a Redis put reads its slot under a lease (``lease``) that ``begin_write`` waits for.
    A Redis put hashes the slot's bytes for the value's header under its lease, on its own
    thread: the seal, on the forward's thread, does not (0.1 ms a 1024-token tiny-model
    miss, docs/benchmarks.md section 50).
    """

    def __init__(self, num_slots: int, chunk_shape: Sequence[int], dtype: torch.dtype) -> None:
        pin = torch.cuda.is_available()
        self.chunk_shape = tuple(chunk_shape)
        self.buffer = _aligned_empty((num_slots, *self.chunk_shape), dtype, pin)
        # Touch every page now: the capacity is really held from start-up, and the first
        # saves do not pay page faults inside a forward step.
        self.buffer.view(torch.uint8).zero_()
        self.chunk_bytes = self.buffer[0].numel() * self.buffer.element_size()
        self.num_slots = num_slots
        self._headers: list[SlotHeader | None] = [None] * num_slots
        self._leases = [0] * num_slots  # readers outside the copy thread (Redis puts)
        self._lease_change = threading.Condition()
        logger.info("kvconnector memory pool: %d slots x %.1f MiB (%s, pinned=%s)",
                    num_slots, self.chunk_bytes / 2**20, dtype, pin)

    def slot(self, slot: int) -> torch.Tensor:
        return self.buffer[slot]

    def part(self, slot: int, blocks: int, blocks_per_chunk: int) -> torch.Tensor:
        """The first ``blocks`` of the ``blocks_per_chunk`` blocks of ``slot``'s chunk, every
        layer (a strided view; the whole slot for 0): what a partial chunk holds."""
        chunk = self.buffer[slot]
        if not blocks:
            return chunk
        return chunk.narrow(2, 0, chunk.shape[2] * blocks // blocks_per_chunk)

    def slot_bytes(self, slot: int) -> memoryview:
        """The slot's memory as bytes (no copy), for socket I/O."""
        return memoryview(self.buffer[slot].view(torch.uint8).reshape(-1).numpy())

    def begin_write(self, slot: int) -> torch.Tensor:
        """The slot's buffer, invalidated until ``end_write`` seals it; waits for the
        leases still reading the slot's previous chunk."""
        with self._lease_change:
            self._headers[slot] = None
            self._lease_change.wait_for(lambda: not self._leases[slot])
        return self.buffer[slot]

    def lease(self, slot: int, key: ChunkKey) -> SlotHeader | None:
        """Read ``slot`` from another thread while it holds ``key``: its header, and the
        slot stays as it is until ``end_lease``; None (no lease) if it holds another key."""
        with self._lease_change:
            header = self._headers[slot]
            if header is None or header.key != key:
                return None
            self._leases[slot] += 1
            return header

    def leased(self, slot: int) -> bool:
        """Whether a lease still reads ``slot`` (``begin_write`` would wait for it)."""
        return bool(self._leases[slot])

    def end_lease(self, slot: int) -> None:
        with self._lease_change:
            self._leases[slot] -= 1
            self._lease_change.notify_all()

    def end_write(self, slot: int, key: ChunkKey, xxh3: int | None = None, *,
                  for_redis: bool = True) -> None:
        """Seal a slot as holding ``key`` (whose bytes' checksum is ``xxh3``, if known);
        ``for_redis=False``: the slot is not to be sent (it came from Redis or the disk)."""
        self._headers[slot] = SlotHeader(key, xxh3, for_redis)

    def header(self, slot: int) -> SlotHeader | None:
        return self._headers[slot]

    def read(self, slot: int, key: ChunkKey) -> torch.Tensor:
        self.check(slot, key)
        return self.buffer[slot]

    def check(self, slot: int, key: ChunkKey) -> None:
        """Raises ``ChunkCorrupt`` unless ``slot`` is sealed as ``key``."""
        if not 0 <= slot < self.num_slots:
            raise ChunkCorrupt(f"chunk {key} has no slot", "missing")
        header = self._headers[slot]
        if header is None or header.key != key:
            raise ChunkCorrupt(f"slot {slot} does not hold chunk {key}", "not_in_slot")

    def slot_holding(self, key: ChunkKey) -> int | None:
        for slot, header in enumerate(self._headers):
            if header is not None and header.key == key:
                return slot
        return None
