"""Former path of :mod:`disttensor_nn.training.checkpoint`, kept as an alias."""

from .training.checkpoint import FORMAT, VERSION, CheckpointError, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "FORMAT", "VERSION"]
