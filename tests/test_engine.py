"""The speculative engine end to end: greedy MTP output equals plain decoding over random
batches, chunked prefill, prefix caching and preemption; every draft equals the uncached
reference (``check_drafts``) under every acceptance pattern; a broken drafter is caught by
that check although its output is still exact; bad requests are refused cleanly."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import inkfw.speculative.drafters.mtp as mtp_module
from inkfw.errors import ConfigError
from inkfw.speculative.drafters import MtpDrafter, NgramDrafter, NoDrafter
from inkfw.speculative.engine import DraftCheckError
from inkfw.speculative.interfaces import Drafts
from inkfw.speculative.sampling import SamplingParams

from helpers.engine import (RandomAcceptVerifier, generate, make_engine, one_thread, outputs,  # noqa: F401
                          random_prompts, spec_model, uncached_greedy)

VOCAB = 120  # logits vocabulary of spec_model()


@pytest.fixture(scope="module")
def model():
    return spec_model(seed=0)


@pytest.fixture(scope="module")
def small_vocab_model():
    """12-token vocabulary with a scaled unembedding: sampled MTP drafts are often accepted by the
    real verifier (random-weight MTP depths share the target's unembedding)."""
    m = spec_model(seed=1, vocab_size=16, unpadded_vocab_size=12, eos_token_id=None)
    with torch.no_grad():
        m.unembed.weight.mul_(4.0)
    return m


# --------------------------------------------------------------------------- greedy: mtp == none
# (depths D, draft tokens k): k in {1, 2, D, D + 3} and every D in 1..4
GREEDY_CASES = [(1, 1), (1, 4), (2, 2), (2, 5), (3, 1), (3, 3), (4, 2), (4, 7)]


@pytest.mark.parametrize("case", range(len(GREEDY_CASES)))
def test_greedy_mtp_equals_none(model, case):
    """Random batch (1-16 requests, prompts of 1..40 tokens, some sharing prefixes), random
    prefix caching and chunk budget: token-for-token the output of drafter=none."""
    D, k = GREEDY_CASES[case]
    rng = random.Random(1000 + case)
    n = rng.randint(1, 16) if case % 2 else rng.randint(1, 6)
    prompts = random_prompts(rng, n, VOCAB)
    if n > 1:  # a shared prefix, so prefix caching has something to find
        prompts[-1] = prompts[0][: rng.randint(1, len(prompts[0]))] + prompts[-1][:3]
    prefix = case % 3 != 0
    budget = [512, 9, 64, 13][case % 4]  # small budgets: chunked prefill
    seqs = [16, 3][case % 5 == 4]  # fewer slots than requests: a queue
    new = rng.randint(8, 12)
    ref, _, _ = generate(model, NoDrafter(), prompts, new, prefix_caching=prefix, check_drafts=False)
    reqs, eng, _ = generate(model, MtpDrafter(model, num_tokens=k, num_depths=D), prompts, new,
                            prefix_caching=prefix, max_num_batched_tokens=budget, max_num_seqs=seqs)
    assert outputs(reqs) == outputs(ref)
    assert eng.metrics.num_draft_tokens > 0


def test_none_equals_uncached_greedy(model):
    rng = random.Random(7)
    prompts = random_prompts(rng, 5, VOCAB) + [[3], [4, 5]]
    reqs, _, _ = generate(model, NoDrafter(), prompts, 10, max_num_batched_tokens=11)
    assert outputs(reqs) == [uncached_greedy(model, p, 10) for p in prompts]


def test_ngram_equals_none(model):
    rng = random.Random(8)
    prompts = [[rng.randrange(VOCAB) for _ in range(5)] * 5 for _ in range(4)]
    ref, _, _ = generate(model, NoDrafter(), prompts, 12)
    reqs, eng, _ = generate(model, NgramDrafter(num_tokens=3), prompts, 12)
    assert outputs(reqs) == outputs(ref)
    assert eng.metrics.num_draft_tokens > 0


class OracleDrafter:
    """Drafter test double: proposes the target's own greedy continuation (computed without a
    cache), each draft corrupted with probability 1/4 (seeded), so real greedy verification
    accepts long and varied prefixes."""

    lookahead = 0
    num_depths = 0
    needs_hidden = False

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], num_tokens: int, seed: int = 0):
        self.continuations, self.num_tokens, self.rng = continuations, num_tokens, random.Random(seed)

    def propose(self, spans, kv) -> Drafts:
        tokens = torch.zeros(len(spans), self.num_tokens, dtype=torch.long)
        num = torch.zeros(len(spans), dtype=torch.long)
        for b, span in enumerate(spans):
            r = span.request
            full = self.continuations[tuple(r.prompt_token_ids)]
            L, n = len(r.token_ids), min(self.num_tokens, span.num_drafts)
            assert r.token_ids == full[:L]  # greedy verification never lets a wrong token through
            true = (full[L: L + n] + [0] * n)[:n]
            drafts = [t if self.rng.random() < 0.75 else (t + 1) % VOCAB for t in true]
            tokens[b, :n] = torch.tensor(drafts, dtype=torch.long)
            num[b] = n
        return Drafts(tokens, num)

    def release(self, rid) -> None:
        pass


