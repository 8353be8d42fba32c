"""Model invariants: logits slice and muP, relative bias, attention against a from-the-spec
reference, sliding window reach, router choice vs weights, MoE dispatch, causality, MTP chain."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from helpers.models import randomize_, tiny_config
from inkfw.errors import ConfigError
from inkfw.models.inkling.layers import Attention, DenseMLP, MoE, RelativeBias, RMSNorm, Router, ShortConv
from inkfw.models.inkling.model import InklingLM

TOL = dict(atol=1e-5, rtol=1e-5)


def ids_of(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 90, shape, generator=torch.Generator().manual_seed(seed))


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- logits
def test_logits_are_the_unpadded_slice(model, cfg):
    assert (cfg.vocab_size, cfg.logits_vocab_size) == (96, 90)
    with torch.no_grad():
        h = model(ids_of(2, 7))
        logits = model.logits(h)
    assert logits.shape == (2, 7, 90)
    full = F.linear(h / cfg.logits_mup_width_multiplier, model.unembed.weight)
    assert full.shape[-1] == 96
    torch.testing.assert_close(logits, full[..., :90], **TOL)


@pytest.mark.parametrize("unpadded, expected", [(None, 96), (96, 96), (200, 96), (1, 1)])
def test_logits_vocab_size(unpadded, expected):
    cfg = tiny_config(unpadded_vocab_size=unpadded)
    assert cfg.logits_vocab_size == expected
    model = InklingLM(cfg)
    assert model.logits(torch.zeros(3, cfg.hidden_size)).shape == (3, expected)


def test_mup_division(model, cfg):
    h = randn(2, 5, cfg.hidden_size)
    with torch.no_grad():
        base = model.logits(h)
        model.cfg = dataclasses.replace(cfg, logits_mup_width_multiplier=2 * cfg.logits_mup_width_multiplier)
        halved = model.logits(h)
    assert base.abs().max() > 0.1
    torch.testing.assert_close(halved, base / 2, **TOL)


# -------------------------------------------------------------- relative bias
def test_relative_bias_formula_and_zero_beyond_extent():
    d_rel, extent, B, T, H = 3, 5, 2, 4, 2
    rb = RelativeBias(d_rel, extent)
    with torch.no_grad():
        rb.table.copy_(randn(d_rel, extent, seed=1))
    r = randn(B, T, H, d_rel, seed=2)
    distance = torch.randint(-4, extent + 4, (B, T, 6), generator=torch.Generator().manual_seed(3))
    distance[0, 0, :] = torch.tensor([-1, 0, extent - 1, extent, extent + 1, 1 << 40])
    with torch.no_grad():
        bias = rb(r, distance)
    assert bias.shape == (B, H, T, 6)
    for b in range(B):
        for t in range(T):
            for s in range(6):
                d = int(distance[b, t, s])
                for h in range(H):
                    want = float(r[b, t, h] @ rb.table[:, d].detach()) if 0 <= d < extent else 0.0
                    assert math.isclose(float(bias[b, h, t, s]), want, abs_tol=1e-6), (b, t, s, h, d)
    assert (bias[0, :, 0, [0, 3, 4, 5]] == 0).all()
    assert (bias[0, :, 0, [1, 2]] != 0).all()


# --------------------------------------------------- attention vs the spec
def ref_sconv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y[t] = x[t] + sum_k w[:, k] * x[t - (K-1) + k], zeros before position 0."""
    K, T = w.shape[-1], x.shape[1]
    y = x.clone()
    for t in range(T):
        for k in range(K):
            s = t - (K - 1) + k
            if s >= 0:
                y[:, t] += w[:, 0, k] * x[:, s]
    return y


