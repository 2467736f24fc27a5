"""disttensor: distributed N-D arrays over MPI, with halos and redistribution.

Importing the package completes :class:`DistArray`: :mod:`.redistribute`,
:mod:`.halo` and :mod:`.ops` attach its data-movement methods and NumPy
protocols (the array module itself imports none of them).
"""

try:  # one clear message instead of the MPI loader's traceback
    from mpi4py import MPI as _MPI
except (ImportError, RuntimeError) as _exc:
    raise ImportError(
        f"disttensor needs an MPI library and none could be loaded ({str(_exc).splitlines()[0]}"
        "). Install one with `pip install \"disttensor[mpich]\"`, or load your cluster's MPI "
        "(e.g. `module load mpi`) before starting Python.") from None
del _MPI

from . import (
    ops,  # noqa: F401  (importing it attaches the NumPy protocols to DistArray)
    random,
)
from .array import DistArray
from .creation import arange, asarray, empty, full, make_distribution, ones, zeros
from .device import gpu_aware_mpi, nccl_enabled, node_local_rank, set_transport, use_device
from .distribution import Distribution, block_boundaries
from .grid import ProcessGrid, factorizations
from .halo import halo_accumulate, halo_plan
from .redistribute import redistribution_plan
from .runtime import abort_on_exception, limit_blas_threads

__all__ = [
    "DistArray",
    "Distribution",
    "ProcessGrid",
    "abort_on_exception",
    "arange",
    "asarray",
    "block_boundaries",
    "empty",
    "factorizations",
    "full",
    "gpu_aware_mpi",
    "halo_accumulate",
    "halo_plan",
    "limit_blas_threads",
    "make_distribution",
    "nccl_enabled",
    "node_local_rank",
    "ones",
    "random",
    "redistribution_plan",
    "set_transport",
    "use_device",
    "zeros",
]
__version__ = "0.1.0"

from .runtime import _install_default as _install  # noqa: E402

_install()
del _install
