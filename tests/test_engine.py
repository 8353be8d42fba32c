"""The speculative engine end to end: greedy MTP output equals plain decoding over random
batches, chunked prefill, prefix caching and preemption; every draft equals the uncached
reference (``check_drafts``) under every acceptance pattern; a broken drafter is caught by
that check although its output is still exact; bad requests are refused cleanly."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

import inkfw.speculative.drafters.mtp as mtp_module
from helpers.engine import (  # noqa: F401
    NO_DRAFTER,
    OracleDrafter,
    double,
    generate,
    make_engine,
    mtp,
    ngram,
    one_thread,
    outputs,
    random_accept,
    random_prompts,
    spec_model,
    uncached_greedy,
)
from helpers.engine import SPEC_VOCAB as VOCAB
from inkfw.errors import ConfigError
from inkfw.speculative.engine import DraftCheckError
from inkfw.speculative.interfaces import FinishReason, RequestStatus
from inkfw.speculative.observers import EngineObserver
from inkfw.speculative.sampling import SamplingParams


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
    ref, _, _ = generate(model, NO_DRAFTER, prompts, new, prefix_caching=prefix, check_drafts=False)
    reqs, eng, _ = generate(
        model, mtp(D, k), prompts, new, prefix_caching=prefix, max_num_batched_tokens=budget, max_num_seqs=seqs
    )
    assert outputs(reqs) == outputs(ref)
    assert eng.metrics.num_draft_tokens > 0


def test_none_equals_uncached_greedy(model):
    rng = random.Random(7)
    prompts = random_prompts(rng, 5, VOCAB) + [[3], [4, 5]]
    reqs, _, _ = generate(model, NO_DRAFTER, prompts, 10, max_num_batched_tokens=11)
    assert outputs(reqs) == [uncached_greedy(model, p, 10) for p in prompts]


def test_ngram_equals_none(model):
    rng = random.Random(8)
    prompts = [[rng.randrange(VOCAB) for _ in range(5)] * 5 for _ in range(4)]
    ref, _, _ = generate(model, NO_DRAFTER, prompts, 12)
    reqs, eng, _ = generate(model, ngram(3), prompts, 12)
    assert outputs(reqs) == outputs(ref)
    assert eng.metrics.num_draft_tokens > 0


def test_accepted_drafts_keep_greedy_output(model):
    """Real greedy verification with many accepted drafts (an oracle drafter): the accepted
    positions' target state written by verify steps is reused correctly, output stays exact."""
    rng = random.Random(9)
    prompts = random_prompts(rng, 6, VOCAB)
    k = 5
    continuations = {tuple(p): p + uncached_greedy(model, p, 16) for p in prompts}
    oracle = double("drafter", OracleDrafter, horizon=16) + [f"spec.num_tokens={k}"]
    reqs, eng, _ = generate(model, oracle, prompts, 16, max_num_batched_tokens=20)
    assert isinstance(eng.drafter, OracleDrafter) and eng.drafter.num_tokens == k
    assert [r.token_ids for r in reqs] == [continuations[tuple(p)] for p in prompts]
    m = eng.metrics
    assert m.num_accepted_tokens > 0.25 * m.num_draft_tokens and m.accepted_per_position[k - 1] > 0


@pytest.mark.parametrize("prefix", [False, True])
def test_preemption_keeps_greedy_output(model, prefix):
    """A pool too small for the batch: requests are preempted and recomputed, output unchanged."""
    rng = random.Random(11)
    prompts = random_prompts(rng, 8, VOCAB, lo=10, hi=40)
    prompts[1] = prompts[0][:30] + prompts[1][:4]
    ref, _, _ = generate(model, NO_DRAFTER, prompts, 12, check_drafts=False)
    reqs, _, _ = generate(
        model, mtp(3, 5), prompts, 12, prefix_caching=prefix, num_blocks=24, max_num_batched_tokens=32
    )
    assert max(r.num_preemptions for r in reqs) > 0
    assert outputs(reqs) == outputs(ref)


