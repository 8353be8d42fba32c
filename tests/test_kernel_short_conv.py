"""The cached short convolution (inkfw/kernels/short_conv.py): the Triton kernel (interpreter, fp32)
against the torch reference, the reference against a per-token loop of its definition on
hand-built pools (stale, never-written and unmapped slots, evicted blocks), and the reference
against the model's path, ``ShortConv`` over ``PagedLayerCache``, on a real ``PagedKVManager``
through a run of ragged, padded, rolled-back steps."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.models import tiny_config
from inkfw.cache.interface import EMPTY_POSITION
from inkfw.cache.paged import PagedKVManager, slots_of
from inkfw.errors import ConfigError
from inkfw.kernels.short_conv import cached_short_conv_reference, cached_short_conv_triton
from inkfw.models.inkling.layers import ShortConv
from inkfw.models.inkling.model import InklingLM

pytestmark = pytest.mark.kernel


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- hand-built pools
def _hand_built(seed: int, S: int, B: int, T: int, C: int, K: int, bs: int = 4, W: int = 4) -> dict:
    """A conv pool of ``B * W + 1`` blocks (the last one: scratch) with every row's blocks from
    logical block ``base`` on (some columns -1), spans of ragged length (a fully padded row, a
    prompt start shorter than K), and slot tags that are right, stale or empty, as StepView
    leaves them: the tags of the span's own valid, mapped tokens set."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = B * W
    num_slots = (num_blocks + 1) * bs
    table = torch.randperm(num_blocks, generator=g)[: B * W].view(B, W).clone()  # [B, W] distinct blocks
    table[torch.rand(B, W, generator=g) < 0.2] = -1
    base = torch.tensor([rng.randint(0, 3) for _ in range(B)])  # [B] > 0: earlier blocks evicted
    base[0] = 0
    lengths = [rng.randint(1, T) for _ in range(B)]
    lengths[-1] = 0  # a padding row
    first = [rng.randint(int(base[b]) * bs, int(base[b] + W) * bs - 1) for b in range(B)]
    first[0] = 0  # a prompt start: the window reaches before position 0
    positions = torch.tensor([[first[b] + t for t in range(T)] for b in range(B)])  # [B, T]
    positions[-1] = 0
    valid = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # [B, T]

    # tags: each mapped slot holds its own position (60%), a stale one (20%) or nothing
    slot_pos = torch.full((num_slots,), EMPTY_POSITION, dtype=torch.long)
    for b in range(B):
        for c in range(W):
            if table[b, c] < 0:
                continue
            for o in range(bs):
                own = (int(base[b]) + c) * bs + o
                u = rng.random()
                tag = own if u < 0.6 else own + bs * rng.choice([-2, -1, 1, W]) if u < 0.8 else EMPTY_POSITION
                slot_pos[int(table[b, c]) * bs + o] = tag
    for b in range(B):
        for t in range(lengths[b]):
            slot = _slot_of(table, base, b, int(positions[b, t]), bs)
            if slot is not None:
                slot_pos[slot] = positions[b, t]
    store = [torch.randn(num_slots, C, generator=g) for _ in range(S)]
    return dict(
        x=torch.randn(S, B, T, C, generator=g),
        weight=torch.randn(S, C, K, generator=g) * 0.5,
        store=store,
        slot_pos=slot_pos,
        table=table,
        base=base,
        positions=positions,
        valid=valid,
        bs=bs,
    )


def _slot_of(table: torch.Tensor, base: torch.Tensor, b: int, q: int, bs: int) -> int | None:
    column = q // bs - int(base[b])
    if q < 0 or not 0 <= column < table.shape[1] or table[b, column] < 0:
        return None
    return int(table[b, column]) * bs + q % bs


