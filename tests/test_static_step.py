"""The static, sync-free decode step (docs/design.md §5): one device->host read per decode step,
persistent step inputs (same ``data_ptr`` step after step of one bucket), batches padded to
buckets with unchanged greedy output, ``engine.compile`` equal to eager with no graph breaks,
adaptive k (``spec.num_tokens=auto``) including its lagged catch-up, and a warm-up that leaves
the engine as it found it."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from torch._dynamo.utils import counters

from helpers.cuda_graphs import CaptureError, RecordedCudaGraphs
from helpers.engine import (  # noqa: F401
    AUTO,
    NO_DRAFTER,
    assert_drafts_are_the_reference,
    counted_compiles,
    generate,
    mtp,
    ngram,
    one_thread,
    outputs,
    parts,
    record_proposals,
    slow_first_calls,
    spec_model,
)
from helpers.engine import SPEC_VOCAB as VOCAB
from helpers.engine import make_engine as make_any_engine
from inkfw.bench.step_profile import OpsOutsideSteps
from inkfw.errors import ConfigError
from inkfw.models.inkling.layers import MoE
from inkfw.profiling import count_host_reads
from inkfw.speculative.adaptive import AdaptiveK, fit_step_costs, non_decreasing
from inkfw.speculative.engine import LAG_LIMIT, Engine, Request, StepTimes
from inkfw.speculative.sampling import SamplingParams
from inkfw.speculative.step import (
    DEFAULT_BUCKETS,
    StepBuffers,
    StepFunction,
    bucket_for,
    cpu_outer_loop_fusion_off,
    inductor_config_patches,
)


def make_engine(model, drafter: Sequence[str], **kwargs):
    """An engine (helpers.engine.make_engine) whose eager steps run padded to batch buckets as
    compiled ones do (``engine.pad_batches=true``): the static shapes these tests check, without
    a compile each. Eager engines left to the default run their n rows unpadded."""
    kwargs["overrides"] = ["engine.pad_batches=true", *kwargs.get("overrides", ())]
    return make_any_engine(model, drafter, **kwargs)


@pytest.fixture(scope="module")
def model():
    """6 routed experts, top-2: eager on the CPU, outside the decode step, the MoE of 2+ tokens
    takes its grouped path, which reads its group sizes on the host (prefill chunks)."""
    return spec_model(seed=0)


@pytest.fixture(scope="module")
def static_moe_model():
    """4 routed experts, top-2 (E <= 2 top_k): the MoE is static at every decode size, also
    eagerly on the CPU, so the only host reads left are the engine's own."""
    m = spec_model(seed=0, n_routed_experts=4)
    moes = [mod for mod in m.modules() if isinstance(mod, MoE)]
    assert moes and all(moe.path_for(n) != "grouped" for moe in moes for n in range(1, MoE.static_max_tokens + 1))
    return m


