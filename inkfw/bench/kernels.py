"""Kernel timings: every fused op's Triton kernel against its plain-torch reference, and the target's
verify forward with both backends (``kernel_timings: true``; the GPU check's ``bench_gpu.yaml``).

Inputs are shaped like the served model: its heads, head dims, ``d_rel``, relative-bias extents,
sliding window, hidden size, vocabulary, conv kernel and MTP depth count, the KV block size, and a
verify span of T = k + 1 positions (``span``, 9: k = 8 drafts). At each batch size and context
(tokens already cached per request):

* ``paged_span_attention[global]`` / ``[sliding]``: one layer of each attention kind present, T
  queries at positions ``context .. context + T - 1`` over a pool holding every earlier position in
  shuffled blocks (the sliding layer's table starts at its window, as the engine builds it);
* ``cached_short_conv[k,v]`` (the two attention streams in one launch) and ``[hidden]`` (the
  ``attn_sconv`` / ``mlp_sconv`` streams);
* ``greedy_accept``, ``rejection_sample`` (k drafts, the model's vocabulary),
  ``prepare_draft_spans`` (P - 1 = min(D, k) - 1 tail rows, ragged acceptance) and
  ``mtp_depth_input`` (a span of T positions), which read nothing by context: timed once per batch
  size (``context`` None);
* ``verify_forward``: the target's forward over ``[x[L-1], d_1 .. d_k]`` with logits, through a
  :class:`~inkfw.cache.paged.PagedKVManager` of each backend (``kernels.backend`` torch and
  triton) holding ``context`` tokens per request, prefilled through the model in chunks of
  :data:`PREFILL_CHUNK` tokens per request (each cache on its own backend; with
  ``prefill_each=False`` the Triton cache is a copy of the torch one's, for the interpreter); the
  views come from ``kv.caches_from(kv.step_tables(...), positions, valid)`` as in the verifier.

Each implementation is called ``warmup`` times (Triton compiles on its first call), then ``repeats``
times, on its own copy of the inputs it writes; a row reports the median milliseconds per call (CUDA events
around each call on a GPU, ``time.perf_counter`` elsewhere; on the CPU the Triton side runs in
Triton's interpreter and its times mean nothing), ``speedup`` = torch / triton, and whether the two
agree: for the ops, the first timed call's outputs and every tensor the op writes in place
(integers exactly, floats within :data:`TOLERANCE` of the inputs' dtype; ``max_abs_diff`` is the
largest float difference), and for ``verify_forward`` the greedy check, the logits' argmax at every
position (``max_abs_diff``: of the logits). Measuring only: the engine's kernels are not changed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inkfw.bench.plan import positive_ints
from inkfw.cache.interface import EMPTY_POSITION
from inkfw.errors import ConfigError
from inkfw.kernels import Kernels, implementation, resolve_backend
from inkfw.options import bool_option
from inkfw.profiling import timed_calls

SPAN = 9  # verify span T = k + 1 with k = 8 drafts (the shipped checkpoint's D)
# tokens per request per prefill forward: 8,192 cached tokens take 32 eager forwards (~45 ms each
# on the H200 host) per backend and batch size, where 32-token chunks took 256
PREFILL_CHUNK = 256
# float outputs agree within rtol = atol = this, by the inputs' dtype
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}


# ------------------------------------------------------------------------ options
@dataclass
class KernelBenchOptions:
    """The benchmark's kernel options (``inkfw/conf/bench.yaml``), validated."""

    enabled: bool
    batch_sizes: list[int]
    contexts: list[int]


def kernel_bench_options(cfg: Any, device: torch.device) -> KernelBenchOptions:
    """``kernel_timings``, ``kernel_batch_sizes`` and ``kernel_contexts`` of ``cfg``; a bad one
    raises :class:`ConfigError` (one sentence). When enabled on a CPU, this chooses Triton's
    interpreter before any kernel module is imported."""
    enabled = bool_option(cfg.get("kernel_timings", False), "kernel_timings")
    opts = KernelBenchOptions(
        enabled,
        positive_ints(cfg.get("kernel_batch_sizes", [1]), "kernel_batch_sizes"),
        positive_ints(cfg.get("kernel_contexts", [512]), "kernel_contexts"),
    )
    if enabled:
        resolve_backend("triton", device)
    return opts


