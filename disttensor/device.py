"""Device choice: which accelerator and array module this rank computes with, and how it talks.

One rank drives one GPU. :func:`use_device` picks the GPU from the rank's
position among the ranks of its node and returns the array module (CuPy) that
allocates there; ``device="cpu"`` returns NumPy. The transport options say
how GPU buffers travel between ranks: straight from device memory when the
MPI library is CUDA-aware (:func:`gpu_aware_mpi`), otherwise staged through
page-locked host buffers; NCCL (:func:`nccl_enabled`) optionally replaces MPI
for the gradient allreduce and the halo messages of GPU arrays.

Each option has a launch-level override in the environment, read when the
option is asked for:

``DISTTENSOR_GPU_AWARE_MPI=0|1``
    Force host staging (0) or device buffers handed to MPI (1), whatever the
    detection says.
``DISTTENSOR_NCCL=0|1``
    Use NCCL for GPU arrays (1) or not (0, the default).

:func:`set_transport` sets them from Python instead (it wins over the
environment). Every rank must make the same choice: the ranks of one
exchange have to agree on the transport.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = [
    "gpu_aware_mpi",
    "nccl_enabled",
    "node_local_rank",
    "resolve_array_module",
    "set_transport",
    "use_device",
]

DEVICES = ("cpu", "gpu")

_local_rank: int | None = None
_chosen_gpu: int | None = None
_options: dict[str, bool | None] = {"gpu_aware_mpi": None, "nccl": None}
_detected: bool | None = None


def node_local_rank(comm: MPI.Intracomm | None = None) -> int:
    """This rank's index among the ranks of ``comm`` that share its node (collective).

    Computed once per process with ``MPI_Comm_split_type(COMM_TYPE_SHARED)``
    and cached; later calls make no communication.

    Parameters
    ----------
    comm : MPI.Intracomm, optional
        The communicator to split (``MPI.COMM_WORLD`` by default). Only the
        first call splits, so every rank must make that first call together.
    """
    global _local_rank
    if _local_rank is None:
        comm = MPI.COMM_WORLD if comm is None else comm
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            _local_rank = node.Get_rank()
        finally:
            node.Free()
    return _local_rank


def _import_cupy() -> ModuleType:
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError(
            "device='gpu' needs CuPy (pip install 'disttensor[gpu]'); it could not be "
            f"imported: {err}"
        ) from None
    return cupy


def _gpu_count(cupy: ModuleType) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device: CuPy raises its runtime error
        return 0


def use_device(device: str = "gpu", comm: MPI.Intracomm | None = None) -> ModuleType:
    """Choose this rank's device and return the array module that allocates on it.

    Parameters
    ----------
    device : {'gpu', 'cpu'}
        ``'cpu'``: NumPy, nothing else happens. ``'gpu'``: CuPy, after making
        GPU ``node_local_rank % gpu_count`` this process's current device
        (the first call chooses; later calls return CuPy at once).
    comm : MPI.Intracomm, optional
        Communicator over which ranks are counted per node (first GPU call
        only; collective then). ``MPI.COMM_WORLD`` by default.

    Returns
    -------
    module
        ``numpy`` or ``cupy``.

    Raises
    ------
    ValueError
        For an unknown device name.
    RuntimeError
        When CuPy cannot be imported or no GPU is visible. Raised before any
        communication, identically on every rank of a uniform job.
    """
    global _chosen_gpu
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {DEVICES}")
    if device == "cpu":
        return np
    cupy = _import_cupy()
    count = _gpu_count(cupy)
    if count == 0:
        raise RuntimeError("device='gpu' but CuPy sees no GPU on this node")
    if _chosen_gpu is None:
        index = node_local_rank(comm) % count
        cupy.cuda.Device(index).use()
        _chosen_gpu = index
    return cupy


def resolve_array_module(xp: ModuleType | None, device: Any,
                         comm: MPI.Intracomm | None = None) -> tuple[ModuleType, Any]:
    """The array module and device placement that ``xp=`` and ``device=`` ask for.

    ``device`` is ``'cpu'`` or ``'gpu'`` (see :func:`use_device`), or, with
    ``xp`` an array API namespace, one of that namespace's device objects.
    Returns ``(module, placement)`` where ``placement`` is None or the device
    object to pass to the module's creation functions.
    """
    if isinstance(device, str):
        chosen = use_device(device, comm)
        if xp is not None and xp is not chosen:
            raise ValueError(f"xp={xp.__name__} contradicts device={device!r}")
        return chosen, None
    if xp is None:
        if device is not None:
            raise ValueError(f"device={device!r} needs xp= (or the name 'cpu' or 'gpu')")
        return np, None
    return xp, device


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 0 or 1")


def _detect_gpu_aware() -> bool:
    """What the MPI library says about CUDA device buffers (False when it cannot say)."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # pragma: no cover - depends on the MPI build
            return False
    try:  # Open MPI and MPICH export the extension from the library mpi4py is linked to
        import ctypes

        fn = getattr(ctypes.CDLL(MPI.__file__), "MPIX_Query_cuda_support", None)
        if fn is None:
            return False
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return bool(fn())
    except OSError:  # pragma: no cover - a statically linked or unusual build
        return False


def gpu_aware_mpi() -> bool:
    """Whether GPU buffers are handed to MPI as device memory (else staged through the host).

    In order: :func:`set_transport`'s ``gpu_aware_mpi``, the environment
    variable ``DISTTENSOR_GPU_AWARE_MPI=0|1``, then the MPI library's own
    answer (``MPIX_Query_cuda_support``; False where it has none).
    """
    global _detected
    chosen = _options["gpu_aware_mpi"]
    if chosen is not None:
        return chosen
    env = _env_flag("DISTTENSOR_GPU_AWARE_MPI")
    if env is not None:
        return env
    if _detected is None:
        _detected = _detect_gpu_aware()
    return _detected


def nccl_enabled() -> bool:
    """Whether GPU arrays use NCCL for the sum allreduce and the halo messages.

    :func:`set_transport`'s ``nccl``, else ``DISTTENSOR_NCCL=0|1``, else False.
    """
    chosen = _options["nccl"]
    if chosen is not None:
        return chosen
    return bool(_env_flag("DISTTENSOR_NCCL"))


def set_transport(*, gpu_aware_mpi: bool | None = None, nccl: bool | None = None) -> None:
    """Choose how GPU buffers travel (every rank must make the same call).

    Parameters
    ----------
    gpu_aware_mpi : bool or None
        True: hand device buffers to MPI; False: stage through page-locked
        host buffers; None: back to the environment variable or detection.
    nccl : bool or None
        True: NCCL for the sum allreduce and the halo messages of GPU arrays;
        False: MPI only; None: back to ``DISTTENSOR_NCCL``.
    """
    _options["gpu_aware_mpi"] = None if gpu_aware_mpi is None else bool(gpu_aware_mpi)
    _options["nccl"] = None if nccl is None else bool(nccl)
