"""Triton kernels, each next to its plain-torch reference (docs/design.md §5).

Each module holds ``<op>_reference`` (torch, the ground truth) and ``<op>_triton`` with the same
signature. :class:`Kernels` binds one implementation of every op for the engine; the choice is
``kernels.backend`` (``inkfw/conf/kernels/default.yaml``):

* ``auto``: Triton on CUDA, torch on CPU;
* ``triton``: Triton everywhere. On CPU the kernels run in Triton's interpreter
  (``TRITON_INTERPRET=1``, chosen by :func:`prepare_backend` before Triton is imported): exact
  but slow, for tests;
* ``torch``: the references, i.e. the model's own modules.

With torch, the paged attention and the cached short convolutions run as the model's modules
(:class:`~inkfw.models.inkling.layers.Attention` over :class:`~inkfw.cache.paged.StepView`s, which
the references restate op for op); with Triton the paged cache hands the layers the fused kernels
(:attr:`Kernels.fused`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from inkfw.errors import ConfigError

BACKENDS = ("auto", "triton", "torch")

# op -> module of inkfw.kernels that holds <op>_reference and <op>_triton
OPS = {
    "paged_span_attention": "paged_attention",
    "cached_short_conv": "short_conv",
    "greedy_accept": "acceptance",
    "rejection_sample": "acceptance",
    "prepare_draft_spans": "draft_span",
    "mtp_depth_input": "depth_input",
}


def check_backend(backend: object) -> str:
    """``backend`` if it names a backend, else a one-sentence :class:`ConfigError`."""
    if backend not in BACKENDS:
        raise ConfigError(f"kernels.backend must be one of {', '.join(BACKENDS)}, got {backend!r}.")
    return str(backend)


def use_interpreter() -> bool:
    """Choose Triton's interpreter (``TRITON_INTERPRET=1``) if Triton is not imported yet, and say
    whether it runs interpreted. Triton fixes the choice when ``triton.language`` is imported
    (its own ``@triton.jit`` functions are built then), and loading a model may import it, so
    call this before the model is built."""
    if "triton" not in sys.modules and os.environ.get("TRITON_INTERPRET") is None:
        os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl

    return type(tl.zeros).__name__ == "InterpretedFunction"


def prepare_backend(backend: object, device: str | None) -> str:
    """Validate ``backend`` before anything is built; for Triton without CUDA (``device`` is the
    config's ``device`` option: ``cpu``, ``cuda``, or ``auto``/None), choose the interpreter
    while that is still possible (:func:`use_interpreter`)."""
    backend = check_backend(backend)
    on_cpu = device == "cpu" or (device in (None, "auto") and not torch.cuda.is_available())
    if backend == "triton" and on_cpu:
        use_interpreter()
    return backend


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """``triton`` or ``torch`` for ``backend`` on ``device`` (``auto``: Triton on CUDA only)."""
    check_backend(backend)
    device = torch.device(device)
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not use_interpreter():
        raise ConfigError(
            "kernels.backend=triton on the CPU runs Triton's interpreter, which must be chosen before "
            "Triton is imported: set TRITON_INTERPRET=1 in the environment (or use kernels.backend=torch)."
        )
    return backend


def implementation(op: str, backend: str) -> Callable[..., Any]:
    """The ``backend`` (``triton`` | ``torch``) implementation of ``op`` (a key of :data:`OPS`)."""
    module = importlib.import_module(f"{__name__}.{OPS[op]}")
    return getattr(module, f"{op}_{'triton' if backend == 'triton' else 'reference'}")


class Kernels:
    """One implementation of every op (:data:`OPS`), bound as attributes of the same names
    (``inkfw/conf/kernels``; the factory passes the model's ``device``)."""

    paged_span_attention: Callable[..., Any]
    cached_short_conv: Callable[..., Any]
    greedy_accept: Callable[..., Any]
    rejection_sample: Callable[..., Any]
    prepare_draft_spans: Callable[..., Any]
    mtp_depth_input: Callable[..., Any]

    def __init__(self, backend: str = "auto", device: torch.device | str = "cpu"):
        self.backend = resolve_backend(backend, device)
        for op in OPS:
            setattr(self, op, implementation(op, self.backend))

    @property
    def fused(self) -> bool:
        """The paged cache hands the layers fused attention and conv kernels (else: the modules)."""
        return self.backend == "triton"

    def __repr__(self) -> str:
        return f"Kernels(backend={self.backend!r})"
