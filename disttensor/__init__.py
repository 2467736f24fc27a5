"""disttensor: distributed N-D arrays over MPI, with halos and redistribution.

Importing the package completes :class:`DistArray`: :mod:`.redistribute`,
:mod:`.halo` and :mod:`.ops` attach its data-movement methods and NumPy
protocols, :mod:`.io` its writers (the array module itself imports none of
them).
"""

from . import (
    _mpi_check,  # noqa: F401  (first: a missing MPI library raises one clear ImportError)
    ops,  # noqa: F401  (importing it attaches the NumPy protocols to DistArray)
    random,
)
from .array import DistArray
from .blockcache import BlockCache, block_cache
from .creation import arange, asarray, empty, full, make_distribution, ones, zeros
from .device import gpu_aware_mpi, nccl_enabled, node_local_rank, set_transport, use_device
from .distribution import Distribution, block_boundaries
from .grid import ProcessGrid, factorizations
from .halo import halo_accumulate, halo_plan
from .io import chunk_splits, from_hdf5, from_npy, from_zarr, npy_header, to_npy, to_zarr
from .redistribute import redistribution_plan
from .runtime import abort_on_exception, limit_blas_threads, node_share
from .settings import CollectiveMismatchError, get_options, options, set_options

__all__ = [
    "BlockCache",
    "CollectiveMismatchError",
    "DistArray",
    "Distribution",
    "ProcessGrid",
    "abort_on_exception",
    "arange",
    "asarray",
    "block_boundaries",
    "block_cache",
    "chunk_splits",
    "empty",
    "factorizations",
    "from_hdf5",
    "from_npy",
    "from_zarr",
    "full",
    "get_options",
    "gpu_aware_mpi",
    "halo_accumulate",
    "halo_plan",
    "limit_blas_threads",
    "node_share",
    "make_distribution",
    "nccl_enabled",
    "node_local_rank",
    "npy_header",
    "ones",
    "options",
    "random",
    "redistribution_plan",
    "set_options",
    "set_transport",
    "to_npy",
    "to_zarr",
    "use_device",
    "zeros",
]
__version__ = "0.1.0"

from .runtime import _install_default as _install  # noqa: E402

_install()
del _install
