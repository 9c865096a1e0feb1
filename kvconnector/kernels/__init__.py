"""Paged blocks <-> chunk copies. ``reference`` is plain torch and is the ground truth.

``gather``/``scatter`` here pick the implementation: the Triton kernels in ``triton_copy``
when every tensor is on CUDA, the reference otherwise. ``triton_copy`` (and so Triton) is
imported only the first time CUDA tensors arrive, so CPU-only installs never need Triton.
``kernel_block_ids`` turns scheduler block ids into the kernel block ids all of them take.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvconnector.kernels import reference
from kvconnector.layout import LayerLayout

__all__ = ["gather", "kernel_block_ids", "scatter"]


def kernel_block_ids(block_ids: Sequence[int], ratio: int) -> list[int]:
    """Scheduler block ids -> kernel block ids, ``ratio`` kernel blocks per scheduler block
    (the attention backend may page in smaller blocks); -1 stays -1, once per kernel block."""
    if ratio == 1:
        return list(block_ids)
    return [b * ratio + i if b >= 0 else -1 for b in block_ids for i in range(ratio)]


def _on_cuda(layers: Sequence[torch.Tensor], chunks: torch.Tensor) -> bool:
    return chunks.is_cuda and len(layers) > 0 and all(t.is_cuda for t in layers)


def gather(layers: Sequence[torch.Tensor], layout: LayerLayout, block_ids: torch.Tensor,
           chunks: torch.Tensor) -> None:
    """Copy blocks ``block_ids`` of every layer into ``chunks`` (zeros where an id is -1)."""
    if _on_cuda(layers, chunks):
        from kvconnector.kernels import triton_copy

        triton_copy.gather(layers, layout, block_ids, chunks)
    else:
        reference.gather(layers, layout, block_ids, chunks)


def scatter(chunks: torch.Tensor, layout: LayerLayout, block_ids: torch.Tensor,
            layers: Sequence[torch.Tensor]) -> None:
    """Copy ``chunks`` into blocks ``block_ids`` of every layer (ids of -1 are left alone)."""
    if _on_cuda(layers, chunks):
        from kvconnector.kernels import triton_copy

        triton_copy.scatter(chunks, layout, block_ids, layers)
    else:
        reference.scatter(chunks, layout, block_ids, layers)
