"""Triton gather/scatter must equal the torch reference bit for bit, for every layout.

Without a GPU the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, set before
the kernels are defined); with one, the same tests run on CUDA tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from layouts import FAMILIES, make_case  # noqa: E402

import kvconnector.kernels as kernels  # noqa: E402
from kvconnector.kernels import reference, triton_copy  # noqa: E402
from kvconnector.layout import describe_layers  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# (kernel block size, kernel blocks per scheduler block, scheduler blocks per chunk)
SPLITS = {"bs16": (16, 1, 2), "bs32": (32, 1, 1), "bs16-of-32": (16, 2, 2)}
NUM_BLOCKS = 8


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view: compares bits (NaN payloads, -0.0), works for any strides."""
    return t.view(_INT[t.element_size()])


def randomize(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    b = bits(t)
    info = torch.iinfo(b.dtype)
    b.copy_(torch.randint(info.min, info.max, b.shape, generator=gen, dtype=b.dtype))
    return t


def to_device(layers):
    """Move whole storages, so strided views (and layers sharing one buffer) stay as they are."""
    if DEVICE == "cpu":
        return layers
    moved = {}
    for t in layers:
        st = t.untyped_storage()
        if st.data_ptr() not in moved:
            moved[st.data_ptr()] = torch.empty(0, dtype=t.dtype).set_(st).to(DEVICE)
    return [torch.as_strided(moved[t.untyped_storage().data_ptr()], t.shape, t.stride(),
                             t.storage_offset()) for t in layers]


def setup(family, dtype, block_size=16, seed=0, **kw):
    case = make_case(family, dtype=dtype, block_size=block_size, num_blocks=NUM_BLOCKS,
                     seed=seed, **kw)
    for i, t in enumerate(case.layers):
        randomize(t, seed * 10 + i)
    layers = to_device(case.layers)
    layout = describe_layers({f"l{i}": t for i, t in enumerate(layers)}, **case.describe_kw)
    return layers, layout


def kernel_ids(split: str, num_blocks: int) -> torch.Tensor:
    """Three chunks of distinct scheduler blocks, with -1 holes, as kernel block ids."""
    _, per_sched, sched_per_chunk = SPLITS[split]
    sched = [b for b in range(num_blocks // per_sched)][::-1]
    rows, it = [], iter(sched)
    for c in range(3):
        row = []
        for s in range(sched_per_chunk):
            hole = (c == 1 and s == 0) or c == 2  # a -1 slot and an all -1 chunk
            b = -1 if hole else next(it)
            row += [-1 if b < 0 else b * per_sched + j for j in range(per_sched)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def chunk_buffer(layers, layout, ids, fill=None):
    shape = (ids.shape[0], len(layers), *layout.chunk_shape(ids.shape[1]))
    buf = torch.empty(shape, dtype=layout.dtype, device=DEVICE)
    return randomize(buf, 99) if fill is None else buf.fill_(fill)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_gather_matches_reference(family, dtype, split):
    layers, layout = setup(family, dtype, SPLITS[split][0])
    ids = kernel_ids(split, layout.num_blocks)
    want, got = chunk_buffer(layers, layout, ids), chunk_buffer(layers, layout, ids)
    reference.gather(layers, layout, ids, want)
    triton_copy.gather(layers, layout, ids, got)
    assert torch.equal(bits(got), bits(want))
    assert not bits(got[2]).any(), "an all -1 chunk must gather as zeros"


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_scatter_matches_reference(family, dtype, split):
    want, layout = setup(family, dtype, SPLITS[split][0])
    got, _ = setup(family, dtype, SPLITS[split][0])
    before = [bits(layout.view(t)).clone() for t in got]
    ids = kernel_ids(split, layout.num_blocks)
    chunks = chunk_buffer(want, layout, ids)
    reference.scatter(chunks, layout, ids, want)
    triton_copy.scatter(chunks, layout, ids, got)
    written = sorted(int(b) for b in ids.flatten() if b >= 0)
    untouched = [b for b in range(layout.num_blocks) if b not in written]
    for w, g, old in zip(want, got, before, strict=True):
        assert torch.equal(bits(g), bits(w))
        assert torch.equal(bits(layout.view(g))[:, untouched], old[:, untouched])
    # Reading the written blocks back gives the chunks, with zeros at the -1 slots.
    back = chunk_buffer(got, layout, ids)
    reference.gather(got, layout, ids, back)
    mask = (ids >= 0).to(DEVICE).repeat_interleave(layout.sizes[2], dim=1)[:, None, None, :]
    assert torch.equal(bits(back), torch.where(mask[..., None, None], bits(chunks), 0))


@pytest.mark.parametrize("family", ["kv-LBNHC", "kv-BHLNC", "kv-LHBNC", "mla-LBHNC", "cpu-pages"])
def test_small_tiles_odd_heads(family, monkeypatch):
    """Several row and column tiles per block, with partial (masked) tiles."""
    monkeypatch.setattr(triton_copy, "_TILE_BYTES", 192)  # not even a power of 2
    kw = {"heads": 3, "head_size": 12, "latent": 20, "num_layers": 1}
    layers, layout = setup(family, torch.float16, **kw)
    ids = torch.tensor([[5, -1], [0, 7]])
    want, got = chunk_buffer(layers, layout, ids), chunk_buffer(layers, layout, ids)
    reference.gather(layers, layout, ids, want)
    triton_copy.gather(layers, layout, ids, got)
    assert torch.equal(bits(got), bits(want))
    dst_ref, _ = setup(family, torch.float16, seed=1, **kw)
    dst, _ = setup(family, torch.float16, seed=1, **kw)
    reference.scatter(want, layout, ids, dst_ref)
    triton_copy.scatter(want, layout, ids, dst)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst, dst_ref, strict=True))


@pytest.mark.parametrize("family", ["kv-LBHNC", "kv-BLNHC", "cpu-pages"])
def test_block_size_128(family):
    layers, layout = setup(family, torch.bfloat16, block_size=128, num_layers=1)
    ids = torch.tensor([[6], [-1], [1]])
    want, got = chunk_buffer(layers, layout, ids), chunk_buffer(layers, layout, ids)
    reference.gather(layers, layout, ids, want)
    triton_copy.gather(layers, layout, ids, got)
    assert torch.equal(bits(got), bits(want))


def test_no_chunks_is_a_no_op():
    layers, layout = setup("kv-LBNHC", torch.float16)
    ids = torch.empty((0, 2), dtype=torch.int64)
    buf = chunk_buffer(layers, layout, ids)
    triton_copy.gather(layers, layout, ids, buf)
    triton_copy.scatter(buf, layout, ids, layers)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU dispatch path")
def test_dispatch_uses_reference_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(reference, "gather", lambda *a: calls.append("gather"))
    monkeypatch.setattr(reference, "scatter", lambda *a: calls.append("scatter"))
    monkeypatch.setattr(triton_copy, "gather", lambda *a: pytest.fail("used Triton on CPU"))
    monkeypatch.setattr(triton_copy, "scatter", lambda *a: pytest.fail("used Triton on CPU"))
    layers, layout = setup("mla-LBHNC", torch.float32)
    ids = torch.tensor([[1, 2]])
    buf = chunk_buffer(layers, layout, ids)
    kernels.gather(layers, layout, ids, buf)
    kernels.scatter(buf, layout, ids, layers)
    assert calls == ["gather", "scatter"]


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: checks the CUDA dispatch path")
def test_dispatch_uses_triton_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_copy, "gather", lambda *a: calls.append("gather"))
    monkeypatch.setattr(triton_copy, "scatter", lambda *a: calls.append("scatter"))
    layers, layout = setup("mla-LBHNC", torch.float32)
    ids = torch.tensor([[1, 2]])
    buf = chunk_buffer(layers, layout, ids)
    kernels.gather(layers, layout, ids, buf)
    kernels.scatter(buf, layout, ids, layers)
    assert calls == ["gather", "scatter"]


def test_importing_kernels_does_not_import_triton():
    code = ("import sys, kvconnector.kernels, kvconnector.kernels.host_transfer; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={
        k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})


