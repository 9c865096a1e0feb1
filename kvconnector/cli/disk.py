"""``kvconnector stats | verify | purge`` on a disk tier's directory (``disk_path``).

The directory holds ``<fingerprint>/r<rank>/<hh>/<hash>.kvc`` chunk files and one
``<fingerprint>/descriptor.kvd`` per fingerprint (store/disk_files.py). Every deletion goes
through the directory's shared byte count (store/disk_space.py), so engines running on it
keep their capacity bound right. Ages are times since a file was last written or read (a
read sets its modification time).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

from kvconnector.cli.inventory import CliError, Inventory, Progress
from kvconnector.cli.verify import Problem, Report
from kvconnector.keys import HASH_BYTES, Fingerprint
from kvconnector.store import codec, descriptor
from kvconnector.store.codec import CorruptValue, ExpectedChunk
from kvconnector.store.disk_files import HEAD_BYTES, SUFFIX, descriptor_path
from kvconnector.store.disk_space import DiskSpace

_HEX = rf"[0-9a-f]{{{2 * HASH_BYTES}}}"
_FINGERPRINT = re.compile(rf"^{_HEX}$")
_RANK = re.compile(r"^r(\d+)$")


def is_directory_target(target: str) -> bool:
    """A path (or file:// URL) rather than a Redis URL."""
    return target.startswith("file://") or "://" not in target


def open_root(target: str) -> Path:
    root = Path(target.removeprefix("file://"))
    if not root.is_dir():
        raise CliError(f"{root}: no such directory (give the engines' disk_path)")
    return root


def chunk_files(root: Path) -> Iterator[tuple[str, int, Path]]:
    """(fingerprint hex, rank, path) of every chunk file under ``root``."""
    for fp_dir in sorted(_dirs(root)):
        if not _FINGERPRINT.match(fp_dir.name):
            continue
        for rank_dir in sorted(_dirs(fp_dir)):
            m = _RANK.match(rank_dir.name)
            if m is None:
                continue
            for sub in sorted(_dirs(rank_dir)):
                for entry in os.scandir(sub):
                    if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                        yield fp_dir.name, int(m[1]), Path(entry.path)


def _dirs(path: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _descriptor(root: Path, fp: str, mac_key: bytes | None = None
                ) -> tuple[descriptor.Descriptor | None, str | None]:
    path = descriptor_path(root, fp)
    try:
        value = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path}: {e.strerror}"
    try:
        desc = descriptor.decode(value, mac_key=mac_key)
    except ValueError as e:
        return None, str(e)
    if not desc.matches(fp):
        return None, "its fields do not hash to its fingerprint"
    return desc, None


def disk_inventory(root: Path, progress: bool | None = None) -> Inventory:
    inv = Inventory()
    now = time.time()
    bar = Progress(progress, None, "stats", "file")
    try:
        for fp, rank, path in chunk_files(root):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            inv.group(fp).add_chunk(rank, st.st_size, int(max(0.0, now - st.st_mtime)), None)
            bar.update(1)
    finally:
        bar.close()
    for fp, group in inv.groups.items():
        group.descriptor, group.descriptor_error = _descriptor(root, fp)
        group.has_descriptor_key = descriptor_path(root, fp).exists()
    return inv


def check_file(path: Path, chunk_key: str, desc: descriptor.Descriptor | None,
               mac_key: bytes | None) -> CorruptValue | None:
    """What is wrong with a chunk file, as ``verify.check_value`` says of a Redis value."""
    try:
        data = path.read_bytes()
    except OSError as e:
        return CorruptValue("io", e.strerror or str(e))
    mv = memoryview(data)
    try:
        if len(data) < HEAD_BYTES:
            raise CorruptValue("too_short", f"{len(data)} bytes")
        header_len = codec.check_prefix(mv[:codec.PREFIX_LEN], HEAD_BYTES)
        if codec.PREFIX_LEN + header_len > HEAD_BYTES:
            raise CorruptValue("header_too_long", f"{header_len} bytes")
        header = mv[codec.PREFIX_LEN:codec.PREFIX_LEN + header_len]
        if desc is not None and mac_key is None:
            expected = desc.expected(chunk_key, codec.unpack_header(header))
        else:
            f = codec.unpack_header(header)
            expected = ExpectedChunk(chunk_key, f["layout"], f["dtype"], tuple(f["shape"]),
                                     f["nbytes"])
        checked = codec.check_header(header, expected)
        codec.check_payload(checked, mv[HEAD_BYTES:], mac_key)
    except CorruptValue as c:
        return c
    return None


def verify_disk(root: Path, *, mac_key: bytes | None = None, delete: bool = False,
                progress: bool | None = None) -> Report:
    report = Report()
    space = DiskSpace(root, 1 << 62) if delete else None
    known = {f.name for f in fields(Fingerprint)}
    descs: dict[str, descriptor.Descriptor | None] = {}
    bar = Progress(progress, None, "verify", "file")
    try:
        for fp, rank, path in chunk_files(root):
            if fp not in descs:
                desc, error = _descriptor(root, fp, mac_key)
                if error is not None:
                    report.problems.append(Problem(str(descriptor_path(root, fp)),
                                                   "descriptor", error))
                    if delete:
                        descriptor_path(root, fp).unlink(missing_ok=True)
                elif desc is not None and set(desc.fingerprint) != known:
                    report.warnings.append(f"{descriptor_path(root, fp)}: written by another "
                                           "kvconnector version; its chunks are checked "
                                           "against their own headers")
                    desc = None
                descs[fp] = desc
            problem = check_file(path, f"{fp}:{rank}:{path.stem}", descs[fp], mac_key)
            report.checked += 1
            report.checked_bytes += path.stat().st_size if path.exists() else 0
            bar.update(1)
            if problem is not None:
                report.problems.append(Problem(str(path), problem.reason, problem.detail))
                if space is not None:
                    report.deleted += int(space.remove(path) > 0)
    finally:
        bar.close()
        if space is not None:
            space.close()
    return report


def purge_disk(root: Path, fingerprints: set[str], progress: bool | None = None) -> int:
    """Delete every chunk file and the descriptor of ``fingerprints``; files deleted."""
    space = DiskSpace(root, 1 << 62)
    deleted = 0
    bar = Progress(progress, None, "purge", "file")
    try:
        for fp, _, path in chunk_files(root):
            if fp in fingerprints:
                deleted += int(space.remove(path) > 0)
                bar.update(1)
        for fp in fingerprints:
            path = descriptor_path(root, fp)
            if path.exists():
                path.unlink()
                deleted += 1
            for sub in sorted((root / fp).rglob("*"), reverse=True):
                if sub.is_dir():
                    _rmdir(sub)
            _rmdir(root / fp)
    finally:
        bar.close()
        space.close()
    return deleted


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()  # only if empty: an engine may be writing there again
    except OSError:
        pass

