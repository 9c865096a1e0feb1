"""The disk tier on a real file system: files written off the caller's thread and read back
into slots, every kind of damaged file a miss that is deleted, the capacity bound across
processes, the index found again after a restart, a full file system, a killed writer."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from kvconnector.keys import ChunkKey
from kvconnector.placement import WritePlacement
from kvconnector.store import codec
from kvconnector.store.disk_catalog import DiskCatalog
from kvconnector.store.disk_files import HEAD_BYTES, chunk_path, file_size
from kvconnector.store.disk_space import STALE_TEMP_S, USAGE_FILE, DiskSpace, read_usage
from kvconnector.store.disk_tier import DiskTier
from kvconnector.store.memory import ChunkCorrupt, SlotPool

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (2, 64, 8)  # 1024 fp32 elements: 4 KiB a chunk
CHUNK_BYTES = 4096
FILE = file_size(CHUNK_BYTES)
FP = bytes(range(16))


def key(i: int, rank: int = 0) -> ChunkKey:
    return ChunkKey(FP, rank, i.to_bytes(16, "big"))


def fill(pool: SlotPool, slot: int, k: ChunkKey, value: float) -> None:
    pool.begin_write(slot).copy_(torch.arange(pool.buffer[0].numel()).view(SHAPE) + value)
    pool.end_write(slot, k)


def stored(tier: DiskTier, pool: SlotPool, values: dict[int, float]) -> None:
    """Write chunk i with ``values[i]`` through the tier, one slot at a time."""
    for i, v in values.items():
        fill(pool, 0, key(i), v)
        tier.offload(0, key(i), 0)
        assert tier.flush()


def files(root: Path) -> list[Path]:
    """Chunk files, written or being written."""
    return [p for p in root.rglob("*") if p.is_file() and p.name != USAGE_FILE]


@pytest.fixture
def pool() -> SlotPool:
    return SlotPool(4, SHAPE, torch.float32)


@pytest.fixture
def tier(tmp_path, pool):
    t = DiskTier(tmp_path / "kv", 10 * FILE, pool, "kv")
    yield t
    t.close(1.0)


def test_disk_writes_wait_for_a_forward_pass_as_the_worker_places_them(tmp_path, pool):
    """On the CPU build a worker's disk writes, like its Redis puts, wait for its
    ``write_gate`` (placement.WRITE_HOLD_MAX_S); on CUDA they do not wait."""
    forward_running = threading.Event()
    placement = WritePlacement.for_worker(None, forward_running, cuda=False)
    assert placement.gate is forward_running
    assert WritePlacement.for_worker(None, forward_running, cuda=True).gate is None
    t = DiskTier(tmp_path / "kv", 10 * FILE, pool, "kv",
                 placement=WritePlacement(gate=forward_running, hold_s=5.0))
    try:
        fill(pool, 0, key(1), 0.5)
        t.offload(0, key(1), 0)
        time.sleep(0.3)
        assert t.snapshot()["puts"] == 0 and t.queued == 1  # between forward passes: held
        forward_running.set()
        assert t.flush(5) and t.snapshot()["puts"] == 1
        assert t.fetch([(1, key(1), 0)]) == [True]
    finally:
        t.close(1.0)


def test_a_held_write_whose_slot_was_reused_is_reported_not_written(tmp_path, pool):
    """A write held for a forward pass finds its slot sealed under another chunk: nothing
    is written, and with KV events the chunk is reported as not on disk."""
    gate = threading.Event()
    t = DiskTier(tmp_path / "kv", 10 * FILE, pool, "kv", track_gone=True,
                 placement=WritePlacement(gate=gate, hold_s=5.0))
    try:
        fill(pool, 0, key(1), 0.5)
        t.offload(0, key(1), 0)
        fill(pool, 0, key(2), 1.5)  # reused while the write waits
        gate.set()
        assert t.flush(5)
        assert t.snapshot()["puts"] == 0 and files(tmp_path / "kv") == []
        assert t.take_gone() == {key(1).chunk_hash}
    finally:
        t.close(1.0)


def test_a_written_chunk_reads_back_into_another_slot(tier, pool, tmp_path):
    stored(tier, pool, {1: 0.5})
    path = chunk_path(tmp_path / "kv", key(1))
    assert path.stat().st_size == FILE
    assert path.parent.parent.name == "r0" and path.parent.name == path.stem[:2]
    assert tier.fetch([(2, key(1), 0), (3, key(9), 0)]) == [True, False]
    assert torch.equal(pool.read(2, key(1)), pool.slot(0))
    with pytest.raises(ChunkCorrupt):
        pool.read(3, key(9))  # not on disk: the slot stays unsealed
    snap = tier.snapshot()
    assert (snap["puts"], snap["hits"], snap["misses"], snap["put_bytes"]) == (1, 1, 1,
                                                                               CHUNK_BYTES)
    assert read_usage(tmp_path / "kv") == FILE


def test_the_payload_starts_on_a_4k_boundary_after_a_codec_header(tier, pool, tmp_path):
    stored(tier, pool, {1: 0.0})
    data = chunk_path(tmp_path / "kv", key(1)).read_bytes()
    header_len = codec.check_prefix(data[:codec.PREFIX_LEN], len(data))
    header = codec.check_header(data[codec.PREFIX_LEN:codec.PREFIX_LEN + header_len],
                                tier.expected(key(1)))
    assert set(data[codec.PREFIX_LEN + header_len:HEAD_BYTES]) == {0}
    codec.check_payload(header, memoryview(data)[HEAD_BYTES:])
    assert data[HEAD_BYTES:] == bytes(pool.slot_bytes(0))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (lambda p, other: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    "too_large": (lambda p, other: p.write_bytes(p.read_bytes() + b"x"), "too_large"),
    "payload_bit": (lambda p, other: _flip(p, HEAD_BYTES + 1000), "checksum"),
    "header_bit": (lambda p, other: _flip(p, 30), None),  # whichever field it hits
    "swapped": (lambda p, other: p.write_bytes(other.read_bytes()), "key"),
    "foreign": (lambda p, other: p.write_bytes(os.urandom(FILE)), "bad_magic"),
    "empty": (lambda p, other: p.write_bytes(b""), "too_short"),
    "head_only": (lambda p, other: p.write_bytes(p.read_bytes()[:HEAD_BYTES]), "truncated"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_file_is_a_miss_and_is_deleted(tier, pool, tmp_path, damage):
    stored(tier, pool, {1: 0.0, 2: 7.0})
    path, other = chunk_path(tmp_path / "kv", key(1)), chunk_path(tmp_path / "kv", key(2))
    do, reason = DAMAGE[damage]
    do(path, other)
    assert tier.fetch([(1, key(1), 0)]) == [False]
    with pytest.raises(ChunkCorrupt):
        pool.read(1, key(1))
    assert not path.exists()
    corrupt = tier.snapshot()["corrupt"]
    assert sum(corrupt.values()) == 1 and (reason is None or corrupt == {reason: 1})
    assert tier.fetch([(1, key(2), 0)]) == [True]  # the other file is untouched
    assert read_usage(tmp_path / "kv") == FILE  # the deleted file's room given back


def test_a_fetch_of_several_reads_them_at_once_each_into_its_own_slot(tmp_path):
    """A hit of several chunks reads its files on several threads; each result stays with
    its slot and a damaged or missing file among them fails only itself."""
    pool = SlotPool(12, SHAPE, torch.float32)
    tier = DiskTier(tmp_path / "kv", 20 * FILE, pool, "kv")
    try:
        stored(tier, pool, {i: float(i * 10) for i in range(1, 7)})
        _flip(chunk_path(tmp_path / "kv", key(3)), HEAD_BYTES + 8)
        readers, read_into = set(), tier.files.read_into

        def watched(*a, **kw):
            readers.add(threading.current_thread().name)
            time.sleep(0.01)  # each read waits a little, as on a device
            return read_into(*a, **kw)

        tier.files.read_into = watched
        wanted = [(5 + i, key(k), 0) for i, k in enumerate([1, 2, 3, 4, 9, 5, 6])]
        assert tier.fetch(wanted) == [True, True, False, True, False, True, True]
        for slot, k, _ in wanted:
            if k not in (key(3), key(9)):
                want = torch.arange(pool.buffer[0].numel()).view(SHAPE) + float(
                    int.from_bytes(k.chunk_hash, "big") * 10)
                assert torch.equal(pool.read(slot, k), want.to(torch.float32))
        assert len(readers) > 1 and all(r.startswith("kvconnector-disk-read") for r in readers)
        assert not chunk_path(tmp_path / "kv", key(3)).exists()
        assert tier.snapshot()["hits"] == 5
    finally:
        tier.close(1.0)


def test_with_a_mac_key_unsigned_and_forged_files_are_misses(tmp_path, pool):
    root = tmp_path / "kv"
    plain = DiskTier(root, 10 * FILE, pool, "kv")
    stored(plain, pool, {1: 0.0})
    plain.close(1.0)
    signed = DiskTier(root, 10 * FILE, pool, "kv", mac_key=codec.mac_key(b"s" * 32))
    stored(signed, pool, {2: 1.0})
    assert signed.fetch([(1, key(1), 0), (2, key(2), 0)]) == [False, True]
    assert signed.snapshot()["corrupt"] == {"mac": 1}
    # A file re-signed with another secret is forged for this reader.
    other = DiskTier(tmp_path / "other", 10 * FILE, pool, "kv",
                     mac_key=codec.mac_key(b"t" * 32))
    stored(other, pool, {2: 1.0})
    os.replace(chunk_path(tmp_path / "other", key(2)), chunk_path(root, key(2)))
    assert signed.fetch([(1, key(2), 0)]) == [False]
    signed.close(1.0)
    other.close(1.0)


def test_capacity_evicts_the_least_recently_used_first(tmp_path, pool):
    root = tmp_path / "kv"
    tier = DiskTier(root, 3 * FILE, pool, "kv")
    stored(tier, pool, {1: 1.0, 2: 2.0, 3: 3.0})
    assert tier.fetch([(1, key(1), 0)]) == [True]  # 1 is now the most recently used
    stored(tier, pool, {4: 4.0, 5: 5.0})
    on_disk = {i for i in range(1, 6) if chunk_path(root, key(i)).exists()}
    assert on_disk == {1, 4, 5}
    assert read_usage(root) == 3 * FILE == sum(p.stat().st_size for p in root.rglob("*.kvc"))
    assert tier.snapshot()["evictions"] == 2
    tier.close(1.0)


def test_a_file_larger_than_the_capacity_is_never_written(tmp_path, pool):
    tier = DiskTier(tmp_path / "kv", FILE - 1, pool, "kv")
    stored(tier, pool, {1: 1.0})
    assert not list((tmp_path / "kv").rglob("*.kvc"))
    assert tier.snapshot()["put_no_room"] == 1
    tier.close(1.0)


def test_two_writers_share_one_bound(tmp_path, pool):
    """Two tiers on one directory (as two engines): the directory never holds more than
    the capacity, and each evicts the other's files when it needs room."""
    root = tmp_path / "kv"
    a, b = DiskTier(root, 4 * FILE, pool, "kv"), DiskTier(root, 4 * FILE, pool, "kv")
    for i in range(12):
        stored(a if i % 2 else b, pool, {i: float(i)})
        held = sum(p.stat().st_size for p in root.rglob("*.kvc"))
        assert held <= 4 * FILE and read_usage(root) == held
    assert b.fetch([(1, key(11), 0)]) == [True]  # written by a, read by b
    a.close(1.0)
    b.close(1.0)


