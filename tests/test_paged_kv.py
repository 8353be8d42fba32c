"""The paged KV pool: block pool mechanics (LRU, refcounts, prefix-cache index), what counts as
final for prefix caching, window freeing during generation, prefix hits reused by the engine,
and random operation sequences that must keep the pool's books balanced."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.engine import (  # noqa: F401
    BLOCK,
    NO_DRAFTER,
    generate,
    make_engine,
    mtp,
    one_thread,
    outputs,
    random_accept,
    random_prompts,
    spec_model,
    uncached_greedy,
)
from inkfw.cache.paged import EMPTY_POSITION, BlockPool, PagedKVManager
from inkfw.profiling import count_aten_ops

VOCAB = 120


@pytest.fixture(scope="module")
def model():
    return spec_model(seed=0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- BlockPool
def test_pool_allocates_in_order_and_runs_dry():
    pool = BlockPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.refcount == [1, 1, 1] and pool.num_free == 0
    assert pool.allocate() is None


def test_pool_reuses_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    for b in (2, 0, 3, 1):
        pool.release(blocks[b])
    assert [pool.allocate() for _ in range(4)] == [2, 0, 3, 1]


def test_pool_refcounts_shared_blocks():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.register(b, b"h")
    assert pool.acquire_cached(b"h") == b  # a second owner while the first still holds it
    assert pool.refcount[b] == 2
    pool.release(b)
    assert pool.refcount[b] == 1 and pool.num_free == 1  # still held: not free
    pool.release(b)
    assert pool.refcount[b] == 0 and pool.num_free == 2
    with pytest.raises(AssertionError):
        pool.release(b)


def test_pool_cached_block_is_found_until_reused():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 2 and pool.cached == {b"A": a, b"B": b}  # freed, still findable
    # acquiring a free cached block takes it off the free list
    assert pool.acquire_cached(b"B") == b and pool.num_free == 1
    pool.release(b)  # now most recently freed: a is evicted first
    assert pool.allocate() == a
    assert b"A" not in pool.cached and pool.block_hash[a] is None  # the hash died with the reuse
    assert pool.acquire_cached(b"A") is None
    assert pool.acquire_cached(b"B") == b
    assert pool.acquire_cached(b"missing") is None


def test_pool_register_keeps_first_owner_of_content():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"X")
    pool.register(b, b"X")  # same content already cached: no-op
    assert pool.cached == {b"X": a} and pool.block_hash[b] is None
    pool.register(a, b"Y")  # a block already registered keeps its hash
    assert pool.cached == {b"X": a} and pool.block_hash[a] == b"X"


# --------------------------------------------------------------------------- PagedKVManager units
def _kv(model, lookahead: int = 2, bs: int = 4, blocks: int = 32, depths: int = 2, prefix: bool = True):
    return PagedKVManager(
        model,
        num_draft_depths=depths,
        lookahead=lookahead,
        block_size=bs,
        num_blocks=blocks,
        num_window_blocks=blocks,
        enable_prefix_caching=prefix,
        max_model_len=128,
    )


def _cached_blocks(kv) -> list[int]:
    return [len(g.pool.cached) for g in kv.groups]


def _hit_blocks(kv, h: int) -> list[int]:
    """Blocks a prefix hit of ``h`` positions hands each group: all of them for full attention,
    only those a query at ``h`` can still read for windowed groups (sliding attention, conv)."""
    bs = kv.block_size
    return [
        h // bs - (0 if g.window is None else max(0, h - max(g.window, kv.conv_kernel_size) + 1) // bs)
        for g in kv.groups
    ]


def test_block_registered_only_when_final(model):
    """Block j is registered once its positions are final AND its `lookahead` next tokens are
    committed (MTP depth s at position t reads x[t+s+1])."""
    kv = _kv(model, lookahead=2)
    tokens = list(range(10, 30))
    kv.add("a", tokens[:9])
    assert kv.ensure("a", 12, 12)
    kv.finalize("a", tokens[:9], 3)  # block 0 not final yet
    assert _cached_blocks(kv) == [0] * len(kv.groups)
    kv.finalize("a", tokens[:9], 8)  # positions 0..7 final, but x[8], x[9] must follow block 1
    assert _cached_blocks(kv) == [1] * len(kv.groups)
    kv.finalize("a", tokens[:10], 8)  # now block 1's lookahead is committed
    assert _cached_blocks(kv) == [2] * len(kv.groups)

    # a new request finds the registered blocks only where its tokens, lookahead included, agree
    assert kv.add("b", tokens[:12]) == 8
    assert kv.add("c", tokens[:9]) == 4  # (9 - 2) // 4 = 1 block has its lookahead
    assert kv.add("d", tokens[:9] + [0, 0, 0]) == 4  # x[9] differs: block 1's hash differs
    assert kv.add("e", [99] + tokens[1:12]) == 0
    assert [kv.held_blocks(r) for r in "bcde"] == [_hit_blocks(kv, h) for h in (8, 4, 4, 0)]
    assert any(n < 2 for n in _hit_blocks(kv, 8))  # the conv groups keep only the last block
    for r in "abcde":
        kv.free(r)
    assert kv.is_whole()


def test_target_blocks_register_past_the_draft_ones(model):
    """A request whose drafter stopped early (``num_final_draft`` < ``num_final``) registers its
    target blocks beyond its draft ones: a request that decodes plainly (``draft_depths=0``) reuses
    them and takes no draft-group blocks, a drafting request hits only where every group is
    cached, and draft blocks join when the drafter's positions become final."""
    kv = _kv(model, lookahead=2)
    draft = [g.draft for g in kv.groups]
    assert any(draft) and not all(draft)
    tokens = list(range(10, 30))  # (20 - 2) // 4 = 4 blocks have their lookahead committed
    kv.add("a", tokens)
    assert kv.ensure("a", 16, 16)
    kv.finalize("a", tokens, 16, num_final_draft=4)
    assert _cached_blocks(kv) == [1 if d else 4 for d in draft]
    assert kv.add("plain", tokens, draft_depths=0) == 16
    assert kv.held_blocks("plain") == [0 if d else n for n, d in zip(_hit_blocks(kv, 16), draft)]
    assert kv.add("drafting", tokens) == 4
    kv.finalize("a", tokens, 16, num_final_draft=12)
    assert _cached_blocks(kv) == [3 if d else 4 for d in draft]
    assert kv.add("drafting later", tokens) == 12
    for r in ("a", "plain", "drafting", "drafting later"):
        kv.free(r)
    assert kv.is_whole()


