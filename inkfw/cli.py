"""What every entry point shares: one clear line and a non-zero exit on bad input."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inkfw.errors import InkfwError
from inkfw.options import bool_option

EXIT_USER_ERROR = 2


def run_user_command(fn: Callable[[Any], Any], cfg: Any) -> Any:
    """Run ``fn(cfg)``; turn an :class:`InkfwError` into ``error: <sentence>`` on stderr and exit 2.

    With ``debug=true`` the full traceback is shown instead.
    """
    debug = False
    try:
        debug = bool_option(cfg.get("debug", False), "debug")  # first: it decides how other errors read
        return fn(cfg)
    except InkfwError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def check_group_choices(conf_dir: str | Path, argv: Sequence[str] | None = None) -> None:
    """Reject ``group=option`` overrides naming an option that ``conf_dir/group/`` lacks.

    Hydra reports those with a multi-line error before any of our code runs; call this before
    ``hydra.main`` to print ``error: unknown drafter 'foo'; choose one of mtp, ngram, none.``
    and exit 2 instead. Only groups that are folders of ``*.yaml`` files are checked; sweeps
    (``a,b``) are checked item by item, anything else Hydra parses is left to Hydra.
    """
    conf_dir = Path(conf_dir)
    for arg in sys.argv[1:] if argv is None else argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        group = key.lstrip("+")
        if not group or group.startswith("hydra") or "." in group or "@" in group:
            continue
        options = sorted(p.stem for p in (conf_dir / group).glob("*.yaml")) if (conf_dir / group).is_dir() else []
        if not options or any(c in value for c in "()[]{}$"):
            continue
        for choice in value.split(","):
            choice = choice.strip().strip("'\"")
            if choice not in options and choice.lower() != "null":
                print(f"error: unknown {group} {choice!r}; choose one of {', '.join(options)}.", file=sys.stderr)
                sys.exit(EXIT_USER_ERROR)
