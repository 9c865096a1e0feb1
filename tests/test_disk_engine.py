"""Real engines with a disk tier: chunks found again after a restart and by another engine on
the same directory (at the same time), the directory bounded, damaged files and a full disk
costing misses only, an engine killed while it writes. Every answer is vLLM alone's."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvconnector.store.disk_files import HEAD_BYTES
from kvconnector.store.disk_space import read_usage
from tests.conftest import ROOT, engine_env, prompt, run_engine

pytestmark = pytest.mark.engine

CHUNK = 256
CHUNK_FILE = (256 << 10) + HEAD_BYTES  # the tiny model's 256 KiB chunk and its head
# P1: 2 full chunks and a partial chunk of 1 block: a hit on it is 640 tokens.
P1, P2, P3, P4 = prompt(21, 700), prompt(22, 600), prompt(23, 800), prompt(24, 520)
PROMPTS = [P1, P2, P3, P4]
P1_HIT = 640


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory):
    res = run_engine(tmp_path_factory.mktemp("disk-base"), {
        "model": tiny_model, "connector": None,
        "steps": [{"op": "generate", "prompts": PROMPTS}]})
    return [r["tokens"] for r in res[0]]


def chunk_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvc"))


def test_a_restarted_engine_serves_the_chunks_on_disk(tiny_model, tmp_path, baseline):
    disk = tmp_path / "kv"
    extra = {"memory_capacity": "4MiB", "disk_path": str(disk)}
    first = run_engine(tmp_path / "a", {"model": tiny_model, "connector": extra, "steps": [
        {"op": "generate", "prompts": [P1, P2]}, {"op": "flush"}, {"op": "disk_stats"}]})
    assert [o["tokens"] for o in first[0]] == baseline[:2]
    assert first[2]["puts"] == 5 and len(chunk_files(disk)) == 5  # 3 + 2 chunks
    # P1's last chunk holds 1 of its 2 blocks: only that block's bytes are stored.
    assert read_usage(disk) == 4 * CHUNK_FILE + HEAD_BYTES + (128 << 10)
    second = run_engine(tmp_path / "b", {
        "model": tiny_model, "connector": extra, "log_stats": True, "steps": [
            {"op": "generate", "prompts": [P1]}, {"op": "cached_by_source"},
            {"op": "generate", "prompts": [P1, P2]}, {"op": "totals"}]})
    assert second[0][0]["cached"] == P1_HIT and second[0][0]["tokens"] == baseline[0]
    assert second[1] == {"disk": P1_HIT}  # vLLM's own per-tier count
    # Once read, P1 is in memory; P2 comes from disk.
    assert [o["cached"] for o in second[2]] == [P1_HIT, 2 * CHUNK]
    assert [o["tokens"] for o in second[2]] == baseline[:2]
    totals = second[3]
    assert totals["disk_loaded_chunks"] == 5 and totals["disk_misses"] == 0
    assert totals["load_errors"] == 0


def test_two_engines_share_one_directory_at_the_same_time(tiny_model, tmp_path, baseline):
    """Engine B waits until engine A has written P1's files, then finds them; both then
    store P3 at once: one file per chunk, and the byte count still adds up."""
    disk = tmp_path / "kv"
    extra = {"memory_capacity": "4MiB", "disk_path": str(disk)}
    out: dict = {}

    def engine_b() -> None:
        out["b"] = run_engine(tmp_path / "b", {"model": tiny_model, "connector": extra,
                                               "steps": [
            {"op": "wait_for_files", "dir": str(disk), "count": 3},
            {"op": "generate", "prompts": [P1, P3]}, {"op": "flush"}, {"op": "totals"}]},
            fresh=True)

    b = threading.Thread(target=engine_b)
    b.start()
    a = run_engine(tmp_path / "a", {"model": tiny_model, "connector": extra, "steps": [
        {"op": "generate", "prompts": [P1]}, {"op": "flush"},
        {"op": "wait_for_files", "dir": str(disk), "count": 4},
        {"op": "generate", "prompts": [P3]}, {"op": "flush"}]})
    b.join(600)
    assert "b" in out, "engine B did not finish"
    res_b = out["b"]
    assert res_b[0] >= 3
    assert res_b[1][0]["cached"] == P1_HIT and res_b[1][0]["tokens"] == baseline[0]
    assert res_b[3]["disk_loaded_chunks"] == 3
    assert a[0][0]["tokens"] == baseline[0] and a[3][0]["tokens"] == baseline[2]
    assert res_b[1][1]["tokens"] == baseline[2]
    files = chunk_files(disk)
    assert len(files) == len({f.name for f in files}) == 3 + 3  # P1: 2 + a partial, P3: 3
    assert read_usage(disk) == sum(f.stat().st_size for f in files)


def test_the_directory_never_exceeds_its_capacity(tiny_model, tmp_path, baseline):
    disk = tmp_path / "kv"
    cap = 4 * CHUNK_FILE
    extra = {"memory_capacity": "1MiB", "disk_path": str(disk), "disk_capacity": cap}
    steps = []
    for p in PROMPTS:
        steps += [{"op": "generate", "prompts": [p]}, {"op": "flush"}, {"op": "disk_stats"}]
    steps += [{"op": "generate", "prompts": PROMPTS}]
    res = run_engine(tmp_path / "a", {"model": tiny_model, "connector": extra,
                                      "steps": steps})
    for i in range(len(PROMPTS)):
        assert res[3 * i][0]["tokens"] == baseline[i]
    assert [o["tokens"] for o in res[-1]] == baseline
    sizes = sum(f.stat().st_size for f in disk.rglob("*") if f.name.endswith(".kvc"))
    assert sizes <= cap and read_usage(disk) == sizes
    assert res[-2]["evictions"] >= 5  # 12 files written through a room of 4


def verify(path: Path) -> bytes:
    """A chunk file's key, after the checks a reader makes of its header and checksum."""
    from kvconnector.store import codec

    data = path.read_bytes()
    n = codec.check_prefix(data[:codec.PREFIX_LEN], len(data))
    header = codec.unpack_header(data[codec.PREFIX_LEN:codec.PREFIX_LEN + n])
    codec.check_payload(header, memoryview(data)[HEAD_BYTES:])
    return header["key"]


