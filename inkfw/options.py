"""Checks of a program's integer and true/false options (Hydra settings): a value of the wrong
type or out of range is one :class:`~inkfw.errors.ConfigError` sentence naming the option, never
a traceback from ``int('abc')`` further on, nor a switch that ``bool('maybe')`` turns on."""

from __future__ import annotations

from typing import Any

from inkfw.errors import ConfigError


def is_int(x: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def int_option(value: Any, what: str, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum``; else one sentence naming ``what``."""
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}.")
    return value


def optional_int_option(value: Any, what: str, minimum: int = 1) -> int | None:
    """:func:`int_option`, where null (None) is allowed too."""
    if value is not None and (not is_int(value) or value < minimum):
        raise ConfigError(f"{what} must be null or an integer >= {minimum}, got {value!r}.")
    return value


def bool_option(value: Any, what: str) -> bool:
    """``value`` if it is true or false; else one sentence naming ``what`` (``bool('maybe')`` is
    True, so a mistyped switch would otherwise turn itself on)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{what} must be true or false, got {value!r}.")
    return value


def optional_bool_option(value: Any, what: str) -> bool | None:
    """:func:`bool_option`, where null (None) is allowed too."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{what} must be null, true or false, got {value!r}.")
    return value
