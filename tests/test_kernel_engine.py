"""The engine on the Triton backend (``kernels.backend=triton``; the CPU runs Triton's
interpreter, docs/design.md §5): greedy and seeded sampled outputs equal the torch backend's
token for token, MTP drafts pass the uncached reference check, every kernel actually runs, and
the backend choice behaves (auto: torch on CPU; bad values and combinations fail in one
sentence)."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import pytest

from helpers.cuda_graphs import RecordedCudaGraphs
from helpers.engine import (  # noqa: F401
    NO_DRAFTER,
    assert_drafts_are_the_reference,
    generate,
    make_engine,
    mtp,
    one_thread,
    outputs,
    parts,
    record_proposals,
    spec_model,
)
from helpers.engine import SPEC_VOCAB as VOCAB
from inkfw.errors import ConfigError
from inkfw.kernels import OPS, Kernels, check_backend, implementation, resolve_backend
from inkfw.speculative.sampling import SamplingParams

pytestmark = pytest.mark.kernel

FUSED_VERIFY = {"paged_span_attention", "cached_short_conv", "greedy_accept"}  # kernels of every engine step
FUSED_DRAFTING = {"prepare_draft_spans", "mtp_depth_input"}  # and of MTP drafting rounds


@pytest.fixture(scope="module")
def model():
    return spec_model(seed=3)


def prompts_of(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 11))] for _ in range(n)]


def counting(engine) -> Counter:
    """Count calls of each op of the engine's one Kernels object (shared by verifier, drafter, KV)."""
    kernels, calls = engine.verifier.kernels, Counter()
    assert getattr(engine.drafter, "kernels", kernels) is kernels and engine.kv.kernels is kernels  # none: no drafter
    for op in OPS:
        fn = getattr(kernels, op)

        def counted(*args, _fn=fn, _op=op, **kwargs):
            calls[_op] += 1
            return _fn(*args, **kwargs)

        setattr(kernels, op, counted)
    return calls


def run(model, drafter, prompts, backend, params=None, new=7):
    engine, kv = make_engine(model, drafter, overrides=[f"kernels.backend={backend}"], max_num_seqs=4)
    calls = counting(engine) if backend == "triton" else Counter()
    reqs = [engine.add_request(p, params, max_new_tokens=new) for p in prompts]
    engine.generate(reqs)
    assert all(r.finish_reason in ("length", "stop") for r in reqs), [r.error for r in reqs]
    assert kv.is_whole()
    return outputs(reqs), calls


@pytest.mark.parametrize("drafter", [mtp(2, 3), NO_DRAFTER], ids=["mtp-D2-k3", "plain"])
def test_triton_backend_greedy_equals_torch(model, drafter):
    """k > D exercises the drafter's decode steps; check_drafts (on in make_engine) compares every
    draft with the uncached reference, so the fused attention, convs and depth input are exact."""
    prompts = prompts_of(1, 3)
    ours, calls = run(model, drafter, prompts, "triton")
    theirs, _ = run(model, drafter, prompts, "torch")
    assert ours == theirs
    fused = FUSED_VERIFY | (FUSED_DRAFTING if drafter != NO_DRAFTER else set())
    assert fused <= {op for op, n in calls.items() if n > 0}, calls


def test_triton_kernels_replayed_in_cuda_graphs_equal_torch(model, monkeypatch):
    """On a GPU the Triton kernels run inside captured CUDA graphs (``engine.cuda_graphs``, on
    there by default). Through the CPU stand-in (helpers.cuda_graphs: a capture records each
    kernel launch, a replay re-launches them without running the step's Python), the Triton
    engine's replayed steps emit the torch backend's eager tokens, every draft equals the
    uncached reference, and the fused kernels ran as recorded launches (k > D: the drafter's
    decode steps too; plain decoding's steps are the verify's, with no drafts)."""
    graphs, drafter = RecordedCudaGraphs(monkeypatch), mtp(2, 3)
    prompts = prompts_of(4, 2)  # Triton's interpreter runs each launch in Python: kept small
    engine, kv = make_engine(
        model,
        drafter,
        check_drafts=False,
        overrides=["kernels.backend=triton", "engine.cuda_graphs=true"],
        max_num_seqs=2,
    )
    proposals = record_proposals(parts(engine)[1])
    reqs = [engine.add_request(p, max_new_tokens=7) for p in prompts]
    engine.generate(reqs)
    theirs, _ = run(model, drafter, prompts, "torch")
    assert outputs(reqs) == theirs and kv.is_whole()
    assert_drafts_are_the_reference(model, proposals, parts(engine)[1])
    fused = {f"{op}_triton" for op in FUSED_VERIFY | FUSED_DRAFTING}
    assert graphs.replays >= 5 and fused <= set(graphs.launches), graphs.launches


def test_triton_backend_sampled_equals_torch(model):
    """Seeded sampling draws the same numbers on both backends; the rejection-sampling kernel
    turns them into the same tokens as the reference."""
    prompts = prompts_of(2, 2)
    params = SamplingParams(temperature=0.9, top_k=20, seed=11)
    ours, calls = run(model, mtp(2, 2), prompts, "triton", params=params)
    theirs, _ = run(model, mtp(2, 2), prompts, "torch", params=params)
    assert ours == theirs
    assert calls["rejection_sample"] > 0


def test_backend_choice():
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("torch", "cuda") == "torch"
    triton, torch_ = Kernels("triton", "cpu"), Kernels("torch", "cpu")
    assert triton.fused and not torch_.fused
    for op in OPS:
        assert getattr(triton, op).__name__ == f"{op}_triton"
        assert getattr(torch_, op) is implementation(op, "torch")
    with pytest.raises(ConfigError, match="kernels.backend must be one of"):
        check_backend("cuda")


PROBE = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
if sys.argv[1] == "imported-first":
    import triton.language  # as loading a model can: Triton now runs compiled, not interpreted
from inkfw.errors import ConfigError
from inkfw.kernels import prepare_backend, resolve_backend
prepare_backend("triton", "cpu")
try:
    print(resolve_backend("triton", "cpu"))
except ConfigError as exc:
    print("error:", exc)
"""


@pytest.mark.parametrize("order", ["prepared-first", "imported-first"])
def test_triton_on_cpu_chooses_the_interpreter_before_triton_loads(order):
    """Triton fixes interpreted-or-compiled when it is imported: the factory's early
    prepare_backend chooses the interpreter; once Triton is loaded without it, one sentence."""
    out = subprocess.run([sys.executable, "-c", PROBE, order], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if order == "prepared-first":
        assert out.stdout.strip() == "triton"
    else:
        assert out.stdout.startswith("error: kernels.backend=triton on the CPU") and "TRITON_INTERPRET=1" in out.stdout


def test_bad_kernel_options_fail_in_one_sentence(model):
    with pytest.raises(ConfigError, match="kernels.backend must be one of"):
        make_engine(model, NO_DRAFTER, overrides=["kernels.backend=cuda"])
    with pytest.raises(ConfigError, match="torch.compile cannot"):
        make_engine(model, NO_DRAFTER, overrides=["kernels.backend=triton", "engine.compile=true"])


def test_torch_backend_keeps_the_modules(model):
    """On the torch backend the layers run their own modules: the KV manager hands them no kernels."""
    engine, kv = make_engine(model, NO_DRAFTER, overrides=["kernels.backend=torch"])
    assert kv.kernels is None and engine.verifier.kernels.backend == "torch"
