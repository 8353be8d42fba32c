"""Inkling building blocks: RMSNorm, short convolution, relative bias, attention, MLPs, block.

Architecture only: no checkpoint names, no I/O. Every module that remembers state between
calls takes ``positions`` [B, T] and an optional :class:`~inkfw.cache.interface.LayerCache`.

The serving step on small models is bound by how many operators it dispatches, so the hot path
avoids per-layer work that depends only on positions (:class:`AttentionTerms` computes it once
per forward), casts that are no-ops, and host syncs at decode sizes (:class:`MoE` has
static-shape paths for small token counts).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from inkfw.cache.interface import ATTN_SCONV, K_SCONV, MLP_SCONV, V_SCONV, LayerCache
from inkfw.models.inkling.config import InklingConfig


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t.float()`` without dispatching an op when ``t`` is fp32 already."""
    return t if t.dtype == torch.float32 else t.float()


def _fused(cache: LayerCache | None) -> bool:
    """The cache hands the layer fused kernels (a paged cache on the Triton backend)."""
    return getattr(cache, "kernels", None) is not None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without dispatching an op when the dtype already matches."""
    return t if t.dtype == dtype else t.to(dtype)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the weight multiplies the result in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # on CPU F.rms_norm runs x * rsqrt(mean(x^2) + eps) (* weight): the same ops in the same order
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class ShortConv(nn.Module):
    """Depthwise causal conv1d with a built-in residual, ``y = x + conv(x)``, in fp32.

    ``weight`` [C, 1, K]. Without a cache the whole sequence is convolved at once; with a cache
    the last K-1 inputs of each position come from it (``conv_window``).
    """

    def __init__(self, channels: int, kernel_size: int, stream: int):
        super().__init__()
        # [C, 1, K] laid out tap-major ([K, 1, C] in memory): the cached path's ``w.permute(1, 2, 0)``
        # then reads each tap contiguously over channels. Read channel-major (stride K), it made
        # inductor tile the fused conv + norm kernel by tokens: ~3x slower at 9 tokens (CPU).
        self.weight = nn.Parameter(torch.zeros(kernel_size, 1, channels).permute(2, 1, 0))
        self.kernel_size = kernel_size
        self.stream = stream

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None) -> torch.Tensor:
        if _fused(cache):  # the cached short-conv kernel reads the conv pool in place
            return cache.short_convs((self.stream,), (x,), (self.weight,))[0]  # type: ignore[union-attr]
        w, xf = _fp32(self.weight), _fp32(x)  # [C, 1, K], [B, T, C]
        if cache is None:
            conv = F.conv1d(xf.transpose(1, 2), w, padding=self.kernel_size - 1, groups=w.shape[0])
            conv = conv[..., : x.shape[1]].transpose(1, 2)  # [B, T, C]
        else:
            window = cache.conv_window(self.stream, x, positions, self.kernel_size)  # [B, T, K, C]
            conv = (_fp32(window) * w.permute(1, 2, 0)).sum(2)  # [B, T, K, C] * [1, K, C], summed over K
        return _as(xf + conv, x.dtype)


class RelativeBias(nn.Module):
    """Learned relative position bias: ``bias[q, k] = (r_q @ table)[q - k]`` for
    ``0 <= q - k < extent``, else 0. ``table`` [d_rel, extent].

    Attention reads it through :meth:`masked`: the profile ``r_q @ table`` padded with two
    columns, ``extent`` (bias 0: a visible key beyond the table) and ``extent + 1`` (-inf: a key
    the query may not see), so that one gather yields the bias with the mask folded in.
    """

    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(d_rel, extent))
        self.extent = extent

    def masked(self, r: torch.Tensor, columns: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """r [B, T, H, d_rel], columns [B, H, T, S] (from :func:`relative_bias_columns`), tail [B, H, T, 2]
        (the values of the two padding columns) -> bias [B, H, T, S]."""
        profile = (r @ self.table).transpose(1, 2)  # [B, H, T, extent]
        return torch.cat([profile, tail], dim=-1).gather(-1, columns)

    def forward(self, r: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        # r [B, T, H, d_rel], distance [B, T, S] -> bias [B, H, T, S], 0 wherever 0 <= distance < extent fails
        B, T, H, _ = r.shape
        columns = torch.where((distance >= 0) & (distance < self.extent), distance, self.extent)
        tail = r.new_zeros(1, 1, 1, 2).expand(B, H, T, 2)
        return self.masked(r, columns[:, None].expand(-1, H, -1, -1), tail)


def relative_bias_columns(distance: torch.Tensor, extent: int, window: int | None) -> torch.Tensor:
    """distance [B, T, S] (query minus key position) -> the column of the padded bias profile
    (see :meth:`RelativeBias.masked`) each pair reads: ``distance`` inside the table, ``extent``
    for a visible key beyond it, ``extent + 1`` for a key that is in the future or outside the
    sliding ``window``."""
    visible = distance >= 0
    if window is not None:
        visible = visible & (distance < window)
    inside = (distance >= 0) & (distance < extent)
    return torch.where(inside, distance, torch.where(visible, extent, extent + 1))  # [B, T, S]


class AttentionTerms:
    """What the attention layers of one forward derive from positions alone, computed once and
    shared by every layer: the log-scaling factor of each query and, per set of key positions
    (the layers of one cache group read the same key positions tensor), the bias columns with
    the causal and window masks folded in.

    Build one per forward from the query ``positions`` [B, T]; a block given none builds its own.
    Key positions are recognised by identity, so a cache must not change the values of a key
    positions tensor it has returned while the forward runs (the paged cache's group views build
    theirs once per forward; the dense cache returns a new tensor per layer).
    """

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        self._tau: dict[tuple[int, float], torch.Tensor] = {}
        # (key_positions, extent, window, heads, dtype, columns [B, H, T, S], tail [B, H, T, 2])
        self._columns: list[tuple] = []

    def tau(self, n_floor: int, alpha: float) -> torch.Tensor:
        """Log-scaling factor ``1 + alpha * log(max(1, (p + 1) / n_floor))`` per query: [B, 1, T, 1], fp32."""
        key = (n_floor, alpha)
        if key not in self._tau:
            tau = 1.0 + alpha * torch.log(((self.positions + 1).float() / n_floor).clamp(min=1.0))  # [B, T]
            self._tau[key] = tau[:, None, :, None]
        return self._tau[key]

    def bias_columns(
        self, key_positions: torch.Tensor, extent: int, window: int | None, heads: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(columns [B, H, T, S], tail [B, H, T, 2]) for :meth:`RelativeBias.masked` against keys at
        ``key_positions`` [B, S]; the tail holds 0 and -inf in ``dtype``."""
        for kp, e, w, h, dt, columns, tail in self._columns:
            if kp is key_positions and (e, w, h, dt) == (extent, window, heads, dtype):
                return columns, tail
        distance = self.positions[:, :, None] - key_positions[:, None, :]  # [B, T, S]
        B, T, S = distance.shape
        columns = relative_bias_columns(distance, extent, window)[:, None].expand(B, heads, T, S)
        tail = torch.zeros(2, dtype=dtype, device=distance.device)  # no host values: CUDA-graph capturable
        tail[1] = float("-inf")
        tail = tail.expand(B, heads, T, 2)
        self._columns.append((key_positions, extent, window, heads, dtype, columns, tail))
        return columns, tail


