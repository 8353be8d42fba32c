"""Shared pieces of the engine tests: a tiny 4-depth Inkling, an engine runner, and a
verifier test double that accepts a random number of drafts."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from helpers.models import randomize_, tiny_config
from inkfw.cache.paged import PagedKVManager
from inkfw.models.inkling.config import MtpConfig
from inkfw.models.inkling.model import InklingLM
from inkfw.speculative.engine import Engine, EngineConfig, Request
from inkfw.speculative.interfaces import Drafts, Verdict
from inkfw.speculative.sampling import SamplingParams
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


def spec_config(**overrides):
    """4 layers (local 0 and 2, global 1 and 3), window 16, 4 MTP depths (local 0 and 2)."""
    base = dict(vocab_size=128, unpadded_vocab_size=120, sliding_window=WINDOW, rel_extent=32,
                local_layer_ids=[0, 2], max_position_embeddings=MAX_LEN,
                mtp=MtpConfig(num_nextn_predict_layers=4, chain_hidden_post_norm=True, local_layer_ids=[0, 2]))
    base.update(overrides)
    return tiny_config(**base)


def spec_model(seed: int = 0, **overrides) -> InklingLM:
    cfg = spec_config(**overrides)
    torch.manual_seed(seed)
    return randomize_(InklingLM(cfg, mtp_depths=cfg.mtp.num_nextn_predict_layers), seed=seed).eval()


def random_prompts(rng: random.Random, n: int, vocab: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_engine(model, drafter, *, verifier=None, prefix_caching: bool = True, num_blocks: int | None = None,
                max_num_batched_tokens: int = 512, max_num_seqs: int = 16, check_drafts: bool = True,
                max_model_len: int | None = None) -> tuple[Engine, PagedKVManager]:
    kv = PagedKVManager(model, num_draft_depths=drafter.num_depths, lookahead=drafter.lookahead,
                        num_draft_tokens=drafter.num_tokens, block_size=BLOCK, num_blocks=num_blocks,
                        enable_prefix_caching=prefix_caching, max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          check_drafts=check_drafts, max_model_len=max_model_len)
    return Engine(model, drafter, verifier or TargetVerifier(), kv, config=config), kv


def generate(model, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 12,
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             **engine_kw) -> tuple[list[Request], Engine, PagedKVManager]:
    """Run ``prompts`` to completion in one engine; every request must finish without an error
    and the KV pool must be whole afterwards."""
    eng, kv = make_engine(model, drafter, **engine_kw)
    news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    ps = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    reqs = [eng.add_request(p, sp, max_new_tokens=n) for p, sp, n in zip(prompts, ps, news)]
    eng.generate(reqs)
    assert all(r.finished and r.finish_reason in ("length", "stop") for r in reqs), [r.error for r in reqs]
    assert kv.is_whole(), kv.num_free_blocks()
    return reqs, eng, kv


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
    return ids[len(prompt):]


class RandomAcceptVerifier:
    """Verifier test double: runs the target exactly like :class:`TargetVerifier` (so the
    target cache holds [x[L-1], drafts]) but accepts a random a' in [0, num_drafts] and then
    emits the target's argmax or a random token.

    Randomness depends only on (seed, request id, verify step of that request), so a request's
    tokens do not depend on what else shares its batch. ``history`` records
    ``(request id, step, num_drafts, num_accepted, emitted tokens)`` per row, ``lengths`` the
    request's committed length at that verify step.
    """

    def __init__(self, seed: int = 0, p_argmax: float = 0.5, vocab: int | None = None):
        self.seed, self.p_argmax, self.vocab = seed, p_argmax, vocab
        self.inner = TargetVerifier()
        self.history: list[tuple[int, int, int, int, list[int]]] = []
        self.lengths: list[int] = []

    @torch.no_grad()
    def verify(self, model, kv, requests, drafts: Drafts) -> Verdict:
        verdict = self.inner.verify(model, kv, requests, drafts)
        argmax = model.logits(verdict.hidden).argmax(-1)  # [B, 1+k]
        vocab = self.vocab or model.cfg.logits_vocab_size
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
