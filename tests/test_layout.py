"""layout.describe against the KV tensors the installed vLLM really registers: every layout
family, and every attention backend vLLM ships that imports here."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from kvconnector import compat
from kvconnector.kernels import reference
from kvconnector.layout import LayoutError, describe, describe_layers
from tests.layouts import (
    FAMILIES,
    ORDERS,
    Case,
    fill,
    fresh_like,
    logical_kv,
    make_case,
    vllm_layers,
)

# Backends common models run on: a regression that refuses them must fail here.
MUST_SUPPORT = {"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHMLA", "TRITON_MLA",
                "CPU_ATTN", "CPU_MLA", "AMX_MLA"}


def _describe(case):
    return describe_layers({str(i): t for i, t in enumerate(case.layers)}, **case.describe_kw)


def _check_round_trip(case: Case, ids: torch.Tensor) -> None:
    """Gather ``ids`` into chunks and scatter them into a second cache: the blocks named
    hold the source's values, every other block is untouched."""
    layout = _describe(case)
    chunks = torch.empty((ids.shape[0], len(case.layers), *layout.chunk_shape(ids.shape[1])),
                         dtype=layout.dtype)
    reference.gather(case.layers, layout, ids, chunks)
    gen = torch.Generator().manual_seed(1)
    target = Case(case.family, fresh_like(case.layers, gen), case.describe_kw)
    before = [t.clone() for t in target.layers]
    reference.scatter(chunks, layout, ids, target.layers)
    named = set(ids.flatten().tolist())
    n = layout.kernel_block_size
    for li in range(len(case.layers)):
        for b in range(layout.num_blocks):
            for tok in (0, n - 1):
                want = logical_kv(case if b in named else Case("", before, case.describe_kw),
                                  li, b, tok)
                assert torch.equal(logical_kv(target, li, b, tok), want), (li, b, tok)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_round_trip_through_chunks(family, dtype):
    _check_round_trip(make_case(family, dtype=dtype), torch.tensor([[3, 7], [11, 0]]))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "cpu-pages"])
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
            if case.describe_kw["mla"]:
                got = chunks[0, li, 0, t]
            else:
                got = torch.cat([chunks[0, li, 0, t], chunks[0, li, 1, t]], dim=-1)
            assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size, num_blocks", [(16, 12), (128, 3)])
def test_mirror_builds_what_vllm_builds(family, block_size, num_blocks):
    """The GPU machine has no vLLM; its kernel tests use the mirror, which must lay tensors
    out exactly as the installed vLLM does."""
    kw = {"block_size": block_size, "num_blocks": num_blocks, "dtype": torch.bfloat16}
    real, mirror = make_case(family, **kw), make_case(family, use_vllm=False, **kw)
    assert real.describe_kw == mirror.describe_kw
    for a, b in zip(real.layers, mirror.layers, strict=True):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    offsets = [t.storage_offset() for t in real.layers]
    assert [o - offsets[0] for o in offsets] == [
        t.storage_offset() - mirror.layers[0].storage_offset() for t in mirror.layers]


def _backends():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return [m.name for m in AttentionBackendEnum if m.value]


_PROBE = """
import sys
from vllm.v1.attention.backends.registry import AttentionBackendEnum
for name in sys.argv[1:]:
    print(name, flush=True)
    try:
        AttentionBackendEnum[name].get_class()
    except Exception:
        pass
"""


@functools.cache
def _backends_that_abort() -> frozenset[str]:
    """Backends whose import kills the interpreter here, found in child processes: on a CPU
    without AVX-512, ROCm's platform module imports ``vllm._C``, the AVX-512 build of the
    CPU ops, and that aborts the process (vLLM's CPU platform loads ``_C_AVX2`` instead)."""
    left, aborting = _backends(), set()
    while left:
        done = subprocess.run([sys.executable, "-c", _PROBE, *left], capture_output=True,
                              text=True, timeout=600)
        tried = done.stdout.split()
        if done.returncode == 0:
            break
        if not tried:
            raise AssertionError(f"the backend probe died before its first import: "
                                 f"{done.stderr[-2000:]}")
        aborting.add(tried[-1])
        left = left[len(tried):]
    return frozenset(aborting)


