"""Triton gather/scatter between paged KV tensors and chunks, for every layout at once.

Same signatures and results as ``reference``. One kernel serves every layout family: the
layout's five element strides are kernel arguments and the layers are reached through a
device table of their base addresses, so one launch moves a whole batch of chunks for all
layers. Program (block, layer*K + k, tile) copies one ``[rows, cols]`` tile of the
``[n*H, D]`` slab of one kernel block; in the chunk that slab is contiguous.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvconnector.layout import LayerLayout

# Decided when the kernel is defined, like Triton itself does.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                         "float8_e5m2fnuz") if hasattr(torch, n))
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8) + _FP8
# The kernel moves bits, so it sees every dtype as the integer type of the same width:
# bit-exact (NaN payloads, -0.0) and no fp8/bf16 support needed from the compiler.
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_TILE_BYTES = 16384
_MAX_GRID_YZ = 65535


@triton.jit
def _copy_kernel(addrs_ptr, chunk_ptr, ids_ptr, num_blocks, bpc,
                 s_k, s_b, s_n, s_h, s_d,
                 LK: tl.constexpr, K: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
                 D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 D_TILES: tl.constexpr, ALIGN: tl.constexpr, GATHER: tl.constexpr):
    pid_blk = tl.program_id(0).to(tl.int64)  # chunk * bpc + block within chunk
    pid_lk = tl.program_id(1)  # layer * K + k
    pid_t = tl.program_id(2)  # (row tile, col tile)
    layer = pid_lk // K
    k = (pid_lk % K).to(tl.int64)

    bid = tl.load(ids_ptr + pid_blk)
    # Out-of-range ids are rejected by the launcher; masking them too keeps a bad id
    # from ever turning into a wild address.
    valid = (bid >= 0) & (bid < num_blocks)
    bid = tl.where(valid, bid, 0)

    base = tl.load(addrs_ptr + layer).to(tl.pointer_type(chunk_ptr.dtype.element_ty))
    if ALIGN > 1:
        base = tl.multiple_of(base, ALIGN)  # bytes; without it KV accesses stay scalar
    kv = base + k * s_k + bid * s_b
    c = pid_blk // bpc
    j = pid_blk % bpc
    ch = chunk_ptr + ((c * LK + pid_lk) * bpc + j) * (N * H * D)

    rows = (pid_t // D_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid_t % D_TILES) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok = (rows // H).to(tl.int64)
    head = (rows % H).to(tl.int64)
    kv_off = (tok * s_n + head * s_h)[:, None] + cols.to(tl.int64)[None, :] * s_d
    ch_off = rows[:, None] * D + cols[None, :]
    col_ok = (cols < D)[None, :]
    in_tile = (rows < N * H)[:, None] & col_ok
    # A skipped block has no rows. An int limit, not `mask & valid`: the CPU interpreter
    # cannot combine a scalar mask with a tensor one.
    in_block = (rows < tl.where(valid, N * H, 0))[:, None] & col_ok

    if GATHER:
        x = tl.load(kv + kv_off, mask=in_block, other=0)  # -1 blocks read as zeros
        tl.store(ch + ch_off, x, mask=in_tile)
    else:
        x = tl.load(ch + ch_off, mask=in_block)
        tl.store(kv + kv_off, x, mask=in_block)  # -1 blocks stay untouched


_addr_cache: dict[tuple, tuple[torch.Tensor, int]] = {}


def _layer_addresses(layers: Sequence[torch.Tensor], device: torch.device
                     ) -> tuple[torch.Tensor, int]:
    ptrs = tuple(t.data_ptr() for t in layers)  # data_ptr includes the storage offset
    key = (device, ptrs)
    hit = _addr_cache.get(key)
    if hit is None:
        if len(_addr_cache) > 64:
            _addr_cache.clear()
        align = 16 if all(p % 16 == 0 for p in ptrs) else 1
        hit = (torch.tensor(ptrs, dtype=torch.int64).to(device), align)
        _addr_cache[key] = hit
    return hit


def _extent(sizes: Sequence[int], strides: Sequence[int]) -> int:
    return sum((s - 1) * abs(st) for s, st in zip(sizes, strides, strict=True) if s > 0)


def _check(layers: Sequence[torch.Tensor], layout: LayerLayout, block_ids: torch.Tensor,
           chunks: torch.Tensor) -> torch.Tensor:
    """Validate everything the kernel relies on; return block ids on the chunk device."""
    if not isinstance(chunks, torch.Tensor) or not isinstance(block_ids, torch.Tensor):
        raise TypeError("chunks and block_ids must be torch tensors")
    if len(layers) == 0:
        raise ValueError("no KV layers given")
    dev = chunks.device
    if dev.type == "cpu" and not _INTERPRETED:
        raise ValueError("triton_copy needs CUDA tensors (CPU tensors only run with "
                         "TRITON_INTERPRET=1 set before import); use kvconnector.kernels, "
                         "which sends CPU tensors to the reference")
    if layout.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"KV dtype {layout.dtype} is not supported; supported: "
                        f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if block_ids.dim() != 2 or block_ids.dtype != torch.int64:
        raise ValueError(f"block_ids must be int64 [num_chunks, kernel_blocks_per_chunk], got "
                         f"{block_ids.dtype} of shape {tuple(block_ids.shape)}")
    if block_ids.device not in (dev, torch.device("cpu")):
        raise ValueError(f"block_ids are on {block_ids.device}; expected cpu or {dev}")
    layout.check_chunks(chunks, len(layers), block_ids)
    if not chunks.is_contiguous():
        raise ValueError("chunk buffer must be contiguous")
    first = layers[0]
    if _extent(layout.sizes, layout.strides) > _extent(first.shape, first.stride()):
        raise ValueError(f"layout {layout} reaches past the end of KV tensor of shape "
                         f"{tuple(first.shape)}, strides {first.stride()}")
    for i, t in enumerate(layers):
        if t.device != dev:
            raise ValueError(f"layer {i} is on {t.device} but the chunk buffer is on {dev}")
        if t.dtype != layout.dtype:
            raise ValueError(f"layer {i} has dtype {t.dtype}, layout says {layout.dtype}")
        if t.shape != first.shape or t.stride() != first.stride():
            raise ValueError(
                f"layer {i} has shape {tuple(t.shape)}, strides {t.stride()} but layer 0 has "
                f"{tuple(first.shape)}, {first.stride()}; one launch needs one geometry")
    if block_ids.numel() and int(block_ids.max()) >= layout.num_blocks:
        raise IndexError(f"block id {int(block_ids.max())} >= num_blocks {layout.num_blocks}")
    k = layout.sizes[0]
    if len(layers) * k > _MAX_GRID_YZ:
        raise ValueError(f"{len(layers)} layers x K={k} exceeds one launch's grid")
    return block_ids.to(dev, non_blocking=True).contiguous()


def _launch(layers: Sequence[torch.Tensor], layout: LayerLayout, block_ids: torch.Tensor,
            chunks: torch.Tensor, gather: bool) -> None:
    ids = _check(layers, layout, block_ids, chunks)
    if ids.numel() == 0:
        return
    c, bpc = ids.shape
    k, _, n, h, d = layout.sizes
    addrs, align = _layer_addresses(layers, chunks.device)
    if addrs.is_cuda:  # the cached table may be read from several streams
        addrs.record_stream(torch.cuda.current_stream(addrs.device))
    bits = chunks.view(_AS_INT[chunks.element_size()])
    tile = 1 << (max(1, _TILE_BYTES // chunks.element_size()).bit_length() - 1)  # power of 2
    block_d = min(triton.next_power_of_2(d), tile)
    block_r = min(triton.next_power_of_2(n * h), tile // block_d)
    d_tiles = triton.cdiv(d, block_d)
    grid = (c * bpc, len(layers) * k, triton.cdiv(n * h, block_r) * d_tiles)
    _copy_kernel[grid](
        addrs, bits, ids, layout.num_blocks, bpc, *layout.strides,
        LK=len(layers) * k, K=k, N=n, H=h, D=d, BLOCK_R=block_r, BLOCK_D=block_d,
        D_TILES=d_tiles, ALIGN=align, GATHER=gather,
        num_warps=8 if block_r * block_d * chunks.element_size() >= 8192 else 4)


def gather(layers: Sequence[torch.Tensor], layout: LayerLayout, block_ids: torch.Tensor,
           chunks: torch.Tensor) -> None:
    """Copy the blocks ``block_ids`` of every layer into ``chunks`` (zeros for -1 ids)."""
    _launch(layers, layout, block_ids, chunks, gather=True)


def scatter(chunks: torch.Tensor, layout: LayerLayout, block_ids: torch.Tensor,
            layers: Sequence[torch.Tensor]) -> None:
    """Copy ``chunks`` into the blocks ``block_ids`` of every layer (-1 ids are skipped)."""
    _launch(layers, layout, block_ids, chunks, gather=False)
