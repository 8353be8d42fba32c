"""Where inkfw finds its files. Everything that needs the Hydra config folder asks
:func:`config_dir`; the folder ships inside the package (``inkfw/conf``), so an installed
inkfw (``pip install .``) finds it from any working directory."""

from __future__ import annotations

from pathlib import Path


def package_dir() -> Path:
    """The ``inkfw`` package folder (in the checkout, or in site-packages when installed)."""
    return Path(__file__).resolve().parent


def project_root() -> Path:
    """The folder holding the ``inkfw`` package: the checkout for a source or editable install
    (site-packages for an installed wheel; :func:`checkout_root` tells the two apart)."""
    return package_dir().parent


def checkout_root() -> Path | None:
    """The source checkout (the folder with ``pyproject.toml``) when inkfw runs from one, else None."""
    root = project_root()
    return root if (root / "pyproject.toml").is_file() else None


def config_dir() -> Path:
    """The Hydra config folder ``inkfw/conf`` (``infer.yaml``, ``train.yaml`` and the groups)."""
    return package_dir() / "conf"
