"""Token-granular K/V of whole blocks of one layer, on every layout blend runs on.

``read`` gives ``[2, tokens, heads, head_size]`` (K then V, tokens in block order) and
``write`` takes the same. GPU layouts are strided views (``layout.py``) and need nothing
more. The CPU backend packs K (and V) inside each (block, head) page in an order that
depends on the instruction set; ``probe_cpu_packing`` learns that order once at start-up by
writing numbered probe values through vLLM's own cache-write kernel, so no ISA is
hard-coded here. Reads unpack by that order; writes go through the kernel itself (16x
faster than scattering by the order: 0.36 against 5.9 ms for 5k tokens of SmolLM2's layer
in bf16), which is also how vLLM's forward writes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvconnector.kernels import kernel_block_ids
from kvconnector.layout import LayerLayout

#: ``write(key [T, H, D], value [T, H, D], kv_cache [B, H, block, 2D], slot_mapping [T])``
KVWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class PackingError(RuntimeError):
    """The CPU kernel's page packing is not a plain reordering of the tokens' values."""


@dataclass(frozen=True)
class CpuPacking:
    """Where element (token, dim) of K and of V lives inside one head's page half, and the
    kernel that writes tokens so."""

    k_inverse: torch.Tensor  # [block*D]: token * D + dim -> page offset
    v_inverse: torch.Tensor
    write: KVWriter


def probe_cpu_packing(write: KVWriter, dtype: torch.dtype, block_size: int, num_heads: int,
                      head_size: int) -> CpuPacking:
    """Learn the packing by writing each element's index, one base-16 digit per pass (small
    integers are exact in every float dtype), into a scratch page."""
    n = block_size * head_size
    index = torch.arange(n).view(block_size, head_size)
    passes = max(1, math.ceil(math.log(n, 16)))
    page = torch.empty((1, num_heads, block_size, 2 * head_size), dtype=dtype)
    slots = torch.arange(block_size, dtype=torch.long)
    code = torch.zeros((num_heads, 2 * n), dtype=torch.long)
    for d in range(passes):
        page.fill_(-1)
        digit = ((index // 16 ** d) % 16).to(dtype)
        src = digit[:, None, :].expand(block_size, num_heads, head_size).contiguous()
        write(src, src, page, slots)
        got = page.reshape(num_heads, 2 * n).to(torch.long)
        if bool((got < 0).any()):
            raise PackingError("the CPU attention kernel leaves parts of a KV page unwritten")
        code += got * 16 ** d
    if not bool((code == code[0]).all()):
        raise PackingError("the CPU attention kernel packs each head's page differently")
    k_code, v_code = code[0, :n], code[0, n:]
    want = torch.arange(n)
    for name, c in (("K", k_code), ("V", v_code)):
        if not torch.equal(torch.sort(c).values, want):
            raise PackingError(f"the CPU attention kernel's {name} packing is not a "
                               "reordering of one block's tokens")
    return CpuPacking(torch.argsort(k_code), torch.argsort(v_code), write)


class TokenPages:
    def __init__(self, layers: Sequence[torch.Tensor], layout: LayerLayout,
                 block_size: int, num_kv_heads: int, head_size: int,
                 packing: CpuPacking | None = None) -> None:
        if layout.family == "mla":
            raise PackingError("MLA caches hold one latent per token, not K and V per head")
        if layout.family == "cpu-pages" and packing is None:
            raise PackingError("CPU pages need the kernel's packing (probe_cpu_packing)")
        self.layers = list(layers)
        self.layout = layout
        self.n = layout.kernel_block_size
        self.ratio = block_size // self.n
        self.heads, self.head_size = num_kv_heads, head_size
        self.packing = packing
        self.device = self.layers[0].device

    def kernel_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(kernel_block_ids(block_ids, self.ratio), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.layout.num_blocks):
            raise IndexError(f"block ids {block_ids} outside the KV cache")
        return ids.to(self.device)

    def read(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """K/V of kernel blocks ``ids``: ``[2, len(ids) * n, H, D]``."""
        view = self.layout.view(self.layers[layer])
        h, d = self.heads, self.head_size
        if self.packing is None:
            return view[:, ids].reshape(2, -1, h, d)
        p = self.packing
        pages = view[0, ids, 0]  # [B, H, 2 * n * D]
        half = self.n * d
        k = pages[..., :half].index_select(-1, p.k_inverse.to(pages.device))
        v = pages[..., half:].index_select(-1, p.v_inverse.to(pages.device))
        kv = torch.stack([k, v]).view(2, -1, h, self.n, d)
        return kv.transpose(2, 3).reshape(2, -1, h, d)

    def write(self, layer: int, ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Overwrite every token of kernel blocks ``ids`` with ``kv`` ``[2, len(ids)*n, H, D]``."""
        view = self.layout.view(self.layers[layer])
        h, d, n = self.heads, self.head_size, self.n
        if tuple(kv.shape) != (2, ids.numel() * n, h, d):
            raise ValueError(f"K/V of shape {tuple(kv.shape)} for {ids.numel()} blocks")
        kv = kv.to(view.dtype)
        if self.packing is None:
            view[:, ids] = kv.reshape(2, -1, n, h, d)
            return
        slots = (ids[:, None] * n + torch.arange(n, device=ids.device)[None]).reshape(-1)
        self.packing.write(kv[0].contiguous(), kv[1].contiguous(), self.layers[layer], slots)
