"""PyTorch on distributed blocks: the library's data movements as autograd functions.

:mod:`disttensor_nn.torch.functional` holds halo exchange, redistribution,
gather, scatter, all-reduce and broadcast as :class:`torch.autograd.Function`
s whose backward pass is the movement's adjoint, for people who write their
own distributed layers in PyTorch (see ``docs/torch.md``). Each takes this
rank's block as a tensor and the :class:`~disttensor.Distribution` it
belongs to, and returns a tensor. :func:`parallelize`
(:mod:`disttensor_nn.torch.parallel`) runs an unchanged ``torch.nn.Module`` on
distributed blocks with them.

PyTorch is optional (``pip install "disttensor[torch]"``): importing
:mod:`disttensor_nn` never imports it, and importing this package without it
raises an ImportError that names the extra.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (the one place that says what is missing)
except ImportError as err:
    raise ImportError(
        'disttensor_nn.torch needs PyTorch: pip install "disttensor[torch]"'
    ) from err

from .functional import (
    all_reduce,
    broadcast,
    extended_distribution,
    gather,
    halo_accumulate,
    halo_exchange,
    redistribute,
    scatter,
)
from .parallel import ParallelModule, parallelize

__all__ = [
    "ParallelModule",
    "all_reduce",
    "broadcast",
    "extended_distribution",
    "gather",
    "halo_accumulate",
    "halo_exchange",
    "parallelize",
    "redistribute",
    "scatter",
]
