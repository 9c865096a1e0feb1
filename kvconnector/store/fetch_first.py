"""Fetches before puts on one tier: a fetch holds up a request's first token, a put holds
up nothing.

Measured on the CPU build (docs/benchmarks.md, section 12): a 45 MiB Redis fetch that
started while one 5.6 MiB put was on the wire took 141 ms, against 37-42 ms alone; the
put took 146 ms. One redis-server serves both connections in turns, so the two transfers
share its bandwidth and each waits on the other's. So a put does not start while a
fetch runs, and a fetch lets the put already on the wire finish first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: How long a fetch waits for the put on the wire: a chunk's put takes milliseconds alone.
FETCH_WAIT_S = 0.25
#: How long a put waits for fetches to stop: under back-to-back fetches it then goes
#: anyway rather than fill the queue (a full queue drops puts: later misses).
PUT_WAIT_S = 1.0


class FetchFirst:
    def __init__(self, fetch_wait_s: float = FETCH_WAIT_S,
                 put_wait_s: float = PUT_WAIT_S) -> None:
        self._cv = threading.Condition()
        self._fetching = 0
        self._putting = 0
        self._fetch_wait_s = fetch_wait_s
        self._put_wait_s = put_wait_s
        self.fetch_waited_s = 0.0  # total time fetches waited for a put (phase timers)
        self.puts_delayed = 0

    @contextmanager
    def fetch(self) -> Iterator[None]:
        start = time.perf_counter()
        with self._cv:
            self._fetching += 1
            if self._putting:
                self._cv.wait_for(lambda: not self._putting, self._fetch_wait_s)
        self.fetch_waited_s += time.perf_counter() - start
        try:
            yield
        finally:
            with self._cv:
                self._fetching -= 1
                self._cv.notify_all()

    @contextmanager
    def put(self) -> Iterator[None]:
        with self._cv:
            if self._fetching:
                self.puts_delayed += 1
                self._cv.wait_for(lambda: not self._fetching, self._put_wait_s)
            self._putting += 1
        try:
            yield
        finally:
            with self._cv:
                self._putting -= 1
                self._cv.notify_all()