def test_accepted_drafts_keep_greedy_output(model):
    """Real greedy verification with many accepted drafts (an oracle drafter): the accepted
    positions' target state written by verify steps is reused correctly, output stays exact."""
    rng = random.Random(9)
    prompts = random_prompts(rng, 6, VOCAB)
    k = 5
    continuations = {tuple(p): p + uncached_greedy(model, p, 16) for p in prompts}
    reqs, eng, _ = generate(model, OracleDrafter(continuations, k), prompts, 16, max_num_batched_tokens=20)
    assert [r.token_ids for r in reqs] == [continuations[tuple(p)] for p in prompts]
    m = eng.metrics
    assert m.num_accepted_tokens > 0.25 * m.num_draft_tokens and m.accepted_per_position[k - 1] > 0


@pytest.mark.parametrize("prefix", [False, True])
def test_preemption_keeps_greedy_output(model, prefix):
    """A pool too small for the batch: requests are preempted and recomputed, output unchanged."""
    rng = random.Random(11)
    prompts = random_prompts(rng, 8, VOCAB, lo=10, hi=40)
    prompts[1] = prompts[0][:30] + prompts[1][:4]
    ref, _, _ = generate(model, NoDrafter(), prompts, 12, check_drafts=False)
    reqs, _, _ = generate(model, MtpDrafter(model, num_tokens=5, num_depths=3), prompts, 12,
                          prefix_caching=prefix, num_blocks=24, max_num_batched_tokens=32)
    assert max(r.num_preemptions for r in reqs) > 0
    assert outputs(reqs) == outputs(ref)


def test_request_larger_than_pool_fails_alone(model):
    """A request that cannot fit even alone finishes with an error; the others complete."""
    rng = random.Random(12)
    prompts = random_prompts(rng, 3, VOCAB, lo=5, hi=8)
    eng, kv = make_engine(model, NoDrafter(), num_blocks=4)
    small = [eng.add_request(p, max_new_tokens=4) for p in prompts]
    big = eng.add_request(list(range(1, 40)), max_new_tokens=4)
    eng.generate(small + [big])
    assert big.finish_reason == "error" and "KV cache blocks" in big.error
    assert all(r.finish_reason in ("length", "stop") for r in small)
    assert outputs(small) == [uncached_greedy(model, p, 4) for p in prompts]
    assert kv.is_whole()


def test_greedy_rows_exact_next_to_sampled_rows(model):
    """Greedy and sampled requests in one batch (the verifier then rejection-samples every row):
    the greedy rows still produce plain greedy decoding."""
    rng = random.Random(13)
    prompts = random_prompts(rng, 6, VOCAB, lo=1, hi=30)
    params = [SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.9, top_k=20, seed=i) for i in range(6)]
    reqs, _, _ = generate(model, MtpDrafter(model, num_tokens=4, num_depths=2), prompts, 10, params=params)
    assert [r.output_token_ids for r in reqs[::2]] == [uncached_greedy(model, p, 10) for p in prompts[::2]]


def test_max_model_len_limits_drafts(model):
    """Requests that run into max_model_len finish there ("length") with at most as many drafts
    as there is room for; drafts stay exact up to the last position."""
    rng = random.Random(14)
    prompts = random_prompts(rng, 4, VOCAB, lo=10, hi=25)
    verifier = RandomAcceptVerifier(seed=6)
    reqs, _, _ = generate(model, MtpDrafter(model, num_tokens=7, num_depths=4), prompts, 60, verifier=verifier,
                          max_model_len=32)
    for r in reqs:
        assert len(r.token_ids) == 32 or r.finish_reason == "stop"
    assert any(r.finish_reason == "length" for r in reqs)
    room = [32 - L for L in verifier.lengths]
    assert all(n <= left for (_, _, n, _, _), left in zip(verifier.history, room))
    assert any(0 < n == left < 7 for (_, _, n, _, _), left in zip(verifier.history, room))  # shrunk to fit


# --------------------------------------------------------------------------- random acceptance
# k in {1, 2, D, D + 3} for D in 1..4 (k > D runs decode steps)
RANDOM_CASES = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 5), (3, 1), (3, 3), (3, 6), (4, 2), (4, 4), (4, 7)]


