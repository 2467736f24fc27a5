"""Former path of :mod:`disttensor_nn.training.plot`, kept as an alias."""

import sys

from .training.plot import plot_main, plot_metrics

__all__ = ["plot_metrics", "plot_main"]

if __name__ == "__main__":
    sys.exit(plot_main())
