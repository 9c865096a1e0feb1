"""The worker's copy thread: saves and asynchronous loads run here, off the forward pass.

One thread, first in first out, so two jobs touching one slot always run in the order the
scheduler planned them. The worker asks it to wait only where vLLM is about to reuse memory a
job still reads (a preempted request's blocks) or where the main thread reads a slot a job is
still writing.

With a ``saves`` placement (the CPU build) the thread runs on the placement's cores, and a
save is held until the next forward pass begins (placement.py). Whatever must not wait for
it lets it go at once: a job that is not a save queued behind it, a wait for its slots or
requests, a drain. The whole thread moves, not each save: in one run, a save that moved
back to the forward's core when done added about 0.8 ms to each 1024-token tiny-model
memory miss (docs/benchmarks.md section 37).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait

from kvconnector import threads
from kvconnector.placement import AT_ONCE, WritePlacement

logger = logging.getLogger("kvconnector.background")


class CopyThread:
    def __init__(self, saves: WritePlacement = AT_ONCE) -> None:
        self._executor = threads.pool("kvconnector-copy", saves.cores)
        self._saves = saves
        self._held = 0  # saves queued that have not started
        self._lock = threading.Lock()
        self._by_slot: dict[int, Future[None]] = {}  # the last job touching each slot
        self._by_request: dict[str, set[Future[None]]] = {}
        self.busy_seconds = 0.0  # time the thread spent running jobs (phase timers)

    def submit(self, job: Callable[[], None], req_ids: Iterable[str],
               slots: Iterable[int], save: bool = False) -> None:
        """Run ``job`` after every job submitted before it; a ``save`` as the ``saves``
        placement says. It must not raise: a failed copy is a cache miss, which the job
        itself reports."""
        if save and self._saves.gate is not None:
            with self._lock:
                self._held += 1
            job = self._placed(job, time.monotonic() + self._saves.hold_s)
        else:
            self.release()
        future = self._executor.submit(self._timed, job)
        req_ids, slots = set(req_ids), [s for s in slots if s >= 0]
        with self._lock:
            for s in slots:
                self._by_slot[s] = future
            for r in req_ids:
                self._by_request.setdefault(r, set()).add(future)
        future.add_done_callback(lambda f: self._forget(f, req_ids, slots))

    def release(self) -> None:
        """Held saves go now: the gate, if one waits for it, opens (until its owner closes
        it). It lets the tiers' held puts go too, as a forward pass would."""
        if self._held and self._saves.gate is not None:
            self._saves.gate.set()

    def _placed(self, job: Callable[[], None], deadline: float) -> Callable[[], None]:
        def run() -> None:
            assert self._saves.gate is not None
            try:
                self._saves.gate.wait(max(0.0, deadline - time.monotonic()))
            finally:
                with self._lock:
                    self._held -= 1
            job()
        return run

    def _timed(self, job: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            job()
        finally:
            self.busy_seconds += time.perf_counter() - start  # this thread only writes it

    def _forget(self, future: Future[None], req_ids: set[str], slots: list[int]) -> None:
        if not future.cancelled() and future.exception() is not None:
            logger.error("kvconnector: a background copy failed", exc_info=future.exception())
        with self._lock:
            for s in slots:
                if self._by_slot.get(s) is future:
                    del self._by_slot[s]
            for r in req_ids:
                pending = self._by_request.get(r)
                if pending is not None:
                    pending.discard(future)
                    if not pending:
                        del self._by_request[r]

    def busy(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._by_request

    def uses(self, slots: Iterable[int]) -> bool:
        """Whether a job not yet done touches any of ``slots``."""
        with self._lock:
            return any(s in self._by_slot for s in slots)

    def wait_for_slots(self, slots: Iterable[int]) -> None:
        self.release()
        with self._lock:
            futures = [f for s in slots if (f := self._by_slot.get(s)) is not None]
        for f in futures:
            f.exception()  # waits; failures were logged by _forget

    def wait_for_requests(self, req_ids: Iterable[str]) -> None:
        self.release()
        with self._lock:
            futures = [f for r in req_ids for f in self._by_request.get(r, ())]
        for f in futures:
            f.exception()

    def drain(self) -> None:
        """Wait for every job submitted so far."""
        self.release()
        self._executor.submit(lambda: None).result()

    @property
    def pending(self) -> int:
        with self._lock:
            return len({f for fs in self._by_request.values() for f in fs}
                       | set(self._by_slot.values()))

    def close(self, timeout_s: float) -> bool:
        """Drop the jobs not started (the engine is stopping: unsaved chunks are misses
        later) and wait at most ``timeout_s`` for the running one. True if it finished."""
        self.release()
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = {f for fs in self._by_request.values() for f in fs} | set(
                self._by_slot.values())
        _, not_done = wait(running, timeout=timeout_s)
        return not not_done
