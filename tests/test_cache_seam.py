"""The training/serving seam: the same modules, run with a position-indexed cache over chunks
of any size, rows at different positions and rejected (overwritten) positions, give the hidden
states of the uncached whole-sequence forward that training uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.models import randomize_, tiny_config
from inkfw.cache.dense import DenseModelCache
from inkfw.models.inkling.model import InklingLM

VOCAB = 90
TOL = dict(atol=1e-5, rtol=1e-5)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def span(start: int, length: int, wrong_from: int | None = None) -> tuple[list[int], list[bool]]:
    """Positions start..start+length-1; inputs from index ``wrong_from`` on are wrong (drafts to reject)."""
    return list(range(start, start + length)), [wrong_from is not None and i >= wrong_from for i in range(length)]


def run(step, streams, wrong, calls, max_len: int, hidden: int) -> torch.Tensor:
    """Drive ``step(*inputs, positions)`` over ``calls``; return the latest output at every (row, position).

    streams[b] / wrong[b]: tuples of per-position inputs of row b (true / wrong values), each [L_b, ...].
    calls: one entry per call, a list over rows of ``span(...)`` results (same length for every row).
    """
    B = len(streams)
    got = torch.full((B, max_len, hidden), float("nan"))
    for call in calls:
        pos = torch.tensor([p for p, _ in call])  # [B, T]
        inputs = []
        for k in range(len(streams[0])):
            rows = []
            for b, (p, w) in enumerate(call):
                x, y = streams[b][k][p], wrong[b][k][p]
                mask = torch.tensor(w).view(-1, *[1] * (x.dim() - 1))
                rows.append(torch.where(mask, y, x))
            inputs.append(torch.stack(rows))
        with torch.no_grad():
            out = step(*inputs, pos)
        assert out.shape == (B, pos.shape[1], hidden)
        got[torch.arange(B)[:, None], pos] = out
    return got


def backbone_step(model: InklingLM, cache: DenseModelCache):
    return lambda ids, pos: model(ids, pos, caches=cache.layers)


def mtp_step(model: InklingLM, cache: DenseModelCache, depth: int):
    return lambda h, ids, pos: model.mtp_step(depth, h, ids, pos, cache=cache.mtp[depth])


def wrong_ids(seq: torch.Tensor) -> torch.Tensor:
    return (seq + 1 + tokens(len(seq), 99) % (VOCAB - 1)) % VOCAB  # differs from seq everywhere


def mtp_streams(model: InklingLM, seq: torch.Tensor, depth: int):
    """Inputs (g_d, x[t+d+1]) and the reference output g_{d+1} of depth ``depth`` over ``seq``."""
    with torch.no_grad():
        h = model(seq[None])
        chain = model.mtp_chain(h, seq[None], num_depths=depth + 1)
    g_in = h if depth == 0 else chain[depth - 1]
    ids = torch.zeros_like(seq)  # x[t+depth+1], 0 past the end
    ids[: max(0, len(seq) - depth - 1)] = seq[depth + 1 :]
    return (g_in[0], ids), chain[depth][0]


def check(got: torch.Tensor, refs: list[torch.Tensor]) -> None:
    for b, ref in enumerate(refs):
        torch.testing.assert_close(got[b, : len(ref)], ref, **TOL)


# ------------------------------------------------------------------------- (a)
def test_chunked_prefill_and_decode_rows_at_different_offsets(model):
    """Row 1 runs 5 positions ahead of row 0; prefill in chunks 1, 3, 7, then decode 1 by 1
    far beyond the window (8). Row 0 first fills positions 0..4 with garbage, overwritten later."""
    H, lead, L0 = model.cfg.hidden_size, 5, 30
    seqs = [tokens(L0, 1), tokens(L0 + lead, 2)]
    with torch.no_grad():
        refs = [model(s[None])[0] for s in seqs]
    cache = DenseModelCache(model, batch=2, max_len=40)
    calls = [[span(0, lead, wrong_from=0), span(0, lead)]]
    cursor = [0, lead]
    for T in [1, 3, 7] + [1] * (L0 - 11):
        calls.append([span(c, T) for c in cursor])
        cursor = [c + T for c in cursor]
    assert cursor == [L0, L0 + lead]
    got = run(backbone_step(model, cache), [(s,) for s in seqs], [(wrong_ids(s),) for s in seqs], calls, 40, H)
    check(got, refs)


@pytest.mark.parametrize("chunks", [[30], [8, 8, 8, 6], [2, 9, 1, 17, 1], [1] * 30])
def test_chunkings_single_row(model, chunks):
    seq = tokens(30, 3)
    with torch.no_grad():
        ref = model(seq[None])[0]
    cache = DenseModelCache(model, batch=1, max_len=32)
    calls, c = [], 0
    for T in chunks:
        calls.append([span(c, T)])
        c += T
    got = run(backbone_step(model, cache), [(seq,)], [(seq,)], calls, 32, model.cfg.hidden_size)
    check(got, [ref])


def test_cached_logits_match(model):
    """What serving samples from: logits of the cached decode equal the training forward's."""
    seq = tokens(20, 4)
    with torch.no_grad():
        ref = model.logits(model(seq[None]))
        cache = DenseModelCache(model, batch=1, max_len=20)
        pre = model.logits(model(seq[None, :12], torch.arange(12)[None], caches=cache.layers))
        dec = [
            model.logits(model(seq[None, t : t + 1], torch.tensor([[t]]), caches=cache.layers)) for t in range(12, 20)
        ]
    torch.testing.assert_close(torch.cat([pre, *dec], dim=1), ref, **TOL)
    assert ref.shape[-1] == model.cfg.logits_vocab_size


