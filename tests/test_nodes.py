"""Config nodes: a node that fails to build, or a ``_partial_`` node whose call fails, is one
:class:`ConfigError` naming the group, and the setting where a value of the wrong type is the cause."""

from __future__ import annotations

from functools import partial
from typing import Literal

import pytest
import torch
from omegaconf import OmegaConf

from inkfw.errors import ConfigError
from inkfw.nodes import build_node, call_node, check_setting_types, mistyped_setting, setting_hints

TRAINER = {"_target_": "lightning.pytorch.Trainer", "max_steps": 2, "logger": False, "enable_progress_bar": False}
ADAMW = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1.0e-3, "betas": [0.9, 0.95], "_convert_": "all"}


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"max_steps": "abc"}, "trainer.max_steps must be an integer, got 'abc'."),
        # text where text is allowed: the target's own reason, in one line
        ({"precision": "fp7"}, "trainer: cannot build 'lightning.pytorch.Trainer' (Precision 'fp7' is invalid."),
    ],
)
def test_a_node_that_fails_to_build_names_the_setting(setting, message):
    with pytest.raises(ConfigError) as err:
        build_node("trainer", OmegaConf.create({**TRAINER, **setting}))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"max_steps": "abc"}, "trainer.max_steps must be an integer, got 'abc'."),
        ({"enable_progress_bar": "maybe"}, "trainer.enable_progress_bar must be null, true or false, got 'maybe'."),
        ({"gradient_clip_val": "big"}, "trainer.gradient_clip_val must be null or a number, got 'big'."),
    ],
)
def test_settings_of_the_wrong_type_are_refused_before_building(setting, message):
    """``enable_progress_bar='maybe'`` would build (Lightning takes any truthy value)."""
    with pytest.raises(ConfigError, match=f"^{message}$"):
        check_setting_types("trainer", OmegaConf.create({**TRAINER, **setting}))


def test_a_setting_that_points_at_another_option_is_named_by_that_option():
    """``task.beta: ${loss.beta}``: the user wrote ``loss.beta=abc``, so the error names loss.beta."""
    cfg = OmegaConf.create({"steps": "abc", "trainer": {**TRAINER, "max_steps": "${steps}"}})
    with pytest.raises(ConfigError, match=r"^steps must be an integer, got 'abc'\.$"):
        check_setting_types("trainer", cfg.trainer)


def test_good_settings_build_and_pass_the_check():
    node = OmegaConf.create(TRAINER)
    check_setting_types("trainer", node)
    assert build_node("trainer", node).max_steps == 2
    optimizer = call_node("optim", build_node("optim", OmegaConf.create(ADAMW)), params())
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 1.0e-3


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"lr": -1}, "optim: cannot build 'torch.optim.adamw.AdamW' (Invalid learning rate: -1)."),
        ({"betas": [0.9]}, "optim: cannot build 'torch.optim.adamw.AdamW' (list index out of range)."),
    ],
)
def test_a_partial_node_whose_call_fails_names_the_setting(setting, message):
    """The optimizer node builds (a partial); its settings meet the parameters only when called."""
    factory = build_node("optim", OmegaConf.create({**ADAMW, **setting}))
    with pytest.raises(ConfigError) as err:
        call_node("optim", factory, params())
    assert str(err.value) == message


def test_a_partial_node_refuses_text_for_a_number_when_built_and_when_called():
    """``build_node`` checks before it builds; ``call_node`` names the setting for a factory
    built elsewhere (``lr='abc'`` fails only in AdamW's comparison ``'<=' ... 'str'``)."""
    with pytest.raises(ConfigError, match=r"^optim.lr must be a number, got 'abc'\.$"):
        build_node("optim", OmegaConf.create({**ADAMW, "lr": "abc"}))
    with pytest.raises(ConfigError, match=r"^optim.lr must be a number, got 'abc'\.$"):
        call_node("optim", partial(torch.optim.AdamW, lr="abc"), params())


def test_a_switch_given_as_text_is_refused_before_it_turns_itself_on():
    """The paged cache would take ``enable_prefix_caching='maybe'`` as true. One of its hints
    (``kernels: Kernels | None``) names a type only type checkers import; the others are still read."""
    node = OmegaConf.create({"_target_": "inkfw.cache.paged.PagedKVManager", "_partial_": True, "block_size": 16})
    assert callable(build_node("kv", node))
    node.enable_prefix_caching = "maybe"
    with pytest.raises(ConfigError, match=r"^kv.enable_prefix_caching must be true or false, got 'maybe'\.$"):
        build_node("kv", node)


def test_setting_hints_read_what_they_can_and_the_bases_a_subclass_passes_kwargs_to():
    class Base:
        def __init__(self, steps: int = 1, flag: bool = False) -> None: ...

    class Child(Base):
        def __init__(self, name: str = "x", unknown: NotImported = None, **kwargs) -> None:  # noqa: F821
            super().__init__(**kwargs)

    hints = setting_hints(Child)
    assert hints["name"] is str and hints["steps"] is int and hints["flag"] is bool and "unknown" not in hints
    assert mistyped_setting("g", Child, {"steps": "abc"}) == "g.steps must be an integer, got 'abc'."


def test_only_text_where_the_signature_takes_no_text_is_mistyped():
    def target(
        steps: int, ratio: float | None, name: str, either: int | str, flag: bool, mode: Literal["all"] | bool, loose=1
    ):
        raise AssertionError("never called")

    settings = {"name": "x", "either": "x", "loose": "x", "steps": 3, "mode": "all"}
    assert mistyped_setting("g", target, settings) is None
    assert mistyped_setting("g", target, {"flag": "x"}) == "g.flag must be true or false, got 'x'."
    assert mistyped_setting("g", target, {"ratio": "x"}) == "g.ratio must be null or a number, got 'x'."
    assert mistyped_setting("g", len, {"obj": "x"}) is None  # no type hints to read