def test_request_larger_than_pool_fails_alone(model):
    """A request that cannot fit even alone finishes with an error; the others complete."""
    rng = random.Random(12)
    prompts = random_prompts(rng, 3, VOCAB, lo=5, hi=8)
    eng, kv = make_engine(model, NO_DRAFTER, num_blocks=4)
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
    reqs, _, _ = generate(model, mtp(2, 4), prompts, 10, params=params)
    assert [r.output_token_ids for r in reqs[::2]] == [uncached_greedy(model, p, 10) for p in prompts[::2]]


def test_max_model_len_limits_drafts(model):
    """Requests that run into max_model_len finish there ("length") with at most as many drafts
    as there is room for; drafts stay exact up to the last position."""
    rng = random.Random(14)
    prompts = random_prompts(rng, 4, VOCAB, lo=10, hi=25)
    reqs, eng, _ = generate(model, mtp(4, 7), prompts, 60, verifier=random_accept(seed=6), max_model_len=32)
    verifier = eng.verifier
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
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=1)] + [SamplingParams()] * 5
    _, eng, _ = generate(
        model,
        mtp(D, k),
        prompts,
        [20, 20, 20, 1, 3, 20, 20, 20],
        params=params,
        verifier=random_accept(seed=D * 10 + k),
        max_num_batched_tokens=[512, 9][k % 2],
    )
    verifier = eng.verifier
    seen = {a for _, _, _, a, _ in verifier.history}
    assert seen == set(range(k + 1)), f"acceptance counts seen: {sorted(seen)}"
    assert {a for _, _, n, a, _ in verifier.history if n == k} >= {0, k}


def test_random_acceptance_chunked_prefix_cached(model):
    """Random acceptance with prefix hits, chunked prefill and preemption, all at once."""
    rng = random.Random(5)
    base = random_prompts(rng, 1, VOCAB, lo=30, hi=30)[0]
    prompts = [base[: rng.randint(20, 30)] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))] for _ in range(8)]
    reqs, eng, _ = generate(
        model, mtp(3, 6), prompts, 14, verifier=random_accept(seed=3), num_blocks=16, max_num_batched_tokens=11
    )
    verifier = eng.verifier
    assert max(r.num_preemptions for r in reqs) > 0
    assert max(a for _, _, _, a, _ in verifier.history) == 6


@pytest.mark.parametrize("D,k", [(4, 4), (4, 7), (3, 5)])
def test_prompts_shorter_than_lookahead(model, D, k):
    """1- and 2-token prompts with P = min(D, k) > prompt length: r never reaches before position 0."""
    prompts = [[7], [9, 3], [5], [1, 2]]
    reqs, eng, _ = generate(model, mtp(D, k), prompts, 30, verifier=random_accept(seed=k))
    verifier = eng.verifier
    assert all(len(r.output_token_ids) == 30 or r.finish_reason == "stop" for r in reqs)
    # the first verify after a 1-token prompt has no drafts; later ones do, at every acceptance
    assert {a for _, _, _, a, _ in verifier.history} == set(range(k + 1))
    assert verifier.history[0][2] == 0  # request 0 (1 token): its first verify had nothing to check


def test_finish_inside_accepted_drafts(model, monkeypatch):
    """A request whose EOS is an accepted draft stops there (later emitted tokens dropped),
    frees its blocks mid-step, and the other requests are unaffected."""
    rng = random.Random(21)
    prompts = random_prompts(rng, 6, VOCAB, lo=1, hi=30)
    reqs, eng, _ = generate(model, mtp(4, 5), prompts, 16, verifier=random_accept(seed=9, p_argmax=1.0))
    first = eng.verifier
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
    reqs, eng, _ = generate(model, mtp(4, 5), prompts, 16, verifier=random_accept(seed=9, p_argmax=1.0))
    second = eng.verifier
    stops = set(model.cfg.eos_token_ids)
    for r, full in zip(reqs, base):
        cut = next((i + 1 for i, t in enumerate(full) if t in stops), len(full))
        assert r.output_token_ids == full[:cut]
        assert (r.finish_reason == "stop") == (cut < len(full) or full[-1] in stops)
    # the stop really happened inside a verify step's accepted drafts
    last_step = {}
    for rid, _step, _, a, emitted in second.history:
        last_step[rid] = (a, emitted)
    assert any(
        r.output_token_ids[-1] == eos and last_step[r.id][1].index(eos) < last_step[r.id][0]
        for r in reqs
        if r.output_token_ids and r.output_token_ids[-1] == eos
    )


