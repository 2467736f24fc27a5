"""Reductions: sum, prod, mean, var, std, min, max, argmin, argmax, all, any, cumsum, cumprod.

Each rank reduces its block over the reduced dimensions, then the partial
results are combined **only along the grid axes that split the reduced
dimensions** (``grid.subcomm(axes)``): one ``Allreduce`` (two for var/std, an
``Allgather`` of (value, index) pairs for argmin/argmax, an ``Allgather`` of
block totals for cumsum/cumprod). Grid axes that hold replicas, or that split
only kept dimensions, carry no message.

The result's distribution: the kept dimensions keep their grid axes and
boundaries; reduced dimensions are dropped (or kept with size 1 and not
split, with ``keepdims=True``), so their grid axes become replica axes and
every rank along them holds the same result.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import to_numpy_dtype

from ..array import DistArray
from ..backend import mpi_dtype, numpy_dtype, to_numpy
from ..distribution import Distribution
from ..settings import collective
from ..transport import allreduce as allreduce_over
from ._util import (
    axis_index,
    is_dist,
    make_dist,
    normalize_axes,
    split_grid_axes,
    subcomm_members,
    wrap,
)
from .indexing import setitem
from .shape import concatenate, reshape

__all__ = [
    "reduced_distribution",
    "sum",
    "prod",
    "mean",
    "var",
    "std",
    "min",
    "max",
    "all",
    "any",
    "argmin",
    "argmax",
    "cumsum",
    "cumprod",
    "count_nonzero",
    "ufunc_reduce",
    "ufunc_accumulate",
]

_builtin_sum, _builtin_all, _builtin_any, _builtin_min, _builtin_max = (
    sum, all, any, min, max
)

_NoValue = np._NoValue  # type: ignore[attr-defined]


# ------------------------------------------------------------------ metadata


def reduced_distribution(dist: Distribution, dims: tuple[int, ...], keepdims: bool
                         ) -> Distribution:
    """The distribution of a reduction of ``dist`` over ``dims``.

    Kept dimensions keep their grid axes and boundaries. Reduced dimensions
    are dropped, or with ``keepdims`` kept with size 1 and not split; either
    way their grid axes become replica axes.
    """
    shape, axes, bounds = [], [], []
    for d in range(dist.ndim):
        if d in dims:
            if keepdims:
                shape.append(1)
                axes.append(())
                bounds.append(None)
        else:
            shape.append(dist.global_shape[d])
            axes.append(dist.dim_axes[d])
            bounds.append(dist.boundaries[d])
    return make_dist(shape, dist.grid, axes, bounds)


def _check_where(where: Any, name: str) -> None:
    if where is not True and where is not _NoValue:
        raise TypeError(f"{name} of a DistArray does not support where=")


# ------------------------------------------------------------------ MPI combination

_BUILTIN = {
    ("add", "iufc"): MPI.SUM,
    ("multiply", "iufc"): MPI.PROD,
    ("logical_and", "b"): MPI.LAND,
    ("logical_or", "b"): MPI.LOR,
    ("minimum", "iu"): MPI.MIN,
    ("maximum", "iu"): MPI.MAX,
    ("bitwise_and", "iu"): MPI.BAND,
    ("bitwise_or", "iu"): MPI.BOR,
    ("bitwise_xor", "iu"): MPI.BXOR,
}


@cache
def _ufunc_op(ufunc: np.ufunc) -> MPI.Op:
    """An MPI reduction operator that applies a NumPy ufunc (NaN and complex order like NumPy)."""

    def apply(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
        dtype = to_numpy_dtype(datatype)
        a = np.frombuffer(inbuf, dtype)
        b = np.frombuffer(inoutbuf, dtype)
        ufunc(a, b, out=b)

    return MPI.Op.Create(apply, commute=True)


def mpi_op(ufunc: np.ufunc, dtype: np.dtype) -> MPI.Op:
    """The MPI operator that combines partial ``ufunc`` reductions of ``dtype``."""
    for (name, kinds), op in _BUILTIN.items():
        if ufunc.__name__ == name and dtype.kind in kinds:
            return op
    return _ufunc_op(ufunc)


def _check_mpi_dtype(dtype: np.dtype, name: str) -> None:
    if dtype.kind not in "biufc":
        raise TypeError(f"{name} of a DistArray does not support dtype {dtype}")
    mpi_dtype(dtype)


def allreduce(partial: Any, dist: Distribution, dims: tuple[int, ...], ufunc: np.ufunc,
              xp: Any) -> Any:
    """Combine ``partial`` (this rank's reduction over ``dims``) along the splitting grid axes."""
    axes = split_grid_axes(dist, dims)
    if not axes:
        return partial
    comm = dist.grid.subcomm(axes)
    # through the array module's transport (device memory, host staging or NCCL); a plain
    # buffer, so that mpi4py picks the predefined datatype that built-in ops need
    return allreduce_over(partial, comm, mpi_op(ufunc, numpy_dtype(partial.dtype)))


def _local_empty(dist: Distribution, dims: tuple[int, ...]) -> bool:
    shape = dist.local_shape()
    return _builtin_any(shape[d] == 0 for d in dims)


def _finish(partial: Any, dist: Distribution, dims: tuple[int, ...], keepdims: bool,
            xp: Any) -> DistArray:
    rdist = reduced_distribution(dist, dims, keepdims)
    return wrap(xp.reshape(partial, rdist.local_shape()), rdist, xp)


def _store(result: DistArray, out: Any) -> DistArray:
    if out is None:
        return result
    if not is_dist(out):
        raise TypeError(f"out= must be a DistArray, got {type(out).__name__}")
    if out.shape != result.shape:
        raise ValueError(f"out has shape {out.shape} but the result has shape {result.shape}")
    setitem(out, Ellipsis, result)
    return out


# ------------------------------------------------------------------ sum / prod / all / any

_IDENTITY_UFUNC = {"sum": np.add, "prod": np.multiply, "all": np.logical_and,
                   "any": np.logical_or}


def _reduce_local(local: Any, dist: Distribution, dims: tuple[int, ...], name: str,
                  dtype: Any, xp: Any) -> Any:
    """Distributed sum/prod/all/any of a local block of ``dist``; keepdims shape."""
    ufunc = _IDENTITY_UFUNC[name]
    if name in ("all", "any"):
        partial = getattr(xp, name)(local, axis=dims, keepdims=True)
    else:
        partial = getattr(xp, name)(local, axis=dims, dtype=dtype, keepdims=True)
    partial = xp.asarray(partial)
    _check_mpi_dtype(np.dtype(partial.dtype), name)
    return allreduce(partial, dist, dims, ufunc, xp)


def _simple(name: str, x: DistArray, axis: Any, dtype: Any, out: Any, keepdims: bool,
            initial: Any, where: Any) -> DistArray:
    _check_where(where, name)
    x = _as_dist(x, name)
    dims = normalize_axes(axis, x.ndim)
    dry = getattr(np, name)(np.empty((0,), x.dtype), **({} if dtype is None else
                                                         {"dtype": dtype}))
    _check_mpi_dtype(np.asarray(dry).dtype, name)
    partial = _reduce_local(x.local, x.dist, dims, name, dtype, x.xp)
    if initial is not _NoValue and initial is not None:
        partial = _IDENTITY_UFUNC[name](partial, initial)
    return _store(_finish(partial, x.dist, dims, keepdims, x.xp), out)


def _as_dist(x: Any, name: str) -> DistArray:
    if not is_dist(x):
        raise TypeError(f"{name}: expected a DistArray, got {type(x).__name__}")
    return x


@collective
def sum(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None,
        keepdims: bool = False, initial: Any = _NoValue, where: Any = True) -> DistArray:
    """Sum over ``axis`` (all by default), like :func:`numpy.sum`.

    Parameters
    ----------
    x : DistArray
        The array.
    axis : None, int or tuple of int
        Dimensions to reduce.
    dtype : dtype, optional
        Accumulator and result type, as in NumPy.
    out : DistArray, optional
        Receives the result (redistributed into it if needed).
    keepdims : bool
        Keep reduced dimensions with size 1.
    initial : scalar, optional
        Added once to the result.
    where : True
        Only the default is supported.

    Returns
    -------
    DistArray
        A 0-d DistArray for a full reduction; see the module docstring for
        its distribution.
    """
    return _simple("sum", x, axis, dtype, out, keepdims, initial, where)


@collective
def prod(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None,
         keepdims: bool = False, initial: Any = _NoValue, where: Any = True) -> DistArray:
    """Product over ``axis``, like :func:`numpy.prod` (parameters as :func:`sum`)."""
    return _simple("prod", x, axis, dtype, out, keepdims, initial, where)


@collective
def all(x: DistArray, axis: Any = None, out: Any = None, keepdims: bool = False, *,
        where: Any = True) -> DistArray:
    """Whether all elements are true over ``axis``, like :func:`numpy.all`."""
    return _simple("all", x, axis, None, out, keepdims, _NoValue, where)


@collective
def any(x: DistArray, axis: Any = None, out: Any = None, keepdims: bool = False, *,
        where: Any = True) -> DistArray:
    """Whether any element is true over ``axis``, like :func:`numpy.any`."""
    return _simple("any", x, axis, None, out, keepdims, _NoValue, where)


@collective
def count_nonzero(x: DistArray, axis: Any = None, *, keepdims: bool = False) -> Any:
    """Number of non-zero elements over ``axis``, like :func:`numpy.count_nonzero`."""
    x = _as_dist(x, "count_nonzero")
    dims = normalize_axes(axis, x.ndim)
    nz = x.xp.asarray(x.local != 0)
    partial = _reduce_local(nz, x.dist, dims, "sum", np.intp, x.xp)
    return _finish(partial, x.dist, dims, keepdims, x.xp)


# ------------------------------------------------------------------ min / max


def _extreme_identity(dtype: np.dtype, name: str) -> Any:
    """The neutral element of ``minimum`` (largest value) or ``maximum`` (smallest)."""
    big = name == "min"
    if dtype.kind == "b":
        return big
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if big else info.min
    if dtype.kind == "f":
        return np.inf if big else -np.inf
    inf = np.inf if big else -np.inf
    return complex(inf, inf)


def _extreme(name: str, x: DistArray, axis: Any, out: Any, keepdims: bool, initial: Any,
             where: Any) -> DistArray:
    _check_where(where, name)
    x = _as_dist(x, name)
    dims = normalize_axes(axis, x.ndim)
    ufunc = np.minimum if name == "min" else np.maximum
    _check_mpi_dtype(x.dtype, name)
    n = math.prod(x.shape[d] for d in dims)
    has_initial = initial is not _NoValue and initial is not None
    if n == 0 and not has_initial:
        raise ValueError(
            f"zero-size array to reduction operation {ufunc.__name__} which has no identity"
        )
    xp = x.xp
    keep_shape = tuple(1 if d in dims else s for d, s in enumerate(x.local_shape))
    if _local_empty(x.dist, dims):
        partial = xp.full(keep_shape, _extreme_identity(x.dtype, name), dtype=x.dtype)
    else:
        partial = xp.asarray(getattr(xp, name)(x.local, axis=dims, keepdims=True))
    partial = allreduce(partial, x.dist, dims, ufunc, xp)
    if has_initial:
        partial = ufunc(partial, initial)
    return _store(_finish(partial, x.dist, dims, keepdims, xp), out)


@collective
def min(x: DistArray, axis: Any = None, out: Any = None, keepdims: bool = False,
        initial: Any = _NoValue, where: Any = True) -> DistArray:
    """Minimum over ``axis``, like :func:`numpy.min` (NaN propagates; complex order as NumPy)."""
    return _extreme("min", x, axis, out, keepdims, initial, where)


@collective
def max(x: DistArray, axis: Any = None, out: Any = None, keepdims: bool = False,
        initial: Any = _NoValue, where: Any = True) -> DistArray:
    """Maximum over ``axis``, like :func:`numpy.max`."""
    return _extreme("max", x, axis, out, keepdims, initial, where)


# ------------------------------------------------------------------ mean / var / std


def _mean_dtype(dtype: np.dtype, requested: Any) -> tuple[Any, bool]:
    if requested is not None:
        return requested, False
    if dtype.kind in "biu":
        return np.dtype("f8"), False
    if dtype == np.float16:
        return np.dtype("f4"), True
    return None, False


@collective
def mean(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None,
         keepdims: bool = False, *, where: Any = True) -> DistArray:
    """Arithmetic mean over ``axis``, like :func:`numpy.mean` (same dtype rules)."""
    _check_where(where, "mean")
    x = _as_dist(x, "mean")
    dims = normalize_axes(axis, x.ndim)
    n = math.prod(x.shape[d] for d in dims)
    acc, f16 = _mean_dtype(x.dtype, dtype)
    partial = _reduce_local(x.local, x.dist, dims, "sum", acc, x.xp)
    with np.errstate(invalid="ignore", divide="ignore"):
        partial = np.true_divide(partial, n, out=partial, casting="unsafe")
    if f16:
        partial = partial.astype(x.dtype)
    return _store(_finish(partial, x.dist, dims, keepdims, x.xp), out)


@collective
def var(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None, ddof: float = 0,
        keepdims: bool = False, *, where: Any = True, mean: Any = _NoValue,
        correction: Any = _NoValue) -> DistArray:
    """Variance over ``axis``, like :func:`numpy.var` (two passes, two Allreduces).

    ``correction`` is the array API name of ``ddof``; ``mean=`` is not supported.
    """
    _check_where(where, "var")
    if mean is not _NoValue:
        raise TypeError("var of a DistArray does not support mean=")
    if correction is not _NoValue:
        if ddof != 0:
            raise ValueError("ddof and correction can't be provided simultaneously.")
        ddof = correction
    x = _as_dist(x, "var")
    dims = normalize_axes(axis, x.ndim)
    return _store(_finish(_var_partial(x, dims, dtype, ddof), x.dist, dims, keepdims, x.xp),
                  out)


def _var_partial(x: DistArray, dims: tuple[int, ...], dtype: Any, ddof: float) -> Any:
    xp = x.xp
    n = math.prod(x.shape[d] for d in dims)
    acc = np.dtype("f8") if dtype is None and x.dtype.kind in "biu" else dtype
    _check_mpi_dtype(x.dtype, "var")
    s = _reduce_local(x.local, x.dist, dims, "sum", acc, xp)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.true_divide(s, n, out=s, casting="unsafe") if s.dtype.kind in "fc" else s / n
        dev = xp.asarray(x.local - m)
        if dev.dtype.kind == "c":
            sq = dev.real * dev.real + dev.imag * dev.imag
        else:
            sq = xp.multiply(dev, dev, out=dev)
        ss = _reduce_local(sq, x.dist, dims, "sum", dtype, xp)
        return np.true_divide(ss, _builtin_max(n - ddof, 0), out=ss, casting="unsafe") \
            if ss.dtype.kind in "fc" else ss / _builtin_max(n - ddof, 0)


@collective
def std(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None, ddof: float = 0,
        keepdims: bool = False, *, where: Any = True, mean: Any = _NoValue,
        correction: Any = _NoValue) -> DistArray:
    """Standard deviation over ``axis``, like :func:`numpy.std` (the root of :func:`var`)."""
    v = var(x, axis, dtype, None, ddof, keepdims, where=where, mean=mean, correction=correction)
    v.local[...] = v.xp.sqrt(v.local)
    return _store(v, out)


# ------------------------------------------------------------------ argmin / argmax


def _arg(name: str, x: DistArray, axis: Any, out: Any, keepdims: bool) -> DistArray:
    x = _as_dist(x, name)
    xp = x.xp
    dist = x.dist
    _check_mpi_dtype(x.dtype, name)
    if axis is None:
        if x.size == 0:
            raise ValueError(f"attempt to get {name} of an empty sequence")
        dims = tuple(range(x.ndim))
    else:
        a = axis_index(axis, x.ndim)
        dims = (a,)
        if x.shape[a] == 0:
            raise ValueError(f"attempt to get {name} of an empty sequence")
    start = dist.local_start()
    local = x.local
    keep_shape = tuple(1 if d in dims else s for d, s in enumerate(x.local_shape))
    empty = _local_empty(dist, dims)
    if empty:
        vals = xp.zeros(keep_shape, dtype=x.dtype)
        idx = xp.full(keep_shape, -1, dtype=np.intp)
    elif axis is None:
        li = int(getattr(xp, name)(local))
        multi = np.unravel_index(li, local.shape)
        vals = xp.reshape(local[multi], keep_shape)
        glob = tuple(int(m) + s for m, s in zip(multi, start))
        flat = int(np.ravel_multi_index(glob, x.shape)) if x.ndim else 0
        idx = xp.full(keep_shape, flat, dtype=np.intp)
    else:
        li = getattr(xp, name)(local, axis=dims[0], keepdims=True)
        vals = xp.take_along_axis(local, li, axis=dims[0])
        idx = xp.asarray(li, dtype=np.intp) + start[dims[0]]
    axes = split_grid_axes(dist, dims)
    # subcomm() is collective the first time: every rank asks, whatever its block
    comm = dist.grid.subcomm(axes) if axes else None
    if comm is not None and idx.size:
        members = subcomm_members(dist.grid, axes)
        hv = np.ascontiguousarray(to_numpy(vals))
        hi = np.ascontiguousarray(to_numpy(idx))
        allv = np.empty((len(members), *hv.shape), hv.dtype)
        alli = np.empty((len(members), *hi.shape), hi.dtype)
        comm.Allgather([hv, mpi_dtype(hv.dtype)], [allv, mpi_dtype(hv.dtype)])
        comm.Allgather([hi, mpi_dtype(hi.dtype)], [alli, mpi_dtype(hi.dtype)])
        valid = [not _builtin_any(dist.local_shape(r)[d] == 0 for d in dims) for r in members]
        allv, alli = allv[valid], alli[valid]
        order = np.argsort(alli, axis=0, kind="stable")
        allv = np.take_along_axis(allv, order, axis=0)
        alli = np.take_along_axis(alli, order, axis=0)
        k = getattr(np, name)(allv, axis=0, keepdims=True)
        idx = xp.asarray(np.take_along_axis(alli, k, axis=0)[0])
    return _store(_finish(idx, dist, dims, keepdims, xp), out)


@collective
def argmin(x: DistArray, axis: Any = None, out: Any = None, *, keepdims: bool = False
           ) -> DistArray:
    """Index of the minimum (first one on ties, first NaN), like :func:`numpy.argmin`.

    With ``axis=None`` the index is into the flattened global array. Partial
    (value, index) pairs are gathered along the grid axes that split the
    reduced dimensions.
    """
    return _arg("argmin", x, axis, out, keepdims)


@collective
def argmax(x: DistArray, axis: Any = None, out: Any = None, *, keepdims: bool = False
           ) -> DistArray:
    """Index of the maximum, like :func:`numpy.argmax` (see :func:`argmin`)."""
    return _arg("argmax", x, axis, out, keepdims)


# ------------------------------------------------------------------ cumulative sums


def _scan(name: str, x: DistArray, axis: Any, dtype: Any, out: Any) -> DistArray:
    x = _as_dist(x, name)
    ufunc = np.add if name == "cumsum" else np.multiply
    if axis is None:
        x = reshape(x, (-1,))
        axis = 0
    a = axis_index(axis, x.ndim)
    xp = x.xp
    dist = x.dist
    dry = getattr(np, name)(np.empty((0,), x.dtype), dtype=dtype)
    _check_mpi_dtype(dry.dtype, name)
    local = xp.asarray(getattr(xp, name)(x.local, axis=a, dtype=dtype))
    axes = split_grid_axes(dist, (a,))
    if axes:
        comm = dist.grid.subcomm(axes)
        members = subcomm_members(dist.grid, axes)
        tot_shape = tuple(1 if d == a else s for d, s in enumerate(x.local_shape))
        if x.local_shape[a]:
            total = local[tuple(slice(-1, None) if d == a else slice(None)
                                for d in range(x.ndim))]
        else:
            total = xp.full(tot_shape, 0 if name == "cumsum" else 1, dtype=local.dtype)
        ht = np.ascontiguousarray(to_numpy(total))
        allt = np.empty((len(members), *ht.shape), ht.dtype)
        if ht.size:
            comm.Allgather([ht, mpi_dtype(ht.dtype)], [allt, mpi_dtype(ht.dtype)])
        mine = dist.local_start()[a]
        # blocks before this one along the axis, in global order
        before = sorted(
            (dist.local_start(r)[a], i) for i, r in enumerate(members)
            if dist.local_shape(r)[a] and dist.local_start(r)[a] < mine
        )
        if before and x.local_shape[a]:
            carry = allt[before[0][1]]
            for _, i in before[1:]:
                carry = ufunc(carry, allt[i])
            local = ufunc(local, xp.asarray(carry))
    return _store(wrap(local, dist, xp), out)


@collective
def cumsum(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None) -> DistArray:
    """Cumulative sum along ``axis`` (flattened when None), like :func:`numpy.cumsum`.

    Each rank scans its block; the block totals are gathered along the grid
    axes that split ``axis`` and the totals of the earlier blocks are added.
    """
    return _scan("cumsum", x, axis, dtype, out)


@collective
def cumprod(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None) -> DistArray:
    """Cumulative product along ``axis``, like :func:`numpy.cumprod` (see :func:`cumsum`)."""
    return _scan("cumprod", x, axis, dtype, out)


# ------------------------------------------------------------------ ufunc.reduce / accumulate

_REDUCE = {np.add: "sum", np.multiply: "prod", np.logical_and: "all", np.logical_or: "any",
           np.minimum: "min", np.maximum: "max"}


@collective
def ufunc_reduce(ufunc: np.ufunc, inputs: Any, kwargs: dict[str, Any]) -> Any:
    """``ufunc.reduce`` for add, multiply, logical_and/or, minimum and maximum."""
    name = _REDUCE.get(ufunc)
    if name is None or len(inputs) != 1 or not is_dist(inputs[0]):
        return NotImplemented
    kw = dict(kwargs)
    axis = kw.pop("axis", 0)
    out = kw.pop("out", None)
    if isinstance(out, tuple):
        out = out[0]
    keepdims = kw.pop("keepdims", False)
    dtype = kw.pop("dtype", None)
    initial = kw.pop("initial", _NoValue)
    where = kw.pop("where", True)
    if kw:
        raise TypeError(f"{ufunc.__name__}.reduce on a DistArray does not take {sorted(kw)}")
    x = inputs[0]
    if name in ("min", "max"):
        return _extreme(name, x, axis, out, keepdims, initial, where)
    if name in ("all", "any"):
        if dtype is not None and np.dtype(dtype) != np.bool_:
            return NotImplemented
        return _simple(name, x, axis, None, out, keepdims, initial, where)
    return _simple(name, x, axis, dtype, out, keepdims, initial, where)


@collective
def ufunc_accumulate(ufunc: np.ufunc, inputs: Any, kwargs: dict[str, Any]) -> Any:
    """``np.add.accumulate`` and ``np.multiply.accumulate`` (cumsum and cumprod)."""
    if ufunc not in (np.add, np.multiply) or len(inputs) != 1 or not is_dist(inputs[0]):
        return NotImplemented
    kw = dict(kwargs)
    out = kw.pop("out", None)
    if isinstance(out, tuple):
        out = out[0]
    axis, dtype = kw.pop("axis", 0), kw.pop("dtype", None)
    if kw:
        raise TypeError(f"{ufunc.__name__}.accumulate on a DistArray does not take {sorted(kw)}")
    return _scan("cumsum" if ufunc is np.add else "cumprod", inputs[0], axis, dtype, out)


# ------------------------------------------------------------------ derived reductions


def _wrap_like(x: DistArray, local: Any) -> DistArray:
    return wrap(local, x.dist, x.xp)


def ptp(x: DistArray, axis: Any = None, out: Any = None, keepdims: bool = False) -> DistArray:
    """Range (max - min) over ``axis``, like :func:`numpy.ptp`."""
    r = np.subtract(max(x, axis, keepdims=keepdims), min(x, axis, keepdims=keepdims))
    return _store(r, out)


def _nan_free(x: DistArray, fill: Any) -> DistArray:
    return _wrap_like(x, x.xp.where(x.xp.isnan(x.local), fill, x.local))


def _count_valid(x: DistArray, dims: tuple[int, ...], keepdims: bool) -> DistArray:
    valid = x.xp.asarray(~x.xp.isnan(x.local), dtype=np.intp)
    return _finish(_reduce_local(valid, x.dist, dims, "sum", None, x.xp), x.dist, dims,
                   keepdims, x.xp)


def nansum(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None,
           keepdims: bool = False, initial: Any = _NoValue, where: Any = True) -> DistArray:
    """Sum treating NaN as zero, like :func:`numpy.nansum`."""
    x = _as_dist(x, "nansum")
    y = _nan_free(x, 0) if x.dtype.kind in "fc" else x
    return sum(y, axis, dtype, out, keepdims, initial, where)


def nanprod(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None,
            keepdims: bool = False, initial: Any = _NoValue, where: Any = True) -> DistArray:
    """Product treating NaN as one, like :func:`numpy.nanprod`."""
    x = _as_dist(x, "nanprod")
    y = _nan_free(x, 1) if x.dtype.kind in "fc" else x
    return prod(y, axis, dtype, out, keepdims, initial, where)


def _nan_extreme(name: str, x: DistArray, axis: Any, out: Any, keepdims: bool,
                 initial: Any, where: Any) -> DistArray:
    x = _as_dist(x, f"nan{name}")
    if x.dtype.kind not in "fc":
        return _extreme(name, x, axis, out, keepdims, initial, where)
    ident = _extreme_identity(x.dtype, name)
    r = _extreme(name, _nan_free(x, ident), axis, None, keepdims, initial, where)
    n = _count_valid(x, normalize_axes(axis, x.ndim), keepdims)
    r.local[...] = r.xp.where(n.local == 0, np.nan, r.local)
    return _store(r, out)


def nanmin(x: DistArray, axis: Any = None, out: Any = None, keepdims: bool = False,
           initial: Any = _NoValue, where: Any = True) -> DistArray:
    """Minimum ignoring NaN (NaN where all are NaN), like :func:`numpy.nanmin`."""
    return _nan_extreme("min", x, axis, out, keepdims, initial, where)


def nanmax(x: DistArray, axis: Any = None, out: Any = None, keepdims: bool = False,
           initial: Any = _NoValue, where: Any = True) -> DistArray:
    """Maximum ignoring NaN, like :func:`numpy.nanmax`."""
    return _nan_extreme("max", x, axis, out, keepdims, initial, where)


def nanmean(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None,
            keepdims: bool = False, *, where: Any = True) -> DistArray:
    """Mean ignoring NaN, like :func:`numpy.nanmean`."""
    x = _as_dist(x, "nanmean")
    if x.dtype.kind not in "fc":
        return mean(x, axis, dtype, out, keepdims, where=where)
    dims = normalize_axes(axis, x.ndim)
    s = sum(_nan_free(x, 0), axis, dtype, None, keepdims, where=where)
    n = _count_valid(x, dims, keepdims)
    with np.errstate(invalid="ignore", divide="ignore"):
        s.local[...] = s.local / n.local
    return _store(s, out)


def nanvar(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None,
           ddof: float = 0, keepdims: bool = False, *, where: Any = True) -> DistArray:
    """Variance ignoring NaN, like :func:`numpy.nanvar`."""
    x = _as_dist(x, "nanvar")
    if x.dtype.kind not in "fc":
        return var(x, axis, dtype, out, ddof, keepdims, where=where)
    dims = normalize_axes(axis, x.ndim)
    xp = x.xp
    nan = xp.isnan(x.local)
    m = nanmean(x, axis, dtype, None, True)
    with np.errstate(invalid="ignore", divide="ignore"):
        dev = xp.where(nan, 0, x.local - m.local)
        sq = dev.real * dev.real + dev.imag * dev.imag if dev.dtype.kind == "c" else dev * dev
        ss = _finish(_reduce_local(sq, x.dist, dims, "sum", dtype, xp), x.dist, dims,
                     keepdims, xp)
        n = _count_valid(x, dims, keepdims)
        ss.local[...] = ss.local / xp.maximum(n.local - ddof, 0)
    return _store(ss, out)


def nanstd(x: DistArray, axis: Any = None, dtype: Any = None, out: Any = None,
           ddof: float = 0, keepdims: bool = False, *, where: Any = True) -> DistArray:
    """Standard deviation ignoring NaN, like :func:`numpy.nanstd`."""
    v = nanvar(x, axis, dtype, None, ddof, keepdims, where=where)
    v.local[...] = v.xp.sqrt(v.local)
    return _store(v, out)


def trace(x: DistArray, offset: int = 0, axis1: int = 0, axis2: int = 1, dtype: Any = None,
          out: Any = None) -> DistArray:
    """Sum along a diagonal, like :func:`numpy.trace` (a masked sum; one Allreduce)."""
    x = _as_dist(x, "trace")
    if x.ndim < 2:
        raise ValueError("diag requires an array of at least two dimensions")
    a1, a2 = axis_index(axis1, x.ndim), axis_index(axis2, x.ndim)
    if a1 == a2:
        raise ValueError("axis1 and axis2 cannot be the same")
    sl = x.dist.local_slices()
    shape = [1] * x.ndim
    rows = np.arange(sl[a1].start, sl[a1].stop)
    cols = np.arange(sl[a2].start, sl[a2].stop)
    shape1, shape2 = list(shape), list(shape)
    shape1[a1], shape2[a2] = rows.size, cols.size
    on = rows.reshape(shape1) + offset == cols.reshape(shape2)
    xp = x.xp
    masked = _wrap_like(x, xp.where(xp.asarray(on), x.local, 0).astype(x.dtype, copy=False))
    return sum(masked, (a1, a2), dtype, out)


def _cumulative(name: str, x: DistArray, axis: Any, dtype: Any, out: Any,
                include_initial: bool) -> DistArray:
    x = _as_dist(x, name)
    if axis is None:
        if x.ndim > 1:
            raise ValueError("axis must be specified for multi-dimensional arrays.")
        axis = 0
    a = axis_index(axis, _builtin_max(x.ndim, 1))
    r = _scan("cumsum" if name == "cumulative_sum" else "cumprod", x, a, dtype, None)
    if include_initial:
        shape = tuple(1 if d == a else s for d, s in enumerate(r.shape))
        ident = np.full(shape, 0 if name == "cumulative_sum" else 1, dtype=r.dtype)
        r = concatenate([ident, r], axis=a)
    return _store(r, out)


def cumulative_sum(x: DistArray, /, *, axis: Any = None, dtype: Any = None, out: Any = None,
                   include_initial: bool = False) -> DistArray:
    """Cumulative sum, like :func:`numpy.cumulative_sum` (see :func:`cumsum`)."""
    return _cumulative("cumulative_sum", x, axis, dtype, out, include_initial)


def cumulative_prod(x: DistArray, /, *, axis: Any = None, dtype: Any = None, out: Any = None,
                    include_initial: bool = False) -> DistArray:
    """Cumulative product, like :func:`numpy.cumulative_prod`."""
    return _cumulative("cumulative_prod", x, axis, dtype, out, include_initial)