def test_damaged_files_are_recomputed_never_served(tiny_model, tmp_path, baseline):
    """P1's first chunk file swapped for P2's, its second bit-flipped: a fresh engine
    (nothing in memory) finds both bad, recomputes them, answers as vLLM alone and writes
    them again; the next engine loads them."""
    disk = tmp_path / "kv"
    extra = {"memory_capacity": "4MiB", "disk_path": str(disk)}
    first = run_engine(tmp_path / "a", {"model": tiny_model, "connector": extra, "steps": [
        {"op": "generate", "prompts": [P1, P2]}, {"op": "flush"},
        {"op": "disk_paths", "prompts": [P1, P2]}]})
    (p1c0, p1c1), (p2c0, _) = (list(map(Path, ps)) for ps in first[2])
    key0 = verify(p1c0)
    data = bytearray(p1c1.read_bytes())
    data[HEAD_BYTES + 4096] ^= 0x01
    p1c1.write_bytes(bytes(data))
    p1c0.write_bytes(p2c0.read_bytes())  # another chunk's file under this name
    res = run_engine(tmp_path / "b", {"model": tiny_model, "connector": extra, "steps": [
        {"op": "generate", "prompts": [P1]}, {"op": "flush"}, {"op": "disk_stats"},
        {"op": "totals"}]})
    assert res[0][0]["tokens"] == baseline[0]
    assert res[2]["corrupt"] == {"key": 1, "checksum": 1}
    assert res[3]["load_errors"] >= 2
    assert verify(p1c0) == key0 and verify(p1c1)  # recomputed and written again
    again = run_engine(tmp_path / "c", {"model": tiny_model, "connector": extra, "steps": [
        {"op": "generate", "prompts": [P1]}, {"op": "totals"}]})
    assert again[0][0] == {"tokens": baseline[0], "cached": P1_HIT}
    assert again[1]["disk_loaded_chunks"] == 3 and again[1]["load_errors"] == 0


def test_a_full_disk_costs_writes_never_requests(tiny_model, tmp_path, baseline):
    """The engine's process may not write files of a chunk's size (RLIMIT_FSIZE: EFBIG,
    as from a full disk): every request is answered, nothing lands on disk, one warning;
    once the limit is lifted, writes resume."""
    disk = tmp_path / "kv"
    extra = {"memory_capacity": "4MiB", "disk_path": str(disk)}
    res = run_engine(tmp_path / "a", {"model": tiny_model, "connector": extra, "steps": [
        {"op": "flush"},  # the start-up scan has run
        {"op": "file_size_limit", "bytes": 200 << 10},
        {"op": "generate", "prompts": [P1, P2]}, {"op": "flush"}, {"op": "disk_stats"},
        {"op": "file_size_limit", "bytes": None}, {"op": "sleep", "seconds": 2.5},
        {"op": "generate", "prompts": [P3]}, {"op": "flush"}, {"op": "disk_stats"},
        {"op": "generate", "prompts": [P1]}]})
    assert [o["tokens"] for o in res[2]] == baseline[:2]
    assert res[4]["full"] >= 1 and res[4]["puts"] == 0
    assert res[7][0]["tokens"] == baseline[2]
    assert res[9]["puts"] >= 3  # writes resumed
    assert res[10][0]["tokens"] == baseline[0] and res[10][0]["cached"] == P1_HIT
    log = (tmp_path / "a" / "engine.log").read_text()
    assert log.count("cannot write chunk files") == 1