def test_cache_is_actually_used(model):
    """Control: decoding position t without its past in the cache gives a different answer."""
    seq = tokens(12, 5)
    with torch.no_grad():
        ref = model(seq[None])[0]
        cache = DenseModelCache(model, batch=1, max_len=12)
        alone = model(seq[None, 11:], torch.tensor([[11]]), caches=cache.layers)[0, 0]
    assert not torch.allclose(alone, ref[11], atol=1e-3)


def test_position_beyond_cache_is_an_error(model):
    cache = DenseModelCache(model, batch=1, max_len=4)
    with pytest.raises(ValueError, match="beyond the cache length"):
        model(tokens(5, 0)[None], torch.arange(5)[None], caches=cache.layers)


# ------------------------------------------------------------------------- (b)
@pytest.mark.parametrize("resume", [[1], [3], [2, 1], [4]])
def test_rejected_positions_are_overwritten(model, resume):
    """Verify writes [x_n, x_n+1, d, d, d] at n..n+4; row 0 accepts 2 (resumes at n+2), row 1
    accepts none (resumes at n); both continue and end equal to the uncached forward."""
    H, n, L = model.cfg.hidden_size, 11, 26
    seqs = [tokens(L, 6), tokens(L - 2, 7)]
    with torch.no_grad():
        refs = [model(s[None])[0] for s in seqs]
    cache = DenseModelCache(model, batch=2, max_len=L)
    calls = [
        [span(0, 4), span(0, 4)],
        [span(4, n - 4), span(4, n - 4)],
        [span(n, 5, wrong_from=2), span(n, 5, wrong_from=0)],
    ]
    cursor = [n + 2, n]
    for T in resume + [1] * 64:
        if cursor[0] >= L:
            break
        T = min(T, L - cursor[0])
        calls.append([span(c, T) for c in cursor])
        cursor = [c + T for c in cursor]
    got = run(backbone_step(model, cache), [(s,) for s in seqs], [(wrong_ids(s),) for s in seqs], calls, L, H)
    check(got, refs)


def test_repeated_rejections(model):
    """Every step writes 4 wrong drafts after the true token; the next step overwrites them."""
    H, L = model.cfg.hidden_size, 24
    seq = tokens(L, 8)
    with torch.no_grad():
        ref = model(seq[None])[0]
    cache = DenseModelCache(model, batch=1, max_len=L + 4)
    calls = [[span(0, 3)]] + [[span(t, 5, wrong_from=1)] for t in range(3, L)]
    padded = torch.cat([seq, torch.zeros(4, dtype=seq.dtype)])
    got = run(backbone_step(model, cache), [(padded,)], [(wrong_ids(padded),)], calls, L + 4, H)
    check(got, [ref])


