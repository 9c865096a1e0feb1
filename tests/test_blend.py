"""Blend parts without an engine: config, segments and keys, RoPE re-rotation against vLLM's
own rotary modules, token-granular page access against vLLM's own CPU cache-write kernel,
and the attention the selective recompute uses."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvconnector.blend.config import BlendConfig
from kvconnector.blend.cost import compute_share
from kvconnector.blend.segments import (
    PieceHeader,
    PieceHeaderError,
    documents,
    find_segments,
    piece_capacity,
    piece_view,
)
from kvconnector.config import ConfigError, ConnectorConfig
from kvconnector.keys import chunk_hashes

# ---- config ----


def test_blend_is_off_by_default_with_the_issues_defaults():
    cfg = ConnectorConfig.from_extra_config({}).blending
    assert cfg == BlendConfig()
    assert (cfg.enabled, cfg.separator, cfg.separator_ids, cfg.recompute_ratio,
            cfg.check_layer, cfg.strategy, cfg.epic_tokens, cfg.min_tokens, cfg.sink_tokens,
            cfg.refine_layer, cfg.refine_ratio, cfg.group_tokens, cfg.max_cost) == (
        False, " # # ", None, 0.5, 1, "attention", 32, 256, 0, 8, 0.3, 16, 0.85)


def test_blend_keys_are_parsed():
    cfg = ConnectorConfig.from_extra_config({
        "blend": True, "blend_separator": " ## ", "blend_separator_ids": [7, 8],
        "blend_recompute_ratio": 1, "blend_check_layer": 2, "blend_strategy": "epic",
        "blend_epic_tokens": 16, "blend_min_tokens": 0}).blending
    assert cfg == BlendConfig(True, " ## ", (7, 8), 1.0, 2, "epic", 16, 0)


@pytest.mark.parametrize("extra, named", [
    ({"blend": "yes"}, "blend:"), ({"blend_separator": ""}, "blend_separator"),
    ({"blend_separator_ids": []}, "blend_separator_ids"),
    ({"blend_separator_ids": [1, -2]}, "blend_separator_ids"),
    ({"blend_recompute_ratio": 1.5}, "blend_recompute_ratio"),
    ({"blend_recompute_ratio": True}, "blend_recompute_ratio"),
    ({"blend_recompute_ratio": float("nan")}, "blend_recompute_ratio"),
    ({"blend_check_layer": -1}, "blend_check_layer"),
    ({"blend_strategy": "fast"}, "blend_strategy"),
    ({"blend_epic_tokens": 1.5}, "blend_epic_tokens"),
    ({"blend_min_tokens": -1}, "blend_min_tokens"),
    ({"blend_sink_tokens": -4}, "blend_sink_tokens"),
    ({"blend_max_cost": 1.2}, "blend_max_cost"), ({"blend_max_cost": "1"}, "blend_max_cost"),
    ({"blend_refine_ratio": -1}, "blend_refine_ratio"),
    ({"blend_group_tokens": 0}, "blend_group_tokens"),
    ({"blend_refine_layer": 1.5}, "blend_refine_layer"),
    ({"blend_ratio": 0.2}, "blend_ratio"),
])
def test_bad_blend_values_name_the_key(extra, named):
    with pytest.raises(ConfigError) as e:
        ConnectorConfig.from_extra_config(extra)
    assert named in str(e.value)


def test_requests_override_blend_settings_and_bad_overrides_are_ignored():
    cfg = BlendConfig(enabled=True)
    assert cfg.for_request(None) is cfg
    assert cfg.for_request({"other": 1}) is cfg
    assert cfg.for_request({"blend_recompute_ratio": 1.0}).recompute_ratio == 1.0
    assert cfg.for_request({"blend_strategy": "epic", "blend": False}) == BlendConfig(
        enabled=False, strategy="epic")
    assert cfg.for_request({"blend_recompute_ratio": 7}) is cfg  # logged, never raised
    assert cfg.for_request({"blend_separator": "x"}) is cfg  # not a per-request key


def test_a_request_cannot_lower_the_deployments_blend_threshold():
    """Issue 20: ``blend_min_tokens: 0`` per request had the worker blend (a dense
    recompute) prompts with nothing stored; a request may only raise the threshold."""
    cfg = BlendConfig(enabled=True, min_tokens=256)
    assert cfg.for_request({"blend_min_tokens": 0}).min_tokens == 256
    assert cfg.for_request({"blend_min_tokens": 0, "blend_recompute_ratio": 0.5}) == (
        BlendConfig(enabled=True, min_tokens=256, recompute_ratio=0.5))
    assert cfg.for_request({"blend_min_tokens": 1024}).min_tokens == 1024


def test_blend_salts_differ_by_every_setting_that_changes_the_kv():
    base = BlendConfig(enabled=True)
    others = [BlendConfig(enabled=True, recompute_ratio=0.3),
              BlendConfig(enabled=True, strategy="cacheblend"),
              BlendConfig(enabled=True, check_layer=2), BlendConfig(enabled=True, epic_tokens=8),
              BlendConfig(enabled=True, sink_tokens=16),
              BlendConfig(enabled=True, refine_layer=4), BlendConfig(enabled=True, refine_ratio=.1),
              BlendConfig(enabled=True, group_tokens=1)]
    assert len({c.salt() for c in [base, *others]}) == 9
    assert BlendConfig(enabled=True, min_tokens=1).salt() == base.salt()
    assert BlendConfig(enabled=True, max_cost=1.0).salt() == base.salt()


def test_blend_cost_against_full_prefill():
    """Issue 20: blend must never make a request slower than full prefill. On 2 layers the
    check layer is the whole model: blending costs what full prefill does and more."""
    cfg = BlendConfig(enabled=True, recompute_ratio=0.15, refine_layer=0)  # check layer 1
    assert compute_share(cfg, 2, 2048, 2048, 4) == 1.0
    assert compute_share(cfg, 30, 2048, 2048, 4) == pytest.approx((2 + 0.15 * 28) / 30)
    # Tokens no document covers go through every layer.
    assert compute_share(cfg, 30, 2048, 1024, 2) == pytest.approx(
        (1024 + 1024 * (2 + 0.15 * 28) / 30) / 2048)
    assert compute_share(replace(cfg, recompute_ratio=0.0), 30, 2048, 1024, 2) == 0.5
    assert compute_share(replace(cfg, recompute_ratio=1.0), 30, 2048, 2048, 4) == 1.0
    assert compute_share(replace(cfg, strategy="epic", epic_tokens=64), 8, 2048, 2048, 4) == (
        pytest.approx(256 / 2048))
    sinks = compute_share(replace(cfg, sink_tokens=16), 30, 2048, 2048, 4)
    assert sinks == pytest.approx((2 + (0.15 + 64 / 2048) * 28) / 30)
    refined = compute_share(replace(cfg, recompute_ratio=0.5, refine_layer=8, refine_ratio=0.15),
                            30, 2048, 2048, 4)
    assert refined == pytest.approx((2 + 0.5 * 7 + 0.15 * 21) / 30)
    default = compute_share(BlendConfig(enabled=True), 30, 2048, 2048, 4)
    assert default == pytest.approx((2 + 0.5 * 7 + 0.3 * 21) / 30)
    assert BlendConfig().max_cost == 0.85
    assert BlendConfig().for_request({"blend_max_cost": 1.0}).max_cost == 0.85  # deployment's


# ---- segments and keys ----


@pytest.mark.parametrize("tokens, segments", [
    ([1, 2, 3], [(0, 3)]),
    ([1, 9, 9, 2, 9, 9, 3], [(0, 1), (3, 4), (6, 7)]),
    ([9, 9, 1, 9], [(0, 0), (2, 4)]),  # a lone 9 at the end is no separator
    ([1, 9, 9, 9, 9, 2], [(0, 1), (3, 3), (5, 6)]),
    ([1, 9, 9], [(0, 1), (3, 3)]),
])
def test_find_segments(tokens, segments):
    assert find_segments(tokens, [9, 9]) == segments


SEED = b"s" * 16


def test_a_document_has_one_key_at_any_position_after_anything():
    doc, other, sep = list(range(10, 310)), list(range(400, 450)), [9, 9]
    a = documents([1, 5] + sep + doc + sep + other + sep + [3], sep, SEED, 256)
    b = documents(other + sep + doc + sep + [1, 2, 3], sep, SEED, 256)
    assert [(d.start, d.length) for d in a] == [(0, 2), (4, 300), (306, 50)]
    assert [(d.start, d.length) for d in b] == [(0, 50), (52, 300)]  # not the question
    assert a[1].doc_hash == b[1].doc_hash and a[1].pieces == b[1].pieces
    assert a[2].doc_hash == b[0].doc_hash
    # Another seed (fingerprint or cache salt) gives other keys.
    c = documents(other + sep + doc + sep + [1], sep, b"t" * 16, 256)
    assert c[1].doc_hash != b[1].doc_hash and not set(c[1].pieces) & set(b[1].pieces)


@pytest.mark.parametrize("length, pieces", [(1, 1), (255, 1), (256, 2), (510, 2), (511, 3)])
def test_documents_split_into_pieces_of_one_slot_minus_the_header_row(length, pieces):
    assert piece_capacity(256) == 255
    (d,) = documents(list(range(length)) + [-1, 0], [-1], SEED, 256)
    assert len(d.pieces) == pieces and len(set(d.pieces)) == pieces


def test_document_keys_never_equal_prefix_chain_keys():
    tokens = list(range(1000, 1000 + 510))
    (d,) = documents(tokens + [-1, 0], [-1], SEED, 256)
    chain = chunk_hashes(tokens, 256, SEED)
    assert not set(d.pieces) & set(chain) and d.doc_hash not in chain


def test_piece_header_round_trip_and_rejects_other_bytes():
    h = PieceHeader(255, 1234, b"d" * 16)
    assert PieceHeader.unpack(h.pack()) == h
    with pytest.raises(PieceHeaderError):
        PieceHeader.unpack(b"\0" * len(h.pack()))


def test_a_slot_holds_one_piece_and_its_header():
    slot = torch.zeros((2, 1, 2, 2, 2 * 128 * 32))  # CPU pages: 2 layers, 2 blocks of 128
    data, header = piece_view(slot, num_layers=2, num_kv_heads=2, head_size=32,
                              chunk_size=256)
    assert tuple(data.shape) == (2, 2, 255, 2, 32)
    data.fill_(1.0)
    header.copy_(torch.frombuffer(bytearray(PieceHeader(3, 4, b"x" * 16).pack()),
                                  dtype=torch.uint8))
    flat = slot.reshape(-1)
    assert int((flat == 1.0).sum()) == data.numel()  # data and header do not overlap
    assert PieceHeader.unpack(bytes(header.numpy())) == PieceHeader(3, 4, b"x" * 16)


# ---- RoPE re-rotation ----


@pytest.fixture(scope="module")
def vllm_context():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _rope(params, neox=True, head_size=64):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(head_size, max_position=8192, is_neox_style=neox, rope_parameters=params,
                    dtype=torch.float32)


@pytest.mark.parametrize("params, neox", [
    ({"rope_theta": 10000.0, "rope_type": "default"}, True),
    ({"rope_theta": 1e6, "rope_type": "default"}, False),
    ({"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}, True),
    ({"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}, True),
    ({"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}, True),
    ({"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 2048}, True),
])
def test_moved_keys_equal_keys_rotated_at_the_new_position(vllm_context, params, neox):
    from kvconnector.blend.rope import ReRotator

    rope = _rope(params, neox)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(300, 2 * 64, generator=gen)
    query = torch.randn(300, 64, generator=gen)

    def at(pos: int) -> torch.Tensor:
        _, k = rope.forward_native(torch.arange(pos, pos + 300), query.clone(), key.clone())
        return k.view(300, 2, 64)

    mover = ReRotator(rope)
    for p, q in [(0, 5000), (4000, 3), (17, 17), (100, 101)]:
        moved = mover.move(at(p), p, q)
        assert torch.allclose(moved, at(q), atol=2e-6, rtol=1e-5), (p, q)
    assert (at(0) - at(5000)).abs().max() > 1  # the check can fail


@pytest.mark.parametrize("params", [
    {"rope_theta": 1e5, "rope_type": "default"},  # SmolLM2's
    {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
     "original_max_position_embeddings": 2048},
])
def test_bf16_keys_move_as_vllm_rotates_them(vllm_context, params):
    """In bf16 vLLM rotates with its table rounded to bf16; a stored key was rounded after
    its rotation. Undoing the very row vLLM used leaves only that rounding (at most 2 units
    in the last place of the head's largest element); composing with the float32 table
    adds the table's rounding on top (before the fix, the moved keys carried it)."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from kvconnector.blend.rope import ReRotator

    rope = get_rope(64, max_position=8192, is_neox_style=True, rope_parameters=params,
                    dtype=torch.bfloat16)
    from vllm.platforms import current_platform

    # vLLM's CPU kernel: what the CPU build's engine runs (it rotates in float32)
    rotate = rope.forward_cpu if current_platform.is_cpu() else rope.forward_native
    gen = torch.Generator().manual_seed(0)
    n = 300
    key = torch.randn(n, 3 * 64, generator=gen).bfloat16()
    query = torch.randn(n, 9 * 64, generator=gen).bfloat16()

    def at(pos: int) -> torch.Tensor:
        _, k = rotate(torch.arange(pos, pos + n), query.clone(), key.clone())
        return k.view(n, 3, 64)

    mover = ReRotator(rope)
    fp32 = ReRotator(rope)
    table = rope._compute_cos_sin_cache().to(torch.float64)
    fp32.cos, fp32.sin = table[:, :32], table[:, 32:]
    for p, q in [(0, 5000), (4000, 3), (100, 101), (1000, 7000)]:
        want = at(q).float()
        # bf16's unit in the last place at the head's largest element (7 stored mantissa bits)
        ulp = torch.exp2(torch.floor(torch.log2(want.abs().amax(-1, keepdim=True))) - 7)
        err = (mover.move(at(p), p, q).float() - want).abs()
        err32 = (fp32.move(at(p), p, q).float() - want).abs()
        assert float((err / ulp).max()) <= 2.0, (p, q)
        assert float(err.mean()) < 0.85 * float(err32.mean()), (p, q)
        assert float((err == 0).float().mean()) > 0.6, (p, q)


@pytest.mark.parametrize("params, why", [
    ({"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [8, 12, 12]},
     "does not rotate by a plain table lookup"),
])
def test_ropes_that_cannot_move_keys_are_refused(vllm_context, params, why):
    from kvconnector.blend.rope import ReRotator, RopeUnsupported

    with pytest.raises(RopeUnsupported) as e:
        ReRotator(_rope(params))
    assert why in str(e.value)


def test_a_table_not_proportional_to_the_position_is_refused(vllm_context):
    from kvconnector.blend.rope import ReRotator, RopeUnsupported

    rope = _rope({"rope_theta": 10000.0, "rope_type": "default"})
    table = rope._compute_cos_sin_cache()
    bent = table.clone()
    bent[4000:] = table[:table.shape[0] - 4000]  # restarts at 4000, as two tables would
    rope._compute_cos_sin_cache = lambda: bent
    with pytest.raises(RopeUnsupported) as e:
        ReRotator(rope)
    assert "not proportional to the position" in str(e.value)


# ---- token-granular pages ----


def _cpu_writer(isa: str):
    from vllm import _custom_ops as ops

    def write(key, value, kv_cache, slots):
        b, h, n, _ = kv_cache.shape
        kc, vc = kv_cache.view(b, h, 2 * n, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    return write


def _isas():
    out = [(torch.float32, "vec", 32), (torch.float32, "vec16", 48),
           (torch.bfloat16, "vec", 64)]
    if torch.cpu._is_amx_tile_supported():
        out.append((torch.bfloat16, "amx", 128))
    return out


@pytest.mark.parametrize("dtype, isa, head_size", _isas())
def test_cpu_pages_read_and_write_what_vllms_kernel_writes(dtype, isa, head_size):
    from kvconnector.blend.pages import TokenPages, probe_cpu_packing
    from kvconnector.layout import describe

    bs, heads, blocks = 128, 2, 6
    packing = probe_cpu_packing(_cpu_writer(isa), dtype, bs, heads, head_size)
    cache = torch.zeros((blocks, heads, bs, 2 * head_size), dtype=dtype)
    layout = describe(cache, num_kv_heads=heads, head_size=head_size, cpu_pages=True)
    pages = TokenPages([cache], layout, bs, heads, head_size, packing)
    ids = torch.tensor([4, 1, 3])
    k = torch.randn(3 * bs, heads, head_size).to(dtype)
    v = torch.randn(3 * bs, heads, head_size).to(dtype)
    slots = (ids[:, None] * bs + torch.arange(bs)[None]).reshape(-1)
    _cpu_writer(isa)(k, v, cache, slots)
    got = pages.read(0, ids)
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    written_by_vllm = cache.clone()
    cache.zero_()
    pages.write(0, ids, torch.stack([k, v]))
    assert torch.equal(cache, written_by_vllm)


def test_strided_gpu_layouts_read_and_write_tokens():
    from kvconnector.blend.pages import TokenPages
    from kvconnector.layout import describe

    blocks, heads, n, d = 6, 2, 16, 8
    cache = torch.zeros((blocks, heads, n, 2 * d))  # vLLM 0.32 GPU: K then V per token
    layout = describe(cache, num_kv_heads=heads, head_size=d)
    pages = TokenPages([cache], layout, 32, heads, d)  # scheduler blocks of 2 kernel blocks
    ids = pages.kernel_ids([2, 0])
    assert ids.tolist() == [4, 5, 0, 1]
    kv = torch.randn(2, 4 * n, heads, d)
    pages.write(0, ids, kv)
    assert torch.equal(pages.read(0, ids), kv)
    assert torch.equal(cache[4, :, 3, :d], kv[0, 3])  # token 3 of block 4, K
    assert torch.equal(cache[0, 1, 0, d:], kv[1, 2 * n, 1])  # token 0 of block 0, V, head 1


# ---- attention ----


def _naive(q, k, v, q_pos, scale, window):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("ahd,thd->aht", q, k) * scale
    kp = torch.arange(k.shape[0])
    mask = kp[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= (q_pos[:, None] - kp[None, :]) < window
    s = s.masked_fill(~mask[:, None, :], -math.inf)
    return torch.einsum("aht,thd->ahd", s.softmax(-1), v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("window", [None, 7])
def test_attention_of_scattered_queries_over_all_keys(window, monkeypatch):
    from kvconnector.blend import recompute

    monkeypatch.setattr(recompute, "_SCORE_ELEMENTS", 4 * 8 * 50)  # several query chunks
    monkeypatch.setattr(recompute, "_SPAN", 8)  # and several position spans
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(20, 8, 16, generator=gen)
    k, v = torch.randn(50, 2, 16, generator=gen), torch.randn(50, 2, 16, generator=gen)
    q_pos = torch.tensor(sorted(torch.randperm(50, generator=gen)[:20].tolist()))
    got = recompute.attend(q, k, v, q_pos, 0.25, window)
    assert torch.allclose(got, _naive(q, k, v, q_pos, 0.25, window), atol=1e-5)


def test_the_separator_is_found_where_a_prompt_holds_it():
    """A trailing space is a token of its own when the separator is encoded alone, but
    joins the next word in a prompt: the default " # # " was never found in text prompts
    of byte-level BPE models (SmolLM2, Llama 3, Qwen2), so blend never ran for them."""
    from transformers import AutoTokenizer

    from kvconnector.blend.segments import find_segments, separator_ids
    from kvconnector.tiny_model import build_tiny_mistral
    from tests.conftest import CACHE

    tok = AutoTokenizer.from_pretrained(build_tiny_mistral(CACHE / "tiny-mistral"))
    prompt = tok.encode("alpha beta gamma # # delta cache chunk # # token prefix",
                        add_special_tokens=False)
    alone = tok.encode(" # # ", add_special_tokens=False)
    assert len(find_segments(prompt, alone)) == 1  # not found: why this exists
    assert len(find_segments(prompt, separator_ids(tok, " # # "))) == 3
    assert separator_ids(tok, " ") == tok.encode(" ", add_special_tokens=False)  # never empty
