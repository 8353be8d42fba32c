"""Command-line arguments handled before Hydra: verbatim ``prompt=`` / ``stop=`` text and
one-line errors for overrides Hydra cannot use.

Hydra parses every ``key=value`` with its override grammar, in which ``( ) [ ] { } , : ' "``
and ``$`` mean something, so ``prompt="def main():"`` fails with a grammar error. Entry
scripts call :func:`prepare_argv` before their ``@hydra.main`` function:

* every ``prompt=TEXT`` and ``stop=TEXT`` argument (also with a leading ``+`` or ``++``) is
  taken out of ``sys.argv`` and its TEXT kept exactly as the shell passed it; ``prompt=-``
  reads the prompt from standard input. Several ``stop=`` arguments give several stop strings;
  an empty ``stop=`` gives none;
* in their place go the overrides ``prompt=${inkfw.verbatim:prompt}`` (and the same for
  ``stop``); the OmegaConf resolver ``inkfw.verbatim`` returns the kept text, and OmegaConf never
  parses or resolves what a resolver returns, so the text reaches the program unchanged;
* the remaining overrides are parsed and composed once against the script's config; an error
  there is printed as one ``error: ...`` line and the script exits with code 2 (instead of
  Hydra's multi-line report and exit code 1).

Every entry point calls :func:`check_command_line` (which does this, then
:func:`inkfw.cli.check_group_choices`) before its ``@hydra.main`` app.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from inkfw.cli import EXIT_USER_ERROR, check_group_choices
from inkfw.paths import config_dir

RESOLVER = "inkfw.verbatim"
VERBATIM_KEYS = ("prompt", "stop")
STDIN_MARK = "-"

# text of the verbatim arguments of this process, read by the resolver
_VERBATIM: dict[str, Any] = {}

# Hydra options that take a value as the next argument (``--info`` only one of _INFO_VALUES)
_FLAGS_WITH_VALUE = {
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
}
_INFO_FLAGS = {"--info", "-i"}
_INFO_VALUES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
# Hydra options after which the overrides are not composed into one job here
_NO_COMPOSE_FLAGS = {
    "--multirun",
    "-m",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--hydra-help",
    "--help",
    "-h",
    "--version",
    "--shell-completion",
    "-sc",
}


def _takes_value(arg: str, following: str | None) -> bool:
    """Whether Hydra option ``arg`` consumes the next argument ``following``."""
    return arg in _FLAGS_WITH_VALUE or (arg in _INFO_FLAGS and following in _INFO_VALUES)


def _resolve(key: str) -> Any:
    if key not in _VERBATIM:
        raise KeyError(f"no verbatim argument {key!r} was given on the command line")
    return _VERBATIM[key]


def register_resolver() -> None:
    """Register the ``inkfw.verbatim`` resolver once per process."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, _resolve)


def _verbatim_key(arg: str) -> tuple[str, str] | None:
    """(key, text) when ``arg`` is ``prompt=TEXT`` or ``stop=TEXT`` (optionally ``+``/``++``)."""
    if "=" not in arg:
        return None
    key, text = arg.split("=", 1)
    key = key.lstrip("+")
    if key not in VERBATIM_KEYS or arg.startswith("+++"):
        return None
    return key, text


def extract_verbatim(argv: Sequence[str], stdin=None) -> tuple[list[str], dict[str, Any]]:
    """Split ``argv`` (without the program name) into the arguments Hydra should see and the
    verbatim values: ``{"prompt": str}`` and/or ``{"stop": [str, ...]}``.

    Arguments after a Hydra option that takes a value (``-cn NAME``) are left alone.
    """
    rest: list[str] = []
    values: dict[str, Any] = {}
    skip_next = False
    for i, arg in enumerate(argv):
        if skip_next:
            rest.append(arg)
            skip_next = False
            continue
        if _takes_value(arg, argv[i + 1] if i + 1 < len(argv) else None):
            rest.append(arg)
            skip_next = True
            continue
        found = _verbatim_key(arg)
        if found is None:
            rest.append(arg)
            continue
        key, text = found
        if key == "prompt":
            if text == STDIN_MARK:
                stream = stdin if stdin is not None else sys.stdin
                text = stream.read()
            values["prompt"] = text
        else:
            stops = values.setdefault("stop", [])
            if text:
                stops.append(text)
    return rest, values


def verbatim_overrides(values: dict[str, Any]) -> list[str]:
    """The Hydra overrides that make ``cfg.<key>`` resolve to the kept text."""
    return [f"{key}=${{{RESOLVER}:{key}}}" for key in VERBATIM_KEYS if key in values]