def prompts_of(seed: int, n: int, lo: int = 5, hi: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def prefill(engine: Engine, prompts: Sequence[Sequence[int]], new: int, params=None) -> list[Request]:
    """Queue ``prompts`` and run the step that prefills them all; every later step decodes only."""
    reqs = [engine.add_request(p, params, max_new_tokens=new) for p in prompts]
    engine.step()
    assert all(r.num_computed == len(r.token_ids) - 1 and not r.output_token_ids for r in reqs)
    return reqs


def decode_reads(engine: Engine, reqs: Sequence[Request]) -> tuple[int, int, dict[str, int]]:
    """(decode steps, host reads, reads by kind) until ``reqs`` finish."""
    steps = 0
    with count_host_reads() as reads:
        while not all(r.finished for r in reqs):
            engine.step()
            steps += 1
    return steps, reads.count, dict(reads.by_kind)


def one_at_a_time(engine: Engine, prompts: Sequence[Sequence[int]], new: int) -> list[list[int]]:
    out = []
    for p in prompts:
        (r,) = engine.generate([engine.add_request(p, max_new_tokens=new)])
        out.append(r.output_token_ids)
    return out


# --------------------------------------------------------------------------- 1. host reads
SAMPLED = SamplingParams(temperature=1.0, seed=5)
DRAFTERS = {"mtp-k3": mtp(2, 3), "mtp-k4": mtp(2, 4), "ngram": ngram(3), "none": NO_DRAFTER}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_one_host_read_per_decode_step(static_moe_model, drafter, batch, sampled):
    """Eager decode steps (after the prefill step) read exactly one tensor back: the packed
    accepted counts, next tokens and drafts (Engine.step's ``tolist``). Sampled requests read
    no more: their per-request generators draw on the host (CPU generators) and the draws go
    to the device; nothing is read back."""
    engine, _ = make_engine(static_moe_model, DRAFTERS[drafter], check_drafts=False)
    engine.eos_ids = set()  # every request runs its full length (sampling draws EOS now and then)
    prompts = prompts_of(10 + batch, batch)
    if drafter == "ngram":  # repeated prompts: lookup finds drafts, so verify steps are k + 1 wide
        prompts = [p[:4] * 3 for p in prompts]
    reqs = prefill(engine, prompts, 16, SAMPLED if sampled else None)
    steps, count, kinds = decode_reads(engine, reqs)
    assert steps >= 3 and all(len(r.output_token_ids) == 16 for r in reqs)
    assert count == steps and kinds == {"tolist": steps}
    if drafter != "none":
        assert engine.metrics.num_draft_tokens > 0


def test_decode_step_keeps_many_expert_moe_static(model, monkeypatch):
    """With many experts (E > 2 top_k) an eager MoE over 2+ tokens would take the grouped path,
    which reads its group sizes (``bincount(...).tolist()``); inside the decode step
    (``static_moe``) it never does, so eager decode steps still read once each
    (docs/design.md §5). Outside the step (a plain forward of 2+ tokens) it still groups."""
    grouped = []
    original = MoE._grouped

    def counted(self, flat):
        grouped.append(flat.shape[0])
        return original(self, flat)

    monkeypatch.setattr(MoE, "_grouped", counted)
    engine, _ = make_engine(model, mtp(2, 3), check_drafts=False)
    reqs = prefill(engine, prompts_of(20, 3), 8)
    grouped.clear()
    steps, count, _ = decode_reads(engine, reqs)
    assert not grouped and steps >= 3 and count == steps
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    with torch.no_grad():
        moe(torch.randn(4, model.cfg.hidden_size))
    assert grouped == [4]


# --------------------------------------------------------------------------- 2. persistent inputs
@pytest.fixture
def step_calls(monkeypatch) -> list[tuple[StepFunction, tuple[tuple[tuple[int, ...], int], ...]]]:
    """Every StepFunction call: (function, ((shape, data_ptr) per input))."""
    calls = []
    original = StepFunction.__call__

    def spy(self, *args):
        calls.append((self, tuple((tuple(a.shape), a.data_ptr()) for a in args)))
        return original(self, *args)

    monkeypatch.setattr(StepFunction, "__call__", spy)
    return calls


def staged_log(buffers) -> dict:
    """Record ``{(name, shape, dtype): data_ptr}`` of what ``buffers.stage`` returns, into the
    dict returned (cleared by the caller between steps)."""
    log: dict = {}
    original = buffers.stage

    def stage(name, values, dtype=torch.long):
        t = original(name, values, dtype)
        log[(name, tuple(t.shape), t.dtype)] = t.data_ptr()
        return t

    buffers.stage = stage
    return log


def test_staged_host_values_reach_the_device_in_one_copy_per_dtype():
    """``StepBuffers``: a staged list is written at :meth:`flush`, all lists of one dtype in one
    copy, into buffers that keep their ``data_ptr``; tensors are copied at once; empty rows are
    not copied at all."""
    buffers = StepBuffers("cpu")
    a = buffers.stage("a", [1, 2, 3])
    table = buffers.stage("table", [[4, 5], [6, 7]])
    valid = buffers.stage("valid", [True, False], torch.bool)
    hidden = buffers.stage("hidden", torch.ones(2, 3), torch.float32)
    assert buffers.num_copies == 1 and hidden.tolist() == [[1.0] * 3] * 2  # the tensor, already
    buffers.flush()
    assert (a.tolist(), table.tolist(), valid.tolist()) == ([1, 2, 3], [[4, 5], [6, 7]], [True, False])
    assert buffers.num_copies == 3  # long and bool: one copy each
    again = buffers.stage("table", [[8, 9], [10, 11]])
    assert again is table and table.tolist() == [[4, 5], [6, 7]]  # written at the next flush
    buffers.flush()
    assert table.tolist() == [[8, 9], [10, 11]] and buffers.num_copies == 4
    assert buffers.stage("empty", [[], []]).shape == (2, 0)
    no_drafts = buffers.stage("drafts", [[]] * 4)  # a batch of 4 rows with no drafts
    buffers.flush()
    assert no_drafts.shape == (4, 0) and buffers.num_copies == 4  # nothing to copy
    assert buffers.stage("drafts", [[]] * 4) is no_drafts
    with pytest.raises(ValueError, match="rows of unequal length"):
        buffers.stage("ragged", [[1], [2, 3]])


def test_a_decode_step_copies_host_values_once(static_moe_model):
    """A decode step stages ~10 verify inputs and ~20 drafting-round inputs (k = 4, two depths'
    tables), and copies them to the device in 2 copies each: one of every host value (masks go
    as 0 / 1 with the integers) and the one tensor (drafts, hidden)."""
    engine, _ = make_engine(static_moe_model, mtp(2, 4), check_drafts=False)
    verifier, drafter = parts(engine)
    reqs = prefill(engine, prompts_of(31, 3, lo=6, hi=10), 10)
    while not all(r.finished for r in reqs):
        before = [verifier.buffers.num_copies, drafter.buffers.num_copies]
        staged = [len(verifier.buffers._pending), len(drafter.buffers._pending)]
        engine.step()
        copies = [verifier.buffers.num_copies - before[0], drafter.buffers.num_copies - before[1]]
        assert staged == [0, 0] and copies[0] == 2 and copies[1] <= 2
    assert len(verifier.buffers) >= 7 and len(drafter.buffers) >= 15


def test_a_plain_decode_step_gathers_and_copies_no_drafts(static_moe_model):
    """Plain decoding at batch 3 (bucket 4): beside the verify step function, a decode step makes
    one copy of its host values, and gathers, pads and copies no drafts (it has none): on a GPU
    each op there is a launch next to the graph, and a copy from the host waits for the stream."""
    engine, _ = make_engine(static_moe_model, NO_DRAFTER)
    verifier = engine.verifier
    reqs = prefill(engine, prompts_of(33, 3, lo=6, hi=10), 8)
    ops, steps = OpsOutsideSteps(), 0
    with torch.no_grad(), ops:
        while not all(r.finished for r in reqs):
            before = verifier.buffers.num_copies
            engine.step()
            assert verifier.buffers.num_copies - before == 1
            steps += 1
    assert steps >= 7 and ops.outside["aten._foreach_copy_"] == steps
    assert not {"aten.index_select", "aten.constant_pad_nd", "aten.copy_", "aten.cat"} & set(ops.outside)


def is_table(key) -> bool:
    return key[0].startswith("table")


def test_step_inputs_persist_across_decode_steps(static_moe_model, step_calls):
    """Step after step of one bucket (k = 4 > D), the verify and draft step functions get the
    same input tensors (same ``data_ptr``): only a block table whose width doubled is a new
    tensor. The staged buffers are never reallocated, and none appear while the bucket and
    the table widths stay the same."""
    engine, _ = make_engine(static_moe_model, mtp(2, 4), check_drafts=False)
    engine.eos_ids = set()  # every request runs its full length
    verifier, drafter = parts(engine)
    logs = {"verifier": staged_log(verifier.buffers), "drafter": staged_log(drafter.buffers)}
    reqs = prefill(engine, prompts_of(30, 3, lo=6, hi=10), 14)
    history = []  # per decode step: rows, staged keys -> ptr, all buffers -> ptr, step-function calls
    while not all(r.finished for r in reqs):
        for log in logs.values():
            log.clear()
        step_calls.clear()
        rows = {"verifier": sum(not r.finished for r in reqs)}
        engine.step()
        rows["drafter"] = sum(not r.finished for r in reqs)
        buffers = {"verifier": verifier.buffers._buffers, "drafter": drafter.buffers._buffers}
        history.append(
            (
                rows,
                {part: dict(log) for part, log in logs.items()},
                {part: {k: t.data_ptr() for k, t in b.items()} for part, b in buffers.items()},
                list(step_calls),
            )
        )

    def bucket(staged: dict) -> int:  # rows of the step's staged inputs
        (b,) = {shape[0] for name, shape, _ in staged if name in ("last", "slots")}  # verifier, drafter
        return b

    compared, widened, calls_compared = Counter(), 0, 0
    for (_, staged0, buffers0, calls0), (rows1, staged1, buffers1, calls1) in zip(history, history[1:]):
        for part in ("verifier", "drafter"):
            assert all(buffers1[part][k] == ptr for k, ptr in buffers0[part].items()), part  # never reallocated
            if not staged1[part]:
                assert part == "drafter" and rows1[part] == 0  # nothing left to draft for
                continue
            assert bucket(staged1[part]) == bucket_for(rows1[part], DEFAULT_BUCKETS)  # padded
            if not staged0[part] or bucket(staged0[part]) != bucket(staged1[part]):
                continue
            if {k for k in staged0[part] if is_table(k)} == {k for k in staged1[part] if is_table(k)}:
                compared[part] += 1
                assert staged1[part] == staged0[part], part  # same keys, same tensors
                assert buffers1[part].keys() == buffers0[part].keys(), part  # no new buffers
            else:
                widened += 1
                assert {k for k in staged1[part] if not is_table(k)} == {k for k in staged0[part] if not is_table(k)}
        assert [fn.name for fn, _ in calls1] == ["verify"] + ["draft-round-k4"] * (rows1["drafter"] > 0)
        previous = {fn: args for fn, args in calls0}
        for fn, args in calls1:
            if fn not in previous or previous[fn][0][0] != args[0][0]:
                continue  # first call, or another bucket
            calls_compared += 1
            for i, ((shape0, ptr0), (shape1, ptr1)) in enumerate(zip(previous[fn], args)):
                if shape0 == shape1:
                    assert ptr0 == ptr1, (fn.name, i)
                else:  # only a block table may change, and only in width
                    assert i >= fn.tables_from and shape0[0] == shape1[0], (fn.name, i, shape0, shape1)
    # both cases happened, in both parts, with most steps in one bucket
    assert min(compared["verifier"], compared["drafter"]) >= 5 and widened >= 1 and calls_compared >= 10


# --------------------------------------------------------------------------- 3. buckets
def spy_padding(engine: Engine) -> list[tuple[str, int, int | None]]:
    """Record (part, rows, pad_to) of every verify call and drafting round."""
    seen = []
    verifier, drafter = parts(engine)
    verify, propose = verifier.verify, drafter.propose

    def spied_verify(kv, requests, drafts, run, pad_to=None):
        seen.append(("verify", len(requests), pad_to))
        return verify(kv, requests, drafts, run, pad_to=pad_to)

    def spied_propose(spans, kv, run, keep_logits=False, pad_to=None, num_tokens=None):
        seen.append(("draft", len(spans), pad_to))
        return propose(spans, kv, run, keep_logits=keep_logits, pad_to=pad_to, num_tokens=num_tokens)

    verifier.verify, drafter.propose = spied_verify, spied_propose  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("buckets,padded", [(None, 4), ([1, 8], 8)])
def test_batch_runs_padded_to_its_bucket(model, buckets, padded):
    """A batch of 3 runs padded to its bucket (4 by default, 8 with buckets [1, 8]), verify and
    drafting alike; greedy output equals the same requests run one at a time (bucket 1) and
    plain decoding."""
    prompts, new = prompts_of(40, 3), 10
    overrides = [f"engine.batch_buckets=[{','.join(map(str, buckets))}]"] if buckets else []
    engine, _ = make_engine(model, mtp(2, 4), check_drafts=False, overrides=overrides)
    seen = spy_padding(engine)
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    engine.generate(reqs)
    assert all(len(r.output_token_ids) == new for r in reqs)  # finished together: one bucket
    decode_calls = [(part, rows, pad) for part, rows, pad in seen if pad is not None]
    assert [part for part, _, _ in decode_calls].count("verify") == new
    assert set(decode_calls) == {("verify", 3, padded), ("draft", 3, padded)}
    verifier, drafter = parts(engine)
    assert ("last", (padded,), torch.long) in verifier.buffers._buffers
    assert ("slots", (padded,), torch.long) in drafter.buffers._buffers

    alone, _ = make_engine(model, mtp(2, 4), check_drafts=False, overrides=overrides)
    seen_alone = spy_padding(alone)
    assert one_at_a_time(alone, prompts, new) == outputs(reqs)
    assert {pad for _, _, pad in seen_alone if pad is not None} == {1}
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs(plain) == outputs(reqs)


def test_eager_batches_run_unpadded_unless_told(model):
    """An eager engine left to the default (``engine.pad_batches=null``) verifies and drafts a
    batch of 3 as 3 rows, with no padding row's work; its greedy output equals the padded
    engine's and plain decoding."""
    prompts, new = prompts_of(40, 3), 10
    engine, _ = make_any_engine(model, mtp(2, 4), check_drafts=False)
    padded, _ = make_engine(model, mtp(2, 4), check_drafts=False)
    assert not engine.pads_batches and padded.pads_batches
    seen = spy_padding(engine)
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    engine.generate(reqs)
    verifies = {(rows, pad) for part, rows, pad in seen if part == "verify"}
    decode_rounds = {(rows, pad) for part, rows, pad in seen if part == "draft" and pad is not None}
    assert verifies == {(3, None)} and decode_rounds == {(3, 3)}
    verifier, drafter = parts(engine)
    assert {shape for name, shape, _ in verifier.buffers._buffers if name == "last"} == {(3,)}
    assert {shape for name, shape, _ in drafter.buffers._buffers if name == "slots"} == {(3,)}
    assert one_at_a_time(padded, prompts, new) == outputs(reqs)
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs(plain) == outputs(reqs)


def test_unpadded_batches_need_eager_steps(model):
    with pytest.raises(ConfigError, match="engine.pad_batches=false needs eager steps"):
        make_any_engine(model, mtp(2, 3), overrides=["engine.compile=true", "engine.pad_batches=false"])


# --------------------------------------------------------------------------- 4. compile
COMPILE_PROMPTS = [  # the longer two reach 22 and 21 positions: past the 16 of the narrowest block table
    [7, 19, 33, 4, 81, 56],
    [44, 9, 102, 71, 18, 5, 63, 27, 90, 11, 38, 84, 6, 59],
    [15, 88, 40, 23, 97, 61, 5, 30, 72, 19, 104, 8, 53],
]
COMPILE_NEW = 8


@pytest.fixture(scope="module")
def compiled(model):
    """One compiled engine (mtp D = 2, k = 3 > D, batch 1: one verify and one draft-round graph,
    and one graph per depth for the prompt rounds),
    warmed up, then run over COMPILE_PROMPTS one at a time with host reads counted per decode
    phase. Dynamo state is reset first, so its counters are this engine's."""
    with counted_compiles():
        engine, _ = make_engine(model, mtp(2, 3), check_drafts=False, overrides=["engine.compile=true"])
        engine.warmup([1])  # compiles here, so the counted steps below run compiled code only
        outs, steps, reads = [], 0, 0
        for p in COMPILE_PROMPTS:
            (r,) = prefill(engine, [p], COMPILE_NEW)
            n, count, _ = decode_reads(engine, [r])
            outs.append(r.output_token_ids)
            steps, reads = steps + n, reads + count
        stats = {
            "graph_break": dict(counters["graph_break"]),
            "unique_graphs": counters["stats"]["unique_graphs"],
            "tables": {k[1] for k in parts(engine)[0].buffers._buffers if k[0] == "table0"},
        }
        yield engine, outs, steps, reads, stats


def test_compiled_greedy_equals_eager(model, compiled):
    engine, outs, _, _, _ = compiled
    eager, _ = make_engine(model, mtp(2, 3), check_drafts=False)
    assert outs == one_at_a_time(eager, COMPILE_PROMPTS, COMPILE_NEW)
    plain, _ = make_engine(model, NO_DRAFTER, check_drafts=False)
    assert outs == one_at_a_time(plain, COMPILE_PROMPTS, COMPILE_NEW)
    assert all(len(o) == COMPILE_NEW for o in outs)


def test_compiled_step_functions_have_no_graph_breaks(compiled):
    """Verify and draft step functions, and the prompt rounds' depth steps, were compiled
    (fullgraph=True would raise on a break) into exactly one graph each, which served every
    table width (context length) and prompt length."""
    engine, _, _, _, stats = compiled
    verifier, drafter = parts(engine)
    functions = list(verifier._steps.values()) + list(drafter._steps.values())
    assert sorted(fn.name for fn in functions) == ["draft-round-k3", "span-depth-0", "span-depth-1", "verify"]
    assert all(fn.compiled and fn.warmup_s > 0 for fn in functions) and engine.warmup_s > 0
    assert stats["graph_break"] == {}
    assert stats["tables"] == {(1, 4), (1, 8)}  # the context crossed a table width ...
    assert stats["unique_graphs"] == 4  # ... without a recompile


def test_second_compiled_engine_on_one_model_drafts_exactly(model, compiled):
    """A second engine on the same model compiles graphs of its own (its step functions' guards
    leave out the pools and weights, so sharing the first one's graphs would be unchecked): its
    drafts must come from its own caches and tail, equal to the uncached reference, and its output
    equal to the first engine's, with both running in turn (the benchmark builds several engines
    around one model)."""
    first, outs, _, _, _ = compiled
    graphs = counters["stats"]["unique_graphs"]
    second, _ = make_engine(model, mtp(2, 3), check_drafts=False, overrides=["engine.compile=true"])
    _, drafter = parts(second)
    proposals = record_proposals(drafter)
    for _ in range(2):  # the first engine runs between the second's requests, as in the benchmark
        assert one_at_a_time(second, COMPILE_PROMPTS, COMPILE_NEW) == outs
        assert one_at_a_time(first, COMPILE_PROMPTS, COMPILE_NEW) == outs
    assert counters["stats"]["unique_graphs"] == 2 * graphs  # the same four graphs, compiled for the second
    assert sum(static for _, drafts, static in proposals if drafts) >= 2 * len(COMPILE_PROMPTS)
    assert_drafts_are_the_reference(model, proposals, drafter)


def test_compiled_engine_with_other_pools_runs_its_own_graphs(model, compiled):
    """An engine whose KV blocks hold 8 positions, compiled after one whose blocks hold 4 (the
    ``compiled`` fixture) on the same model, emits what eager decoding emits. While the step
    functions' ``def`` was shared, dynamo served it the first engine's graphs, which address the
    pools with the first one's block size: other tokens."""
    second, _ = make_engine(model, mtp(2, 3), check_drafts=False, overrides=["engine.compile=true", "kv.block_size=8"])
    eager, _ = make_engine(model, mtp(2, 3), check_drafts=False, overrides=["kv.block_size=8"])
    assert one_at_a_time(second, COMPILE_PROMPTS, COMPILE_NEW) == one_at_a_time(eager, COMPILE_PROMPTS, COMPILE_NEW)


def test_step_functions_of_one_def_keep_their_graphs_apart():
    """Closures of one ``def`` whose unguarded ``kv`` differs (here the block size, an int read
    through it) each run a graph compiled for their own: dynamo keeps graphs per code object,
    and every step function compiles a private copy of its function."""
    torch._dynamo.reset()

    class Pools:
        def __init__(self, block: int):
            self.block = block
            self.pool = torch.zeros(64)

    def step_over(kv: Pools) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def step(values: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
            kv.pool.index_copy_(0, blocks * kv.block, values)  # the block size is not guarded
            return kv.pool.view(-1, kv.block)[blocks, 0]  # [n]

        return step

    pools = [Pools(4), Pools(8)]
    fns = [StepFunction(step_over(kv), f"test-block-{kv.block}", compile=True) for kv in pools]
    values, blocks = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 2, 5])
    for fn in fns:
        assert fn(values, blocks).tolist() == [1.0, 2.0, 3.0]
    assert [kv.pool.nonzero().flatten().tolist() for kv in pools] == [[0, 8, 20], [0, 16, 40]]


