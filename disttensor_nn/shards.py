"""Flat shards of an array over the ranks of a communicator: the range each rank holds
(:func:`shard_range`, :func:`shard_counts`), gathering the shards (:func:`gather_shards`)
and reduce-scattering a sum into them (:func:`reduce_scatter_`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import backend
from disttensor.backend import array_namespace, as_module, device_of, numpy_dtype, reshape

__all__ = ["shard_range", "shard_counts", "gather_shards", "reduce_scatter_"]


def shard_range(size: int, nranks: int, rank: int) -> tuple[int, int]:
    """The flat range ``(start, stop)`` of ``size`` elements that rank ``rank`` of
    ``nranks`` holds: the first ``size % nranks`` ranks one element more (empty ranges
    when ``size < nranks``)."""
    base, extra = divmod(size, nranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard_counts(size: int, nranks: int) -> tuple[list[int], list[int]]:
    """Every rank's element count and offset under :func:`shard_range`."""
    bounds = [shard_range(size, nranks, r) for r in range(nranks)]
    return [b - a for a, b in bounds], [a for a, _ in bounds]


def _host(a: Any) -> np.ndarray:
    """``a`` as a contiguous NumPy array (itself for NumPy arrays)."""
    return np.ascontiguousarray(backend.to_numpy(a))


def gather_shards(shard: Any, comm: MPI.Intracomm, size: int, out: Any = None) -> Any:
    """The flat array of ``size`` elements whose :func:`shard_range` pieces the ranks of
    ``comm`` hold (``shard`` this rank's), by one Allgatherv; written into ``out``
    (flat, of ``size`` elements, in place) when given. Collective over ``comm``."""
    counts, displs = shard_counts(size, comm.size)
    like = shard if out is None else out
    xp, device = array_namespace(like), device_of(like)
    if out is not None and isinstance(out, np.ndarray):
        lo = displs[comm.rank]
        if comm.size > 1:
            if not np.shares_memory(out[lo:lo + counts[comm.rank]], shard):
                out[lo:lo + counts[comm.rank]] = shard
            comm.Allgatherv(MPI.IN_PLACE, [out, (counts, displs)])
        return out
    host = np.empty(size, dtype=numpy_dtype(shard.dtype))
    comm.Allgatherv(_host(shard), [host, (counts, displs)])
    if out is None:
        return as_module(host, xp, device) if xp is not np else host
    out[...] = as_module(host, xp, device)
    return out


def reduce_scatter_(grad: Any, comm: MPI.Intracomm) -> Any:
    """This rank's :func:`shard_range` piece of the sum over ``comm`` of the flat ``grad``
    (one Reduce_scatter with counts). Collective over ``comm``."""
    counts, _ = shard_counts(grad.size, comm.size)
    send = _host(reshape(grad, (-1,)))
    recv = np.empty(counts[comm.rank], dtype=send.dtype)
    comm.Reduce_scatter(send, recv, counts, op=MPI.SUM)
    xp = array_namespace(grad)
    return recv if xp is np else as_module(recv, xp, device_of(grad))
