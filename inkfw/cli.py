"""What every entry point shares: one clear line and a non-zero exit on bad input."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from inkfw.errors import InkfwError

EXIT_USER_ERROR = 2


def run_user_command(fn: Callable[[Any], Any], cfg: Any) -> Any:
    """Run ``fn(cfg)``; turn an :class:`InkfwError` into ``error: <sentence>`` on stderr and exit 2.

    With ``debug=true`` the full traceback is shown instead.
    """
    try:
        return fn(cfg)
    except InkfwError as exc:
        if bool(cfg.get("debug", False)):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
