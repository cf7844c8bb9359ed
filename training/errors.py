"""Errors of the training side that the CLI reports as one line (no torch import here)."""


class TrainingError(Exception):
    """Training cannot start or continue (bad resume state, NaN weights, ...)."""


class ExportError(Exception):
    """The exported ONNX graph disagrees with the torch model."""