def test_a_request_with_fewer_draft_depths_holds_and_needs_only_theirs(model):
    """``draft_depths=1`` (adaptive k admitted the request to draft with depth 0 only): it gets
    no blocks in depth 1's groups, its prefix hits need the target's and depth 0's groups only,
    and what it registers serves requests with as few depths, not those that draft with all."""
    kv = _kv(model, lookahead=2, depths=2)
    depth_of = {g: d for d, pair in enumerate(kv.draft_layout) for g in pair}
    tokens = list(range(10, 30))
    kv.add("one", tokens, draft_depths=1)
    assert kv.ensure("one", 16, 18)
    held = kv.held_blocks("one")
    assert [h > 0 for h in held] == [depth_of.get(g, 0) == 0 for g in range(len(kv.groups))]
    kv.finalize("one", tokens, 16)
    assert kv.add("all depths", tokens) == 0  # depth 1's groups hold nothing of it
    assert kv.add("depth 0", tokens, draft_depths=1) == 16
    assert kv.held_blocks("depth 0") == [0 if depth_of.get(g, 0) > 0 else n for g, n in enumerate(_hit_blocks(kv, 16))]
    for r in ("one", "all depths", "depth 0"):
        kv.free(r)
    assert kv.is_whole()


def test_prefix_hit_leaves_a_token_to_compute(model):
    kv = _kv(model, lookahead=0)
    tokens = list(range(1, 9))  # two whole blocks
    kv.add("a", tokens)
    kv.ensure("a", 8, 8)
    kv.finalize("a", tokens, 8)
    assert _cached_blocks(kv) == [2] * len(kv.groups)
    assert kv.add("b", tokens) == 4  # not 8: the last token must still be fed to the target
    assert kv.add("c", tokens + [9]) == 8


def test_prefix_caching_off_never_hits(model):
    kv = _kv(model, prefix=False)
    tokens = list(range(1, 20))
    kv.add("a", tokens)
    kv.ensure("a", 19, 19)
    kv.finalize("a", tokens, 19)
    assert _cached_blocks(kv) == [0] * len(kv.groups)
    assert kv.add("b", tokens) == 0


def test_trim_frees_only_windowed_groups(model):
    kv = _kv(model, lookahead=2)
    kv.add("a", list(range(40)))
    assert kv.ensure("a", 40, 42)
    before = kv.held_blocks("a")
    kv.trim("a", 30)
    after = kv.held_blocks("a")
    for g, b, a in zip(kv.groups, before, after):
        if g.window is None:
            assert a == b
        else:  # keeps the blocks a query at position >= 30 can read: from 30 - window + 1 on
            first_kept = (30 - max(g.window, kv.conv_kernel_size) + 1) // 4
            assert a == b - first_kept, g.name
    assert any(a < b for a, b in zip(after, before))
    assert [g.pool.num_free for g in kv.groups] == [g.pool.num_blocks - a for g, a in zip(kv.groups, after)]
    kv.free("a")
    assert kv.is_whole()


