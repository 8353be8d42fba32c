"""Config nodes with a ``_target_``: built by Hydra, with one-sentence errors.

Serving (``inkfw.speculative.factory``) and training (``inkfw.train.run``) build every component
through :func:`build_node`, and call the ``_partial_`` ones (the optimizer, the scheduler) through
:func:`call_node`, so a bad node reads the same wherever it is.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, cast

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import OmegaConf

from inkfw.cli_args import one_line
from inkfw.errors import ConfigError, InkfwError


def build_node(group: str, node: Any, **kwargs: Any) -> Any:
    """``instantiate(node, **kwargs)``; inkfw's own errors pass through, Hydra's become one
    :class:`ConfigError` naming the group and the target. A setting given as text where the
    target takes a number or a boolean (``kv.enable_prefix_caching=maybe``, which the target
    would take as true) is refused first (:func:`check_setting_types`)."""
    check_setting_types(group, node)
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, InkfwError):
            raise cause from None
        detail = one_line(cause if cause is not None else exc).rstrip(".")
        target = node.get("_target_") if hasattr(node, "get") else None
        raise ConfigError(f"{group}: cannot build {target!r} ({detail}).") from exc


def call_node(group: str, factory: Callable[..., Any], *args: Any) -> Any:
    """Call a ``_partial_`` node that :func:`build_node` built, with the arguments only the caller
    has (the optimizer's parameters, the scheduler's optimizer). Settings the target refuses
    (``optim.lr=abc``, ``optim.lr=-1``) become one :class:`ConfigError` naming the group."""
    try:
        return factory(*args)
    except InkfwError:
        raise
    except (TypeError, ValueError, IndexError) as exc:
        func, settings = (factory.func, factory.keywords) if isinstance(factory, partial) else (factory, {})
        name = f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', func)!s}".lstrip(".")
        detail = one_line(exc).rstrip(".")
        raise ConfigError(
            mistyped_setting(group, func, settings) or f"{group}: cannot build {name!r} ({detail})."
        ) from exc


def check_setting_types(group: str, node: Any) -> None:
    """Raise one :class:`ConfigError` for a setting of ``node`` given as text where its target's
    signature takes a number or a boolean (see :func:`mistyped_setting`), before it is built."""
    mistyped = mistyped_node_setting(group, node)
    if mistyped:
        raise ConfigError(mistyped)


def mistyped_node_setting(group: str, node: Any) -> str | None:
    """:func:`mistyped_setting` for a config node and its ``_target_``; None where the target does
    not import (building it says so) or the node does not resolve. A setting that only points
    at another option (``beta: ${loss.beta}``) is named by that option, the one the user sets."""
    target = node.get("_target_") if hasattr(node, "get") else None
    try:
        settings = {k: v for k, v in node.items() if not str(k).startswith("_")}
        raw = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else {}
        names = {
            str(k): match.group(1)
            for k, v in cast(dict, raw).items()
            if isinstance(v, str) and (match := re.fullmatch(r"\$\{([\w.]+)\}", v))
        }
        return mistyped_setting(group, get_object(target), settings, names) if isinstance(target, str) else None
    except Exception:
        return None


def mistyped_setting(
    group: str, target: Any, settings: Mapping[str, Any], names: Mapping[str, str] | None = None
) -> str | None:
    """The first setting given as text where the target's signature takes only numbers or
    booleans (``trainer.max_steps=abc``, whose own error reads ``'<' not supported between
    instances of 'str' and 'int'``), as one sentence; None when there is none or the target's
    type hints cannot be read. ``names``: the option to name for a setting (default
    ``group.setting``)."""
    hints = setting_hints(target)
    for key, value in settings.items():
        hint = hints.get(str(key))
        if not isinstance(value, str) or hint is None:
            continue
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        accepted: set[Any] = set()
        for arg in typing.get_args(hint) if union else (hint,):  # Literal["all"] takes text, Literal[16] a number
            is_literal = typing.get_origin(arg) is typing.Literal
            accepted |= {type(v) for v in typing.get_args(arg)} if is_literal else {arg}
        if str in accepted or not accepted & {bool, int, float}:
            continue
        kind = "a number" if float in accepted else "an integer" if int in accepted else "true or false"
        if type(None) in accepted:  # the messages of inkfw.options' optional_* checks
            kind = "null, true or false" if kind == "true or false" else f"null or {kind}"
        name = (names or {}).get(str(key), f"{group}.{key}")
        return f"{name} must be {kind}, got {value!r}."
    return None


def setting_hints(target: Any) -> dict[str, Any]:
    """The type hints of ``target``'s parameters. A class: those of its ``__init__`` and of its
    bases' (a subclass that passes ``**kwargs`` on takes its bases' settings). Where one hint
    names what only type checkers import (``kernels: Kernels | None``), the others are read one
    by one and that one is left out; {} where none can be read."""
    if isinstance(target, type):
        hints: dict[str, Any] = {}
        for cls in reversed(target.__mro__):
            if "__init__" in vars(cls) and cls is not object:
                hints |= _function_hints(vars(cls)["__init__"])
        return hints
    return _function_hints(target)


def _function_hints(fn: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:
        pass
    namespace = getattr(fn, "__globals__", {})
    hints: dict[str, Any] = {}
    for name, hint in getattr(fn, "__annotations__", {}).items():
        try:
            hints[name] = eval(hint, namespace) if isinstance(hint, str) else hint
        except Exception:
            continue
    return hints