def test_a_chunk_written_twice_is_one_file(tmp_path, pool):
    root = tmp_path / "kv"
    a, b = DiskTier(root, 4 * FILE, pool, "kv"), DiskTier(root, 4 * FILE, pool, "kv")
    stored(a, pool, {1: 1.0})
    stored(b, pool, {1: 1.0})
    assert b.snapshot()["put_exists"] == 1 and read_usage(root) == FILE
    a.close(1.0)
    b.close(1.0)


def test_a_restart_finds_the_files_and_their_order(tmp_path, pool):
    root = tmp_path / "kv"
    tier = DiskTier(root, 3 * FILE, pool, "kv")
    stored(tier, pool, {1: 1.0, 2: 2.0, 3: 3.0})
    time.sleep(0.02)
    assert tier.fetch([(1, key(1), 0)]) == [True]  # its modification time moves on
    tier.close(1.0)
    (root / USAGE_FILE).write_bytes(b"")  # the count is rebuilt from what is there
    stale = chunk_path(root, key(7)).with_name("x.kvc.tmp-1-2")
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - STALE_TEMP_S - 5,) * 2)
    young = chunk_path(root, key(8)).with_name("y.kvc.tmp-1-2")
    young.write_bytes(b"being written")
    again = DiskTier(root, 3 * FILE, pool, "kv")
    assert again.flush()  # the scan runs before the first write
    assert again.scan_result.files == 3 and again.scan_result.stale_temps == 1
    assert not stale.exists() and young.exists()
    assert read_usage(root) == 3 * FILE + young.stat().st_size
    young.unlink()  # its writer gave up: files removed by hand are recounted by a scan
    again.space.scan()
    assert read_usage(root) == 3 * FILE
    stored(again, pool, {4: 4.0})
    assert not chunk_path(root, key(2)).exists() and chunk_path(root, key(1)).exists()
    assert again.fetch([(1, key(3), 0)]) == [True]
    again.close(1.0)


