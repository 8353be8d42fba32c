"""Every Hydra config composes; presets build; parameter counts agree with HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from inkfw.models.inkling.config import InklingConfig
from inkfw.params import count_parameters
from inkfw.presets import build_model, model_config

CONF = Path(__file__).resolve().parent.parent / "conf"
PRIMARY = sorted(p.stem for p in CONF.glob("*.yaml"))
MODEL_PRESETS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))


def compose_cfg(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [])


@pytest.mark.parametrize("name", PRIMARY)
def test_every_primary_config_composes(name):
    cfg = compose_cfg(name)
    assert cfg.debug is False
    assert ("model" in cfg) == (name not in ("train_tokenizer", "heldout_prompts"))


TRAIN_GROUPS = ["task", "data", "trainer", "logger", "experiment"]


@pytest.mark.parametrize("group, option", [(g, p.stem) for g in TRAIN_GROUPS
                                           for p in sorted((CONF / g).glob("*.yaml"))])
def test_every_training_option_composes(group, option, tmp_path):
    overrides = [f"{group}={option}", f"output_dir={tmp_path}"]
    if group == "data" and option == "files":
        overrides.append(f"data.sources=[{tmp_path}]")
    cfg = compose_cfg("train", overrides)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # every value resolves
    if group == "logger":
        from hydra.utils import instantiate

        logger = instantiate(cfg.logger)
        assert type(logger).__name__ == {"wandb": "WandbLogger", "csv": "CSVLogger"}[option]


@pytest.mark.parametrize("preset", [p for p in MODEL_PRESETS if p != "inkling"])
def test_random_init_presets_build_on_meta(preset):
    cfg = compose_cfg("smoke", [f"model={preset}"])
    mcfg = model_config(cfg.model)
    assert isinstance(mcfg, InklingConfig)
    with torch.device("meta"):
        from inkfw.models.inkling.model import InklingLM

        model = InklingLM(mcfg, mtp_depths=mcfg.mtp.num_nextn_predict_layers)
    assert model.num_mtp_depths == mcfg.mtp.num_nextn_predict_layers


def test_debug_preset_covers_every_layer_kind():
    mcfg = model_config(compose_cfg("smoke", ["model=inkling-debug"]).model)
    kinds = {(mcfg.is_local(i), mcfg.is_moe(i)) for i in range(mcfg.num_layers)}
    assert (True, False) in kinds and (False, True) in kinds and (True, True) in kinds
    assert mcfg.log_scaling_n_floor is not None
    mtp_local = set(mcfg.mtp.local_layer_ids)
    assert mtp_local and mtp_local != set(range(mcfg.mtp.num_nextn_predict_layers))
    assert mcfg.mtp.num_nextn_predict_layers >= 3


def test_debug_preset_builds_and_runs():
    cfg = compose_cfg("smoke", ["model=inkling-debug"])
    model = build_model(cfg.model, mtp_depths=2)
    ids = torch.randint(0, 100, (1, 12))
    logits = model.logits(model(ids))
    assert logits.shape == (1, 12, model.cfg.logits_vocab_size)
    assert model.num_mtp_depths == 2


def test_inkling_preset_reads_config_json(tmp_path):
    from inkfw.checkpoint import export_checkpoint

    small = compose_cfg("smoke", ["model=inkling-debug"])
    export_checkpoint(build_model(small.model), tmp_path / "ckpt")
    cfg = compose_cfg("smoke", ["model=inkling", f"model.path={tmp_path / 'ckpt'}"])
    assert model_config(cfg.model) == model_config(small.model)


def hf_counts(cfg: InklingConfig) -> tuple[int, int]:
    from transformers import InklingForCausalLM, InklingTextConfig

    hf_cfg = InklingTextConfig(**{k: v for k, v in cfg.to_text_dict().items() if k != "model_type"})
    with torch.device("meta"):
        hf = InklingForCausalLM(hf_cfg)
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    return total, active


@pytest.mark.parametrize("preset", ["inkling-release", "inkling-debug"])
def test_backbone_counts_equal_hf(preset):
    cfg = model_config(compose_cfg("count_params", [f"model={preset}"]).model)
    ours = count_parameters(cfg)["backbone"]
    assert (ours.total, ours.active) == hf_counts(cfg)


def test_release_counts_match_published_numbers():
    cfg = model_config(compose_cfg("count_params", ["model=inkling-release"]).model)
    counts = count_parameters(cfg)
    assert round(counts["backbone"].total / 1e9, 1) == 947.0
    assert round(counts["backbone"].active / 1e9, 2) == 41.06
    # MTP depths are dense: all of their parameters are active, and they grow with depth count
    assert counts["mtp"].total == counts["mtp"].active > 0
    per_depth = [count_parameters(cfg, mtp_depths=d)["mtp"].total for d in range(9)]
    assert per_depth[0] == 0 and all(a < b for a, b in zip(per_depth, per_depth[1:]))
    assert per_depth[8] == counts["mtp"].total


def test_random_preset_weights_do_not_depend_on_depth_count():
    """The same preset serves every drafter: building fewer depths changes no shared weight."""
    node = OmegaConf.load(CONF / "model" / "inkling-debug.yaml")
    full = build_model(node, mtp_depths=4).state_dict()
    for depths in (0, 2):
        part = build_model(node, mtp_depths=depths).state_dict()
        assert part.keys() <= full.keys()
        assert all(torch.equal(part[k], full[k]) for k in part)
