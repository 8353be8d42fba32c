from inkfw.models.inkling.model import InklingBackbone, InklingLM
from inkfw.models.inkling.mtp import MtpDepth, MtpStack

__all__ = ["InklingBackbone", "InklingLM", "MtpDepth", "MtpStack"]
