"""Array creation: DistArrays filled with constants, ranges or copies of NumPy data."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from .array import DistArray, check_root, root_only_array
from .backend import astype, device_kw, fill, namespace_dtype, numpy_dtype
from .distribution import Distribution
from .grid import ProcessGrid
from .settings import collective

__all__ = ["make_distribution", "empty", "zeros", "ones", "full", "arange", "asarray"]

_default_grid: ProcessGrid | None = None


def default_grid() -> ProcessGrid:
    """A 1-D grid over ``MPI.COMM_WORLD`` (created on first use; collective then)."""
    global _default_grid
    if _default_grid is None:
        _default_grid = ProcessGrid.create(1)
    return _default_grid


def make_distribution(
    shape: int | Sequence[int] | Distribution,
    *,
    dist: Distribution | None = None,
    grid: ProcessGrid | None = None,
    axes: Sequence[Any] | None = None,
    splits: Sequence[Any] | None = None,
) -> Distribution:
    """The Distribution that creation functions use.

    ``shape`` may itself be a Distribution. Otherwise a Distribution of
    ``shape`` is built over ``grid`` (a 1-D grid over ``COMM_WORLD`` when
    omitted) with ``axes`` and ``splits``; with the default grid and no
    ``axes`` the first dimension is split.
    """
    if isinstance(shape, Distribution):
        dist, shape = shape, None
    if dist is not None:
        if shape is not None:
            shp = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
            if shp != dist.global_shape:
                raise ValueError(f"shape {shp} does not match {dist}")
        if grid is not None or axes is not None or splits is not None:
            raise ValueError("give either dist= or grid/axes/splits, not both")
        return dist
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    if not isinstance(shape, Iterable):
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
    shape = tuple(shape)
    if grid is None:
        grid = default_grid()
        if axes is None:
            axes = tuple(0 if i == 0 else None for i in range(len(shape)))
    return Distribution(shape, grid, axes, splits)


@collective
def empty(shape: Any, dtype: Any = np.float64, *, xp: ModuleType | None = None,
          device: Any = None, **dist_kw: Any) -> DistArray:
    """Uninitialised DistArray (see :func:`make_distribution` for the layout keywords).

    ``xp`` (an array module) or ``device`` (``'cpu'`` or ``'gpu'``; with an
    array API ``xp``, one of its devices) choose where the blocks live, as
    for :meth:`DistArray.empty`; every creation function takes them.
    """
    return DistArray.empty(make_distribution(shape, **dist_kw), numpy_dtype(dtype), xp=xp,
                           device=device)


@collective
def zeros(shape: Any, dtype: Any = np.float64, *, xp: ModuleType | None = None,
          device: Any = None, **dist_kw: Any) -> DistArray:
    """DistArray of zeros, like :func:`numpy.zeros`.

    Examples
    --------
    >>> x = zeros((8, 6), grid=ProcessGrid((2, 1)), axes=(0, None))  # doctest: +SKIP
    >>> g = zeros((8, 6), device="gpu")  # doctest: +SKIP
    """
    return full(shape, 0, dtype, xp=xp, device=device, **dist_kw)


@collective
def ones(shape: Any, dtype: Any = np.float64, *, xp: ModuleType | None = None,
         device: Any = None, **dist_kw: Any) -> DistArray:
    """DistArray of ones, like :func:`numpy.ones`."""
    return full(shape, 1, dtype, xp=xp, device=device, **dist_kw)


@collective
def full(shape: Any, fill_value: Any, dtype: Any = None, *, xp: ModuleType | None = None,
         device: Any = None, **dist_kw: Any) -> DistArray:
    """DistArray filled with ``fill_value``, like :func:`numpy.full`."""
    dtype = np.asarray(fill_value).dtype if dtype is None else numpy_dtype(dtype)
    out = DistArray.empty(make_distribution(shape, **dist_kw), dtype, xp=xp, device=device)
    fill(out.local, fill_value)
    return out


@collective
def arange(start: float, stop: float | None = None, step: float = 1, dtype: Any = None, *,
           xp: ModuleType | None = None, device: Any = None, **dist_kw: Any) -> DistArray:
    """1-D DistArray of evenly spaced values, like :func:`numpy.arange`."""
    if stop is None:
        start, stop = 0, start
    if step == 0:
        raise ValueError("arange: step must not be zero")
    n = max(0, int(np.ceil((stop - start) / step)))
    if dtype is None:
        dtype = np.result_type(np.asarray(start), np.asarray(stop), np.asarray(step))
    dist = make_distribution((n,), **dist_kw)
    out = DistArray.empty(dist, dtype, xp=xp, device=device)
    sl = dist.local_slices()[0]
    # start + step * index, computed as NumPy would: in int64 for integers, else in float64
    work = np.result_type(np.int64, np.asarray(start), np.asarray(step))
    lxp = out.xp
    index = lxp.arange(sl.start, sl.stop, dtype=namespace_dtype(lxp, work),
                       **device_kw(out.local))
    values = work.type(start).item() + work.type(step).item() * index
    out.local[...] = astype(values, out.dtype)
    return out


@collective(ignore=root_only_array)
def asarray(array: Any, dist: Distribution | None = None, *, root: int | None = None,
            xp: ModuleType | None = None, device: Any = None, **dist_kw: Any) -> DistArray:
    """Distribute ``array`` (every rank passes the same one, or only ``root``).

    A DistArray is returned as it is when it already has the distribution, and
    redistributed when it has another. ``xp``/``device`` choose the module and
    device of new blocks (default: those of ``array``; see
    :meth:`DistArray.from_global`).
    """
    if isinstance(array, DistArray):
        if dist is None or array.dist == dist:
            return array
        return array.redistribute(dist)
    if dist is None:
        if root is None:
            shape = np.shape(array)
        else:
            grid = dist_kw.get("grid") or default_grid()
            root = check_root(root, grid)
            comm = grid.comm
            shape = comm.bcast(np.shape(array) if comm.Get_rank() == root else None, root=root)
        dist = make_distribution(shape, **dist_kw)
    return DistArray.from_global(array, dist, root=root, xp=xp, device=device)