def _scale(t: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``t * tau`` computed in fp32, returned in ``t``'s dtype."""
    return t * tau if t.dtype == torch.float32 else (t.float() * tau).to(t.dtype)


class Attention(nn.Module):
    """Inkling attention: no RoPE; q/k/v/r projections, k/v short convs, per-head q/k RMSNorm,
    softmax scale 1/head_dim, learned relative bias, GQA, sliding window for local layers and
    optional log-scaling of q and the bias for global layers."""

    def __init__(self, cfg: InklingConfig, local: bool):
        super().__init__()
        self.local = local
        self.num_heads = cfg.swa_num_heads if local else cfg.num_heads
        self.num_kv_heads = cfg.swa_num_kv_heads if local else cfg.num_kv_heads
        self.head_dim = cfg.swa_head_dim if local else cfg.head_dim
        self.window = cfg.sliding_window if local else None
        extent = cfg.sliding_window if local else cfg.rel_extent
        self.log_scaling_n_floor = None if local else cfg.log_scaling_n_floor
        self.log_scaling_alpha = cfg.log_scaling_alpha
        self.d_rel = cfg.d_rel
        h, q_dim, kv_dim = cfg.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, q_dim, bias=False)
        self.k_proj = nn.Linear(h, kv_dim, bias=False)
        self.v_proj = nn.Linear(h, kv_dim, bias=False)
        self.r_proj = nn.Linear(h, self.num_heads * cfg.d_rel, bias=False)
        self.o_proj = nn.Linear(q_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_sconv = ShortConv(kv_dim, cfg.conv_kernel_size, K_SCONV)
        self.v_sconv = ShortConv(kv_dim, cfg.conv_kernel_size, V_SCONV)
        self.rel_bias = RelativeBias(cfg.d_rel, extent)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None, terms: AttentionTerms | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        terms = terms if terms is not None else AttentionTerms(positions)
        fused = cache is not None and _fused(cache)  # the cache's kernels read its pools in place
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim))  # [B, T, Hq, D]
        if fused:  # the k and v short convs in one launch
            k, v = cache.short_convs(  # type: ignore[union-attr]
                (K_SCONV, V_SCONV), (self.k_proj(x), self.v_proj(x)), (self.k_sconv.weight, self.v_sconv.weight)
            )
        else:
            k, v = self.k_sconv(self.k_proj(x), positions, cache), self.v_sconv(self.v_proj(x), positions, cache)
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim))  # [B, T, Hkv, D]
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        r = self.r_proj(x).view(B, T, self.num_heads, self.d_rel)  # [B, T, Hq, d_rel]

        if fused:  # paged span attention over the pools, bias and masks inside the kernel
            tau = None
            if self.log_scaling_n_floor is not None:
                tau = terms.tau(self.log_scaling_n_floor, self.log_scaling_alpha)[:, 0, :, 0]  # [B, T]
            out = cache.attend(  # type: ignore[union-attr]
                q, k, v, r, self.rel_bias.table, self.window, tau, 1.0 / self.head_dim
            )  # [B, T, Hq, D]
            return self.o_proj(out.reshape(B, T, -1))

        q = q.transpose(1, 2)  # [B, Hq, T, D]
        if cache is None:
            keys, values, key_positions = k, v, positions
        else:
            keys, values, key_positions = cache.update_kv(k, v, positions)  # [B, S, Hkv, D], [B, S]

        columns, tail = terms.bias_columns(key_positions, self.rel_bias.extent, self.window, self.num_heads, r.dtype)
        mask = self.rel_bias.masked(r, columns, tail)  # [B, Hq, T, S]: bias, -inf where not visible
        if self.log_scaling_n_floor is not None:
            tau = terms.tau(self.log_scaling_n_floor, self.log_scaling_alpha)  # [B, 1, T, 1]
            q, mask = _scale(q, tau), _scale(mask, tau)

        out = F.scaled_dot_product_attention(
            q,
            _as(keys.transpose(1, 2), q.dtype),
            _as(values.transpose(1, 2), q.dtype),
            attn_mask=_as(mask, q.dtype),
            scale=1.0 / self.head_dim,
            enable_gqa=True,
        )  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down @ (silu(gate @ x) * (up @ x))`` with ``gate_up`` [2I, H] (gate rows first)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