# ------------------------------------------------------------------------ timing and comparison
def timed(fn: Callable[[], Any], repeats: int, warmup: int, device: torch.device) -> tuple[float, Any]:
    """(median milliseconds of one ``fn()`` call, what the first timed call returned): see
    :func:`inkfw.profiling.timed_calls`."""
    seconds, first = timed_calls(fn, repeats, warmup, device)
    return 1e3 * seconds, first


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x`` (a tensor, or nested tuples / lists of them), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def _cloned(x: Any) -> Any:
    """``x`` with every tensor cloned (tuples and lists rebuilt), other values shared."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_cloned(item) for item in x)
    return x


def compare(expected: Any, actual: Any) -> tuple[bool, float]:
    """(agree, max_abs_diff) of two results (tensors or nested tuples / lists of them): integer and
    bool tensors must be equal, float tensors within :data:`TOLERANCE` of their dtype."""
    pairs = list(zip(_tensors(expected), _tensors(actual), strict=True))
    agree, worst = True, 0.0
    for a, b in pairs:
        if a.shape != b.shape:
            return False, math.inf
        if a.is_floating_point():
            tol = TOLERANCE.get(a.dtype, TOLERANCE[torch.float32])
            a32, b32 = a.float(), b.float()
            worst = max(worst, (a32 - b32).abs().max().item() if a.numel() else 0.0)
            agree = agree and torch.allclose(a32, b32, rtol=tol, atol=tol)
        else:
            agree = agree and torch.equal(a, b)
    return agree, worst


# ------------------------------------------------------------------------ op cases
@dataclass
class OpCase:
    """One op at one batch size (and context): ``args`` / ``kwargs`` for both implementations;
    ``writes`` names the positional arguments the op writes in place (compared too)."""

    name: str  # row label, e.g. "paged_span_attention[global]"
    op: str  # key of inkfw.kernels.OPS
    shape: str
    batch: int
    context: int | None
    args: tuple
    kwargs: dict[str, Any]
    writes: tuple[int, ...] = ()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Inputs:
    """Seeded random inputs, made on the CPU and moved to ``device`` (the same on every machine)."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype):
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.dtype = device, dtype

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen).to(self.device, dtype or self.dtype)

    def randint(self, high: int, *shape: int, low: int = 0) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen).to(self.device)

    def rand(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, dtype=dtype).to(self.device)

    def paged(self, batch: int, first: int, end: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(table [B, W], slot_pos [(B * W + 1) * bs]) of ``batch`` rows whose logical blocks
        ``first // bs .. (end - 1) // bs`` sit in shuffled physical blocks (one spare block: the
        scratch), with positions ``first_block * bs .. end - 1`` tagged; and the first block."""
        lo, hi = first // block_size, _cdiv(end, block_size)
        W = hi - lo
        table = torch.randperm(batch * W, generator=self.gen).view(batch, W)  # [B, W]
        slot_pos = torch.full(((batch * W + 1) * block_size,), EMPTY_POSITION, dtype=torch.long)
        positions = torch.arange(lo * block_size, end)  # [N]
        slots = table[:, positions // block_size - lo] * block_size + positions % block_size  # [B, N]
        slot_pos[slots.reshape(-1)] = positions.repeat(batch)
        return table.to(self.device), slot_pos.to(self.device), lo


def _attention_layers(model) -> dict[str, Any]:
    """The first attention module of each kind present: ``{"global": attn, "sliding": attn}``."""
    found: dict[str, Any] = {}
    for layer in model.backbone.layers:
        found.setdefault("global" if layer.attn.window is None else "sliding", layer.attn)
    return found


def attention_case(inputs: _Inputs, kind: str, attn, batch: int, context: int, span: int, block_size: int) -> OpCase:
    """One attention layer's verify span over ``context`` cached positions per request."""
    Hq, Hkv, D, d_rel = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.d_rel
    end = context + span
    first = 0 if attn.window is None else max(0, context - attn.window + 1)  # what the span's queries read
    table, slot_pos, lo = inputs.paged(batch, first, end, block_size)
    num_slots = slot_pos.shape[0]
    q_positions = (context + torch.arange(span, device=inputs.device)).expand(batch, span)  # [B, T]
    tau = None
    if attn.log_scaling_n_floor is not None:  # as AttentionTerms.tau: [B, T] fp32
        ratio = ((q_positions + 1).float() / attn.log_scaling_n_floor).clamp(min=1.0)
        tau = 1.0 + attn.log_scaling_alpha * torch.log(ratio)
    rel_table = attn.rel_bias.table.detach()  # [d_rel, E]
    args = (
        inputs.randn(batch, span, Hq, D),  # q
        inputs.randn(num_slots, Hkv, D),  # k_pool
        inputs.randn(num_slots, Hkv, D),  # v_pool
        slot_pos,
        table,
        torch.full((batch,), lo, dtype=torch.long, device=inputs.device),  # base
        q_positions,
        inputs.randn(batch, span, Hq, d_rel),  # r
        rel_table,
    )
    kwargs = dict(block_size=block_size, window=attn.window, tau=tau, scale=1.0 / D)
    shape = f"T={span} Hq={Hq} Hkv={Hkv} D={D} E={rel_table.shape[1]}" + (
        f" window={attn.window}" if attn.window is not None else ""
    )
    return OpCase(f"paged_span_attention[{kind}]", "paged_span_attention", shape, batch, context, args, kwargs)