SPAN_PROMPTS = [
    [int(t) for t in torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n))]
    for n in (5, 11, 17, 26, 3)
]


@pytest.fixture(scope="module")
def compiled_spans(model):
    """A compiled engine with k = D = 2: its prompt rounds (spans of any length) run each depth
    as a step function of symbolic shapes. Warmed up at batch 1, then SPAN_PROMPTS one at a time
    (graphs counted), then three together (a batch of prompt spans). Records every drafting
    round's (committed tokens, drafts, static)."""
    with counted_compiles():
        engine, _ = make_engine(model, mtp(2, 2), check_drafts=False, overrides=["engine.compile=true"])
        proposals = record_proposals(parts(engine)[1])
        engine.warmup([1])
        outs = one_at_a_time(engine, SPAN_PROMPTS, COMPILE_NEW)
        graphs_one_at_a_time = counters["stats"]["unique_graphs"]
        batch = engine.generate([engine.add_request(p, max_new_tokens=COMPILE_NEW) for p in SPAN_PROMPTS[:3]])
        stats = {"graph_break": dict(counters["graph_break"]), "graphs_one_at_a_time": graphs_one_at_a_time}
        yield engine, outs + [r.output_token_ids for r in batch], proposals, stats


def test_compiled_prompt_rounds_equal_eager_and_the_reference(model, compiled_spans):
    """Prompt rounds compiled depth by depth: greedy output equals eager and plain decoding,
    one at a time and batched, and every draft (prompt rounds' and decode rounds') equals the
    uncached reference."""
    engine, outs, proposals, _ = compiled_spans
    expected = []
    for overrides in (mtp(2, 2), NO_DRAFTER):
        eager, _ = make_engine(model, overrides, check_drafts=False)
        single = one_at_a_time(eager, SPAN_PROMPTS, COMPILE_NEW)
        batch = eager.generate([eager.add_request(p, max_new_tokens=COMPILE_NEW) for p in SPAN_PROMPTS[:3]])
        expected.append(single + [r.output_token_ids for r in batch])
    assert outs == expected[0] == expected[1]
    assert sum(not static for _, drafts, static in proposals if drafts) >= len(SPAN_PROMPTS) + 3
    assert_drafts_are_the_reference(model, proposals, parts(engine)[1])


def test_compiled_prompt_rounds_compile_each_depth_once_for_every_span_length(compiled_spans):
    """One graph per depth serves prompts of every length at batch 1 (the width is symbolic):
    verify, draft round and the two depths' span steps are all the graphs one-at-a-time serving
    needs, whatever the prompt lengths; no graph breaks. Their compile time is warm-up."""
    engine, _, _, stats = compiled_spans
    _, drafter = parts(engine)
    names = sorted(fn.name for fn in drafter._steps.values())
    assert names == ["draft-round-k2", "span-depth-0", "span-depth-1"]
    assert stats["graph_break"] == {}
    assert stats["graphs_one_at_a_time"] == 4  # verify, draft round, span depths 0 and 1
    spans = [fn for fn in drafter._steps.values() if fn.name.startswith("span")]
    assert all(fn.compiled and fn.dynamic_dims and fn.warmup_s > 0 for fn in spans)


def test_dynamic_step_dimensions_compile_once_and_count_warmup_once():
    """``StepFunction(dynamic_dims=...)``: widths 3..9 share one graph (sizes 0 and 1 are
    dynamo's specialisations: width 1 gets its own), fresh input tensors every call are no new
    warm-up, and CUDA graphs, which have one shape, refuse dynamic dimensions."""
    torch._dynamo.reset()
    counters.clear()

    def step(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x.sum(-1) + table.sum(-1)  # [B]

    fn = StepFunction(step, "test-span", compile=True, tables_from=2, dynamic_dims=[(0, 0), (0, 1), (1, 0), (1, 1)])
    for rows, width, blocks in [(2, 3, 4), (2, 5, 4), (3, 7, 5), (2, 9, 8), (2, 1, 4)]:
        assert (
            fn(torch.ones(rows, width), torch.ones(rows, blocks, dtype=torch.long)).tolist() == [width + blocks] * rows
        )
    assert counters["stats"]["unique_graphs"] == 2
    assert len(fn._seen) == 2
    with pytest.raises(ValueError, match="one shape"):
        StepFunction(step, "test-span", compile=True, cuda_graphs=True, dynamic_dims=[(0, 1)])


def test_eager_rounds_keep_no_buffer_per_span_length(model):
    """Rounds over spans of any length (prompt chunks) stage their inputs in buffers of their
    own: the drafter's persistent buffers hold only static rounds' shapes, however many prompt
    lengths it meets (a [B, T, H] buffer per length would grow without bound in a server)."""
    engine, _ = make_engine(model, mtp(2, 2), check_drafts=False)
    _, drafter = parts(engine)
    lengths = list(range(4, 40, 3))
    one_at_a_time(engine, [[5 + i % 50 for i in range(n)] for n in lengths], 4)
    hidden_widths = {key[1][1] for key in drafter.buffers._buffers if key[0] == "hidden"}
    assert hidden_widths == {3}  # the decode rounds' k + 1


@pytest.mark.parametrize("graphs", [False, True], ids=["compiled", "compiled-graphs"])
def test_compiled_step_functions_stay_static_as_shapes_change(monkeypatch, graphs):
    """A compiled step function specializes every new input shape (a bucket, a k) in a graph of
    its own and keeps only block-table widths dynamic. Dynamo's default would make a changed
    dimension symbolic from its second value on: graphs that compile for minutes on the CPU
    and run slower (auto k switching between k's did this to the verify width). With CUDA
    graphs as well (simulated), each table width is a capture of its own but not a compile."""
    torch._dynamo.reset()
    counters.clear()
    replays = simulate_cuda_graphs(monkeypatch) if graphs else None

    def step(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x.sum(-1) + table.sum(-1)  # [B]

    fn = StepFunction(step, "test-step", compile=True, cuda_graphs=graphs, tables_from=1)
    for width in (3, 5, 7, 9):  # like the verify width 1 + k
        x = torch.ones(2, width)
        for blocks in (4, 8, 16):
            table = torch.ones(2, blocks, dtype=torch.long)  # a persistent buffer per width
            for _ in range(2):  # graphs: captured, then replayed
                assert fn(x, table).tolist() == [width + blocks] * 2
    assert counters["stats"]["unique_graphs"] == 4  # one per width; the table widths share it
    if replays is not None:
        assert replays[0] == 12 and len(fn._graphs) == 12


def test_compiled_steps_keep_simd_but_compile_without_cpu_outer_loop_fusion():
    """Inductor's CPU outer-loop fusion miscompiles batched steps (torch 2.13; the shipped
    checkpoint's test shows it): compiled steps turn it off while they compile, put it back
    afterwards, also after an error, and key the on-disk graph cache apart from graphs compiled
    with it, while keeping SIMD kernels."""
    from torch._inductor.codegen.cpp import CppScheduling

    fusable = CppScheduling.can_fuse_vertical_outer_loop
    with cpu_outer_loop_fusion_off():
        assert CppScheduling.can_fuse_vertical_outer_loop(None, None, None) is False  # type: ignore[arg-type]
    assert CppScheduling.can_fuse_vertical_outer_loop is fusable
    with pytest.raises(RuntimeError), cpu_outer_loop_fusion_off():
        raise RuntimeError("compile failed")
    assert CppScheduling.can_fuse_vertical_outer_loop is fusable
    patches = inductor_config_patches()
    assert "cpp.simdlen" not in patches
    assert "outer-loop-fusion-off" in patches["post_grad_custom_post_pass"].uuid()


def _record_inductor_compiles(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, dict]]:
    """Replace inductor's ``compile_fx`` by a recorder that runs graphs eagerly; each entry says
    whether outer-loop fusion was on while the graph compiled, and with which config patches."""
    import torch._inductor.compile_fx
    from torch._inductor.codegen.cpp import CppScheduling

    compiles: list[tuple[bool, dict]] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list, config_patches: dict) -> object:
        compiles.append((CppScheduling.can_fuse_vertical_outer_loop(None, None, None) is not False, config_patches))  # type: ignore[arg-type]
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", record)
    return compiles


def test_step_graphs_compile_with_outer_loop_fusion_off_and_replays_leave_it_on(monkeypatch):
    """The fusion is off exactly while inductor compiles a step's graph, not around replays."""
    from torch._inductor.codegen.cpp import CppScheduling

    torch._dynamo.reset()
    compiles = _record_inductor_compiles(monkeypatch)
    fusable = CppScheduling.can_fuse_vertical_outer_loop
    fn = StepFunction(lambda x: (x * 2).sum(-1), "test-step", compile=True, tables_from=1)  # [B]
    for _ in range(3):
        assert fn(torch.ones(2, 3)).tolist() == [6.0, 6.0]
        assert CppScheduling.can_fuse_vertical_outer_loop is fusable
    assert [fused for fused, _ in compiles] == [False]  # one graph, compiled with the fusion off
    assert "post_grad_custom_post_pass" in compiles[0][1]