@pytest.mark.parametrize("D,k", RANDOM_CASES)
def test_random_acceptance_drafts_match_reference(model, D, k):
    """Every a' in [0, n] occurs; check_drafts holds after each (re-prefill r = P-1-a')."""
    rng = random.Random(100 * D + k)
    prompts = [[rng.randrange(VOCAB)], [rng.randrange(VOCAB) for _ in range(2)]] + random_prompts(rng, 6, VOCAB)
    verifier = RandomAcceptVerifier(seed=D * 10 + k)
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=1)] + [SamplingParams()] * 5
    generate(model, MtpDrafter(model, num_tokens=k, num_depths=D), prompts, [20, 20, 20, 1, 3, 20, 20, 20],
             params=params, verifier=verifier, max_num_batched_tokens=[512, 9][k % 2])
    seen = {a for _, _, _, a, _ in verifier.history}
    assert seen == set(range(k + 1)), f"acceptance counts seen: {sorted(seen)}"
    assert {a for _, _, n, a, _ in verifier.history if n == k} >= {0, k}


def test_random_acceptance_chunked_prefix_cached(model):
    """Random acceptance with prefix hits, chunked prefill and preemption, all at once."""
    rng = random.Random(5)
    base = random_prompts(rng, 1, VOCAB, lo=30, hi=30)[0]
    prompts = [base[: rng.randint(20, 30)] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))]
               for _ in range(8)]
    verifier = RandomAcceptVerifier(seed=3)
    reqs, _, _ = generate(model, MtpDrafter(model, num_tokens=6, num_depths=3), prompts, 14, verifier=verifier,
                          num_blocks=16, max_num_batched_tokens=11)
    assert max(r.num_preemptions for r in reqs) > 0
    assert max(a for _, _, _, a, _ in verifier.history) == 6


@pytest.mark.parametrize("D,k", [(4, 4), (4, 7), (3, 5)])
def test_prompts_shorter_than_lookahead(model, D, k):
    """1- and 2-token prompts with P = min(D, k) > prompt length: r never reaches before position 0."""
    prompts = [[7], [9, 3], [5], [1, 2]]
    verifier = RandomAcceptVerifier(seed=k)
    reqs, _, _ = generate(model, MtpDrafter(model, num_tokens=k, num_depths=D), prompts, 30, verifier=verifier)
    assert all(len(r.output_token_ids) == 30 or r.finish_reason == "stop" for r in reqs)
    # the first verify after a 1-token prompt has no drafts; later ones do, at every acceptance
    assert {a for _, _, _, a, _ in verifier.history} == set(range(k + 1))
    assert verifier.history[0][2] == 0  # request 0 (1 token): its first verify had nothing to check


def test_finish_inside_accepted_drafts(model, monkeypatch):
    """A request whose EOS is an accepted draft stops there (later emitted tokens dropped),
    frees its blocks mid-step, and the other requests are unaffected."""
    rng = random.Random(21)
    prompts = random_prompts(rng, 6, VOCAB, lo=1, hi=30)
    drafter = lambda m: MtpDrafter(m, num_tokens=5, num_depths=4)  # noqa: E731
    first = RandomAcceptVerifier(seed=9, p_argmax=1.0)
    reqs, _, _ = generate(model, drafter(model), prompts, 16, verifier=first)
    base = outputs(reqs)
    # a token whose first occurrence in some output is an accepted draft followed by more
    # tokens of the same verify step: make it an end token
    seen: dict[int, list[int]] = {}
    eos = None
    for rid, _, _, a, emitted in first.history:
        out = seen.setdefault(rid, [])
        for i, t in enumerate(emitted):
            if eos is None and i < a and t not in out and t not in model.cfg.eos_token_ids:
                eos = t
            out.append(t)
    assert eos is not None
    monkeypatch.setattr(model, "cfg", dataclasses.replace(model.cfg, eos_token_id=[*model.cfg.eos_token_ids, eos]))
    second = RandomAcceptVerifier(seed=9, p_argmax=1.0)
    reqs, _, _ = generate(model, drafter(model), prompts, 16, verifier=second)
    stops = set(model.cfg.eos_token_ids)
    for r, full in zip(reqs, base):
        cut = next((i + 1 for i, t in enumerate(full) if t in stops), len(full))
        assert r.output_token_ids == full[:cut]
        assert (r.finish_reason == "stop") == (cut < len(full) or full[-1] in stops)
    # the stop really happened inside a verify step's accepted drafts
    last_step = {}
    for rid, step, _, a, emitted in second.history:
        last_step[rid] = (a, emitted)
    assert any(r.output_token_ids[-1] == eos and last_step[r.id][1].index(eos) < last_step[r.id][0]
               for r in reqs if r.output_token_ids and r.output_token_ids[-1] == eos)


