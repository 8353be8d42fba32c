"""The MoE's static-shape paths (issue 9): the same function as the grouped path, no host reads
at decode sizes, the same parameters; and a 1-token forward that compiles without graph breaks."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from helpers.models import randomize_, tiny_config
from inkfw.cache.dense import DenseModelCache
from inkfw.models.inkling.layers import MoE
from inkfw.models.inkling.model import InklingLM

HIDDEN = 32

# (n_routed_experts, num_experts_per_tok, n_shared_experts, route_scale)
EXPERTS = [(6, 2, 2, 2.5), (4, 2, 1, 1.0), (16, 3, 1, 0.7), (3, 3, 2, 1.0)]


def make_moe(routed: int, top_k: int, shared: int, route_scale: float, seed: int = 0) -> MoE:
    cfg = tiny_config(
        hidden_size=HIDDEN,
        moe_intermediate_size=24,
        n_routed_experts=routed,
        num_experts_per_tok=top_k,
        n_shared_experts=shared,
        route_scale=route_scale,
    )
    moe = MoE(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (moe.experts_gate_up, moe.experts_down, moe.shared_gate_up, moe.shared_down):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 * p.shape[-1] ** -0.5)  # outputs of order 1
        moe.router.weight.copy_(torch.randn(moe.router.weight.shape, generator=g) * 0.5)
        moe.router.global_scale.fill_(1.3)
        moe.router.score_bias.copy_(torch.randn(routed, generator=g) * 0.2)
    return moe


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed))


def all_paths(moe: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {path: moe(x, path=path) for path in ("grouped", "gathered", "dense")}


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 9), (3, 7), (4, 16)])
def test_static_paths_match_the_grouped_path(experts, shape):
    moe = make_moe(*experts)
    out = all_paths(moe, tokens(*shape))
    ref = out.pop("grouped")
    assert ref.shape == (*shape, HIDDEN) and ref.abs().max() > 0.05
    for path, got in out.items():
        assert got.shape == ref.shape and got.dtype == ref.dtype
        if shape == (1, 1):  # one token: the same matmuls, added in the same order
            assert torch.equal(got, ref), path
        assert (got - ref).abs().max() <= 1e-6, path


def test_dense_path_reads_each_expert_weight_in_place():
    """The dense path applies each expert to all N tokens in one matmul over its weights as they
    are: no copy of the weights per token. Broadcasting ``[N, X, 1, I] @ [X, I, H]`` copies them N
    times first (on the shipped checkpoint at batch 16: 4 MB per MoE layer and step, and 3.4x
    slower MTP steps at batch 16 on the CPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    moe = make_moe(4, 2, 1, 1.0)
    made: list[tuple[str, int]] = []  # (op, elements) of every tensor an op returns

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    made.append((str(func.overloadpacket), t.numel()))
            return out

    x = tokens(4, 9)  # 36 tokens
    with torch.no_grad(), Sizes():
        got = moe(x, path="dense")
    assert torch.allclose(got, moe(x, path="grouped"), atol=1e-6)
    per_token_weights = 36 * moe.experts_down[0].numel()  # one expert's down weights for every token
    assert max(n for _, n in made) < per_token_weights


def test_shared_experts_and_scales_move_every_path():
    """Control for the comparison above: the sink (shared) experts, route_scale and global_scale
    all change the output, and every path follows."""
    x = tokens(2, 5)
    base = all_paths(make_moe(6, 2, 2, 2.5), x)
    changed = []
    for edit in ("shared", "route_scale", "global_scale"):
        moe = make_moe(6, 2, 2, 2.5)
        with torch.no_grad():
            if edit == "shared":
                moe.shared_down.mul_(-1.0)
            elif edit == "route_scale":
                moe.router.route_scale = 1.0
            else:
                moe.router.global_scale.fill_(0.4)
        changed.append(all_paths(moe, x))
    for out in changed:
        for path in base:
            assert (out[path] - base[path]).abs().max() > 1e-3, path
        for path in ("gathered", "dense"):
            assert (out[path] - out["grouped"]).abs().max() <= 1e-6, path


def test_tied_routes_pick_the_same_experts_on_every_path():
    """Three experts with zero router rows and the same bias tie on every token for the top 2:
    every path resolves the tie the same way (they share the router), which shows because the
    tied experts compute very different functions."""
    moe = make_moe(6, 2, 1, 2.5)
    tied = [1, 3, 4]
    with torch.no_grad():
        moe.router.weight[tied] = 0.0
        moe.router.score_bias[tied] = 5.0  # far above the others: the top 2 always come from the tie
        moe.experts_down[3].mul_(-3.0)
        moe.experts_down[4].mul_(4.0)
    x = tokens(3, 4, seed=3)
    with torch.no_grad():
        ids, weights, _ = moe.router(x.reshape(-1, HIDDEN))
    assert all(len(set(row.tolist())) == 2 and set(row.tolist()) <= set(tied) for row in ids)
    assert torch.equal(weights[:, 0], weights[:, 1])  # equal logits: equal weights
    out, one_token = all_paths(moe, x), all_paths(moe, x[:1, :1])
    for path in ("gathered", "dense"):
        assert (out[path] - out["grouped"]).abs().max() <= 1e-6, path
        assert torch.equal(one_token[path], one_token["grouped"]), path
    # control: another resolution of the tie would change the output
    with torch.no_grad():
        e1, e3 = (torch.nn.functional.linear(x, moe.experts_gate_up[e]) for e in (1, 3))
    assert not torch.allclose(e1, e3, atol=1e-2)


def test_paths_by_token_count(monkeypatch):
    few_experts, many_experts = make_moe(4, 2, 1, 1.0), make_moe(16, 3, 1, 1.0)
    assert MoE.static_max_tokens == 64
    # every decode size (batch x verify width up to 64 tokens) is static with few experts
    assert {few_experts.path_for(n) for n in range(1, 65)} == {"dense"}
    # many experts, eager: gathered while it reads few experts, then grouped (only the chosen work)
    assert [many_experts.path_for(n) for n in (1, 2, 3, 64)] == ["gathered", "gathered", "grouped", "grouped"]
    # ... and on CUDA or under torch.compile every decode size is static
    assert [many_experts.path_for(n, on_cuda=True) for n in (1, 2, 3, 64)] == ["gathered", "gathered", "dense", "dense"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert [many_experts.path_for(n) for n in (1, 2, 3, 64)] == ["gathered", "gathered", "dense", "dense"]
    monkeypatch.undo()
    assert few_experts.path_for(65) == many_experts.path_for(512) == "grouped"
    few_experts.static_max_tokens = 8
    assert (few_experts.path_for(8), few_experts.path_for(9)) == ("dense", "grouped")
    with pytest.raises(ValueError, match="grouped"):
        few_experts(tokens(1, 1), path="sorted")


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@pytest.fixture
def host_reads(monkeypatch) -> list[str]:
    """Names of the Tensor methods that read device data on the host, in call order."""
    calls: list[str] = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


@pytest.mark.parametrize("experts", [(4, 2, 1, 1.0), (16, 3, 1, 1.0)])
def test_decode_sizes_read_nothing_on_the_host(experts, host_reads, monkeypatch):
    moe = make_moe(*experts)
    # many experts take the static paths on CUDA and under torch.compile (eager CPU: grouped)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        for shape in [(1, 1), (4, 9), (8, 8)]:
            moe(tokens(*shape))
        moe(tokens(5, 13))  # 65 tokens: under compile too the static paths, never the grouped one
        assert host_reads == []
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        moe(tokens(5, 13))  # eager CPU, 65 tokens: the grouped path, which reads its group sizes
    assert host_reads  # the patch sees host reads where there are some


def test_parameters_keep_their_names_and_shapes():
    moe = make_moe(6, 2, 2, 2.5)
    shapes = {name: tuple(t.shape) for name, t in moe.state_dict().items()}
    assert shapes == {
        "router.weight": (8, HIDDEN),
        "router.global_scale": (1,),
        "router.score_bias": (6,),
        "experts_gate_up": (6, 48, HIDDEN),
        "experts_down": (6, HIDDEN, 24),
        "shared_gate_up": (2, 48, HIDDEN),
        "shared_down": (2, HIDDEN, 24),
    }


def graph_breaks(fn, *args) -> tuple[int, int, list[str]]:
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(fn)(*args)
    torch._dynamo.reset()
    return explained.graph_count, explained.graph_break_count, [str(b.reason) for b in explained.break_reasons]


def test_one_token_forward_compiles_in_one_graph():
    """A decode-size forward (uncached, and through a dense cache) is one graph: no host reads,
    no data-dependent shapes."""
    cfg = tiny_config()
    model = randomize_(InklingLM(cfg)).eval()
    ids, positions = torch.tensor([[5]]), torch.tensor([[7]])
    assert graph_breaks(model, ids, positions) == (1, 0, [])
    cache = DenseModelCache(model, batch=1, max_len=16)
    with torch.no_grad():
        model(torch.arange(3, 10)[None], torch.arange(7)[None], cache.layers)
    assert graph_breaks(model, ids, positions, cache.layers) == (1, 0, [])
    # a chunk above the MoE's static size: eagerly it would group tokens by expert (a host read,
    # a graph break); compiled it stays on the static paths, one graph
    long_ids = torch.arange(70)[None] % cfg.vocab_size
    assert graph_breaks(model, long_ids, torch.arange(70)[None]) == (1, 0, [])


@pytest.mark.parametrize("path", ["gathered", "dense"])
def test_static_paths_compile_in_one_graph(path):
    moe = make_moe(6, 2, 2, 2.5)
    assert graph_breaks(lambda x: moe(x, path=path), tokens(4, 9)) == (1, 0, [])