def _backend_class(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if name in _backends_that_abort():
        pytest.skip(f"importing {name} aborts the interpreter on this machine")
    try:
        return AttentionBackendEnum[name].get_class()
    except Exception as e:  # GPU-only modules, missing optional packages
        pytest.skip(f"{name} does not import here: {type(e).__name__}: {e}"[:300])


def _backend_spec(backend):
    """The spec a vLLM worker builds for one layer on ``backend``: the model's spec, then
    the backend's own adjustments (``customize_attention_spec``)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    block_size = backend.get_preferred_block_size(64)
    if backend.is_mla():
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                                dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=4, head_size=64,
                                 dtype=torch.bfloat16)
    return customize_attention_spec(backend, spec)


@pytest.mark.parametrize("name", _backends())
def test_every_vllm_backend_is_described_or_refused_clearly(name):
    """For each backend and each layout it supports, the tensors vLLM registers either
    round-trip through chunks token by token, or are refused at start-up with a message."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import select_common_block_size

    backend = _backend_class(name)
    spec = _backend_spec(backend)
    on_cpu = name == "CPU_ATTN"
    try:
        kw = compat.layout_kw(spec, on_cpu=on_cpu)
    except LayoutError as e:
        assert name not in MUST_SUPPORT, e
        assert "kvconnector cannot store this model's KV cache" in str(e)
        return
    kernel = select_common_block_size(spec.block_size, [backend], [spec])
    for order in backend.supported_kv_cache_layouts() or [KVCacheLayout[o] for o in ORDERS]:
        # vLLM never splits blocks into kernel blocks in block-outermost layouts, and
        # refuses to where a block is not one dense page: no engine runs those.
        split = kernel if order.is_layer_compact else None
        try:
            layers = vllm_layers(spec, order.name, num_layers=2, num_blocks=6,
                                 kernel_block_size=split)
        except ValueError as e:
            assert "cannot be split" in str(e)
            continue
        gen = torch.Generator().manual_seed(0)
        for t in layers:
            fill(t, gen)
        case = Case(f"{name}/{order.name}", layers, kw)
        ratio = layers[0].shape[0] // 6
        ids = torch.tensor([[r * ratio + j for r in (4, 1) for j in range(ratio)]])
        _check_round_trip(case, ids)


def test_common_backends_are_supported():
    names = set(_backends())
    assert MUST_SUPPORT <= names, MUST_SUPPORT - names


def test_mla_is_the_4d_view_vllm_registers():
    case = make_case("mla-LBHNC", latent=24)
    assert case.layers[0].shape == (12, 1, 16, 24)
    layout = _describe(case)
    assert layout.family == "mla" and layout.sizes == (1, 12, 16, 1, 24)


def test_layouts_are_read_from_strides():
    nhd = _describe(make_case("kv-LBNHC"))
    hnd = _describe(make_case("kv-LBHNC"))
    assert nhd.sizes == hnd.sizes == (2, 12, 16, 2, 8)
    assert nhd.strides != hnd.strides
    pages = _describe(make_case("cpu-pages"))
    assert pages.family == "cpu-pages" and pages.sizes == (1, 12, 1, 2, 16 * 16)


def test_bad_tensors_get_clear_errors():
    with pytest.raises(LayoutError, match="heads"):
        describe(torch.empty(4, 3, 16, 16), num_kv_heads=2, head_size=8)
    with pytest.raises(LayoutError, match="MLA expects"):
        describe(torch.empty(4, 2, 16, 24), num_kv_heads=1, head_size=24, mla=True)
    with pytest.raises(LayoutError, match="4D"):
        describe(torch.empty(2, 4, 16, 2, 8), num_kv_heads=2, head_size=8)
    a = make_case("kv-LBNHC").layers[0]
    b = make_case("kv-LBNHC", block_size=32).layers[0]
    with pytest.raises(LayoutError, match="share a layout"):
        describe_layers({"a": a, "b": b}, num_kv_heads=2, head_size=8)
    with pytest.raises(ValueError, match="expected"):
        case = make_case("kv-LBNHC")
        reference.gather(case.layers, _describe(case), torch.tensor([[0]]),
                         torch.empty(1, 2, 2, 99, 2, 8))