def ref_attention(attn: Attention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    Hq, Hkv, D, R = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.d_rel
    q = attn.q_norm(attn.q_proj(x).view(B, T, Hq, D))
    k = attn.k_norm(ref_sconv(attn.k_sconv.weight, attn.k_proj(x)).view(B, T, Hkv, D))
    v = ref_sconv(attn.v_sconv.weight, attn.v_proj(x)).view(B, T, Hkv, D)
    r = attn.r_proj(x).view(B, T, Hq, R)
    table, extent = attn.rel_bias.table, attn.rel_bias.extent
    out = torch.zeros(B, T, Hq, D)
    for b in range(B):
        for i in range(T):
            p = int(positions[b, i])
            tau = 1.0
            if attn.log_scaling_n_floor is not None:
                tau = 1.0 + attn.log_scaling_alpha * math.log(max(1.0, (p + 1) / attn.log_scaling_n_floor))
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                scores = torch.full((T,), float("-inf"))
                for j in range(T):
                    dist = p - int(positions[b, j])
                    if dist < 0 or (attn.window is not None and dist >= attn.window):
                        continue
                    bias = r[b, i, h] @ table[:, dist] if dist < extent else torch.tensor(0.0)
                    scores[j] = tau * (q[b, i, h] @ k[b, j, kv]) / D + tau * bias
                out[b, i, h] = torch.softmax(scores, 0) @ v[b, :, kv]
    return attn.o_proj(out.reshape(B, T, Hq * D))


@pytest.mark.parametrize("layer", [0, 2])  # 0: local (window 8, 4 q / 1 kv heads); 2: global, log scaling
def test_attention_matches_reference(model, layer):
    attn = model.backbone.layers[layer].attn
    assert attn.local == (layer == 0)
    T = 20  # beyond the window (8) and the global rel_extent (16)
    x = randn(2, T, model.cfg.hidden_size, seed=layer)
    positions = torch.stack([torch.arange(T), torch.arange(5, 5 + T)])  # row 1 starts at position 5
    with torch.no_grad():
        got = attn(x, positions, None)
        want = ref_attention(attn, x, positions)
    torch.testing.assert_close(got, want, **TOL)


def test_attention_log_scaling_matters(model):
    """Control for the reference test: log scaling does change a global layer's output."""
    attn = model.backbone.layers[2].attn
    x = randn(1, 12, model.cfg.hidden_size, seed=7)
    pos = torch.arange(12)[None]
    with torch.no_grad():
        a = attn(x, pos, None)
        floor, attn.log_scaling_n_floor = attn.log_scaling_n_floor, None
        b = attn(x, pos, None)
        attn.log_scaling_n_floor = floor
    assert not torch.allclose(a[:, 4:], b[:, 4:], atol=1e-4)
    torch.testing.assert_close(a[:, :4], b[:, :4], **TOL)  # tau = 1 while (pos + 1) <= n_floor = 4


# ------------------------------------------------------------- sliding window
def influence(attn: Attention, T: int, t: int, hidden: int) -> list[bool]:
    """For every s <= t: does changing x[s] change the output at t?"""
    x = randn(1, T, hidden, seed=11)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        base = attn(x, pos, None)[0, t]
        out = []
        for s in range(t + 1):
            y = x.clone()
            y[0, s] += randn(hidden, seed=100 + s) * 3
            out.append(not torch.allclose(attn(y, pos, None)[0, t], base, atol=1e-6))
    return out


def test_sliding_window_without_convs(model, cfg):
    attn = model.backbone.layers[1].attn
    assert attn.local and attn.window == cfg.sliding_window == 8
    with torch.no_grad():
        attn.k_sconv.weight.zero_()
        attn.v_sconv.weight.zero_()
    t = 19
    seen = influence(attn, 20, t, cfg.hidden_size)
    assert seen == [s > t - 8 for s in range(t + 1)]  # exactly the window t-7 .. t


def test_sliding_window_reach_with_convs(model, cfg):
    attn = model.backbone.layers[1].attn
    K, W, t = cfg.conv_kernel_size, cfg.sliding_window, 19
    seen = influence(attn, 20, t, cfg.hidden_size)
    # the oldest visible key (t - W + 1) reads conv inputs back to t - W + 1 - (K - 1)
    assert seen == [s >= t - W + 1 - (K - 1) for s in range(t + 1)]


def test_global_layer_sees_everything(model, cfg):
    attn = model.backbone.layers[2].attn
    assert not attn.local
    assert all(influence(attn, 20, 19, cfg.hidden_size))


# ------------------------------------------------------------------ short conv
def test_short_conv_is_causal_with_residual():
    conv = ShortConv(6, 4, stream=0)
    with torch.no_grad():
        conv.weight.copy_(randn(6, 1, 4, seed=4))
    x = randn(2, 9, 6, seed=5)
    y = conv(x, torch.arange(9).expand(2, 9), None)
    torch.testing.assert_close(y, ref_sconv(conv.weight, x), **TOL)
    with torch.no_grad():
        conv.weight.zero_()
    torch.testing.assert_close(conv(x, torch.arange(9).expand(2, 9), None), x)


def test_short_conv_computes_in_fp32():
    conv = ShortConv(4, 3, stream=0)
    with torch.no_grad():
        conv.weight.copy_(randn(4, 1, 3, seed=6))
    x = randn(1, 5, 4, seed=7).to(torch.bfloat16)
    y = conv(x, torch.arange(5)[None], None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref_sconv(conv.weight, x.float()).to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_weights_stay_tap_major_through_init_and_load(dtype):
    """The cached path reads ``weight.permute(1, 2, 0)`` [1, K, C]; stored tap-major, that read is
    contiguous over channels, which keeps inductor's fused conv + norm kernel vectorised over
    channels (read with stride K it tiled by tokens: ~3x slower at 9 tokens). Loading and casting
    keep the layout, and a seeded init draws the values a channel-major weight would draw."""
    from pathlib import Path

    from inkfw.models.inkling.checkpoint import load_model

    model, _ = load_model(Path(__file__).parents[1] / "checkpoints" / "inkling-tiny", dtype=dtype)
    convs = [m for m in model.modules() if isinstance(m, ShortConv)]
    assert len(convs) == 80
    assert all(c.weight.dtype == torch.float32 and c.weight.permute(1, 2, 0).is_contiguous() for c in convs)

    tap_major, channel_major = InklingLM(tiny_config()), InklingLM(tiny_config())
    for m in channel_major.modules():
        if isinstance(m, ShortConv):
            m.weight = torch.nn.Parameter(m.weight.detach().contiguous())
    for lm in (tap_major, channel_major):
        torch.manual_seed(3)
        lm.init_weights()
    convs = [m for m in tap_major.modules() if isinstance(m, ShortConv)]
    assert convs and all(c.weight.permute(1, 2, 0).is_contiguous() for c in convs)
    for (name, a), b in zip(tap_major.state_dict().items(), channel_major.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_rmsnorm():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(8, seed=8))
    x = randn(3, 8, seed=9) * 7
    want = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), want, **TOL)


