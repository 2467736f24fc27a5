"""Former path of :mod:`disttensor_nn.training.driver`, kept as an alias.

Import :class:`~disttensor_nn.training.TrainConfig` and
:func:`~disttensor_nn.training.train` from :mod:`disttensor_nn.training`.
"""

from .training.driver import TrainConfig, train

__all__ = ["TrainConfig", "train"]
