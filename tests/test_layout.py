from __future__ import annotations

import pytest
import torch

from kvconnector.kernels import reference
from kvconnector.layout import LayoutError, describe, describe_layers
from tests.layouts import FAMILIES, logical_kv, make_case


def _describe(case):
    return describe_layers({str(i): t for i, t in enumerate(case.layers)}, **case.describe_kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_round_trip_through_chunks(family, dtype):
    case = make_case(family, dtype=dtype)
    layout = _describe(case)
    ids = torch.tensor([[3, 7], [11, 0]])
    chunks = torch.empty((2, len(case.layers), *layout.chunk_shape(2)), dtype=dtype)
    reference.gather(case.layers, layout, ids, chunks)
    target = make_case(family, dtype=dtype, seed=1)
    before = [t.clone() for t in target.layers]
    reference.scatter(chunks, layout, ids, target.layers)
    for li in range(len(case.layers)):
        for b in range(layout.num_blocks):
            for tok in (0, 15):
                got, src, old = (logical_kv(c, li, b, tok) for c in (
                    target, case, type(case)(family, before, case.describe_kw)))
                want = src if b in (3, 7, 11, 0) else old
                assert torch.equal(got, want), (family, li, b, tok)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("cpu-pages",)])
def test_chunks_use_the_lmcache_token_layout(family):
    """chunk[c, layer, :, t] is token t's K|V (or latent), blocks in plan order."""
    case = make_case(family, block_size=4)
    layout = _describe(case)
    ids = torch.tensor([[5, 2]])
    chunks = torch.empty((1, 2, *layout.chunk_shape(2)), dtype=case.layers[0].dtype)
    reference.gather(case.layers, layout, ids, chunks)
    for li in range(2):
        for t in range(8):
            block, tok = (5, 2)[t // 4], t % 4
            want = logical_kv(case, li, block, tok)
            if family == "mla":
                got = chunks[0, li, 0, t, 0]
            else:
                got = torch.cat([chunks[0, li, 0, t], chunks[0, li, 1, t]], dim=-1)
            assert torch.equal(got, want)


def test_minus_one_is_zeros_on_gather_and_untouched_on_scatter():
    case = make_case("v032-LBNHC")
    layout = _describe(case)
    ids = torch.tensor([[4, -1]])
    chunks = torch.full((1, 2, *layout.chunk_shape(2)), 9.0)
    reference.gather(case.layers, layout, ids, chunks)
    assert torch.all(chunks[0, :, :, 16:] == 0)
    before = [t.clone() for t in case.layers]
    chunks.fill_(5.0)
    reference.scatter(chunks, layout, torch.tensor([[-1, -1]]), case.layers)
    assert all(torch.equal(a, b) for a, b in zip(before, case.layers, strict=True))


def test_layouts_are_read_from_strides():
    nhd = describe(make_case("v032-LBNHC").layers[0], num_kv_heads=2, head_size=8)
    hnd = describe(make_case("v032-LBHNC").layers[0], num_kv_heads=2, head_size=8)
    assert nhd.sizes == hnd.sizes == (2, 12, 16, 2, 8)
    assert nhd.strides != hnd.strides
    pages = describe(make_case("cpu-pages").layers[0], num_kv_heads=2, head_size=8,
                     cpu_pages=True)
    assert pages.family == "cpu-pages" and pages.sizes == (1, 12, 1, 2, 16 * 16)


def test_bad_tensors_get_clear_errors():
    with pytest.raises(LayoutError, match="heads"):
        describe(torch.empty(4, 3, 16, 16), num_kv_heads=2, head_size=8)
    with pytest.raises(LayoutError, match="cannot be told apart"):
        describe(torch.empty(2, 4, 2, 2, 8), num_kv_heads=2, head_size=8)
    with pytest.raises(LayoutError, match="3D .* 4D or 5D"):
        describe(torch.empty(4, 4), num_kv_heads=2, head_size=8)
    a, b = make_case("old-NHD").layers[0], make_case("old-NHD", block_size=32).layers[0]
    with pytest.raises(LayoutError, match="share a layout"):
        describe_layers({"a": a, "b": b}, num_kv_heads=2, head_size=8)
    with pytest.raises(ValueError, match="expected"):
        case = make_case("old-NHD")
        reference.gather(case.layers, _describe(case), torch.tensor([[0]]),
                         torch.empty(1, 2, 2, 99, 2, 8))