@pytest.mark.parametrize("D,k", [(2, 2), (3, 5), (3, 3)])
def test_sampled_drafts_match_reference_with_real_acceptance(small_vocab_model, D, k):
    """Sampled drafts (temperature 1, top-k, top-p) under real rejection sampling, where many
    drafts are accepted: check_drafts holds, and acceptance really is substantial."""
    m = small_vocab_model
    rng = random.Random(D + k)
    prompts = random_prompts(rng, 8, 12, lo=1, hi=24)
    params = [
        SamplingParams(temperature=1.0, seed=i, top_k=[None, 5][i % 2], top_p=[1.0, 0.9][i % 3 == 0]) for i in range(8)
    ]
    reqs, eng, _ = generate(m, mtp(D, k), prompts, 14, params=params)
    assert eng.metrics.num_accepted_tokens > 0.1 * eng.metrics.num_draft_tokens
    assert eng.metrics.accepted_per_position[k - 1] > 0


# --------------------------------------------------------------------------- broken drafters
_RowState = mtp_module._RowState


def _drop_tail(next_start, tail_len, deferred=None):
    """No cached tail: re-prefill r is always 0."""
    return _RowState(next_start, 0, deferred)


def _short_tail(next_start, tail_len, deferred=None):
    """One cached position too few: r is clamped to P - 2."""
    return _RowState(next_start, max(0, tail_len - 1), deferred)


@pytest.mark.parametrize("breakage", [_drop_tail, _short_tail])
def test_check_drafts_catches_broken_reprefill(model, monkeypatch, breakage):
    """Acceptance, not output, reveals a broken drafter: its greedy output is still exact, but
    its drafts differ from the reference as soon as re-prefill matters."""
    rng = random.Random(31)
    prompts = random_prompts(rng, 4, VOCAB, lo=5, hi=30)
    monkeypatch.setattr(mtp_module, "_RowState", breakage)
    ref, _, _ = generate(model, NO_DRAFTER, prompts, 10, check_drafts=False)
    broken, _, _ = generate(model, mtp(4, 4), prompts, 10, check_drafts=False)
    assert outputs(broken) == outputs(ref)
    with pytest.raises(DraftCheckError, match="check_drafts: request"):
        generate(model, mtp(4, 4), prompts, 10, verifier=random_accept(seed=1))


