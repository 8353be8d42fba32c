"""Inkling building blocks: RMSNorm, short convolution, relative bias, attention, MLPs, block.

Architecture only: no checkpoint names, no I/O. Every module that remembers state between
calls takes ``positions`` [B, T] and an optional :class:`~inkfw.cache.interface.LayerCache`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inkfw.cache.interface import ATTN_SCONV, K_SCONV, MLP_SCONV, V_SCONV, LayerCache
from inkfw.models.inkling.config import InklingConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the weight multiplies the result in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class ShortConv(nn.Module):
    """Depthwise causal conv1d with a built-in residual, ``y = x + conv(x)``, in fp32.

    ``weight`` [C, 1, K]. Without a cache the whole sequence is convolved at once; with a cache
    the last K-1 inputs of each position come from it (``conv_window``).
    """

    def __init__(self, channels: int, kernel_size: int, stream: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel_size))
        self.kernel_size = kernel_size
        self.stream = stream

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None) -> torch.Tensor:
        w = self.weight.float()  # [C, 1, K]
        if cache is None:
            xt = x.float().transpose(1, 2)  # [B, C, T]
            conv = F.conv1d(xt, w, padding=self.kernel_size - 1, groups=w.shape[0])[..., : x.shape[1]]
            conv = conv.transpose(1, 2)  # [B, T, C]
        else:
            window = cache.conv_window(self.stream, x, positions, self.kernel_size)  # [B, T, K, C]
            conv = torch.einsum("btkc,ck->btc", window.float(), w[:, 0, :])
        return (x.float() + conv).to(x.dtype)


class RelativeBias(nn.Module):
    """Learned relative position bias: ``bias[q, k] = (r_q @ table)[q - k]`` for
    ``0 <= q - k < extent``, else 0. ``table`` [d_rel, extent]."""

    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(d_rel, extent))
        self.extent = extent

    def forward(self, r: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        # r [B, T, H, d_rel], distance [B, T, S] -> bias [B, H, T, S]
        profile = (r @ self.table).transpose(1, 2)  # [B, H, T, extent]
        index = distance.clamp(0, self.extent - 1)[:, None].expand(-1, profile.shape[1], -1, -1)
        bias = profile.gather(-1, index)
        outside = (distance < 0) | (distance >= self.extent)
        return bias.masked_fill(outside[:, None], 0.0)


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim))  # [B, T, Hq, D]
        k = self.k_sconv(self.k_proj(x), positions, cache).view(B, T, self.num_kv_heads, self.head_dim)
        k = self.k_norm(k)  # [B, T, Hkv, D]
        v = self.v_sconv(self.v_proj(x), positions, cache).view(B, T, self.num_kv_heads, self.head_dim)
        r = self.r_proj(x).view(B, T, self.num_heads, self.d_rel)  # [B, T, Hq, d_rel]

        if cache is None:
            keys, values, key_positions = k, v, positions
        else:
            keys, values, key_positions = cache.update_kv(k, v, positions)  # [B, S, Hkv, D], [B, S]

        distance = positions[:, :, None] - key_positions[:, None, :]  # [B, T, S]
        bias = self.rel_bias(r, distance)  # [B, Hq, T, S]
        allowed = distance >= 0
        if self.window is not None:
            allowed &= distance < self.window
        if self.log_scaling_n_floor is not None:
            tau = 1.0 + self.log_scaling_alpha * torch.log(
                ((positions + 1).float() / self.log_scaling_n_floor).clamp(min=1.0))  # [B, T]
            q = (q.float() * tau[:, :, None, None]).to(q.dtype)
            bias = (bias.float() * tau[:, None, :, None]).to(bias.dtype)
        mask = bias.masked_fill(~allowed[:, None], float("-inf"))

        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=mask.to(q.dtype), scale=1.0 / self.head_dim, enable_gqa=True,
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

    def __init__(self, cfg: InklingConfig):
        super().__init__()
        self.num_routed = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.route_scale = cfg.route_scale
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts + cfg.n_shared_experts, cfg.hidden_size))
        self.global_scale = nn.Parameter(torch.ones(1))
        self.register_buffer("score_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x [N, H] -> expert ids [N, k], routed weights [N, k], shared gammas [N, S]
        logits = F.linear(x.float(), self.weight.float())  # [N, E + S]
        routed, shared = logits[:, : self.num_routed], logits[:, self.num_routed:]
        choice = routed.sigmoid() + self.score_bias.float()
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [N, k]
        log_w = F.logsigmoid(torch.cat([routed.gather(-1, expert_ids), shared], dim=-1))  # [N, k + S]
        weights = torch.exp(log_w - torch.logsumexp(log_w, dim=-1, keepdim=True))
        weights = (weights * self.route_scale * self.global_scale.float()).to(x.dtype)
        return expert_ids, weights[:, : self.top_k], weights[:, self.top_k:]


class MoE(nn.Module):
    """Routed experts (top-k of ``n_routed_experts``) plus always-on shared experts weighted by gammas."""

    def __init__(self, cfg: InklingConfig):
        super().__init__()
        e, s, h, i = cfg.n_routed_experts, cfg.n_shared_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = Router(cfg)
        self.experts_gate_up = nn.Parameter(torch.zeros(e, 2 * i, h))  # gate rows first
        self.experts_down = nn.Parameter(torch.zeros(e, h, i))
        self.shared_gate_up = nn.Parameter(torch.zeros(s, 2 * i, h))
        self.shared_down = nn.Parameter(torch.zeros(s, h, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
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
        return out.to(x.dtype).view(shape)


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

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        h = h + self.attn_sconv(self.attn(self.attn_norm(h), positions, cache), positions, cache)
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
            m.weight.normal_(0.0, 1.0 / math.sqrt(m.kernel_size) * 0.1)
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
