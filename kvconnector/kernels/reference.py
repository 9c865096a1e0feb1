"""Plain-torch gather/scatter between paged KV tensors and chunks.

``block_ids`` is an int64 tensor ``[num_chunks, kernel_blocks_per_chunk]`` of kernel block
ids; -1 marks a block to skip (zeros on gather, untouched on scatter). Chunks are
``[num_chunks, num_layers, K, tokens, H, D]`` (see ``layout.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvconnector.layout import LayerLayout


def _check(layers: Sequence[torch.Tensor], layout: LayerLayout, block_ids: torch.Tensor,
           chunks: torch.Tensor) -> None:
    layout.check_chunks(chunks, len(layers), block_ids)
    if block_ids.numel() and int(block_ids.max()) >= layout.num_blocks:
        raise IndexError(f"block id {int(block_ids.max())} >= num_blocks {layout.num_blocks}")


def gather(layers: Sequence[torch.Tensor], layout: LayerLayout, block_ids: torch.Tensor,
           chunks: torch.Tensor) -> None:
    _check(layers, layout, block_ids, chunks)
    c, bpc = block_ids.shape
    k, _, n, h, d = layout.sizes
    flat = block_ids.reshape(-1).to(torch.long)
    valid = flat >= 0
    idx = flat.clamp(min=0).to(layers[0].device)
    for li, tensor in enumerate(layers):
        rows = layout.view(tensor)[:, idx]  # [K, C*bpc, n, H, D]
        if not bool(valid.all()):
            rows[:, ~valid.to(rows.device)] = 0
        rows = rows.reshape(k, c, bpc * n, h, d).transpose(0, 1)
        chunks[:, li].copy_(rows)


def scatter(chunks: torch.Tensor, layout: LayerLayout, block_ids: torch.Tensor,
            layers: Sequence[torch.Tensor]) -> None:
    _check(layers, layout, block_ids, chunks)
    c, bpc = block_ids.shape
    k, _, n, h, d = layout.sizes
    flat = block_ids.reshape(-1).to(torch.long)
    keep = (flat >= 0).nonzero().squeeze(1)
    if keep.numel() == 0:
        return
    idx = flat[keep].to(layers[0].device)
    for li, tensor in enumerate(layers):
        src = chunks[:, li].to(tensor.device).reshape(c, k, bpc, n, h, d)
        src = src.transpose(0, 1).reshape(k, c * bpc, n, h, d)[:, keep.to(src.device)]
        layout.view(tensor)[:, idx] = src