# ----------------------------------------------------------------------- MoE
@pytest.fixture
def router(cfg) -> Router:
    r = Router(cfg)
    with torch.no_grad():
        r.weight.copy_(randn(*r.weight.shape, seed=12) * 0.5)
        r.global_scale.fill_(1.3)
    return r


def ref_weights(router: Router, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of a given choice from the spec: normalised sigmoids of the chosen routed and the
    shared logits (log-sigmoid, normalised), times route_scale * global_scale."""
    logits = x @ router.weight.T
    E = router.num_routed
    s = torch.cat([logits[:, :E].gather(1, ids), logits[:, E:]], 1).sigmoid()
    w = s / s.sum(1, keepdim=True) * router.route_scale * router.global_scale
    return w[:, : ids.shape[1]], w[:, ids.shape[1] :]


def as_dict(ids: torch.Tensor, w: torch.Tensor) -> list[dict[int, float]]:
    return [{int(i): float(v) for i, v in zip(row_ids, row_w)} for row_ids, row_w in zip(ids, w)]


def assert_same_weights(ids1, w1, ids2, w2) -> None:
    """Same experts per token with the same weights (top-k order may differ)."""
    for d1, d2 in zip(as_dict(ids1, w1), as_dict(ids2, w2), strict=True):
        assert d1.keys() == d2.keys()
        assert all(math.isclose(d1[e], d2[e], abs_tol=1e-6) for e in d1)


def test_router_choice_is_topk_with_bias(router, cfg):
    x = randn(16, cfg.hidden_size, seed=13)
    with torch.no_grad():
        router.score_bias.copy_(randn(cfg.n_routed_experts, seed=14) * 0.3)
        ids, w, gammas = router(x)
    assert ids.shape == w.shape == (16, cfg.num_experts_per_tok) and gammas.shape == (16, cfg.n_shared_experts)
    choice = (x @ router.weight[: cfg.n_routed_experts].T).sigmoid() + router.score_bias
    want = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    assert [set(r.tolist()) for r in ids] == [set(r.tolist()) for r in want]
    rw, rg = ref_weights(router, x, ids)
    torch.testing.assert_close(w, rw, **TOL)
    torch.testing.assert_close(gammas, rg, **TOL)
    total = w.sum(1) + gammas.sum(1)
    torch.testing.assert_close(total, torch.full((16,), cfg.route_scale * 1.3), **TOL)


def test_router_bias_steers_choice_not_weights(router, cfg):
    x = randn(16, cfg.hidden_size, seed=15)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        ids0, w0, g0 = router(x)
        # a bias that favours the last k experts over everything: the choice changes ...
        router.score_bias.copy_(torch.zeros(E))
        router.score_bias[E - k :] = 10.0
        ids1, w1, g1 = router(x)
        assert all(set(r.tolist()) == set(range(E - k, E)) for r in ids1)
        assert [set(r.tolist()) for r in ids0] != [set(r.tolist()) for r in ids1]
        # ... and the weights are those of the new choice, with no trace of the bias
        rw, rg = ref_weights(router, x, ids1)
        torch.testing.assert_close(w1, rw, **TOL)
        torch.testing.assert_close(g1, rg, **TOL)
        # a different bias that leaves the choice as it is leaves the weights as they are
        router.score_bias[E - k :] = 3.0
        router.score_bias[: E - k] = -0.5
        ids2, w2, g2 = router(x)
    assert_same_weights(ids1, w1, ids2, w2)
    torch.testing.assert_close(g2, g1, atol=0, rtol=0)


def test_router_bias_is_not_in_the_weights_per_token(router, cfg):
    """A uniform shift of the bias keeps every token's choice, so the weights do not move."""
    x = randn(8, cfg.hidden_size, seed=16)
    with torch.no_grad():
        ids, w, g = router(x)
        for delta in (0.5, -2.0, 7.0):
            router.score_bias.add_(delta)  # a uniform shift never changes a top-k
            ids2, w2, g2 = router(x)
            assert_same_weights(ids, w, ids2, w2)
            torch.testing.assert_close(g2, g, **TOL)


def ref_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    ids, w, gammas = moe.router(x)
    width = moe.experts_down.shape[-1]  # intermediate size

    def expert(gate_up, down, v):
        gate, up = gate_up[:width] @ v, gate_up[width:] @ v
        return down @ (F.silu(gate) * up)

    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for s in range(moe.shared_gate_up.shape[0]):
            out[n] += gammas[n, s] * expert(moe.shared_gate_up[s], moe.shared_down[s], x[n])
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            out[n] += w[n, j] * expert(moe.experts_gate_up[e], moe.experts_down[e], x[n])
    return out


def test_moe_matches_per_token_reference(model, cfg):
    moe = model.backbone.layers[1].mlp
    assert isinstance(moe, MoE)
    x = randn(2, 9, cfg.hidden_size, seed=17)
    with torch.no_grad():
        got = moe(x)
        want = ref_moe(moe, x.reshape(-1, cfg.hidden_size)).view_as(x)
    torch.testing.assert_close(got, want, **TOL)


def test_dense_mlp(model, cfg):
    mlp = model.backbone.layers[0].mlp
    assert isinstance(mlp, DenseMLP)
    x = randn(5, cfg.hidden_size, seed=18)
    width = cfg.intermediate_size
    want = (F.silu(x @ mlp.gate_up[:width].T) * (x @ mlp.gate_up[width:].T)) @ mlp.down.T * mlp.global_scale
    torch.testing.assert_close(mlp(x), want, **TOL)


def test_layer_kinds(model, cfg):
    kinds = [(blk.attn.local, isinstance(blk.mlp, MoE)) for blk in model.backbone.layers]
    assert kinds == [(True, False), (True, True), (False, True), (True, True)]
    assert [d.block.attn.local for d in model.mtp.depths] == [True, False, True]
    assert all(isinstance(d.block.mlp, DenseMLP) for d in model.mtp.depths)
    assert model.backbone.layers[2].attn.rel_bias.extent == cfg.rel_extent
    assert model.backbone.layers[0].attn.rel_bias.extent == cfg.sliding_window


# ------------------------------------------------------------------ causality
def test_causality(model):
    T, t = 14, 6
    ids = ids_of(2, T, seed=19)
    other = ids.clone()
    other[:, t + 1 :] = ids_of(2, T - t - 1, seed=20)
    assert (other[:, t + 1 :] != ids[:, t + 1 :]).any()
    with torch.no_grad():
        a, b = model.logits(model(ids)), model.logits(model(other))
    # equal up to rounding: the MoE groups tokens per expert, so batch composition moves the last bit
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], **TOL)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :], atol=1e-3)


