"""Every Hydra config composes; presets build; parameter counts agree with HF transformers."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from inkfw.errors import ConfigError
from inkfw.models.inkling.config import InklingConfig
from inkfw.models.inkling.flavours import FLAVOURS, PUBLISHED
from inkfw.models.inkling.params import count_parameters
from inkfw.paths import config_dir
from inkfw.presets import build_model, model_config

CONF = config_dir()
PRIMARY = sorted(p.stem for p in CONF.glob("*.yaml"))
MODEL_PRESETS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))


def compose_cfg(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [])


@pytest.mark.parametrize("name", PRIMARY)
def test_every_primary_config_composes(name):
    cfg = compose_cfg(name)
    assert cfg.debug is False
    assert ("model" in cfg) == (name not in ("train_tokenizer", "heldout_prompts", "export"))


TRAIN_GROUPS = ["task", "data", "optim", "scheduler", "callbacks", "trainer", "logger", "experiment"]


@pytest.mark.parametrize(
    "group, option", [(g, p.stem) for g in TRAIN_GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
)
def test_every_training_option_composes(group, option, tmp_path):
    """Every option composes, every value resolves, and every node builds what its _target_ names."""
    import lightning as L
    from hydra.utils import get_class, instantiate
    from torch.optim.lr_scheduler import LRScheduler

    from inkfw.train.tasks import TrainTask

    overrides = [f"{group}={option}", f"output_dir={tmp_path}"]
    if group == "data" and option == "files":
        overrides.append(f"data.sources=[{tmp_path}]")
    if group == "data" and option in ("hf", "hidden"):
        overrides.append(f"data.path={tmp_path}")
    cfg = compose_cfg("train", overrides)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # every value resolves
    task = instantiate(cfg.task)
    assert isinstance(task, TrainTask) and type(task) is get_class(cfg.task._target_)
    assert task.objective == cfg.loss.objective and task.beta == cfg.loss.beta
    data = instantiate(cfg.data, tokenizer=tmp_path / "tokenizer.json")
    assert type(data) is get_class(cfg.data._target_) and data.batch_size == cfg.data.batch_size
    if "seq_len" in cfg.data:  # stored hidden states come in the dump's row length
        assert data.seq_len == cfg.data.seq_len
    optimizer = instantiate(cfg.optim)([torch.nn.Parameter(torch.zeros(1))])
    assert type(optimizer) is get_class(cfg.optim._target_)
    assert optimizer.defaults["lr"] == cfg.optim.lr and tuple(optimizer.defaults["betas"]) == tuple(cfg.optim.betas)
    assert isinstance(instantiate(cfg.scheduler)(optimizer), LRScheduler)
    for name, node in cfg.callbacks.items():
        assert type(instantiate(node)) is get_class(node._target_), name
    gpu_here = torch.cuda.is_available()
    trainer = instantiate(
        cfg.trainer, **({} if gpu_here or cfg.trainer.accelerator != "gpu" else {"accelerator": "cpu"})
    )
    assert isinstance(trainer, L.Trainer) and trainer.max_steps == cfg.trainer.max_steps
    logger = instantiate(cfg.logger)
    assert type(logger) is get_class(cfg.logger._target_)


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
    from inkfw.models.inkling.checkpoint import export_checkpoint

    small = compose_cfg("smoke", ["model=inkling-debug"])
    export_checkpoint(build_model(small.model), tmp_path / "ckpt")
    cfg = compose_cfg("smoke", ["model=inkling", f"model.path={tmp_path / 'ckpt'}"])
    assert model_config(cfg.model) == model_config(small.model)


def hf_counts(hf_cfg) -> tuple[int, int]:
    """(total, active) of HF transformers 5.23's InklingForCausalLM for ``hf_cfg``, built on meta."""
    from transformers import InklingForCausalLM

    with torch.device("meta"):
        hf = InklingForCausalLM(hf_cfg)
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    active = total - experts + experts * hf_cfg.num_experts_per_tok // hf_cfg.n_routed_experts
    return total, active


def hf_config(cfg: InklingConfig):
    from transformers import InklingTextConfig

    return InklingTextConfig(**{k: v for k, v in cfg.to_text_dict().items() if k != "model_type"})


