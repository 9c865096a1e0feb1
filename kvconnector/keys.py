"""Chunk keys: a hash chain over token ids, bound to what defines the stored bytes.

blake2b over explicit little-endian bytes, so every process on every host computes the
same keys with no seed (Python's ``hash()`` would need a shared PYTHONHASHSEED).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

import msgpack

# Part of every key: a new stored format gets new keys, so engines of two versions sharing
# a Redis never read, and delete, each other's values. 2: XXH3-64 in store/codec.py; 3: a
# partial chunk stores the bytes of its filled blocks only (store/tiering.py SlotBytes).
FORMAT_VERSION = 3
HASH_BYTES = 16
PARTIAL_PERSON = b"kvc-partial"


@dataclass(frozen=True)
class Fingerprint:
    """Everything that decides the bytes of a stored chunk except its tokens."""

    model: str
    revision: str
    model_config_digest: str
    dtype: str
    kv_layout: str  # "chunk" (the LMCache layout), "mla", or "cpu-pages-<isa>"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    chunk_size: int
    namespace: str
    format_version: int = FORMAT_VERSION
    # What else changes the KV of the same model path (issue 21): the weights' bytes
    # (sampled, compat.weights_digest), the dtype the model runs in, the KV cache dtype
    # vLLM was asked for (fp8 variants share one storage dtype), quantization and the
    # load format ("dummy" weights are random).
    weights: str = ""
    model_dtype: str = ""
    cache_dtype: str = ""
    quantization: str = ""
    load_format: str = ""

    def digest(self) -> bytes:
        packed = msgpack.packb(sorted(asdict(self).items()), use_bin_type=True)
        return hashlib.blake2b(packed, digest_size=HASH_BYTES).digest()


class ChunkKey(NamedTuple):
    """One rank's stored chunk: the fingerprint, the rank and the chained token hash. A
    tuple, not a dataclass: a hit makes and compares several per chunk, at half the cost."""

    fingerprint: bytes
    tp_rank: int
    chunk_hash: bytes

    def __str__(self) -> str:
        return f"{self.fingerprint.hex()}:{self.tp_rank}:{self.chunk_hash.hex()}"


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 (struct: several times faster than numpy from a
    Python list, which is what vLLM's requests hold)."""
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def chunk_hashes(token_ids: Sequence[int], chunk_size: int, seed: bytes) -> list[bytes]:
    """Chained hashes of each full chunk of ``token_ids``; chunk i depends on chunks 0..i."""
    n_full = len(token_ids) // chunk_size
    if n_full == 0:
        return []
    tokens = token_bytes(token_ids[: n_full * chunk_size])
    width = chunk_size * 8
    out: list[bytes] = []
    prev = seed
    for i in range(n_full):
        h = hashlib.blake2b(prev, digest_size=HASH_BYTES)
        h.update(tokens[i * width:(i + 1) * width])
        prev = h.digest()
        out.append(prev)
    return out


def partial_chunk_hash(prev: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a chunk's first blocks only (the trailing part of a prompt or answer that
    does not fill a chunk): chained from the previous full chunk's hash like a full chunk,
    but personalised, so it never equals a full chunk's hash, whatever its tokens."""
    h = hashlib.blake2b(prev, digest_size=HASH_BYTES, person=PARTIAL_PERSON)
    h.update(token_bytes(token_ids))
    return h.digest()


def partial_chunk_hashes(prev: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """``partial_chunk_hash`` of the first 1, 2, ... whole blocks of ``token_ids``, in one
    pass: blake2b streams, so the hash of k blocks continues the state of k - 1. A lookup
    asks for every length a chunk could have (15 with 16-token blocks); hashed one by one
    they cost more than the full chunks."""
    h = hashlib.blake2b(prev, digest_size=HASH_BYTES, person=PARTIAL_PERSON)
    data = token_bytes(token_ids)
    width = block_size * 8
    out: list[bytes] = []
    for k in range(len(token_ids) // block_size):
        h.update(data[k * width:(k + 1) * width])
        out.append(h.digest())  # digest() leaves the state as it was
    return out


def request_seed(fingerprint: bytes, cache_salt: str | None) -> bytes:
    """The chain's start: requests with different salts never share chunks."""
    if not cache_salt:
        return fingerprint
    return hashlib.blake2b(fingerprint + b"salt:" + cache_salt.encode(),
                           digest_size=HASH_BYTES).digest()


def reset_seed(fingerprint: bytes, nonce: bytes) -> bytes:
    """The chain's start after a cache reset: no chunk stored before it is found again."""
    return hashlib.blake2b(fingerprint + b"reset:" + nonce, digest_size=HASH_BYTES).digest()
