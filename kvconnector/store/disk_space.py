"""The disk tier's capacity: how many bytes the directory holds, shared by every process
that writes it, and which files go first when a new one needs room.

The directory's byte count lives in ``<disk_path>/.kvconnector-usage`` (8 bytes), and every
change to the directory's chunk files (reserve, commit, evict, delete) happens under an
exclusive ``flock`` on it, taken by any kvconnector process writing there. Room is reserved
before a file is written: its temporary file is created at its full size (sparse) under the
lock, so the directory never holds more than ``disk_capacity`` bytes of chunk files, written
or being written. A killed writer leaves its temporary file behind, counted; the next scan
deletes it once it is old.

Least recently used goes first. This process's order is exact (its writes and reads);
files of other processes enter it when this process scans the directory (at start-up, in
the background, oldest modification time first; a read hit sets the file's modification
time, so the order also survives restarts) or reads them. A file another process deleted
is skipped. The count drifts only when files are removed by hand (too high: more is
evicted than needed) until the next scan, which recounts.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvconnector.config_schema import ConfigError, human_size
from kvconnector.store.disk_files import SUFFIX, TEMP_MARK, is_temp

logger = logging.getLogger("kvconnector.store.disk")

USAGE_FILE = ".kvconnector-usage"
STALE_TEMP_S = 600.0  # a temporary file this old belongs to a writer that died
_SCAN_DEPTH = 4  # <fingerprint>/r<rank>/<hh>/<file>
DEFAULT_SHARE = 0.5  # of the free space at start-up, without disk_capacity
DEFAULT_MAX = 1 << 40


def disk_capacity(path: str, asked: int | None) -> int:
    """The capacity of the disk tier at ``path`` (created if missing), checked at start-up
    against what the file system can give: its free space plus the chunk files already
    counted there. Without ``asked``: half of that, at most 1 TiB."""
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"disk_path: cannot create {path}: {e.strerror}") from None
    if not root.is_dir():
        raise ConfigError(f"disk_path: {path} is not a directory")
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError(f"disk_path: {path} is not readable and writable by this process")
    free = shutil.disk_usage(root).free
    held = read_usage(root)
    room = free + held
    if asked is None:
        capacity = min(DEFAULT_MAX, int(room * DEFAULT_SHARE))
        logger.info("kvconnector disk %s: disk_capacity not set; using %s (half of the "
                    "file system's free space)", path, human_size(capacity))
        if capacity <= 0:
            raise ConfigError(f"disk_path: the file system under {path} is full; free some "
                              "space or set disk_capacity")
        return capacity
    if asked > room:
        raise ConfigError(
            f"disk_capacity={human_size(asked)} is more than the file system under {path} "
            f"can give: {human_size(free)} free, plus {human_size(held)} of chunk files "
            f"already there; lower it")
    return asked


def read_usage(root: str | Path) -> int:
    """The byte count the processes writing ``root`` keep (0 if none was kept yet)."""
    try:
        with open(Path(root) / USAGE_FILE, "rb") as f:
            data = f.read(8)
    except OSError:
        return 0
    return int.from_bytes(data, "little") if len(data) == 8 else 0


@dataclass(frozen=True)
class ScanResult:
    files: int
    bytes: int
    stale_temps: int
    seconds: float


class DiskSpace:
    def __init__(self, root: str | Path, capacity: int,
                 on_evict: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        self.capacity = capacity
        self._on_evict = on_evict  # told the path of every file it evicts
        self.root.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.root / USAGE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._mutex = threading.Lock()  # flock is per open file, not per thread
        self._lru: OrderedDict[str, int] = OrderedDict()  # path -> bytes, least recent first
        self.evictions = 0
        self.evicted_bytes = 0

    def close(self) -> None:
        os.close(self._fd)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._mutex:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _usage(self) -> int:
        data = os.pread(self._fd, 8, 0)
        return int.from_bytes(data, "little") if len(data) == 8 else 0

    def _set_usage(self, n: int) -> None:
        os.pwrite(self._fd, max(0, n).to_bytes(8, "little"), 0)

    def usage(self) -> int:
        """Bytes of chunk files in the directory, as the processes writing it count them."""
        with self._locked():
            return self._usage()

    # ---- writing a file ----
    def reserve(self, final: Path, size: int) -> tuple[int, Path] | None:
        """Room for a new file ``final`` of ``size`` bytes: its temporary file, created at
        full size, open for writing (fd, name). None if ``final`` exists (touched) or no
        room can be made. Raises OSError (the disk refused the file)."""
        if size > self.capacity:
            return None
        with self._locked():
            if final.exists():
                self._touch_locked(str(final), size)
                return None
            usage = self._usage()
            usage = self._evict_locked(usage + size - self.capacity, usage)
            if usage + size > self.capacity:
                return None
            final.parent.mkdir(parents=True, exist_ok=True)
            temp = final.parent / f"{final.name}{TEMP_MARK}{os.getpid()}-{threading.get_ident()}"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.ftruncate(fd, size)
            except OSError:
                os.close(fd)
                _unlink(temp)
                raise
            self._set_usage(usage + size)
            return fd, temp

    def commit(self, temp: Path, final: Path, size: int) -> bool:
        """Put a written temporary file in place; False if another process put the same
        chunk there meanwhile (the temporary file is dropped)."""
        with self._locked():
            if final.exists():
                _unlink(temp)
                self._set_usage(self._usage() - size)
                self._touch_locked(str(final), size)
                return False
            os.rename(temp, final)
            self._lru[str(final)] = size
            return True

    def abandon(self, temp: Path, size: int) -> None:
        """A reserved file that was not written: its room is given back."""
        with self._locked():
            _unlink(temp)
            self._set_usage(self._usage() - size)

    # ---- evicting and deleting ----
    def _evict_locked(self, need: int, usage: int) -> int:
        while need > 0 and self._lru:
            path, size = self._lru.popitem(last=False)
            try:
                freed = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue  # gone already: whoever removed it gave its room back
            except OSError as e:
                logger.warning("kvconnector disk: cannot evict %s: %s", path, e)
                continue
            usage -= freed
            need -= freed
            self.evictions += 1
            self.evicted_bytes += freed
            if self._on_evict is not None:
                self._on_evict(path)
        return usage

    def remove(self, path: Path, inode: int | None = None) -> int:
        """Delete a chunk file (a corrupt one, or a purge): its size, 0 if it was gone, or
        was replaced since it was read (``inode``)."""
        with self._locked():
            try:
                st = os.stat(path)
                if inode is not None and st.st_ino != inode:
                    return 0
                os.unlink(path)
            except OSError:
                return 0
            # As counted when written: a damaged file may have another size by now.
            counted = self._lru.pop(str(path), None)
            size = counted if counted is not None else st.st_size
            self._set_usage(self._usage() - size)
            return size

    # ---- recency ----
    def touch(self, path: Path, size: int) -> None:
        """A read hit: most recently used here, and by modification time for later scans."""
        with self._mutex:
            self._touch_locked(str(path), size)
        try:
            os.utime(path)
        except OSError:
            pass

    def _touch_locked(self, path: str, size: int) -> None:
        self._lru[path] = size
        self._lru.move_to_end(path)

    def __len__(self) -> int:
        return len(self._lru)

    # ---- scanning ----
    def scan(self) -> ScanResult:
        """Index every chunk file under the directory (oldest first), delete temporary files
        of dead writers, and set the byte count to what is there."""
        start = time.perf_counter()
        now = time.time()
        found: list[tuple[float, str, int]] = []
        temps = stale = 0
        with self._locked():
            for entry in _walk(str(self.root), _SCAN_DEPTH):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if is_temp(entry.name):
                    if now - st.st_mtime > STALE_TEMP_S:
                        _unlink(Path(entry.path))
                        stale += 1
                    else:
                        temps += st.st_size  # being written by a live process: counted
                elif entry.name.endswith(SUFFIX):
                    found.append((st.st_mtime, entry.path, st.st_size))
            found.sort()
            mine = dict(self._lru)
            self._lru = OrderedDict((p, n) for _, p, n in found)
            for p, n in mine.items():  # what this process used meanwhile stays most recent
                if p in self._lru:
                    self._lru[p] = n
                    self._lru.move_to_end(p)
            total = sum(n for _, _, n in found)
            self._set_usage(total + temps)
        return ScanResult(len(found), total, stale, time.perf_counter() - start)


def _walk(top: str, depth: int) -> Iterator[os.DirEntry[str]]:
    """Files under ``top`` down to ``depth`` levels, not following links."""
    try:
        entries = list(os.scandir(top))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                if depth > 1:
                    yield from _walk(entry.path, depth - 1)
            elif entry.is_file(follow_symlinks=False) and entry.name != USAGE_FILE:
                yield entry
        except OSError:
            continue


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
