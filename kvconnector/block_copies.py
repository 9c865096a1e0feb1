"""Chunks between vLLM's paged KV blocks and the pool's slots, and what each copy owes the
ledger. The CPU build moves a step's chunks in one gather or scatter (``PagedCopier``): a
step's saves on the copy thread, held for the next forward pass (``placement.py``), unless
they are small; CUDA queues a DMA per chunk through a staging buffer (``HostTransfer``) and
seals the slot on the copy thread once it is done."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from kvconnector import kernels
from kvconnector.background import CopyThread
from kvconnector.kernels.batched import PagedCopier, block_runs
from kvconnector.layout import LayerLayout
from kvconnector.ledger import Ledger
from kvconnector.metadata import ChunkTransfer
from kvconnector.store import ChunkCorrupt
from kvconnector.worker_store import WorkerStore

if TYPE_CHECKING:
    from kvconnector.kernels.host_transfer import HostTransfer

logger = logging.getLogger("kvconnector.worker")


def paged_mover(layers: list[torch.Tensor], layout: LayerLayout, chunk_blocks: int,
                spare_cores: set[int]) -> PagedCopier | HostTransfer:
    """What moves chunks for these KV tensors; ``chunk_blocks``: a chunk's kernel blocks."""
    if layers[0].is_cuda:
        from kvconnector.kernels.host_transfer import HostTransfer

        return HostTransfer(layers, layout, chunk_blocks, max_chunks=1)
    return PagedCopier(layers, layout, spare_cores)


def copy_stream(mover: PagedCopier | HostTransfer) -> torch.cuda.Stream | None:
    return None if isinstance(mover, PagedCopier) else mover.stream


