"""The errors of `cognet-export` (`ParityError` is shared: `cognet.core.errors`)."""

from cognet.core.errors import InputError


class ExportError(RuntimeError):
    """An exported graph is malformed (checker failure, specialised axis, ...)."""


class TensorRTUnavailable(InputError):
    """--tensorrt on a machine without TensorRT or a GPU (exit code 2)."""