@pytest.mark.parametrize("preset", ["inkling-release", "inkling-small", "inkling-debug"])
def test_backbone_counts_equal_hf(preset):
    cfg = model_config(compose_cfg("count_params", [f"model={preset}"]).model)
    ours = count_parameters(cfg)["backbone"]
    assert (ours.total, ours.active) == hf_counts(hf_config(cfg))


def test_release_preset_is_hf_default_config():
    """HF 5.23's default InklingTextConfig is the release model: every layer MoE."""
    from transformers import InklingTextConfig

    cfg = model_config(compose_cfg("count_params", ["model=inkling-release"]).model)
    assert all(cfg.is_moe(i) for i in range(cfg.num_layers))
    ours = count_parameters(cfg)["backbone"]
    assert (ours.total, ours.active) == hf_counts(InklingTextConfig())


@pytest.mark.parametrize(
    "preset, flavour, total, active",
    [
        ("inkling-release", "release", 975_340_270_146, 41_059_054_146),
        ("inkling-small", "small", 276_240_214_570, 11_999_062_570),
    ],
)
def test_counts_match_published_numbers(preset, flavour, total, active):
    node = compose_cfg("count_params", [f"model={preset}"]).model
    assert node.flavour == flavour
    cfg = model_config(node)
    counts = count_parameters(cfg)
    assert (counts["backbone"].total, counts["backbone"].active) == (total, active)
    # the model card's rounded figures
    published = PUBLISHED[flavour]
    assert f"{round(total / 1e9)}B" == published.total and f"{round(active / 1e9)}B" == published.active
    # MTP depths are dense: all of their parameters are active, and they grow with depth count
    assert counts["mtp"].total == counts["mtp"].active > 0
    per_depth = [count_parameters(cfg, mtp_depths=d)["mtp"].total for d in range(9)]
    assert per_depth[0] == 0 and all(a < b for a, b in zip(per_depth, per_depth[1:]))
    assert per_depth[8] == counts["mtp"].total


def test_small_mtp_depths_fill_the_published_mtp_file():
    """Inkling-Small ships its 8 depths in a separate mtp.safetensors of about 4.5 GB (bfloat16)."""
    cfg = model_config(compose_cfg("count_params", ["model=inkling-small"]).model)
    assert cfg.mtp.num_nextn_predict_layers == 8
    gigabytes = count_parameters(cfg)["mtp"].total * 2 / 1e9
    assert 4.4 < gigabytes < 4.6


def test_every_flavour_has_a_preset_and_builds():
    names = {compose_cfg("smoke", [f"model={p}"]).model.get("flavour") for p in MODEL_PRESETS}
    assert set(FLAVOURS) <= names
    for name in FLAVOURS:
        node = OmegaConf.create({"name": name, "flavour": name, "path": None, "sizes": {}})
        assert isinstance(model_config(node), InklingConfig)


def test_preset_size_overrides():
    base = model_config(compose_cfg("smoke", ["model=inkling-debug"]).model)
    cfg = model_config(
        compose_cfg(
            "smoke", ["model=inkling-debug", "+model.sizes.num_layers=3", "+model.sizes.mtp.num_nextn_predict_layers=1"]
        ).model
    )
    assert (cfg.num_layers, cfg.mtp.num_nextn_predict_layers) == (3, 1)
    assert (
        cfg.local_layer_ids == base.local_layer_ids
        and cfg.mtp.chain_hidden_post_norm == base.mtp.chain_hidden_post_norm
    )
    assert cfg.hidden_size == base.hidden_size
    with pytest.raises(ConfigError, match="num_layerz"):
        model_config(compose_cfg("smoke", ["model=inkling-debug", "+model.sizes.num_layerz=2"]).model)
    with pytest.raises(ConfigError, match="'huge'"):
        model_config(compose_cfg("smoke", ["model=inkling-debug", "model.flavour=huge"]).model)


def test_random_preset_weights_do_not_depend_on_depth_count():
    """The same preset serves every drafter: building fewer depths changes no shared weight."""
    node = OmegaConf.load(CONF / "model" / "inkling-debug.yaml")
    full = build_model(node, mtp_depths=4).state_dict()
    for depths in (0, 2):
        part = build_model(node, mtp_depths=depths).state_dict()
        assert part.keys() <= full.keys()
        assert all(torch.equal(part[k], full[k]) for k in part)