def test_mtp_chain_causality(model):
    """g_{d+1}[t] reads tokens up to x[t+d+1] and nothing later."""
    T, t = 14, 4
    ids = ids_of(1, T, seed=21)
    with torch.no_grad():
        base = model.mtp_chain(model(ids), ids)
        for d in range(3):
            cut = t + d + 1  # last token depth d may read at position t
            other = ids.clone()
            other[:, cut + 1 :] = (ids[:, cut + 1 :] + 1) % 90
            got = model.mtp_chain(model(other), other)
            torch.testing.assert_close(got[d][:, : t + 1], base[d][:, : t + 1], **TOL)
            other = ids.clone()
            other[:, cut] = (ids[:, cut] + 1) % 90
            got = model.mtp_chain(model(other), other)
            assert not torch.allclose(got[d][:, t], base[d][:, t], atol=1e-4)


def test_mtp_chain_is_the_spec(model, cfg):
    """Depth d: input_proj(cat[hidden_norm(g_d), embed_norm(backbone_embed_norm(E[x[t+d+1]]))]),
    block, chain_norm."""
    ids = ids_of(1, 10, seed=22)
    with torch.no_grad():
        h = model(ids)
        chain = model.mtp_chain(h, ids)
        g = h
        for d, depth in enumerate(model.mtp.depths):
            nxt = F.pad(ids[:, d + 1 :], (0, d + 1))
            e = model.backbone.embed_norm(model.backbone.embed(nxt))
            z = depth.input_proj(torch.cat([depth.hidden_norm(g), depth.embed_norm(e)], -1))
            g = model.mtp.chain_norm(depth.block(z, torch.arange(10)[None], None))
            torch.testing.assert_close(chain[d], g, **TOL)


