"""Chunk files of the disk tier: where a chunk's file lives, and how it is written and read.

A chunk is one file, ``<disk_path>/<fingerprint>/r<rank>/<hh>/<hash>.kvc`` (``hh``: the
chain hash's first two hex digits, 256 subdirectories per rank); what the fingerprint
stands for is in ``<disk_path>/<fingerprint>/descriptor.kvd``. Every part of the name
comes from the chunk key (keys.py: no per-process seed), so another process, another engine
or the same engine after a restart finds the file again.

A file is a Redis value (store/codec.py: magic, header length, msgpack header with the
checksum and optional MAC) padded with zeros to ``HEAD_BYTES``, then the payload:

    codec prefix + header | zeros up to 4096 | payload (the slot's bytes)

The payload starts on a 4 KiB boundary so that it can be read straight into a slot (whose
memory starts on a page, store/memory.py), and written from one, with O_DIRECT: by
default, because the memory tier is the cache (the page cache would hold a second copy), a
direct read's speed does not depend on what else the page cache holds (docs/benchmarks.md
section 11: 0.92x a plain O_DIRECT read), and a direct write leaves no copy and no
write-back to run beside the forward pass (section 13). Where the file system, the buffer
or the length does not allow it, the read or write is buffered.

A file is written under a temporary name in its final directory (store/disk_space.py
reserves it) and renamed into place only when complete: a file under a final name is never
half written, even when a writer is killed. Bytes can still go bad
on the device or be swapped by hand: a reader checks the header against the key it
expects, the file's size, then the checksum (or MAC) of the payload in the slot, and a
file that fails any check is a miss.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from kvconnector.keys import ChunkKey
from kvconnector.store import codec
from kvconnector.store.codec import CorruptValue, ExpectedChunk

logger = logging.getLogger("kvconnector.store.disk")

HEAD_BYTES = 4096
SUFFIX = ".kvc"
DESCRIPTOR_NAME = "descriptor.kvd"
TEMP_MARK = ".tmp-"
#: Errors that mean "no room" rather than a broken file: writes pause and retry later.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def chunk_path(root: Path, key: ChunkKey) -> Path:
    h = key.chunk_hash.hex()
    return root / key.fingerprint.hex() / f"r{key.tp_rank}" / h[:2] / f"{h}{SUFFIX}"


def descriptor_path(root: Path, fingerprint_hex: str) -> Path:
    """What a fingerprint stands for (store/descriptor.py), next to its chunk files."""
    return root / fingerprint_hex / DESCRIPTOR_NAME


def file_size(nbytes: int) -> int:
    return HEAD_BYTES + nbytes


def is_temp(name: str) -> bool:
    return TEMP_MARK in name


@dataclass(frozen=True)
class ReadResult:
    """A read's outcome: ``ok``, or why not (``missing``, a codec reason, or ``io``)."""

    ok: bool
    reason: str = ""
    inode: int = 0  # of the file read: a corrupt file is deleted only if still that file