def conv_case(
    inputs: _Inputs, name: str, weights: Sequence[torch.Tensor], batch: int, context: int, span: int, block_size: int
) -> OpCase:
    """The span's cached short convs of ``weights`` (each [C, 1, K], one launch) over a conv pool
    holding the K - 1 positions before ``context``."""
    C, K = weights[0].shape[0], weights[0].shape[-1]
    S = len(weights)
    end = context + span
    table, slot_pos, lo = inputs.paged(batch, max(0, context - K + 1), end, block_size)
    positions = (context + torch.arange(span, device=inputs.device)).expand(batch, span)  # [B, T]
    args = (
        inputs.randn(S, batch, span, C),  # x
        torch.stack([w.detach()[:, 0, :] for w in weights]),  # [S, C, K], as PagedLayerCache.short_convs
        [inputs.randn(slot_pos.shape[0], C) for _ in range(S)],  # store, written in place
        slot_pos,
        table,
        torch.full((batch,), lo, dtype=torch.long, device=inputs.device),
        positions,
        torch.ones(batch, span, dtype=torch.bool, device=inputs.device),
    )
    shape = f"S={S} T={span} C={C} K={K}"
    return OpCase(name, "cached_short_conv", shape, batch, context, args, {"block_size": block_size}, (2,))


def acceptance_cases(inputs: _Inputs, batch: int, span: int, vocab: int) -> list[OpCase]:
    """Greedy acceptance and rejection sampling of k = span - 1 drafts over ``vocab`` tokens; the
    drafts match the target's argmax for a random number of leading positions."""
    k = span - 1
    logits = inputs.randn(batch, span, vocab) * 3  # [B, k+1, V], the model's dtype
    agreeing = inputs.randint(k + 1, batch, 1)  # [B, 1]: leading drafts equal to the argmax
    drafts = torch.where(
        torch.arange(k, device=inputs.device) < agreeing, logits[:, :k].argmax(-1), inputs.randint(vocab, batch, k)
    )  # [B, k]
    num_drafts = torch.full((batch,), k, dtype=torch.long, device=inputs.device)
    shape = f"k={k} V={vocab}"
    draft_probs = torch.softmax(inputs.randn(batch, k, vocab, dtype=torch.float32) * 3, dim=-1)  # [B, k, V]
    sample_args = (
        drafts,
        draft_probs,
        torch.softmax(logits.float(), dim=-1),  # target probs [B, k+1, V]
        inputs.rand(batch, k, dtype=torch.float64),  # uniforms
        -torch.log(inputs.rand(batch, vocab, dtype=torch.float32).clamp(min=1e-12)),  # Exp(1) noise [B, V]
        num_drafts,
    )
    return [
        OpCase("greedy_accept", "greedy_accept", shape, batch, None, (drafts, logits, num_drafts), {"check": False}),
        OpCase("rejection_sample", "rejection_sample", shape, batch, None, sample_args, {"check": False}),
    ]