@torch.no_grad()
def test_previous_owner_of_a_block_is_never_read(model):
    """A request that reuses another's freed blocks sees nothing of their old content: its
    forward over positions 8..11 (nothing written before) equals the same forward on a pool
    that was never used. (Three-block pools: "a" frees blocks 2, 1, 0 in that order, so "b"
    gets block 1 back at the same logical index 1, positions 4..7.)"""
    ids_a, ids_b = torch.arange(10, 22)[None], torch.arange(40, 52)[None]
    pos = torch.arange(12)[None]

    def forward(kv, rid, ids, positions):
        valid = torch.ones_like(positions, dtype=torch.bool)
        return model(ids, positions, kv.target_caches([rid], positions, valid))

    used = _kv(model, lookahead=0, blocks=3, depths=0, prefix=False)
    used.add("a", ids_a[0].tolist())
    assert used.ensure("a", 12, 0)
    forward(used, "a", ids_a, pos)
    used.free("a")
    used.add("b", ids_b[0].tolist())
    assert used.ensure("b", 12, 0)  # the same three blocks again: the pools hold only three
    assert used.num_free_blocks() == [0] * len(used.groups)
    stale = forward(used, "b", ids_b[:, 8:], pos[:, 8:])

    fresh = _kv(model, lookahead=0, blocks=3, depths=0, prefix=False)
    fresh.add("b", ids_b[0].tolist())
    assert fresh.ensure("b", 12, 0)
    clean = forward(fresh, "b", ids_b[:, 8:], pos[:, 8:])
    assert torch.equal(stale, clean)
    # the reads are not vacuous: with positions 4..7 written, the result differs
    forward(fresh, "b", ids_a[:, 4:8], pos[:, 4:8])
    assert not torch.allclose(forward(fresh, "b", ids_b[:, 8:], pos[:, 8:]), clean)


def test_fresh_blocks_are_cleared_together_before_the_next_forward(model):
    """Allocating blocks issues no tensor op; the next forward's views (``step_tables``) clear the
    old tags of all of them first, a few ops per group (a block each cost three: ~270 eager ops per decode step
    at batch 16 with 8 depths, beside the CUDA graphs)."""
    kv = _kv(model, lookahead=0, blocks=12, depths=0, prefix=False)
    for g in kv.groups:
        g.slot_pos.fill_(7)  # stale tags everywhere, as blocks that held other requests' positions
    for rid in ("a", "b", "c"):
        kv.add(rid, list(range(3, 15)))
    allocating = count_aten_ops(lambda: [kv.ensure(rid, 12, 0) for rid in ("a", "b", "c")])
    fresh = {gi: [b for t in ([kv._tables[r][gi] for r in "abc"]) for b in t] for gi in range(len(kv.groups))}
    assert allocating == 0 and sum(map(len, fresh.values())) >= 9
    assert all(int(kv.groups[gi].slot_pos[b * kv.block_size]) == 7 for gi, bs in fresh.items() for b in bs)  # not yet
    clearing = count_aten_ops(kv._clear_fresh_blocks)
    assert clearing <= 6 * len(kv.groups)  # per group: the block ids (4 in the profiler), a view, one fill
    assert count_aten_ops(kv._clear_fresh_blocks) == 0  # once
    for gi, blocks in fresh.items():
        tags = kv.groups[gi].slot_pos.view(-1, kv.block_size)
        assert all((tags[b] == EMPTY_POSITION).all() for b in blocks)  # cleared, every request's
        assert (tags[11] == 7).all()  # an unallocated block keeps its tags


# --------------------------------------------------------------------------- engine-level
@pytest.fixture(scope="module")
def no_eos_model():
    return spec_model(seed=0, eos_token_id=None)