class DenseMLP(nn.Module):
    """SwiGLU with a learned scalar ``global_scale``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.zeros(2 * intermediate, hidden))
        self.down = nn.Parameter(torch.zeros(hidden, intermediate))
        self.global_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_up, self.down) * self.global_scale


class Router(nn.Module):
    """Sigmoid router over routed + shared experts.

    Choice: top-k of ``sigmoid(logits) + score_bias`` over the routed experts (the bias only
    steers the choice). Weights: log-sigmoid of the k chosen routed logits and the shared
    ("sink") logits, normalised together, times ``route_scale * global_scale``. The shared
    experts' weights are the per-token gammas.
    """

    score_bias: torch.Tensor  # buffer [E], fp32

    def __init__(self, cfg: InklingConfig):
        super().__init__()
        self.num_routed = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.route_scale = cfg.route_scale
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts + cfg.n_shared_experts, cfg.hidden_size))
        self.global_scale = nn.Parameter(torch.ones(1))
        self.register_buffer("score_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x [..., H] -> expert ids [..., k], routed weights [..., k], shared gammas [..., S]
        logits = F.linear(_fp32(x), _fp32(self.weight))  # [..., E + S]
        routed, shared = logits.split([self.num_routed, logits.shape[-1] - self.num_routed], dim=-1)
        choice = routed.sigmoid() + _fp32(self.score_bias)
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [..., k]
        log_w = F.logsigmoid(torch.cat([routed.gather(-1, expert_ids), shared], dim=-1))  # [..., k + S]
        weights = torch.exp(log_w - torch.logsumexp(log_w, dim=-1, keepdim=True))
        if self.route_scale != 1.0:  # x * 1.0 == x: skipping it changes nothing
            weights = weights * self.route_scale
        weights = _as(weights * _fp32(self.global_scale), x.dtype)
        routed_weights, gammas = weights.split([self.top_k, weights.shape[-1] - self.top_k], dim=-1)
        return expert_ids, routed_weights, gammas


_STATIC_MOE = [False]  # inside static_moe()


@contextmanager
def static_moe() -> Iterator[None]:
    """Within this block every MoE takes a static-shape path (no host read), whatever its token
    count: the engine's decode step runs in it (docs/design.md §5)."""
    before = _STATIC_MOE[0]
    _STATIC_MOE[0] = True
    try:
        yield
    finally:
        _STATIC_MOE[0] = before


