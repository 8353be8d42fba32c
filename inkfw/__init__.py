"""inkfw: one set of Inkling MTP modules for training extra depths and serving multi-depth
speculative decoding.

``from inkfw import LLM, SamplingParams`` is the Python API (:mod:`inkfw.llm`); it is loaded on
first use, so ``import inkfw`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamOutput", "__version__"]

if TYPE_CHECKING:
    from inkfw.llm import LLM, RequestOutput, SamplingParams, StreamOutput


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput", "SamplingParams", "StreamOutput"):
        from inkfw import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'inkfw' has no attribute {name!r}")
