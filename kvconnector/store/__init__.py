"""Where chunks live. The memory tier is split across the two vLLM processes:
``MemoryIndex`` (scheduler) decides which chunk sits in which slot and what to evict;
``SlotPool`` (each worker) holds the bytes and checks them on every read."""

from kvconnector.store.memory import ChunkCorrupt, MemoryIndex, SlotPool

__all__ = ["ChunkCorrupt", "MemoryIndex", "SlotPool"]
