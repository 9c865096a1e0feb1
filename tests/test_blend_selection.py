"""The selective recompute on a toy decoder (no vLLM): which tokens each strategy recomputes,
that recomputed tokens get exactly the K/V of a full prefill, and that nothing outside the
request's blocks is written."""

from __future__ import annotations

import math

import pytest
import torch

from kvconnector.blend.config import BlendConfig
from kvconnector.blend.cost import compute_share
from kvconnector.blend.families import Geometry
from kvconnector.blend.pages import TokenPages
from kvconnector.blend.plan import BlendJob
from kvconnector.blend.recompute import LoadedPiece, Sources, attend, run_blend
from kvconnector.blend.strategies import STRATEGIES, Check, Strategy, register
from kvconnector.blend.strategies.attention import QUERY_WINDOW, attention_mass
from kvconnector.config import ConfigError, ConnectorConfig
from kvconnector.layout import describe

LAYERS, HEADS, KV_HEADS, D, HIDDEN, VOCAB, BLOCK = 3, 4, 2, 8, 32, 50, 16


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    f = pos[:, None].double() / 100.0 ** (torch.arange(0, D, 2).double() / D)
    cos, sin = torch.cos(f).repeat(1, 2)[:, None], torch.sin(f).repeat(1, 2)[:, None]
    return (x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin).to(x.dtype)


class ToyLayer:
    """The shape of ``BlendLayer``: peaked random attention, a residual stream."""

    def __init__(self, gen: torch.Generator) -> None:
        def w(i: int, o: int, s: float = 1.0) -> torch.Tensor:
            return torch.randn(i, o, generator=gen, dtype=torch.float64) * s / math.sqrt(i)
        self.wq, self.wk = w(HIDDEN, HEADS * D, 3.0), w(HIDDEN, KV_HEADS * D, 3.0)
        self.wv, self.wo, self.wm = w(HIDDEN, KV_HEADS * D), w(HEADS * D, HIDDEN), w(HIDDEN, HIDDEN)

    def norm_in(self, h, residual):
        r = h if residual is None else h + residual
        return r / r.norm(dim=-1, keepdim=True) * math.sqrt(HIDDEN), r

    def qkv(self, x, positions):
        t = x.shape[0]
        return (_rope((x @ self.wq).view(t, HEADS, D), positions),
                _rope((x @ self.wk).view(t, KV_HEADS, D), positions),
                (x @ self.wv).view(t, KV_HEADS, D))

    def post(self, o, residual):
        r = o @ self.wo + residual
        return torch.tanh(r @ self.wm), r


class ToyModel:
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
        self.layers = [ToyLayer(gen) for _ in range(LAYERS)]
        self.geometry = Geometry(LAYERS, HEADS, KV_HEADS, D, 1 / math.sqrt(D), None)
        self.device, self.dtype = torch.device("cpu"), torch.float64

    def embed(self, tokens):
        return self.table[tokens]

    def prefill(self, tokens: list[int]):
        """Per layer: K/V ``[2, T, Hkv, D]`` and queries ``[T, Hq, D]`` of a full prefill."""
        pos = torch.arange(len(tokens))
        h, residual, kvs, qs = self.embed(torch.tensor(tokens)), None, [], []
        for layer in self.layers:
            x, residual = layer.norm_in(h, residual)
            q, k, v = layer.qkv(x, pos)
            kvs.append(torch.stack([k, v]))
            qs.append(q)
            h, residual = layer.post(attend(q, k, v, pos, self.geometry.scale, None), residual)
        return kvs, qs


class NoMove:
    """Documents sit where they were stored in these tests: nothing to re-rotate."""

    def mover(self, from_pos, to_pos, device):
        assert torch.equal(from_pos, to_pos)
        return lambda key: key


PROMPT = 100  # tokens: blocks 0..5 hold [0, 96); the range ends at 96, 4 tail tokens
BLOCKS = [5, 2, 7, 0, 3, 6]  # scheduler block of each 16 tokens; blocks 1, 4, 8 are not ours
DOC = (20, 90)  # the loaded document: [20, 90)