class MoE(nn.Module):
    """Routed experts (top-k of ``n_routed_experts``) plus always-on shared experts weighted by gammas.

    Three computations of the same function, chosen by the token count N (a Python int, so the
    choice is static under ``torch.compile``):

    * ``grouped`` (N > ``static_max_tokens``: prefill chunks): tokens grouped by expert, one
      SwiGLU per expert that has tokens. Reads the group sizes on the host (a sync).
    * ``gathered`` (small N with ``2 * N * top_k < n_routed_experts``): each token's k expert
      weights gathered into [N, k, ...] and applied with batched matmuls; reads only the chosen
      experts.
    * ``dense`` (small N otherwise, when ``n_routed_experts <= 2 * top_k``, on CUDA, or
      under ``torch.compile``): every routed expert applied to every token with batched matmuls, then
      weighted by a routing matrix that is zero for experts not chosen; reads every expert once,
      cheaper than gathering when the tokens use most experts anyway. Eager on the CPU with many
      experts, such token counts take ``grouped`` instead, which does only the chosen work.

    The two static paths have fixed shapes and read nothing on the host (compile and CUDA-graph
    friendly). They add each token's expert outputs in the grouped path's order (shared experts,
    then routed experts by id), so for a single token all three agree bit for bit; for more tokens
    they agree to float rounding (a matmul's rounding depends on its row count).
    """

    static_max_tokens: int = 64  # largest token count that takes a static-shape path

    def __init__(self, cfg: InklingConfig):
        super().__init__()
        e, s, h, i = cfg.n_routed_experts, cfg.n_shared_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = Router(cfg)
        self.experts_gate_up = nn.Parameter(torch.zeros(e, 2 * i, h))  # gate rows first
        self.experts_down = nn.Parameter(torch.zeros(e, h, i))
        self.shared_gate_up = nn.Parameter(torch.zeros(s, 2 * i, h))
        self.shared_down = nn.Parameter(torch.zeros(s, h, i))

    def path_for(self, num_tokens: int, on_cuda: bool = False) -> str:
        """Which computation ``num_tokens`` tokens take: ``gathered``, ``dense`` or ``grouped``.
        Inside :func:`static_moe` (the engine's decode step) and under ``torch.compile`` only the
        static paths are taken, whatever the token count."""
        static = _STATIC_MOE[0] or torch.compiler.is_compiling()
        if num_tokens > self.static_max_tokens and not static:
            return "grouped"
        experts, top_k = self.experts_gate_up.shape[0], self.router.top_k
        if 2 * num_tokens * top_k < experts:
            return "gathered"
        if experts <= 2 * top_k or on_cuda or static:
            return "dense"
        # eager on the CPU with many experts: running every expert on every token costs more than
        # the grouped path's host read, which is cheap there (inkling-bench at batch 16: 6.7x slower)
        return "grouped"

    def forward(self, x: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]. ``path`` forces a computation (tests, benchmarks); None picks
        it from the token count (:meth:`path_for`)."""
        path = path or self.path_for(x.numel() // x.shape[-1], on_cuda=x.is_cuda)
        if path not in ("grouped", "gathered", "dense"):
            raise ValueError(f"MoE path must be 'grouped', 'gathered' or 'dense', got {path!r}")
        if path == "grouped":  # the static paths keep the leading dims, this one flattens them
            return _as(self._grouped(x.reshape(-1, x.shape[-1])), x.dtype).view(x.shape)
        return _as(self._gathered(x) if path == "gathered" else self._dense(x), x.dtype)

    @staticmethod
    def _all_experts(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of every expert of a stack on every token: gate_up [X, 2I, H], down [X, H, I],
        x [..., H] -> [..., X, 1, H]."""
        # one matmul over the stacked rows: each output equals the expert's own F.linear
        h = F.linear(x, gate_up.flatten(0, 1)).unflatten(-1, (gate_up.shape[0], 1, -1))  # [..., X, 1, 2I]
        gate, up = h.chunk(2, dim=-1)  # [..., X, 1, I] each
        # one matmul per expert over all the tokens (a batch of X), its weights read in place;
        # broadcasting [..., X, 1, I] @ [X, I, H] would copy the weights once per token first
        return torch.einsum("...xoi,xhi->...xoh", F.silu(gate) * up, down)  # [..., X, 1, H]

    @staticmethod
    def _weighted_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """y [..., X, 1, H], weights [..., X] -> the sum over X of ``(y * w).float()``, in X's order
        (as the grouped path accumulates): [..., H], fp32."""
        return _fp32(y * weights.unflatten(-1, (-1, 1, 1))).sum((-3, -2))

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, weights, gammas = self.router(x)
        y = torch.cat(
            [
                self._all_experts(self.shared_gate_up, self.shared_down, x),
                self._all_experts(self.experts_gate_up, self.experts_down, x),
            ],
            dim=-3,
        )  # [..., S + E, 1, H]
        routed = weights.new_zeros(*x.shape[:-1], self.experts_gate_up.shape[0])  # [..., E]
        routing = torch.cat([gammas, routed.scatter_(-1, expert_ids, weights)], dim=-1)  # [..., S + E], 0: not chosen
        return self._weighted_sum(y, routing)

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, weights, gammas = self.router(x)
        expert_ids, order = expert_ids.sort(dim=-1)  # by id: the order the grouped path adds them in
        rows = x[..., None, None, :]  # [..., 1, 1, H]
        gate, up = (rows @ self.experts_gate_up[expert_ids].mT).chunk(2, dim=-1)  # [..., k, 1, I] each
        routed = (F.silu(gate) * up) @ self.experts_down[expert_ids].mT  # [..., k, 1, H]
        shared = self._all_experts(self.shared_gate_up, self.shared_down, x)  # [..., S, 1, H]
        return self._weighted_sum(
            torch.cat([shared, routed], dim=-3), torch.cat([gammas, weights.gather(-1, order)], dim=-1)
        )

    def _grouped(self, flat: torch.Tensor) -> torch.Tensor:
        # flat [N, H] -> [N, H] fp32
        expert_ids, weights, gammas = self.router(flat)
        out = torch.zeros_like(flat, dtype=torch.float32)
        for s in range(self.shared_gate_up.shape[0]):
            y = swiglu(flat, self.shared_gate_up[s], self.shared_down[s])
            out += (y * gammas[:, s, None]).float()
        order = expert_ids.flatten().argsort(stable=True)  # group (token, slot) pairs by expert
        counts = torch.bincount(expert_ids.flatten(), minlength=self.experts_gate_up.shape[0]).tolist()
        tokens = order // expert_ids.shape[1]
        slot_weights = weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = tokens[start : start + n]
            y = swiglu(flat[idx], self.experts_gate_up[e], self.experts_down[e])
            out.index_add_(0, idx, (y * slot_weights[start : start + n, None]).float())
            start += n
        return out  # fp32