def test_every_compiled_step_skips_parameter_guards(monkeypatch):
    """Serving never swaps weights under a step, so no step function guards its parameters (a
    guard per parameter costs ~1 ms per call): replacing a weight recompiles none of them, and
    each reads the new weight. Not only the first: ``torch.compile`` pops the guard filter out of
    the options it is given, so a shared options dict left later step functions guarded."""
    torch._dynamo.reset()
    compiles = _record_inductor_compiles(monkeypatch)
    linear = torch.nn.Linear(3, 2, bias=False)

    def offset_step(offset: int):  # one graph per offset, like one per depth or bucket
        return lambda x: linear(x) + offset  # [B, 2]

    fns = [StepFunction(offset_step(i), f"test-step-{i}", compile=True, tables_from=1) for i in range(3)]
    x = torch.ones(1, 3)
    for fn in fns:
        fn(x)
    assert len(compiles) == 3
    with torch.no_grad():
        linear.weight = torch.nn.Parameter(torch.full((3, 2), 2.0).t())  # other strides: a guard would fail
    for i, fn in enumerate(fns):
        assert fn(x).tolist() == [[6.0 + i, 6.0 + i]]
    assert len(compiles) == 3  # no recompiles


def test_compiled_steps_check_only_their_inputs_each_call(monkeypatch):
    """Per call a compiled step checks only what can change: dynamo guards its inputs, not the
    parameters nor the cache pools its ``kv`` closure reaches (fixed for the function's life; on
    the shipped checkpoint ~90 pool tensors, each checked and alias-checked), and inductor's
    wrapper asserts no input's size, stride or alignment (a Python call per input: ~340 per
    verify step)."""
    from torch._inductor.utils import run_and_get_code

    import inkfw.speculative.step as step_module

    kept: dict[str, set[bool]] = {}
    filter_guards = step_module._step_guards

    def recording(entries):
        keep = filter_guards(entries)
        for entry, k in zip(entries, keep):
            kept.setdefault(entry.name, set()).add(k)
        return keep

    monkeypatch.setattr(step_module, "_step_guards", recording)
    torch._dynamo.reset()
    linear = torch.nn.Linear(4, 4, bias=False)

    class Pools:
        def __init__(self):
            self.groups = [torch.zeros(8, 4), torch.zeros(8, 4)]

    kv = Pools()

    def step(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        for pool in kv.groups:
            pool.index_copy_(0, slots, linear(x))
        return kv.groups[0][slots] + kv.groups[1][slots]

    x, slots = torch.randn(2, 4), torch.tensor([1, 5])
    with torch.no_grad():
        out, code = run_and_get_code(StepFunction(step, "test-step", compile=True, tables_from=2), x, slots)
        torch.testing.assert_close(out, 2 * linear(x))
    assert code and not any("assert_size_stride(" in c or "assert_alignment(" in c for c in code)
    pools = [name for name in kept if name.startswith("kv.")]
    assert pools and all(kept[name] == {False} for name in pools), {n: kept[n] for n in pools}
    assert kept["x"] == kept["slots"] == {True}
    assert not any(True in k for name, k in kept.items() if "linear" in name and "weight" in name)


def test_a_captured_step_runs_its_in_place_effects_once_per_call(monkeypatch):
    """The step functions update state in place (caches, the drafter's tail, drafts written into
    their ext buffer), so capturing a step must not run it more often than it is called: the
    first call runs it once and captures it, each later call replays it once, and replays
    write their outputs into the graph's own tensors."""
    graphs = RecordedCudaGraphs(monkeypatch)
    state = torch.zeros(3)  # e.g. the drafter's tail: read, then updated in place

    def step(x: torch.Tensor) -> torch.Tensor:  # [3] -> [3]
        out = state + x
        state.copy_(out)
        return out

    fn = StepFunction(step, "test-step", cuda_graphs=True)
    x = torch.ones(3)
    outs = [fn(x).clone() for _ in range(4)]
    assert [o.tolist() for o in outs] == [[float(i)] * 3 for i in range(1, 5)]
    assert state.tolist() == [4.0] * 3  # one update per call
    assert len(fn._graphs) == 1 and graphs.captures == 1 and graphs.replays == 3 and fn.warmup_s > 0.0
    graph_out = fn(x)
    assert fn(x) is graph_out and graph_out.tolist() == [6.0] * 3  # replays hand out the graph's tensors


def test_recorded_graphs_replay_kernels_not_python(monkeypatch):
    """The CPU stand-in for CUDA graphs that the engine's graph tests run on (helpers.cuda_graphs)
    has a real graph's semantics: a replay runs what the capture recorded and no Python, so a
    value read from Python state stays as captured, and an intermediate kept from the capture
    holds each replay's value; a host read during capture is an error, as on a GPU."""
    graphs = RecordedCudaGraphs(monkeypatch)
    calls = [0]
    kept: list[torch.Tensor] = []

    def step(x: torch.Tensor) -> torch.Tensor:  # [2] -> [2]
        calls[0] += 1
        doubled = 2 * x
        kept.append(doubled)
        return doubled + calls[0]  # a Python value: baked in at capture

    fn = StepFunction(step, "test-step", cuda_graphs=True)
    x = torch.zeros(2)
    assert fn(x).tolist() == [1.0, 1.0]  # the real first run
    x.fill_(1.0)
    assert fn(x).tolist() == [4.0, 4.0]  # replayed: 2 * 1 + 2, the count at capture
    assert calls[0] == 2 and graphs.replays == 1  # no Python ran in the replay
    x.fill_(5.0)
    assert fn(x).tolist() == [12.0, 12.0] and kept[-1].tolist() == [10.0, 10.0]

    def reads_back(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()

    with pytest.raises(CaptureError, match="host"):
        StepFunction(reads_back, "test-read", cuda_graphs=True)(torch.ones(2))


def simulate_cuda_graphs(monkeypatch) -> list[int]:
    """Graph capture and replay counted for *compiled* step functions, whose C++ kernels
    :class:`RecordedCudaGraphs` cannot record: the first call of a shape runs for real and
    "captures" its inputs; each later call re-runs the function (Python included) on those same
    input tensors and writes its results into the graph's own output tensors. Returns a
    one-element list counting the replays."""
    replays = [0]

    def capture(self, args):
        first = self.fn(*args)
        owned = tuple(t.clone() for t in first) if isinstance(first, tuple) else first.clone()

        class Graph:
            @staticmethod
            def replay():
                out = self.fn(*args)
                for dst, src in zip(owned, out) if isinstance(owned, tuple) else [(owned, out)]:
                    dst.copy_(src)
                replays[0] += 1

        return (Graph(), args, owned), first

    monkeypatch.setattr(StepFunction, "_capture", capture)
    return replays


RANDOM_K = ["drafter=mtp", "mtp.depths=4", "spec.num_tokens=auto"]  # k drawn per round below


@pytest.mark.parametrize("drafter", [mtp(2, 3), mtp(2, 4), RANDOM_K], ids=["k3", "k4", "random-k"])
@pytest.mark.parametrize("batch", [1, 3])
def test_replayed_steps_overwrite_their_outputs_and_decode_exactly(model, monkeypatch, drafter, batch):
    """With graph replay's output reuse (simulated on the CPU), the engine still emits eager
    decoding's tokens and accepts exactly as many drafts: nothing it keeps from one step's
    outputs is read after the next replay overwrote them (random-k: shallow rounds keep verify
    rows for deeper depths, read when those catch up)."""
    prompts = prompts_of(40 + batch, batch, lo=6, hi=14)

    def run(graphs: bool) -> list[Request]:
        engine, kv = make_engine(
            model,
            drafter,
            check_drafts=False,
            max_num_seqs=batch,
            overrides=[f"engine.cuda_graphs={str(graphs).lower()}"],
        )
        if drafter is RANDOM_K:
            rng = random.Random(batch)
            engine._round_k = lambda bucket, share, probe, request=None: rng.choice([1, 1, 2, 3, 4])  # type: ignore[method-assign]
        reqs = engine.generate([engine.add_request(p, max_new_tokens=20) for p in prompts])
        assert kv.is_whole()
        return reqs

    eager = run(graphs=False)
    graphs = RecordedCudaGraphs(monkeypatch)
    replayed = run(graphs=True)
    assert outputs(replayed) == outputs(eager)
    assert [r.num_accepted_tokens for r in replayed] == [r.num_accepted_tokens for r in eager]  # the same drafts
    assert graphs.replays >= 10


def test_prompt_chunks_replay_as_graphs_padded_to_width_buckets(model, monkeypatch):
    """With CUDA graphs (simulated), prompt chunks run as step functions too, the target's and
    the drafter's, padded to a batch bucket and a power-of-two width >= 16 (an eager prompt pass
    costs a launch per op on a GPU); decoding stays exact, with the same drafts as eager."""
    prompts = [*prompts_of(8, 1, lo=40, hi=40), *prompts_of(7, 2, lo=5, hi=9)]  # 40 tokens: chunks of 32 and 7

    def run(graphs: bool) -> tuple[list[Request], Engine]:
        engine, kv = make_engine(
            model,
            mtp(2, 3),
            check_drafts=False,
            max_num_seqs=3,
            max_num_batched_tokens=32,
            overrides=[f"engine.cuda_graphs={str(graphs).lower()}"],
        )
        reqs = engine.generate([engine.add_request(p, max_new_tokens=12) for p in prompts])
        assert kv.is_whole()
        return reqs, engine

    eager, _ = run(graphs=False)
    RecordedCudaGraphs(monkeypatch)
    replayed, engine = run(graphs=True)
    assert outputs(replayed) == outputs(eager)
    assert [r.num_accepted_tokens for r in replayed] == [r.num_accepted_tokens for r in eager]
    verifier, drafter = parts(engine)
    prefill_shapes = {key[0][0] for f in verifier._steps.values() if f.name == "prefill" for key in f._graphs}
    assert prefill_shapes and all(w in (16, 32) and rows in (1, 2, 4) for rows, w in prefill_shapes)
    assert (1, 32) in prefill_shapes  # the long prompt's first chunk, alone: 32 tokens
    ext_widths = {key[7][0][1] for f in drafter._steps.values() for key in f._graphs}  # ext [B, T + max(K, P)]
    assert {16 + 3, 32 + 3} <= ext_widths and 3 + 1 + 3 in ext_widths  # prompt rounds and decode rounds


def test_profiling_a_compiled_engine_counts_the_ops_beside_its_steps(compiled):
    """scripts/profile_step.py with engine.compile=true: the op count's dispatch mode stays out of
    the compiled steps (dynamo refuses to trace under one), which then go uncounted."""
    from inkfw.bench.step_profile import profile_decode_steps

    engine = compiled[0]
    eos = engine.eos_ids
    try:
        run = profile_decode_steps(engine, [COMPILE_PROMPTS[0]], steps=2, max_new_tokens=8)
    finally:
        engine.eos_ids = eos
    assert run["steps"] == 2 and run["ops"]["steps"] == 2
    assert run["ops"]["outside_per_step"] > 0 and run["ops"]["inside_per_step"] is None


def test_compiled_decode_reads_once_per_step(compiled):
    """Compiled, the many-expert MoE stays static: one host read per decode step."""
    _, _, steps, reads, _ = compiled
    assert steps >= 2 * len(COMPILE_PROMPTS) and reads == steps


# --------------------------------------------------------------------------- 5. adaptive k
def test_auto_k_equals_plain_and_measures_costs(model):
    prompts, new = prompts_of(50, 2), 10
    engine, _ = make_engine(model, AUTO, check_drafts=False)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK) and adaptive.max_k == 2 and engine.drafter.num_tokens == 2
    measured = []  # the costs: every k timed in each of 3 rounds over one set of long-context requests
    measure = engine._measure_step_costs
    engine._measure_step_costs = lambda *args: measured.append(measure(*args)) or measured[-1]  # type: ignore[method-assign]
    assert engine.warmup([1]) > 0
    assert len(measured) == 1
    samples, catch_ups, prompt_s = measured[0]
    assert prompt_s > 0 and adaptive.prompt_s[1] == prompt_s  # the drafter's pass over the prompts, per position
    assert sorted(samples) == [0, 1, 2] and all(len(s) == 3 for s in samples.values())  # one step per k and round
    fitted = fit_step_costs(samples, 2)
    assert adaptive.costs[1] == pytest.approx(non_decreasing([fitted[k] for k in range(3)]))
    # rounds 1 and 3 run k = 1 (shallow: depth 0 only) right before k = 2, whose first step catches up
    assert len(catch_ups) == 2 and all(c >= 0 for c in catch_ups)
    assert adaptive.catch_up[1] == pytest.approx([0.0, sorted(catch_ups)[0] / 2 + sorted(catch_ups)[1] / 2, 0.0])
    assert adaptive.has_costs(1) and not adaptive.has_costs(2)
    assert len(adaptive.costs[1]) == 3 and all(c > 0 for c in adaptive.costs[1])
    assert not engine.k_chosen and not adaptive.chosen  # warm-up forces k: no choices recorded
    assert not adaptive._next_probe and not adaptive.steps  # ... and schedules no probe
    assert not engine.running and not engine.waiting and engine.kv.is_whole()
    # the costs: every k timed in each of 3 rounds over one set of requests with a long context
    for bucket in (1, 2):  # measured costs vary on a busy machine; equal ones keep drafting best
        adaptive.set_costs(bucket, [1.0, 1.0, 1.0])
    rounds = []
    draft = engine._draft

    def counted(spans, num_rows):
        rounds.append(len(spans))
        return draft(spans, num_rows)

    engine._draft = counted  # type: ignore[method-assign]
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    engine.generate(reqs)
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs(reqs) == outputs(plain)
    assert sum(adaptive.chosen.values()) == len(rounds) >= 4  # one choice per drafting round
    assert engine.k_chosen[0] == adaptive.chosen[0]  # rounds that chose plain decoding
    assert engine.k_chosen[2] == adaptive.chosen[2]  # rounds that drafted k_max


def test_auto_k_chooses_by_a_lone_request_and_pools_each_request_as_it_finishes(model):
    """At batch 1 the round's one request names itself to adaptive k, whose own estimates then
    choose; rounds of two rows choose by the pool. Each verify step's counts go to the request
    they came from, and each finished request enters the pool as at most one unit per position."""
    engine, _ = make_engine(model, AUTO, check_drafts=False)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    for bucket in (1, 2):
        adaptive.set_costs(bucket, [1.0, 1.0, 1.0])  # drafting always pays: every round drafts
    named: list[tuple[int, object]] = []
    choose = adaptive.choose

    def recorded(bucket, row_depths=None, probe=True, request=None):
        named.append((bucket, request))
        return choose(bucket, row_depths, probe, request)

    adaptive.choose = recorded  # type: ignore[method-assign]
    alone = engine.add_request(prompts_of(51, 1)[0], max_new_tokens=10)
    engine.generate([alone])
    assert named and all(n == (1, alone.id) for n in named)
    assert not adaptive._requests and 0.0 < adaptive.seen[0] <= 1.0  # one request: one unit at most
    named.clear()
    pair = [engine.add_request(p, max_new_tokens=10) for p in prompts_of(52, 2)]
    engine.generate(pair)
    assert (2, None) in named and all(request is None for bucket, request in named if bucket == 2)
    assert not adaptive._requests and adaptive.seen[0] <= 1.0 * adaptive.request_decay**2 + 2.0


def test_auto_k_lag_catches_up_exactly(model, monkeypatch):
    """Costs that make k = 0 best and a probe every 4th round (forced: at these costs no acceptance
    could make drafting pay, which would stop probes): decode spans wait in the lag and the
    probing round drafts over all of them at once. check_drafts compares every draft of those
    catch-up rounds with the uncached reference (DraftCheckError otherwise)."""
    prompts, new = prompts_of(60, 2), 14
    engine, _ = make_engine(model, AUTO, check_drafts=True)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    engine.warmup([1])
    for bucket in (1, 2):
        adaptive.set_costs(bucket, [1.0, 100.0, 100.0])
    adaptive.probe_every, adaptive.probe_budget, adaptive.max_backoff = 4, 0.0, 0  # a probe every 4th round
    monkeypatch.setattr(adaptive, "drafting_could_pay", lambda bucket: True)
    rounds = []  # per drafting round: (pad_to, [(num_accepted, new_positions) per span])
    drafter = parts(engine)[1]
    propose = drafter.propose

    def recording(spans, kv, run, keep_logits=False, pad_to=None, num_tokens=None):
        rounds.append((pad_to, [(s.num_accepted, s.new_positions) for s in spans]))
        return propose(spans, kv, run, keep_logits=keep_logits, pad_to=pad_to, num_tokens=num_tokens)

    drafter.propose = recording  # type: ignore[method-assign]
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    engine.generate(reqs)
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs(reqs) == outputs(plain)
    assert engine.k_chosen[0] >= 4 and engine.k_chosen[2] >= 2 and adaptive.probes >= 2
    assert engine.metrics.num_draft_tokens > 0
    # a catch-up span: the lag of 2+ steps (one position each) and this step's position, drafted
    # over at once with the most re-prefill (num_accepted 0), in a round that is not static
    catch_up = [pad for pad, spans in rounds if any(a == 0 and n >= 3 for a, n in spans)]
    assert catch_up and all(pad is None for pad in catch_up)


def round_k(name: str) -> int:
    """K of a draft-round step function, from its name (``draft-round-k2``, ``draft-round-k1-shallow``)."""
    return int(name.removeprefix("draft-round-k").removesuffix("-shallow"))


@pytest.mark.parametrize("defer_limit", [0, 64])
def test_auto_k_draft_rounds_keep_one_shape_per_bucket_and_k(model, step_calls, defer_limit):
    """k switches between steps (k = 1 best, a probe at k_max = 2 every third round), so a
    draft round follows verify steps of either width. Each static draft round's inputs still
    have at most two shapes per (bucket, K) (block tables aside), which a compiled or captured
    round needs to replay without a new graph: the verify's hidden rows are padded to K + 1
    where every span fits (the verify before ran at K), else to k_max + 1 (after a probe). With
    shallow rounds (``defer_limit`` > 0) the k = 1 rounds run depth 0 only and each probe catches
    depth 1 up in an eager round (spans of any length); with 0 both run all depths, static."""
    prompts, new = prompts_of(62, 2), 16
    engine, _ = make_engine(  # checking drafts runs rounds eagerly
        model, [*AUTO, f"drafter.defer_limit={defer_limit}"], check_drafts=False
    )
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    for bucket in (1, 2):
        adaptive.set_costs(bucket, [1.0, 1.0, 2.0])  # E(1) / 1 > E(2) / 2 and >= E(0): k = 1 unless probing
    adaptive.probe_every, adaptive.probe_budget, adaptive.max_backoff = 3, 0.0, 0
    adaptive.depths_for = lambda *args: 2  # type: ignore[method-assign]  # every request keeps both depths
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    engine.generate(reqs)
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs(reqs) == outputs(plain)
    assert engine.k_chosen[1] >= 4 and engine.k_chosen[2] >= 2  # both widths were verified
    shapes: dict[tuple[str, int], set] = {}  # (round, bucket) -> input shapes before the tables
    for fn, args in step_calls:
        if fn.name.startswith("draft-round"):
            shapes.setdefault((fn.name, args[0][0][0]), set()).add(tuple(s for s, _ in args[: fn.tables_from]))
    static = {"draft-round-k1", "draft-round-k2"} if defer_limit == 0 else {"draft-round-k1-shallow"}
    assert {name for name, _ in shapes} == static
    for (name, _), seen in shapes.items():
        K = round_k(name)
        widths = {shape[0][1] for shape in seen}  # of the hidden rows [B, T, H]
        assert len(seen) == len(widths) and K + 1 in widths and widths <= {K + 1, 3}, shapes


@pytest.mark.parametrize("defer_limit", [0, 64])
def test_static_draft_rounds_cut_hidden_rows_to_their_span_width(model, step_calls, defer_limit):
    """k drawn per round from 1..4 (k_max = 4), so a round often follows a verify wider than
    itself: after a verify at k = 4 (5 hidden rows) that accepted little, a round at K = 2 whose
    spans fit in K + 1 = 3 takes 3 of those rows, not 5. Every static round's hidden rows are
    as wide as its spans (the ext buffer holds the span and max(K, P) more), so it has at most
    the two shapes warm-up compiles per (bucket, K): K + 1 and k_max + 1 (a third, K + 1 spans
    beside k_prev + 1 rows, compiled mid-run, 1-9 s each at batch 1). Outputs equal plain
    decoding."""
    prompts, new = prompts_of(71, 2), 60
    engine, _ = make_engine(
        model,
        ["drafter=mtp", "mtp.depths=4", "spec.num_tokens=auto", f"drafter.defer_limit={defer_limit}"],
        check_drafts=False,
    )
    rng = random.Random(defer_limit)
    engine._round_k = lambda bucket, share, probe, request=None: rng.choice([1, 2, 3, 4])  # type: ignore[method-assign]
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    engine.generate(reqs)
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs(reqs) == outputs(plain)
    shapes: dict[tuple[str, int], set] = {}  # (round, bucket) -> (hidden rows, span width)
    verified, after_wider = 0, 0  # the last verify's width; rounds that followed a wider verify
    for fn, args in step_calls:
        if fn.name == "verify":
            verified = args[1][0][1]  # ids [B, k_prev + 1]
        elif fn.name.startswith("draft-round"):
            K = round_k(fn.name)
            hidden, ext = args[0][0], args[7][0]  # [B, Th, H], [B, T + max(K, P)]
            shapes.setdefault((fn.name, hidden[0]), set()).add((hidden[1], ext[1] - max(K, 4)))
            after_wider += verified > K + 1
    assert after_wider >= 3 and len(shapes) >= 4, shapes
    for (name, _), seen in shapes.items():
        K = round_k(name)
        assert all(rows == width for rows, width in seen) and {w for _, w in seen} <= {K + 1, 5}, (name, seen)


def test_auto_k_measures_its_probes_as_served(model):
    """The engine times each probe as served, its drafting step and the step that verifies its
    drafts, in the bucket's decode steps that took no part in a probe (AdaptiveK.note_probe_steps,
    which spaces later probes by it). A step that prefills between the two drops the measure, and
    warm-up's forced k measures nothing. Outputs equal plain decoding."""
    prompts, new = prompts_of(40, 1), 24
    engine, _ = make_engine(model, AUTO, check_drafts=False)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    adaptive.set_costs(1, [1.0, 1.0, 2.0])  # k = 1 unless probing
    adaptive.probe_every, adaptive.probe_budget, adaptive.max_backoff = 3, 0.0, 0
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    engine.generate(reqs)
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs(reqs) == outputs(plain)
    assert adaptive.probes >= 2 and engine._typical_step_s[1] > 0
    measured = adaptive.measured_probe_steps(1)
    assert measured is not None and measured > 0
    # the measure itself, with steps of known seconds
    engine._typical_step_s, adaptive._probe_steps = {}, {}
    for seconds in (1.0, 1.0):
        engine._time_probe(seconds, 1, probed=False)
    engine._time_probe(3.0, 1, probed=True)  # a probe's drafting step
    engine._time_probe(2.0, 1, probed=False)  # the verify of its drafts
    assert adaptive.measured_probe_steps(1) == pytest.approx(5.0) and engine._typical_step_s == {1: 1.0}
    engine._time_probe(3.0, 1, probed=True)
    engine._time_probe(9.0, None, probed=False)  # a step that prefilled
    engine._time_probe(2.0, 1, probed=False)  # an ordinary step again
    assert adaptive.measured_probe_steps(1) == pytest.approx(5.0)
    assert engine._typical_step_s[1] == pytest.approx(0.95 + 0.05 * 2.0)
    engine._forced_k = 2
    engine._time_probe(3.0, 1, probed=True)
    engine._time_probe(2.0, 1, probed=False)
    assert adaptive.measured_probe_steps(1) == pytest.approx(5.0) and engine._probe_pair is None


@pytest.mark.parametrize(("probe_due", "defer_limit"), [(True, 0), (True, 64), (False, 64)])
def test_auto_k_stops_drafting_for_good(model, monkeypatch, probe_due, defer_limit):
    """k = 0 best and no probes ever run. With a probe due soon (``probe_due``) the first
    request's prompt is drafted over (no drafts; its caches filled, or with shallow rounds every
    depth deferred until a probe would need it; the second is admitted plainly: one drafting
    request is enough for a probe), its lag fills to LAG_LIMIT, then the request
    stops drafting for good; with none due it stops at its prefill, never drafted over. Either
    way it then decodes plainly (nothing proposed, k = 0 counted, its prefix cache ends where its
    drafter's caches do) and its output equals plain decoding; preemption makes it start over."""
    monkeypatch.setattr("inkfw.speculative.engine.LAG_LIMIT", 3)
    prompts, new = prompts_of(61, 2), 12
    engine, kv = make_engine(model, [*AUTO, f"drafter.defer_limit={defer_limit}"], check_drafts=True)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    for bucket in (1, 2):
        adaptive.set_costs(bucket, [1.0, 100.0, 100.0])
    adaptive.probe_every = 0
    assert adaptive.steps_to_probe(1) == float("inf")
    if probe_due:
        monkeypatch.setattr(adaptive, "steps_to_probe", lambda bucket: 3)
    proposed = []  # (request id, num_accepted) of every span drafted over
    drafter = parts(engine)[1]
    propose = drafter.propose

    def recording(spans, *args, **kwargs):
        proposed.extend((s.request.id, s.num_accepted) for s in spans)
        return propose(spans, *args, **kwargs)

    drafter.propose = recording  # type: ignore[method-assign]
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    engine.step()  # prefill
    assert [r.drafting_off for r in reqs] == [not probe_due, True]
    while not all(r.drafting_off for r in reqs):
        engine.step()
    assert not any(r.finished for r in reqs) and all(r.lag == [] for r in reqs)
    # where each drafter's caches end: a K = 0 round over the prompt runs no depth when it may defer them
    drafted_to = [len(prompts[0]) - 1 if probe_due and not defer_limit else 0, 0]
    assert [r.lag_start for r in reqs] == drafted_to
    assert all(drafter.next_start(r.id) is None for r in reqs)  # the drafter forgot them
    assert proposed == ([(reqs[0].id, None)] if probe_due else [])  # a prompt only, K = 0
    steps, plain_steps = engine.times.num_steps, engine.k_chosen[0]

    def draft_blocks():
        return [len(t) for r in reqs for g, t in zip(kv.groups, kv._tables[r.id]) if g.draft]

    held = draft_blocks()
    for _ in range(4):
        engine.step()
    assert engine.k_chosen[0] == plain_steps + 4  # a step where nothing drafts counts as k = 0
    assert draft_blocks() == held  # no new blocks for the draft groups
    assert [r.lag_start for r in reqs] == drafted_to  # the prefix cache's limit stays

    engine._preempt(reqs[0])
    assert not reqs[0].drafting_off and reqs[0].lag_start is None
    while not all(r.finished for r in reqs):
        engine.step()
    assert reqs[0].num_preemptions == 1 and engine.times.num_steps > steps + 1
    assert proposed[1:] == ([(reqs[0].id, None)] if probe_due else [])  # its re-prefill started over
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs(reqs) == outputs(plain)
    assert engine.metrics.num_draft_tokens == 0


@pytest.mark.parametrize(("k0_best", "probing"), [(True, False), (True, True), (False, False)])
def test_auto_k_admits_plainly_while_nothing_would_draft(model, k0_best, probing):
    """Admitted while k = 0 is best at its bucket and no probe can come (probing off, or on at
    costs where no acceptance could make drafting pay), a request decodes
    plainly from admission: its prompt is not drafted over, it holds no draft-cache blocks, and
    its first prefill chunk fills the step's budget (10) instead of ending P - 1 = 2 short of the
    prompt's end (D = 3). Where k = 3 is best it drafts as before. Either way its target blocks
    go to the prefix cache: the same prompt again hits its first two blocks. Outputs equal
    plain decoding."""
    engine, kv = make_engine(
        model, ["drafter=mtp", "mtp.depths=3", "spec.num_tokens=auto"], check_drafts=False, max_num_batched_tokens=10
    )
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK) and engine.drafter.lookahead == 3
    adaptive.set_costs(1, [1.0, 100.0, 100.0, 100.0] if k0_best else [1.0] * 4)
    adaptive.probe_every, adaptive.probe_budget, adaptive.max_backoff = (2, 0.0, 0) if probing else (0, 0.02, 4)
    proposed = []
    drafter = parts(engine)[1]
    propose = drafter.propose

    def recording(spans, *args, **kwargs):
        proposed.append(len(spans))
        return propose(spans, *args, **kwargs)

    drafter.propose = recording  # type: ignore[method-assign]
    prompt = prompts_of(63, 1, lo=12, hi=12)[0]
    r = engine.add_request(prompt, max_new_tokens=8)
    engine.step()
    assert r.drafting_off == k0_best and r.num_computed == (10 if k0_best else 9)
    draft_blocks = [len(t) for g, t in zip(kv.groups, kv._tables[r.id]) if g.draft]
    assert (sum(draft_blocks) == 0) == k0_best
    engine.generate([r])
    assert (not proposed) == k0_best and (engine.metrics.num_draft_tokens > 0) != k0_best
    again = engine.add_request(prompt, max_new_tokens=8)
    engine.step()
    assert again.num_computed == 11  # a hit of (12 - P) // 4 = 2 blocks, then the rest in one chunk
    engine.generate([again])
    plain, _, _ = generate(model, NO_DRAFTER, [prompt], 8, check_drafts=False)
    assert outputs([r]) == outputs([again]) == outputs(plain)


