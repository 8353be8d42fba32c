"""inkfw.options: the numeric option checks every program shares."""

from __future__ import annotations

import pytest

from inkfw.errors import ConfigError
from inkfw.options import bool_option, int_option, is_int, optional_bool_option, optional_int_option


def test_integers_at_or_above_the_minimum_pass():
    assert int_option(3, "steps") == 3 and int_option(0, "seed", 0) == 0
    assert optional_int_option(None, "threads") is None and optional_int_option(2, "threads") == 2
    assert is_int(5) and not is_int(True) and not is_int(2.0) and not is_int("2")


@pytest.mark.parametrize("value", ["abc", "3", 2.5, True, 0, -1, None])
def test_anything_else_is_one_sentence_naming_the_option(value):
    with pytest.raises(ConfigError, match=rf"^steps must be an integer >= 1, got {value!r}\.$"):
        int_option(value, "steps")


@pytest.mark.parametrize("value", ["abc", False, 0])
def test_null_is_the_only_extra_value_an_optional_option_takes(value):
    with pytest.raises(ConfigError, match=rf"^threads must be null or an integer >= 1, got {value!r}\.$"):
        optional_int_option(value, "threads")


@pytest.mark.parametrize("value", ["maybe", "true", 1, 0, None])
def test_a_switch_takes_true_or_false_only(value):
    """``bool('maybe')`` is True: a switch read with ``bool()`` would turn itself on."""
    assert bool_option(True, "plot") is True and bool_option(False, "plot") is False
    with pytest.raises(ConfigError, match=rf"^plot must be true or false, got {value!r}\.$"):
        bool_option(value, "plot")


def test_null_is_the_only_extra_value_an_optional_switch_takes():
    assert optional_bool_option(None, "engine.cuda_graphs") is None and optional_bool_option(False, "x") is False
    with pytest.raises(ConfigError, match=r"^engine.cuda_graphs must be null, true or false, got 'maybe'\.$"):
        optional_bool_option("maybe", "engine.cuda_graphs")