def _loop_definition(case: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """y and the stores after the call, token by token from the definition."""
    x, weight, table, base, bs = case["x"], case["weight"], case["table"], case["base"], case["bs"]
    S, B, T, C = x.shape
    K = weight.shape[-1]
    store = [s.clone() for s in case["store"]]
    for b in range(B):
        for t in range(T):
            slot = _slot_of(table, base, b, int(case["positions"][b, t]), bs)
            if case["valid"][b, t] and slot is not None:
                for s in range(S):
                    store[s][slot] = x[s, b, t]
    y = torch.empty_like(x)
    for s in range(S):
        for b in range(B):
            for t in range(T):
                out = x[s, b, t].clone()
                for j in range(K):
                    q = int(case["positions"][b, t]) - (K - 1) + j
                    slot = _slot_of(table, base, b, q, bs)
                    if slot is not None and int(case["slot_pos"][slot]) == q:
                        out += weight[s, :, j] * store[s][slot]
                y[s, b, t] = out
    return y, store


def _call(fn, case: dict, store: list[torch.Tensor]) -> torch.Tensor:
    return fn(
        case["x"],
        case["weight"],
        store,
        case["slot_pos"],
        case["table"],
        case["base"],
        case["positions"],
        case["valid"],
        block_size=case["bs"],
    )


@pytest.mark.parametrize("K", [3, 4])
@pytest.mark.parametrize("S", [1, 2])
@pytest.mark.parametrize("T, C", [(1, 5), (4, 12), (9, 7)])
def test_matches_definition_on_hand_built_pools(K, S, T, C):
    case = _hand_built(seed=100 * K + 10 * S + T, S=S, B=4, T=T, C=C, K=K)
    y_loop, store_loop = _loop_definition(case)
    ref_store = [s.clone() for s in case["store"]]
    tri_store = [s.clone() for s in case["store"]]
    y_ref = _call(cached_short_conv_reference, case, ref_store)
    y_tri = _call(cached_short_conv_triton, case, tri_store)
    assert y_ref.shape == y_tri.shape == (S, 4, T, C) and y_tri.dtype == torch.float32
    _close(y_ref, y_loop)
    _close(y_tri, y_ref)
    for s in range(S):
        # written slots hold x, every other slot (the scratch block too) is untouched
        torch.testing.assert_close(ref_store[s], store_loop[s], rtol=0, atol=0)
        torch.testing.assert_close(tri_store[s], store_loop[s], rtol=0, atol=0)
    # the case exercises what it claims: windows that read the pool, the span, and nothing
    conv = y_ref - case["x"]
    assert (conv.abs().sum(-1) == 0).any() and (conv.abs().sum(-1) > 0).any()
    assert int(case["base"].max()) > 0


def test_channels_over_several_programs():
    """C larger than one program's channel block (1024): the second block reads and writes too."""
    case = _hand_built(seed=7, S=2, B=2, T=3, C=1030, K=4)
    ref_store = [s.clone() for s in case["store"]]
    tri_store = [s.clone() for s in case["store"]]
    y_ref = _call(cached_short_conv_reference, case, ref_store)
    y_tri = _call(cached_short_conv_triton, case, tri_store)
    _close(y_tri, y_ref)
    for s in range(2):
        torch.testing.assert_close(tri_store[s], ref_store[s], rtol=0, atol=0)
    assert not torch.equal(ref_store[0][:, 1024:], case["store"][0][:, 1024:])  # the tail channels were written


def test_in_span_inputs_are_seen_before_the_pool_holds_them():
    """One row, prefill of positions 0..5 into empty slots: every window reads only this span's
    inputs, which no launch could have stored yet; y equals the uncached causal conv."""
    g = torch.Generator().manual_seed(3)
    S, T, C, K, bs = 2, 6, 3, 4, 4
    x = torch.randn(S, 1, T, C, generator=g)
    weight = torch.randn(S, C, K, generator=g)
    table = torch.tensor([[2, 0, -1]])
    positions = torch.arange(T)[None]
    slot_pos = torch.full((4 * bs,), EMPTY_POSITION, dtype=torch.long)
    slot_pos[torch.tensor([8, 9, 10, 11, 0, 1])] = positions[0]  # StepView's tags
    args = (slot_pos, table, torch.zeros(1, dtype=torch.long), positions, torch.ones(1, T, dtype=torch.bool))
    y_ref = cached_short_conv_reference(x, weight, [torch.zeros(4 * bs, C) for _ in range(S)], *args, block_size=bs)
    y_tri = cached_short_conv_triton(x, weight, [torch.zeros(4 * bs, C) for _ in range(S)], *args, block_size=bs)
    for s in range(S):
        conv = ShortConv(C, K, stream=s)
        with torch.no_grad():
            conv.weight.copy_(weight[s][:, None])
        _close(y_ref[s], conv(x[s], positions, None))
    _close(y_tri, y_ref)
    # the same span listed latest position first: the interpreter runs the readers of earlier
    # positions before their writers, so only inputs taken from the span itself get this right
    order = torch.arange(T - 1, -1, -1)
    args = (slot_pos, table, torch.zeros(1, dtype=torch.long), positions[:, order], torch.ones(1, T, dtype=torch.bool))
    pools = [torch.zeros(4 * bs, C) for _ in range(S)]
    y_tri_reversed = cached_short_conv_triton(x[:, :, order], weight, pools, *args, block_size=bs)
    _close(y_tri_reversed, y_ref[:, :, order])
    torch.testing.assert_close(pools[0][torch.tensor([8, 9, 10, 11, 0, 1])], x[0, 0], rtol=0, atol=0)


def test_rejects_mismatched_streams():
    case = _hand_built(seed=1, S=2, B=2, T=2, C=4, K=3)
    with pytest.raises(ConfigError, match="streams"):
        _call(cached_short_conv_triton, case, case["store"][:1])
    case["weight"] = case["weight"][:, :3]
    with pytest.raises(ConfigError, match="weight"):
        _call(cached_short_conv_reference, case, case["store"])


# --------------------------------------------------------------------------- the model's path
@pytest.mark.parametrize("K", [3, 4])
def test_reference_and_kernel_match_the_model_path(K):
    """Several steps of three requests (one prompt shorter than K) and a padding row over a real
    PagedKVManager (block size 4, windows trimmed: base > 0): the model's ShortConv over the
    PagedLayerCache, the reference and the kernel give the same y, and leave the same pool (but
    for the scratch block, which only the model's path writes)."""
    cfg = tiny_config(conv_kernel_size=K, swa_head_dim=6, head_dim=6, hidden_size=20)
    kv = PagedKVManager(
        InklingLM(cfg, mtp_depths=0),
        block_size=4,
        num_window_blocks=24,
        enable_prefix_caching=False,
        max_model_len=64,
        max_num_seqs=4,
    )
    bs, T = kv.block_size, 6
    _, conv_gi, layer = kv.target_layout[0]
    group = kv.groups[conv_gi]
    scratch = group.scratch_slot
    torch.manual_seed(K)
    rng = random.Random(K)
    c_kv, c_hidden = group.layers[layer][0].shape[1], group.layers[layer][2].shape[1]
    convs = [ShortConv(c, K, stream) for stream, c in enumerate((c_kv, c_kv, c_hidden))]
    with torch.no_grad():
        for conv in convs:
            conv.weight.normal_(0.0, 0.5)
    prompts = {"a": K - 2, "b": 13, "c": 7}
    for rid in prompts:
        kv.add(rid, [0] * prompts[rid])
    cursor = dict.fromkeys(prompts, 0)  # next position to compute
    seen_base = seen_pool_reads = seen_forgotten = 0
    for _ in range(5):
        # ragged spans: prompt chunks, decode (T = 1) and verify spans
        step = []
        for rid, prompt in prompts.items():
            n = min(rng.randint(1, T), prompt - cursor[rid]) if cursor[rid] < prompt else rng.choice([1, T // 2, T])
            step.append((rid, cursor[rid], n))
        rows: list[tuple[str | None, int, int]] = [*step]
        rows.insert(rng.randrange(len(rows) + 1), (None, 0, 0))  # a padding row
        positions = torch.tensor([[first + t for t in range(T)] for _, first, _ in rows])  # [B, T], padding continues
        valid = torch.arange(T)[None, :] < torch.tensor([n for _, _, n in rows])[:, None]  # [B, T]
        for rid, first, n in step:
            assert kv.ensure(rid, first + n, 0)
            kv.trim(rid, first)
        rids = [rid for rid, _, _ in rows]
        ends = [first + n for _, first, n in rows]
        tables = kv.step_tables(kv.group_indices(), rids, [first for _, first, _ in rows], ends, width=lambda w: w + 1)
        cache = kv.caches_from(tables, positions, valid)[0]  # sets the slot tags of this step
        table, base = tables[conv_gi]
        seen_base = max(seen_base, int(base.max()))
        pools = group.layers[layer]
        before = [p.clone() for p in pools]

        x_kv = torch.randn(2, len(rows), T, c_kv)
        x_hidden = torch.randn(1, len(rows), T, c_hidden)
        with torch.no_grad():
            y_model = [convs[0](x_kv[0], positions, cache), convs[1](x_kv[1], positions, cache)]
            y_model_hidden = convs[2](x_hidden[0], positions, cache)
        for streams, x, y_mod in (((0, 1), x_kv, torch.stack(y_model)), ((2,), x_hidden, y_model_hidden[None])):
            weight = torch.stack([convs[s].weight.detach()[:, 0] for s in streams])  # [S, C, K]
            args = (group.slot_pos, table, base, positions, valid)
            ref_store = [before[s].clone() for s in streams]
            tri_store = [before[s].clone() for s in streams]
            y_ref = cached_short_conv_reference(x, weight, ref_store, *args, block_size=bs)
            y_tri = cached_short_conv_triton(x, weight, tri_store, *args, block_size=bs)
            _close(y_ref, y_mod)
            _close(y_tri, y_ref)
            for i, s in enumerate(streams):
                torch.testing.assert_close(ref_store[i][:scratch], pools[s][:scratch], rtol=0, atol=0)
                torch.testing.assert_close(tri_store[i], ref_store[i], rtol=0, atol=0)
                torch.testing.assert_close(tri_store[i][scratch:], before[s][scratch:], rtol=0, atol=0)
        # windows that read inputs of earlier steps from the pool, or found them forgotten
        want = positions[:, :, None] - torch.arange(K)  # [B, T, K]
        slots, mapped = slots_of(group, table, base, want.clamp(min=0), (want >= 0) & valid[:, :, None])
        earlier = mapped & (want < torch.tensor([first for _, first, _ in rows])[:, None, None])
        tagged = group.slot_pos[slots].view(want.shape) == want
        seen_pool_reads += int((earlier & tagged).sum())
        seen_forgotten += int((earlier & ~tagged).sum())

        # up to two positions of each span are rejected (written again by the next span), and
        # sometimes the last kept one is forgotten (a drafter's decode gap, docs/design.md §2)
        forget = torch.zeros(len(rows), 1, dtype=torch.long)  # [B, 1]
        forget_valid = torch.zeros(len(rows), 1, dtype=torch.bool)
        for rid, first, n in step:
            cursor[rid] = first + n - rng.randint(0, min(n - 1, 2))
            if rng.random() < 0.4:
                forget[rids.index(rid)] = cursor[rid] - 1
                forget_valid[rids.index(rid)] = True
        kv.forget_from({conv_gi: (table, base)}, forget, forget_valid)
    assert seen_base > 0 and seen_pool_reads > 0 and seen_forgotten > 0
