"""A load by layer (``kernels/by_layer.py``, ``layer_loads.py``): the bytes of the
reference, each layer waited for before the forward reads it, and every way it can go
wrong turned into a recompute."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from layouts import make_case
from test_batched_copy import CHUNKS, _ids, _pool

from kvconnector import layer_loads
from kvconnector.kernels import reference
from kvconnector.kernels.batched import PagedCopier, block_runs
from kvconnector.kernels.by_layer import LayerLoad
from kvconnector.layer_loads import LoadsByLayer
from kvconnector.layout import describe_layers
from kvconnector.metadata import ChunkTransfer


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as vLLM's CPU worker on 2 cores: the helper exists
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("one_buffer", [True, False], ids=["stacked", "separate"])
def test_a_load_by_layer_moves_the_bytes_of_the_reference(num_layers, one_buffer, one_thread):
    case = make_case("cpu-pages", num_layers=num_layers, num_blocks=12)
    want = [t if one_buffer else t.clone() for t in case.layers]
    layout = describe_layers({f"l{i}": t for i, t in enumerate(want)}, **case.describe_kw)
    got = [t.clone() for t in want] if not one_buffer else \
        list(make_case("cpu-pages", num_layers=num_layers, num_blocks=12).layers)
    pool = _pool(want, layout)
    reference.scatter(pool[[s for s, _ in CHUNKS]], layout, _ids(CHUNKS), want)
    copier = PagedCopier(got, layout, helper_cores=os.sched_getaffinity(0))
    load = copier.scatter_by_layer(pool, block_runs(CHUNKS))
    assert load is not None
    for i in range(num_layers):
        load.wait(i)
        assert torch.equal(got[i], want[i]), f"layer {i} read before it landed"
    assert load.finish() is None and load.unwaited == []
    assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))
    copier.close()


def test_no_helper_no_load_by_layer():
    case = make_case("cpu-pages", num_layers=2, num_blocks=12)
    layout = describe_layers({f"l{i}": t for i, t in enumerate(case.layers)},
                             **case.describe_kw)
    before = [t.clone() for t in case.layers]
    copier = PagedCopier(case.layers, layout)  # no spare core
    assert copier.scatter_by_layer(_pool(case.layers, layout), block_runs(CHUNKS)) is None
    assert all(torch.equal(a, b) for a, b in zip(before, case.layers, strict=True))


def _gated(n: int):
    """A copy of ``n`` layers, each waiting for its gate: the test decides when a layer
    lands."""
    gates = [threading.Event() for _ in range(n)]
    done: list[int] = []

    def copy(landed) -> None:
        for i in range(n):
            assert gates[i].wait(10)
            done.append(i)
            landed(i)
    return gates, done, copy


def _layers(*copies):
    """A copy running ``copies`` one layer each."""
    def copy(landed) -> None:
        for i, c in enumerate(copies):
            c()
            landed(i)
    return len(copies), copy


def test_a_wait_returns_only_once_its_layer_has_landed():
    gates, done, copies = _gated(3)
    with ThreadPoolExecutor(1) as helper:
        load = LayerLoad(helper, 3, copies)
        gates[0].set()
        load.wait(0)
        assert done == [0]
        waiter = threading.Thread(target=load.wait, args=(1,))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive(), "layer 1 waited for returned before layer 1 landed"
        gates[1].set()
        waiter.join(10)
        assert not waiter.is_alive() and done == [0, 1]
        assert load.wait_seconds > 0.1
        gates[2].set()
        assert load.finish() is None
        assert done == [0, 1, 2] and load.unwaited == [2] and load.copy_seconds > 0


def test_a_failed_copy_wakes_every_waiter_and_is_reported():
    def broken() -> None:
        raise RuntimeError("copy broke")

    with ThreadPoolExecutor(1) as helper:
        load = LayerLoad(helper, *_layers(lambda: None, broken, lambda: None))
        for i in range(3):
            load.wait(i)  # returns: nobody waits forever on a failed copy
        assert isinstance(load.finish(), RuntimeError)


def _transfer(i: int) -> ChunkTransfer:
    return ChunkTransfer(req_id="r", index=i, chunk_hash=i.to_bytes(16, "big"), slot=i,
                         block_ids=[2 * i, 2 * i + 1])


def test_loads_go_by_layer_only_after_vllm_waited_for_every_layer(monkeypatch):
    monkeypatch.setattr(layer_loads, "MIN_LAYERS", 3)
    loads = LoadsByLayer(["a", "b", "c"])
    assert not loads.usable(1 << 30)  # vLLM has shown nothing yet
    loads.wait("a")
    loads.wait("c")
    loads.wait("not-an-attention-layer")  # a draft model's layer: ignored
    assert not loads.usable(1 << 30)
    loads.wait("b")
    assert loads.usable(1 << 30)
    assert not loads.usable(layer_loads.MIN_BYTES - 1)  # small: before the forward
    assert loads.land() is None  # nothing in flight
    monkeypatch.setattr(layer_loads, "MIN_LAYERS", 4)
    assert not loads.usable(1 << 30)  # too few layers to hide the copy behind


def test_a_layer_never_waited_for_is_a_recompute_and_ends_loads_by_layer(monkeypatch):
    monkeypatch.setattr(layer_loads, "MIN_LAYERS", 0)
    names = ["a", "b", "c"]
    loads = LoadsByLayer(names)
    for n in names:
        loads.wait(n)
    transfers = [_transfer(0), _transfer(1)]
    with ThreadPoolExecutor(1) as helper:
        loads.begin(LayerLoad(helper, *_layers(*[lambda: None] * 3)), transfers, 0.001)
        loads.wait("a")
        loads.wait("c")  # "b": the forward read it without waiting
        landed = loads.land()
        assert landed is not None and landed.transfers == transfers
        assert landed.problem is not None and "[1]" in landed.problem
        assert not loads.usable(1 << 30)  # for good
        assert loads.land() is None


def test_a_load_by_layer_that_failed_is_a_recompute(monkeypatch):
    monkeypatch.setattr(layer_loads, "MIN_LAYERS", 0)
    names = ["a", "b"]
    loads = LoadsByLayer(names)
    for n in names:
        loads.wait(n)

    def broken() -> None:
        raise RuntimeError("copy broke")

    with ThreadPoolExecutor(1) as helper:
        loads.begin(LayerLoad(helper, *_layers(lambda: None, broken)), [_transfer(0)], 0.0)
        for n in names:
            loads.wait(n)
        landed = loads.land()
    assert landed is not None and "copy broke" in (landed.problem or "")
    assert loads.usable(1 << 30)  # a failed copy is not vLLM skipping a layer
