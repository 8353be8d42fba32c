"""The engine's end-to-end correctness checks with static steps, compiled (``engine.compile=true``)
and captured as CUDA graphs (``engine.cuda_graphs``, on the CPU through helpers.cuda_graphs,
which replays the recorded ops without running Python, as a GPU does), kept short: the
scenarios of tests/test_engine.py (a queue of requests in batches of 1-4 rows padded to bucket
4, shared prefixes, chunked prefill, preemption, every acceptance count, sampled rows beside
greedy ones, k > D), and adaptive k's of tests/test_static_step.py (k switching between rounds,
shallow rounds deferring deeper depths, catch-ups, lags, requests kept to fewer depths beside
ones carrying every depth). Static output equals eager output token for token (greedy output
also plain decoding's), and every draft a static round made equals the uncached reference
(``check_drafts`` would run the rounds eagerly, so drafts are recorded and checked afterwards).

Compiling is the cost here (on a cold inductor cache about half a minute a graph on 2 cores):
the adaptive-k engines here share one configuration and one batch bucket, so inductor's cache
serves each the first one's graphs; the k > D engine compiles two of its own. Batch 1 compiled
is tests/test_static_step.py's."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from torch._dynamo.utils import counters

from helpers.cuda_graphs import RecordedCudaGraphs
from helpers.engine import (  # noqa: F401
    AUTO,
    NO_DRAFTER,
    assert_drafts_are_the_reference,
    counted_compiles,
    generate,
    make_engine,
    mtp,
    one_thread,
    outputs,
    parts,
    random_accept,
    random_prompts,
    record_proposals,
    run_to_completion,
    spec_model,
)
from helpers.engine import SPEC_VOCAB as VOCAB
from inkfw.speculative.adaptive import AdaptiveK
from inkfw.speculative.engine import Engine, Request
from inkfw.speculative.sampling import SamplingParams

# a queue of eight requests through four slots, every batch padded to bucket 4, chunked prefill
# (11 tokens a step), prefix-cache hits and preemption (16 blocks of 4 positions)
QUEUE = ["engine.batch_buckets=[4]"]
QUEUE_OPTIONS = dict(num_blocks=16, max_num_batched_tokens=11, max_num_seqs=4)


MODES = ["compiled", "graphs"]


@pytest.fixture(scope="module")
def model():
    return spec_model(seed=0)


def static_engine(
    model, mode: str, monkeypatch, drafter: Sequence[str] = AUTO, **options
) -> tuple[Engine, RecordedCudaGraphs | None]:
    """An engine over the queue (adaptive k unless ``drafter`` says otherwise) whose steps run
    compiled (``mode`` "compiled") or as CUDA graphs captured per shape and replayed
    (``"graphs"``, simulated: the :class:`RecordedCudaGraphs` returned patches ``torch.cuda``
    for the test)."""
    graphs = RecordedCudaGraphs(monkeypatch) if mode == "graphs" else None
    static = "engine.compile=true" if mode == "compiled" else "engine.cuda_graphs=true"
    engine, _ = make_engine(model, drafter, check_drafts=False, overrides=[static, *QUEUE], **options)
    return engine, graphs


def queue_of_prompts(seed: int) -> list[list[int]]:
    """Eight prompts of 1-40 tokens, two sharing a prefix with a third (prefix-cache hits)."""
    rng = random.Random(seed)
    prompts = random_prompts(rng, 8, VOCAB, lo=1, hi=40)
    base = random_prompts(rng, 1, VOCAB, lo=30, hi=30)[0]
    prompts[2], prompts[5] = base + prompts[2][:3], base[:26] + prompts[5][:5]
    return prompts


def static_functions(engine: Engine) -> set[str]:
    """Names of the engine's step functions that ran compiled or were captured as CUDA graphs
    (verify, drafting rounds, depths)."""
    verifier, drafter = parts(engine)
    steps = (*verifier._steps.values(), *drafter._steps.values())
    return {f.name for f in steps if (f.compiled and f.warmup_s > 0) or f._graphs}


def choose_at_random(engine: Engine, seed: int) -> None:
    """Adaptive k's choices drawn at random, the same sequence in every engine given one seed:
    k per round in 0..2, and per admission whether the request decodes plainly, carries the next
    probe (every depth) or keeps 1 or 2 depths. Everything else is the engine's own."""
    rng = random.Random(seed)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    engine._round_k = lambda *_, **__: rng.choice([0, 1, 1, 1, 2, 2])  # type: ignore[method-assign]
    engine._admits_plainly = lambda *_: rng.random() < 0.2  # type: ignore[method-assign]
    adaptive.steps_to_probe = lambda bucket: rng.choice([0, 10**6])  # type: ignore[method-assign]
    adaptive.depths_for = lambda *_, **__: rng.choice([1, 2])  # type: ignore[method-assign]


def rounds_of_mixed_depths(engine: Engine) -> list[int]:
    """Counts, in the one-element list returned, the static drafting rounds whose rows keep
    different numbers of depths (a row kept to 1 beside a carrier of both, drafting k = 1)."""
    drafter, count = parts(engine)[1], [0]
    propose = drafter.propose

    def counting(spans, *args, **kwargs):
        count[0] += kwargs.get("pad_to") is not None and len({s.depths for s in spans}) > 1
        return propose(spans, *args, **kwargs)

    drafter.propose = counting  # type: ignore[method-assign]
    return count