def _blend(strategy: str, ratio: float, start: int, sink_tokens: int = 0,
           refine: tuple[int, float] = (0, 0.15), group_tokens: int = 1):
    gen = torch.Generator().manual_seed(1)
    model = ToyModel()
    tokens = torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist()
    ref, ref_q = model.prefill(tokens)
    caches = [torch.full((9, KV_HEADS, BLOCK, 2 * D), 7.0, dtype=torch.float64)
              for _ in range(LAYERS)]
    pages = TokenPages(caches, describe(caches[0], num_kv_heads=KV_HEADS, head_size=D),
                       BLOCK, KV_HEADS, D)
    ctx_ids = pages.kernel_ids(BLOCKS[:start // BLOCK])
    for li in range(LAYERS):  # vLLM's own hit before ``start``
        pages.write(li, ctx_ids, ref[li][:, :start])
    end = (PROMPT - 1) // BLOCK * BLOCK
    # The stored document's K/V: computed in another context, so off from this prompt's.
    stored = torch.stack(ref)[:, :, DOC[0]:DOC[1]]
    stored = stored + 0.5 * torch.randn(stored.shape, generator=gen, dtype=torch.float64)
    piece = LoadedPiece(DOC[0] - start, stored, DOC[0])
    sources = Sources(end - start, start, [piece], [DOC[0] - start], NoMove(), (KV_HEADS, D),
                      model.device, model.dtype)
    job = BlendJob("r", start, end, tokens[start:end], BLOCKS, [], strategy, ratio, 1, 8,
                   tail_ids=tokens[end:], sink_tokens=sink_tokens,
                   refine_layer=refine[0], refine_ratio=refine[1], group_tokens=group_tokens)
    result = run_blend(model, pages, job, sources, BLOCK)
    return model, tokens, ref, ref_q, caches, pages, stored, job, result


def _exact(pages, ref, layer: int, job) -> torch.Tensor:
    """Per range token: does its K/V in the pages equal full prefill's?"""
    got = pages.read(layer, pages.kernel_ids(BLOCKS[job.start // BLOCK:job.end // BLOCK]))
    want = ref[layer][:, job.start:job.end]
    return ((got - want).abs() < 1e-9).all(0).all(-1).all(-1)


@pytest.mark.parametrize("start", [0, 16])
def test_attention_recomputes_the_tokens_the_prompts_last_queries_attend_to(start):
    model, tokens, ref, ref_q, caches, pages, stored, job, result = _blend(
        "attention", 0.2, start)
    # The pick, from full prefill: the last QUERY_WINDOW queries at the check layer (1),
    # tail tokens included, over every key.
    pos = torch.arange(PROMPT - QUERY_WINDOW, PROMPT)
    mass = attention_mass(ref_q[1][-QUERY_WINDOW:], pos, ref[1][0], model.geometry.scale,
                          None)[start:job.end]
    loaded = torch.zeros(job.end - start, dtype=torch.bool)
    loaded[DOC[0] - start:DOC[1] - start] = True
    n_pick = math.ceil(0.2 * int(loaded.sum()))
    picked = set((torch.topk(mass.masked_fill(~loaded, -1), n_pick).indices + start).tolist())
    # Layers up to the check layer are recomputed for every token; after it, exactly the
    # picked tokens and those no document covers hold full prefill's K/V.
    assert _exact(pages, ref, 0, job).all() and _exact(pages, ref, 1, job).all()
    exact = set((_exact(pages, ref, 2, job).nonzero().squeeze(1) + start).tolist())
    assert exact == picked | (set(range(start, job.end)) - set(range(*DOC)))
    assert result.recomputed == job.end - start - int(loaded.sum()) + n_pick
    # The rest keeps the loaded K/V; nothing is written outside the request's blocks.
    rest = sorted(set(range(*DOC)) - picked)
    got = pages.read(2, pages.kernel_ids(BLOCKS))
    assert torch.equal(got[:, rest], stored[2][:, [t - DOC[0] for t in rest]])
    assert all(bool((c[[1, 4, 8]] == 7.0).all()) for c in caches)


@pytest.mark.parametrize("strategy", ["attention", "cacheblend"])
def test_sink_tokens_recompute_each_documents_first_tokens_on_top_of_the_ratio(strategy):
    _, _, ref, _, _, pages, _, job, result = _blend(strategy, 0.2, 0)
    _, _, ref, _, _, sunk, _, sink_job, sink_result = _blend(strategy, 0.2, 0, sink_tokens=6)
    picked = set(_exact(pages, ref, 2, job).nonzero().squeeze(1).tolist())
    heads = set(range(DOC[0], DOC[0] + 6))
    exact = set(_exact(sunk, ref, 2, sink_job).nonzero().squeeze(1).tolist())
    assert heads <= exact and not heads <= picked  # the check above can fail
    assert sink_result.recomputed == result.recomputed + 6  # on top of the ratio's share


@pytest.mark.parametrize("strategy", ["attention", "cacheblend"])
def test_a_refine_layer_narrows_the_pick_after_it(strategy):
    """Gradual filtering: the wide pick at the check layer gets full prefill's K/V up to
    and at the refine layer (2); after it only the narrower share is carried on."""
    _, _, ref, _, _, wide, _, job, wide_result = _blend(strategy, 0.5, 0)
    _, _, ref, _, _, narrowed, _, job2, result = _blend(strategy, 0.5, 0, refine=(2, 0.2))
    picked = _exact(wide, ref, 2, job)
    assert torch.equal(_exact(narrowed, ref, 2, job2), picked)
    loaded = DOC[1] - DOC[0]
    must = job.end - job.start - loaded
    assert wide_result.recomputed == must + math.ceil(0.5 * loaded)
    assert result.recomputed == must + math.ceil(0.2 * loaded)


def test_pick_top_takes_whole_groups_best_summed_first():
    from kvconnector.blend.recompute import pick_top

    active = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14])  # 8 is not active
    score = torch.tensor([0, 0, 0, 0, 5, 0, 0, 0, 1, 1.1, 0.9, 1.2, 0, 0])
    assert pick_top(score, active, 3, 1).tolist() == [4, 9, 11]  # plain top-k, ascending
    # Indices into ``active``. Groups of 4 tokens: 0-3 sum 0, 4-7 sum 5, 9-11 (indices
    # 8-10; token 8 is not active) sum 3, 12-14 (indices 11-13) sum 1.2.
    assert pick_top(score, active, 3, 4).tolist() == [4, 5, 6, 7]
    assert pick_top(score, active, 5, 4).tolist() == [4, 5, 6, 7, 8, 9, 10]
    forced = score.clone()
    forced[0] = torch.inf  # a token that must be recomputed brings its group
    assert pick_top(forced, active, 5, 4).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert pick_top(score, active, 14, 4).tolist() == list(range(14))
    assert pick_top(score, active, 0, 4).tolist() == []  # no share, no group
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):  # never fewer than asked, under a group more, whole aligned groups
        act = torch.sort(torch.randperm(400, generator=rng)[:250]).values
        sc = torch.rand(250, generator=rng)
        n = int(torch.randint(1, 250, (1,), generator=rng))
        got = act[pick_top(sc, act, n, 16)]
        assert n <= len(got) < n + 16
        groups = set((got // 16).tolist())
        assert sorted(got.tolist()) == [int(t) for t in act if int(t) // 16 in groups]


def test_grouped_picks_get_full_prefills_kv_on_whole_groups():
    _, _, ref, _, _, pages, _, job, result = _blend("attention", 0.3, 0, group_tokens=8)
    exact = _exact(pages, ref, 2, job)
    loaded = DOC[1] - DOC[0]
    must = job.end - job.start - loaded
    n = must + math.ceil(0.3 * loaded)
    assert n <= result.recomputed < n + 8
    assert int(exact.sum()) == result.recomputed
    by_group = exact.view(-1, 8)  # the range starts at 0: groups are rows of 8 tokens
    assert bool(((by_group.all(1)) | (~by_group.any(1))).all())  # all or none of a group
    _, _, ref, _, _, single, _, job1, _ = _blend("attention", 0.3, 0)
    assert not torch.equal(_exact(single, ref, 2, job1), exact)  # the check above can fail


def test_cacheblend_and_attention_pick_differently_and_ratio_1_is_full_prefill():
    picks = {}
    for strategy in ("cacheblend", "attention"):
        _, _, ref, _, _, pages, _, job, _ = _blend(strategy, 0.2, 0)
        picks[strategy] = set(_exact(pages, ref, 2, job).nonzero().squeeze(1).tolist())
    assert picks["cacheblend"] != picks["attention"]  # the check above can fail
    for strategy in ("cacheblend", "attention"):
        _, _, ref, _, _, pages, _, job, result = _blend(strategy, 1.0, 16)
        assert all(_exact(pages, ref, li, job).all() for li in range(LAYERS))
        assert result.recomputed == job.end - job.start


def test_attention_mass_is_causal_attention_summed_over_queries_and_heads():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, 4, 8, generator=gen), torch.randn(10, 2, 8, generator=gen)
    q_pos = torch.tensor([5, 8, 9])
    for window in (None, 3):
        got = attention_mass(q, q_pos, k, 0.5, window)
        want = torch.zeros(10)
        for a, p in enumerate(q_pos.tolist()):
            for h in range(4):
                keys = [t for t in range(p + 1) if window is None or p - t < window]
                s = torch.stack([q[a, h] @ k[t, h // 2] * 0.5 for t in keys]).softmax(0)
                want[keys] += s
        assert torch.allclose(got, want, atol=1e-6)
        assert got.sum().item() == pytest.approx(3 * 4, abs=1e-4)


# ---- a strategy of one's own (blend/strategies/) ----

FIXED = range(24, 36)  # range rows, inside the loaded document at either range start


class _Fixed(Strategy):
    """A fixed set, computed from layer 0 like epic's; no check layer."""

    name = "test-fixed"

    def first(self, knobs, must, heads):
        mask = must.clone()
        mask[FIXED.start:FIXED.stop] = True
        return mask

    def checks(self, knobs, num_layers, loaded):
        return {}


class _Latest(Strategy):
    """A picking strategy: at the check layer, the loaded tokens nearest the question."""

    name = "test-latest"

    def score(self, at: Check) -> torch.Tensor:
        assert at.tail is None and at.loaded.shape[1] > at.active.max()
        return at.positions.double()


@pytest.fixture
def registered():
    """The toy strategies registered the way a strategy's file registers itself."""
    register(_Fixed)
    register(_Latest)
    yield
    for name in (_Fixed.name, _Latest.name):
        del STRATEGIES[name]


@pytest.mark.parametrize("start", [0, 16])
def test_a_registered_strategy_is_a_config_choice_and_picks_the_tokens(registered, start):
    cfg = ConnectorConfig.from_extra_config({"blend": True, "blend_strategy": "test-fixed"})
    assert cfg.blending.strategy == "test-fixed"
    assert BlendConfig(enabled=True).for_request(
        {"blend_strategy": "test-latest"}).strategy == "test-latest"
    assert 0 < compute_share(cfg.blending, LAYERS, 200, 100, 1) < 1
    _, _, ref, _, _, pages, stored, job, result = _blend("test-fixed", 0.2, start)
    outside = set(range(start, job.end)) - set(range(*DOC))
    exact = set((_exact(pages, ref, 0, job).nonzero().squeeze(1) + start).tolist())
    fixed = {start + r for r in FIXED}
    assert exact == outside | fixed  # computed from layer 0: its pick and the rest
    assert result.recomputed == len(outside) + len(fixed)
    rest = sorted(set(range(*DOC)) - fixed)  # the loaded K/V, at every layer
    got = pages.read(LAYERS - 1, pages.kernel_ids(BLOCKS))
    assert torch.equal(got[:, rest], stored[LAYERS - 1][:, [t - DOC[0] for t in rest]])
    _, _, ref, _, _, pages, _, job, result = _blend("test-latest", 0.2, start)
    n_pick = math.ceil(0.2 * (DOC[1] - DOC[0]))
    exact = set((_exact(pages, ref, 2, job).nonzero().squeeze(1) + start).tolist())
    assert exact == outside | set(range(DOC[1] - n_pick, DOC[1]))
    assert result.recomputed == len(outside) + n_pick


def test_an_unknown_strategy_is_refused_naming_the_key_and_the_choices(registered):
    with pytest.raises(ConfigError, match=r"blend_strategy: expected one of \['attention', "
                                          r"'cacheblend', 'epic', 'test-fixed', 'test-latest'\], "
                                          r"got 'nope'"):
        ConnectorConfig.from_extra_config({"blend": True, "blend_strategy": "nope"})
    assert BlendConfig().for_request({"blend_strategy": "nope"}).strategy == "attention"
    with pytest.raises(ValueError, match="a name of its own"):
        register(_Fixed)
