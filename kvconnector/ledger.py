"""What the worker half owes vLLM at its next report: counters, the blocks whose loads
failed, chunks found unusable, and parked requests whose loads are done.

The main thread and the copy thread both write here, so every field sits behind one lock.
Blend (``blend/worker.py``) writes through the same methods as the half.

It also counts the fetches of parked requests still in flight, so that a step with nothing
to compute can wait for one (``wait_for_fetch``) instead of spinning: vLLM steps an idle
engine back to back, and that loop holds the GIL the copy thread needs after every read
from a socket or a file (Python hands it over only every 5 ms).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from kvconnector.metadata import ChunkTransfer, WorkerReport
from kvconnector.stats import TransferStats


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TransferStats()  # since the last report to vLLM
        self.totals = TransferStats()  # since start-up
        self._load_errors: set[int] = set()
        self._report = WorkerReport()  # since the last step's report
        self._received: set[str] = set()  # parked requests whose loads are done
        self._fetches = 0  # parked requests' fetches submitted and not yet over
        self._fetch_over = threading.Condition(self._lock)

    def count(self, **counts: float) -> None:
        with self._lock:
            self._stats.add(**counts)
            self.totals.add(**counts)

    def loaded(self, transfers: Sequence[ChunkTransfer], block_size: int, chunk_bytes: int,
               seconds: float, copy_seconds: float | None = None) -> None:
        """Chunks copied into vLLM's blocks, as one batch of ``seconds``; ``copy_seconds``:
        the copy's phase timer (``phase_seconds.load_copy``), counted with them."""
        if not transfers:
            return
        n_blocks = sum(b >= 0 for t in transfers for b in t.block_ids)
        counts = {"loaded_chunks": len(transfers), "loaded_tokens": n_blocks * block_size,
                  "loaded_bytes": chunk_bytes * n_blocks // len(transfers[0].block_ids),
                  "load_seconds": seconds}
        if copy_seconds is not None:
            counts["phase_seconds.load_copy"] = copy_seconds
        self.count(**counts)
        self.observe(load_batch_seconds=seconds)

    def saved(self, chunks: int, tokens: int, nbytes: int, seconds: float) -> None:
        """``chunks`` saved together in ``seconds``: one sample per chunk, each of the
        whole ``seconds`` (what each of them waited)."""
        counts = {"saved_chunks": chunks, "saved_tokens": tokens, "saved_bytes": nbytes,
                  "save_seconds": seconds}
        with self._lock:
            self._stats.add(**counts)
            self.totals.add(**counts)
            self._stats.observe_many("chunk_save_seconds", [seconds] * chunks)

    def observe(self, **seconds: float) -> None:
        with self._lock:
            self._stats.observe(**seconds)

    def gauges(self, **values: float) -> None:
        with self._lock:
            self._stats.set_gauges(**values)

    def load_failed(self, req_id: str, index: int, block_ids: Iterable[int],
                    bad_chunks: Iterable[bytes] = ()) -> None:
        """vLLM recomputes ``block_ids``; the scheduler never plans chunk ``index`` or later
        of ``req_id`` again, and forgets ``bad_chunks``."""
        with self._lock:
            self._load_errors.update(block_ids)
            self._report.bad_chunks.update(bad_chunks)
            self._report.note_failed_load(req_id, index)

    def chunk_load_failed(self, t: ChunkTransfer, reason: str) -> None:
        """``t``'s blocks are recomputed and its chunk forgotten; counted under ``reason``."""
        self.load_failed(t.req_id, t.index, [b for b in t.block_ids if b >= 0], [t.chunk_hash])
        self.count(load_errors=1, **{f"load_errors.{reason}": 1})

    def bad_chunks(self, chunk_hashes: Iterable[bytes]) -> None:
        """Chunks the scheduler must forget (unreadable, or their save failed)."""
        with self._lock:
            self._report.bad_chunks.update(chunk_hashes)

    def disk_removed(self, chunk_hashes: Iterable[bytes]) -> None:
        """Chunks the disk tier evicted or did not write (for KV events)."""
        with self._lock:
            self._report.disk_removed.update(chunk_hashes)

    def received(self, req_id: str) -> None:
        """A parked request's loads are done, failed or not: vLLM may run it."""
        with self._lock:
            self._received.add(req_id)

    def start_fetch(self, submit: Callable[[], object]) -> None:
        """Count a parked request's fetch, which ``submit`` queues; its job must call
        ``fetch_over`` when it ends."""
        with self._lock:
            self._fetches += 1
        try:
            submit()
        except BaseException:
            self.fetch_over()
            raise

    def fetch_over(self) -> None:
        """A parked request's fetch ended (arrived or failed)."""
        with self._lock:
            self._fetches = max(0, self._fetches - 1)
            self._fetch_over.notify_all()

    def wait_for_fetch(self, timeout: float) -> None:
        """Until a fetch in flight ends, at most ``timeout`` seconds; at once if none is."""
        with self._lock:
            if self._fetches:
                start = self._fetches
                self._fetch_over.wait_for(lambda: self._fetches < start, timeout)

    def take_received(self) -> set[str]:
        with self._lock:
            received, self._received = self._received, set()
        return received

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        with self._lock:
            if not self._report:
                return None
            report, self._report = self._report, WorkerReport()
        return report

    def take_stats(self) -> TransferStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, TransferStats()
        return stats

    def outstanding(self) -> dict[str, int]:
        return {"load_errors": len(self._load_errors),
                "bad_chunks": len(self._report.bad_chunks),
                "failed_loads": len(self._report.failed_loads),
                "received": len(self._received), "fetches": self._fetches}
