"""The scheduler's view of the disk tier: which chunks it holds, asked of the file system.

A lookup is one ``stat`` per file (microseconds on a local disk, its directories cached),
so it runs inline in the scheduler's step and sees every file, whoever wrote it and
whenever: no index to build at start-up or to keep in sync with other engines. A file
found here can still be gone when the worker reads it (evicted by another engine): that
read is a miss and its blocks are recomputed. A file system that answers slowly (over
``budget_s`` for one lookup, a hung network mount) is not asked again for ``PAUSE_S``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from kvconnector.keys import ChunkKey
from kvconnector.store.disk_files import chunk_path

logger = logging.getLogger("kvconnector.store.disk")

PAUSE_S = 10.0


class DiskCatalog:
    def __init__(self, root: str | Path, budget_s: float = 0.05) -> None:
        self.root = Path(root)
        self.budget_s = budget_s
        self.slow_lookups = 0
        self._paused_until = 0.0

    def count_prefix(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        """How many leading chunks have a file for every key (every TP rank's share)."""
        if not chunks or time.monotonic() < self._paused_until:
            return 0
        start = time.monotonic()
        n = 0
        for keys in chunks:
            if not all(self._exists(k) for k in keys):
                break
            n += 1
        self._check_time(start)
        return n

    def holds(self, keys: Sequence[ChunkKey]) -> bool:
        return self.count_prefix([keys]) == 1

    def _exists(self, key: ChunkKey) -> bool:
        try:
            os.stat(chunk_path(self.root, key))
        except OSError:
            return False
        return True

    def _check_time(self, start: float) -> None:
        elapsed = time.monotonic() - start
        if elapsed > self.budget_s:
            self.slow_lookups += 1
            self._paused_until = time.monotonic() + PAUSE_S
            logger.warning("kvconnector disk %s: a lookup took %.0f ms; the disk tier is not "
                           "asked for %.0f s", self.root, elapsed * 1000, PAUSE_S)
