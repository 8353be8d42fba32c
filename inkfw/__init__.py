"""inkfw: one set of Inkling MTP modules for training extra depths and serving multi-depth
speculative decoding."""

__version__ = "0.1.0"
