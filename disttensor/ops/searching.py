"""``searchsorted`` and ``take``: finding values in a sorted DistArray, gathering by index.

``searchsorted(x1, x2)``: every block of the sorted 1-D ``x1`` counts, for
each value of ``x2``, its elements below it (``side="left"``) or at or below
it (``"right"``); because ``x1`` is sorted, the sum of these counts over the
blocks is the insertion index. ``x2`` is first made whole along the grid
axes that split ``x1`` (a redistribution that replicates it over them;
all of it when it lives on another grid of the same processes), the
counts are summed with one allreduce over those grid axes, and the result
takes ``x2``'s distribution.

``take(x, indices, axis=axis)``: the result is ``x`` with ``axis`` replaced
by ``len(indices)`` elements, split over the same grid axes in blocks (the
block rule). Along an axis that is not split every rank takes from its own
block. Along a split axis the ranks that share the other coordinates
exchange requests (one ``Alltoallv`` of the indices each block needs from
each other block) and answers (one ``Alltoallv`` of the rows). Indices
outside ``[-n, n)`` raise the same IndexError on every rank (one allreduce
of their range first); negative indices count from the end, as in NumPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ..array import DistArray
from ..backend import mpi_dtype, to_numpy
from ..distribution import Distribution
from ..settings import collective
from ..transport import allreduce
from ._util import axis_index, is_dist, same_comm, split_grid_axes, wrap
from .sorting import block_ranks, inverse_ranks

__all__ = ["searchsorted", "take"]


def _as_dist_like(v: Any, like: DistArray, what: str) -> DistArray:
    """``v`` as a DistArray on ``like``'s grid (NumPy arrays and scalars: replicated)."""
    if is_dist(v):
        if not same_comm(v.dist, like.dist):
            raise ValueError(f"{what} must live on the same processes as the array")
        return v
    a = np.asarray(v)
    return DistArray.from_global(a, Distribution(a.shape, like.grid, (None,) * a.ndim),
                                 xp=like.xp)


def _without_axes(dist: Distribution, axes: tuple[int, ...]) -> Distribution:
    """``dist`` with the grid axes ``axes`` removed from every dimension (replicas there)."""
    new = [tuple(a for a in e if a not in axes) for e in dist.dim_axes]
    splits = [s if new[d] == dist.dim_axes[d] else None for d, s in enumerate(dist.splits)]
    return Distribution(dist.shape, dist.grid, new, splits)


@collective
def searchsorted(x1: DistArray, x2: Any, /, *, side: str = "left",
                 sorter: Any = None) -> DistArray:
    """Indices where the values of ``x2`` would be inserted into the sorted ``x1``.

    Parameters
    ----------
    x1 : DistArray
        1-D, sorted ascending (NaNs last), on any distribution; with
        ``sorter``, ``take(x1, sorter)`` is.
    x2 : DistArray, array or scalar
        The values; NumPy arrays and scalars count as replicated.
    side : {"left", "right"}
        Insert before (``"left"``) or after (``"right"``) equal elements.
    sorter : DistArray or array of int, optional
        Indices that sort ``x1``.

    Returns
    -------
    DistArray
        ``intp`` indices with ``x2``'s shape and distribution.

    Raises
    ------
    TypeError, ValueError
        For a non-DistArray or non-1-D ``x1``, a bad ``side``, or operands on
        different processes, on every rank.
    """
    if not is_dist(x1):
        raise TypeError(f"searchsorted: x1 must be a DistArray, got {type(x1).__name__}")
    if x1.ndim != 1:
        raise ValueError("searchsorted: x1 must be one-dimensional")
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    x2 = _as_dist_like(x2, x1, "x2")
    if sorter is not None:
        x1 = take(x1, sorter, axis=0)
    axes = split_grid_axes(x1.dist, [0])
    if x2.dist.grid_shape == x1.dist.grid_shape and x2.grid == x1.grid:
        whole = _without_axes(x2.dist, axes)
    else:  # another grid over the same processes: replicate x2 on x1's
        whole = Distribution(x2.shape, x1.grid, (None,) * x2.ndim)
    y = x2 if whole == x2.dist else x2.redistribute(whole)
    counts = np.searchsorted(to_numpy(x1.local), to_numpy(y.local), side=side).astype(np.intp)
    counts = allreduce(np.ascontiguousarray(counts), x1.grid.subcomm(axes), MPI.SUM)
    out = wrap(x1.xp.asarray(counts), whole, x1.xp)
    return out if whole == x2.dist else out.redistribute(x2.dist)


# ------------------------------------------------------------------ take


