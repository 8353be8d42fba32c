"""Where inkfw finds its files. Everything that needs the Hydra config folder asks
:func:`config_dir`, so the folder can move (e.g. inside the package) in one place."""

from __future__ import annotations

from pathlib import Path


def project_root() -> Path:
    """The checkout holding the ``inkfw`` package (editable installs)."""
    return Path(__file__).resolve().parent.parent


def config_dir() -> Path:
    """The Hydra config folder (``conf/``: ``infer.yaml``, ``train.yaml`` and the groups)."""
    return project_root() / "conf"