class _WrongDecodeDepth:
    """The model as a drafter sees it, except that one-position steps (decode steps) run depth
    2 where depth 0 is due (both sliding-window depths, so the cache shapes still fit)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def mtp_step(self, depth, hidden, token_ids, positions, cache=None, depth_input=None):
        if positions.shape[1] == 1 and depth == 0:
            depth = 2
        return self._model.mtp_step(depth, hidden, token_ids, positions, cache, depth_input)


def test_check_drafts_catches_wrong_decode_depth(model):
    """Decode steps (k > D) must cycle depths s % D; a drafter that does not is caught."""
    eng, _ = make_engine(model, mtp(3, 5))
    eng.drafter.model = _WrongDecodeDepth(model)
    prompts = [[5, 6, 7, 8, 9, 10], [3, 1, 4, 1, 5]]  # >= 3 tokens: no prefill span is one position long
    reqs = [eng.add_request(p, max_new_tokens=10) for p in prompts]
    with pytest.raises(DraftCheckError, match=r"draft 4 of 5 \(depth 0\)"):
        eng.generate(reqs)


# --------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize(
    "prompt,kw,needle",
    [
        ([], {}, "empty"),
        ([1, 2, -1], {}, "token ids must lie in"),
        ([1, 128], {}, "token ids must lie in"),
        (list(range(1, 41)), {}, "model limit is 40"),
        ([1, 2, 3], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2, 3], {"max_new_tokens": 2.5}, "max_new_tokens"),
    ],
)
def test_bad_request_is_refused_and_others_complete(model, prompt, kw, needle):
    eng, kv = make_engine(model, mtp(2, 3), max_model_len=40)
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


# --------------------------------------------------------------------------- observers
class Recorder(EngineObserver):
    def __init__(self):
        self.events: list[tuple] = []

    def on_forward_start(self, phase):
        self.events.append(("start", phase))

    def on_forward_end(self, phase, seconds):
        assert seconds >= 0
        self.events.append(("end", phase, seconds))

    def on_step_end(self, engine, finished):
        self.events.append(("step", engine.times.num_steps, [r.id for r in finished]))


@pytest.mark.parametrize("drafter, phases", [(NO_DRAFTER, {"target"}), (mtp(3, 4), {"target", "draft"})])
def test_observers_see_every_forward_and_step(model, drafter, phases):
    """Every model call is one start/end pair of its phase, their seconds add up to the engine's
    forward time, every step ends with the requests that finished in it; a removed observer
    hears nothing more."""
    eng, _ = make_engine(model, drafter, check_drafts=False)
    rec, late = Recorder(), Recorder()
    eng.add_observer(rec)
    reqs = [eng.add_request([3, 1, 4, 1, 5, 9], max_new_tokens=5), eng.add_request([2, 7], max_new_tokens=8)]
    eng.generate(reqs)
    forwards = [e for e in rec.events if e[0] != "step"]
    assert [e[:2] for e in forwards[::2]] == [("start", e[1]) for e in forwards[1::2]]  # start, end, start, end ...
    assert {e[1] for e in forwards} == phases
    assert sum(e[2] for e in forwards if e[0] == "end") == pytest.approx(eng.times.forward_s)
    steps = [e for e in rec.events if e[0] == "step"]
    assert [s[1] for s in steps] == list(range(1, eng.times.num_steps + 1))
    assert sorted(i for s in steps for i in s[2]) == sorted(r.id for r in reqs)
    eng.remove_observer(rec)
    eng.add_observer(late)
    before = len(rec.events)
    eng.generate([eng.add_request([4, 4], max_new_tokens=2)])
    assert len(rec.events) == before and late.events


def test_steps_with_prompt_chunks_are_timed_apart(model):
    """``StepTimes`` counts the steps that ran prompt chunks (chunked prompts; a prompt admitted
    beside a decoding request shares its step) and their seconds, within the totals; the others
    are decode steps."""
    eng, _ = make_engine(model, mtp(2, 2), max_num_batched_tokens=8, check_drafts=False)
    first = eng.add_request(list(range(3, 23)), max_new_tokens=12)  # 19 positions to prefill: 3 chunks of <= 8
    second = None
    expected = 0
    while not first.finished or (second is not None and not second.finished):
        if eng.times.num_steps == 5:
            second = eng.add_request([5, 6, 7, 8, 9], max_new_tokens=4)  # its chunk joins `first`'s decode step
        expected += any(r.num_computed < len(r.token_ids) - 1 for r in (*eng.waiting, *eng.running))
        eng.step()
    t = eng.times
    assert expected == 4 and t.prompt_steps == expected  # first's 3 chunks, second's 1 beside a decode
    assert t.decode_steps == t.num_steps - expected > 0
    assert 0 < t.prompt_s < t.total_s and t.decode_s == pytest.approx(t.total_s - t.prompt_s)


def test_status_and_finish_reason_are_named_strings(model):
    """Request status and finish reason are enums whose values are the strings JSON shows."""
    eng, _ = make_engine(model, NO_DRAFTER, check_drafts=False)
    r = eng.add_request([5, 6, 7], max_new_tokens=3)
    assert r.status is RequestStatus.WAITING and r.finish_reason is None
    eng.step()
    assert r.status is RequestStatus.RUNNING
    eng.generate([r])
    assert r.status is RequestStatus.FINISHED and r.finished
    assert r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert json.dumps([r.status, r.finish_reason]) == f'["finished", "{r.finish_reason.value}"]'
    assert f"{r.finish_reason}" == r.finish_reason.value and r.finish_reason == r.finish_reason.value
