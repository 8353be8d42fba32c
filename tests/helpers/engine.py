"""Shared pieces of the engine tests: a tiny 4-depth Inkling, an engine runner that builds every
engine through the serving factory, and test doubles selected through the config (a verifier
that accepts a random number of drafts, one that accepts every draft, an oracle drafter)."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Sequence

import pytest
import torch
from torch._dynamo.utils import counters

from helpers.models import randomize_, tiny_config
from inkfw.cache.paged import PagedKVManager
from inkfw.models.inkling.config import MtpConfig
from inkfw.models.inkling.model import InklingLM
from inkfw.speculative.drafters.mtp import MtpDrafter
from inkfw.speculative.engine import Engine, Request
from inkfw.speculative.factory import build_engine, serving_config
from inkfw.speculative.interfaces import Drafts, Verdict
from inkfw.speculative.observers import run_directly
from inkfw.speculative.reference import reference_draft_logits
from inkfw.speculative.sampling import Sampler, SamplingParams
from inkfw.speculative.step import StepFunction
from inkfw.speculative.verifier import TargetVerifier

WINDOW = 16  # target sliding window: prompts go up to 40 tokens, well past it
MAX_LEN = 128  # max_position_embeddings of the test models (keeps default pools small)
BLOCK = 4


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared machine: one intra-op thread is much faster than contended ones.
    Test modules import this fixture to make it autouse there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SPEC_VOCAB = 120  # logits vocabulary of spec_model() (token ids 0 .. SPEC_VOCAB - 1)


def spec_config(**overrides):
    """4 layers (local 0 and 2, global 1 and 3), window 16, 4 MTP depths (local 0 and 2)."""
    base = dict(
        vocab_size=128,
        unpadded_vocab_size=SPEC_VOCAB,
        sliding_window=WINDOW,
        rel_extent=32,
        local_layer_ids=[0, 2],
        max_position_embeddings=MAX_LEN,
        mtp=MtpConfig(num_nextn_predict_layers=4, chain_hidden_post_norm=True, local_layer_ids=[0, 2]),
    )
    base.update(overrides)
    return tiny_config(**base)


def spec_model(seed: int = 0, **overrides) -> InklingLM:
    cfg = spec_config(**overrides)
    torch.manual_seed(seed)
    return randomize_(InklingLM(cfg, mtp_depths=cfg.mtp.num_nextn_predict_layers), seed=seed).eval()


def random_prompts(rng: random.Random, n: int, vocab: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ----------------------------------------------------------------------------- components by config
NO_DRAFTER = ["drafter=none"]


def mtp(depths: int, num_tokens: int | str) -> list[str]:
    """Overrides for multi-depth MTP drafting: D = ``depths``, k = ``num_tokens`` (or "auto")."""
    return ["drafter=mtp", f"mtp.depths={depths}", f"spec.num_tokens={num_tokens}"]


AUTO = mtp(2, "auto")  # adaptive k, k_max = D = 2


def ngram(num_tokens: int) -> list[str]:
    return ["drafter=ngram", f"spec.num_tokens={num_tokens}"]


def double(group: str, cls: type, **options) -> list[str]:
    """Overrides that make ``group`` (drafter or verifier) build the test double ``cls`` of this
    module, with ``options`` as extra arguments of its node."""
    base = ["drafter=none"] if group == "drafter" else []
    return [*base, f"{group}._target_={__name__}.{cls.__name__}", *(f"+{group}.{k}={v}" for k, v in options.items())]


def random_accept(seed: int = 0, p_argmax: float = 0.5) -> list[str]:
    """Overrides selecting :class:`RandomAcceptVerifier`."""
    return double("verifier", RandomAcceptVerifier, seed=seed, p_argmax=p_argmax)


def _value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def make_engine(
    model,
    drafter: Sequence[str],
    *,
    verifier: Sequence[str] = (),
    prefix_caching: bool = True,
    num_blocks: int | None = None,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    check_drafts: bool = True,
    max_model_len: int | None = None,
    overrides: Sequence[str] = (),
) -> tuple[Engine, PagedKVManager]:
    """An engine around ``model`` from :func:`build_engine`; ``drafter`` and ``verifier`` are config
    overrides (:func:`mtp`, :data:`NO_DRAFTER`, :func:`ngram`, :func:`random_accept`, :func:`double`)."""
    cfg = serving_config(
        [
            "model=inkling-debug",  # the model is given; this node names no checkpoint, so no tokenizer is read
            *drafter,
            *verifier,
            f"kv.block_size={BLOCK}",
            f"kv.num_blocks={_value(num_blocks)}",
            f"kv.enable_prefix_caching={_value(prefix_caching)}",
            f"engine.max_num_seqs={max_num_seqs}",
            f"engine.max_num_batched_tokens={max_num_batched_tokens}",
            f"engine.check_drafts={_value(check_drafts)}",
            f"engine.max_model_len={_value(max_model_len)}",
            *overrides,
        ]
    )
    engine, _ = build_engine(cfg, model=model)
    assert isinstance(engine.kv, PagedKVManager)
    return engine, engine.kv


def generate(
    model,
    drafter: Sequence[str],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] = 12,
    params: SamplingParams | Sequence[SamplingParams | None] | None = None,
    **engine_kw,
) -> tuple[list[Request], Engine, PagedKVManager]:
    """Run ``prompts`` to completion in one new engine (:func:`run_to_completion`)."""
    eng, kv = make_engine(model, drafter, **engine_kw)
    return run_to_completion(eng, prompts, max_new_tokens, params), eng, kv


def run_to_completion(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int] = 12,
    params: SamplingParams | Sequence[SamplingParams | None] | None = None,
) -> list[Request]:
    """Run ``prompts`` to completion in ``engine``; every request must finish without an error
    and the KV pool must be whole afterwards."""
    news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    ps = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    reqs = [engine.add_request(p, sp, max_new_tokens=n) for p, sp, n in zip(prompts, ps, news)]
    engine.generate(reqs)
    assert all(r.finished and r.finish_reason in ("length", "stop") for r in reqs), [r.error for r in reqs]
    assert engine.kv.is_whole(), engine.kv.num_free_blocks()
    return reqs


def outputs(reqs: Sequence[Request]) -> list[list[int]]:
    return [r.output_token_ids for r in reqs]


@torch.no_grad()
def uncached_greedy(model: InklingLM, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy autoregressive decoding with whole-sequence forwards (no cache), stopping at EOS."""
    ids = list(prompt)
    eos = set(model.cfg.eos_token_ids)
    for _ in range(max_new_tokens):
        t = int(model.logits(model(torch.tensor([ids]))[0, -1]).argmax())
        ids.append(t)
        if t in eos:
            break
    return ids[len(prompt) :]


