"""Typed errors raised while loading a model; each message says what is wrong and where."""


class ModelLoadError(Exception):
    """A checkpoint could not be loaded (missing/truncated file, bad config, shape mismatch)."""


class UnsupportedArchitecture(ModelLoadError):
    """The checkpoint's architecture is not one this service implements."""