def _index_values(indices: Any, x: DistArray, axis: int, res: Distribution) -> np.ndarray:
    """This rank's block of ``indices`` in ``res`` along ``axis`` (NumPy), wrapped to [0, n)."""
    n = x.shape[axis]
    sl = res.local_slices()[axis]
    if is_dist(indices):
        m = indices.shape[0]
        lay = Distribution((m,), res.grid, (res.dim_axes[axis],),
                           [res.splits[axis]])
        mine = indices if indices.dist == lay else indices.redistribute(lay)
        idx = to_numpy(mine.local).astype(np.int64)
        lo_hi = np.array([idx.min() if idx.size else 0, idx.max() if idx.size else -1])
        lo = allreduce(lo_hi[:1].copy(), x.comm, MPI.MIN)[0]
        hi = allreduce(lo_hi[1:].copy(), x.comm, MPI.MAX)[0]
    else:
        full = np.asarray(indices).astype(np.int64)
        idx = full[sl]
        lo, hi = (full.min(), full.max()) if full.size else (0, -1)
    if full_range_bad(lo, hi, n):
        raise IndexError(f"index {lo if lo < -n else hi} is out of bounds for axis {axis} "
                         f"with size {n}")
    return np.where(idx < 0, idx + n, idx)


def full_range_bad(lo: int, hi: int, n: int) -> bool:
    """Whether an index range ``[lo, hi]`` (empty when ``hi < lo``) leaves ``[-n, n)``."""
    return hi >= lo and (lo < -n or hi >= n)


def _check_indices(indices: Any) -> None:
    dtype = indices.dtype if hasattr(indices, "dtype") else np.asarray(indices).dtype
    ndim = indices.ndim if hasattr(indices, "ndim") else np.ndim(indices)
    if ndim != 1:
        raise ValueError("take: indices must be a one-dimensional array")
    if np.dtype(dtype).kind not in "iu":
        raise IndexError("take: indices must be an array of integers")


@collective
def take(x: DistArray, indices: Any, /, *, axis: int | None = None) -> DistArray:
    """Elements of ``x`` at ``indices`` along ``axis``, like :func:`numpy.take`.

    Parameters
    ----------
    x : DistArray
        Input of any distribution.
    indices : DistArray or array of int
        1-D integer indices (a NumPy array must be the same on every rank).
    axis : int, optional
        Required unless ``x`` is 1-D.

    Returns
    -------
    DistArray
        ``x``'s shape with ``axis`` replaced by ``len(indices)``, split over
        ``x``'s grid axes, the changed axis in blocks (the module docstring).

    Raises
    ------
    IndexError
        For an index outside ``[-n, n)`` or non-integer indices, on every rank.
    ValueError, TypeError
        For indices that are not 1-D or a missing ``axis`` of an N-D ``x``.
    """
    if not is_dist(x):
        raise TypeError(f"take: expected a DistArray, got {type(x).__name__}")
    if axis is None:
        if x.ndim != 1:
            raise ValueError("take: axis is required for arrays of more than one dimension")
        axis = 0
    axis = axis_index(axis, x.ndim)
    _check_indices(indices)
    if is_dist(indices) and not same_comm(indices.dist, x.dist):
        raise ValueError("take: indices must live on the same processes as the array")
    m = int(indices.shape[0])
    shape = list(x.shape)
    shape[axis] = m
    splits = list(x.dist.splits)
    splits[axis] = None
    res = Distribution(shape, x.grid, x.dist.dim_axes, splits)
    idx = _index_values(indices, x, axis, res)
    h = to_numpy(x.local)
    if x.dist.nblocks[axis] == 1:
        return wrap(x.xp.asarray(np.take(h, idx, axis=axis)), res, x.xp)
    return wrap(x.xp.asarray(_remote_take(x, h, idx, axis)), res, x.xp)


def _remote_take(x: DistArray, h: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    """Rows ``idx`` along the split ``axis``, fetched from their blocks (two Alltoallv)."""
    dist = x.dist
    b = np.asarray(dist.boundaries[axis])
    p = len(b) - 1
    comm = dist.grid.subcomm(dist.dim_axes[axis])
    ranks = block_ranks(dist, axis)
    start = b[dist.block_index()[axis]]
    owner = np.searchsorted(b[1:], idx, "right")
    order = np.argsort(owner, kind="stable")
    want = np.ascontiguousarray(idx[order])
    counts = np.bincount(owner, minlength=p)
    inv = inverse_ranks(ranks)
    got = comm.alltoall([int(counts[blk]) for blk in inv])   # requests from each rank
    sc = [int(counts[inv[r]]) for r in range(len(ranks))]
    sd = np.concatenate([[0], np.cumsum([counts[blk] for blk in range(p)])])
    sdispl = [int(sd[inv[r]]) for r in range(len(ranks))]
    rd = np.concatenate([[0], np.cumsum(got)]).astype(int)
    req = np.empty(int(sum(got)), np.int64)
    t = mpi_dtype(np.dtype(np.int64))
    comm.Alltoallv([want, (sc, sdispl), t], [req, (list(got), rd[:-1].tolist()), t])
    # answers: the requested rows, axis first
    rows = np.ascontiguousarray(np.moveaxis(np.take(h, req - start, axis=axis), axis, 0))
    row = int(np.prod(rows.shape[1:], dtype=np.int64))
    out = np.empty((len(idx),) + rows.shape[1:], h.dtype)
    t = mpi_dtype(h.dtype)
    comm.Alltoallv([rows, ([g * row for g in got], (rd[:-1] * row).tolist()), t],
                   [out, ([c * row for c in sc], [d * row for d in sdispl]), t])
    res = np.empty_like(out)
    res[order] = out
    return np.moveaxis(res, 0, axis)