class DiskFiles:
    """Reads and writes chunk files under ``root``; holds no state but the root."""

    def __init__(self, root: str | Path, mac_key: bytes | None = None,
                 direct_io: bool = True) -> None:
        self.root = Path(root)
        self.mac_key = mac_key
        self.direct_io = direct_io
        self._local = threading.local()  # per thread: an aligned buffer for heads

    def path(self, key: ChunkKey) -> Path:
        return chunk_path(self.root, key)

    def exists(self, key: ChunkKey) -> bool:
        try:
            os.stat(self.path(key))
        except OSError:
            return False
        return True

    # ---- writing ----
    def head(self, expected: ExpectedChunk, payload: memoryview, xxh3: int | None) -> bytes:
        prefix = codec.encode_header(expected, payload, xxh3=xxh3, mac_key=self.mac_key)
        if len(prefix) > HEAD_BYTES:
            raise ValueError(f"chunk header of {len(prefix)} bytes exceeds {HEAD_BYTES}")
        return prefix.ljust(HEAD_BYTES, b"\0")

    def write(self, fd: int, head: bytes, payload: memoryview) -> None:
        """Write a file's bytes into ``fd`` (a temporary file ``DiskSpace.reserve`` made):
        with ``direct_io`` past the page cache, where the file system and the payload's
        alignment allow it. Copying into the page cache and writing it back ran on the
        forward pass's cores: a 30-layer model's misses took 4-12% longer that way on a
        2-core machine (docs/benchmarks.md section 13)."""
        if self.direct_io:
            buf = self._head_buffer()
            buf[:] = head
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
                _write_all(fd, [memoryview(buf), payload])
                return
            except OSError as e:
                if e.errno != errno.EINVAL:  # not a refusal of O_DIRECT: a real failure
                    raise
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
                os.lseek(fd, 0, os.SEEK_SET)
        _write_all(fd, [memoryview(head), payload])

    # ---- reading ----
    def read_into(self, key: ChunkKey, expected: ExpectedChunk, out: memoryview) -> ReadResult:
        """Read the chunk ``key`` into ``out`` (``expected.nbytes`` bytes) and check it.
        Never raises for what a file holds; an I/O error is ``reason="io"``."""
        try:
            fd = self._open(self.path(key))
        except FileNotFoundError:
            return ReadResult(False, "missing")
        except OSError as e:
            logger.debug("kvconnector disk: cannot open %s: %s", self.path(key), e)
            return ReadResult(False, "io")
        try:
            st = os.fstat(fd)
            try:
                self._read_checked(fd, st.st_size, expected, out)
            except CorruptValue as e:
                return ReadResult(False, e.reason, st.st_ino)
            return ReadResult(True, inode=st.st_ino)
        except OSError as e:
            logger.debug("kvconnector disk: reading %s failed: %s", self.path(key), e)
            return ReadResult(False, "io")
        finally:
            os.close(fd)

    def _open(self, path: Path) -> int:
        if self.direct_io:
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:  # a file system without O_DIRECT: buffered
                    raise
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        # Chunks are read whole, once: a larger readahead window than the default.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def _head_buffer(self) -> mmap.mmap:
        buf = getattr(self._local, "head", None)
        if buf is None:
            buf = self._local.head = mmap.mmap(-1, HEAD_BYTES)  # page aligned
        return buf

    def _read_checked(self, fd: int, size: int, expected: ExpectedChunk,
                      out: memoryview) -> None:
        if size < HEAD_BYTES:
            raise CorruptValue("too_short", f"{size} bytes")
        head = self._head_buffer()
        if os.preadv(fd, [head], 0) != HEAD_BYTES:
            raise CorruptValue("truncated", "the head block")
        view = memoryview(head)
        try:
            header_len = codec.check_prefix(view[:codec.PREFIX_LEN],
                                            codec.PREFIX_LEN + HEAD_BYTES)
            if codec.PREFIX_LEN + header_len > HEAD_BYTES:
                raise CorruptValue("header_too_long", f"{header_len} bytes")
            header = codec.check_header(
                view[codec.PREFIX_LEN:codec.PREFIX_LEN + header_len], expected)
        finally:
            view.release()
        codec.check_payload_len(header, size - HEAD_BYTES)
        if out.nbytes != expected.nbytes:
            raise ValueError(f"buffer of {out.nbytes} bytes for a chunk of {expected.nbytes}")
        _read_all(fd, out, HEAD_BYTES)
        codec.check_payload(header, out, self.mac_key)

    # ---- removing ----
    def remove_if_same(self, key: ChunkKey, inode: int) -> int:
        """Delete ``key``'s file if it is still the file (inode) read; its size, or 0."""
        path = self.path(key)
        try:
            st = os.stat(path)
            if st.st_ino != inode:
                return 0  # replaced since: not the bad file
            os.unlink(path)
        except OSError:
            return 0
        return st.st_size


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    bufs = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
    while bufs:
        n = os.writev(fd, bufs)
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]


def _read_all(fd: int, out: memoryview, offset: int) -> None:
    """Fill ``out`` from ``offset``; a file that ends early is ``truncated``. O_DIRECT needs
    aligned memory and lengths: a read it refuses is done again without it."""
    done = 0
    total = out.nbytes
    while done < total:
        try:
            n = os.preadv(fd, [out[done:]], offset + done)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            n = _read_buffered(fd, out[done:], offset + done)
        if n == 0:
            raise CorruptValue("truncated", f"payload ends after {done} of {total} bytes")
        done += n


def _read_buffered(fd: int, out: memoryview, offset: int) -> int:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    return os.preadv(fd, [out], offset)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
