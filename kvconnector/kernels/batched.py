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
from dataclasses import dataclass

import torch

from kvconnector import threads
from kvconnector.layout import LayerLayout

# Waking the helper on the other core cost 0.3-0.4 ms a load here (tiny-model loads of
# 0.5-2 MiB got that much slower). In the engine a load's pages are out of cache and copy
# at 3-4 GB/s: a tiny-model 16000-token hit's 7.75 MiB took 2.10-2.19 ms on one thread,
# 1.50-1.87 ms with the helper (docs/benchmarks.md section 26).
HELPER_MIN_BYTES = 6 << 20
# Views of one-slot runs made ahead (PagedCopier.prepare), about 0.3 KiB each; where a cache
# or a pool would need more than this many, they are made per copy.
MAX_VIEWS = 1 << 16
# A pool's pages and, if made, the views of one-slot runs: paged[count - 1][block] and
# chunk[slot][(first, count)].
RunViews = tuple[torch.Tensor, list[list[torch.Tensor]] | None,
                 list[dict[tuple[int, int], torch.Tensor]] | None]


@dataclass(frozen=True)
class Run:
    """Kernel blocks ``first .. first + count - 1`` of the chunks in ``slots`` consecutive
    slots from ``slot`` <-> ``slots * count`` consecutive blocks of every layer from
    ``block``."""

    slot: int
    first: int
    block: int
    count: int
    slots: int = 1


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
            end = j + 1
            while end < n and ids[end] == b + end - j:
                end += 1
            prev = out[-1] if out else None
            if (prev is not None and prev.first == j and prev.count == end - j
                    and slot == prev.slot + prev.slots
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
        # Views of every one-slot run, for the pool last copied to or from (the same pool
        # each step): vLLM hands out blocks in descending order once its cache has cycled, so
        # every block is a run of its own, and building two views a run cost a tiny model's
        # 1k hit about as much as its copy. One assignment: the threads that copy share it.
        self._run_views: tuple[torch.Tensor | None, RunViews | None] = (None, None)
        self._helper: ThreadPoolExecutor | None = None
        if helper_cores and torch.get_num_threads() == 1:
            self._helper = threads.pool("kvconnector-load-helper", set(helper_cores))

    def _pairs(self, pool: torch.Tensor, runs: Sequence[Run]
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._pages is not None:
            views = self._pool_views(pool)
            if views is not None:
                return self._page_pairs(views, runs)
        k, _, n, h, d = self.layout.sizes
        paged: list[torch.Tensor] = []
        chunk: list[torch.Tensor] = []
        stacks = [self._stack] if self._stack is not None else [v[None] for v in self._views]
        for li, stack in enumerate(stacks):
            layers = stack.shape[0]
            lo = li if self._stack is None else 0
            for r in runs:
                m, c = r.slots, r.count
                paged.append(stack[:, :, r.block:r.block + m * c].view(layers, k, m, c, n, h, d))
                src = pool[r.slot:r.slot + m, lo:lo + layers, :, r.first * n:(r.first + c) * n]
                chunk.append(src.view(m, layers, k, c, n, h, d).permute(1, 2, 0, 3, 4, 5, 6))
        return paged, chunk

    def prepare(self, pool: torch.Tensor) -> None:
        """Make the views of ``pool``'s runs now (start-up), not in a step's first copy."""
        if self._pages is not None:
            self._pool_views(pool)

    def _pool_views(self, pool: torch.Tensor) -> RunViews | None:
        """``pool`` as pages, with the views of its one-slot runs where they are few
        enough; None where its pages do not fit ``_pages``."""
        cached_pool, views = self._run_views
        if cached_pool is pool:
            return views
        assert self._pages is not None
        pages = _slot_pages(pool, self._pages)
        views = None
        if pages is not None:
            slots, _, per_chunk, _ = pages.shape
            blocks = self._pages.shape[1]
            paged = chunk = None
            if blocks * per_chunk <= MAX_VIEWS and slots * per_chunk ** 2 <= MAX_VIEWS:
                paged = [[self._pages[:, b:b + c] for b in range(blocks)]
                         for c in range(1, per_chunk + 1)]
                chunk = [{(f, c): pages[s, :, f:f + c] for f in range(per_chunk)
                          for c in range(1, per_chunk - f + 1)} for s in range(slots)]
            views = (pages, paged, chunk)
        self._run_views = (pool, views)
        return views

    def _page_pairs(self, views: RunViews, runs: Sequence[Run]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``_pairs`` for whole pages: views of rank 3 or 4 instead of 7, those of one-slot
        runs made ahead where there are some."""
        assert self._pages is not None
        layers = self._pages.shape[0]
        pool, made_paged, made_chunk = views
        paged: list[torch.Tensor] = []
        chunk: list[torch.Tensor] = []
        for r in runs:
            m, c = r.slots, r.count
            if m == 1 and made_paged is not None and made_chunk is not None:
                paged.append(made_paged[c - 1][r.block])
                chunk.append(made_chunk[r.slot][(r.first, c)])
            elif m == 1:
                paged.append(self._pages[:, r.block:r.block + c])
                chunk.append(pool[r.slot, :, r.first:r.first + c])
            else:
                paged.append(self._pages[:, r.block:r.block + m * c].view(layers, m, c, -1))
                chunk.append(pool[r.slot:r.slot + m, :, r.first:r.first + c].transpose(0, 1))
        return paged, chunk

    def _check(self, pool: torch.Tensor, runs: Sequence[Run]) -> None:
        blocks = self.layout.num_blocks
        for r in runs:
            last = r.block + r.slots * r.count - 1
            if not (0 <= r.block and last < blocks):
                raise IndexError(f"blocks {r.block}..{last} outside the {blocks} kernel "
                                 "blocks of the KV cache")
            if not (0 <= r.slot and r.slot + r.slots <= pool.shape[0]):
                raise IndexError(f"slots {r.slot}..{r.slot + r.slots - 1} outside the pool")

    def scatter(self, pool: torch.Tensor, runs: Sequence[Run]) -> None:
        """Chunk bytes -> paged blocks (half of the layers on the helper, if there is one
        and the load is big enough to repay handing it over)."""
        self._check(pool, runs)
        paged, chunk = self._pairs(pool, runs)
        if self._helper is None or self._bytes(pool, runs) < HELPER_MIN_BYTES:
            _copy_all(paged, chunk)
            return
        (dst_a, dst_b), (src_a, src_b) = _halves(paged), _halves(chunk)
        other = self._helper.submit(_copy_all, dst_b, src_b)
        try:
            _copy_all(dst_a, src_a)
        finally:
            other.result()  # its error, if any, is the load's

    def _bytes(self, pool: torch.Tensor, runs: Sequence[Run]) -> int:
        """Bytes the runs move: a slot's bytes per kernel block, all layers."""
        blocks_per_slot = pool.shape[3] // self.layout.sizes[2]
        per_block = pool[0].numel() * pool.element_size() // blocks_per_slot
        return per_block * sum(r.slots * r.count for r in runs)

    def layer_scatter(self, pool: torch.Tensor, runs: Sequence[Run]
                      ) -> Callable[[int, int], None]:
        """``scatter`` a few layers at a time, on the calling thread: the function returned
        copies layers ``first``..``last - 1`` of every run."""
        self._check(pool, runs)
        paged, chunk = self._pairs(pool, runs)
        n = len(self.layers)

        def copy(first: int, last: int) -> None:
            _copy_all(_layers(paged, first, last, n), _layers(chunk, first, last, n))
        return copy

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=False)

    def gather(self, pool: torch.Tensor, runs: Sequence[Run]) -> None:
        """Paged blocks -> chunk bytes (blocks of the chunks not in a run are untouched)."""
        self._check(pool, runs)
        paged, chunk = self._pairs(pool, runs)
        _copy_all(chunk, paged)


def _halves(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The copies split in two by layer: per-layer views by list, stacked ones by dim 0."""
    if len(tensors) > 1 and all(t.shape[0] == 1 for t in tensors):
        mid = len(tensors) // 2
        return tensors[:mid], tensors[mid:]
    return ([t[:t.shape[0] // 2] for t in tensors if t.shape[0] > 1],
            [t[t.shape[0] // 2:] for t in tensors])


def _layers(tensors: list[torch.Tensor], first: int, last: int,
            num_layers: int) -> list[torch.Tensor]:
    """Layers ``first``..``last - 1`` of the copies: per-layer views (layer-major, a run
    each) by list, stacked ones by dim 0."""
    if num_layers > 1 and all(t.shape[0] == 1 for t in tensors):
        per = len(tensors) // num_layers
        return tensors[first * per:last * per]
    return [t[first:last] for t in tensors]


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
        return
    for a, b in zip(dst, src, strict=True):
        a.copy_(b)