class RandomAcceptVerifier(TargetVerifier):
    """Verifier test double: runs the target exactly like :class:`TargetVerifier` (so the
    target cache holds [x[L-1], drafts], and sampled rows consume their draws) but then accepts
    a random a' in [0, num_drafts] and emits the target's argmax or a random token.

    Randomness depends only on (seed, request id, verify step of that request), so a request's
    tokens do not depend on what else shares its batch. ``history`` records
    ``(request id, step, num_drafts, num_accepted, emitted tokens)`` per row, ``lengths`` the
    request's committed length at that verify step.
    """

    def __init__(self, model, sampler=None, seed: int = 0, p_argmax: float = 0.5, vocab: int | None = None):
        super().__init__(model, sampler)
        self.seed, self.p_argmax, self.vocab = seed, p_argmax, vocab
        self.history: list[tuple[int, int, int, int, list[int]]] = []
        self.lengths: list[int] = []

    @torch.no_grad()
    def verify(self, kv, requests, drafts: Drafts, run=run_directly, pad_to=None) -> Verdict:
        verdict = super().verify(kv, requests, drafts, run, pad_to)
        argmax = self.model.logits(verdict.hidden).argmax(-1)  # [B, 1+k]
        vocab = self.vocab or self.model.cfg.logits_vocab_size
        accepted, nexts = [], []
        for b, r in enumerate(requests):
            rng = random.Random(f"{self.seed}/{r.id}/{r.num_verify_steps}")
            n = int(drafts.num_drafts[b])
            a = rng.randint(0, n)
            t = int(argmax[b, a]) if rng.random() < self.p_argmax else rng.randrange(vocab)
            accepted.append(a)
            nexts.append(t)
            self.history.append((r.id, r.num_verify_steps, n, a, drafts.tokens[b, :a].tolist() + [t]))
            self.lengths.append(len(r.token_ids))
        device = drafts.tokens.device
        return Verdict(torch.tensor(accepted, device=device), torch.tensor(nexts, device=device), verdict.hidden)


class AcceptAllVerifier(TargetVerifier):
    """Lossy verifier test double: accepts every draft, then samples the bonus token from the
    target's processed distribution after the last one (through the sampler, with each
    request's generator). Its output follows the drafter's distribution, not the target's."""

    def accept(self, logits, requests, drafts: Drafts):
        num = drafts.num_drafts.long()  # [B]
        p = self.sampler.probs(logits, [r.sampling for r in requests])  # [B, 1+k, V]
        rows = torch.arange(len(requests), device=p.device)
        return num, self.sampler.sample(p[rows, num], [r.generator for r in requests])