@pytest.mark.parametrize("D,k", [(2, 2), (3, 5), (3, 3)])
def test_sampled_drafts_match_reference_with_real_acceptance(small_vocab_model, D, k):
    """Sampled drafts (temperature 1, top-k, top-p) under real rejection sampling, where many
    drafts are accepted: check_drafts holds, and acceptance really is substantial."""
    m = small_vocab_model
    rng = random.Random(D + k)
    prompts = random_prompts(rng, 8, 12, lo=1, hi=24)
    params = [SamplingParams(temperature=1.0, seed=i, top_k=[None, 5][i % 2], top_p=[1.0, 0.9][i % 3 == 0])
              for i in range(8)]
    reqs, eng, _ = generate(m, MtpDrafter(m, num_tokens=k, num_depths=D), prompts, 14, params=params)
    assert eng.metrics.num_accepted_tokens > 0.1 * eng.metrics.num_draft_tokens
    assert eng.metrics.accepted_per_position[k - 1] > 0


# --------------------------------------------------------------------------- broken drafters
_RowState = mtp_module._RowState


def _drop_tail(next_start, tail):
    """No cached tail: re-prefill r is always 0."""
    return _RowState(next_start, tail[:0])


def _short_tail(next_start, tail):
    """One cached position too few: r is clamped to P - 2."""
    return _RowState(next_start, tail[1:])


@pytest.mark.parametrize("breakage", [_drop_tail, _short_tail])
def test_check_drafts_catches_broken_reprefill(model, monkeypatch, breakage):
    """Acceptance, not output, reveals a broken drafter: its greedy output is still exact, but
    its drafts differ from the reference as soon as re-prefill matters."""
    rng = random.Random(31)
    prompts = random_prompts(rng, 4, VOCAB, lo=5, hi=30)
    monkeypatch.setattr(mtp_module, "_RowState", breakage)
    ref, _, _ = generate(model, NoDrafter(), prompts, 10, check_drafts=False)
    broken, _, _ = generate(model, MtpDrafter(model, num_tokens=4, num_depths=4), prompts, 10, check_drafts=False)
    assert outputs(broken) == outputs(ref)
    with pytest.raises(DraftCheckError, match="check_drafts: request"):
        generate(model, MtpDrafter(model, num_tokens=4, num_depths=4), prompts, 10,
                 verifier=RandomAcceptVerifier(seed=1))


class _WrongDecodeDepth:
    """The model as a drafter sees it, except that one-position steps (decode steps) run depth
    2 where depth 0 is due (both sliding-window depths, so the cache shapes still fit)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def mtp_step(self, depth, hidden, token_ids, positions, cache=None):
        if positions.shape[1] == 1 and depth == 0:
            depth = 2
        return self._model.mtp_step(depth, hidden, token_ids, positions, cache)


def test_check_drafts_catches_wrong_decode_depth(model):
    """Decode steps (k > D) must cycle depths s % D; a drafter that does not is caught."""
    drafter = MtpDrafter(model, num_tokens=5, num_depths=3)
    drafter.model = _WrongDecodeDepth(model)
    prompts = [[5, 6, 7, 8, 9, 10], [3, 1, 4, 1, 5]]  # >= 3 tokens: no prefill span is one position long
    with pytest.raises(DraftCheckError, match=r"draft 4 of 5 \(depth 0\)"):
        generate(model, drafter, prompts, 10)


# --------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize("prompt,kw,needle", [
    ([], {}, "empty"),
    ([1, 2, -1], {}, "token ids must lie in"),
    ([1, 128], {}, "token ids must lie in"),
    (list(range(1, 41)), {}, "model limit is 40"),
    ([1, 2, 3], {"max_new_tokens": 0}, "max_new_tokens"),
    ([1, 2, 3], {"max_new_tokens": 2.5}, "max_new_tokens"),
])
def test_bad_request_is_refused_and_others_complete(model, prompt, kw, needle):
    eng, kv = make_engine(model, MtpDrafter(model, num_tokens=3, num_depths=2), max_model_len=40)
    good = [eng.add_request([5, 6, 7], max_new_tokens=6)]
    with pytest.raises(ConfigError) as err:
        eng.add_request(prompt, **kw)
    msg = str(err.value)
    assert needle in msg
    assert "\n" not in msg and msg.endswith(".") and msg.count(". ") == 0 and len(msg) < 200
    good.append(eng.add_request([8, 9], max_new_tokens=6))
    assert len(eng.waiting) == 2  # nothing of the bad request was queued
    eng.generate(good)
    assert outputs(good) == [uncached_greedy(model, p, 6) for p in ([5, 6, 7], [8, 9])]
    assert kv.is_whole()
