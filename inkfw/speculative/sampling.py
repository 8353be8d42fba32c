"""Sampling: greedy, temperature, top-k and top-p, with seeded per-request generators.

Two steps, kept apart because speculative verification needs the middle product:

1. :func:`processed_probs` turns logits into the distribution a request samples from
   (temperature, then top-k, then top-p; greedy requests get a one-hot argmax). Rejection
   sampling compares exactly these probabilities, so target and draft must use it alike.
2. :func:`sample` draws one token per row from such probabilities.

Every random number the engine uses comes from here: the verifier asks
:meth:`Sampler.acceptance_draws` for the draws of rejection sampling, and the drafters sample
through :meth:`Sampler.sample`. Randomness comes from ``generators``, which is one of

* ``None``: torch's default generator for the device, drawn for the whole batch at once;
* one ``torch.Generator``: shared by the whole batch, drawn at once (tests, unseeded batches);
* a sequence of one ``torch.Generator | None`` per row: row b draws only from its own
  generator, so a request with a seed produces the same tokens whichever other requests
  share its batch (``None`` entries fall back to the default generator).

A categorical draw is an exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per
token: exact for any probabilities without a cumulative sum over the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inkfw.errors import ConfigError
from inkfw.options import is_number

Generators = torch.Generator | Sequence[torch.Generator | None] | None

_MAX_SEED = 2**64  # torch.Generator.manual_seed accepts 0 .. 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens.

    ``temperature`` 0 means greedy (argmax; top-k and top-p are then irrelevant). ``top_k``
    keeps the k most likely tokens (0 or None: off; tokens tied with the k-th are kept too).
    ``top_p`` keeps the smallest set of most likely tokens whose mass reaches top_p (1: off;
    tokens tied with the last one kept are kept too). ``seed`` makes the request's samples
    reproducible (None: drawn from torch's default generator).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field that is out of range."""
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not (is_number(t) and math.isfinite(t) and t >= 0):
            raise ConfigError(f"sampler: temperature must be a finite number >= 0 (0 = greedy), got {t!r}.")
        if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
            raise ConfigError(f"sampler: top_k must be an integer >= 0 (0 or null = off), got {k!r}.")
        if not (is_number(p) and 0 < p <= 1):
            raise ConfigError(f"sampler: top_p must lie in (0, 1] (1 = off), got {p!r}.")
        if s is not None and not (isinstance(s, int) and not isinstance(s, bool) and 0 <= s < _MAX_SEED):
            raise ConfigError(f"sampler: seed must be null or an integer in [0, 2**64), got {s!r}.")


