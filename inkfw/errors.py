"""User-facing errors: one clear sentence, no traceback unless ``debug=true``."""


class InkfwError(Exception):
    """An error caused by the user's input (config, checkpoint, prompt), not by a bug."""


class CheckpointError(InkfwError):
    """A checkpoint file or tensor is missing, unexpected, malformed or of the wrong shape."""


class ConfigError(InkfwError):
    """A configuration value is missing or out of range."""
