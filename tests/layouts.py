"""KV tensors for the layout and kernel tests, laid out by the installed vLLM's own code.

``vllm_layers`` runs what a vLLM worker runs: ``get_kv_cache_config_from_groups`` places the
layers for a ``KVCacheLayout`` and ``allocate_kv_cache`` returns the per-layer views that
vLLM hands to ``register_kv_caches``. A change to vLLM's layouts therefore fails these
tests. The GPU machine has no vLLM: there ``mirror_layers`` builds the same geometry, and
test_layout checks it against vLLM wherever vLLM is installed.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

# vLLM's KVCacheLayout members: physical order of the logical [L, B, H, N, C] axes.
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
FAMILIES = [f"kv-{o}" for o in ORDERS] + ["mla-LBHNC", "mla-BLNHC", "cpu-pages"]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass
class Case:
    family: str
    layers: list[torch.Tensor]
    describe_kw: dict


@functools.cache
def _vllm_config(order: str) -> Any:
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.cache_config.kv_cache_layout = order
    return config


def vllm_layers(spec: Any, order: str, num_layers: int, num_blocks: int,
                kernel_block_size: int | None = None) -> list[torch.Tensor]:
    """The views a vLLM worker registers for ``num_layers`` layers of ``spec``."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    config = _vllm_config(order)
    config.cache_config.num_gpu_blocks_override = num_blocks
    names = [f"model.layers.{i}.attn" for i in range(num_layers)]
    kv_cache_config = get_kv_cache_config_from_groups(
        config, [KVCacheGroupSpec(names, spec)], available_memory=1 << 40)
    kernel = [kernel_block_size] if kernel_block_size else None
    views = allocate_kv_cache(kv_cache_config, torch.device("cpu"),
                              config.cache_config.get_resolved_kv_cache_layout(), kernel)
    return [views[n] for n in names]


def mirror_layers(order: str, logical: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """vLLM's placement rule without vLLM: one buffer in ``order``, a [B, H, N, C] view per
    layer of the logical [L, B, H, N, C]."""
    perm = ORDERS[order]
    phys = torch.empty([logical[i] for i in perm], dtype=dtype)
    full = phys.permute(*[perm.index(i) for i in range(5)])
    return [full[i] for i in range(logical[0])]


def _spec(kind: str, block_size: int, heads: int, head_size: int, latent: int,
          dtype: torch.dtype) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if kind == "mla":
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=latent,
                                dtype=dtype)
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                             dtype=dtype)


def fill(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if t.dtype == torch.uint8:
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    else:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
    return t


def fresh_like(layers: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    """A second cache with the same placement (one buffer, same views), random values."""
    raw = torch.empty(layers[0].untyped_storage().nbytes(), dtype=torch.uint8,
                      device=layers[0].device)
    return [fill(torch.as_strided(raw.view(t.dtype), t.shape, t.stride(), t.storage_offset()),
                 gen) for t in layers]


def make_case(family: str, *, num_layers: int = 2, num_blocks: int = 12, block_size: int = 16,
              heads: int = 2, head_size: int = 8, latent: int = 24,
              dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu",
              use_vllm: bool = HAVE_VLLM) -> Case:
    """Layer tensors of one family, filled with random values, and ``describe``'s arguments
    for them. ``cpu-pages`` is the CPU backend's LBHNC cache, moved as whole pages."""
    kind, _, order = family.partition("-")
    if family == "cpu-pages":
        kind, order = "cpu", "LBHNC"
    mla = kind == "mla"
    h, c = (1, latent) if mla else (heads, 2 * head_size)
    if use_vllm:
        spec = _spec(kind, block_size, heads, head_size, latent, dtype)
        layers = vllm_layers(spec, order, num_layers, num_blocks)
    else:
        layers = mirror_layers(order, (num_layers, num_blocks, h, block_size, c), dtype)
    gen = torch.Generator().manual_seed(seed)
    for t in layers:
        fill(t, gen)
    kw = {"num_kv_heads": h, "head_size": latent if mla else head_size, "mla": mla,
          "cpu_pages": kind == "cpu"}
    return Case(family, [t.to(device) for t in layers], kw)


def logical_kv(case: Case, layer: int, block: int, token: int) -> torch.Tensor:
    """What vLLM's attention reads for one token: per head K then V (FlashAttention splits
    the last dim at head_size), the MLA latent, or the whole opaque CPU block."""
    t = case.layers[layer]
    if case.describe_kw["cpu_pages"]:
        return t[block]
    return t[block, :, token, :]
