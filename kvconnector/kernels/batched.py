"""A whole step's chunks between pool slots and paged KV on the host, in one pass.

The step's chunks become runs of consecutive kernel blocks (a fresh request's blocks mostly
are consecutive), and each run is one contiguous copy per layer, or one strided copy for all
layers when the layers are evenly spaced views of one allocation (vLLM's CPU cache). Measured
on CPU pages (docs/benchmarks.md): the per-chunk advanced-indexing scatter of ``reference``
was ~3x slower than one ``index_copy_`` per layer, which is itself slower than these copies.
``reference`` stays the ground truth the tests compare against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvconnector.layout import LayerLayout


@dataclass(frozen=True)
class Run:
    """``count`` kernel blocks from ``first`` on in the chunk of ``slot`` <-> blocks
    ``block`` to ``block + count - 1`` of every layer."""

    slot: int
    first: int
    block: int
    count: int


def block_runs(chunks: Iterable[tuple[int, Sequence[int]]]) -> list[Run]:
    """Runs of ``(slot, kernel block ids of its chunk)``; ids of -1 are skipped."""
    out: list[Run] = []
    for slot, ids in chunks:
        j, n = 0, len(ids)
        while j < n:
            b = ids[j]
            if b < 0:
                j += 1
                continue
            end = j + 1
            while end < n and ids[end] == b + end - j:
                end += 1
            out.append(Run(slot, j, b, end - j))
            j = end
    return out


def _stacked(layers: Sequence[torch.Tensor], layout: LayerLayout) -> torch.Tensor | None:
    """All layers as one ``[L, K, blocks, n, H, D]`` view, if they are evenly spaced views of
    one storage with the same strides; else None."""
    first = layers[0]
    if len(layers) < 2:
        return layout.view(first)[None]
    step = layers[1].data_ptr() - first.data_ptr()
    item = first.element_size()
    if step <= 0 or step % item:
        return None
    for i, t in enumerate(layers):
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.data_ptr() != first.data_ptr() + i * step or t.stride() != first.stride()):
            return None
    return torch.as_strided(first, (len(layers), *layout.sizes), (step // item, *layout.strides),
                            first.storage_offset())


class PagedCopier:
    """Copies runs between a pool ``[slots, L, K, tokens, H, D]`` and host KV layers."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: LayerLayout) -> None:
        self.layout = layout
        self.layers = list(layers)
        self._stack = _stacked(self.layers, layout)
        self._views = [layout.view(t) for t in self.layers]

    def _pairs(self, pool: torch.Tensor, runs: Sequence[Run]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        k, _, n, h, d = self.layout.sizes
        paged: list[torch.Tensor] = []
        chunk: list[torch.Tensor] = []
        if self._stack is not None:
            layers = len(self.layers)
            for r in runs:
                paged.append(self._stack[:, :, r.block:r.block + r.count])
                chunk.append(pool[r.slot, :, :, r.first * n:(r.first + r.count) * n]
                             .view(layers, k, r.count, n, h, d))
            return paged, chunk
        for li, view in enumerate(self._views):
            for r in runs:
                paged.append(view[:, r.block:r.block + r.count])
                chunk.append(pool[r.slot, li, :, r.first * n:(r.first + r.count) * n]
                             .view(k, r.count, n, h, d))
        return paged, chunk

    def _check(self, pool: torch.Tensor, runs: Sequence[Run]) -> None:
        blocks = self.layout.num_blocks
        for r in runs:
            if not (0 <= r.block and r.block + r.count <= blocks):
                raise IndexError(f"blocks {r.block}..{r.block + r.count - 1} outside the "
                                 f"{blocks} kernel blocks of the KV cache")
            if not 0 <= r.slot < pool.shape[0]:
                raise IndexError(f"slot {r.slot} outside the pool")

    def scatter(self, pool: torch.Tensor, runs: Sequence[Run]) -> None:
        """Chunk bytes -> paged blocks."""
        self._check(pool, runs)
        paged, chunk = self._pairs(pool, runs)
        _copy_all(paged, chunk)

    def gather(self, pool: torch.Tensor, runs: Sequence[Run]) -> None:
        """Paged blocks -> chunk bytes (blocks of the chunks not in a run are untouched)."""
        self._check(pool, runs)
        paged, chunk = self._pairs(pool, runs)
        _copy_all(chunk, paged)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
        return
    for a, b in zip(dst, src, strict=True):
        a.copy_(b)
