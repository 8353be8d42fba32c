"""An inkfw export is what vLLM's Inkling loader reads: config keys and tensor names and shapes.

The facts come from vLLM's source (``tests/fixtures/vllm_inkling_loader.json`` names the files
and commits). vLLM reads ``config.json`` with its own defaults for absent keys, so the check is
semantic: the model vLLM would build from the exported config must be the model inkfw wrote,
and its loaders must find exactly the exported tensors, with the exported shapes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from helpers.models import randomize_, tiny_config
from inkfw.models.inkling.checkpoint import export_checkpoint
from inkfw.models.inkling.config import InklingConfig
from inkfw.models.inkling.model import InklingLM
from inkfw.paths import project_root

FACTS = json.loads((Path(__file__).parent / "fixtures" / "vllm_inkling_loader.json").read_text())


def vllm_text_config(text: dict[str, Any]) -> dict[str, Any]:
    """``text_config`` as vLLM's ``InklingModelConfig`` reads it (the fixture's defaults and
    rules, from vllm/models/inkling/configs.py)."""
    c = dict(FACTS["text_config_defaults"])
    c.update({k: v for k, v in text.items() if k in FACTS["text_config_keys"]})
    if c["head_dim"] is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    for swa, base in (
        ("swa_num_attention_heads", "num_attention_heads"),
        ("swa_num_key_value_heads", "num_key_value_heads"),
        ("swa_head_dim", "head_dim"),
    ):
        if c[swa] is None:
            c[swa] = c[base]
    if (
        c["moe_intermediate_size"] is not None
        and c["intermediate_size"] is not None
        and c["dense_intermediate_size"] is None
    ):
        c["dense_intermediate_size"], c["intermediate_size"] = c["intermediate_size"], c["moe_intermediate_size"]
    if c["dense_intermediate_size"] is None:
        c["dense_intermediate_size"] = c["intermediate_size"]
    if c["sconv_kernel_size"] is None:
        c["sconv_kernel_size"] = c["conv_kernel_size"] if c["conv_kernel_size"] is not None else 4
    if c["padded_vocab_size"] is None:
        c["padded_vocab_size"] = c["vocab_size"]
        if c["unpadded_vocab_size"] is not None and c["unpadded_vocab_size"] < c["padded_vocab_size"]:
            c["vocab_size"] = c["unpadded_vocab_size"]
    c["local_layer_ids"] = list(c["local_layer_ids"] or [])
    return c


def _shape(spec: list, variables: dict[str, Any]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else int(eval(d, {"__builtins__": {}}, variables)) for d in spec)


def _add(out: dict[str, tuple[int, ...]], prefix: str, table: dict[str, list], variables: dict[str, Any]) -> None:
    for name, spec in table.items():
        out[prefix + name] = _shape(spec, variables)


def _block(out: dict, prefix: str, c: dict[str, Any], local: bool, dense: bool) -> None:
    t = FACTS["tensors"]
    kind = t["block_variables"]["local" if local else "global"]
    variables = dict(c, **{k: c[v] for k, v in kind.items()})
    _add(out, prefix, t["block"], variables)
    _add(out, prefix, t["dense_mlp"] if dense else t["moe_mlp"], variables)
    for flag, table in (t["dense_mlp_if"] if dense else t["moe_mlp_if"]).items():
        if c[flag]:
            _add(out, prefix, table, variables)


def vllm_tensors(c: dict[str, Any], mtp: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM's backbone and MTP loaders read for config ``c``, with its shape."""
    t = FACTS["tensors"]
    out: dict[str, tuple[int, ...]] = {}
    _add(out, "", t["top"], c)
    for flag, table in t["top_if"].items():
        if c[flag]:
            _add(out, "", table, c)
    for i in range(c["num_hidden_layers"]):
        _block(out, t["layer_prefix"].format(i=i), c, i in c["local_layer_ids"], i < c["dense_mlp_idx"])
    depth_local = set(mtp.get("local_layer_ids") or [])
    for d in range(mtp.get("num_nextn_predict_layers", 0)):
        prefix = t["mtp_prefix"].format(d=d)
        _add(out, prefix, t["mtp_depth"], c)
        _block(out, prefix + t["mtp_block_prefix"], c, d in depth_local, dense=True)
    if mtp.get("num_nextn_predict_layers", 0):
        for flag, table in t["mtp_if"].items():
            if mtp.get(flag):
                _add(out, "", table, c)
    return out


def _written(path: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, InklingLM]:
    torch.manual_seed(0)
    cfg = tiny_config()
    model = randomize_(InklingLM(cfg, mtp_depths=cfg.mtp.num_nextn_predict_layers)).eval()
    return export_checkpoint(model, tmp_path_factory.mktemp("vllm") / "export"), model


