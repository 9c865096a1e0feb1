"""A step's chunks in one pass (``kernels/batched.py``) must move exactly the bytes the
reference gather/scatter moves, for every layout vLLM ships, and nothing else."""

from __future__ import annotations

import os

import pytest
import torch
from layouts import FAMILIES, make_case

from kvconnector.kernels import reference
from kvconnector.kernels.batched import PagedCopier, Run, block_runs
from kvconnector.layout import describe_layers

BPC = 3  # kernel blocks per chunk
# (slot, kernel block ids): consecutive, reversed, a hole, an all -1 chunk, a split run
CHUNKS = [(4, [0, 1, 2]), (1, [7, 6, 5]), (0, [3, -1, 4]), (2, [-1, -1, -1]), (3, [8, 9, 11])]


def _setup(family: str, dtype: torch.dtype, seed: int = 0):
    case = make_case(family, dtype=dtype, num_blocks=12, seed=seed)
    layout = describe_layers({f"l{i}": t for i, t in enumerate(case.layers)},
                             **case.describe_kw)
    return case.layers, layout


def _pool(layers, layout, slots: int = 5) -> torch.Tensor:
    shape = (slots, len(layers), *layout.chunk_shape(BPC))
    return torch.randn(shape).to(layout.dtype) if layout.dtype.is_floating_point else \
        torch.randint(0, 255, shape, dtype=layout.dtype)


def _ids(chunks) -> torch.Tensor:
    return torch.tensor([ids for _, ids in chunks], dtype=torch.int64)


# Consecutive slots with consecutive blocks: one run for 3 chunks, then a partial chunk.
WHOLE = [(1, [0, 1, 2]), (2, [3, 4, 5]), (3, [6, 7, 8]), (4, [9, 10, -1])]
# Blocks as vLLM hands them out once its cache has cycled (it frees a request's blocks last
# first): descending, across chunks too.
DESCENDING = [(0, [11, 10, 9]), (2, [8, 7, 6]), (1, [5, 4, -1]), (3, [2, 1, 0])]


def test_runs_merge_consecutive_blocks_and_skip_holes():
    assert block_runs(CHUNKS) == [
        Run(4, 0, 0, 3), Run(1, 0, 7, 1), Run(1, 1, 6, 1), Run(1, 2, 5, 1), Run(0, 0, 3, 1),
        Run(0, 2, 4, 1), Run(3, 0, 8, 2), Run(3, 2, 11, 1)]
    assert block_runs(WHOLE) == [Run(1, 0, 0, 3, slots=3), Run(4, 0, 9, 2)]