class OracleDrafter:
    """Drafter test double: proposes the target's own greedy continuation (computed without a
    cache, up to ``horizon`` tokens after the prompt), each draft corrupted with probability 1/4
    (seeded), so real greedy verification accepts long and varied prefixes."""

    lookahead = 0
    num_depths = 0
    needs_hidden = False

    def __init__(self, model, num_tokens: int, seed: int = 0, horizon: int = 16):
        self.model, self.num_tokens, self.horizon = model, num_tokens, horizon
        self.rng = random.Random(seed)
        self.continuations: dict[tuple[int, ...], list[int]] = {}

    def continuation(self, prompt: Sequence[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.continuations:
            self.continuations[key] = list(prompt) + uncached_greedy(self.model, prompt, self.horizon)
        return self.continuations[key]

    def propose(self, spans, kv, run=run_directly, keep_logits: bool = False, pad_to=None, num_tokens=None) -> Drafts:
        vocab = self.model.cfg.logits_vocab_size
        tokens = torch.zeros(len(spans), self.num_tokens, dtype=torch.long)
        num = torch.zeros(len(spans), dtype=torch.long)
        for b, span in enumerate(spans):
            r = span.request
            full = self.continuation(r.prompt_token_ids)
            L, n = len(r.token_ids), min(self.num_tokens, span.num_drafts)
            assert r.token_ids == full[:L]  # greedy verification never lets a wrong token through
            true = (full[L : L + n] + [0] * n)[:n]
            drafts = [t if self.rng.random() < 0.75 else (t + 1) % vocab for t in true]
            tokens[b, :n] = torch.tensor(drafts, dtype=torch.long)
            num[b] = n
        return Drafts(tokens, num)

    def release(self, rid) -> None:
        pass

    def stale_from(self, rid) -> None:
        return None  # no cache


class FixedTokenSampler(Sampler):
    """Sampler test double: every sampling request's processed distribution is one-hot at
    ``token`` (greedy rows keep their argmax). Drafts and verification that really go through
    the sampler then emit nothing but ``token``."""

    def __init__(self, device="cpu", token: int = 7, **defaults):
        super().__init__(device, **defaults)
        self.token = token

    def probs(self, logits, params):
        probs = super().probs(logits, params)
        rows = [params] * logits.shape[0] if isinstance(params, SamplingParams) else list(params)
        sampled = torch.tensor([not r.greedy for r in rows], device=logits.device)
        fixed = torch.nn.functional.one_hot(
            torch.full(logits.shape[:-1], self.token, device=logits.device), logits.shape[-1]
        ).to(probs.dtype)
        return torch.where(sampled.view(-1, *[1] * (logits.dim() - 1)), fixed, probs)


def slow_first_calls(monkeypatch, seconds: float) -> None:
    """Make every step function's first call of a shape take ``seconds`` more and count them as
    its compile / capture time (``warmup_s``), as ``engine.compile`` or CUDA graphs would."""
    first_call = StepFunction._call

    def compiling(self, args):
        key = self._key(args)
        if key not in self._seen:
            self._seen.add(key)
            time.sleep(seconds)
            self.warmup_s += seconds
        return first_call(self, args)

    monkeypatch.setattr(StepFunction, "_call", compiling)


# ----------------------------------------------------------------------------- compiled engines, drafts
def parts(engine: Engine) -> tuple[TargetVerifier, MtpDrafter]:
    """The engine's verifier and MTP drafter, typed (their step buffers and step functions)."""
    verifier, drafter = engine.verifier, engine.drafter
    assert isinstance(verifier, TargetVerifier) and isinstance(drafter, MtpDrafter)
    return verifier, drafter


@contextlib.contextmanager
def counted_compiles():
    """One torch thread, dynamo reset and its counters cleared: the graphs and breaks counted
    inside are the block's own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def record_proposals(drafter: MtpDrafter) -> list[tuple[list[int], list[int], bool]]:
    """Wraps ``drafter.propose``: per row of every round, (committed tokens, drafts, whether the
    round was static), appended to the list returned."""
    proposals = []
    propose = drafter.propose

    def recorded(spans, *args, **kwargs):
        out = propose(spans, *args, **kwargs)
        assert out.counts is not None
        for b, span in enumerate(spans):
            drafts = out.tokens[b, : out.counts[b]].tolist()
            proposals.append((list(span.request.token_ids), drafts, kwargs.get("pad_to") is not None))
        return out

    drafter.propose = recorded  # type: ignore[method-assign]
    return proposals


def assert_drafts_are_the_reference(model, proposals, drafter: MtpDrafter) -> None:
    """Every recorded draft (:func:`record_proposals`) equals the uncached reference's argmax."""
    for committed, drafts, _ in proposals:
        if drafts:
            reference = reference_draft_logits(
                model, torch.tensor(committed), torch.tensor(drafts), drafter.lookahead, drafter.num_depths
            )
            assert reference.argmax(-1).tolist() == drafts
