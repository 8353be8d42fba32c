"""Verification: greedy acceptance on hand-built cases; rejection sampling is a pure function of
its draws and is lossless.

Losslessness is checked with chi-square tests over a small vocabulary: the first emitted
token, and the first two, must follow the target's distribution whatever the drafter
proposes. Seeds are fixed, so every p-value is deterministic. Negative controls run wrong
rules through the same test to show it has the power to catch them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

import inkfw.speculative.acceptance as verify
from inkfw.speculative.acceptance import emitted_tokens, greedy_accept, rejection_sample
from inkfw.speculative.sampling import Generators, Sampler

V = 6
N = 20_000
P1 = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.10, 0.08])  # target, position 0
Q1 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])  # draft, position 0 (deliberately different)
P2 = torch.tensor([0.10, 0.20, 0.05, 0.30, 0.15, 0.20])  # target, position 1 (independent of token 1)
Q2 = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
P3 = torch.tensor([0.20, 0.10, 0.30, 0.05, 0.25, 0.10])  # target, position 2 (bonus after 2 drafts)
ALPHA = 1e-3  # a correct rule must pass
POWER = 1e-6  # a wrong rule must fail


def chisq_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``tokens`` [N] (ids in [0, len(probs))) being drawn from ``probs``."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * tokens.numel()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def sample_step(
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    num_drafts: torch.Tensor | None,
    generators: Generators,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rejection-sampling step as the verifier runs it: the sampler draws the step's random
    numbers from ``generators``, the pure :func:`rejection_sample` decides."""
    B, k = drafts.shape
    counts = num_drafts if num_drafts is not None else torch.full((B,), k)
    uniforms, noise = Sampler().acceptance_draws(generators, counts, k, p.shape[-1], p.device)  # [B, k], [B, V]
    return rejection_sample(drafts, q, p, uniforms, noise, num_drafts)


def draw(probs: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, n, replacement=True, generator=g)  # [n]


