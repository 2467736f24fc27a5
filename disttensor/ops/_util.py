"""Small shared helpers of the array layer: wrapping blocks, axes, sub-communicator roots."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI
from numpy.lib.array_utils import normalize_axis_index, normalize_axis_tuple

from ..array import DistArray
from ..backend import contiguous, is_numpy, mpi_dtype, to_numpy
from ..distribution import Distribution
from ..grid import coords_of, rank_of

__all__ = [
    "is_dist",
    "wrap",
    "make_dist",
    "normalize_axes",
    "normalize_axis_index",
    "split_grid_axes",
    "subcomm_members",
    "subcomm_index",
    "bcast_array",
    "same_comm",
]


def is_dist(x: Any) -> bool:
    """Whether ``x`` is a DistArray."""
    return isinstance(x, DistArray)


def wrap(local: Any, dist: Distribution, xp: Any = np) -> DistArray:
    """A DistArray from this rank's block ``local`` of ``dist`` (not copied when contiguous)."""
    local = contiguous(xp.asarray(local))
    want = dist.local_shape()
    if tuple(local.shape) != want:  # a bug in the caller, never a user error
        raise AssertionError(f"local block {tuple(local.shape)} does not match {want} of {dist}")
    return DistArray(local, dist)


def make_dist(
    shape: Sequence[int],
    grid: Any,
    dim_axes: Sequence[Sequence[int]],
    boundaries: Sequence[Sequence[int] | None],
) -> Distribution:
    """A Distribution from per-dimension grid axes and boundaries (None: the block rule)."""
    axes = [tuple(e) for e in dim_axes]
    splits = [None if b is None else b[1:-1] for b in boundaries]
    return Distribution(tuple(int(s) for s in shape), grid, axes, splits)


def normalize_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    """Sorted, non-negative axes; None means all. Raises numpy's AxisError like NumPy."""
    if axis is None:
        return tuple(range(ndim))
    _check_axis_ints(axis)
    return tuple(sorted(normalize_axis_tuple(axis, ndim)))


def _check_axis_ints(axis: Any) -> None:
    """TypeError naming ``axis`` unless it is an int or a sequence of ints (bools refused)."""
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    for a in items:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"axis must be an int or a tuple of ints, got {axis!r}")


def split_grid_axes(dist: Distribution, dims: Iterable[int]) -> tuple[int, ...]:
    """Grid axes of extent > 1 that split any of ``dims`` (sorted)."""
    return tuple(sorted({a for d in dims for a in dist.dim_axes[d] if dist.grid_shape[a] > 1}))


def subcomm_members(grid: Any, axes: Sequence[int], coords: Sequence[int] | None = None
                    ) -> list[int]:
    """World ranks of ``grid.subcomm(axes)`` around ``coords``, in sub-communicator order.

    ``ProcessGrid.subcomm`` orders its members by their rank in the grid's
    communicator, which is row-major order of their coordinates along the
    sorted ``axes``.
    """
    axes = sorted(axes)
    coords = list(grid.coords if coords is None else coords)
    extents = [grid.shape[a] for a in axes]
    out = []
    for k in range(math.prod(extents)):
        c = list(coords)
        for a, ca in zip(axes, coords_of(k, extents)):
            c[a] = ca
        out.append(rank_of(c, grid.shape))
    return out


def subcomm_index(grid: Any, axes: Sequence[int], coords: Sequence[int]) -> int:
    """Rank, inside ``grid.subcomm(axes)``, of the process at grid ``coords``."""
    axes = sorted(axes)
    return rank_of([coords[a] for a in axes], [grid.shape[a] for a in axes])


def block_coords(dist: Distribution, dim: int, block: int, coords: Sequence[int]) -> list[int]:
    """``coords`` changed along the grid axes of ``dim`` to those of block ``block``."""
    c = list(coords)
    e = dist.dim_axes[dim]
    for a, ca in zip(e, coords_of(block, [dist.grid_shape[a] for a in e])):
        c[a] = ca
    return c


def host(a: Any) -> np.ndarray:
    """A C-contiguous NumPy array with the data of ``a`` (the array itself when possible)."""
    return np.ascontiguousarray(to_numpy(a)) if a.ndim else np.asarray(to_numpy(a)).copy()


def bcast_array(buf: Any, comm: MPI.Comm, root: int, xp: Any = np) -> Any:
    """Broadcast the contiguous array ``buf`` (same shape and dtype everywhere) from ``root``."""
    if comm.Get_size() == 1 or buf.size == 0:
        return buf
    if is_numpy(xp):
        comm.Bcast([buf, mpi_dtype(buf.dtype)], root=root)
        return buf
    h = host(buf)  # pragma: no cover - GPU only
    comm.Bcast([h, mpi_dtype(h.dtype)], root=root)  # pragma: no cover
    return xp.asarray(h)  # pragma: no cover


def same_comm(a: Distribution, b: Distribution) -> bool:
    """Whether two distributions live on grids over the same group of processes."""
    return a.grid.same_processes(b.grid)


def axis_index(axis: Any, ndim: int) -> int:
    """A single normalised axis (AxisError like NumPy)."""
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an int, got {axis!r}")
    return int(normalize_axis_index(axis, ndim))