@pytest.fixture(params=["export", "shipped"])
def checkpoint(request, exported) -> Path:
    return exported[0] if request.param == "export" else project_root() / "checkpoints" / "inkling-tiny"


def test_config_reads_as_the_same_model_in_vllm(checkpoint):
    raw = json.loads((checkpoint / "config.json").read_text())
    ours = InklingConfig.from_dict(raw)
    assert raw["model_type"] in FACTS["model_types"]
    assert set(raw["architectures"]) <= set(FACTS["architectures"])
    assert set(FACTS["mtp_config_keys"]) <= set(raw["mtp_config"])
    c = vllm_text_config(raw["text_config"])
    # the model vLLM builds from these keys is inkfw's
    assert (c["num_hidden_layers"], c["hidden_size"], c["dense_mlp_idx"]) == (
        ours.num_layers,
        ours.hidden_size,
        ours.dense_mlp_idx,
    )
    assert (c["padded_vocab_size"], c["vocab_size"]) == (ours.vocab_size, ours.logits_vocab_size)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rel_extent"]) == (
        ours.num_heads,
        ours.num_kv_heads,
        ours.head_dim,
        ours.rel_extent,
    )
    assert (
        c["swa_num_attention_heads"],
        c["swa_num_key_value_heads"],
        c["swa_head_dim"],
        c["sliding_window_size"],
    ) == (ours.swa_num_heads, ours.swa_num_kv_heads, ours.swa_head_dim, ours.sliding_window)
    assert sorted(c["local_layer_ids"]) == ours.local_layer_ids and c["d_rel"] == ours.d_rel
    assert (c["dense_intermediate_size"], c["intermediate_size"]) == (
        ours.intermediate_size,
        ours.moe_intermediate_size,
    )
    assert (c["n_routed_experts"], c["n_shared_experts"], c["num_experts_per_tok"], c["route_scale"]) == (
        ours.n_routed_experts,
        ours.n_shared_experts,
        ours.num_experts_per_tok,
        ours.route_scale,
    )
    assert (c["sconv_kernel_size"], c["rms_norm_eps"], c["use_embed_norm"]) == (
        ours.conv_kernel_size,
        ours.rms_norm_eps,
        ours.use_embed_norm,
    )
    assert (c["log_scaling_n_floor"], c["log_scaling_alpha"], c["logits_mup_width_multiplier"]) == (
        ours.log_scaling_n_floor,
        ours.log_scaling_alpha,
        ours.logits_mup_width_multiplier,
    )
    # every Inkling MLP has a global scale and every router a selection bias and sink experts
    assert c["use_global_scale"] is True and c["use_gate_bias"] is True
    if ours.dense_mlp_idx < ours.num_layers:
        assert {k: c[k] for k in FACTS["moe_requires"]} == FACTS["moe_requires"]


def test_tensor_names_and_shapes_are_what_vllm_loads(checkpoint):
    raw = json.loads((checkpoint / "config.json").read_text())
    expected = vllm_tensors(vllm_text_config(raw["text_config"]), raw["mtp_config"])
    written = _written(checkpoint)
    assert sorted(set(written) - set(expected)) == []  # vLLM would reject these as unexpected
    assert sorted(set(expected) - set(written)) == []  # vLLM would miss these
    assert {n: s for n, s in written.items() if expected[n] != s} == {}


def test_gate_up_rows_are_interleaved_as_vllm_reads_them(exported):
    path, model = exported
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        w13 = f.get_tensor("model.llm.layers.0.mlp.w13_dn.weight")  # [2F, H]
        experts = f.get_tensor("model.llm.layers.1.mlp.experts.w13_weight")  # [E, 2F, H]
    mlp = model.backbone.layers[0].mlp
    F = mlp.down.shape[1]
    assert torch.equal(w13[0::2], mlp.gate_up[:F]) and torch.equal(w13[1::2], mlp.gate_up[F:])
    moe = model.backbone.layers[1].mlp
    Fm = moe.experts_down.shape[-1]
    assert torch.equal(experts[:, 0::2], moe.experts_gate_up[:, :Fm])
    assert torch.equal(experts[:, 1::2], moe.experts_gate_up[:, Fm:])


def test_the_docs_command_uses_vllms_method_and_the_export_depths():
    doc = (project_root() / "docs" / "serving-at-scale.md").read_text()
    configs = [json.loads(m) for m in re.findall(r"--speculative-config '(\{[^']*\})'", doc)]
    assert configs, "no vllm serve --speculative-config in docs/serving-at-scale.md"
    shipped = json.loads((project_root() / "checkpoints" / "inkling-tiny" / "config.json").read_text())
    depths = shipped["mtp_config"]["num_nextn_predict_layers"]
    assert {c["method"] for c in configs} == {FACTS["speculative_method"]}
    assert configs[0]["num_speculative_tokens"] == depths  # the first command: k = D, every depth used
