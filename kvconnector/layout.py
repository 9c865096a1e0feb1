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
             cpu_pages: bool = False, mla: bool = False) -> LayerLayout:
    """Describe one layer's KV tensor: vLLM (0.32 on) registers every layer as a 4D view
    ``[blocks, H, N, C]`` whose strides follow its ``KVCacheLayout``. For attention C is K
    then V of one token and head (2 * head_size); for MLA H is 1 and C the latent."""
    shape, st = tuple(tensor.shape), tuple(tensor.stride())
    where = f"KV tensor of shape {shape}, strides {st}, dtype {tensor.dtype}"
    if len(shape) != 4:
        raise LayoutError(f"{where}: expected the 4D [num_blocks, heads, block_size, content] "
                          "view vLLM registers")
    b, h, n, c = shape
    if mla:
        if h != 1 or c != head_size:
            raise LayoutError(f"{where}: MLA expects [num_blocks, 1, block_size, {head_size}]")
        return LayerLayout("mla", tensor.dtype, b, n, (1, b, n, 1, c), (0, st[0], st[2], 0, st[3]))
    if h != num_kv_heads or c != 2 * head_size:
        raise LayoutError(f"{where}: expected [num_blocks, {num_kv_heads} heads, block_size, "
                          f"2*{head_size}]")
    if cpu_pages:
        if st[3] != 1 or st[2] != c:
            raise LayoutError(f"{where}: CPU pages must be contiguous within a (block, head)")
        return LayerLayout("cpu-pages", tensor.dtype, b, n, (1, b, 1, h, n * c),
                           (0, st[0], 0, st[1], 1))
    return LayerLayout("kv", tensor.dtype, b, n, (2, b, n, h, head_size),
                       (head_size * st[3], st[0], st[2], st[1], st[3]))


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
