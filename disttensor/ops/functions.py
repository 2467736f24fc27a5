"""``__array_function__``: which NumPy functions run on DistArrays, and with what.

``HANDLED`` maps NumPy functions to their DistArray implementations. A NumPy
function that is not in it returns ``NotImplemented`` from
``DistArray.__array_function__``, so NumPy raises its usual ``TypeError``
("no implementation found for 'numpy.xyz' on types that implement
__array_function__") on every rank, before any communication.
``docs/gen_coverage.py`` lists both sets in ``docs/coverage.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import disttensor.ops.elementwise as elementwise
import disttensor.ops.indexing as indexing
import disttensor.ops.linalg as linalg
import disttensor.ops.reductions as reductions
import disttensor.ops.replication as replication
import disttensor.ops.searching as searching
import disttensor.ops.sets as sets
import disttensor.ops.shape as shape
import disttensor.ops.sorting as sorting

from ..array import DistArray
from ..settings import collective
from ._util import is_dist, wrap

__all__ = ["HANDLED", "array_function", "implements"]

HANDLED: dict[Callable[..., Any], Callable[..., Any]] = {}


def implements(*np_funcs: Callable[..., Any]) -> Callable[[Callable[..., Any]],
                                                           Callable[..., Any]]:
    """Register the decorated function as the DistArray version of ``np_funcs``."""

    def register(impl: Callable[..., Any]) -> Callable[..., Any]:
        for f in np_funcs:
            HANDLED[f] = impl
        return impl

    return register


def _register_all() -> None:
    table: dict[Any, Callable[..., Any]] = {
        # reductions
        np.sum: reductions.sum, np.prod: reductions.prod, np.mean: reductions.mean,
        np.var: reductions.var, np.std: reductions.std, np.min: reductions.min,
        np.max: reductions.max, np.amin: reductions.min, np.amax: reductions.max,
        np.argmin: reductions.argmin, np.argmax: reductions.argmax,
        np.all: reductions.all, np.any: reductions.any,
        np.cumsum: reductions.cumsum, np.cumprod: reductions.cumprod,
        np.count_nonzero: reductions.count_nonzero, np.ptp: reductions.ptp,
        np.nansum: reductions.nansum, np.nanprod: reductions.nanprod,
        np.nanmin: reductions.nanmin, np.nanmax: reductions.nanmax,
        np.nanmean: reductions.nanmean, np.nanvar: reductions.nanvar,
        np.nanstd: reductions.nanstd, np.trace: reductions.trace,
        np.cumulative_sum: reductions.cumulative_sum,
        np.cumulative_prod: reductions.cumulative_prod,
        # shape
        np.transpose: shape.transpose, np.permute_dims: shape.permute_dims,
        np.moveaxis: shape.moveaxis, np.swapaxes: shape.swapaxes,
        np.matrix_transpose: shape.matrix_transpose,
        np.expand_dims: shape.expand_dims, np.squeeze: shape.squeeze,
        np.reshape: shape.reshape, np.ravel: shape.ravel,
        np.concatenate: shape.concatenate, np.concat: shape.concatenate,
        np.stack: shape.stack, np.broadcast_to: shape.broadcast_to,
        np.broadcast_arrays: shape.broadcast_arrays, np.flip: shape.flip,
        np.roll: shape.roll, np.diff: shape.diff, np.atleast_1d: shape.atleast_1d,
        np.atleast_2d: shape.atleast_2d, np.atleast_3d: shape.atleast_3d,
        np.hstack: shape.hstack, np.vstack: shape.vstack, np.unstack: shape.unstack,
        np.nonzero: indexing.nonzero, np.flatnonzero: indexing.flatnonzero,
        np.argwhere: indexing.argwhere,
        # sorting
        np.sort: _np_sort, np.argsort: _np_argsort, np.take: _np_take,
        np.searchsorted: _np_searchsorted, np.unique_values: sets.unique_values,
        np.unique_counts: sets.unique_counts, np.unique_inverse: sets.unique_inverse,
        np.unique_all: sets.unique_all, np.tile: replication.tile,
        np.meshgrid: replication.meshgrid, np.tensordot: _np_tensordot,
        np.repeat: _np_repeat,
        # element-wise functions that are not ufuncs
        np.where: elementwise.where, np.clip: elementwise.clip,
        np.round: elementwise.round, np.around: elementwise.round,
        np.real: elementwise.real, np.imag: elementwise.imag,
        np.isclose: elementwise.isclose, np.allclose: elementwise.allclose,
        np.array_equal: elementwise.array_equal, np.nan_to_num: elementwise.nan_to_num,
        np.astype: elementwise.astype,
        # linear algebra
        np.dot: linalg.dot, np.vdot: linalg.vdot, np.inner: linalg.inner,
        np.outer: linalg.outer, np.linalg.matmul: linalg.matmul,
        np.linalg.vecdot: linalg.vecdot, np.linalg.matrix_transpose: shape.matrix_transpose,
        np.linalg.norm: linalg.norm, np.linalg.vector_norm: linalg.vector_norm,
        np.linalg.matrix_norm: linalg.matrix_norm, np.linalg.outer: linalg.outer,
        # metadata and copies
        np.shape: _shape, np.ndim: _ndim, np.size: _size, np.copy: _copy,
        np.zeros_like: _zeros_like, np.ones_like: _ones_like, np.empty_like: _empty_like,
        np.full_like: _full_like, np.result_type: _result_type,
    }
    HANDLED.update(table)


def _shape(a: Any) -> tuple[int, ...]:
    """The global shape (metadata, no communication)."""
    return a.shape


def _ndim(a: Any) -> int:
    """The number of dimensions."""
    return a.ndim


def _size(a: Any, axis: int | None = None) -> int:
    """The global number of elements (along ``axis`` if given)."""
    return a.size if axis is None else a.shape[axis]


def _copy(a: Any, order: str = "K", subok: bool = False) -> Any:
    """A copy with the same distribution."""
    return a.copy()


def _like(a: Any, dtype: Any, fill: Any, shape: Any) -> Any:
    if shape is not None and tuple(np.atleast_1d(shape)) != a.shape:
        raise ValueError("*_like of a DistArray does not support a new shape=")
    dtype = a.dtype if dtype is None else np.dtype(dtype)
    local = a.xp.empty(a.dist.local_shape(), dtype=dtype)
    if fill is not None:
        local[...] = fill
    return wrap(local, a.dist, a.xp)


def _zeros_like(a: Any, dtype: Any = None, order: str = "K", subok: bool = True,
                shape: Any = None, *, device: Any = None) -> Any:
    """Zeros with the distribution of ``a``."""
    return _like(a, dtype, 0, shape)


def _ones_like(a: Any, dtype: Any = None, order: str = "K", subok: bool = True,
               shape: Any = None, *, device: Any = None) -> Any:
    """Ones with the distribution of ``a``."""
    return _like(a, dtype, 1, shape)


def _empty_like(prototype: Any, dtype: Any = None, order: str = "K", subok: bool = True,
                shape: Any = None, *, device: Any = None) -> Any:
    """Uninitialised, with the distribution of ``prototype``."""
    return _like(prototype, dtype, None, shape)


def _full_like(a: Any, fill_value: Any, dtype: Any = None, order: str = "K",
               subok: bool = True, shape: Any = None, *, device: Any = None) -> Any:
    """Filled with ``fill_value``, with the distribution of ``a``."""
    if dtype is None:
        dtype = a.dtype
    return _like(a, dtype, fill_value, shape)


def _sort_args(a: Any, axis: Any, kind: Any, order: Any, stable: Any) -> tuple[Any, int, bool]:
    """NumPy's sort arguments as (array, axis, stable); ``axis=None`` sorts the flattened array."""
    if order is not None:
        raise ValueError("Cannot specify order when the array has no fields.")
    if kind not in (None, "quicksort", "mergesort", "heapsort", "stable"):
        raise ValueError(f"sort kind must be one of 'quick', 'heap', or 'stable' (got {kind!r})")
    if axis is None:
        return a.ravel(), 0, bool(stable) or kind in ("stable", "mergesort")
    return a, axis, bool(stable) or kind in ("stable", "mergesort")


