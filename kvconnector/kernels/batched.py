"""A whole step's chunks between pool slots and paged KV on the host, in one pass.

The step's chunks become runs of consecutive kernel blocks (a fresh request's blocks mostly
are consecutive), and each run is one contiguous copy per layer, or one strided copy for all
layers when the layers are evenly spaced views of one allocation (vLLM's CPU cache). Measured
on CPU pages (docs/benchmarks.md): the per-chunk advanced-indexing scatter of ``reference``
was ~3x slower than one ``index_copy_`` per layer, which is itself slower than these copies.
``reference`` stays the ground truth the tests compare against.

A load runs on the forward's thread while the forward waits. Where vLLM's CPU worker
computes on one thread, half of a load's layers are copied on a helper thread on a core it
left spare (the one it reserves for its engine-core process and KV transfers): a 90 MiB
load took 6.8 ms instead of 11.8 on the 2-core machine of docs/benchmarks.md, with a process
spinning on that core as vLLM's engine core does. A small load stays on one thread: handing
it over costs more than it saves. With more compute threads, torch already spreads each copy
over them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvconnector import threads
from kvconnector.layout import LayerLayout

# Waking the helper on the other core cost 0.3-0.4 ms a load here (tiny-model loads of
# 0.5-2 MiB got that much slower); a copy of 16 MiB takes ~1.3 ms on one thread.
HELPER_MIN_BYTES = 16 << 20


@dataclass(frozen=True)
class Run:
    """Kernel blocks ``first .. first + count - 1`` of the chunks in ``slots`` consecutive
    slots from ``slot`` <-> ``slots * count`` consecutive blocks of every layer from
    ``block``; with ``step`` -1 (one slot), the chunk's blocks sit in kernel blocks
    ``block, block - 1, ..., block - count + 1``: vLLM hands out freed blocks in
    descending order."""

    slot: int
    first: int
    block: int
    count: int
    slots: int = 1
    step: int = 1

    @property
    def lowest(self) -> int:
        return self.block if self.step == 1 else self.block - self.count + 1

    def ascending(self) -> list[Run]:
        """The run as runs of step 1: itself, or one a block."""
        if self.step == 1:
            return [self]
        return [Run(self.slot, self.first + k, self.block - k, 1) for k in range(self.count)]


def block_runs(chunks: Iterable[tuple[int, Sequence[int]]]) -> list[Run]:
    """Runs of ``(slot, kernel block ids of its chunk)``; ids of -1 are skipped. Chunks in
    consecutive slots with consecutive blocks (a request stored and loaded whole, in an
    unfragmented pool and cache) merge into one run."""
    out: list[Run] = []
    for slot, ids in chunks:
        j, n = 0, len(ids)
        while j < n:
            b = ids[j]
            if b < 0:
                j += 1
                continue
            step = -1 if j + 1 < n and ids[j + 1] == b - 1 else 1
            end = j + 1
            while end < n and ids[end] == b + step * (end - j):
                end += 1
            prev = out[-1] if out else None
            if step == -1:
                out.append(Run(slot, j, b, end - j, step=-1))
            elif (prev is not None and prev.step == 1 and prev.first == j
                  and prev.count == end - j and slot == prev.slot + prev.slots
                  and b == prev.block + prev.slots * prev.count):
                out[-1] = Run(prev.slot, j, prev.block, prev.count, prev.slots + 1)
            else:
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


def _pages(stack: torch.Tensor | None, layout: LayerLayout) -> torch.Tensor | None:
    """CPU pages of all layers as ``[L, blocks, page]`` (a layer's block is one run of
    ``page`` elements), if ``stack`` holds them so; else None."""
    if stack is None or layout.family != "cpu-pages":
        return None
    layers, k, blocks, n, h, d = stack.shape
    if k != 1 or n != 1 or stack.stride(5) != 1 or stack.stride(4) != d:
        return None
    return torch.as_strided(stack, (layers, blocks, h * d), (stack.stride(0), stack.stride(2), 1),
                            stack.storage_offset())


def _slot_pages(pool: torch.Tensor, pages: torch.Tensor) -> torch.Tensor | None:
    """The pool ``[slots, L, 1, blocks per chunk, H, D]`` as ``[slots, L, blocks per chunk,
    page]``, if it is contiguous (so the view writes into it); else None."""
    if (not pool.is_contiguous() or pool.dim() != 6 or pool.shape[1] != pages.shape[0]
            or pool.shape[2] != 1 or pool.shape[4] * pool.shape[5] != pages.shape[2]):
        return None
    return pool.view(pool.shape[0], pool.shape[1], -1, pages.shape[2])


class PagedCopier:
    """Copies runs between a pool ``[slots, L, K, tokens, H, D]`` and host KV layers."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: LayerLayout,
                 helper_cores: set[int] | frozenset[int] = frozenset()) -> None:
        self.layout = layout
        self.layers = list(layers)
        self._stack = _stacked(self.layers, layout)
        self._pages = _pages(self._stack, layout)
        self._views = [layout.view(t) for t in self.layers]
        self._helper: ThreadPoolExecutor | None = None
        if helper_cores and torch.get_num_threads() == 1:
            self._helper = threads.pool("kvconnector-load-helper", set(helper_cores))

    def _pairs(self, pool: torch.Tensor, runs: Sequence[Run]) -> Copies:
        if self._pages is not None:
            pages = _slot_pages(pool, self._pages)
            if pages is not None:
                return self._page_pairs(pages, runs)
        k, _, n, h, d = self.layout.sizes
        out = Copies()
        stacks = [self._stack] if self._stack is not None else [v[None] for v in self._views]
        for li, stack in enumerate(stacks):
            layers = stack.shape[0]
            lo = li if self._stack is None else 0
            for r in (a for run in runs for a in run.ascending()):
                m, c = r.slots, r.count
                src = pool[r.slot:r.slot + m, lo:lo + layers, :, r.first * n:(r.first + c) * n]
                out.add(stack[:, :, r.block:r.block + m * c].view(layers, k, m, c, n, h, d),
                        src.view(m, layers, k, c, n, h, d).permute(1, 2, 0, 3, 4, 5, 6))
        return out

    def _page_pairs(self, pool: torch.Tensor, runs: Sequence[Run]) -> Copies:
        """``_pairs`` for whole pages: views of rank 3 or 4 instead of 7, and a descending
        run as one reversed pair (copied block by block, a 16000-token tiny-model load
        took 5.9 ms against 0.7 ms in ascending blocks)."""
        assert self._pages is not None
        layers = self._pages.shape[0]
        out = Copies()
        for r in runs:
            m, c = r.slots, r.count
            dst = self._pages[:, r.lowest:r.lowest + m * c]
            if r.step == -1:
                out.add(dst, pool[r.slot, :, r.first:r.first + c], flipped=True)
            elif m == 1:
                out.add(dst, pool[r.slot, :, r.first:r.first + c])
            else:
                out.add(dst.view(layers, m, c, -1),
                        pool[r.slot:r.slot + m, :, r.first:r.first + c].transpose(0, 1))
        return out

    def _check(self, pool: torch.Tensor, runs: Sequence[Run]) -> None:
        blocks = self.layout.num_blocks
        for r in runs:
            last = r.lowest + r.slots * r.count - 1
            if not (0 <= r.lowest and last < blocks):
                raise IndexError(f"blocks {r.lowest}..{last} outside the {blocks} kernel "
                                 "blocks of the KV cache")
            if not (0 <= r.slot and r.slot + r.slots <= pool.shape[0]):
                raise IndexError(f"slots {r.slot}..{r.slot + r.slots - 1} outside the pool")

    def scatter(self, pool: torch.Tensor, runs: Sequence[Run]) -> None:
        """Chunk bytes -> paged blocks (half of the layers on the helper, if there is one
        and the load is big enough to repay handing it over)."""
        self._check(pool, runs)
        copies = self._pairs(pool, runs)
        if self._helper is None or copies.chunk_bytes() < HELPER_MIN_BYTES:
            copies.to_paged()
            return
        mine, theirs = copies.halves()
        other = self._helper.submit(theirs.to_paged)
        try:
            mine.to_paged()
        finally:
            other.result()  # its error, if any, is the load's

    def layer_scatter(self, pool: torch.Tensor, runs: Sequence[Run]
                      ) -> Callable[[int, int], None]:
        """``scatter`` a few layers at a time, on the calling thread: the function returned
        copies layers ``first``..``last - 1`` of every run."""
        self._check(pool, runs)
        copies = self._pairs(pool, runs)
        n = len(self.layers)

        def copy(first: int, last: int) -> None:
            copies.layers(first, last, n).to_paged()
        return copy

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=False)

    def gather(self, pool: torch.Tensor, runs: Sequence[Run]) -> None:
        """Paged blocks -> chunk bytes (blocks of the chunks not in a run are untouched)."""
        self._check(pool, runs)
        self._pairs(pool, runs).to_chunk()