def test_a_full_file_system_pauses_writes_then_they_resume(tier, pool, tmp_path, monkeypatch,
                                                           caplog):
    from kvconnector.store import disk_tier
    from kvconnector.store.disk_files import DiskFiles

    monkeypatch.setattr(disk_tier, "FIRST_PAUSE_S", 0.2)
    tier._pause_s = 0.2
    real = DiskFiles.write

    def full(fd, head, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskFiles, "write", staticmethod(full))
    stored(tier, pool, {1: 1.0, 2: 2.0})
    snap = tier.snapshot()
    assert snap["full"] == 1 and snap["dropped_puts"] == 1  # the second waits out the pause
    assert sum("cannot write chunk files" in r.message for r in caplog.records) == 1
    assert read_usage(tmp_path / "kv") == 0 and not files(tmp_path / "kv")
    monkeypatch.setattr(DiskFiles, "write", real)
    time.sleep(0.5)
    stored(tier, pool, {3: 3.0})
    assert tier.snapshot()["puts"] == 1 and tier.fetch([(1, key(3), 0)]) == [True]


def test_a_file_size_limit_is_a_full_disk_not_a_crash(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the file (EFBIG), as a full disk would."""
    script = textwrap.dedent(f"""
        import resource, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from tests.test_disk_store import SHAPE, key, stored
        from kvconnector.store.disk_tier import DiskTier
        from kvconnector.store.memory import SlotPool
        pool = SlotPool(2, SHAPE, torch.float32)
        tier = DiskTier({str(tmp_path / "kv")!r}, 1 << 20, pool, "kv")
        assert tier.flush()
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
        stored(tier, pool, {{1: 1.0}})
        print(tier.snapshot()["full"], tier.snapshot()["puts"])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0"]
    assert not files(tmp_path / "kv")


def test_a_killed_writer_never_leaves_a_bad_file_under_a_final_name(tmp_path):
    """kill -9 a process while it writes chunk files as fast as it can: every file under
    a final name reads back intact; what it was writing is a temporary file."""
    root = tmp_path / "kv"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from tests.test_disk_store import SHAPE, key, fill
        from kvconnector.store.disk_tier import DiskTier
        from kvconnector.store.memory import SlotPool
        pool = SlotPool(2, SHAPE, torch.float32)
        tier = DiskTier({str(root)!r}, 1 << 30, pool, "kv")
        assert tier.flush()
        print("ready", flush=True)
        i = 0
        while True:
            fill(pool, 0, key(i), float(i))
            tier._write(key(i), pool.slot_bytes(0), pool.header(0).checksum)
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finals = list(root.rglob("*.kvc"))
    assert len(finals) > 10
    pool = SlotPool(1, SHAPE, torch.float32)
    reader = DiskTier(root, 1 << 30, pool, "kv")
    for path in finals:
        i = int(path.stem, 16)
        assert reader.fetch([(0, key(i), 0)]) == [True], path
        assert float(pool.slot(0).flatten()[0]) == float(i)
    reader.close(1.0)


def test_the_catalog_counts_leading_chunks_on_every_rank(tmp_path, pool):
    root = tmp_path / "kv"
    tier = DiskTier(root, 10 * FILE, pool, "kv")
    stored(tier, pool, {1: 1.0, 2: 2.0})
    fill(pool, 0, key(1, rank=1), 1.0)
    tier.offload(0, key(1, rank=1), 0)
    assert tier.flush()
    cat = DiskCatalog(root)
    assert cat.count_prefix([[key(1)], [key(2)], [key(3)]]) == 2
    assert cat.count_prefix([[key(1), key(1, 1)], [key(2), key(2, 1)]]) == 1
    assert cat.count_prefix([[key(3)], [key(1)]]) == 0
    tier.close(1.0)


def test_a_slow_file_system_is_not_asked_for_a_while(tmp_path, monkeypatch):
    from kvconnector.store import disk_catalog

    cat = DiskCatalog(tmp_path, budget_s=0.01)
    real = os.stat
    monkeypatch.setattr(disk_catalog.os, "stat", lambda p: (time.sleep(0.02), real(p))[1])
    (tmp_path / "x").mkdir()
    assert cat.count_prefix([[key(1)]]) == 0 and cat.slow_lookups == 1
    monkeypatch.setattr(disk_catalog.os, "stat", lambda p: pytest.fail("asked while paused"))
    assert cat.count_prefix([[key(1)]]) == 0


def test_space_reserve_counts_a_file_being_written(tmp_path):
    space = DiskSpace(tmp_path, 2 * FILE)
    final = chunk_path(tmp_path, key(1))
    fd, temp = space.reserve(final, FILE)
    assert temp.stat().st_size == FILE and read_usage(tmp_path) == FILE
    os.close(fd)
    space.abandon(temp, FILE)
    assert not temp.exists() and read_usage(tmp_path) == 0
    space.close()


def test_disk_keys_are_validated_at_start_up(tmp_path):
    from kvconnector.config import ConfigError, ConnectorConfig
    from kvconnector.store.disk_space import disk_capacity

    with pytest.raises(ConfigError, match="disk_capacity needs disk_path"):
        ConnectorConfig.from_extra_config({"disk_capacity": "1GiB"})
    with pytest.raises(ConfigError, match="disk_capacity: expected a size"):
        ConnectorConfig.from_extra_config({"disk_path": str(tmp_path), "disk_capacity": "lots"})
    with pytest.raises(ConfigError, match="is more than the file system"):
        disk_capacity(str(tmp_path), 1 << 60)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="disk_path: .* is not a directory|cannot create"):
        disk_capacity(str(tmp_path / "file"), 1 << 20)
    assert 0 < disk_capacity(str(tmp_path / "new"), None) <= 1 << 40
    assert (tmp_path / "new").is_dir()