def _np_sort(a: Any, axis: Any = -1, kind: Any = None, order: Any = None, *,
             stable: Any = None) -> Any:
    """:func:`numpy.sort` (distributed, see :mod:`disttensor.ops.sorting`)."""
    x, ax, st = _sort_args(a, axis, kind, order, stable)
    return sorting.sort(x, axis=ax, stable=st)


def _np_argsort(a: Any, axis: Any = -1, kind: Any = None, order: Any = None, *,
                stable: Any = None) -> Any:
    """:func:`numpy.argsort` (always stable)."""
    x, ax, _ = _sort_args(a, axis, kind, order, stable)
    return sorting.argsort(x, axis=ax)


def _np_take(a: Any, indices: Any, axis: Any = None, out: Any = None,
             mode: str = "raise") -> Any:
    """:func:`numpy.take` with 1-D integer indices (``axis=None``: of the flattened array)."""
    if out is not None or mode != "raise":
        raise TypeError("take of a DistArray supports neither out= nor mode=")
    if axis is None:
        return searching.take(a.ravel(), indices, axis=0)
    return searching.take(a, indices, axis=axis)


def _np_tensordot(a: Any, b: Any, axes: Any = 2) -> Any:
    """:func:`numpy.tensordot` (a distributed matrix product)."""
    return linalg.tensordot(a, b, axes=axes)


def _np_repeat(a: Any, repeats: Any, axis: Any = None) -> Any:
    """:func:`numpy.repeat`."""
    return replication.repeat(a, repeats, axis=axis)


def _np_searchsorted(a: Any, v: Any, side: str = "left", sorter: Any = None) -> Any:
    """:func:`numpy.searchsorted` of a sorted 1-D DistArray."""
    return searching.searchsorted(a, v, side=side, sorter=sorter)


def _result_type(*arrays_and_dtypes: Any) -> np.dtype:
    """NumPy's type promotion, with DistArrays standing for their dtypes."""
    return np.result_type(*(a.dtype if is_dist(a) else a for a in arrays_and_dtypes))


_register_all()


@collective
def array_function(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    """The body of ``DistArray.__array_function__``."""
    impl = HANDLED.get(func)
    if impl is None:
        return NotImplemented
    for t in types:
        if not (issubclass(t, DistArray) or issubclass(t, np.ndarray)):
            return NotImplemented
    return impl(*args, **kwargs)
