"""Sharded training of MTP depths: the FSDP strategy behind ``trainer=fsdp``.

:class:`DepthShardedFSDPStrategy` is Lightning's FSDP (``FullyShardedDataParallel``) laid out
for depth training on a frozen backbone (docs/design.md §1):

* every MTP depth with trainable parameters is its own FSDP unit: its parameters, gradients and
  optimizer state are sharded across the ranks (:func:`wrap_trainable_depths`);
* every module whose parameters are all frozen (the backbone, the embedding, the unembedding,
  depths below ``mtp.train_from``) is left out of FSDP (``ignored_modules``,
  :func:`frozen_subtrees`): each rank holds it whole and runs it with no collectives;
* it runs on CPUs (gloo) as well as GPUs: Lightning's own FSDP strategy refuses
  ``accelerator=cpu``, and FSDP needs an explicit CPU ``device_id``;
* :func:`checkpoint_trainable_depths` (``activation_checkpointing=true``) recomputes the
  depths' activations in the backward pass, with any strategy;
* gradients are clipped by their global norm through the FSDP root (Lightning's FSDP
  precision plugin refuses norm clipping);
* after ``fit`` the model is whole again on every rank: the sharded parameters are gathered
  and the FSDP units unwrapped, so exporting and serving the trained model need nothing from
  the other ranks.

:func:`gathered_parameters` is the same gathering for a moment (the engine's acceptance at the
end of a validation runs on the whole depths, on rank 0 only).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, OptimStateKeyType, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.optim import Optimizer

from inkfw.errors import ConfigError
from inkfw.models.inkling.mtp import MtpDepth


def has_trainable_parameters(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def checkpoint_trainable_depths(model: nn.Module) -> int:
    """Activation checkpointing for every :class:`MtpDepth` of ``model`` with trainable
    parameters: its activations are recomputed in the backward pass instead of kept. Applied
    with forward hooks (torch's composable ``checkpoint``), so the module tree,
    parameter names and checkpoints are unchanged, and FSDP can still wrap each depth.
    Returns the number of depths it applies to."""
    from torch.distributed._composable.checkpoint_activation import checkpoint

    depths = [m for m in model.modules() if isinstance(m, MtpDepth) and has_trainable_parameters(m)]
    for depth in depths:
        checkpoint(depth)
    return len(depths)


def wrap_trainable_depths(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """FSDP auto-wrap policy: one FSDP unit per :class:`MtpDepth` that has trainable parameters
    (FSDP calls it with ``recurse=True`` to ask whether to look inside ``module``)."""
    if recurse:
        return True
    return isinstance(module, MtpDepth) and has_trainable_parameters(module)


def frozen_subtrees(module: nn.Module) -> list[nn.Module]:
    """The largest submodules of ``module`` whose parameters are all frozen (those with no
    parameters at all are skipped): what FSDP leaves unsharded."""
    found: list[nn.Module] = []
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if has_trainable_parameters(child):
            found.extend(frozen_subtrees(child))
        else:
            found.append(child)
    return found


class GlobalNormClippingPrecision(FSDPPrecision):
    """Lightning's FSDP precision plugin, clipping by the global gradient norm through the
    FSDP root (``FullyShardedDataParallel.clip_grad_norm_`` reduces the norm over the shards)."""

    def __init__(self, precision: Any, scaler: Any = None) -> None:
        super().__init__(precision, scaler)
        self.root: nn.Module | None = None  # set by the strategy once it has wrapped the model

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if not isinstance(self.root, FSDP):
            raise RuntimeError("the FSDP root is not set up yet: gradients can only be clipped during fit.")
        self.root.clip_grad_norm_(clip_val)


class DepthShardedFSDPStrategy(FSDPStrategy):
    """``trainer=fsdp`` (see the module docstring). Takes Lightning's ``FSDPStrategy`` options;
    ``auto_wrap_policy`` defaults to :func:`wrap_trainable_depths`, ``ignored_modules`` are
    always the frozen subtrees, and ``use_orig_params`` stays on (the optimizer sees the
    model's own parameters)."""

    strategy_name = "fsdp_depths"

    def __init__(self, auto_wrap_policy: Any = wrap_trainable_depths, **kwargs: Any) -> None:
        for key in ("ignored_modules", "ignored_states"):
            if key in kwargs:
                raise ConfigError(f"trainer.strategy.{key} cannot be set: every frozen module is left unsharded.")
        if kwargs.get("use_orig_params") is False:
            raise ConfigError("trainer.strategy.use_orig_params must stay true (frozen and trainable parameters mix).")
        super().__init__(auto_wrap_policy=auto_wrap_policy, **kwargs)

    @property
    def precision_plugin(self) -> FSDPPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = GlobalNormClippingPrecision("32-true")
        assert isinstance(plugin, FSDPPrecision)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        if plugin is not None and type(plugin) is FSDPPrecision:  # the one Lightning makes from `precision`
            plugin = GlobalNormClippingPrecision(plugin.precision, plugin.scaler)
        FSDPStrategy.precision_plugin.fset(self, plugin)  # type: ignore[attr-defined]

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if any(isinstance(m, FSDP) for m in model.modules()):
            raise ConfigError("the model is already wrapped in FSDP; DepthShardedFSDPStrategy wraps it itself.")
        wrapped = FSDP(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,  # a torch.device: FSDP refuses device_id=None on CPU
            ignored_modules=frozen_subtrees(model),
            **self.kwargs,
        )
        if self._activation_checkpointing_kwargs:
            from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing

            _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        plugin = self.precision_plugin
        if isinstance(plugin, GlobalNormClippingPrecision):
            plugin.root = wrapped
        return wrapped

    def _full_state_dict(self, rank0_only: bool = True):
        """FSDP's full-state-dict context as Lightning's, but offloading to the CPU only from an
        accelerator (on the CPU, FSDP's offload frees the gathered tensors before it copies them)."""
        offload = self.root_device.type != "cpu"
        return FSDP.state_dict_type(
            self.model,  # type: ignore[arg-type]
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state_dict_type != "full":
            return super().lightning_module_state_dict()
        assert self.model is not None
        with self._full_state_dict():
            return self.model.state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        if self._state_dict_type != "full":
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        assert self.model is not None
        with self._full_state_dict():
            state = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # the standard format, as Lightning stores it
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state

    def on_train_end(self) -> None:
        """Fit is over on every rank: gather the shards and leave a plain model behind."""
        super().on_train_end()
        if isinstance(self.model, FSDP):
            self.model = unshard_and_unwrap(self.model)
            plugin = self.precision_plugin
            if isinstance(plugin, GlobalNormClippingPrecision):
                plugin.root = None


def _nested_units(root: nn.Module) -> list[tuple[nn.Module, str, FSDP]]:
    """(parent, attribute name, unit) of every FSDP unit below ``root`` (``root`` excluded)."""
    return [
        (parent, name, child)
        for parent in root.modules()
        for name, child in parent.named_children()
        if isinstance(child, FSDP)
    ]


def _is_sharded(root: nn.Module) -> bool:
    return isinstance(root, FSDP) or any(isinstance(m, FSDP) for m in root.modules())


@contextmanager
def gathered_parameters(root: nn.Module | None) -> Iterator[None]:
    """Within: the FSDP units below ``root`` (a Lightning strategy's model) are replaced by the
    modules they wrap, holding their full parameters, so the model runs on one rank with no
    collectives; afterwards the units are back. A no-op when nothing is sharded. Entering it
    is a collective (every rank must); read-only: changes to parameters are discarded."""
    if root is None or not _is_sharded(root):
        yield
        return
    with FSDP.summon_full_params(root, writeback=False):
        units = _nested_units(root)
        for parent, name, unit in units:
            setattr(parent, name, unit.module)
        try:
            yield
        finally:
            for parent, name, unit in units:
                setattr(parent, name, unit)


@torch.no_grad()
def unshard_and_unwrap(root: FSDP) -> nn.Module:
    """The module ``root`` wraps, with every FSDP unit inside unwrapped and every sharded
    parameter whole again (a collective: every rank must call it)."""
    ignored = {id(p) for m in frozen_subtrees(root) for p in m.parameters()}
    with FSDP.summon_full_params(root, writeback=False):
        full = [(p, p.detach().clone()) for p in root.parameters() if id(p) not in ignored]
    for parent, name, unit in _nested_units(root):
        setattr(parent, name, unit.module)
    for p, whole in full:
        p.data = whole
        p.grad = None
    return root.module