def draft_cases(inputs: _Inputs, model, batch: int, context: int, span: int) -> list[OpCase]:
    """Re-prefill span preparation and the first MTP depth's fused input over a span of ``span``
    positions (none without MTP depths)."""
    depths = model.num_mtp_depths
    if depths == 0:
        return []
    k, H = span - 1, model.cfg.hidden_size
    P = min(depths, k)  # prefill steps (docs/design.md §2)
    accepted = inputs.randint(k + 1, batch)  # [B]: drafts accepted by the last verify step
    takes = (P - 1 - accepted).clamp(min=0)  # re-prefilled positions r
    lengths = takes + accepted + 1  # r + the committed positions
    span_args = (
        inputs.randn(batch + 1, P - 1, H),  # tail [slots + 1, P-1, H], written in place
        inputs.randn(batch, span, H),  # the verify step's hidden states [B, k+1, H]
        torch.arange(batch, device=inputs.device),  # slots
        context - takes,  # starts
        takes,
        lengths,
    )
    depth = model.mtp.depths[0]
    embed_norm = model.backbone.embed_norm
    backbone_norm = embed_norm.weight if embed_norm is not None and model.embed_source == "backbone_norm" else None
    depth_args = (
        inputs.randint(model.cfg.logits_vocab_size, batch, span),  # token ids [B, T]
        model.backbone.embed.weight.detach(),
        backbone_norm.detach() if backbone_norm is not None else None,
        inputs.randn(batch, span, H),  # g [B, T, H]
        depth.hidden_norm.weight.detach(),
        depth.embed_norm.weight.detach(),
    )
    vocab = model.backbone.embed.weight.shape[0]
    return [
        OpCase(
            "prepare_draft_spans",
            "prepare_draft_spans",
            f"P-1={P - 1} width={span} H={H}",
            batch,
            None,
            span_args,
            {"width": span},
            (0,),
        ),
        OpCase(
            "mtp_depth_input",
            "mtp_depth_input",
            f"T={span} H={H} V={vocab}",
            batch,
            None,
            depth_args,
            {"eps": depth.hidden_norm.eps},
        ),
    ]


def op_cases(
    model, batch: int, contexts: Sequence[int], span: int, block_size: int, device: torch.device, seed: int = 0
) -> list[OpCase]:
    """Every op's inputs at batch size ``batch``: the cache readers at each context, the others once."""
    dtype = next(model.parameters()).dtype
    inputs = _Inputs(seed, device, dtype)
    cases: list[OpCase] = []
    first_layer = model.backbone.layers[0]
    for context in contexts:
        for kind, attn in _attention_layers(model).items():
            cases.append(attention_case(inputs, kind, attn, batch, context, span, block_size))
        attn = first_layer.attn
        streams = {
            "cached_short_conv[k,v]": (attn.k_sconv.weight, attn.v_sconv.weight),
            "cached_short_conv[hidden]": (first_layer.attn_sconv.weight,),
        }
        for name, weights in streams.items():
            cases.append(conv_case(inputs, name, weights, batch, context, span, block_size))
    cases += acceptance_cases(inputs, batch, span, model.cfg.logits_vocab_size)
    cases += draft_cases(inputs, model, batch, contexts[0], span)
    return cases