class BlockCopies:
    def __init__(self, mover: PagedCopier | HostTransfer, layers: list[torch.Tensor],
                 block_size: int, kernel_block_size: int, store: WorkerStore, ledger: Ledger,
                 copies: CopyThread, inline_save_max_bytes: int = 0) -> None:
        """``block_size``: vLLM's, a multiple of the kernel's. ``inline_save_max_bytes``:
        a CPU step's saves up to this size are made on the thread that asks (config
        ``inline_save_max_kib``). The default of 1 MiB, because on 1024-token tiny-model
        misses (0.5 MiB, a 0.2 ms gather) that took 1.046x the requests that opt out, the
        copy thread 1.068x (pooled over nine and seven runs; the last two pairs the other
        way); larger saves were as fast or faster on the copy thread: SmolLM2's
        1k (22 MiB, 3.8 ms on the worker's thread) 1.002x against 1.009x, and under load,
        where a full step saves 2 MiB of the tiny model, 1.048x against 1.059x
        (docs/benchmarks.md section 49)."""
        self.inline_save_max_bytes = inline_save_max_bytes
        self.layers = layers
        self.block_size = block_size
        self._ratio = block_size // kernel_block_size
        self.store = store
        self.ledger = ledger
        self.copies = copies
        self.copier = mover if isinstance(mover, PagedCopier) else None
        if self.copier is not None:
            self.copier.prepare(store.pool.buffer)
        self._host_transfer = None if isinstance(mover, PagedCopier) else mover
        self._device_lock = threading.Lock()  # HostTransfer's staging buffer is shared

    def kernel_ids(self, block_ids: list[int]) -> list[int]:
        return kernels.kernel_block_ids(block_ids, self._ratio)

    def _kernel_block_ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.kernel_ids(block_ids)], dtype=torch.long)

    # ---- loads ----
    def load(self, transfers: list[ChunkTransfer], on_copy_thread: bool) -> None:
        """Check every slot's key, then move all the chunks that passed at once. A slot
        that fails costs a recompute of its blocks, never the request."""
        start = time.perf_counter()
        ready: list[ChunkTransfer] = []
        for t in transfers:
            try:
                self.store.check(t.slot, t.chunk_hash)
            except ChunkCorrupt as e:
                logger.warning("kvconnector: %s; its blocks will be recomputed", e)
                self.ledger.chunk_load_failed(t, e.reason)
                continue
            ready.append(t)
        if not ready:
            return
        try:
            if self.copier is not None:
                runs = block_runs((t.slot, self.kernel_ids(t.block_ids)) for t in ready)
                self.copier.scatter(self.store.pool.buffer, runs)
            else:
                for t in ready:
                    self._load_cuda(self.store.pool.slot(t.slot),
                                    self._kernel_block_ids(t.block_ids), on_copy_thread)
        except Exception:
            logger.exception("kvconnector: loading %d chunks failed", len(ready))
            for t in ready:
                self.ledger.chunk_load_failed(t, "error")
            return
        elapsed = time.perf_counter() - start
        self.ledger.loaded(ready, self.block_size, self.store.pool.chunk_bytes, elapsed,
                           copy_seconds=elapsed)

    def _load_cuda(self, slot: torch.Tensor, block_ids: torch.Tensor,
                   on_copy_thread: bool) -> None:
        """Host slot -> blocks; on the main thread, ordered before the compute stream's next
        work; on the copy thread, complete on return."""
        assert self._host_transfer is not None
        with self._device_lock:
            done = self._host_transfer.load(slot[None], block_ids)
        if on_copy_thread:
            done.synchronize()
        else:
            torch.cuda.current_stream(self.layers[0].device).wait_event(done)

    # ---- saves ----
    def save(self, transfers: list[ChunkTransfer]) -> None:
        """Start copying chunks out; the forward pass does not wait (a small CPU save is
        made now: ``inline_save_max_bytes``).

        The source blocks stay as they are until the copies are done: running requests own
        them, and a later step that hands them out again lists the request in its
        ``fence``, which the worker waits for before any KV is written.
        """
        if not transfers:
            return
        slots = [t.slot for t in transfers]
        if (self._host_transfer is None
                and len(transfers) * self.store.pool.chunk_bytes <= self.inline_save_max_bytes
                and not self.copies.uses(slots)
                and not any(self.store.pool.leased(s) for s in slots)):
            # Nothing else touches the slots: the forward's thread never waits on a fetch
            # or a Redis put (a hung Redis), which queue the save behind them instead.
            self._save_chunks(transfers)
            return
        if self._host_transfer is None:
            self.copies.submit(lambda ts=transfers: self._save_chunks(ts),
                               {t.req_id for t in transfers}, slots, save=True)
            return
        for t in transfers:  # CUDA: the DMA is queued now, the seal waits for it on the thread
            self.copies.wait_for_slots([t.slot])
            start = time.perf_counter()
            try:
                buf = self.store.begin_write(t.slot)
                with self._device_lock:
                    done = self._host_transfer.save(self._kernel_block_ids(t.block_ids), buf[None])
            except Exception:
                self._save_failed(t)
                continue
            self.copies.submit(lambda t=t, d=done, s=start: self._seal(t, d, s),
                               [t.req_id], [t.slot])

    def _save_chunks(self, transfers: list[ChunkTransfer]) -> None:
        """All of a step's saves in one pass (CPU)."""
        assert self.copier is not None
        start = time.perf_counter()
        try:
            for t in transfers:
                buf = self.store.begin_write(t.slot)
                if any(b < 0 for b in t.block_ids):
                    buf.zero_()  # a partial chunk: no bytes of an earlier chunk stay behind
            runs = block_runs((t.slot, self.kernel_ids(t.block_ids)) for t in transfers)
            self.copier.gather(self.store.pool.buffer, runs)
        except Exception:
            for t in transfers:
                self._save_failed(t)
            return
        sealed = [t for t in transfers if self._seal(t, None)]
        self._count_saves(sealed, time.perf_counter() - start)

    def _seal(self, t: ChunkTransfer, copied: torch.cuda.Event | None,
              start: float | None = None) -> bool:
        """Mark the slot as holding ``t``'s chunk, and with ``start`` count the save. Only
        values bound for Redis get a checksum: memory slots never leave this process
        (docs/architecture.md, "Integrity")."""
        try:
            if copied is not None:
                copied.synchronize()
            self.store.seal(t.slot, t.chunk_hash, t.blocks)
        except Exception:
            self._save_failed(t)
            return False
        if start is not None:
            self._count_saves([t], time.perf_counter() - start)
        return True

    def _count_saves(self, sealed: list[ChunkTransfer], seconds: float) -> None:
        """Saves made together in ``seconds``, counted at once (one CPU step's: the ledger's
        lock and counters once a step, not once a chunk)."""
        if not sealed:
            return
        per_block = self.store.pool.chunk_bytes // len(sealed[0].block_ids)
        n_blocks = sum(b >= 0 for t in sealed for b in t.block_ids)
        self.ledger.saved(len(sealed), n_blocks * self.block_size, n_blocks * per_block,
                          seconds)

    def _save_failed(self, t: ChunkTransfer) -> None:
        logger.exception("kvconnector: saving chunk %s failed", self.store.key(t.chunk_hash))
        self.ledger.bad_chunks([t.chunk_hash])
        self.ledger.count(save_errors=1)

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
