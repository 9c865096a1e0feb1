"""Synthetic KV tensors in every layout family vLLM ships, for layout and kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM 0.32 KVCacheLayout: physical order of the logical [L, B, H, N, C] axes.
V032_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
FAMILIES = [f"v032-{o}" for o in V032_ORDERS] + ["old-NHD", "old-HND", "B2NHD", "mla",
                                                  "cpu-pages"]


@dataclass
class Case:
    family: str
    layers: list[torch.Tensor]
    describe_kw: dict


def _fill(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if t.dtype == torch.uint8:
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    else:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
    return t


def make_case(family: str, *, num_layers: int = 2, num_blocks: int = 12, block_size: int = 16,
              heads: int = 2, head_size: int = 8, latent: int = 24,
              dtype: torch.dtype = torch.float32, seed: int = 0,
              device: str = "cpu") -> Case:
    """Layer tensors filled with random values, plus the ``describe`` arguments for them."""
    gen = torch.Generator().manual_seed(seed)
    L, B, N, H, D = num_layers, num_blocks, block_size, heads, head_size
    kw: dict = {"num_kv_heads": H, "head_size": D}
    if family.startswith("v032-") or family == "cpu-pages":
        order = V032_ORDERS[family.removeprefix("v032-")] if family != "cpu-pages" else (
            0, 1, 2, 3, 4)
        logical = (L, B, H, N, 2 * D)
        phys = torch.empty([logical[i] for i in order], dtype=dtype)
        _fill(phys, gen)
        inverse = [order.index(i) for i in range(5)]
        full = phys.permute(*inverse)  # logical [L, B, H, N, 2D] view
        layers = [full[li] for li in range(L)]
        kw["cpu_pages"] = family == "cpu-pages"
    elif family == "old-NHD":
        layers = [_fill(torch.empty(2, B, N, H, D, dtype=dtype), gen) for _ in range(L)]
    elif family == "old-HND":
        layers = [_fill(torch.empty(2, B, H, N, D, dtype=dtype), gen) for _ in range(L)]
        kw["heads_before_tokens"] = True
    elif family == "B2NHD":
        layers = [_fill(torch.empty(B, 2, N, H, D, dtype=dtype), gen) for _ in range(L)]
    elif family == "mla":
        layers = [_fill(torch.empty(B, N, latent, dtype=dtype), gen) for _ in range(L)]
        kw["mla"] = True
    else:
        raise ValueError(family)
    return Case(family, [t.to(device) for t in layers], kw)


def logical_kv(case: Case, layer: int, block: int, token: int) -> torch.Tensor:
    """The K|V (or latent / page) values of one token, read straight off the raw tensor."""
    t = case.layers[layer]
    f = case.family
    if f == "mla":
        return t[block, token]
    if f == "cpu-pages":
        return t[block]  # the whole block's pages: opaque
    if f.startswith("v032-"):
        return t[block, :, token, :]  # [H, 2D]
    if f == "old-NHD":
        return torch.cat([t[0, block, token], t[1, block, token]], dim=-1)
    if f == "old-HND":
        return torch.cat([t[0, block, :, token], t[1, block, :, token]], dim=-1)
    if f == "B2NHD":
        return torch.cat([t[block, 0, token], t[block, 1, token]], dim=-1)
    raise ValueError(f)
