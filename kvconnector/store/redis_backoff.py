"""The backoff a Redis server (or a cluster's node) is put in after a fault.

While it lasts, every call to that server is a miss without touching the network: for
``initial_s``, doubling up to ``max_s``, with jitter (+-20%); then one call tries again (a
probe) and its success ends the backoff. ``RedisStore``'s defaults: 0.5 s, up to 30 s.
"""

from __future__ import annotations

import random
import threading
import time


class Backoff:
    """Exponential backoff with jitter, shared by all threads of a store.

    ``allow`` answers "ok" (healthy), "probe" (backoff over: this call, alone, tries again)
    or "skip" (in backoff, or another call is probing).
    """

    def __init__(self, initial_s: float, max_s: float, rng: random.Random) -> None:
        self.initial_s, self.max_s, self._rng = initial_s, max_s, rng
        self._lock = threading.Lock()
        self.delay_s = 0.0
        self.until = 0.0  # 0.0: not in backoff
        self._probing = False

    @property
    def active(self) -> bool:
        return self.until != 0.0

    def allow(self) -> str:
        if self.until == 0.0:
            return "ok"
        with self._lock:
            if self.until == 0.0:
                return "ok"
            if self._probing or time.monotonic() < self.until:
                return "skip"
            self._probing = True
            return "probe"

    def failure(self, probe: bool) -> float | None:
        """Enter (or extend) backoff; returns the delay, or None if already backing off."""
        with self._lock:
            now = time.monotonic()
            if not probe and self.until != 0.0:
                return None  # another call already put the store in backoff
            self.delay_s = self.initial_s if self.delay_s == 0.0 else min(
                self.max_s, self.delay_s * 2)
            delay = self.delay_s * self._rng.uniform(0.8, 1.2)
            self.until = now + delay
            self._probing = False
            return delay

    def success(self) -> None:
        with self._lock:
            self.delay_s = 0.0
            self.until = 0.0
            self._probing = False
