"""What one registered KV tensor looks like, read from its shape and strides.

Every layout vLLM ships is described as a strided view ``[K, blocks, n, H, D]``:
- "kv": K=2 (key, value), n tokens per kernel block, H KV heads, D head size;
- "mla": K=1, H=1, D = latent width (one latent per token, no separate V);
- "cpu-pages": K=1, n=1, D = one whole (block, head) page, moved as opaque bytes because
  the CPU attention kernels pack K per instruction set.
A chunk of one layer is then ``[K, blocks_per_chunk * n, H, D]``; for "kv" that is the
LMCache layout ``[2, chunk_tokens, H, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LayoutError(ValueError):
    """A KV tensor's shape or strides match no layout kvconnector knows."""


@dataclass(frozen=True)
class LayerLayout:
    family: str  # "kv" | "mla" | "cpu-pages"
    dtype: torch.dtype
    num_blocks: int  # kernel blocks
    kernel_block_size: int  # tokens per kernel block
    sizes: tuple[int, int, int, int, int]  # [K, blocks, n, H, D]
    strides: tuple[int, int, int, int, int]  # elements, same order

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.as_strided(tensor, self.sizes, self.strides, tensor.storage_offset())

    def chunk_shape(self, kernel_blocks_per_chunk: int) -> tuple[int, int, int, int]:
        k, _, n, h, d = self.sizes
        return (k, kernel_blocks_per_chunk * n, h, d)

    def check_chunks(self, chunks: torch.Tensor, num_layers: int,
                     block_ids: torch.Tensor) -> None:
        """A chunk buffer must be ``[num_chunks, layers, K, tokens, H, D]`` of the KV dtype."""
        c, bpc = block_ids.shape
        k, _, n, h, d = self.sizes
        want = (c, num_layers, k, bpc * n, h, d)
        if tuple(chunks.shape) != want:
            raise ValueError(f"chunk buffer has shape {tuple(chunks.shape)}, expected {want}")
        if chunks.dtype != self.dtype:
            raise ValueError(f"chunk buffer dtype {chunks.dtype} != KV dtype {self.dtype}")

    def same_geometry(self, other: LayerLayout) -> bool:
        return (self.family, self.dtype, self.kernel_block_size, self.sizes[0], self.sizes[2:]) == (
            other.family, other.dtype, other.kernel_block_size, other.sizes[0], other.sizes[2:])


def describe(tensor: torch.Tensor, *, num_kv_heads: int, head_size: int,
             cpu_pages: bool = False, mla: bool = False,
             heads_before_tokens: bool | None = None) -> LayerLayout:
    """Describe one layer's KV tensor.

    ``heads_before_tokens`` settles the older 5D layouts when block size equals the head
    count (NHD and HND have the same shape then); vLLM's backend stride order gives it.
    """
    shape, st = tuple(tensor.shape), tuple(tensor.stride())
    where = f"KV tensor of shape {shape}, strides {st}, dtype {tensor.dtype}"
    if mla:
        if len(shape) != 3:
            raise LayoutError(f"{where}: MLA expects [num_blocks, block_size, latent]")
        b, n, d = shape
        return LayerLayout("mla", tensor.dtype, b, n, (1, b, n, 1, d), (0, st[0], st[1], 0, st[2]))
    if len(shape) == 4:
        b, h, n, d2 = shape
        if h != num_kv_heads or d2 != 2 * head_size:
            raise LayoutError(
                f"{where}: expected [num_blocks, {num_kv_heads} heads, block_size, "
                f"2*{head_size}]")
        if cpu_pages:
            page = n * d2
            if st[3] != 1 or st[2] != d2:
                raise LayoutError(f"{where}: CPU pages must be contiguous within a (block, head)")
            return LayerLayout("cpu-pages", tensor.dtype, b, n, (1, b, 1, h, page),
                               (0, st[0], 0, st[1], 1))
        # vLLM >= 0.32: the last dim holds K then V of one token and head.
        return LayerLayout("kv", tensor.dtype, b, n, (2, b, n, h, head_size),
                           (head_size * st[3], st[0], st[2], st[1], st[3]))
    if len(shape) == 5:
        if shape[0] == 2 and shape[1] != 2:
            kv, blk, x, y = 0, 1, 2, 3  # [2, B, ., ., D]
        elif shape[1] == 2:
            kv, blk, x, y = 1, 0, 2, 3  # [B, 2, N, H, D]
        else:
            raise LayoutError(f"{where}: no K/V dimension of size 2 in front")
        if shape[4] != head_size:
            raise LayoutError(f"{where}: last dim should be head_size={head_size}")
        xs, ys = shape[x], shape[y]
        if heads_before_tokens is None:
            if xs == num_kv_heads and ys != num_kv_heads:
                heads_before_tokens = True
            elif ys == num_kv_heads and xs != num_kv_heads:
                heads_before_tokens = False
            elif xs == ys == num_kv_heads:
                raise LayoutError(
                    f"{where}: block size equals the head count ({xs}), so NHD and HND "
                    "cannot be told apart by shape; pass heads_before_tokens")
            else:
                raise LayoutError(f"{where}: no dimension matches num_kv_heads={num_kv_heads}")
        h_dim, n_dim = (x, y) if heads_before_tokens else (y, x)
        if shape[h_dim] != num_kv_heads:
            raise LayoutError(f"{where}: heads dim has {shape[h_dim]}, expected {num_kv_heads}")
        b, n = shape[blk], shape[n_dim]
        return LayerLayout("kv", tensor.dtype, b, n, (2, b, n, num_kv_heads, head_size),
                           (st[kv], st[blk], st[n_dim], st[h_dim], st[4]))
    raise LayoutError(f"{where}: expected a 3D (MLA), 4D or 5D KV tensor")


def describe_layers(kv_caches: dict[str, torch.Tensor], **kw) -> LayerLayout:
    """One layout for all layers (kvconnector moves every layer of a chunk in one plan)."""
    if not kv_caches:
        raise LayoutError("no KV cache tensors were registered")
    layouts = {name: describe(t, **kw) for name, t in kv_caches.items()}
    first_name, first = next(iter(layouts.items()))
    for name, lay in layouts.items():
        if not lay.same_geometry(first) or lay.num_blocks != first.num_blocks:
            raise LayoutError(
                f"layer {name} has layout {lay} but {first_name} has {first}; kvconnector "
                "needs every layer in one KV cache group to share a layout")
    return first
