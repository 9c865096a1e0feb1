"""The disk tier against the disk itself, in one run on the same files:

    python benchmarks/bench_disk.py [--dir DIR] [--chunk-mib 32] [--chunks 32] [--rounds 3]
                                    [--scan-files 100000]

* **read**: ``DiskTier.fetch`` of every chunk into a slot (header and checksum checked),
  with O_DIRECT (the default), and buffered (``disk_direct_io: false``) with the page cache
  dropped for the files first (``posix_fadvise DONTNEED``) and then warm; against a plain
  sequential read of the same files with ``O_DIRECT`` (aligned buffer, the whole file per
  read: ``dd iflag=direct`` in Python), and ``dd iflag=direct`` itself. Goal: the tier at
  least 0.8x the plain read.
* **write**: ``DiskTier`` writes (queue, reserve, write, rename) of the chunks against a
  plain write of the same bytes to new files, each timed until the data is synced to the
  device (buffered writes alone measure the page cache, and the dirty pages one leaves
  behind slow the next); the two take turns going first.
* **scan**: the start-up scan of ``--scan-files`` chunk files (small ones: the scan reads
  names and sizes, not contents), and how long building the tier takes (the scan runs in
  the background: start-up does not wait for it).

Default chunk: 32 MiB, Mistral-7B's 256-token chunk in bf16. Results go to
docs/results/disk.json (with the machine) and a plot next to it.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import pyplot, write_results


def drop_cache(paths: list[Path]) -> None:
    """Evict the files' pages from the page cache (clean pages; no root needed)."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_direct_read(paths: list[Path], size: int) -> float:
    """GB/s of reading every file whole with O_DIRECT into one aligned buffer."""
    buf = mmap.mmap(-1, size)
    start = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            done = 0
            while done < size:
                n = os.preadv(fd, [memoryview(buf)[done:]], done)
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)
    return size * len(paths) / (time.perf_counter() - start) / 1e9


def dd_direct_read(paths: list[Path]) -> float | None:
    if shutil.which("dd") is None:
        return None
    start = time.perf_counter()
    for p in paths:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=4M", "iflag=direct"],
                       check=True, capture_output=True)
    return sum(p.stat().st_size for p in paths) / (time.perf_counter() - start) / 1e9


def tier_read(tier, keys, pool) -> float:
    start = time.perf_counter()
    got = tier.fetch([(0, k, 0) for k in keys[:1]])
    for k in keys[1:]:
        got += tier.fetch([(0, k, 0)])
    elapsed = time.perf_counter() - start
    assert all(got), "a chunk did not read back"
    return pool.chunk_bytes * len(keys) / elapsed / 1e9