def one_line(exc: BaseException) -> str:
    """Hydra's multi-line report of ``exc`` (and its causes) as one sentence."""
    lines: list[str] = []
    cause: BaseException | None = exc
    while cause is not None:
        for line in str(cause).splitlines():
            line = line.strip()
            if line.startswith(("Config search path", "Set the environment variable HYDRA_FULL_ERROR")):
                break
            if line and line not in lines and not line.startswith(("full_key:", "object_type=", "provider=")):
                lines.append(line)
        cause = cause.__cause__
    text = " ".join(lines)
    unknown_key = re.search(r"Could not override '([^']+)'.*To append to your config use (\S+)", text)
    if unknown_key and "not in struct" in text:
        return f"unknown option {unknown_key.group(1)!r}; to add a new key write {unknown_key.group(2)}."
    missing = re.search(r"Could not find '([^'/]+)/([^']+)'\s*Available options in '[^']+':\s*(.*)", text)
    if missing:
        group, choice, options = missing.groups()
        return f"unknown {group} {choice!r}; choose one of {', '.join(options.split())}."
    if not text:
        return f"{type(exc).__name__}."
    return "; ".join(line.rstrip(".") for line in lines) + "."


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def check_overrides(conf_dir: str | Path, config_name: str, args: Sequence[str], verbatim: bool = True) -> None:
    """Parse ``args``' overrides and compose ``config_name`` with them; exit 2 with one line if
    Hydra rejects them, or if one sets a value where the config holds a node of settings (which
    Hydra allows). Nothing is checked when a Hydra option changes what gets composed (``-m``,
    ``-cn`` ...)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    overrides: list[str] = []
    skip_next = False
    for i, arg in enumerate(args):
        if skip_next:
            skip_next = False
            continue
        if arg in _NO_COMPOSE_FLAGS or arg.startswith(("--config-path=", "--config-name=", "--config-dir=")):
            return
        if _takes_value(arg, args[i + 1] if i + 1 < len(args) else None):
            skip_next = True
            continue
        if arg.startswith("-"):
            continue
        overrides.append(arg)
    parser = OverridesParser.create()
    scalars: dict[str, str] = {}  # argument -> key, for a value override that is not null or a mapping
    for arg in overrides:
        try:
            parsed = parser.parse_override(arg)
            key = parsed.key_or_group
            is_group = (Path(conf_dir) / key).is_dir() or key.startswith("hydra")
            plain = not (is_group or parsed.package or parsed.is_delete() or parsed.is_sweep_override())
            if plain and parsed.value() is not None and not isinstance(parsed.value(), dict):
                scalars[arg] = key
        except (OverrideParseException, HydraException) as exc:
            reason = str(exc).strip().splitlines()[0].split(" expecting ")[0].strip() if str(exc).strip() else ""
            hint = ", or pass text through prompt=... / stop=..., which take it verbatim" if verbatim else ""
            _fail(
                f"cannot parse the argument {arg!r} ({reason or 'invalid syntax'}); quote values that hold "
                f"( ) [ ] {{ }} , : = or spaces as '\"...\"'{hint}."
            )
    if GlobalHydra.instance().is_initialized():
        return
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(Path(conf_dir).resolve())):
            compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
            # a value in place of a node of settings (``mtp=8``, ``output=out.json``) composes, and
            # the program would then silently run on its defaults: compare with the config without them
            if scalars:
                rest = [arg for arg in overrides if arg not in scalars]
                base = compose(config_name=config_name, overrides=rest, return_hydra_config=True)
                for arg, key in scalars.items():
                    node = OmegaConf.select(base, key, default=None)
                    if isinstance(node, DictConfig) and len(node):
                        names = [str(name) for name in node]
                        listed = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
                        _fail(
                            f"{key} is a group of settings ({listed}), not one value; "
                            f"set one of them, for example {key}.{names[0]}={arg.partition('=')[2]}."
                        )
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        _fail(one_line(exc))
    finally:
        GlobalHydra.instance().clear()


def prepare_argv(
    conf_dir: str | Path, config_name: str, argv: list[str] | None = None, stdin=None, verbatim: bool = True
) -> dict[str, Any]:
    """Handle ``prompt=`` / ``stop=`` verbatim (unless ``verbatim`` is False: scripts without
    those options) and check the overrides (see the module docstring); rewrites ``argv``
    (default ``sys.argv``) in place for ``@hydra.main``.

    Returns the verbatim values taken out.
    """
    argv = sys.argv if argv is None else argv
    rest, values = extract_verbatim(argv[1:], stdin=stdin) if verbatim else (list(argv[1:]), {})
    register_resolver()
    _VERBATIM.clear()
    _VERBATIM.update(values)
    overrides, flags = _split_flags(rest)
    overrides += verbatim_overrides(values)
    check_overrides(conf_dir, config_name, overrides + flags, verbatim)
    argv[1:] = overrides + flags  # overrides first: Hydra's argparse takes none after an option
    return values


def _split_flags(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(overrides, Hydra options with their values), each in the given order."""
    overrides: list[str] = []
    flags: list[str] = []
    take_value = False
    for i, arg in enumerate(args):
        if take_value:
            flags.append(arg)
            take_value = False
        elif arg.startswith("-"):
            flags.append(arg)
            take_value = _takes_value(arg, args[i + 1] if i + 1 < len(args) else None)
        else:
            overrides.append(arg)
    return overrides, flags


def check_command_line(config_name: str, verbatim: bool = False) -> dict[str, Any]:
    """What an entry point runs on ``sys.argv`` before its ``@hydra.main`` app for ``config_name``
    (a config of ``inkfw/conf``): :func:`prepare_argv` (``prompt=`` / ``stop=`` verbatim only
    with ``verbatim``) and :func:`inkfw.cli.check_group_choices`. A bad override or an unknown
    option ends the program with one ``error: ...`` line and exit code 2. Returns the verbatim
    values taken out."""
    values = prepare_argv(config_dir(), config_name, verbatim=verbatim)
    check_group_choices(config_dir())
    return values
