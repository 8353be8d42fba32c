"""Acceptance kernels (docs/design.md §3): the Triton greedy acceptance and rejection sampling
(interpreter, fp32) equal the torch references of inkfw.speculative.acceptance exactly, on random
ragged batches (padding rows, k = 0, sizes that are not powers of two, ties, exact zeros), with
the vocabulary cut into many chunks or one, and on batches built to take each branch."""

from __future__ import annotations

import pytest
import torch

from inkfw.kernels import acceptance
from inkfw.kernels.acceptance import (
    greedy_accept_reference,
    greedy_accept_triton,
    rejection_sample_reference,
    rejection_sample_triton,
)

pytestmark = pytest.mark.kernel


def split_vocabulary(monkeypatch, block: int = 16) -> None:
    """Cut the vocabulary into chunks of 2 blocks of ``block`` entries: several programs per row,
    blocks past V, maxima tied across chunks (the default puts V <= 8192 in one chunk)."""
    monkeypatch.setattr(acceptance, "MAX_BLOCK_V", block)
    monkeypatch.setattr(acceptance, "MAX_BLOCKS_PER_SPLIT", 2)


@pytest.fixture(params=["one_chunk", "many_chunks"])
def chunks(request, monkeypatch):
    if request.param == "many_chunks":
        split_vocabulary(monkeypatch)
    return request.param


# (seed, chunked): 30 random batches in one chunk, 6 more cut into chunks
CASES = [pytest.param(seed, False, id=f"{seed}") for seed in range(30)]
CASES += [pytest.param(seed, True, id=f"{seed}-chunked") for seed in range(30, 36)]


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w in zip(got, want):
        assert g.dtype == torch.long and g.shape == w.shape
        assert torch.equal(g, w), (got, want)


def random_counts(gen: torch.Generator, B: int, k: int) -> torch.Tensor | None:
    """None (all k) one time in four, else counts in [0, k] with at least one padding row."""
    if int(torch.randint(0, 4, (), generator=gen)) == 0:
        return None
    counts = torch.randint(0, k + 1, (B,), generator=gen)
    counts[int(torch.randint(0, B, (), generator=gen))] = 0
    return counts


def slots_in_use(counts: torch.Tensor | None, B: int, k: int) -> torch.Tensor:
    """[B, k] bool: real drafts."""
    n = torch.full((B,), k) if counts is None else counts
    return torch.arange(k)[None, :] < n[:, None]


# ---------------------------------------------------------------------------------------------------
# greedy