def _bad_calls():
    layers, layout = setup("kv-LBNHC", torch.float16)
    ids = torch.tensor([[1, 2]])
    good = chunk_buffer(layers, layout, ids)
    yield "shape", (layers, layout, ids, good[:, :1]), ValueError, "expected"
    yield "dtype", (layers, layout, ids, good.float()), ValueError, "dtype"
    yield "ids dtype", (layers, layout, ids.int(), good), ValueError, "int64"
    yield "ids rank", (layers, layout, ids[0], good), ValueError, "int64"
    yield "id range", (layers, layout, torch.tensor([[1, NUM_BLOCKS]]), good), IndexError, \
        "num_blocks"
    wide = torch.empty((*good.shape[:-1], 2 * good.shape[-1]), dtype=good.dtype, device=DEVICE)
    yield "strided chunks", (layers, layout, ids, wide[..., :good.shape[-1]]), ValueError, \
        "contiguous"
    odd = [layers[0], layers[1].transpose(2, 3).contiguous().transpose(2, 3)]
    yield "layer strides", (odd, layout, ids, good), ValueError, "strides"
    dl, dlay = setup("kv-LBNHC", torch.float32)
    dl = [t.double() for t in dl]
    dlay = describe_layers({f"l{i}": t for i, t in enumerate(dl)}, num_kv_heads=2, head_size=8)
    yield "unsupported dtype", (dl, dlay, ids, chunk_buffer(dl, dlay, ids)), TypeError, \
        "not supported"
    yield "no layers", ([], layout, ids, good[:, :0]), ValueError, "no KV layers"