@pytest.mark.parametrize(("prompt_s", "drafts"), [(1.0, False), (0.1, True)])
def test_auto_k_drafts_for_a_request_only_where_its_tokens_earn_back_its_prompt_pass(model, prompt_s, drafts):
    """k = 3 best (every k costs a plain step; priced optimistically, every estimate at its upper
    bound, 1 with the prior alone, so E(3) = 4): each of 8 new tokens saves 0.75 plain steps, 6 in
    all. A 12-position prompt whose pass costs 12 plain steps is not drafted over, and the
    request decodes plainly from admission; at 1.2 it drafts, and is recorded as an admission
    to draft (what probes' carriers are priced by). Outputs equal plain decoding."""
    engine, _ = make_engine(model, ["drafter=mtp", "mtp.depths=3", "spec.num_tokens=auto"], check_drafts=False)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    adaptive.set_costs(1, [1.0] * 4, prompt_s=prompt_s)
    adaptive.probe_every = 0
    assert adaptive.best_k(1) == 3
    prompt = prompts_of(67, 1, lo=12, hi=12)[0]
    r = engine.add_request(prompt, max_new_tokens=8)
    engine.step()
    assert r.drafting_off != drafts
    # a probe's carrier would pass over such a prompt: admissions to draft are what probes are priced by
    assert adaptive.carrier_pass_s(1, 0) == pytest.approx(12 * prompt_s if drafts else 0.0)
    engine.generate([r])
    assert (engine.metrics.num_draft_tokens > 0) == drafts
    plain, _, _ = generate(model, NO_DRAFTER, [prompt], 8, check_drafts=False)
    assert outputs([r]) == outputs(plain)