def test_a_buffer_o_direct_refuses_is_read_without_it(tier, pool, tmp_path):
    """O_DIRECT needs aligned memory: an unaligned buffer is read the buffered way."""
    stored(tier, pool, {1: 3.0})
    raw = bytearray(CHUNK_BYTES + 1)
    out = memoryview(raw)[1:]
    res = tier.files.read_into(key(1), tier.expected(key(1)), out)
    assert res.ok and bytes(out) == bytes(pool.slot_bytes(0))


def test_pool_slots_start_on_a_page():
    pool = SlotPool(3, (4, 1024), torch.bfloat16)  # 8 KiB slots
    assert all(pool.slot(s).data_ptr() % 4096 == 0 for s in range(3))


def test_a_partial_chunk_stores_only_its_filled_blocks(tmp_path):
    """The first block of a 4-block chunk: a quarter of the bytes on disk and in Redis,
    read back into those blocks of another slot."""
    from kvconnector.store.redis_store import RedisStore
    from kvconnector.store.tiering import RedisTier
    from tests.redis_server import RedisServer

    shape = (2, 2, 64, 2, 2)  # [layers, K/V, 64 tokens: 4 blocks of 16, heads, head size]
    pool = SlotPool(2, shape, torch.float32)
    disk = DiskTier(tmp_path / "kv", 1 << 20, pool, "kv", blocks_per_chunk=4)
    pool.begin_write(0).copy_(torch.arange(1024.0).view(shape))
    pool.end_write(0, key(1))
    disk.offload(0, key(1), 1)
    assert disk.flush()
    assert chunk_path(tmp_path / "kv", key(1)).stat().st_size == HEAD_BYTES + CHUNK_BYTES // 4
    pool.begin_write(1).zero_()
    assert disk.fetch([(1, key(1), 1)]) == [True]
    assert torch.equal(pool.part(1, 1, 4), pool.part(0, 1, 4))
    assert pool.part(1, 1, 4).shape == (2, 2, 16, 2, 2)
    assert not pool.slot(1)[:, :, 16:].any()
    assert disk.fetch([(1, key(1), 0)]) == [False]  # as a whole chunk: another shape
    disk.close(1.0)
    with RedisServer() as server:
        redis = RedisTier(RedisStore.from_url(server.url), pool, "kv", blocks_per_chunk=4)
        redis.offload(0, key(1), 1)
        assert redis.flush()
        assert server.client().strlen(f"kvc:{key(1)}") < CHUNK_BYTES // 4 + 512
        pool.begin_write(1).zero_()
        assert redis.fetch([(1, key(1), 1)]) == [True]
        assert torch.equal(pool.part(1, 1, 4), pool.part(0, 1, 4))
        redis.close(1.0)