BAD_CALLS = ["shape", "dtype", "ids dtype", "ids rank", "id range", "strided chunks",
             "layer strides", "unsupported dtype", "no layers"]


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_calls_fail_loudly(name):
    args, exc, match = next((a, e, m) for n, a, e, m in _bad_calls() if n == name)
    layers, layout, ids, chunks = args
    with pytest.raises(exc, match=match):
        triton_copy.gather(layers, layout, ids, chunks)
    with pytest.raises(exc, match=match):
        triton_copy.scatter(chunks, layout, ids, layers)


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU tensors are fine on the interpreter only")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(triton_copy, "_INTERPRETED", False)
    layers, layout = setup("mla-LBHNC", torch.float16)
    ids = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="kvconnector.kernels"):
        triton_copy.gather(layers, layout, ids, chunk_buffer(layers, layout, ids))


def test_host_transfer_needs_cuda():
    from kvconnector.kernels.host_transfer import HostTransfer

    if torch.cuda.is_available():
        pytest.skip("checks the message on machines without CUDA")
    layers, layout = setup("kv-LBNHC", torch.float16)
    with pytest.raises(RuntimeError, match="CUDA"):
        HostTransfer(layers, layout, kernel_blocks_per_chunk=2)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU: host transfer uses CUDA streams, events, pinned memory")
@pytest.mark.parametrize("family", ["kv-LBNHC", "kv-BLHNC", "kv-LHBNC", "mla-LBHNC", "cpu-pages"])
def test_host_transfer_round_trip(family):
    from kvconnector.kernels.host_transfer import HostTransfer

    layers, layout = setup(family, torch.bfloat16)
    ids = torch.tensor([[7, 6], [-1, 5], [4, 3]])  # 3 chunks through a 2-chunk staging
    xfer = HostTransfer(layers, layout, kernel_blocks_per_chunk=2, max_chunks=2)
    host = xfer.alloc_host(3)
    xfer.save(ids, host).synchronize()
    want = chunk_buffer(layers, layout, ids)
    reference.gather(layers, layout, ids, want)
    assert torch.equal(bits(host), bits(want.cpu()))

    dst, _ = setup(family, torch.bfloat16, seed=3)
    dst_ref, _ = setup(family, torch.bfloat16, seed=3)
    xfer_dst = HostTransfer(dst, layout, kernel_blocks_per_chunk=2, max_chunks=2)
    torch.cuda.current_stream().wait_event(xfer_dst.load(host, ids))
    reference.scatter(want, layout, ids, dst_ref)
    torch.cuda.synchronize()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst, dst_ref, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU: host transfer uses CUDA streams, events, pinned memory")
def test_host_transfer_waits_for_compute_stream():
    from kvconnector.kernels.host_transfer import HostTransfer

    layers, layout = setup("kv-LBNHC", torch.float16)
    ids = torch.tensor([[0, 1]])
    xfer = HostTransfer(layers, layout, kernel_blocks_per_chunk=2)
    host = xfer.alloc_host(1)
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy, then write the blocks
    for t in layers:
        t.fill_(3)
    xfer.save(ids, host).synchronize()
    assert bool((host == 3).all())
