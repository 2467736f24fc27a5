"""Former path of :mod:`disttensor_nn.training.checkpoint`, kept as an alias."""

from .training.checkpoint import (  # noqa: F401 (former public names outside __all__)
    FORMAT,
    MANIFEST,
    STATE,
    VERSION,
    CheckpointError,
    load_checkpoint,
    named_buffers,
    named_parameters,
    save_checkpoint,
)

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "FORMAT", "VERSION"]