# ------------------------------------------------------------------------- (c)
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_mtp_depth_cached_equals_chain(model, depth):
    """mtp_step with a cache, chunked, rows at different offsets, with a rejected span,
    equals mtp_chain over whole sequences (depths 0 and 2 are local, depth 1 global)."""
    H, lead, L0, n = model.cfg.hidden_size, 3, 22, 12
    seqs = [tokens(L0, 10 + depth), tokens(L0 + lead, 20 + depth)]
    streams, refs = zip(*(mtp_streams(model, s, depth) for s in seqs))
    g = torch.Generator().manual_seed(depth)
    wrong = [(torch.randn(s[0].shape, generator=g), wrong_ids(s[1])) for s in streams]
    cache = DenseModelCache(model, batch=2, max_len=L0 + lead)
    calls = [[span(0, lead, wrong_from=0), span(0, lead)]]
    cursor = [0, lead]
    for T in [2, 5, 1, 4]:  # prefill up to n
        calls.append([span(c, T) for c in cursor])
        cursor = [c + T for c in cursor]
    assert cursor[0] == n
    calls.append([span(c, 5, wrong_from=2) for c in cursor])  # both rows: 2 right, 3 wrong
    cursor = [c + 2 for c in cursor]
    while cursor[0] < L0:
        calls.append([span(c, 1) for c in cursor])
        cursor = [c + 1 for c in cursor]
    got = run(mtp_step(model, cache, depth), list(streams), wrong, calls, L0 + lead, H)
    check(got, list(refs))


def test_mtp_chain_through_caches(model):
    """All depths cached at once, each depth fed the previous depth's cached output."""
    seq = tokens(20, 30)
    with torch.no_grad():
        h = model(seq[None])
        chain = model.mtp_chain(h, seq[None])
        cache = DenseModelCache(model, batch=1, max_len=20)
        outs = [[] for _ in chain]
        c = 0
        for T in [4, 1, 6, 1, 1, 3, 1, 1, 1, 1]:
            pos = torch.arange(c, c + T)[None]
            g = h[:, c : c + T]
            for d in range(len(chain)):
                ids = F.pad(seq[None, d + 1 :], (0, d + 1))[:, c : c + T]
                g = model.mtp_step(d, g, ids, pos, cache=cache.mtp[d])
                outs[d].append(g)
            c += T
    assert c == 20
    for d, ref in enumerate(chain):
        torch.testing.assert_close(torch.cat(outs[d], dim=1), ref, **TOL)


# ------------------------------------------------------------------------- (d)
@pytest.fixture(scope="module")
def shared_model() -> InklingLM:
    cfg = tiny_config()
    torch.manual_seed(0)
    return randomize_(InklingLM(cfg, mtp_depths=cfg.mtp.num_nextn_predict_layers), seed=5).eval()


@st.composite
def schedules(draw):
    """A sequence length, chunk sizes covering it, and per chunk a number of wrong trailing drafts."""
    L = draw(st.integers(1, 20))
    chunks, left = [], L
    while left:
        T = draw(st.integers(1, min(left, 9)))
        chunks.append((T, draw(st.integers(0, 3))))
        left -= T
    return L, chunks


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedules(), st.sampled_from([None, 0, 1, 2]), st.integers(0, 2**16))
def test_random_chunkings_property(shared_model, schedule, depth, seed):
    model, (L, chunks) = shared_model, schedule
    H, extra = model.cfg.hidden_size, 3
    seq = torch.cat([tokens(L, seed), torch.zeros(extra, dtype=torch.long)])
    if depth is None:
        with torch.no_grad():
            ref = model(seq[None, :L])[0]
        streams, wrong = (seq,), (wrong_ids(seq),)
    else:
        streams, ref = mtp_streams(model, seq[:L], depth)
        streams = (F.pad(streams[0], (0, 0, 0, extra)), F.pad(streams[1], (0, extra)))
        g = torch.Generator().manual_seed(seed)
        wrong = (torch.randn(streams[0].shape, generator=g), wrong_ids(streams[1]))
    cache = DenseModelCache(model, batch=1, max_len=L + extra)
    calls, c = [], 0
    for T, rejected in chunks:
        calls.append([span(c, T + rejected, wrong_from=T)])
        c += T
    step = backbone_step(model, cache) if depth is None else mtp_step(model, cache, depth)
    got = run(step, [streams], [wrong], calls, L + extra, H)
    check(got, [ref])