@pytest.mark.parametrize("chunks", [CHUNKS, WHOLE, DESCENDING],
                         ids=["scattered", "whole", "descending"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_scatter_equals_reference(family, dtype, chunks):
    want, layout = _setup(family, dtype)
    got, _ = _setup(family, dtype)
    pool = _pool(want, layout)
    slots = [s for s, _ in chunks]
    reference.scatter(pool[slots], layout, _ids(chunks), want)
    PagedCopier(got, layout).scatter(pool, block_runs(chunks))
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)  # written blocks equal, untouched blocks untouched


@pytest.mark.parametrize("chunks", [CHUNKS, WHOLE, DESCENDING],
                         ids=["scattered", "whole", "descending"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_gather_equals_reference(family, dtype, chunks):
    layers, layout = _setup(family, dtype)
    chunks = [c for c in chunks if any(b >= 0 for b in c[1])]
    slots = [s for s, _ in chunks]
    want = torch.zeros(len(chunks), len(layers), *layout.chunk_shape(BPC), dtype=dtype)
    reference.gather(layers, layout, _ids(chunks), want)
    pool = torch.zeros(5, len(layers), *layout.chunk_shape(BPC), dtype=dtype)
    PagedCopier(layers, layout).gather(pool, block_runs(chunks))
    assert torch.equal(pool[slots], want)  # -1 blocks stay zero in both


def test_layers_of_one_buffer_move_in_one_copy_per_run():
    layers, layout = _setup("cpu-pages", torch.float32)
    assert PagedCopier(layers, layout)._stack is not None
    assert PagedCopier(layers, layout)._pages is not None  # whole pages: views of rank 3-4
    separate = [t.clone() for t in layers]  # not one buffer: one copy per layer and run
    copier = PagedCopier(separate, layout)
    assert copier._stack is None
    pool = _pool(layers, layout)
    copier.scatter(pool, block_runs(CHUNKS))
    PagedCopier(layers, layout).scatter(pool, block_runs(CHUNKS))
    assert all(torch.equal(a, b) for a, b in zip(layers, separate, strict=True))


@pytest.mark.parametrize("chunks", [CHUNKS, WHOLE, DESCENDING],
                         ids=["scattered", "whole", "descending"])
def test_views_made_ahead_move_each_steps_bytes(monkeypatch, chunks):
    """The copier makes the views of every one-slot run once: later copies over them, with
    other bytes on both sides, still move their own bytes; another pool gets views of its
    own; past ``MAX_VIEWS`` views are made per copy, with the same result."""
    from kvconnector.kernels import batched

    runs = block_runs(chunks)
    chunks = [c for c in chunks if any(b >= 0 for b in c[1])]
    for limit in (batched.MAX_VIEWS, 4):
        monkeypatch.setattr(batched, "MAX_VIEWS", limit)
        layers, layout = _setup("cpu-pages", torch.bfloat16)
        copier = PagedCopier(layers, layout)
        for seed in range(2):
            pool = _pool(layers, layout)  # another pool
            for _ in range(2):  # the same pool, other bytes on both sides
                want, _ = _setup("cpu-pages", torch.bfloat16, seed=seed + 1)
                for t, w in zip(layers, want, strict=True):
                    t.copy_(w)
                pool.copy_(_pool(layers, layout))
                reference.scatter(pool[[s for s, _ in chunks]], layout, _ids(chunks),
                                  want)
                copier.scatter(pool, runs)
                assert all(torch.equal(a, b) for a, b in zip(layers, want, strict=True))
                pooled, views = copier._run_views
                assert pooled is pool and views is not None
                assert (views[1] is not None) == (limit > 12 * BPC)
                back = torch.zeros_like(pool)
                expected = torch.zeros_like(pool[:len(chunks)])
                copier.gather(back, runs)
                reference.gather(layers, layout, _ids(chunks), expected)
                assert torch.equal(back[[s for s, _ in chunks]], expected)


def test_out_of_range_blocks_are_refused():
    layers, layout = _setup("cpu-pages", torch.float32)
    with pytest.raises(IndexError):
        PagedCopier(layers, layout).scatter(_pool(layers, layout), [Run(0, 0, 11, 2)])
    with pytest.raises(IndexError):
        PagedCopier(layers, layout).scatter(_pool(layers, layout), [Run(4, 0, 0, 1, slots=2)])


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("one_buffer", [True, False], ids=["stacked", "separate"])
def test_a_load_split_with_a_helper_thread_moves_the_same_bytes(num_layers, one_buffer,
                                                                monkeypatch):
    """Where the worker computes on one thread, half of a big load's layers go to a helper
    on the cores vLLM left spare; the bytes must be those of the reference, layer for layer.
    A small load stays on the caller's thread."""
    from kvconnector.kernels import batched

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = make_case("cpu-pages", num_layers=num_layers, num_blocks=12)
        want = [t if one_buffer else t.clone() for t in case.layers]
        layout = describe_layers({f"l{i}": t for i, t in enumerate(want)}, **case.describe_kw)
        got = [t.clone() for t in want] if not one_buffer else \
            list(make_case("cpu-pages", num_layers=num_layers, num_blocks=12).layers)
        pool = _pool(want, layout)
        reference.scatter(pool[[s for s, _ in CHUNKS]], layout, _ids(CHUNKS), want)
        cores = os.sched_getaffinity(0)
        copier = PagedCopier(got, layout, helper_cores=cores)
        assert copier._helper is not None
        assert (copier._stack is not None) == (one_buffer or num_layers == 1)
        assert copier._helper.submit(os.sched_getaffinity, 0).result() == cores
        handed: list[int] = []
        submit = copier._helper.submit
        copier._helper.submit = lambda fn, *a: handed.append(1) or submit(fn, *a)
        copier.scatter(pool, block_runs(CHUNKS))
        assert handed == []  # a few KiB: not worth the hand-over
        monkeypatch.setattr(batched, "HELPER_MIN_BYTES", 0)
        copier.scatter(pool, block_runs(CHUNKS))
        assert handed == [1]
        copier.close()
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    finally:
        torch.set_num_threads(threads)
    if threads > 1:  # torch spreads each copy over the compute threads itself
        assert PagedCopier(got, layout, helper_cores=cores)._helper is None


def test_a_pool_the_page_views_do_not_fit_takes_the_general_path():
    """Whole-page views need a contiguous pool; any other pool still moves the right bytes."""
    want, layout = _setup("cpu-pages", torch.float32)
    got, _ = _setup("cpu-pages", torch.float32)
    wide = _pool(want, layout).repeat(1, 1, 1, 1, 1, 2)  # every page twice as wide
    pool = wide[..., :wide.shape[-1] // 2]
    assert not pool.is_contiguous()
    reference.scatter(pool[[s for s, _ in CHUNKS]], layout, _ids(CHUNKS), want)
    PagedCopier(got, layout).scatter(pool, block_runs(CHUNKS))
    assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_scatter_copies_only_the_layers_asked_and_in_groups_equals_scatter(family):
    """A layer-by-layer load (layer_loads.py) copies a few layers at a time."""
    def setup():
        case = make_case(family, num_layers=3, num_blocks=12, seed=1)
        return case.layers, describe_layers({f"l{i}": t for i, t in enumerate(case.layers)},
                                            **case.describe_kw)
    want, layout = setup()
    got, _ = setup()
    before = [t.clone() for t in got]
    pool = _pool(want, layout)
    PagedCopier(want, layout).scatter(pool, block_runs(CHUNKS))
    copy = PagedCopier(got, layout).layer_scatter(pool, block_runs(CHUNKS))
    copy(1, 2)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], before[0]) and torch.equal(got[2], before[2])
    copy(0, 1)
    copy(2, 3)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_a_copy_moves_are_counted_from_its_runs(family):
    """Whether a load is big enough for the helper is read off its runs: the same bytes as
    its copies' views hold, for every layout (views made ahead where it has pages)."""
    layers, layout = _setup(family, torch.bfloat16)
    copier = PagedCopier(layers, layout)
    pool = _pool(layers, layout)
    copier.prepare(pool)  # as BlockCopies does at start-up, whatever the layout
    for chunks in (CHUNKS, WHOLE, DESCENDING):
        runs = block_runs(chunks)
        _, chunk = copier._pairs(pool, runs)
        assert copier._bytes(pool, runs) == sum(t.numel() for t in chunk) * 2