@pytest.mark.parametrize("mode", MODES)
def test_static_steps_draft_exactly_at_every_acceptance_count(model, monkeypatch, mode):
    """Adaptive k's choices at random (:func:`choose_at_random`) and a verifier accepting a random
    count 0..k, over the queue: rounds switch k, shallow rounds (k = 1 beside 2 depths) defer
    depth 1 and later rounds catch it up, k = 0 leaves lags drafted over later, rows kept to 1
    depth draft in one round with carriers of both, and preempted requests start over. Static
    output equals eager output (every draft there checked, ``check_drafts``), every draft of
    the static engine equals the uncached reference, and the pool ends whole."""
    prompts = queue_of_prompts(7)
    options = dict(verifier=random_accept(seed=3), **QUEUE_OPTIONS)

    def serve(engine: Engine) -> list[Request]:
        choose_at_random(engine, seed=19)
        return run_to_completion(engine, prompts, 16)

    with counted_compiles():
        engine, graphs = static_engine(model, mode, monkeypatch, **options)
        proposals = record_proposals(parts(engine)[1])
        mixed = rounds_of_mixed_depths(engine)
        reqs = serve(engine)
        breaks = dict(counters["graph_break"])
    eager, _ = make_engine(model, AUTO, overrides=QUEUE, **options)  # check_drafts on
    assert outputs(reqs) == outputs(serve(eager))
    assert_drafts_are_the_reference(model, proposals, parts(engine)[1])
    assert max(r.num_preemptions for r in reqs) > 0
    assert {a for _, _, n, a, _ in engine.verifier.history if n == 2} == {0, 1, 2}  # type: ignore[attr-defined]
    assert {0, 1, 2} <= set(engine.depths_admitted) and engine.k_chosen[0] > 0
    assert {"verify", "draft-round-k2", "draft-round-k1-shallow"} <= static_functions(engine)
    static = sum(is_static for _, drafts, is_static in proposals if drafts)
    caught_up = [drafts for _, drafts, is_static in proposals if not is_static and len(drafts) == 2]
    assert static >= 30 and caught_up and mixed[0] > 0 and breaks == {}
    assert graphs is None or graphs.replays >= static


@pytest.mark.parametrize("mode", MODES)
def test_static_greedy_mtp_equals_plain_decoding(model, monkeypatch, mode):
    """The real greedy verifier and adaptive k's own choices, static steps, over the queue: token
    for token what eager plain decoding emits."""
    prompts = queue_of_prompts(8)
    engine, _ = static_engine(model, mode, monkeypatch, **QUEUE_OPTIONS)
    reqs = run_to_completion(engine, prompts, 16)
    plain, _, _ = generate(model, NO_DRAFTER, prompts, 16, check_drafts=False)
    assert outputs(reqs) == outputs(plain)
    assert max(r.num_preemptions for r in reqs) > 0 and engine.metrics.num_draft_tokens > 50


@pytest.mark.parametrize("mode", MODES)
def test_static_sampled_rows_decode_as_eager_ones(model, monkeypatch, mode):
    """Sampled requests (temperature 1, seeded) beside greedy ones, adaptive k's choices at random
    (:func:`choose_at_random`), the real verifier, over the queue: the static engine emits what
    the eager one does, token for token, sampled rows included (their verify forward runs
    static, their drafting rounds and rejection sampling eagerly, with the same draws)."""
    prompts = queue_of_prompts(10)
    params = [SamplingParams(temperature=1.0, seed=i) if i % 3 == 0 else None for i in range(len(prompts))]

    def serve(engine: Engine) -> list[Request]:
        choose_at_random(engine, seed=4)
        return run_to_completion(engine, prompts, 16, params)

    engine, _ = static_engine(model, mode, monkeypatch, **QUEUE_OPTIONS)
    eager, _ = make_engine(model, AUTO, check_drafts=False, overrides=QUEUE, **QUEUE_OPTIONS)
    reqs = serve(engine)
    assert outputs(reqs) == outputs(serve(eager))
    assert engine.metrics.num_draft_tokens > 50 and max(r.num_preemptions for r in reqs) > 0


@pytest.mark.parametrize("mode", MODES)
def test_static_decode_steps_past_the_depths_draft_exactly(model, monkeypatch, mode):
    """Fixed k = 3 > D = 2 over the queue, a verifier accepting a random count: every round ends
    with a decode step (depth 0 again, one position past the span) in rows of a batch padded to
    bucket 4. Static output equals eager output (every draft there checked), every static draft
    equals the uncached reference, and every acceptance count 0..3 occurred."""
    prompts = queue_of_prompts(11)
    options = dict(verifier=random_accept(seed=5), **QUEUE_OPTIONS)
    engine, _ = static_engine(model, mode, monkeypatch, mtp(2, 3), **options)
    proposals = record_proposals(parts(engine)[1])
    reqs = run_to_completion(engine, prompts, 16)
    eager, _ = make_engine(model, mtp(2, 3), overrides=QUEUE, **options)  # check_drafts on
    assert outputs(reqs) == outputs(run_to_completion(eager, prompts, 16))
    assert_drafts_are_the_reference(model, proposals, parts(engine)[1])
    assert {a for _, _, n, a, _ in engine.verifier.history if n == 3} == {0, 1, 2, 3}  # type: ignore[attr-defined]
    assert sum(is_static and len(drafts) == 3 for _, drafts, is_static in proposals) >= 20
    assert {"verify", "draft-round-k3"} <= static_functions(engine)