def plain_write(root: Path, data: memoryview, n: int) -> float:
    """GB/s of writing ``n`` new files of ``data``, until synced to the device."""
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i in range(n):
        fd = os.open(root / f"{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < data.nbytes:
                done += os.write(fd, data[done:])
        finally:
            os.close(fd)
    os.sync()
    return data.nbytes * n / (time.perf_counter() - start) / 1e9


def tier_write(tier, pool, keys) -> float:
    """GB/s of the tier writing ``keys`` (all from slot 0, sealed under each in turn as a
    save would: one write queued at a time), until the files are synced to the device."""
    from kvconnector.store.codec import checksum

    xxh3 = checksum(pool.slot_bytes(0))
    start = time.perf_counter()
    for k in keys:
        pool.end_write(0, k, xxh3)
        tier.offload(0, k)
        tier.flush()
    os.sync()
    return pool.chunk_bytes * len(keys) / (time.perf_counter() - start) / 1e9


def scan_bench(root: Path, n: int) -> dict:
    """Time to build a tier on ``n`` existing files, and its background scan."""
    import torch

    from kvconnector.keys import ChunkKey
    from kvconnector.store.disk_files import chunk_path
    from kvconnector.store.disk_tier import DiskTier
    from kvconnector.store.memory import SlotPool

    fp = bytes(range(16))
    body = b"\0" * 64
    for i in range(n):
        p = chunk_path(root, ChunkKey(fp, 0, i.to_bytes(16, "big")))
        if i % 4096 == 0 or not p.parent.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body)
    pool = SlotPool(1, (1, 16), torch.float32)
    start = time.perf_counter()
    tier = DiskTier(root, 1 << 50, pool, "kv")
    built = time.perf_counter() - start
    tier.flush()
    result = tier.scan_result
    tier.close(1.0)
    return {"files": n, "tier_ready_s": built, "scan_s": result.seconds,
            "scan_files": result.files}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None,
                   help="a directory on the disk to measure (default: a temporary one under "
                   "the repository's .cache)")
    p.add_argument("--chunk-mib", type=float, default=32.0)
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scan-files", type=int, default=100_000)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch

    from kvconnector.keys import ChunkKey
    from kvconnector.store.disk_files import chunk_path
    from kvconnector.store.disk_tier import DiskTier
    from kvconnector.store.memory import SlotPool

    base = args.dir or Path(__file__).resolve().parents[1] / ".cache"
    base.mkdir(parents=True, exist_ok=True)
    elements = int(args.chunk_mib * 2**20) // 2
    with tempfile.TemporaryDirectory(dir=base, prefix="bench-disk-") as tmp:
        root = Path(tmp) / "kv"
        pool = SlotPool(1, (elements,), torch.bfloat16, checksums=True)
        pool.begin_write(0).copy_(torch.randn(elements).to(torch.bfloat16))
        fp = bytes(range(16))
        rounds: dict[str, list[float]] = {}

        def add(name: str, value: float | None) -> None:
            if value is not None:
                rounds.setdefault(name, []).append(value)

        for r in range(args.rounds):
            keys = [ChunkKey(fp, 0, (r * 10_000 + i).to_bytes(16, "big"))
                    for i in range(args.chunks)]
            tier = DiskTier(root, 1 << 50, pool, "kv")
            tier.flush()
            # Writes until the data is on the device (a final sync in the clock), the tier
            # and the plain writer in turn, first one then the other.
            for first in ((True, False) if r % 2 == 0 else (False, True)):
                os.sync()
                if first:
                    add("write tier", tier_write(tier, pool, keys))
                else:
                    add("write plain", plain_write(Path(tmp) / f"plain{r}", pool.slot_bytes(0),
                                                   args.chunks))
            paths = [chunk_path(root, k) for k in keys]
            drop_cache(paths)
            add("read plain O_DIRECT", plain_direct_read(paths, paths[0].stat().st_size))
            drop_cache(paths)
            add("read dd iflag=direct", dd_direct_read(paths))
            drop_cache(paths)
            add("read tier, O_DIRECT (default)", tier_read(tier, keys, pool))
            tier.close(1.0)
            buffered = DiskTier(root, 1 << 50, pool, "kv", direct_io=False)
            buffered.flush()
            drop_cache(paths)
            add("read tier, buffered, cold", tier_read(buffered, keys, pool))
            add("read tier, buffered, page cache warm", tier_read(buffered, keys, pool))
            buffered.close(1.0)
            shutil.rmtree(Path(tmp) / f"plain{r}")
            shutil.rmtree(root)
        scan = scan_bench(Path(tmp) / "scan", args.scan_files) if args.scan_files else None
    med = {k: statistics.median(v) for k, v in rounds.items()}
    floor_read = med["read plain O_DIRECT"]
    floor_write = med["write plain"]
    # This VM's disk swings 3-5x between rounds: the ratio of each round's pair (measured
    # one right after the other) is steadier than the ratio of medians.
    paired = {"write": [t / p for t, p in zip(rounds["write tier"], rounds["write plain"],
                                               strict=True)],
              "read": [t / p for t, p in zip(rounds["read tier, O_DIRECT (default)"],
                                              rounds["read plain O_DIRECT"], strict=True)]}
    print(f"chunk {args.chunk_mib:g} MiB x {args.chunks}, median of {args.rounds} rounds "
          f"(GB/s; ratio to the plain operation of the same kind)")
    for k, v in med.items():
        ref = floor_read if k.startswith("read") else floor_write
        print(f"  {k:34s} {v:6.2f}  ({v / ref:.2f}x)")
    for kind, ratios in paired.items():
        print(f"  {kind}: tier / plain per round {[round(x, 2) for x in ratios]}, median "
              f"{statistics.median(ratios):.2f}")
    if scan:
        print(f"scan: {scan['scan_files']} files in {scan['scan_s']:.2f} s; the tier was "
              f"ready after {scan['tier_ready_s'] * 1000:.1f} ms (the scan runs behind it)")
    out = write_results(args.out, "disk", {
        "chunk_mib": args.chunk_mib, "chunks": args.chunks, "rounds": args.rounds,
        "directory_fs": _fs(base), "gb_per_s": rounds, "median_gb_per_s": med,
        "read_ratio_tier_to_plain_o_direct": med["read tier, O_DIRECT (default)"] / floor_read,
        "read_ratio_buffered_cold_to_plain_o_direct":
            med["read tier, buffered, cold"] / floor_read,
        "write_ratio_tier_to_plain": med["write tier"] / floor_write,
        "paired_ratios": paired, "paired_median": {k: statistics.median(v)
                                                    for k, v in paired.items()},
        "scan": scan})
    print(f"results: {out}")
    plot(out.with_suffix(".png"), med, args)


def _warm(paths: list[Path]) -> bool:
    for p in paths:
        p.read_bytes()
    return True


def _fs(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout
        return out.splitlines()[1].split()[1]
    except (OSError, IndexError):
        return "?"


def plot(path: Path, med: dict[str, float], args) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(med)
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = ["tab:blue" if "tier" in n else "tab:gray" for n in names]
    ax.barh(names, [med[n] for n in names], color=colors)
    ax.set_xlabel("GB/s")
    ax.set_title(f"disk tier vs plain file I/O, {args.chunk_mib:g} MiB chunks")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
