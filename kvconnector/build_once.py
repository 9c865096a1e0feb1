"""Models built once into a directory by whichever process gets there first: the test
suite's parallel workers, or two examples started together, find the build complete or wait
for it, and never read or write a half-built one."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def is_built(marker: Path, want: dict) -> bool:
    """A build is complete once its marker, written last, holds ``want``."""
    try:
        return json.loads(marker.read_text()) == want
    except (OSError, ValueError):
        return False


@contextmanager
def build_once(marker: Path, want: dict) -> Iterator[bool]:
    """True inside: build into ``marker``'s directory, under an exclusive lock; ``marker``
    is written once the block ends without an error. False: the build is complete (here, or
    by the process that held the lock)."""
    if is_built(marker, want):
        yield False
        return
    directory = marker.parent
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.build-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on errors
        if is_built(marker, want):
            yield False
            return
        marker.unlink(missing_ok=True)
        yield True
        marker.write_text(json.dumps(want))