def test_mtp_embed_source(cfg):
    ids = ids_of(1, 5, seed=23)
    torch.manual_seed(0)
    a = randomize_(InklingLM(cfg, mtp_depths=1))
    b = InklingLM(cfg, mtp_depths=1, embed_source="raw")
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(a.mtp_embed(ids), a.backbone.embed_norm(a.backbone.embed(ids)))
        torch.testing.assert_close(b.mtp_embed(ids), a.backbone.embed(ids))
        assert not torch.allclose(
            a.mtp_step(0, a(ids), ids, torch.arange(5)[None]),
            b.mtp_step(0, b(ids), ids, torch.arange(5)[None]),
            atol=1e-4,
        )
    with pytest.raises(ConfigError, match="embed_source"):
        InklingLM(cfg, embed_source="normed")


@pytest.mark.parametrize("T", [1, 2, 3])
def test_mtp_chain_short_sequence(model, T):
    """A prompt shorter than the number of depths (docs/design.md §2: even one token) still gets a
    chain: every depth returns [B, T, H], equal to the chain over the sequence padded with 0."""
    ids = ids_of(2, T, seed=24)
    padded = F.pad(ids, (0, 4))
    with torch.no_grad():
        chain = model.mtp_chain(model(ids), ids)
        want = model.mtp_chain(model(padded), padded)
    assert len(chain) == 3
    for got, ref in zip(chain, want):
        assert got.shape == (2, T, model.cfg.hidden_size)
        torch.testing.assert_close(got, ref[:, :T], **TOL)
