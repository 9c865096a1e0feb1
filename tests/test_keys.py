from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from kvconnector.keys import (
    ChunkKey,
    Fingerprint,
    chunk_hashes,
    partial_chunk_hash,
    partial_chunk_hashes,
    request_seed,
)

FP = Fingerprint(model="m", revision="", model_config_digest="abc", dtype="float32",
                 kv_layout="chunk", block_size=16, num_layers=2, num_kv_heads=2,
                 head_size=32, tp_size=1, chunk_size=256, namespace="")
TOKENS = list(range(1000))


def test_chain_is_prefix_stable_and_diverges_after_a_change():
    a = chunk_hashes(TOKENS, 256, FP.digest())
    assert len(a) == 3  # the trailing partial chunk is never keyed
    changed = TOKENS[:300] + [7] + TOKENS[301:]
    b = chunk_hashes(changed, 256, FP.digest())
    assert a[0] == b[0]
    assert a[1] != b[1] and a[2] != b[2]  # chunk 2 depends on chunk 1 through the chain
    assert chunk_hashes(TOKENS[:512], 256, FP.digest()) == a[:2]


def test_keys_are_identical_in_other_processes_whatever_the_hash_seed():
    code = ("from kvconnector.keys import chunk_hashes; from tests.test_keys import FP, TOKENS;"
            "print(','.join(h.hex() for h in chunk_hashes(TOKENS, 256, FP.digest())))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=root, env={**os.environ, "PYTHONHASHSEED": seed,
                                                      "PYTHONPATH": root}).stdout.strip()
            for seed in ("1", "2", "random")}
    local = ",".join(h.hex() for h in chunk_hashes(TOKENS, 256, FP.digest()))
    assert outs == {local}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Fingerprint)])
def test_every_fingerprint_field_changes_the_keys(field):
    value = getattr(FP, field)
    other = value + 1 if isinstance(value, int) else value + "x"
    changed = dataclasses.replace(FP, **{field: other})
    assert changed.digest() != FP.digest()
    assert chunk_hashes(TOKENS, 256, changed.digest())[0] != chunk_hashes(TOKENS, 256,
                                                                          FP.digest())[0]


def test_rank_and_salt_separate_keys():
    h = chunk_hashes(TOKENS, 256, FP.digest())[0]
    assert str(ChunkKey(FP.digest(), 0, h)) != str(ChunkKey(FP.digest(), 1, h))
    assert request_seed(FP.digest(), None) == FP.digest()
    salted = request_seed(FP.digest(), "tenant-a")
    assert salted not in (FP.digest(), request_seed(FP.digest(), "tenant-b"))


def test_every_field_that_changes_the_kv_changes_the_fingerprint():
    """Issue 21: engines of one model path that differ in weights, dtype, KV cache dtype,
    quantization or load format compute other KV, so they must not share keys."""
    changed = {"weights": "0123456789abcdef", "model_dtype": "bfloat16",
               "cache_dtype": "fp8_e5m2", "quantization": "awq", "load_format": "dummy",
               "revision": "v2", "namespace": "other"}
    digests = {FP.digest()} | {dataclasses.replace(FP, **{k: v}).digest()
                               for k, v in changed.items()}
    assert len(digests) == len(changed) + 1


def test_weights_digest_reads_the_weights(tmp_path):
    from kvconnector.compat import weights_digest

    assert weights_digest(str(tmp_path / "absent")) == ""
    f = tmp_path / "model.safetensors"
    data = bytearray(os.urandom(1 << 20))
    f.write_bytes(data)
    (tmp_path / "config.json").write_text("{}")  # not a weight file
    first = weights_digest(str(tmp_path))
    assert first and weights_digest(str(tmp_path)) == first
    data[(len(data) - 4096) * 15 // 31 + 7] ^= 1  # a byte in a sampled read
    f.write_bytes(data)
    assert weights_digest(str(tmp_path)) != first
    assert weights_digest(str(f)) == weights_digest(str(tmp_path))  # a GGUF-style file path


def test_partial_hashes_in_one_pass_equal_each_hashed_alone():
    """A stored partial chunk's key must not depend on how the lookup computed it."""
    tokens = list(range(1000, 1000 + 16 * 15 + 7))  # 15 whole blocks and a part of one
    prev = b"p" * 16
    one_pass = partial_chunk_hashes(prev, tokens, 16)
    assert one_pass == [partial_chunk_hash(prev, tokens[:16 * k]) for k in range(1, 16)]
    assert len(set(one_pass)) == 15
    assert partial_chunk_hashes(prev, tokens[:15], 16) == []


def test_a_request_asked_for_its_longest_partial_first_keys_the_shorter_ones_alike():
    """The lookup asks for the longest partial chunk first and caches the shorter ones the
    same pass hashed: each must be the key a save of that many blocks would store."""
    from types import SimpleNamespace

    from kvconnector.request_state import RequestState

    tokens = list(range(5000, 5000 + 64 + 16 * 3))  # one full 64-token chunk, 3 blocks more
    st = RequestState(SimpleNamespace(all_token_ids=tokens), b"s" * 16, None)
    prev = chunk_hashes(tokens, 64, b"s" * 16)[0]
    assert st.partial_hash(1, 3, 64, 16) == partial_chunk_hash(prev, tokens[64:112])
    for k in (2, 1):
        assert st.partial_hash(1, k, 64, 16) == partial_chunk_hash(prev, tokens[64:64 + 16 * k])