def time_case(case: OpCase, repeats: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """One row: both implementations of ``case``, each on its own copy of the inputs it writes,
    make the same calls; they agree when the first timed call's outputs and the tensors the op wrote in
    place (after every call) agree."""
    times, results = {}, {}
    for backend in ("torch", "triton"):
        fn = implementation(case.op, backend)
        args = [_cloned(a) if i in case.writes else a for i, a in enumerate(case.args)]
        times[backend], out = timed(functools.partial(fn, *args, **case.kwargs), repeats, warmup, device)
        results[backend] = (out, [args[i] for i in case.writes])
    agree, diff = compare(results["torch"], results["triton"])
    return _row(case.name, case.shape, case.batch, case.context, times, agree, diff)


def _row(
    op: str, shape: str, batch: int, context: int | None, times: dict[str, float], agree: bool, diff: float
) -> dict[str, Any]:
    torch_ms, triton_ms = times["torch"], times["triton"]
    return {
        "op": op,
        "shape": shape,
        "batch": batch,
        "context": context,
        "torch_ms": torch_ms,
        "triton_ms": triton_ms,
        "speedup": torch_ms / triton_ms if triton_ms > 0 else None,
        "agree": bool(agree),
        "max_abs_diff": diff,
    }


# ------------------------------------------------------------------------ the verify forward
class VerifyForward:
    """The target's verify forward (with logits) of ``tokens`` [B, context + span] at positions
    ``context .. context + span - 1``, over a new :class:`~inkfw.cache.paged.PagedKVManager` of
    ``backend`` (``kernels.backend``) that holds positions ``0 .. context - 1`` of every row.

    :meth:`prefill` runs the model over them ``chunk`` tokens per row at a time (windowed groups
    trimmed after each chunk, as the engine does); :meth:`copy_prefill` instead replays the same
    allocations and copies another manager's pools (the same layout whatever the backend). Then
    calling the object runs the forward, with the views built by
    ``kv.caches_from(kv.step_tables(...), positions, valid)`` as in the verifier; it rewrites the
    same positions, so it may be called any number of times."""

    def __init__(self, model, backend: str, tokens: torch.Tensor, context: int, span: int, block_size: int, chunk: int):
        from inkfw.cache.paged import PagedKVManager

        self.model, self.tokens, self.context, self.span, self.chunk = model, tokens, context, span, chunk
        self.device, B = tokens.device, tokens.shape[0]
        self.kv = PagedKVManager(
            model,
            block_size=block_size,
            enable_prefix_caching=False,
            max_model_len=context + span,
            max_num_seqs=B,
            max_num_batched_tokens=B * max(chunk, span),
            num_draft_tokens=span - 1,
            kernels=Kernels(backend, self.device),
        )
        self.rids = list(range(B))
        for rid in self.rids:
            self.kv.add(rid, tokens[rid].tolist())
        self._forward: Callable[[], torch.Tensor] | None = None

    def _chunks(self) -> list[tuple[int, int]]:
        return [(first, min(self.context, first + self.chunk)) for first in range(0, self.context, self.chunk)]

    def _span(self, first: int, end: int, width: Callable[[int], int] = lambda n: n) -> Callable[[], torch.Tensor]:
        """Blocks for positions < ``end``, and the forward of positions ``first .. end - 1``."""
        kv, B = self.kv, len(self.rids)
        for rid in self.rids:
            if not kv.ensure(rid, target_end=end, draft_end=0):
                raise RuntimeError(f"kernel timings: the KV pools hold no block for position {end - 1}.")
        positions = torch.arange(first, end, device=self.device).expand(B, -1)  # [B, end - first]
        valid = torch.ones_like(positions, dtype=torch.bool)
        tables = kv.step_tables(kv.group_indices(), self.rids, [first] * B, [end] * B, width=width)  # host, once
        ids = self.tokens[:, first:end]
        return lambda: self.model.logits(self.model(ids, positions, kv.caches_from(tables, positions, valid)))

    def _trim(self, end: int) -> None:
        for rid in self.rids:
            self.kv.trim(rid, end)  # windowed groups free what no later query reads

    def prefill(self) -> VerifyForward:
        with torch.no_grad():
            for first, end in self._chunks():
                self._span(first, end)()
                self._trim(end)
        return self

    def copy_prefill(self, other: VerifyForward) -> VerifyForward:
        for first, end in self._chunks():
            self._span(first, end)  # the same allocations, no forward
            self._trim(end)
        for mine, theirs in zip(self.kv.groups, other.kv.groups, strict=True):
            mine.slot_pos.copy_(theirs.slot_pos)
            for my_layer, their_layer in zip(mine.layers, theirs.layers, strict=True):
                for a, b in zip(my_layer, their_layer, strict=True):
                    a.copy_(b)
        return self

    def __call__(self) -> torch.Tensor:
        """Logits [B, span, V] of the verify span."""
        from inkfw.speculative.step import table_width

        if self._forward is None:
            self._forward = self._span(self.context, self.context + self.span, width=table_width)  # padded width
        return self._forward()


def verify_row(
    model,
    batch: int,
    context: int,
    span: int,
    block_size: int,
    repeats: int,
    warmup: int,
    seed: int = 0,
    prefill_each: bool = True,
    chunk: int = PREFILL_CHUNK,
) -> dict[str, Any]:
    """The ``verify_forward`` row: both backends on the same random tokens; they agree when the
    logits' argmax is the same at every position (the greedy check). ``prefill_each``: each
    backend's cache is prefilled through the model on that backend; False: the torch cache is
    prefilled and copied into the Triton one (faster in Triton's interpreter)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, model.cfg.logits_vocab_size, (batch, context + span), generator=gen).to(device)
    reference = VerifyForward(model, "torch", tokens, context, span, block_size, chunk).prefill()
    fused = VerifyForward(model, "triton", tokens, context, span, block_size, chunk)
    fused = fused.prefill() if prefill_each else fused.copy_prefill(reference)
    times, logits = {}, {}
    for backend, forward in (("torch", reference), ("triton", fused)):
        times[backend], logits[backend] = timed(forward, repeats, warmup, device)  # [B, T, V]
    agree = torch.equal(logits["torch"].argmax(-1), logits["triton"].argmax(-1))
    diff = (logits["torch"].float() - logits["triton"].float()).abs().max().item()
    shape = f"T={span} {model.cfg.num_layers} layers"
    return _row("verify_forward", shape, batch, context, times, agree, diff)


# ------------------------------------------------------------------------ the whole set
def kernel_timings(
    model,
    device: torch.device | str,
    batch_sizes: Sequence[int],
    contexts: Sequence[int],
    repeats: int,
    *,
    block_size: int = 16,
    span: int = SPAN,
    warmup: int = 2,
    end_to_end: bool = True,
    prefill_each: bool = True,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows ``{op, shape, batch, context, torch_ms, triton_ms, speedup, agree, max_abs_diff}`` for
    every op of :data:`inkfw.kernels.OPS` (see the module docstring) at each batch size (the cache
    readers at each context, the others with ``context`` None), then ``verify_forward`` at each
    batch size and context (``end_to_end``; ``prefill_each``: see :func:`verify_row`).
    ``progress(line)`` hears of each row. Runs on ``model``'s device, which must be of
    ``device``'s type; on a CPU the Triton side runs in Triton's interpreter (slow)."""
    on: torch.device = next(model.parameters()).device  # cuda:N where "cuda" is asked for
    if on.type != torch.device(device).type:
        raise ConfigError(f"kernel timings: the model is on {on}, not on {device}.")
    if not 2 <= span <= 32:
        raise ConfigError(f"kernel timings: the span must hold 2 to 32 positions (k + 1), got {span}.")
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"kernel timings: repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}.")
    contexts = positive_ints(list(contexts), "kernel_contexts")
    batch_sizes = positive_ints(list(batch_sizes), "kernel_batch_sizes")
    resolve_backend("triton", on)  # on a CPU: Triton's interpreter, or a one-line error
    rows = []
    for batch in batch_sizes:
        for case in op_cases(model, batch, contexts, span, block_size, on, seed):
            rows.append(time_case(case, repeats, warmup, on))
            if progress is not None:
                progress(kernel_line(rows[-1]))
    if end_to_end:
        for batch in batch_sizes:
            for context in contexts:
                rows.append(verify_row(model, batch, context, span, block_size, repeats, warmup, seed, prefill_each))
                if progress is not None:
                    progress(kernel_line(rows[-1]))
    return rows