def test_auto_k_drafts_for_a_due_probe_where_the_prompt_pass_does_not_pay(model):
    """As above, k = 3 best and a 12-position prompt whose pass (12 plain steps) costs more than
    its 8 tokens save (6), but with probes on and one due within LAG_LIMIT steps: the request
    drafts anyway. A request admitted plainly observes nothing, so once every request was, the
    estimates that admitted them plainly could never change (the fifteenth session's compiled
    batch-1 run: two early requests, no drafting for the rest of 24). A second request admitted
    while the first drafts decodes plainly: one drafting request is enough for a probe. Outputs
    equal plain decoding."""
    engine, _ = make_engine(model, ["drafter=mtp", "mtp.depths=3", "spec.num_tokens=auto"], check_drafts=False)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    adaptive.set_costs(1, [1.0] * 4, prompt_s=1.0)
    assert adaptive.best_k(1) == 3 and not adaptive.drafting_pays_for(1, 12, 8)
    assert adaptive.steps_to_probe(1) <= LAG_LIMIT and adaptive.steps_to_probe(2) <= LAG_LIMIT
    prompts = prompts_of(67, 2, lo=12, hi=12)
    first = engine.add_request(prompts[0], max_new_tokens=8)
    engine.step()
    second = engine.add_request(prompts[1], max_new_tokens=8)
    engine.step()
    assert not first.drafting_off and second.drafting_off
    engine.generate([first, second])
    assert first.num_draft_tokens > 0 and second.num_draft_tokens == 0
    plain, _, _ = generate(model, NO_DRAFTER, prompts, 8, check_drafts=False)
    assert outputs([first, second]) == outputs(plain)