@dataclass
class Copies:
    """Pairs of views between vLLM's KV (``paged``) and pool slots (``chunk``). A pair in
    ``flipped`` holds its blocks in opposite orders on the two sides (dim 1): it is copied
    from a reversed copy of its source, made at copy time (a layer load fills the slots
    after the pairs are built)."""

    paged: list[torch.Tensor] = field(default_factory=list)
    chunk: list[torch.Tensor] = field(default_factory=list)
    flipped: list[bool] = field(default_factory=list)

    def add(self, paged: torch.Tensor, chunk: torch.Tensor, flipped: bool = False) -> None:
        self.paged.append(paged)
        self.chunk.append(chunk)
        self.flipped.append(flipped)

    def chunk_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.chunk)

    def to_paged(self) -> None:
        _copy_all(self.paged, self.chunk, self.flipped)

    def to_chunk(self) -> None:
        _copy_all(self.chunk, self.paged, self.flipped)

    def _select(self, keep: Callable[[torch.Tensor], torch.Tensor | None]) -> Copies:
        out = Copies()
        for p, c, f in zip(self.paged, self.chunk, self.flipped, strict=True):
            pp, cc = keep(p), keep(c)
            if pp is not None and cc is not None:
                out.add(pp, cc, f)
        return out

    def _per_layer(self) -> bool:
        """Per-layer views (one list entry per layer and run), not stacked ones."""
        return len(self.paged) > 1 and all(t.shape[0] == 1 for t in self.paged)

    def halves(self) -> tuple[Copies, Copies]:
        """The copies split in two by layer: per-layer views by list, stacked ones by dim 0."""
        if self._per_layer():
            mid = len(self.paged) // 2
            return (Copies(self.paged[:mid], self.chunk[:mid], self.flipped[:mid]),
                    Copies(self.paged[mid:], self.chunk[mid:], self.flipped[mid:]))
        return (self._select(lambda t: t[:t.shape[0] // 2] if t.shape[0] > 1 else None),
                self._select(lambda t: t[t.shape[0] // 2:]))

    def layers(self, first: int, last: int, num_layers: int) -> Copies:
        """Layers ``first``..``last - 1``: per-layer views (layer-major, a run each) by
        list, stacked ones by dim 0."""
        if num_layers > 1 and self._per_layer():
            per = len(self.paged) // num_layers
            sl = slice(first * per, last * per)
            return Copies(self.paged[sl], self.chunk[sl], self.flipped[sl])
        return self._select(lambda t: t[first:last])


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], flipped: list[bool]) -> None:
    if any(flipped):
        for d, s, f in zip(dst, src, flipped, strict=True):
            if f:
                d.copy_(s.flip(1))
        dst = [d for d, f in zip(dst, flipped, strict=True) if not f]
        src = [s for s, f in zip(src, flipped, strict=True) if not f]
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
        return
    for a, b in zip(dst, src, strict=True):
        a.copy_(b)
