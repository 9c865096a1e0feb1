"""A prompt is ``segment (separator segment)*``; every segment but the last is a document.

A document is stored under a key of its own tokens (and the fingerprint and cache salt,
through the request seed), so it hits wherever it appears. Its KV is split into pieces of
``chunk_size - 1`` tokens, one memory slot each: the slot's last token row holds a small
header with the positions the piece was computed at, so a reader can re-rotate it.
Keys are blake2b with their own personalisation, so they never equal a prefix-chain key.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvconnector.keys import HASH_BYTES

_DOC_PERSON = b"kvc-blend-doc"
_PIECE_PERSON = b"kvc-blend-piece"


@dataclass(frozen=True)
class Document:
    """Tokens ``[start, end)`` of the prompt, stored under ``doc_hash`` in ``pieces``."""

    start: int
    end: int
    doc_hash: bytes
    pieces: tuple[bytes, ...]  # one key hash per piece, in order

    @property
    def length(self) -> int:
        return self.end - self.start


def find_segments(tokens: Sequence[int], separator: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each segment between separators (separators excluded); one
    segment (the whole prompt) when there is no separator."""
    sep = list(separator)
    m, n = len(sep), len(tokens)
    segments, seg_start, i = [], 0, 0
    first = sep[0]
    while i <= n - m:
        if tokens[i] == first and list(tokens[i:i + m]) == sep:
            segments.append((seg_start, i))
            i += m
            seg_start = i
        else:
            i += 1
    segments.append((seg_start, n))
    return segments


def piece_capacity(chunk_size: int) -> int:
    """Tokens per piece: one slot's token rows minus the header row."""
    return chunk_size - 1


def separator_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as it stands inside prompts: encoded alone, without special tokens, less
    the trailing whitespace tokens, which inside a prompt join the next word (byte-level
    BPE encodes " # # " alone as "Ġ#", "Ġ#", "Ġ" and in a prompt as "Ġ#", "Ġ#", "ĠWord")."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    while len(ids) > 1 and not tokenizer.decode(ids[-1:]).strip():
        ids.pop()
    return ids


def documents(tokens: Sequence[int], separator: Sequence[int], seed: bytes,
              chunk_size: int) -> list[Document]:
    """The prompt's documents (every non-empty segment but the last), with their keys."""
    segments = find_segments(tokens, separator)
    cap = piece_capacity(chunk_size)
    out = []
    for start, end in segments[:-1]:
        if end <= start:
            continue
        doc_hash = hashlib.blake2b(
            np.asarray(tokens[start:end], dtype="<i8").tobytes(), key=seed[:64],
            digest_size=HASH_BYTES, person=_DOC_PERSON).digest()
        n_pieces = -(-(end - start) // cap)
        out.append(Document(start, end, doc_hash, tuple(
            piece_hash(doc_hash, i) for i in range(n_pieces))))
    return out


def piece_hash(doc_hash: bytes, index: int) -> bytes:
    return hashlib.blake2b(doc_hash + index.to_bytes(4, "little"), digest_size=HASH_BYTES,
                           person=_PIECE_PERSON).digest()


_HEADER = struct.Struct("<8sHHIq16s")  # magic, version, 0, tokens, position, doc hash
_MAGIC = b"KVCBLEND"
_VERSION = 1
HEADER_BYTES = _HEADER.size


class PieceHeaderError(ValueError):
    """A slot's piece header does not describe the piece that was asked for."""


@dataclass(frozen=True)
class PieceHeader:
    tokens: int  # tokens held (the piece's first ``tokens`` rows)
    position: int  # the position of its first token when it was computed
    doc_hash: bytes

    def pack(self) -> bytes:
        return _HEADER.pack(_MAGIC, _VERSION, 0, self.tokens, self.position, self.doc_hash)

    @classmethod
    def unpack(cls, raw: bytes) -> PieceHeader:
        magic, version, _, tokens, position, doc_hash = _HEADER.unpack(raw[:HEADER_BYTES])
        if magic != _MAGIC or version != _VERSION:
            raise PieceHeaderError(f"not a blend piece (magic {magic!r}, version {version})")
        return cls(tokens, position, doc_hash)


def piece_view(slot: torch.Tensor, num_layers: int, num_kv_heads: int, head_size: int,
               chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A memory slot seen as a piece: ``[layers, 2, capacity, H, D]`` of KV, and the bytes
    of the header row after it."""
    cap = piece_capacity(chunk_size)
    n_data = num_layers * 2 * cap * num_kv_heads * head_size
    flat = slot.reshape(-1)
    if flat.numel() != num_layers * 2 * chunk_size * num_kv_heads * head_size:
        raise ValueError(f"a slot of {flat.numel()} elements is not {chunk_size} tokens of "
                         f"{num_layers} layers x 2 x {num_kv_heads} x {head_size}")
    data = flat[:n_data].view(num_layers, 2, cap, num_kv_heads, head_size)
    return data, flat[n_data:].view(torch.uint8)[:HEADER_BYTES]
