"""Config nodes with a ``_target_``: built by Hydra, with one-sentence errors.

Serving (``inkfw.speculative.factory``) and training (``inkfw.train.run``) build every component
through :func:`build_node`, so a bad node reads the same wherever it is.
"""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from inkfw.errors import ConfigError, InkfwError


def build_node(group: str, node: Any, **kwargs: Any) -> Any:
    """``instantiate(node, **kwargs)``; inkfw's own errors pass through, Hydra's become one
    :class:`ConfigError` naming the group and the target."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, InkfwError):
            raise cause from None
        lines = str(cause if cause is not None else exc).splitlines()
        detail = " ".join(ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("full_key"))
        target = node.get("_target_") if hasattr(node, "get") else None
        raise ConfigError(f"{group}: cannot build {target!r} ({detail.rstrip('.')}).") from exc
