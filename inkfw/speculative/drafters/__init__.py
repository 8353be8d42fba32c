"""Drafters: ``mtp`` (multi-depth MTP), ``ngram`` (prompt lookup), ``none`` (autoregressive)."""

from inkfw.speculative.drafters.mtp import MtpDrafter
from inkfw.speculative.drafters.ngram import NgramDrafter
from inkfw.speculative.drafters.none import NoDrafter

__all__ = ["MtpDrafter", "NgramDrafter", "NoDrafter"]