def make_drafts(kind: str, qs: list[torch.Tensor], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts [N, k] and their q [N, k, V] (or None) for k = len(qs).

    ``sampled``: d_i ~ q_i. ``greedy``: a per-row deterministic draft (q one-hot at it), here
    the argmax of a random per-row distribution, passed as an explicit one-hot q.
    ``greedy_none``: the same drafts with ``draft_probs=None``.
    """
    if kind == "sampled":
        drafts = torch.stack([draw(q, N, g) for q in qs], dim=1)  # [N, k]
        return drafts, torch.stack(qs)[None].expand(N, -1, -1)
    drafts = torch.rand(N, len(qs), V, generator=g).argmax(-1)  # [N, k]
    return drafts, (F.one_hot(drafts, V).float() if kind == "greedy" else None)


# --------------------------------------------------------------------------- greedy_accept
def one_hot_logits(tokens: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """Logits [B, T, vocab] whose argmax is ``tokens``, with distracting noise."""
    t = torch.tensor(tokens)
    noise = torch.rand(*t.shape, vocab, generator=torch.Generator().manual_seed(0))
    return F.one_hot(t, vocab) * 5.0 + noise


def test_greedy_accept_hand_cases():
    target = [1, 2, 3, 4]
    drafts = torch.tensor(
        [
            [1, 2, 3],  # all accepted -> bonus 4
            [5, 2, 3],  # none accepted -> bonus 1
            [1, 2, 7],  # two accepted -> bonus 3
            [1, 9, 3],  # one accepted; the later match does not count -> bonus 2
            [1, 2, 3],  # num_drafts 1: the matching padding is never accepted -> bonus 2
            [1, 2, 3],  # num_drafts 0: plain greedy decoding -> bonus 1
            [-1, -1, -1],  # num_drafts 0 with junk padding
        ]
    )
    num_drafts = torch.tensor([3, 3, 3, 3, 1, 0, 0])
    logits = one_hot_logits([target] * drafts.shape[0])
    num_accepted, bonus = greedy_accept(drafts, logits, num_drafts)
    assert num_accepted.tolist() == [3, 0, 2, 1, 1, 0, 0]
    assert bonus.tolist() == [4, 1, 3, 2, 2, 1, 1]
    assert num_accepted.dtype == bonus.dtype == torch.long


def test_greedy_accept_defaults_and_zero_width():
    logits = one_hot_logits([[1, 2, 3], [4, 5, 6]])
    num_accepted, bonus = greedy_accept(torch.tensor([[1, 2], [4, 0]]), logits)
    assert num_accepted.tolist() == [2, 1] and bonus.tolist() == [3, 5]
    num_accepted, bonus = greedy_accept(torch.zeros(2, 0, dtype=torch.long), logits[:, :1])
    assert num_accepted.tolist() == [0, 0] and bonus.tolist() == [1, 4]


def test_greedy_accept_rejects_bad_shapes():
    with pytest.raises(ValueError, match="k\\+1"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 10))
    with pytest.raises(ValueError, match="num_drafts"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 10), torch.tensor([1, 4]))


def test_rejection_sample_with_one_hot_target_is_greedy():
    """Temperature 0 on the target (p one-hot) reproduces greedy verification exactly."""
    g = torch.Generator().manual_seed(1)
    B, k, vocab = 64, 4, 5
    logits = torch.randn(B, k + 1, vocab, generator=g)
    target_tokens = logits.argmax(-1)
    # drafts agree with the target most of the time, so all prefix lengths occur
    drafts = torch.where(
        torch.rand(B, k, generator=g) < 0.7, target_tokens[:, :k], torch.randint(0, vocab, (B, k), generator=g)
    )
    num_drafts = torch.randint(0, k + 1, (B,), generator=g)
    q = torch.softmax(torch.randn(B, k, vocab, generator=g), -1)
    expected = greedy_accept(drafts, logits, num_drafts)
    for draft_probs in (q, None):
        got = sample_step(
            drafts, draft_probs, F.one_hot(target_tokens, vocab).float(), num_drafts, torch.Generator().manual_seed(2)
        )
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_rejection_sample_follows_its_draws():
    """Hand case, k = 2, V = 3: draft i is accepted iff u_i < p_i(d_i) / q_i(d_i); a rejection
    samples from max(p_i - q_i, 0), the bonus from p_k, both through argmax(dist / noise)."""
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]])  # [1, 3, 3]
    q = torch.tensor([[[0.25, 0.5, 0.25], [0.6, 0.2, 0.2]]])  # [1, 2, 3]
    drafts = torch.tensor([[1, 0]])  # ratios p/q: 0.6, then 1/3
    noise = torch.tensor([[1e-3, 1.0, 1.0]])  # favours token 0 wherever it has mass

    def step(u0: float, u1: float) -> tuple[int, int]:
        a, nxt = rejection_sample(drafts, q, p, torch.tensor([[u0, u1]], dtype=torch.float64), noise)
        return int(a[0]), int(nxt[0])

    assert step(0.59, 0.30) == (2, 0)  # both accepted; bonus from p_2 = [.1, .1, .8] with this noise: 0
    assert step(0.61, 0.30) == (0, 0)  # rejected at 0: residual [.25, 0, 0]
    assert step(0.59, 0.34) == (1, 2)  # rejected at 1: residual [0, 0, .4]
    assert (
        rejection_sample(drafts, q, p, torch.tensor([[0.59, 0.30]], dtype=torch.float64), torch.ones(1, 3))[1].item()
        == 2
    )  # plain noise: the bonus is p_2's mode
    a, nxt = rejection_sample(
        drafts, q, p, torch.tensor([[0.59, 0.30]], dtype=torch.float64), noise, torch.tensor([1])
    )  # one real draft: the bonus comes from p_1
    assert (int(a[0]), int(nxt[0])) == (1, 0)


def test_rejection_sample_rejects_bad_draw_shapes():
    drafts, q, p = torch.zeros(2, 3, dtype=torch.long), None, torch.full((2, 4, 5), 0.2)
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample(drafts, q, p, torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, 5))
    with pytest.raises(ValueError, match="noise"):
        rejection_sample(drafts, q, p, torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 4))


# --------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize("kind", ["sampled", "greedy", "greedy_none"])
@pytest.mark.parametrize("k", [1, 2])
def test_first_token_follows_target(kind, k):
    g = torch.Generator().manual_seed(10 + k)
    drafts, q = make_drafts(kind, [Q1, Q2][:k], g)
    p = torch.stack([P1, P2, P3][: k + 1])[None].expand(N, -1, -1)  # [N, k+1, V]
    num_accepted, next_token = sample_step(drafts, q, p, None, g)
    first = torch.where(num_accepted > 0, drafts[:, 0], next_token)  # [N]
    assert chisq_p(first, P1) > ALPHA
    if kind == "sampled":
        # the drafter really differs from the target, so rejections and resampling happened
        assert 0.2 < (num_accepted == 0).float().mean() < 0.8


def first_two_tokens(kind: str, g: torch.Generator) -> torch.Tensor:
    """[N] ids t1 * V + t2 of the first two emitted tokens with k = 2 drafts per step.

    Rows that accept nothing emit one token; their second comes from the next verify step,
    drafted from Q2 against the (context-independent) target [P2, P3].
    """
    drafts, q = make_drafts(kind, [Q1, Q2], g)
    p = torch.stack([P1, P2, P3])[None].expand(N, -1, -1)  # [N, 3, V]
    a, nxt = sample_step(drafts, q, p, None, g)
    out = emitted_tokens(drafts, a, nxt)  # [N, 3]
    drafts2, q2 = make_drafts(kind, [Q2], g)
    a2, nxt2 = sample_step(drafts2, q2, torch.stack([P2, P3])[None].expand(N, -1, -1), None, g)
    second = torch.where(a > 0, out[:, 1], emitted_tokens(drafts2, a2, nxt2)[:, 0])
    return out[:, 0] * V + second


@pytest.mark.parametrize("kind", ["sampled", "greedy", "greedy_none"])
def test_first_two_tokens_follow_target(kind):
    tokens = first_two_tokens(kind, torch.Generator().manual_seed(20))
    assert chisq_p(tokens, torch.outer(P1, P2).flatten()) > ALPHA


def test_greedy_drafts_one_hot_and_none_agree():
    g = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, V, (500, 2), generator=g)
    p = torch.stack([P1, P2, P3])[None].expand(500, -1, -1)
    num_drafts = torch.randint(0, 3, (500,), generator=g)
    a = sample_step(drafts, F.one_hot(drafts, V).float(), p, num_drafts, torch.Generator().manual_seed(4))
    b = sample_step(drafts, None, p, num_drafts, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bonus_follows_target_at_num_drafts():
    """q == p accepts every real draft; the bonus comes from p at position num_drafts."""
    g = torch.Generator().manual_seed(30)
    drafts = torch.stack([draw(P1, N, g), draw(P2, N, g)], dim=1)  # [N, 2]
    p = torch.stack([P1, P2, P3])[None].expand(N, -1, -1)  # [N, 3, V]
    num_drafts = torch.arange(N) % 3  # 0, 1 and 2 drafts
    num_accepted, bonus = sample_step(drafts, p[:, :2], p, num_drafts, g)
    assert torch.equal(num_accepted, num_drafts)
    for n, probs in enumerate([P1, P2, P3]):
        assert chisq_p(bonus[num_drafts == n], probs) > ALPHA


def test_zero_drafts_is_plain_sampling():
    g = torch.Generator().manual_seed(40)
    p = P1[None, None].expand(N, 1, V)
    num_accepted, token = sample_step(torch.zeros(N, 0, dtype=torch.long), torch.zeros(N, 0, V), p, None, g)
    assert num_accepted.eq(0).all()
    assert chisq_p(token, P1) > ALPHA


def test_residual_falls_back_to_target_when_empty():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    r = verify._residual(p, torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.6, 0.3]]))
    assert torch.equal(r[0], p[0])
    assert torch.allclose(r[1], torch.tensor([0.1, 0.0, 0.2]))


def test_zero_probability_tokens_are_never_emitted():
    g = torch.Generator().manual_seed(5)
    p = torch.tensor([0.5, 0.0, 0.5, 0.0, 0.0, 0.0])
    q = torch.full((V,), 1 / V)
    drafts = draw(q, 4000, g)[:, None]  # [4000, 1]
    a, nxt = sample_step(drafts, q[None, None].expand(4000, 1, V), p[None, None].expand(4000, 2, V), None, g)
    first = torch.where(a > 0, drafts[:, 0], nxt)
    assert set(first.tolist()) <= {0, 2} and set(nxt.tolist()) <= {0, 2}


# --------------------------------------------------------------------------- negative controls
def test_negative_control_always_accept_is_caught():
    drafts, _ = make_drafts("sampled", [Q1], torch.Generator().manual_seed(11))
    assert chisq_p(drafts[:, 0], P1) < POWER  # what "always accept" emits first


def test_negative_control_resample_from_target_is_caught(monkeypatch):
    """Sampling the replacement from p instead of max(p - q, 0) is a classic lossy bug."""
    monkeypatch.setattr(verify, "_residual", lambda p, q: p)
    g = torch.Generator().manual_seed(11)
    drafts, q = make_drafts("sampled", [Q1], g)
    num_accepted, next_token = sample_step(drafts, q, torch.stack([P1, P2])[None].expand(N, -1, -1), None, g)
    first = torch.where(num_accepted > 0, drafts[:, 0], next_token)
    assert chisq_p(first, P1) < POWER


def test_negative_control_joint_with_dependent_second_token_is_caught():
    """The joint test sees a second token that wrongly depends on the first."""
    tokens = first_two_tokens("sampled", torch.Generator().manual_seed(20))
    t1, t2 = tokens // V, tokens % V
    wrong = t1 * V + torch.where(t1 == 0, t1, t2)  # after token 0, always repeat it
    assert chisq_p(wrong, torch.outer(P1, P2).flatten()) < POWER


# --------------------------------------------------------------------------- seeds, layout
def test_per_row_generators_ignore_batch_composition():
    """A seeded row gets the same outcome alone and among other rows (other k, other seeds)."""
    g = torch.Generator().manual_seed(6)
    k = 3
    drafts = torch.randint(0, V, (4, k), generator=g)
    q = torch.softmax(torch.randn(4, k, V, generator=g), -1)
    p = torch.softmax(torch.randn(4, k + 1, V, generator=g), -1)
    num_drafts = torch.tensor([3, 1, 0, 2])
    seeds = [100, 101, 102, 103]

    def gens(rows):
        return [torch.Generator().manual_seed(seeds[r]) for r in rows]

    together = sample_step(drafts, q, p, num_drafts, gens(range(4)))
    for r in range(4):
        alone = sample_step(drafts[r : r + 1], q[r : r + 1], p[r : r + 1], num_drafts[r : r + 1], gens([r]))
        assert alone[0].item() == together[0][r].item() and alone[1].item() == together[1][r].item()
    # a row's outcome does not depend on the batch's padded width either
    wide = sample_step(
        torch.cat([drafts, drafts[:, :1]], 1),
        torch.cat([q, q[:, :1]], 1),
        torch.cat([p, p[:, :1]], 1),
        num_drafts,
        gens(range(4)),
    )
    assert torch.equal(wide[0], together[0]) and torch.equal(wide[1], together[1])


def test_emitted_tokens_layout():
    drafts = torch.tensor([[7, 8, 9], [7, 8, 9], [7, 8, 9]])
    out = emitted_tokens(drafts, torch.tensor([0, 2, 3]), torch.tensor([1, 2, 3]))
    assert out.tolist() == [[1, -1, -1, -1], [7, 8, 2, -1], [7, 8, 9, 3]]


def test_empty_batch():
    a, nxt = sample_step(torch.zeros(0, 2, dtype=torch.long), None, torch.zeros(0, 3, V), None, [])
    assert a.shape == nxt.shape == (0,)
    a, bonus = greedy_accept(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 3, V))
    assert a.shape == bonus.shape == (0,)
