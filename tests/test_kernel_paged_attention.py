"""Paged span attention (inkfw/kernels/paged_attention.py): the torch reference against what
``Attention.forward`` computes over a real paged cache (global layer with log scaling, sliding
layer with evicted blocks, an invalidated slot, a padding row), the reference against a per-query
restatement of the definition, and the Triton kernel (interpreter, fp32) against the reference on
random ragged batches: padded and all-masked rows, GQA and plain heads, sizes that are not powers
of two, spans crossing blocks, stale slots, missing blocks, windows that evict blocks, tau given
or not, one split, several, more splits than key tiles, and the default."""

from __future__ import annotations

import random

import pytest
import torch

from inkfw.cache.interface import EMPTY_POSITION
from inkfw.cache.paged import PagedKVManager
from inkfw.errors import ConfigError
from inkfw.kernels.paged_attention import paged_span_attention_reference, paged_span_attention_triton
from inkfw.models.inkling.layers import AttentionTerms

pytestmark = pytest.mark.kernel


def random_case(
    seed: int,
    *,
    B: int,
    T: int,
    Hq: int,
    Hkv: int,
    D: int,
    d_rel: int,
    extent: int,
    bs: int,
    W: int,
    window: int | None,
    with_tau: bool,
) -> dict:
    """A ragged batch over hand-built pools. Row 0 is padding (no blocks); every other row holds
    blocks from logical block ``base`` on, some columns missing (-1), some slots stale (a previous
    owner's position or empty), positions past the span written too (rejected drafts); its queries
    end inside its last block and the unused query rows sit at position 0, before the row's first
    key when base > 0 (all masked)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = B * W + 3
    num_slots = (num_blocks + 1) * bs
    k_pool = torch.randn(num_slots, Hkv, D, generator=gen)
    v_pool = torch.randn(num_slots, Hkv, D, generator=gen)
    # blocks no row holds carry tags too: they must never be read
    slot_pos = torch.randint(0, W * bs, (num_slots,), generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    table = torch.full((B, W), -1, dtype=torch.long)
    base = torch.zeros(B, dtype=torch.long)
    q_positions = torch.zeros(B, T, dtype=torch.long)
    for b in range(1, B):
        first = rng.randint(1, 3) if b % 2 else rng.randint(0, 2)
        held = rng.randint(2, W)
        last = (first + held) * bs - 1 - rng.randint(0, bs - 1)  # the span's last query
        base[b] = first
        for c in range(held):
            block = free.pop()
            slot_pos[block * bs : (block + 1) * bs] = EMPTY_POSITION
            if rng.random() < 0.15:
                continue  # a column with no block (evicted / never given)
            table[b, c] = block
            for o in range(bs):
                p = (first + c) * bs + o
                u = rng.random()
                if u < 0.1:
                    slot_pos[block * bs + o] = p + bs * rng.randint(1, 3)  # a previous owner's position
                elif u < 0.15:
                    slot_pos[block * bs + o] = EMPTY_POSITION  # invalidated
                elif p <= last + rng.randint(0, 3):
                    slot_pos[block * bs + o] = p
        queries = rng.randint(1, T)
        q_positions[b, :queries] = torch.arange(last - queries + 1, last + 1)
    return dict(
        q=torch.randn(B, T, Hq, D, generator=gen),
        k_pool=k_pool,
        v_pool=v_pool,
        slot_pos=slot_pos,
        table=table,
        base=base,
        q_positions=q_positions,
        r=torch.randn(B, T, Hq, d_rel, generator=gen),
        rel_table=torch.randn(d_rel, extent, generator=gen),
        block_size=bs,
        window=window,
        tau=1.0 + 0.5 * torch.rand(B, T, generator=gen) if with_tau else None,
        scale=1.0 / D,
    )


def attention_by_definition(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, Hq, D], seen [B, T]: the query has a visible key), one query at a time, keys
    found by walking the table with Python ints."""
    q, k_pool, v_pool, r, rel = case["q"], case["k_pool"], case["v_pool"], case["r"], case["rel_table"]
    table, base, tags, bs, window = (
        case["table"].tolist(),
        case["base"].tolist(),
        case["slot_pos"],
        case["block_size"],
        case["window"],
    )
    B, T, Hq, D = q.shape
    group, extent = Hq // k_pool.shape[1], rel.shape[1]
    out, seen = torch.zeros(B, T, Hq, D), torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            qp = int(case["q_positions"][b, t])
            slots, dists = [], []
            for c, block in enumerate(table[b]):
                for o in range(bs):
                    p = (base[b] + c) * bs + o
                    if block < 0 or int(tags[block * bs + o]) != p or qp - p < 0:
                        continue
                    if window is not None and qp - p >= window:
                        continue
                    slots.append(block * bs + o)
                    dists.append(qp - p)
            if not slots:
                continue
            seen[b, t] = True
            tau = 1.0 if case["tau"] is None else float(case["tau"][b, t])
            heads = torch.arange(Hq) // group
            keys = k_pool[slots][:, heads]  # [S, Hq, D]
            values = v_pool[slots][:, heads]
            bias = torch.stack([r[b, t] @ rel[:, d] if d < extent else torch.zeros(Hq) for d in dists], dim=-1)
            scores = case["scale"] * torch.einsum("hd,shd->hs", tau * q[b, t], keys) + tau * bias  # [Hq, S]
            out[b, t] = torch.einsum("hs,shd->hd", scores.softmax(-1), values)
    return out, seen