class Block(nn.Module):
    """One Inkling block (pre-norm, residual)::

    h = h + attn_sconv(attention(attn_norm(h)))
    h = h + mlp_sconv(mlp(mlp_norm(h)))
    """

    def __init__(self, cfg: InklingConfig, local: bool, moe: bool):
        super().__init__()
        h = cfg.hidden_size
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.attn = Attention(cfg, local)
        self.attn_sconv = ShortConv(h, cfg.conv_kernel_size, ATTN_SCONV)
        self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if moe else DenseMLP(h, cfg.intermediate_size)
        self.mlp_sconv = ShortConv(h, cfg.conv_kernel_size, MLP_SCONV)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: LayerCache | None = None,
        terms: AttentionTerms | None = None,
    ) -> torch.Tensor:
        """``terms``: the forward's shared :class:`AttentionTerms` (None: this block builds its own)."""
        h = h + self.attn_sconv(self.attn(self.attn_norm(h), positions, cache, terms), positions, cache)
        h = h + self.mlp_sconv(self.mlp(self.mlp_norm(h)), positions, cache)
        return h


@torch.no_grad()
def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Random initialisation for presets trained from scratch (norms and scales at 1)."""
    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.weight.fill_(1.0)
        elif isinstance(m, nn.Linear):
            m.weight.normal_(0.0, std)
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(0.0, 1.0)
        elif isinstance(m, ShortConv):
            # drawn in [C, 1, K] order, whatever the storage order: seeded inits stay what they were
            m.weight.copy_(
                torch.empty_like(m.weight, memory_format=torch.contiguous_format).normal_(
                    0.0, 1.0 / math.sqrt(m.kernel_size) * 0.1
                )
            )
        elif isinstance(m, RelativeBias):
            m.table.normal_(0.0, std)
        elif isinstance(m, DenseMLP):
            m.gate_up.normal_(0.0, std)
            m.down.normal_(0.0, std)
            m.global_scale.fill_(1.0)
        elif isinstance(m, MoE):
            for p in (m.experts_gate_up, m.experts_down, m.shared_gate_up, m.shared_down):
                p.normal_(0.0, std)
        elif isinstance(m, Router):
            m.weight.normal_(0.0, std)
            m.global_scale.fill_(1.0)
            m.score_bias.zero_()