def test_window_blocks_freed_during_generation(no_eos_model):
    """Sliding-window and conv groups hold a bounded number of blocks however long the request
    grows, while full-attention groups grow with it; drafts stay exact (re-prefill still finds
    its P - 1 extra positions) and every block comes back at the end."""
    model = no_eos_model
    k, D = 4, 4
    eng, kv = make_engine(model, mtp(D, k), verifier=random_accept(seed=4))
    P = eng.drafter.lookahead
    r = eng.add_request([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], max_new_tokens=100)
    assert r.sampling.greedy
    windowed = [i for i, g in enumerate(kv.groups) if g.window is not None]
    full = [i for i, g in enumerate(kv.groups) if g.window is None]
    assert windowed and full
    peak = [0] * len(kv.groups)
    while not r.finished:
        eng.step()
        if r.finished:
            break
        held = kv.held_blocks(r.id)
        L = len(r.token_ids)
        for i in windowed:
            w = max(kv.groups[i].window, kv.conv_kernel_size)
            assert held[i] <= (w + P + 2 * k) // BLOCK + 2, (kv.groups[i].name, L, held[i])
        for i in full:
            assert held[i] >= (L - 1) // BLOCK
        peak = [max(p, h) for p, h in zip(peak, held)]
    assert len(r.token_ids) >= 100
    assert all(peak[i] < min(peak[j] for j in full) for i in windowed)
    assert kv.is_whole()


def test_prefix_cache_hit_reuses_blocks(model, monkeypatch):
    """A second request with the same long prompt starts from cached blocks (target and every
    draft depth) and produces the same output; check_drafts proves the cached draft-depth state
    is final."""
    rng = random.Random(3)
    prompt = random_prompts(rng, 1, VOCAB, lo=37, hi=37)[0]
    eng, kv = make_engine(model, mtp(3, 3))
    drafter = eng.drafter
    hits = []
    add = kv.add

    def spy(rid, tokens, draft_depths=None):
        free = kv.num_free_blocks()
        h = add(rid, tokens, draft_depths)
        hits.append((h, kv.held_blocks(rid), [a - b for a, b in zip(free, kv.num_free_blocks())]))
        return h

    monkeypatch.setattr(kv, "add", spy)
    first = eng.add_request(prompt, max_new_tokens=10)
    eng.generate([first])
    second = eng.add_request(prompt, max_new_tokens=10)
    eng.generate([second])
    assert kv.is_whole()
    assert hits[0][0] == 0
    h, held, taken = hits[1]
    assert h == (len(prompt) - drafter.lookahead) // BLOCK * BLOCK == 32
    # found in the cache: taken off the free list, nothing new allocated
    assert held == taken == _hit_blocks(kv, h)
    assert second.output_token_ids == first.output_token_ids == uncached_greedy(model, prompt, 10)


@pytest.mark.parametrize("with_mtp", [False, True])
def test_prefix_hash_covers_lookahead(model, with_mtp):
    """Prompts that agree on 13 tokens: without a drafter 3 blocks are shared; with P = 3 block 2
    (positions 8..11) also depends on tokens 12..14, so only 2 are. check_drafts proves the
    shared depth states are right."""
    rng = random.Random(4)
    a = random_prompts(rng, 1, VOCAB, lo=20, hi=20)[0]
    b = a[:13] + [(t + 1) % VOCAB for t in a[13:]]
    eng, kv = make_engine(model, mtp(3, 3) if with_mtp else NO_DRAFTER)
    hits = []
    add = kv.add
    kv.add = lambda rid, tokens, draft_depths=None: hits.append(add(rid, tokens, draft_depths)) or hits[-1]
    ra = eng.add_request(a, max_new_tokens=8)
    eng.generate([ra])
    rb = eng.add_request(b, max_new_tokens=8)
    eng.generate([rb])
    assert hits == [0, 8 if with_mtp else 12]
    ref, _, _ = generate(model, NO_DRAFTER, [a, b], 8, prefix_caching=False)
    assert [ra.output_token_ids, rb.output_token_ids] == outputs(ref)
    assert kv.is_whole()


# --------------------------------------------------------------------------- random operations
@pytest.fixture(scope="module")
def kv_model():
    return spec_model(seed=2)


