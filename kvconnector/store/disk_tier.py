"""The disk tier, seen from a worker: chunk files read straight into pool slots, and sealed
slots written to files by background threads (never by the forward pass).

Files and their checks are ``disk_files.py``; the directory's capacity and eviction
``disk_space.py``. A file that fails a check is a miss and is deleted. A full file system
(no space, a quota, a file size limit, a read-only mount) pauses writes with one warning
and retries after a backoff that doubles up to ``MAX_PAUSE_S``; reads go on meanwhile.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvconnector import threads
from kvconnector.keys import ChunkKey, Fingerprint
from kvconnector.placement import AT_ONCE, WritePlacement
from kvconnector.store import descriptor
from kvconnector.store.codec import REASONS, ExpectedChunk, checksum
from kvconnector.store.disk_files import FULL_ERRNOS, DiskFiles, descriptor_path, file_size
from kvconnector.store.disk_space import DiskSpace
from kvconnector.store.memory import SlotPool
from kvconnector.store.tiering import FLUSH_TIMEOUT_S, Chunk, PutQueue, SlotBytes

logger = logging.getLogger("kvconnector.store.disk")

FIRST_PAUSE_S = 1.0
READ_THREADS = 4  # files read at once by a fetch of several chunks
MAX_PAUSE_S = 60.0


@dataclass
class DiskCounters:
    """Running totals since start-up (``metrics.DiskTap`` turns them into increments)."""

    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    puts: int = 0
    put_bytes: int = 0
    put_exists: int = 0  # the file was there already (another engine wrote it)
    put_no_room: int = 0  # nothing could be evicted to make room
    io_errors: int = 0
    full: int = 0  # writes refused for want of space
    corrupt: dict[str, int] = field(default_factory=dict)


class DiskTier:
    name = "disk"

    def __init__(self, root: str | Path, capacity: int, pool: SlotPool, layout_name: str, *,
                 mac_key: bytes | None = None, direct_io: bool = True,
                 write_threads: int = 1, fingerprint: Fingerprint | None = None,
                 blocks_per_chunk: int = 1, track_gone: bool = False,
                 placement: WritePlacement = AT_ONCE) -> None:
        self.files = DiskFiles(root, mac_key=mac_key, direct_io=direct_io)
        self.space = DiskSpace(root, capacity, self._evicted if track_gone else None)
        # With track_gone (KV events): chunks of this engine that left the disk or never
        # reached it, until ``take_gone``.
        self._track_gone = track_gone
        self._gone: set[bytes] = set()
        self._own_dir = fingerprint.digest().hex() if fingerprint is not None else None
        self.pool = pool
        self.bytes = SlotBytes(pool, layout_name, blocks_per_chunk)
        self.counters = DiskCounters()
        self._lock = threading.Lock()
        self._paused_until = 0.0
        self._pause_s = FIRST_PAUSE_S
        self.scan_result = None
        self._fingerprint = fingerprint
        self._readers: ThreadPoolExecutor | None = None  # started by the first fetch of several
        self._puts = PutQueue("disk", self._put_each, threads=write_threads, first=self._scan,
                              placement=placement)

    def expected(self, key: ChunkKey, blocks: int = 0) -> ExpectedChunk:
        return self.bytes.expected(key, blocks)

    def _evicted(self, path: str) -> None:
        p = Path(path)
        if p.parent.parent.parent.name == self._own_dir:
            try:
                self._gone.add(bytes.fromhex(p.stem))
            except ValueError:
                pass

    def _not_written(self, key: ChunkKey) -> None:
        if self._track_gone:
            with self._lock:
                self._gone.add(key.chunk_hash)

    def take_gone(self) -> set[bytes]:
        with self._lock:
            gone, self._gone = self._gone, set()
        return gone

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.counters, k, getattr(self.counters, k) + v)

    def _scan(self) -> None:
        if self._fingerprint is not None:
            self._write_descriptor(self._fingerprint)
        self.scan_result = self.space.scan()
        r = self.scan_result
        logger.info("kvconnector disk %s: %d chunk files, %.1f GiB of %.1f GiB (scanned in "
                    "%.2f s; %d stale temporary files deleted)", self.files.root, r.files,
                    r.bytes / 2**30, self.space.capacity / 2**30, r.seconds, r.stale_temps)

    def _write_descriptor(self, fp: Fingerprint) -> None:
        """What this engine's fingerprint stands for, for ``kvconnector stats`` (as in
        Redis, store/descriptor.py), next to its chunk files."""
        digest = fp.digest()
        path = descriptor_path(self.files.root, digest.hex())
        value = descriptor.encode(fp, self.expected(ChunkKey(digest, 0, bytes(16))),
                                  mac_key=self.files.mac_key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = path.with_name(f"{path.name}.new-{os.getpid()}-{threading.get_ident()}")
            temp.write_bytes(value)
            os.replace(temp, path)
        except OSError as e:
            logger.warning("kvconnector disk: cannot write %s: %s", path, e)

    # ---- reads (the copy thread, or the forward's before its step) ----
    def fetch(self, wanted: Sequence[tuple[int, ChunkKey, int]]) -> list[bool]:
        """Several files at once: one read at a time waits on the device for each (a
        4096-token tiny-model hit, 16 files, read 0.6 ms a file one by one)."""
        if len(wanted) < 2:
            return [self._fetch_one(*w) for w in wanted]
        with self._lock:
            if self._readers is None:
                self._readers = threads.pool("kvconnector-disk-read", workers=READ_THREADS)
        return list(self._readers.map(lambda w: self._fetch_one(*w), wanted))

    def _fetch_one(self, slot: int, key: ChunkKey, blocks: int) -> bool:
        expected = self.expected(key, blocks)
        self.pool.begin_write(slot)
        view, packed = self.bytes.to_receive(slot, blocks)
        res = self.files.read_into(key, expected, view)
        if res.ok:
            self.bytes.received(slot, blocks, packed)
            self.pool.end_write(slot, key, for_redis=False)  # on disk already
            self.space.touch(self.files.path(key), file_size(expected.nbytes))
            self._count(hits=1, get_bytes=expected.nbytes)
        elif res.reason in REASONS:
            removed = self.space.remove(self.files.path(key), res.inode)
            logger.warning("kvconnector disk: chunk file %s is corrupt (%s)%s; its "
                           "blocks will be recomputed", self.files.path(key), res.reason,
                           ", deleted" if removed else "")
            with self._lock:
                c = self.counters.corrupt
                c[res.reason] = c.get(res.reason, 0) + 1
                self.counters.misses += 1
        else:
            self._count(misses=1, io_errors=int(res.reason == "io"))
        return res.ok

    # ---- writes (background threads) ----
    def offload(self, slot: int, key: ChunkKey, blocks: int = 0) -> None:
        self._puts.offload(slot, key, blocks)

    @property
    def dropped_puts(self) -> int:
        return self._puts.dropped

    def _put_each(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:  # one a time from the queue: its threads write in parallel
            self._put(*chunk)

    def _put(self, slot: int, key: ChunkKey, blocks: int) -> None:
        if time.monotonic() < self._paused_until:
            self._puts.dropped += 1
            self._not_written(key)
            return
        header = self.pool.lease(slot, key)
        if header is None:  # the slot was reused before its turn came (a held write)
            if not self.files.path(key).exists():
                self._not_written(key)
            return
        try:
            payload, xxh3 = self.bytes.to_send(slot, blocks, header.checksum)
            self._write(key, payload, xxh3, blocks)
        finally:
            self.pool.end_lease(slot)

    def _write(self, key: ChunkKey, payload: memoryview, xxh3: int | None,
               blocks: int = 0) -> None:
        expected = self.expected(key, blocks)
        final = self.files.path(key)
        size = file_size(expected.nbytes)
        try:
            head = self.files.head(expected, payload,
                                   xxh3 if xxh3 is not None else checksum(payload))
            reserved = self.space.reserve(final, size)
        except OSError as e:
            self._write_failed(final, e)
            self._not_written(key)
            return
        if reserved is None:
            exists = final.exists()
            self._count(put_exists=int(exists), put_no_room=int(not exists))
            if not exists:
                self._not_written(key)
            return
        fd, temp = reserved
        try:
            try:
                self.files.write(fd, head, payload)
            finally:
                os.close(fd)
        except OSError as e:
            self.space.abandon(temp, size)
            self._write_failed(final, e)
            self._not_written(key)
            return
        if self.space.commit(temp, final, size):
            self._count(puts=1, put_bytes=expected.nbytes)
        else:
            self._count(put_exists=1)
        if self._pause_s != FIRST_PAUSE_S:
            logger.info("kvconnector disk %s: writes resumed", self.files.root)
            self._pause_s = FIRST_PAUSE_S

    def _write_failed(self, final: Path, e: OSError) -> None:
        if e.errno in FULL_ERRNOS:
            if self._pause_s == FIRST_PAUSE_S:
                logger.warning("kvconnector disk %s: cannot write chunk files (%s); writes "
                               "pause and are retried, reads go on", self.files.root,
                               e.strerror)
            self._paused_until = time.monotonic() + self._pause_s
            self._pause_s = min(MAX_PAUSE_S, self._pause_s * 2)
            self._count(full=1)
        else:
            logger.warning("kvconnector disk: writing %s failed: %s", final, e)
            self._count(io_errors=1)

    def snapshot(self) -> dict:
        with self._lock:
            c = self.counters
            return {**{k: v for k, v in vars(c).items() if k != "corrupt"},
                    "corrupt": dict(c.corrupt), "evictions": self.space.evictions,
                    "dropped_puts": self._puts.dropped, "queued": self._puts.queued,
                    "files": len(self.space)}

    @property
    def queued(self) -> int:
        return self._puts.queued

    @property
    def busy_seconds(self) -> float:
        return self._puts.busy_seconds

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        return self._puts.flush(timeout_s)

    def close(self, timeout_s: float) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)
        if self._puts.close(timeout_s):
            self.space.close()  # else a writer still holds it: the process's exit closes it