def test_disk_counters_reach_the_metrics_as_increments(tier, pool, tmp_path):
    from kvconnector.metrics import COUNTERS, GAUGE_FAMILIES, DiskTap

    tap = DiskTap()
    stored(tier, pool, {1: 1.0, 2: 2.0})
    _flip(chunk_path(tmp_path / "kv", key(2)), HEAD_BYTES + 8)
    assert tier.fetch([(1, key(1), 0), (2, key(2), 0)]) == [True, False]
    counts, gauges = tap.counts(tier)
    assert counts == {"disk_chunks.put": 2, "disk_bytes.put": 2 * CHUNK_BYTES,
                      "disk_chunks.get": 1, "disk_bytes.get": CHUNK_BYTES,
                      "disk_corrupt_files.checksum": 1}
    assert gauges == {"disk_write_queue": 0, "disk_files": 1}
    assert tap.counts(tier)[0] == {}  # increments: nothing new since
    families = {f.entry for f in COUNTERS} | {f.entry for f in GAUGE_FAMILIES}
    assert {k.partition(".")[0] for k in counts} | set(gauges) <= families


@pytest.mark.parametrize("direct_io", [True, False])
def test_chunk_files_are_written_past_the_page_cache(tmp_path, pool, monkeypatch, direct_io):
    """With ``disk_direct_io`` a whole chunk (page-aligned slot, 4 KiB multiple) is written
    with O_DIRECT; a partial chunk's packed copy, which O_DIRECT may refuse, and a tier
    without it are written through the page cache. Both read back intact."""
    import fcntl

    from kvconnector.store import disk_files

    direct: list[bool] = []
    write_all = disk_files._write_all

    def noted(fd, buffers):
        direct.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return write_all(fd, buffers)

    monkeypatch.setattr(disk_files, "_write_all", noted)
    t = DiskTier(tmp_path / "kv", 10 * FILE, pool, "kv", direct_io=direct_io)
    stored(t, pool, {1: 1.0})
    assert direct == [direct_io]
    fill(pool, 0, key(2), 2.0)
    pool.end_write(0, key(2))
    refused = []

    def misaligned(fd, buffers):  # what the kernel says to a buffer O_DIRECT cannot use
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return noted(fd, buffers)

    monkeypatch.setattr(disk_files, "_write_all", misaligned)
    t.offload(0, key(2), 0)
    assert t.flush()
    assert len(refused) == int(direct_io) and direct[-1] is False
    for i, v in ((1, 1.0), (2, 2.0)):
        pool.begin_write(1).zero_()
        assert t.fetch([(1, key(i), 0)]) == [True]
        assert torch.equal(pool.slot(1), torch.arange(pool.buffer[0].numel()).view(SHAPE) + v)
    t.close(1.0)
