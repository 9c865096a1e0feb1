"""``kvconnector stats | verify | purge`` on a disk tier's directory, filled by real disk
tiers of two models."""

from __future__ import annotations

import json

import pytest
import torch

from kvconnector.cli import main
from kvconnector.keys import ChunkKey, Fingerprint
from kvconnector.store import codec
from kvconnector.store.disk_files import HEAD_BYTES, chunk_path, descriptor_path, file_size
from kvconnector.store.disk_space import read_usage
from kvconnector.store.disk_tier import DiskTier
from kvconnector.store.memory import SlotPool

SHAPE = (2, 64, 8)
FILE = file_size(4096)
FP_A = Fingerprint("org/model-a", "", "d", "float32", "kv", 16, 2, 2, 32, 1, 256, "")
FP_B = Fingerprint("org/model-b", "", "d", "float32", "kv", 16, 2, 2, 32, 1, 256, "team")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def fill(root, fp: Fingerprint, n: int, mac_key: bytes | None = None) -> list[ChunkKey]:
    pool = SlotPool(1, SHAPE, torch.float32)
    tier = DiskTier(root, 1 << 30, pool, "kv", fingerprint=fp, mac_key=mac_key)
    keys = []
    for i in range(n):
        key = ChunkKey(fp.digest(), i % 2, (i + 1).to_bytes(16, "big"))
        pool.begin_write(0).fill_(float(i))
        pool.end_write(0, key)
        tier.offload(0, key)
        assert tier.flush()
        keys.append(key)
    tier.close(1.0)
    return keys


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "kv"
    return root, fill(root, FP_A, 4), fill(root, FP_B, 2)


def test_stats_counts_files_per_model(store, capsys):
    root, _, _ = store
    rc, out, _ = run(capsys, "stats", str(root), "--json")
    assert rc == 0
    data = json.loads(out)
    assert (data["chunks"], data["bytes"]) == (6, 6 * FILE)
    by_model = {g["model"]: g for g in data["fingerprints"]}
    assert by_model["org/model-a"]["chunks"] == 4 and by_model["org/model-a"]["ranks"] == [0, 1]
    assert by_model["org/model-b"]["namespace"] == "team"
    assert by_model["org/model-b"]["fingerprint"] == FP_B.digest().hex()
    rc, out, _ = run(capsys, "stats", f"file://{root}")
    assert rc == 0 and "org/model-a" in out and "6 chunk files" in out


def test_verify_finds_and_deletes_damaged_files(store, capsys):
    root, keys_a, keys_b = store
    bad = chunk_path(root, keys_a[1])
    data = bytearray(bad.read_bytes())
    data[HEAD_BYTES + 10] ^= 1
    bad.write_bytes(bytes(data))
    swapped = chunk_path(root, keys_b[0])
    swapped.write_bytes(chunk_path(root, keys_b[1]).read_bytes())
    rc, out, _ = run(capsys, "verify", str(root), "--json")
    report = json.loads(out)
    assert rc == 1 and report["checked"] == 6
    assert report["reasons"] == {"checksum": 1, "key": 1} and report["deleted"] == 0
    assert bad.exists()
    rc, out, _ = run(capsys, "verify", str(root), "--delete")
    assert rc == 1 and "deleted 2" in out and not bad.exists() and not swapped.exists()
    assert read_usage(root) == 4 * FILE  # the engines' byte count follows
    rc, out, _ = run(capsys, "verify", str(root))
    assert rc == 0 and "all values are intact" in out


def test_verify_with_the_mac_key_refuses_unsigned_files(tmp_path, capsys, monkeypatch):
    root = tmp_path / "kv"
    fill(root, FP_A, 2)  # unsigned
    fill(root, FP_B, 2, mac_key=codec.mac_key(b"k" * 32))
    monkeypatch.setenv("KVC_MAC", "k" * 32)
    rc, out, _ = run(capsys, "verify", str(root), "--mac-key-env", "KVC_MAC", "--json")
    report = json.loads(out)
    assert rc == 1 and report["reasons"] == {"descriptor": 1, "mac": 2}


def test_purge_removes_one_model_and_keeps_the_other(store, capsys):
    root, keys_a, keys_b = store
    rc, out, _ = run(capsys, "purge", str(root), "--model", "org/model-a", "--dry-run")
    assert rc == 0 and "4 chunks" in out and chunk_path(root, keys_a[0]).exists()
    rc, out, _ = run(capsys, "purge", str(root), "--model", "org/model-a", "--yes")
    assert rc == 0 and "deleted 5 files" in out  # 4 chunks and the descriptor
    assert not (root / FP_A.digest().hex()).exists()
    assert all(chunk_path(root, k).exists() for k in keys_b)
    assert descriptor_path(root, FP_B.digest().hex()).exists()
    assert read_usage(root) == 2 * FILE


def test_a_missing_directory_is_a_clear_error(tmp_path, capsys):
    rc, _, err = run(capsys, "stats", str(tmp_path / "nowhere"))
    assert rc == 2 and "no such directory" in err and "disk_path" in err