def test_auto_k_keeps_each_request_to_the_depths_that_pay(model):
    """D = 3 and k = 1 best by far (steps at k >= 2 cost 3 plain steps), the prompt pass priced:
    a request admitted to draft keeps depth 0 only (``AdaptiveK.depths_for``). Its rounds run that
    depth alone and draft one token at most, it holds no blocks in the groups of depths 1 and 2,
    its drafts equal the uncached reference (check_drafts) and its output plain decoding. A probe
    that falls due while only such requests run waits (it could not draft k = 3 for them); the
    next request admitted keeps every depth, since a probe is due within its steps and no running
    request keeps them all, and the probe then drafts 3 for it: one such request is enough, so
    the one admitted beside it keeps depth 0 only."""
    engine, kv = make_engine(model, ["drafter=mtp", "mtp.depths=3", "spec.num_tokens=auto"], check_drafts=True)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    for bucket in (1, 2):
        adaptive.set_costs(bucket, [1.0, 1.1, 3.0, 3.0], prompt_s=0.001)
    assert adaptive.best_k(1) == 1 and adaptive.depths_for(1, 10, 12) == 1
    adaptive.probe_every, adaptive.probe_budget, adaptive.max_backoff = 64, 0.0, 0
    _, drafter = parts(engine)
    rounds: list[tuple[int, int]] = []  # (k, depths run) of every drafting round
    run_round = drafter.round

    def counting(kv_, K, depths_run, chooser, *args):
        rounds.append((K, depths_run))
        return run_round(kv_, K, depths_run, chooser, *args)

    drafter.round = counting  # type: ignore[method-assign]
    depth_groups = [g for d in (1, 2) for g in kv.draft_layout[d]]
    prompts = prompts_of(68, 3, lo=10, hi=12)
    first = engine.add_request(prompts[0], max_new_tokens=12)
    engine.step()
    adaptive._next_probe[1] = adaptive.steps[1] + 1  # a probe falls due while it runs
    while not first.finished:
        assert all(kv.held_blocks(first.id)[g] == 0 for g in depth_groups)
        engine.step()
    assert first.draft_depths == 1 and engine.depths_admitted == {1: 1}
    assert rounds and all(r == (1, 1) for r in rounds) and 0 < first.num_draft_tokens <= first.num_verify_steps
    assert adaptive.probes == 0 and adaptive.steps_to_probe(1) <= 0  # still due
    rounds.clear()
    second = engine.add_request(prompts[1], max_new_tokens=12)
    engine.step()  # its prompt's round is the probe
    assert second.draft_depths is None and adaptive.probes == 1 and rounds == [(3, 3)]
    adaptive._next_probe[2] = adaptive.steps[2] + 1  # due at batch 2 as well
    third = engine.add_request(prompts[2], max_new_tokens=12)
    engine.step()  # the probe: k = 3 for the second, 1 for the third, in rounds of their own
    assert third.draft_depths == 1 and adaptive.probes == 2 and rounds[-2:] == [(3, 3), (1, 1)]
    engine.generate([second, third])
    assert all(r == (1, 1) or r[1] == 3 for r in rounds)
    assert third.num_draft_tokens <= third.num_verify_steps  # one draft a step at most
    assert engine.depths_admitted == {1: 2, 3: 1}
    plain, _, _ = generate(model, NO_DRAFTER, prompts[:3], 12, check_drafts=False)
    assert outputs([first, second, third]) == outputs(plain)
    assert kv.is_whole()


def test_auto_k_admits_plainly_where_one_drafting_row_could_not_pay(model):
    """Bucket 4 where k = 2 pays when every row drafts (E(2) = 2.19 at 1.6 plain steps) but even
    one row drafting every token right could not (1 + 3/4 tokens at 1.9 plain steps), and no
    prompt pass is earned back: a probe is due, yet all four requests decode plainly. Drafting
    alone among plain rows, a request would lag until the probe, which the whole batch pays for
    (eager batch 16 in the fifteenth session: 0.88x plain with that request, 0.97x without).
    Outputs equal plain decoding."""
    engine, _ = make_engine(model, ["drafter=mtp", "mtp.depths=3", "spec.num_tokens=auto"], check_drafts=False)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    adaptive.set_costs(4, [1.0, 1.3, 1.6, 1.9], prompt_s=1.0)
    assert adaptive.best_k_at(4) == 2 and adaptive.best_k(4) >= 2 and adaptive.best_k(4, [3, 0, 0, 0]) == 0
    assert not adaptive.drafting_pays_for(4, 12, 8) and adaptive.steps_to_probe(4) <= LAG_LIMIT
    prompts = prompts_of(71, 4, lo=12, hi=12)
    reqs = [engine.add_request(p, max_new_tokens=8) for p in prompts]
    engine.step()
    assert all(r.drafting_off for r in reqs)
    engine.generate(reqs)
    assert engine.metrics.num_draft_tokens == 0
    plain, _, _ = generate(model, NO_DRAFTER, prompts, 8, check_drafts=False)
    assert outputs(reqs) == outputs(plain)


def test_auto_k_prices_a_round_by_the_rows_that_draft(model):
    """Two requests at bucket 2 where k = 2 pays if both draft (E = 2.19 at 1.6 plain steps); the
    long prompt's pass (20 positions at 0.1) costs more than its 8 tokens save (1.08), so it
    decodes plainly, the short one (0.6) drafts. With half the rows drafting k = 2 would emit
    1.6 tokens per row at 1.6 plain steps: every decode round chooses k = 0, and the only round
    that drafts is the short prompt's own (bucket 1, where it is the whole batch). Outputs equal
    plain decoding."""
    engine, _ = make_engine(model, ["drafter=mtp", "mtp.depths=2", "spec.num_tokens=auto"], check_drafts=False)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    adaptive.set_costs(2, [1.0, 1.3, 1.6], prompt_s=0.1)
    adaptive.probe_every, adaptive.confidence, adaptive.prior_acceptance = 0, 0.0, 0.7  # the estimates decide
    assert adaptive.best_k(2) == 2 and adaptive.best_k(2, [2, 0]) == 0
    prompts = [prompts_of(68, 1, lo=6, hi=6)[0], prompts_of(69, 1, lo=20, hi=20)[0]]
    reqs = [engine.add_request(p, max_new_tokens=8) for p in prompts]
    engine.step()
    assert [r.drafting_off for r in reqs] == [False, True]
    engine.generate(reqs)
    assert sum(n for k, n in engine.k_chosen.items() if k > 0) == 1 and engine.k_chosen[0] > 1
    plain, _, _ = generate(model, NO_DRAFTER, prompts, 8, check_drafts=False)
    assert outputs(reqs) == outputs(plain)


def test_a_request_admitted_beside_decoding_ones_leaves_their_round_static(model):
    """A prompt's last chunk drafted in the same step as two decoding requests: the decoding
    requests' spans run one static round (padded to bucket 2), the prompt's an eager one of its
    own, instead of one eager round for all three. Drafts match the uncached reference
    (check_drafts) and outputs equal plain decoding."""
    engine, _ = make_engine(model, ["drafter=mtp", "mtp.depths=2", "spec.num_tokens=2"], check_drafts=True)
    rounds: list[list[tuple[int, int | None, bool]]] = []  # per step: (spans, pad_to, any prompt span)
    drafter = parts(engine)[1]
    propose = drafter.propose

    def recording(spans, *args, pad_to=None, **kwargs):
        rounds[-1].append((len(spans), pad_to, any(s.num_accepted is None for s in spans)))
        return propose(spans, *args, pad_to=pad_to, **kwargs)

    drafter.propose = recording  # type: ignore[method-assign]
    prompts = prompts_of(70, 3)
    reqs = [engine.add_request(p, max_new_tokens=10) for p in prompts[:2]]
    for _ in range(3):
        rounds.append([])
        engine.step()
    reqs.append(engine.add_request(prompts[2], max_new_tokens=10))
    rounds.append([])
    engine.step()
    assert sorted(rounds[-1], key=str) == sorted([(2, 2, False), (1, None, True)], key=str)
    engine.generate(reqs)
    plain, _, _ = generate(model, NO_DRAFTER, prompts, 10, check_drafts=False)
    assert outputs(reqs) == outputs(plain)


def test_auto_k_admits_for_the_batch_the_queue_will_make(model):
    """Four requests queued together decode at bucket 4, where k = 0 is best and never probed
    (no acceptance could make drafting pay); at bucket 1 drafting would pay. Each is admitted by
    bucket 4's choice, the batch it joins, so all four decode plainly from admission, the first
    too (judged by bucket 1, as if it would run alone, it drafted over its prompt for nothing).
    Outputs equal plain decoding."""
    engine, _ = make_engine(model, ["drafter=mtp", "mtp.depths=2", "spec.num_tokens=auto"])
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK) and engine.config.max_num_seqs >= 4
    adaptive.set_costs(1, [1.0, 1.0, 1.0])
    adaptive.set_costs(4, [1.0, 100.0, 100.0])
    assert adaptive.best_k(1) == 2 and adaptive.best_k(4) == 0 and not adaptive.drafting_could_pay(4)
    prompts = prompts_of(66, 4)
    reqs = [engine.add_request(p, max_new_tokens=6) for p in prompts]
    engine.step()
    assert [r.drafting_off for r in reqs] == [True] * 4
    engine.generate(reqs)
    assert engine.metrics.num_draft_tokens == 0
    plain, _, _ = generate(model, NO_DRAFTER, prompts, 6, check_drafts=False)
    assert outputs(reqs) == outputs(plain)


def test_auto_k_at_zero_drafts_over_a_sampled_prompt_for_a_probe(model, monkeypatch):
    """k = 0 and a probe due: the drafter still passes over each prompt chunk (no drafts), so the
    probe finds every depth's cache whole. With a sampled request in the batch that round of no
    drafts raised StopIteration (no draft distribution to stack) and took the step down. Outputs,
    the sampled request's included, equal plain decoding with the same seeds: k = 0 drafts
    nothing, and each token is one draw."""
    engine, _ = make_engine(model, AUTO, check_drafts=False)
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    monkeypatch.setattr(engine, "_round_k", lambda *_, **__: 0)
    monkeypatch.setattr(adaptive, "steps_to_probe", lambda bucket: 0)  # due now: prompts drafted over
    passes = record_proposals(parts(engine)[1])
    prompts, params = prompts_of(74, 3), [SAMPLED, None, SamplingParams(temperature=0.7, seed=9)]
    reqs = engine.generate([engine.add_request(p, sp, max_new_tokens=8) for p, sp in zip(prompts, params)])
    assert passes and not any(drafts for _, drafts, _ in passes)  # rounds over the prompts, no drafts
    assert not any(r.drafting_off for r in reqs) and engine.k_chosen[0] > 0
    plain, _, _ = generate(model, NO_DRAFTER, prompts, 8, params=params, check_drafts=False)
    assert outputs(reqs) == outputs(plain)


def test_auto_k_at_zero_lets_one_request_draft_for_a_probe(model, monkeypatch):
    """k = 0 best at bucket 4 and a probe due soon: of 4 requests admitted together only the first
    drafts (its prompt drafted over, its lag caught up by the probe), the others decode plainly
    from admission, so the probe costs one request's passes. Outputs equal plain decoding."""
    engine, _ = make_engine(model, ["drafter=mtp", "mtp.depths=2", "spec.num_tokens=auto"])
    adaptive = engine.adaptive
    assert isinstance(adaptive, AdaptiveK)
    adaptive.set_costs(4, [1.0, 100.0, 100.0])
    adaptive.probe_every, adaptive.probe_budget, adaptive.max_backoff = 3, 0.0, 0  # a probe every 3rd step
    monkeypatch.setattr(adaptive, "drafting_could_pay", lambda bucket: True)  # forced, as these costs stop probes
    proposed = []  # request ids drafted over, per round
    drafter = parts(engine)[1]
    propose = drafter.propose

    def recording(spans, *args, **kwargs):
        proposed.append({s.request.id for s in spans})
        return propose(spans, *args, **kwargs)

    drafter.propose = recording  # type: ignore[method-assign]
    prompts = prompts_of(65, 4)
    reqs = [engine.add_request(p, max_new_tokens=12) for p in prompts]
    engine.step()
    assert [r.drafting_off for r in reqs] == [False, True, True, True]
    engine.generate(reqs)
    assert proposed and set().union(*proposed) == {reqs[0].id}
    assert adaptive.probes >= 1 and engine.metrics.num_draft_tokens > 0  # the probes drafted for it
    plain, _, _ = generate(model, NO_DRAFTER, prompts, 12, check_drafts=False)
    assert outputs(reqs) == outputs(plain)