CASES = {
    # name: (seed, sizes, num_splits)
    "gqa-tau-one-split": (
        1,
        dict(B=4, T=5, Hq=4, Hkv=2, D=12, d_rel=3, extent=10, bs=8, W=12, window=None, with_tau=True),
        1,
    ),
    "gqa-tau-three-splits": (
        2,
        dict(B=4, T=5, Hq=4, Hkv=2, D=12, d_rel=3, extent=10, bs=8, W=12, window=None, with_tau=True),
        3,
    ),
    "decode-window-evicts": (
        3,
        dict(B=4, T=1, Hq=3, Hkv=3, D=10, d_rel=5, extent=13, bs=4, W=24, window=13, with_tau=False),
        2,
    ),
    "span-window-default-splits": (
        4,
        dict(B=3, T=7, Hq=2, Hkv=2, D=16, d_rel=4, extent=20, bs=16, W=6, window=20, with_tau=False),
        None,
    ),
    "span32-more-splits-than-tiles": (
        5,
        dict(B=3, T=32, Hq=2, Hkv=1, D=9, d_rel=2, extent=7, bs=8, W=10, window=None, with_tau=True),
        5,
    ),
    "two-row-blocks-window-tau": (
        6,
        dict(B=3, T=20, Hq=8, Hkv=2, D=8, d_rel=4, extent=30, bs=4, W=20, window=24, with_tau=True),
        2,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name):
    seed, sizes, num_splits = CASES[name]
    case = random_case(seed, **sizes)
    want = paged_span_attention_reference(**case, num_splits=num_splits)
    got = paged_span_attention_triton(**case, num_splits=num_splits)
    assert got.shape == case["q"].shape and got.dtype == case["q"].dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the batch exercises what it claims: rows with visible keys and all-masked rows (zeros, no NaN)
    _, seen = attention_by_definition(case)
    assert seen.any() and (~seen).any()
    assert torch.all(got[~seen] == 0) and not got.isnan().any()


@pytest.mark.parametrize("name", ["gqa-tau-one-split", "decode-window-evicts", "two-row-blocks-window-tau"])
def test_reference_matches_definition(name):
    seed, sizes, _ = CASES[name]
    case = random_case(seed, **sizes)
    want, seen = attention_by_definition(case)
    got = paged_span_attention_reference(**case)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # stale and missing slots matter here: reading them as ordinary keys changes the result
    assert (case["table"] == -1).any() and seen.any() and (~seen).any()


def test_splitting_changes_nothing_but_rounding():
    seed, sizes, _ = CASES["gqa-tau-three-splits"]
    case = random_case(seed, **sizes)
    outs = [paged_span_attention_triton(**case, num_splits=n) for n in (1, 2, 4)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-6, atol=1e-6)


def test_bad_arguments_are_named():
    case = random_case(0, B=2, T=2, Hq=4, Hkv=2, D=8, d_rel=2, extent=4, bs=4, W=2, window=None, with_tau=False)
    with pytest.raises(ConfigError, match="num_splits"):
        paged_span_attention_triton(**case, num_splits=0)
    with pytest.raises(ConfigError, match="k_pool"):
        paged_span_attention_reference(**{**case, "k_pool": case["k_pool"][:, :, :4]})
    with pytest.raises(ConfigError, match="tau"):
        paged_span_attention_triton(**{**case, "tau": torch.ones(2, 3)})


# ---------------------------------------------------------------- against the model over a real cache
def _capture(attn) -> tuple[dict, list]:
    """Hooks that record the layer's normed q [B, T, Hq, D], r [B, T, Hq, d_rel] and the attention
    output before o_proj [B, T, Hq * D]."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        attn.q_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o)),
        attn.r_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("r", o)),
        attn.o_proj.register_forward_pre_hook(lambda m, i: seen.__setitem__("out", i[0])),
    ]
    return seen, hooks


@pytest.mark.parametrize("layer", [2, 0], ids=["global-log-scaled", "sliding"])
@torch.no_grad()
def test_reference_matches_attention_over_paged_cache(model, layer):
    """Prefill three requests chunk by chunk through one attention layer of the tiny model
    (block size 4, window 8), invalidate one past position, free the sliding group's blocks that
    left the window, then run a span batch with a padding row and padded queries: the reference on
    the pools, tables and captured q/r equals the layer's attention output wherever a query has a
    visible key (the kernel too), and is zero elsewhere."""
    torch.manual_seed(1)
    attn, cfg = model.backbone.layers[layer].attn, model.cfg
    assert (attn.window is None) == (layer == 2)
    bs = 4
    kv = PagedKVManager(model, block_size=bs, enable_prefix_caching=False, max_num_seqs=4, max_model_len=64)
    lengths = {"a": 23, "b": 9, "c": 30}
    span = 5  # queries per row of the checked step
    for rid, n in lengths.items():
        kv.add(rid, [1] * n)
        assert kv.ensure(rid, n + span, 0)
    rids = list(lengths)

    def run(positions: torch.Tensor, valid: torch.Tensor, rows: list) -> list:
        caches = kv.target_caches(rows, positions, valid)
        x = torch.randn(*positions.shape, cfg.hidden_size)
        attn(x, positions, caches[layer], AttentionTerms(positions))
        return caches

    for start in range(0, max(lengths.values()), 7):  # chunked prefill, ragged, padded with valid=False
        positions = torch.tensor([[min(start + j, n - 1) for j in range(7)] for n in lengths.values()])
        valid = torch.tensor([[start + j < n for j in range(7)] for n in lengths.values()])
        run(positions, valid, rids)
    # a past position of row "c" stops being readable (as a drafter gap is forgotten)
    kv_group = kv.target_layout[layer][0]
    forget = torch.tensor([[lengths["c"] - 4]])
    kv.forget_from(kv.step_tables([kv_group], ["c"], [0], [lengths["c"]]), forget, torch.ones(1, 1, dtype=torch.bool))
    for rid, n in lengths.items():
        kv.trim(rid, n - 2)  # sliding group: blocks before the window of the span's first query go

    # the step: rows a, b, c re-query from n - 2 (overwriting n-2, n-1) and a padding row (None)
    rows = [*rids, None]
    positions = torch.tensor([[n - 2 + j for j in range(span)] for n in lengths.values()] + [[0] * span])
    valid = torch.tensor([[j < (span if rid != "b" else 2) for j in range(span)] for rid in rows])
    positions = torch.where(valid, positions, 0)
    seen, hooks = _capture(attn)
    try:
        caches = run(positions, valid, rows)
    finally:
        for h in hooks:
            h.remove()

    cache = caches[layer]
    view = cache.kv_view
    B, T = positions.shape
    terms = AttentionTerms(positions)
    tau = None if attn.log_scaling_n_floor is None else terms.tau(attn.log_scaling_n_floor, attn.log_scaling_alpha)
    args = dict(
        q=seen["q"],
        k_pool=cache.kv[0],
        v_pool=cache.kv[1],
        slot_pos=view.group.slot_pos,
        table=view.table,
        base=view.base,
        q_positions=positions,
        r=seen["r"].view(B, T, attn.num_heads, attn.d_rel),
        rel_table=attn.rel_bias.table,
        block_size=bs,
        window=attn.window,
        tau=None if tau is None else tau.view(B, T),
        scale=1.0 / attn.head_dim,
    )
    assert (tau is not None) == (layer == 2)
    if layer == 0:  # the window evicted blocks of rows a and c: their tables start past logical block 0
        assert view.base[0] > 0 and view.base[2] > 0
    want = seen["out"].view(B, T, attn.num_heads, attn.head_dim)
    got = paged_span_attention_reference(**args)

    _, key_positions = view.keys()
    distance = positions[:, :, None] - key_positions[:, None, :]  # [B, T, S]
    visible = (distance >= 0) & (distance < (attn.window or EMPTY_POSITION))
    has_key = visible.any(-1)  # [B, T]
    assert has_key[:3].all() and not has_key[3].any()
    # the forgotten position is inside the table's range but unreadable
    assert (lengths["c"] - 4) not in key_positions[2].tolist()
    torch.testing.assert_close(got[has_key], want[has_key], rtol=1e-5, atol=1e-5)
    assert torch.all(got[~has_key] == 0)
    torch.testing.assert_close(paged_span_attention_triton(**args, num_splits=2), got, rtol=1e-5, atol=1e-5)
