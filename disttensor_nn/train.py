"""Former path of :mod:`disttensor_nn.training.driver`, kept as an alias.

Import :class:`~disttensor_nn.training.TrainConfig` and
:func:`~disttensor_nn.training.train` from :mod:`disttensor_nn.training`.
``python -m disttensor_nn.train`` is ``disttensor-train``.
"""

import sys

from .training.cli import train_main
from .training.driver import TrainConfig, train

__all__ = ["TrainConfig", "train"]

if __name__ == "__main__":
    sys.exit(train_main())
