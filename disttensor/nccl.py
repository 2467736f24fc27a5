"""NCCL through CuPy: one cached NCCL communicator per MPI communicator, sum allreduce, send/recv.

Used only when NCCL is enabled (:func:`disttensor.nccl_enabled`); CuPy's
``cupy.cuda.nccl`` is imported on first use. Every operation is queued on
CuPy's current stream, so kernels queued after it see its results without a
host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from .backend import numpy_dtype

__all__ = ["allreduce_sum", "communicator", "exchange", "supports"]

_keyval: int | None = None

# NCCL element types by NumPy dtype character (complex numbers reduce as pairs of reals)
_TYPES = {"i1": "NCCL_INT8", "u1": "NCCL_UINT8", "i4": "NCCL_INT32", "u4": "NCCL_UINT32",
          "i8": "NCCL_INT64", "u8": "NCCL_UINT64", "f2": "NCCL_FLOAT16", "f4": "NCCL_FLOAT32",
          "f8": "NCCL_FLOAT64"}
_COMPLEX = {"c8": "f4", "c16": "f8"}


def _nccl() -> Any:
    from cupy.cuda import nccl

    return nccl


def communicator(comm: MPI.Intracomm) -> Any:
    """The ``cupy.cuda.nccl.NcclCommunicator`` over the ranks of ``comm`` (collective).

    Created on first use (rank 0's unique id is broadcast over ``comm``) and
    cached as an attribute of ``comm``, so it lives as long as ``comm``.
    NCCL ranks are the ranks of ``comm``.
    """
    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval()
    nc = comm.Get_attr(_keyval)
    if nc is None:
        nccl = _nccl()
        uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
        uid = comm.bcast(uid, root=0)
        nc = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
        comm.Set_attr(_keyval, nc)
    return nc


def _kind(dtype: Any) -> str:
    dt = numpy_dtype(dtype)
    code = f"{dt.kind}{dt.itemsize}"
    return _COMPLEX.get(code, code)


def supports(dtype: Any) -> bool:
    """Whether NCCL can sum elements of ``dtype``."""
    return _kind(dtype) in _TYPES


def _stream_ptr() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


def allreduce_sum(buf: Any, comm: MPI.Intracomm) -> None:
    """Sum the contiguous CuPy array ``buf`` in place over ``comm`` (queued on the stream)."""
    nccl = _nccl()
    nc = communicator(comm)
    kind = _kind(buf.dtype)
    count = buf.size * (2 if numpy_dtype(buf.dtype).kind == "c" else 1)
    ptr = buf.data.ptr
    nc.allReduce(ptr, ptr, count, getattr(nccl, _TYPES[kind]), nccl.NCCL_SUM, _stream_ptr())


def exchange(comm: MPI.Intracomm, recvs: Sequence[tuple[Any, int]],
             sends: Sequence[tuple[Any, int]]) -> None:
    """Receive and send contiguous CuPy arrays as one NCCL group (queued on the stream).

    ``recvs`` and ``sends`` are ``(array, peer)`` pairs; the messages between
    two ranks match in the order they are listed. Collective over ``comm``.
    """
    nccl = _nccl()
    nc = communicator(comm)
    stream = _stream_ptr()
    byte = nccl.NCCL_UINT8
    nccl.groupStart()
    try:
        for buf, peer in recvs:
            nc.recv(buf.data.ptr, buf.nbytes, byte, peer, stream)
        for buf, peer in sends:
            nc.send(buf.data.ptr, buf.nbytes, byte, peer, stream)
    finally:
        nccl.groupEnd()