def test_a_carrier_drafting_k_shares_the_round_of_rows_kept_to_k_depths(model, monkeypatch):
    """A request that keeps every depth (a probe's carrier, 3 here) and one kept to 2 depths,
    both drafting k = 2: the carrier defers its third depth and both draft in one round each
    step, where each number of depths kept used to cost a round of its own. Drafts match the
    uncached reference (check_drafts), outputs equal plain decoding, every block comes back."""
    engine, kv = make_engine(model, ["drafter=mtp", "mtp.depths=3", "spec.num_tokens=auto"], max_num_seqs=2)
    depths = iter([None, 2])
    monkeypatch.setattr(engine, "_admission_depths", lambda r, num_rows: next(depths))
    monkeypatch.setattr(engine, "_round_k", lambda *_, **__: 2)
    prompts, new = prompts_of(73, 2), 10
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    seen = spy_padding(engine)
    engine.generate(reqs)
    assert [r.draft_depths for r in reqs] == [None, 2]
    decode_rounds = [rows for part, rows, pad in seen if part == "draft" and pad is not None]
    assert decode_rounds and decode_rounds[0] == 2  # one round for both rows
    assert engine.k_chosen[2] == len([rows for part, rows, _ in seen if part == "draft"])  # one round a step
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs(reqs) == outputs(plain)
    assert kv.is_whole()


def test_a_larger_batch_lowers_the_depths_chosen_for_a_smaller_one(model, monkeypatch):
    """A request admitted alone keeps the depths that pay at bucket 1 (2 of 3 here) and drafts
    k = 1 in shallow rounds (depth 1 deferred); three that join it make bucket 4, where a request
    keeps 1 (a stand-in for AdaptiveK.depths_for prices depths by bucket alone). The first
    request is lowered to 1 depth: its blocks of depth 1 go back to the pool, its deferred
    positions need no catch-up, and all four draft in one round. Drafts match the uncached
    reference (check_drafts), outputs equal plain decoding, and every block comes back."""
    engine, kv = make_engine(model, ["drafter=mtp", "mtp.depths=3", "spec.num_tokens=auto"], max_num_seqs=4)
    adaptive, drafter = engine.adaptive, parts(engine)[1]
    assert isinstance(adaptive, AdaptiveK)
    adaptive.set_costs(1, [1.0, 1.0, 3.0, 3.0])  # k = 1 best
    adaptive.probe_every = 0
    monkeypatch.setattr(adaptive, "depths_for", lambda bucket, *_, **__: 2 if bucket == 1 else 1)
    prompts, new = prompts_of(71, 4), 12
    first = engine.add_request(prompts[0], max_new_tokens=new)
    for _ in range(3):
        engine.step()
    depth_groups = [gi for gi, d in enumerate(kv._group_depth) if d is not None and d >= 1]
    assert first.draft_depths == 2 and first.depths_bucket == 1 and engine.k_chosen[1] >= 2
    assert sum(kv.held_blocks(first.id)[gi] for gi in depth_groups) > 0
    assert drafter.stale_from(first.id) is not None  # shallow rounds deferred depth 1
    rest = [engine.add_request(p, max_new_tokens=new) for p in prompts[1:]]
    seen = spy_padding(engine)
    engine.step()
    assert first.draft_depths == 1 and engine.depths_lowered == 1
    assert sum(kv.held_blocks(first.id)[gi] for gi in depth_groups) == 0
    assert drafter.stale_from(first.id) is None  # depth 1 never runs over it again
    assert [r.draft_depths for r in rest] == [1, 1, 1]
    engine.generate([first, *rest])
    assert ("draft", 4) in [(part, rows) for part, rows, pad in seen if pad is not None]  # one round for all
    plain, _, _ = generate(model, NO_DRAFTER, prompts, new, check_drafts=False)
    assert outputs([first, *rest]) == outputs(plain)
    assert kv.is_whole()


@pytest.mark.parametrize("defer_limit", [0, 10, 64])
def test_shallow_rounds_defer_deeper_depths_exactly(model, defer_limit):
    """k switches at random between rounds (0 .. k_max = D = 4, P = 4), over two batches that
    share prompts (prefix-cache hits). A round with k < P runs depths 0 .. k-1 only (shallow):
    a row whose deferred positions some of those depths have not run over re-spans them with
    those depths, and every depth runs over them in one span at a round with k = P or when the
    deferred positions would pass ``defer_limit`` (0: every round runs all P depths). check_drafts compares every draft with the uncached reference
    (DraftCheckError otherwise), so drafts right after a catch-up and drafts that read
    prefix-cached draft blocks are exact too; outputs equal plain decoding, the pool ends whole."""
    engine, kv = make_engine(
        model, ["drafter=mtp", "mtp.depths=4", "spec.num_tokens=auto", f"drafter.defer_limit={defer_limit}"]
    )
    drafter = parts(engine)[1]
    assert drafter.lookahead == 4 and drafter.defer_limit == defer_limit
    rng = random.Random(defer_limit)
    engine._round_k = lambda bucket, share, probe, request=None: rng.choice([0, 1, 1, 2, 2, 3, 4])  # type: ignore[method-assign]
    engine._admission_depths = lambda r, rows: None  # type: ignore[method-assign]  # every request keeps all 4
    rounds = []  # per drafting round: (k, depths run, rows caught up, rows re-spanned by a shallow round)
    propose, run_round = drafter.propose, drafter.round

    def recording(spans, kv, run, keep_logits=False, pad_to=None, num_tokens=None):
        states = [drafter._rows.get(s.request.id) for s in spans]
        levels = [None if st is None or st.deferred is None else st.deferred.level for st in states]
        out = propose(spans, kv, run, keep_logits=keep_logits, pad_to=pad_to, num_tokens=num_tokens)
        after = [drafter.stale_from(s.request.id) for s in spans]
        caught_up = sum(lv is not None and a is None for lv, a in zip(levels, after))
        respanned = sum(lv is not None and lv < num_tokens and a is not None for lv, a in zip(levels, after))
        rounds[-1] += (caught_up, respanned)
        return out

    def counting(kv, K, depths_run, chooser, *args):
        rounds.append((K, depths_run))
        return run_round(kv, K, depths_run, chooser, *args)

    drafter.propose, drafter.round = recording, counting  # type: ignore[method-assign]
    prompts = prompts_of(64, 3, lo=6, hi=20)
    reqs = []
    for batch in (prompts, prompts[:2]):  # the second batch hits the first one's prefix blocks
        reqs += engine.generate([engine.add_request(p, max_new_tokens=24) for p in batch])
    plain, _, _ = generate(model, NO_DRAFTER, prompts + prompts[:2], 24, check_drafts=False)
    assert outputs(reqs) == outputs(plain) and all(r.finish_reason == "length" for r in reqs)
    assert engine.metrics.num_draft_tokens > 50 and kv.is_whole()
    shallow = [(k, run) for k, run, _, _ in rounds if run < 4]
    catch_ups = [k for k, run, caught, _ in rounds if caught]
    if defer_limit == 0:
        assert not shallow and not catch_ups
        return
    assert shallow and all(run == k for k, run in shallow)  # only the depths that draft
    assert any(k > 0 for k, _ in shallow)
    assert catch_ups and all(run == 4 for _, run, caught, _ in rounds if caught)  # ... then all P at once
    # a larger k below P re-spans the deferred positions with its own depths, the deeper ones still wait
    assert any(respanned and run < 4 for _, run, _, respanned in rounds)
    if defer_limit == 10:  # the limit forced catch-ups at k that needed no deeper depth
        assert any(k < 4 for k in catch_ups)


def test_defer_limit_must_be_a_count(model):
    with pytest.raises(ConfigError, match="drafter.defer_limit must be an integer >= 0"):
        make_engine(model, ["drafter=mtp", "mtp.depths=2", "drafter.defer_limit=-1"])


# --------------------------------------------------------------------------- 6. warm-up
def test_warmup_leaves_the_engine_clean(model):
    prompts, new = prompts_of(70, 3), 8
    engine, kv = make_engine(model, mtp(2, 3), check_drafts=False)
    seconds = engine.warmup([1, 4])
    assert seconds > 0 and engine.warmup_s == seconds
    assert engine.metrics.num_steps == 0 and engine.times.num_steps == 0 and not engine.k_chosen
    assert not engine.running and not engine.waiting and not engine.has_unfinished()
    assert kv.is_whole()
    assert ("last", (4,), torch.long) in parts(engine)[0].buffers._buffers  # bucket 4 was run
    reqs = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    engine.generate(reqs)
    fresh, _, _ = generate(model, mtp(2, 3), prompts, new, check_drafts=False)
    assert outputs(reqs) == outputs(fresh)
    assert engine.metrics.num_steps == sum(r.num_verify_steps for r in reqs)  # counted from zero


def test_warmup_s_counts_first_compiles_met_while_generating(model, monkeypatch):
    """A step shape first met while generating (a bucket the warm-up left out, a context whose
    block table doubles) compiles or captures then: ``warmup_s`` counts those seconds once, with
    :meth:`Engine.warmup`'s own (whose compiles its wall time already holds), and the step times
    leave them out, so tokens/s and the step split measure decoding."""
    compile_s = 0.3  # seconds each first call of a shape takes, as if it compiled
    slow_first_calls(monkeypatch, compile_s)
    engine, _ = make_engine(model, mtp(2, 3), check_drafts=False)
    seconds = engine.warmup([1])
    shapes = engine.step_compile_s / compile_s
    assert shapes >= 2 and engine.warmup_s == pytest.approx(seconds)  # verify + draft round, inside the wall
    engine.times = StepTimes()
    reqs = [engine.add_request(p, max_new_tokens=12) for p in prompts_of(71, 4)]  # bucket 4: new shapes
    t = time.perf_counter()
    engine.generate(reqs)
    wall = time.perf_counter() - t
    new_shapes = engine.step_compile_s / compile_s - shapes
    assert new_shapes >= 2
    assert engine.warmup_s == pytest.approx(seconds + new_shapes * compile_s)
    assert 0 < engine.times.total_s <= wall - new_shapes * compile_s  # the compiles are not step time
    assert 0 < engine.times.forward_s <= engine.times.total_s


def test_warmup_needs_an_idle_engine(model):
    engine, _ = make_engine(model, NO_DRAFTER, check_drafts=False)
    engine.add_request([5, 6, 7], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warmup([1])
