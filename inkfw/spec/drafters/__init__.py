"""Drafters: ``mtp`` (multi-depth MTP), ``ngram`` (prompt lookup), ``none`` (autoregressive)."""

from inkfw.spec.drafters.mtp import MtpDrafter
from inkfw.spec.drafters.ngram import NgramDrafter
from inkfw.spec.drafters.none import NoDrafter

__all__ = ["MtpDrafter", "NgramDrafter", "NoDrafter"]