def _check_books(kv: PagedKVManager, tokens: dict) -> None:
    """Every group: free + held == num_blocks, refcount == number of live tables holding the
    block, free list == blocks with refcount 0, hash index consistent; a block sits in two
    live tables only as a registered (cached) prefix block, and a held block that carries a
    hash carries the hash of its holders' own tokens there (reuse drops a stale hash)."""
    live = set(tokens)
    chains = {rid: kv._hash_chain(t, max(0, len(t) - kv.lookahead) // kv.block_size) for rid, t in tokens.items()}
    for gi, g in enumerate(kv.groups):
        pool = g.pool
        owners = [0] * pool.num_blocks
        for rid in live:
            table = [b for b in kv._tables[rid][gi] if b >= 0]
            assert len(set(table)) == len(table), f"{g.name}: block twice in one table"
            for b in table:
                owners[b] += 1
            for j, b in enumerate(kv._tables[rid][gi]):
                if b >= 0 and pool.block_hash[b] is not None:
                    assert j < len(chains[rid]) and pool.block_hash[b] == chains[rid][j], f"{g.name}: stale hash"
        assert owners == pool.refcount, g.name
        held = sum(1 for c in owners if c > 0)
        assert pool.num_free + held == pool.num_blocks, g.name
        assert set(pool.free) == {b for b, c in enumerate(owners) if c == 0}, g.name
        assert all(pool.block_hash[b] is not None for b, c in enumerate(owners) if c > 1), g.name
        assert {h: b for b, h in enumerate(pool.block_hash) if h is not None} == pool.cached, g.name
    assert set(kv._tables) == live


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data(), lookahead=st.integers(0, 3), bs=st.sampled_from([2, 4]))
def test_random_operations_keep_books(kv_model, data, lookahead, bs):
    kv = PagedKVManager(
        kv_model,
        num_draft_depths=2,
        lookahead=lookahead,
        block_size=bs,
        num_blocks=8,
        num_window_blocks=6,
        enable_prefix_caching=True,
        max_model_len=128,
    )
    base = [1, 2, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # shared prefixes make prefix hits likely
    tokens: dict[int, list[int]] = {}
    computed: dict[int, int] = {}  # positions with blocks in every group (what may be finalized)
    trimmed: dict[int, int] = {}
    # (tokens, target and draft positions finalized, the request's draft depths) per finalize
    registered: list[tuple[list[int], int, int, int | None]] = []
    depths_of: dict[int, int | None] = {}
    depth_of = {g: d for d, pair in enumerate(kv.draft_layout) for g in pair}
    next_id = 0
    for _ in range(data.draw(st.integers(5, 40), label="ops")):
        ops = ["add"] + (["grow"] * 3 + ["finalize"] * 2 + ["trim"] + ["free"] * 2 if tokens else [])
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "add":
            n = data.draw(st.integers(1, len(base)), label="shared")
            toks = base[:n] + data.draw(st.lists(st.integers(0, 9), max_size=6), label="tail")
            rid, next_id = next_id, next_id + 1
            depths = data.draw(st.sampled_from([0, 1, None]), label="draft depths")  # None: both
            h = kv.add(rid, toks, draft_depths=depths)
            assert h % bs == 0 and 0 <= h <= len(toks) - 1 and h <= max(0, len(toks) - lookahead)
            if h:  # only content someone registered, lookahead tokens included (in the draft groups it needs)
                assert any(
                    t[: h + lookahead] == toks[: h + lookahead]
                    and (f if depths == 0 else fd) >= h
                    and (depths is None) <= (m is None)  # all depths: registered by a request with all
                    and (depths == 0) <= (m != 0)
                    for t, f, fd, m in registered
                )
            tokens[rid], computed[rid], trimmed[rid], depths_of[rid] = toks, h, 0, depths
        else:
            rid = data.draw(st.sampled_from(sorted(tokens)), label="rid")
            if op == "grow":
                tokens[rid] += data.draw(st.lists(st.integers(0, 9), max_size=6), label="new")
                end = data.draw(st.integers(computed[rid], len(tokens[rid]) + 3), label="end")
                if kv.ensure(rid, end, end + data.draw(st.integers(0, 3), label="extra")):
                    computed[rid] = max(computed[rid], min(end, len(tokens[rid])))
            elif op == "finalize":
                num_final = data.draw(st.integers(0, computed[rid]), label="final")
                num_final_draft = data.draw(st.integers(0, num_final), label="final draft")
                kv.finalize(rid, tokens[rid], num_final, num_final_draft)
                last = len(tokens[rid]) - lookahead
                registered.append(
                    (
                        list(tokens[rid]),
                        min(num_final, last) // bs * bs,
                        min(num_final_draft, last) // bs * bs,
                        depths_of[rid],
                    )
                )
            elif op == "trim":
                trimmed[rid] = data.draw(st.integers(trimmed[rid], max(trimmed[rid], computed[rid])), label="q")
                kv.trim(rid, trimmed[rid])
            else:
                kv.free(rid)
                del tokens[rid], computed[rid], trimmed[rid]
        _check_books(kv, tokens)
        for rid in tokens:  # no blocks in the groups of depths a request does not draft with
            m = depths_of[rid]
            assert all(n == 0 for g, n in enumerate(kv.held_blocks(rid)) if m is not None and depth_of.get(g, -1) >= m)
    for rid in list(tokens):
        kv.free(rid)
    _check_books(kv, {})
    assert kv.is_whole()