def kernel_line(row: dict[str, Any]) -> str:
    """One row as a progress line."""
    context = "" if row["context"] is None else f" context {row['context']}"
    return (
        f"  kernel {row['op']} batch {row['batch']}{context}: torch {row['torch_ms']:.3f} ms, "
        f"triton {row['triton_ms']:.3f} ms{'' if row['agree'] else ' (DIFFER)'}"
    )


def kernel_report(
    model,
    device: torch.device,
    opts: KernelBenchOptions,
    repeats: int,
    block_size: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """``bench.json``'s ``kernels`` section (None when ``kernel_timings`` is off): the rows of
    :func:`kernel_timings`, ``agree`` (every row agreed) and ``greedy_agree`` (every
    ``verify_forward`` row's argmax did). On a CPU the Triton cache is copied from the torch one's
    prefill (``prefill_each=False``: the interpreter is slow)."""
    if not opts.enabled:
        return None
    rows = kernel_timings(
        model,
        device,
        opts.batch_sizes,
        opts.contexts,
        repeats,
        block_size=block_size,
        prefill_each=device.type == "cuda",
        progress=progress,
    )
    return {
        "span": SPAN,
        "block_size": block_size,
        "repeats": repeats,
        "interpreter": device.type != "cuda",
        "rows": rows,
        "agree": all(r["agree"] for r in rows),
        "greedy_agree": all(r["agree"] for r in rows if r["op"] == "verify_forward"),
    }