def test_an_engine_killed_while_writing_leaves_no_bad_file(tiny_model, tmp_path, baseline):
    """kill -9 an engine while its disk tier writes; an engine started on the same
    directory answers as vLLM alone, loading what survived, and every file verifies."""
    disk = tmp_path / "kv"
    extra = {"memory_capacity": "2MiB", "disk_path": str(disk)}
    many = [prompt(100 + i, 1100) for i in range(40)]
    spec_dir = tmp_path / "killed"
    spec_dir.mkdir()
    import json

    (spec_dir / "spec.json").write_text(json.dumps({
        "model": tiny_model, "connector": extra,
        "steps": [{"op": "generate", "prompts": many, "max_tokens": 1}]}))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "engine_runner.py"),
                             str(spec_dir / "spec.json"), str(spec_dir / "out.json")],
                            env=engine_env(spec_dir), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(chunk_files(disk)) < 12 and time.monotonic() < deadline:
        assert proc.poll() is None, "the engine ended before it wrote 12 files"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(chunk_files(disk))
    assert written >= 12
    res = run_engine(tmp_path / "b", {"model": tiny_model, "connector": extra, "steps": [
        {"op": "generate", "prompts": [P1, many[0], many[1]]}, {"op": "disk_stats"},
        {"op": "totals"}]})
    assert res[0][0]["tokens"] == baseline[0]
    assert res[0][1]["cached"] == 4 * CHUNK and res[2]["disk_loaded_chunks"] >= 4
    assert res[1]["corrupt"] == {}
    for f in chunk_files(disk):  # every file under a final name is whole
        verify(f)


def test_blocks_of_a_failed_load_never_reach_another_request(tiny_model, tmp_path):
    """A request alone in the engine reads its hit from disk before its step's forward;
    vLLM caches those blocks when it hands them out, and the second chunk's file is
    damaged. Under "recompute" vLLM keeps the unfilled blocks cached for that request to
    recompute. Another request with the same prompt must not read them: not after the
    first was aborted before recomputing, not while a prefill capped by
    ``long_prefill_token_threshold`` recomputes them a little at a time, and not when it
    arrived in the same step and shares them (it waits a step)."""
    rng = random.Random(31)
    base = [[rng.randrange(4, 400) for _ in range(1024)] for _ in range(4)]
    tails = [[[rng.randrange(4, 400) for _ in range(40)] for _ in range(2)] for _ in base]
    first, second = ([b + t[i] for b, t in zip(base, tails, strict=True)] for i in (0, 1))
    alone = run_engine(tmp_path / "alone", {
        "model": tiny_model, "connector": None, "max_model_len": 2048,
        "steps": [{"op": "generate", "prompts": first + second}]})
    want = [r["tokens"] for r in alone[0]]
    disk = tmp_path / "kv"
    extra = {"memory_capacity": "16MiB", "disk_path": str(disk)}
    written = run_engine(tmp_path / "write", {
        "model": tiny_model, "connector": extra, "max_model_len": 2048, "steps": [
            {"op": "generate", "prompts": base}, {"op": "flush"},
            {"op": "disk_paths", "prompts": base}]})
    for files in written[2]:
        damaged = bytearray(Path(files[1]).read_bytes())
        damaged[HEAD_BYTES + 4096] ^= 0x01
        Path(files[1]).write_bytes(bytes(damaged))

    def engine(name: str, llm: dict, steps: list[dict]) -> list:
        return run_engine(tmp_path / name, {
            "model": tiny_model, "connector": extra, "prefix_caching": True,
            "kv_cache_bytes": 6 << 20, "max_model_len": 2048, "llm": llm,
            "steps": [{"op": "noise_kv"}, *steps, {"op": "totals"}]})

    plain = engine("plain", {}, [
        {"op": "arrivals", "first": first[0], "abort": True, "later": second[0]},
        {"op": "arrivals", "first": first[1], "with_first": second[1], "abort": True}])
    assert plain[1] == {"later": {"tokens": want[4], "cached": CHUNK}}
    assert plain[2]["with_first"]["tokens"] == want[5]
    capped = engine("capped", {"max_num_batched_tokens": 512,
                               "long_prefill_token_threshold": 64}, [
        {"op": "arrivals", "first": first[2], "later": second[2]},
        {"op": "arrivals", "first": first[3], "with_first": second[3]}])
    assert capped[1]["first"]["tokens"] == want[2] and capped[1]["later"]["tokens"] == want[6]
    assert capped[2]["first"]["tokens"] == want[3]
    assert capped[2]["with_first"]["tokens"] == want[7]
    for res in (plain, capped):
        assert res[-1]["load_errors"] == 2, res[-1]  # one damaged chunk per first request