def greedy_batch(seed: int, V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logits with few distinct values (ties everywhere) and drafts equal to the argmax except
    for a few misses; padding slots hold the argmax too, so accepting one would show."""
    gen = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 8, (), generator=gen))
    k = int(torch.randint(0, 6, (), generator=gen))
    logits = torch.randint(-3, 3, (B, k + 1, V), generator=gen).float()  # [B, k+1, V]
    drafts = logits.argmax(-1)[:, :k].clone()  # [B, k]
    miss = torch.rand(B, k, generator=gen) < 0.25
    drafts = torch.where(miss, (drafts + torch.randint(1, V, (B, k), generator=gen)) % V, drafts)
    return drafts, logits, random_counts(gen, B, k)


@pytest.mark.parametrize("seed, chunked", CASES)
def test_greedy_random_batches(seed, chunked, monkeypatch):
    if chunked:
        split_vocabulary(monkeypatch)
    drafts, logits, counts = greedy_batch(seed, V=37 if seed % 2 else 100)
    want = greedy_accept_reference(drafts, logits, counts)
    assert_same(greedy_accept_triton(drafts, logits, counts, check=bool(seed % 3)), want)


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "many_chunks"])
def test_greedy_large_vocabulary(chunked, monkeypatch):
    if chunked:
        split_vocabulary(monkeypatch, block=128)
    drafts, logits, counts = greedy_batch(100, V=1000)
    logits[0, 0, 700] = 9.0  # a maximum far from the first chunk
    assert_same(greedy_accept_triton(drafts, logits, counts), greedy_accept_reference(drafts, logits, counts))


def test_greedy_argmax_order(chunks):
    """torch.argmax's order: the first of tied maxima (here in different chunks), the first NaN
    above everything, index 0 for a row of -inf."""
    V, k = 70, 2
    logits = torch.zeros(3, k + 1, V)
    logits[0, 0, [20, 45, 66]] = 5.0  # tied maximum in chunks 0, 1 and 2
    logits[0, 1, [3, 50]] = float("nan")
    logits[0, 1, 1] = float("inf")
    logits[1] = float("-inf")
    logits[2, :, 69] = 1.0  # maximum at the very last entry
    drafts = torch.tensor([[20, 3], [0, 0], [69, 69]])
    num_accepted, bonus = greedy_accept_triton(drafts, logits)
    assert num_accepted.tolist() == [2, 2, 2]
    assert bonus.tolist() == [0, 0, 69]
    assert_same((num_accepted, bonus), greedy_accept_reference(drafts, logits))


def test_greedy_branches():
    """All accepted (bonus at num_drafts), first draft missed, a padding row, k = 0."""
    V = 37
    logits = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(0))
    target = logits.argmax(-1)  # [3, 4]
    drafts = target[:, :3].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % V
    counts = torch.tensor([2, 3, 0])
    num_accepted, bonus = greedy_accept_triton(drafts, logits, counts)
    assert num_accepted.tolist() == [2, 0, 0]
    assert bonus.tolist() == [int(target[0, 2]), int(target[1, 0]), int(target[2, 0])]
    plain = greedy_accept_triton(torch.empty(3, 0, dtype=torch.long), logits[:, :1])
    assert plain[0].tolist() == [0, 0, 0] and torch.equal(plain[1], target[:, 0])


# ---------------------------------------------------------------------------------------------------
# rejection sampling


def noise_like(gen: torch.Generator, B: int, V: int) -> torch.Tensor:
    return torch.empty(B, V).exponential_(generator=gen).clamp_min_(torch.finfo(torch.float32).tiny)


def rejection_batch(seed: int, V: int, with_q: bool):
    """Target probabilities with exact zeros, draft distributions (some rows with p = q / 2 at a
    draft slot: empty residual), drafts mostly sampled from q (some at zeros of p), uniforms with
    exact zeros, padding that must not be read; one batch in four races on tied values (noise 1)."""
    gen = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 8, (), generator=gen))
    k = int(torch.randint(0, 6, (), generator=gen))
    p = torch.softmax(2 * torch.randn(B, k + 1, V, generator=gen), -1)
    p = p * (torch.rand(B, k + 1, V, generator=gen) > 0.3)  # [B, k+1, V] exact zeros
    q = torch.softmax(2 * torch.randn(B, k, V, generator=gen), -1)  # [B, k, V]
    if k:
        p[:, :k] = torch.where(torch.rand(B, k, 1, generator=gen) < 0.2, 0.5 * q, p[:, :k])
    tied = int(torch.randint(0, 4, (), generator=gen)) == 0
    if tied:
        p = (p * 4).round() / 4  # few distinct values
    sampled = torch.multinomial(q.reshape(B * k, V), 1, generator=gen).reshape(B, k) if k else q.new_zeros(B, 0)
    drafts = torch.where(
        torch.rand(B, k, generator=gen) < 0.2, torch.randint(0, V, (B, k), generator=gen), sampled.long()
    )
    counts = random_counts(gen, B, k)
    real = slots_in_use(counts, B, k)  # [B, k]
    likely = p[:, :k].argmax(-1)  # padding: out of range, or a draft that u = 0 would accept
    drafts = torch.where(real, drafts, torch.where(torch.rand(B, k, generator=gen) < 0.5, -1, likely))
    uniforms = torch.rand(B, k, generator=gen, dtype=torch.float64)
    uniforms[(torch.rand(B, k, generator=gen) < 0.1) | ~real] = 0.0
    noise = torch.ones(B, V) if tied else noise_like(gen, B, V)
    return drafts, (q if with_q else None), p, uniforms, noise, counts


@pytest.mark.parametrize("seed, chunked", CASES)
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one_hot"])
def test_rejection_random_batches(seed, chunked, with_q, monkeypatch):
    if chunked:
        split_vocabulary(monkeypatch)
    args = rejection_batch(seed, V=37 if seed % 2 else 100, with_q=with_q)
    want = rejection_sample_reference(*args)
    assert_same(rejection_sample_triton(*args, check=bool(seed % 3)), want)


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "many_chunks"])
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one_hot"])
def test_rejection_large_vocabulary(with_q, chunked, monkeypatch):
    if chunked:
        split_vocabulary(monkeypatch, block=128)
    args = rejection_batch(7, V=1000, with_q=with_q)
    assert_same(rejection_sample_triton(*args), rejection_sample_reference(*args))


def race(dist: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return (dist / noise).argmax(-1)


def test_rejection_all_accepted_bonus_from_p_at_num_drafts(chunks):
    gen = torch.Generator().manual_seed(1)
    B, k, V = 3, 4, 70
    p = torch.softmax(torch.randn(B, k + 1, V, generator=gen), -1)
    q = p[:, :k].clone()  # p == q: u < 1 accepts every draft
    drafts = torch.randint(0, V, (B, k), generator=gen)
    counts = torch.tensor([4, 2, 0])
    uniforms = torch.rand(B, k, generator=gen, dtype=torch.float64)
    noise = noise_like(gen, B, V)
    num_accepted, next_token = rejection_sample_triton(drafts, q, p, uniforms, noise, counts)
    assert num_accepted.tolist() == [4, 2, 0]
    assert torch.equal(next_token, race(p[torch.arange(B), counts], noise))
    want = rejection_sample_reference(drafts, q, p, uniforms, noise, counts)
    assert_same((num_accepted, next_token), want)


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one_hot"])
def test_rejection_first_draft_rejected_samples_the_residual(with_q, chunks):
    gen = torch.Generator().manual_seed(2)
    B, k, V = 3, 3, 70
    p = torch.softmax(torch.randn(B, k + 1, V, generator=gen), -1)
    q = torch.softmax(torch.randn(B, k, V, generator=gen), -1)
    drafts = p[:, 0].argmax(-1)[:, None].repeat(1, k)  # [B, k]
    p[torch.arange(B), 0, drafts[:, 0]] = 0.0  # p(d_1) = 0: rejected whatever u is
    uniforms = torch.zeros(B, k, dtype=torch.float64)
    noise = noise_like(gen, B, V)
    draft_probs = q if with_q else None
    num_accepted, next_token = rejection_sample_triton(drafts, draft_probs, p, uniforms, noise)
    q0 = q[:, 0] if with_q else torch.nn.functional.one_hot(drafts[:, 0], V).float()
    assert num_accepted.tolist() == [0, 0, 0]
    assert torch.equal(next_token, race((p[:, 0] - q0).clamp_min(0), noise))
    assert not torch.isin(next_token, drafts[:, 0]).any()
    assert_same((num_accepted, next_token), rejection_sample_reference(drafts, draft_probs, p, uniforms, noise))


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one_hot"])
def test_rejection_empty_residual_samples_p(with_q, chunks):
    """p <= q at the rejected slot (p = q / 2): the residual has no mass, the race runs over p."""
    gen = torch.Generator().manual_seed(3)
    B, k, V = 3, 2, 70
    q = torch.softmax(torch.randn(B, k, V, generator=gen), -1)
    drafts = q.argmax(-1)  # [B, k]
    if not with_q:
        q = torch.nn.functional.one_hot(drafts, V).float()  # what draft_probs=None stands for
    p = torch.softmax(torch.randn(B, k + 1, V, generator=gen), -1)
    p[:, :k] = 0.5 * q
    uniforms = torch.full((B, k), 0.75, dtype=torch.float64)  # 0.75 q(d) >= p(d): rejected
    noise = noise_like(gen, B, V)
    draft_probs = q if with_q else None
    num_accepted, next_token = rejection_sample_triton(drafts, draft_probs, p, uniforms, noise)
    assert num_accepted.tolist() == [0, 0, 0]
    assert torch.equal(next_token, race(p[:, 0], noise))
    if not with_q:
        assert torch.equal(next_token, drafts[:, 0])  # p is 0.5 at the draft, 0 elsewhere
    assert_same((num_accepted, next_token), rejection_sample_reference(drafts, draft_probs, p, uniforms, noise))


def test_rejection_plain_decoding_k0():
    gen = torch.Generator().manual_seed(4)
    B, V = 5, 37
    p = torch.softmax(torch.randn(B, 1, V, generator=gen), -1)
    noise = noise_like(gen, B, V)
    empty = torch.empty(B, 0)
    for q in (None, torch.empty(B, 0, V)):
        args = (torch.empty(B, 0, dtype=torch.long), q, p, empty.double(), noise)
        got = rejection_sample_triton(*args)
        assert got[0].tolist() == [0] * B and torch.equal(got[1], race(p[:, 0], noise))
        assert_same(got, rejection_sample_reference(*args))


def test_strided_inputs_and_int32_counts():
    """Every operand is read through its strides (here none is contiguous); counts may be int32."""

    def scrambled(t: torch.Tensor) -> torch.Tensor:
        """The same values with dims 0 and 1 swapped in memory and a 7 after every entry."""
        swapped = t.transpose(0, 1)
        return torch.stack([swapped, torch.full_like(swapped, 7)], dim=-1)[..., 0].transpose(0, 1)

    _, logits, counts = greedy_batch(7, V=37)  # B = 6, k = 4, ragged
    assert counts is not None
    drafts = logits.argmax(-1)[:, :-1]  # every real draft matches: a misread one would not
    want = greedy_accept_reference(drafts, logits, counts)
    assert torch.equal(want[0], counts)
    assert not scrambled(drafts).is_contiguous() and not scrambled(logits).is_contiguous()
    assert_same(greedy_accept_triton(scrambled(drafts), scrambled(logits), counts.int()), want)
    drafts, q, p, uniforms, noise, counts = rejection_batch(7, V=37, with_q=True)  # B = 6, k = 4
    assert counts is not None
    uniforms.zero_()  # drafts pass unless p(d) = 0: a misread uniform (7) would fail them
    p[:, :-1, 7] = 0.0  # and so would a misread draft (7)
    want = rejection_sample_reference(drafts, q, p, uniforms, noise, counts)
    assert want[0].sum() > 4
    args = (scrambled(drafts), scrambled(q), scrambled(p), scrambled(uniforms), scrambled(noise), counts.int())
    assert not any(a.is_contiguous() for a in args[:-1])
    assert_same(rejection_sample_triton(*args), want)


# ---------------------------------------------------------------------------------------------------
# checks and host reads


def test_check_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(5)
    B, k, V = 3, 2, 37
    p = torch.softmax(torch.randn(B, k + 1, V, generator=gen), -1)
    q = torch.softmax(torch.randn(B, k, V, generator=gen), -1)
    drafts = torch.randint(0, V, (B, k), generator=gen)
    uniforms = torch.rand(B, k, generator=gen, dtype=torch.float64)
    noise = noise_like(gen, B, V)
    with pytest.raises(ValueError, match="num_drafts must lie"):
        greedy_accept_triton(drafts, p, torch.full((B,), k + 1))
    with pytest.raises(ValueError, match="num_drafts must lie"):
        rejection_sample_triton(drafts, q, p, uniforms, noise, torch.full((B,), -1))
    bad = drafts.clone()
    bad[1, 1] = V
    with pytest.raises(ValueError, match="draft_tokens must lie"):
        rejection_sample_triton(bad, q, p, uniforms, noise)
    rejection_sample_triton(bad, q, p, uniforms, noise, torch.tensor([2, 1, 2]))  # only padding is bad
    with pytest.raises(ValueError, match="noise must be float32"):
        rejection_sample_triton(drafts, q, p, uniforms, noise.double())
    with pytest.raises(ValueError, match="uniforms must be"):
        rejection_sample_triton(drafts, q, p, uniforms[:, :-1], noise)
    for check in (True, False):  # shapes are checked without host reads too
        with pytest.raises(ValueError, match="num_drafts must have shape"):
            greedy_accept_triton(drafts, p, torch.zeros(B + 1, dtype=torch.long), check=check)
        with pytest.raises(ValueError, match="num_drafts must have shape"):
            rejection_sample_triton(drafts, q, p, uniforms, noise, torch.zeros(B + 1, dtype=torch.long), check=check)


def test_no_host_reads_without_check(monkeypatch):
    """check=False reads nothing back: every tensor-to-host conversion raises during the calls."""
    g_args = greedy_batch(11, V=37)
    r_args = rejection_batch(11, V=37, with_q=True)
    g_want = greedy_accept_reference(*g_args)
    r_want = rejection_sample_reference(*r_args)

    def host_read(*_args, **_kwargs):
        raise AssertionError("a tensor was read back to the host")

    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    g_got = greedy_accept_triton(*g_args, check=False)
    r_got = rejection_sample_triton(*r_args, check=False)
    monkeypatch.undo()
    assert_same(g_got, g_want)
    assert_same(r_got, r_want)
