"""Triton kernels, each next to its plain-torch reference. Imported as ``inkfw.kernels``."""
