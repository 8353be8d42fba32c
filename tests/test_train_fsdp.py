"""Scale-out training: trainer=fsdp (the trainable depths sharded, the frozen backbone not) in 2
CPU processes over gloo, its strategy and config, and activation checkpointing of the depths."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from ddp_worker import MTP_DEPTHS, initial_depths, trained
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from helpers.models import randomize_, tiny_config
from inkfw.errors import ConfigError
from inkfw.models.inkling.model import InklingLM
from inkfw.paths import config_dir
from inkfw.train.strategies import (
    DepthShardedFSDPStrategy,
    GlobalNormClippingPrecision,
    checkpoint_trainable_depths,
    frozen_subtrees,
    wrap_trainable_depths,
)
from inkfw.train.tasks import MtpTask


def prepared(train_from: int) -> tuple[InklingLM, MtpTask]:
    torch.manual_seed(0)
    model = randomize_(InklingLM(tiny_config(), mtp_depths=3))
    task = MtpTask(train_from=train_from)
    task.prepare(model)
    return model, task


# ------------------------------------------------------------------ 2 processes, gloo
def test_fsdp_on_cpu_trains_the_same_depths_as_one_process():
    """FSDP (with activation checkpointing and norm clipping) against one plain process."""
    fsdp, single = trained("fsdp"), trained("single")
    init = initial_depths()
    assert fsdp["depths"].keys() == single["depths"].keys() == init.keys()
    assert any(not torch.equal(single["depths"][k], init[k]) for k in init), "training changed nothing"
    for k in init:
        torch.testing.assert_close(fsdp["depths"][k], single["depths"][k], atol=5e-5, rtol=1e-4)
    # the engine's acceptance after validation ran on rank 0 with the depths gathered
    assert fsdp["engine_acceptance_length"] == pytest.approx(single["engine_acceptance_length"], abs=1e-9)
    assert fsdp["plain_after_fit"], "the FSDP units are still there after fit"


def test_fsdp_shards_the_depths_and_not_the_backbone():
    ranks = trained("fsdp")["ranks"]
    assert len(ranks) == 2
    whole = InklingLM(tiny_config(), mtp_depths=MTP_DEPTHS)
    depth_numel = [sum(p.numel() for p in d.parameters()) for d in whole.mtp.depths]  # type: ignore[union-attr]
    backbone_shapes = {n: list(p.shape) for n, p in whole.backbone.named_parameters()}
    for held in ranks:
        assert held["depth_is_unit"] == [True] * MTP_DEPTHS
        assert held["backbone_units"] == 0
        assert held["backbone_shapes"] == backbone_shapes  # every rank holds the frozen backbone whole
        assert held["unembed_shape"] == list(whole.unembed.weight.shape)
    for d in range(MTP_DEPTHS):
        local = [held["depth_local_numel"][d] for held in ranks]
        assert all(0 < n < depth_numel[d] for n in local)
        assert sum(local) == depth_numel[d]  # each rank holds its shard of the depth, no more


# ------------------------------------------------------------------ the layout, in process
def test_only_trainable_depths_are_units_and_frozen_modules_stay_whole():
    model, _ = prepared(train_from=1)  # depth 0 and the chain norm frozen
    assert model.mtp is not None
    units = [m for m in model.modules() if wrap_trainable_depths(m, recurse=False, nonwrapped_numel=0)]
    assert units == [model.mtp.depths[1], model.mtp.depths[2]]
    ignored = frozen_subtrees(model)
    assert set(map(id, ignored)) == {
        id(m) for m in (model.backbone, model.unembed, model.mtp.depths[0], model.mtp.chain_norm)
    }
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert all(id(p) not in trainable for m in ignored for p in m.parameters())
    # every depth trains: only the backbone and the unembedding stay out of FSDP
    model, _ = prepared(train_from=0)
    assert set(map(id, frozen_subtrees(model))) == {id(model.backbone), id(model.unembed)}


def test_fsdp_config_composes_and_builds_the_strategy(tmp_path):
    overrides = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=32-true", f"output_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    trainer = instantiate(cfg.trainer)
    assert isinstance(trainer, L.Trainer)
    strategy = trainer.strategy
    assert type(strategy) is DepthShardedFSDPStrategy
    assert strategy.kwargs["auto_wrap_policy"] is wrap_trainable_depths
    assert strategy.kwargs["use_orig_params"] is True
    assert isinstance(strategy.precision_plugin, GlobalNormClippingPrecision)
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        gpu = compose("train", overrides=["trainer=fsdp"]).trainer
    assert gpu.accelerator == "gpu" and gpu.precision == "bf16-mixed"


@pytest.mark.parametrize("option", ["ignored_modules", "ignored_states"])
def test_strategy_refuses_its_own_layout_options(option):
    with pytest.raises(ConfigError, match=f"trainer.strategy.{option}"):
        DepthShardedFSDPStrategy(**{option: []})


# ------------------------------------------------------------------ activation checkpointing
def _loss_and_grads(model: InklingLM, task: MtpTask, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, _ = task.loss(model, (ids, torch.zeros_like(ids)))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(3))
    (plain, task), (checkpointed, task_ckpt) = prepared(train_from=1), prepared(train_from=1)
    assert checkpoint_trainable_depths(checkpointed) == 2  # depths 1 and 2; depth 0 is frozen
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()  # names unchanged
    assert checkpointed.mtp is not None
    block_calls = []
    # a pre-hook: the recomputation stops once it has every saved tensor, before the block returns
    checkpointed.mtp.depths[1].block.register_forward_pre_hook(lambda *_: block_calls.append(1))
    loss, grads = _loss_and_grads(plain, task, ids)
    loss_ckpt, grads_ckpt = _loss_and_grads(checkpointed, task_ckpt, ids)
    assert len(block_calls) == 2  # the forward, then its recomputation in the backward pass
    torch.testing.assert_close(loss_ckpt, loss, atol=1e-6, rtol=0)
    assert grads.keys() == grads_ckpt.keys() and any(n.startswith("mtp.depths.2.") for n in grads)
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=0)