def _per_row(params: SamplingParams | Sequence[SamplingParams], rows: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * rows
    params = list(params)
    if len(params) != rows:
        raise ValueError(f"got {len(params)} SamplingParams for {rows} rows")
    return params


def processed_probs(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from, float32, same shape as ``logits``.

    ``logits`` is [N, V] or [N, T, V] (e.g. a verify step's k + 1 positions); ``params`` is
    one :class:`SamplingParams` for every row or one per row N (shared over T). Order:
    divide by temperature, keep the top-k logits, softmax, keep the top-p mass, renormalise.
    Greedy rows are one-hot at the argmax (the first one on ties).
    """
    rows = _per_row(params, logits.shape[0])
    V = logits.shape[-1]
    device = logits.device
    bshape = (len(rows),) + (1,) * (logits.dim() - 1)  # broadcasts a per-row value over [..., V]

    x = logits.float()  # [N, ..., V]
    temperature = torch.tensor([1.0 if r.greedy else r.temperature for r in rows], device=device)
    x = x / temperature.view(bshape)

    top_k = [r.top_k if (r.top_k and r.top_k < V and not r.greedy) else 0 for r in rows]
    if any(top_k):
        k_max = max(top_k)
        k_idx = torch.tensor([max(k, 1) - 1 for k in top_k], device=device).view(bshape)
        top = x.topk(k_max, dim=-1).values  # [N, ..., k_max]
        kth = top.gather(-1, k_idx.expand(*top.shape[:-1], 1))  # [N, ..., 1]
        off = torch.tensor([k == 0 for k in top_k], device=device).view(bshape)
        kth = kth.masked_fill(off, -math.inf)
        x = x.masked_fill(x < kth, -math.inf)

    probs = x.softmax(dim=-1)  # [N, ..., V]

    top_p = [1.0 if r.greedy else r.top_p for r in rows]
    if any(p < 1 for p in top_p):
        p_t = torch.tensor(top_p, device=device).view(bshape)
        sorted_p = probs.sort(dim=-1, descending=True).values  # [N, ..., V]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # [N, ..., V], nondecreasing
        num_kept = (mass_before < p_t).sum(dim=-1, keepdim=True).clamp_min(1)  # [N, ..., 1]
        cutoff = sorted_p.gather(-1, num_kept - 1)  # [N, ..., 1] smallest probability kept
        cutoff = cutoff.masked_fill(p_t >= 1, 0.0)
        probs = probs.masked_fill(probs < cutoff, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)

    greedy = [i for i, r in enumerate(rows) if r.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=device)
        one_hot = torch.nn.functional.one_hot(logits[idx].argmax(dim=-1), V).to(probs.dtype)
        probs = probs.index_copy(0, idx, one_hot)
    return probs


# --------------------------------------------------------------------------- randomness
def uniform_draws(
    generators: Generators, counts: torch.Tensor | Sequence[int], width: int, device: torch.device | str
) -> torch.Tensor:
    """[N, width] float64 uniforms in [0, 1); row b needs ``counts[b]`` (<= width) of them.

    With per-row generators row b draws exactly ``counts[b]`` values from its own generator
    (the rest of its row is 1.0); otherwise the whole [N, width] block is drawn at once.
    """
    N = len(counts)
    if generators is None or isinstance(generators, torch.Generator):
        gen_device = device if generators is None else generators.device
        return torch.rand(N, width, generator=generators, device=gen_device, dtype=torch.float64).to(device)
    gens = _row_generators(generators, N)
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    out = torch.ones(N, width, dtype=torch.float64, device=device)
    for b, (g, n) in enumerate(zip(gens, counts)):
        if n:
            out[b, :n] = torch.rand(n, generator=g, device=device if g is None else g.device, dtype=torch.float64).to(
                device
            )
    return out


def exponential_draws(generators: Generators, rows: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    """[N, V] float32 i.i.d. Exp(1) noise, at least the smallest normal float (never 0)."""

    def draw(g: torch.Generator | None, n: int) -> torch.Tensor:
        on = device if g is None else g.device
        return torch.empty(n, vocab, device=on).exponential_(generator=g).to(device)

    if generators is None or isinstance(generators, torch.Generator):
        noise = draw(generators, rows)
    else:
        noise = torch.cat([draw(None, 0)] + [draw(g, 1) for g in _row_generators(generators, rows)])
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _row_generators(generators: Sequence[torch.Generator | None], rows: int) -> list[torch.Generator | None]:
    gens = list(generators)
    if len(gens) != rows:
        raise ValueError(f"got {len(gens)} generators for {rows} rows")
    return gens


def sample_with_noise(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: ``argmax(probs / noise)`` [N]; zero-probability tokens never win.

    ``probs`` [N, V] need not be normalised (only ratios matter) but must have positive mass.
    """
    return (probs.float() / noise).argmax(dim=-1)


def sample(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """One token per row [N] (long) from ``probs`` [N, V] (e.g. :func:`processed_probs`)."""
    return sample_with_noise(probs, exponential_draws(generators, probs.shape[0], probs.shape[-1], probs.device))


class Sampler:
    """Greedy / temperature / top-k / top-p sampling for a batch of requests.

    Each request owns one generator (from :meth:`generator`) for its whole life and passes
    it back on every call; greedy rows are decided by argmax and consume no randomness.

    ``temperature``, ``top_k``, ``top_p`` and ``seed`` are optional defaults (``inkfw/conf/sampler``)
    that :attr:`defaults` holds as validated :class:`SamplingParams` for requests that bring
    none of their own; they change nothing else the sampler does.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int | None = None,
    ):
        self.device = torch.device(device)
        self.defaults = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    def generator(self, params: SamplingParams) -> torch.Generator:
        """A fresh generator for one request: seeded by ``params.seed``, or, without a seed,
        by a value drawn from torch's default generator (so ``torch.manual_seed`` still
        reproduces whole runs)."""
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        return torch.Generator(device=self.device).manual_seed(seed)

    @staticmethod
    def probs(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
        """See :func:`processed_probs`."""
        return processed_probs(logits, params)

    @staticmethod
    def sample(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
        """See :func:`sample`."""
        return sample(probs, generators)

    @staticmethod
    def acceptance_draws(
        generators: Generators,
        num_drafts: torch.Tensor | Sequence[int],
        width: int,
        vocab: int,
        device: torch.device | str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The random numbers of one rejection-sampling step (docs/design.md §3), in the order
        they are drawn: ``uniforms`` [B, width] float64 (row b uses its first ``num_drafts[b]``,
        the only ones drawn from a per-row generator), then ``noise`` [B, vocab] float32 Exp(1)
        for the next token. See :func:`uniform_draws` and :func:`exponential_draws`."""
        uniforms = uniform_draws(generators, num_drafts, width, device)  # [B, width]
        noise = exponential_draws(generators, len(num_drafts), vocab, device)  # [B, V]
        return uniforms, noise

    def __call__(
        self, logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams], generators: Generators = None
    ) -> torch.Tensor:
        """Next token [N] (long) for ``logits`` [N, V]."""
        rows = _per_row(params, logits.shape[0])
        tokens = logits.argmax(dim=-1)  # [N]
        sampled = [i for i, r in enumerate(rows) if not r.greedy]
        if not sampled:
            return tokens
        if generators is not None and not isinstance(generators, torch.Generator):
            generators = [_row_generators(generators, len(rows))[i] for i in sampled]
        idx = torch.tensor(sampled, device=logits.device)
        probs = self.probs(logits[idx], [rows[i] for i in sampled])  # [n, V]
        return tokens.index_copy(0, idx, self.sample(probs, generators))
