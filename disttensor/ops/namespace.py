"""The Python array API namespace of DistArrays: ``x.__array_namespace__()``.

Array-API code written as ``xp = array_namespace(x); xp.mean(x, axis=0)``
runs on DistArrays through this module. It covers the standard's element-wise
functions, statistics, utility and searching functions, manipulation functions,
``matmul``/``matrix_transpose``/``vecdot``/``tensordot``, data type
functions, constants, creation functions, sorting, searching and set
functions: the whole 2023.12 core. The extensions are
``xp.linalg`` (:mod:`~disttensor.ops.linalg_ext`) and ``xp.fft``
(:mod:`~disttensor.ops.fft`), namespaces holding exactly the standard's
names. Semantics are NumPy's (NumPy 2 follows the standard).

Creation functions without an array argument (``zeros``, ``arange``,
``asarray``, ...) build arrays on the default grid (a 1-D grid over
``COMM_WORLD``, first dimension split); the ``*_like`` functions keep the
distribution of their argument.
"""

from __future__ import annotations

import math
import types
from typing import Any, NamedTuple

import numpy as np

import disttensor.creation as creation
import disttensor.ops.elementwise as elementwise
import disttensor.ops.fft as _fft
import disttensor.ops.linalg as _linalg
import disttensor.ops.linalg_ext as _linalg_ext
import disttensor.ops.reductions as reductions
import disttensor.ops.replication as replication
import disttensor.ops.searching as searching
import disttensor.ops.sets as sets
import disttensor.ops.shape as _shape
import disttensor.ops.sorting as sorting

from ..array import DistArray
from ..backend import array_namespace
from ._util import is_dist, wrap
from .indexing import nonzero as nz
from .ufuncs import local_function

__array_api_version__ = "2023.12"

# ------------------------------------------------------------------ constants and dtypes
e = math.e
inf = math.inf
nan = math.nan
pi = math.pi
newaxis = None

bool = np.bool_  # noqa: A001 - the standard's name
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
float32, float64 = np.float32, np.float64
complex64, complex128 = np.complex64, np.complex128

# ------------------------------------------------------------------ element-wise functions
_UFUNCS = {
    "abs": np.absolute, "acos": np.arccos, "acosh": np.arccosh, "add": np.add,
    "asin": np.arcsin, "asinh": np.arcsinh, "atan": np.arctan, "atan2": np.arctan2,
    "atanh": np.arctanh, "bitwise_and": np.bitwise_and, "bitwise_left_shift": np.left_shift,
    "bitwise_invert": np.invert, "bitwise_or": np.bitwise_or,
    "bitwise_right_shift": np.right_shift, "bitwise_xor": np.bitwise_xor, "ceil": np.ceil,
    "conj": np.conjugate, "copysign": np.copysign, "cos": np.cos, "cosh": np.cosh,
    "divide": np.divide, "equal": np.equal, "exp": np.exp,
    "floor": np.floor, "floor_divide": np.floor_divide, "greater": np.greater,
    "greater_equal": np.greater_equal, "hypot": np.hypot, "isfinite": np.isfinite,
    "isinf": np.isinf, "isnan": np.isnan, "less": np.less, "less_equal": np.less_equal,
    "log": np.log, "log1p": np.log1p, "log2": np.log2, "log10": np.log10,
    "logaddexp": np.logaddexp, "logical_and": np.logical_and, "logical_not": np.logical_not,
    "logical_or": np.logical_or, "logical_xor": np.logical_xor, "maximum": np.maximum,
    "minimum": np.minimum, "multiply": np.multiply, "negative": np.negative,
    "nextafter": np.nextafter, "not_equal": np.not_equal, "positive": np.positive,
    "pow": np.power, "reciprocal": np.reciprocal, "remainder": np.remainder,
    "sign": np.sign, "signbit": np.signbit, "sin": np.sin, "sinh": np.sinh,
    "square": np.square, "sqrt": np.sqrt, "subtract": np.subtract, "tan": np.tan,
    "tanh": np.tanh, "trunc": np.trunc,
}


def _make(name: str, uf: np.ufunc) -> Any:
    if uf.nin == 1:
        def f(x: Any, /) -> DistArray:
            return uf(x)
    else:
        def f(x1: Any, x2: Any, /) -> DistArray:  # type: ignore[misc]
            return uf(x1, x2)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"Array API ``{name}``: :data:`numpy.{uf.__name__}` on DistArrays."
    return f


for _name, _uf in _UFUNCS.items():
    globals()[_name] = _make(_name, _uf)
del _name, _uf


def _expm1_standard(z: Any) -> Any:
    """``expm1`` of a block, with the standard's special cases for complex values."""
    xp = array_namespace(z)
    with np.errstate(all="ignore"):
        out = xp.expm1(z)
        if z.dtype.kind != "c" or out.size == 0:
            return out
        a, b = xp.real(z), xp.imag(z)
        # a zero imaginary part stays that zero and the real part is a real expm1 (+0 for -0)
        fix = xp.empty_like(out)
        fix.real[...], fix.imag[...] = xp.expm1(a) + 0.0, b
        out = xp.where(b == 0, fix, out)
        wild = ~xp.isfinite(b)
        # -inf + bj: -1 + 0j, the zero signed like an infinite b (conj symmetry)
        fix.real[...], fix.imag[...] = -1.0, xp.where(xp.isinf(b), xp.copysign(0.0, b), 0.0)
        out = xp.where(wild & (a == -np.inf), fix, out)
        fix.real[...], fix.imag[...] = np.inf, np.nan
        out = xp.where(wild & (a == np.inf), fix, out)
    return out


def expm1(x: Any, /) -> DistArray:
    """Array API ``expm1``: :data:`numpy.expm1`, with the standard's special cases where
    NumPy's complex ``expm1`` differs.

    NumPy computes ``exp(a) * cis(b) - 1`` for ``z = a + bj`` and so loses the
    cases where that product is ``inf * 0`` or ``inf * NaN``. The standard
    (after C99 Annex G, with ``expm1(conj(z)) == conj(expm1(z))``) has
    ``expm1(a + 0j) = expm1(a) + 0j`` (``+0 + 0j`` for ``a = -0`` and ``NaN + 0j``
    for ``a = NaN``), and, for an infinite or NaN ``b``,
    ``expm1(-inf + bj) = -1 + 0j`` and ``expm1(+inf + bj) = inf + NaN j``.
    Real arguments are NumPy's.
    """
    if not is_dist(x) or x.dtype.kind != "c":
        return np.expm1(x)
    return local_function(_expm1_standard, [x])


def real(x: Any, /) -> DistArray:
    """The real part."""
    return elementwise.real(x)


def imag(x: Any, /) -> DistArray:
    """The imaginary part."""
    return elementwise.imag(x)


def round(x: Any, /) -> DistArray:  # noqa: A001
    """Round half to even."""
    return elementwise.round(x)


def clip(x: Any, /, min: Any = None, max: Any = None) -> DistArray:  # noqa: A002
    """Clamp to ``[min, max]``."""
    return elementwise.clip(x, min, max)


# ------------------------------------------------------------------ statistics and utility


def sum(x: DistArray, /, *, axis: Any = None, dtype: Any = None,  # noqa: A001
        keepdims: bool = False) -> DistArray:
    """Sum (see :func:`disttensor.ops.reductions.sum`)."""
    return reductions.sum(x, axis=axis, dtype=dtype, keepdims=keepdims)


def prod(x: DistArray, /, *, axis: Any = None, dtype: Any = None,
         keepdims: bool = False) -> DistArray:
    """Product."""
    return reductions.prod(x, axis=axis, dtype=dtype, keepdims=keepdims)


def mean(x: DistArray, /, *, axis: Any = None, keepdims: bool = False) -> DistArray:
    """Arithmetic mean."""
    return reductions.mean(x, axis=axis, keepdims=keepdims)


def var(x: DistArray, /, *, axis: Any = None, correction: float = 0.0,
        keepdims: bool = False) -> DistArray:
    """Variance with ``correction`` degrees of freedom removed."""
    return reductions.var(x, axis=axis, ddof=correction, keepdims=keepdims)


def std(x: DistArray, /, *, axis: Any = None, correction: float = 0.0,
        keepdims: bool = False) -> DistArray:
    """Standard deviation."""
    return reductions.std(x, axis=axis, ddof=correction, keepdims=keepdims)


def max(x: DistArray, /, *, axis: Any = None, keepdims: bool = False) -> DistArray:  # noqa: A001
    """Maximum."""
    return reductions.max(x, axis=axis, keepdims=keepdims)


def min(x: DistArray, /, *, axis: Any = None, keepdims: bool = False) -> DistArray:  # noqa: A001
    """Minimum."""
    return reductions.min(x, axis=axis, keepdims=keepdims)


def all(x: DistArray, /, *, axis: Any = None, keepdims: bool = False) -> DistArray:  # noqa: A001
    """Logical AND reduction."""
    return reductions.all(x, axis=axis, keepdims=keepdims)


def any(x: DistArray, /, *, axis: Any = None, keepdims: bool = False) -> DistArray:  # noqa: A001
    """Logical OR reduction."""
    return reductions.any(x, axis=axis, keepdims=keepdims)


def argmax(x: DistArray, /, *, axis: int | None = None, keepdims: bool = False) -> DistArray:
    """Index of the maximum."""
    return reductions.argmax(x, axis=axis, keepdims=keepdims)


def argmin(x: DistArray, /, *, axis: int | None = None, keepdims: bool = False) -> DistArray:
    """Index of the minimum."""
    return reductions.argmin(x, axis=axis, keepdims=keepdims)


def count_nonzero(x: DistArray, /, *, axis: Any = None, keepdims: bool = False) -> DistArray:
    """Number of non-zero elements."""
    return reductions.count_nonzero(x, axis=axis, keepdims=keepdims)


def cumulative_sum(x: DistArray, /, *, axis: int | None = None, dtype: Any = None,
                   include_initial: bool = False) -> DistArray:
    """Cumulative sum."""
    return reductions.cumulative_sum(x, axis=axis, dtype=dtype,
                                     include_initial=include_initial)


def cumulative_prod(x: DistArray, /, *, axis: int | None = None, dtype: Any = None,
                    include_initial: bool = False) -> DistArray:
    """Cumulative product."""
    return reductions.cumulative_prod(x, axis=axis, dtype=dtype,
                                      include_initial=include_initial)


def diff(x: DistArray, /, *, axis: int = -1, n: int = 1, prepend: Any = None,
         append: Any = None) -> DistArray:
    """``n``-th differences along ``axis`` (``prepend``/``append`` are not supported)."""
    if prepend is not None or append is not None:
        raise TypeError("diff of a DistArray does not support prepend= or append=")
    return _shape.diff(x, n, axis)


def nonzero(x: DistArray, /) -> tuple[DistArray, ...]:
    """Indices of the non-zero elements."""
    return nz(x)


def where(condition: Any, x1: Any, x2: Any, /) -> DistArray:
    """Select from ``x1`` where ``condition`` is true, else from ``x2``."""
    return elementwise.where(condition, x1, x2)


# ------------------------------------------------------------------ manipulation


def concat(arrays: Any, /, *, axis: int | None = 0) -> DistArray:
    """Join along an existing axis."""
    return _shape.concatenate(arrays, axis=axis)


def stack(arrays: Any, /, *, axis: int = 0) -> DistArray:
    """Join along a new axis."""
    return _shape.stack(arrays, axis=axis)


def reshape(x: DistArray, /, shape: Any, *, copy: Any = None) -> DistArray:
    """New shape (always a copy)."""
    return _shape.reshape(x, shape, copy=copy)


def permute_dims(x: DistArray, /, axes: Any) -> DistArray:
    """Permute the dimensions."""
    return _shape.transpose(x, axes)


def matrix_transpose(x: DistArray, /) -> DistArray:
    """Swap the last two dimensions."""
    return _shape.matrix_transpose(x)


def expand_dims(x: DistArray, /, axis: int = 0) -> DistArray:
    """Insert a dimension of size 1."""
    return _shape.expand_dims(x, axis)


def squeeze(x: DistArray, /, axis: Any) -> DistArray:
    """Remove dimensions of size 1."""
    return _shape.squeeze(x, axis)


def flip(x: DistArray, /, *, axis: Any = None) -> DistArray:
    """Reverse along ``axis``."""
    return _shape.flip(x, axis)


def moveaxis(x: DistArray, source: Any, destination: Any, /) -> DistArray:
    """Move dimensions."""
    return _shape.moveaxis(x, source, destination)


def broadcast_to(x: DistArray, /, shape: Any) -> DistArray:
    """Broadcast to a shape."""
    return _shape.broadcast_to(x, shape)


def broadcast_shapes(*shapes: Any) -> tuple[int, ...]:
    """The shape that ``shapes`` broadcast to."""
    return tuple(np.broadcast_shapes(*shapes))


def roll(x: DistArray, /, shift: Any, *, axis: Any = None) -> DistArray:
    """Roll elements along ``axis``."""
    return _shape.roll(x, shift, axis)


def unstack(x: DistArray, /, *, axis: int = 0) -> tuple[DistArray, ...]:
    """Split into the slices along ``axis``."""
    return _shape.unstack(x, axis=axis)


def broadcast_arrays(*arrays: Any) -> list[DistArray]:
    """Broadcast against each other."""
    return _shape.broadcast_arrays(*arrays)


def tile(x: DistArray, repetitions: Any, /) -> DistArray:
    """Repeat the whole array along each dimension (:mod:`disttensor.ops.replication`)."""
    return replication.tile(x, repetitions)


def repeat(x: DistArray, repeats: Any, /, *, axis: int | None = None) -> DistArray:
    """Repeat each element."""
    return replication.repeat(x, repeats, axis=axis)


def meshgrid(*arrays: DistArray, indexing: str = "xy") -> list[DistArray]:
    """Coordinate grids from 1-D arrays."""
    return replication.meshgrid(*arrays, indexing=indexing)


# ------------------------------------------------------------------ linear algebra


def tensordot(x1: DistArray, x2: DistArray, /, *, axes: Any = 2) -> DistArray:
    """Sum of products over ``axes`` (a distributed matrix product)."""
    return _linalg.tensordot(x1, x2, axes=axes)



def matmul(x1: Any, x2: Any, /) -> DistArray:
    """Matrix product (SUMMA, see :mod:`disttensor.ops.linalg`)."""
    return _linalg.matmul(x1, x2)


def vecdot(x1: Any, x2: Any, /, *, axis: int = -1) -> DistArray:
    """Conjugated dot product along ``axis``, in the operands' result type (``uint8``
    operands give ``uint8``, wrapping around as the standard's integer arithmetic does)."""
    out = _linalg.vecdot(x1, x2, axis=axis)
    want = np.result_type(*(a.dtype if is_dist(a) else np.asarray(a).dtype for a in (x1, x2)))
    return out if out.dtype == want else out.astype(want)


# ------------------------------------------------------------------ sorting


def sort(x: DistArray, /, *, axis: int = -1, descending: bool = False,
         stable: bool = True) -> DistArray:
    """Sorted copy along ``axis`` (distributed sample sort, see :mod:`disttensor.ops.sorting`)."""
    return sorting.sort(x, axis=axis, descending=descending, stable=stable)


def argsort(x: DistArray, /, *, axis: int = -1, descending: bool = False,
            stable: bool = True) -> DistArray:
    """Indices that sort ``x`` along ``axis``."""
    return sorting.argsort(x, axis=axis, descending=descending, stable=stable)


def searchsorted(x1: DistArray, x2: Any, /, *, side: str = "left",
                 sorter: Any = None) -> DistArray:
    """Insertion indices of ``x2`` in the sorted 1-D ``x1`` (:mod:`disttensor.ops.searching`)."""
    return searching.searchsorted(x1, x2, side=side, sorter=sorter)


def take(x: DistArray, indices: Any, /, *, axis: int | None = None) -> DistArray:
    """Elements at integer ``indices`` along ``axis``."""
    return searching.take(x, indices, axis=axis)


# ------------------------------------------------------------------ sets


def unique_values(x: DistArray, /) -> DistArray:
    """Distinct values, sorted (see :mod:`disttensor.ops.sets` for the distribution)."""
    return sets.unique_values(x)


def unique_counts(x: DistArray, /) -> Any:
    """Distinct values and their counts."""
    return sets.unique_counts(x)


def unique_inverse(x: DistArray, /) -> Any:
    """Distinct values and the inverse indices."""
    return sets.unique_inverse(x)


def unique_all(x: DistArray, /) -> Any:
    """Distinct values, first indices, inverse indices and counts."""
    return sets.unique_all(x)


# ------------------------------------------------------------------ extensions


def _extension(name: str, module: types.ModuleType) -> types.ModuleType:
    """A namespace holding exactly ``module.STANDARD_NAMES`` (the standard's functions)."""
    ns = types.ModuleType(f"disttensor.{name}", module.__doc__)
    for n in module.STANDARD_NAMES:
        setattr(ns, n, getattr(module, n))
    ns.__all__ = list(module.STANDARD_NAMES)
    return ns


#: The array API ``fft`` extension (:mod:`disttensor.ops.fft`).
fft = _extension("fft", _fft)
#: The array API ``linalg`` extension (:mod:`disttensor.ops.linalg_ext`).
linalg = _extension("linalg", _linalg_ext)


# ------------------------------------------------------------------ data types


def astype(x: DistArray, dtype: Any, /, *, copy: bool = True, device: Any = None) -> DistArray:
    """Cast to ``dtype``."""
    return elementwise.astype(x, dtype, copy=copy)


def can_cast(from_: Any, to: Any, /) -> bool:
    """Whether ``from_`` casts safely to ``to``."""
    return np.can_cast(from_.dtype if is_dist(from_) else from_, to)


def result_type(*arrays_and_dtypes: Any) -> np.dtype:
    """Type promotion."""
    return np.result_type(*(a.dtype if is_dist(a) else a for a in arrays_and_dtypes))


class finfo_object(NamedTuple):  # noqa: N801 - the standard's name
    """The standard's ``finfo`` result: Python floats and ints, and the dtype."""

    bits: int
    eps: float
    max: float
    min: float
    smallest_normal: float
    dtype: np.dtype


def finfo(type: Any, /) -> finfo_object:  # noqa: A002
    """Machine limits of a floating dtype (or of an array's dtype), as Python floats.

    For complex dtypes the limits are those of their real and imaginary parts.
    """
    f = np.finfo(type.dtype if is_dist(type) else type)
    return finfo_object(int(f.bits), float(f.eps), float(f.max), float(f.min),
                        float(f.smallest_normal), f.dtype)


def iinfo(type: Any, /) -> Any:  # noqa: A002
    """Machine limits of an integer dtype (or of an array's dtype)."""
    return np.iinfo(type.dtype if is_dist(type) else type)


isdtype = np.isdtype


# ------------------------------------------------------------------ creation


def asarray(obj: Any, /, *, dtype: Any = None, device: Any = None, copy: Any = None,
            **dist_kw: Any) -> DistArray:
    """A DistArray from ``obj`` (the same on every rank), on the default grid."""
    if is_dist(obj):
        if dtype is not None and np.dtype(dtype) != obj.dtype:
            return obj.astype(dtype)
        return obj.copy() if copy else obj
    return creation.asarray(np.asarray(_scalars(obj), dtype=dtype), **dist_kw)


def _scalars(obj: Any) -> Any:
    """``obj`` with its 0-d DistArrays (at any depth of nested lists) replaced by their values;
    a 0-d DistArray holds its value on every rank."""
    if isinstance(obj, (list, tuple)):
        return [_scalars(o) for o in obj]
    if is_dist(obj):
        if obj.ndim:
            raise ValueError("asarray: a nested sequence may hold only 0-d DistArrays")
        return obj.local[()]
    return obj


def from_dlpack(x: Any, /, *, device: Any = None, copy: Any = None) -> DistArray:
    """A DistArray from a DLPack-capable object (the same on every rank), on the default grid.

    A DistArray is returned as it is. The object is imported with
    :func:`numpy.from_dlpack` (no copy) and then distributed, which copies
    this rank's block.
    """
    if is_dist(x):
        return x.copy() if copy else x
    return creation.asarray(np.from_dlpack(x))


def _default_dtype(dtype: Any) -> Any:
    return np.float64 if dtype is None else dtype


def zeros(shape: Any, *, dtype: Any = None, device: Any = None, **dist_kw: Any) -> DistArray:
    """Zeros on the default grid (or ``grid=``, ``axes=``, ``dist=``)."""
    return creation.zeros(shape, _default_dtype(dtype), **dist_kw)


def ones(shape: Any, *, dtype: Any = None, device: Any = None, **dist_kw: Any) -> DistArray:
    """Ones."""
    return creation.ones(shape, _default_dtype(dtype), **dist_kw)


def empty(shape: Any, *, dtype: Any = None, device: Any = None, **dist_kw: Any) -> DistArray:
    """Uninitialised."""
    return creation.empty(shape, _default_dtype(dtype), **dist_kw)


def full(shape: Any, fill_value: Any, *, dtype: Any = None, device: Any = None,
         **dist_kw: Any) -> DistArray:
    """Filled with ``fill_value``."""
    if dtype is None:
        dtype = np.result_type(fill_value) if not isinstance(fill_value, float) else np.float64
    return creation.full(shape, fill_value, dtype, **dist_kw)


def arange(start: Any, /, stop: Any = None, step: Any = 1, *, dtype: Any = None,
           device: Any = None, **dist_kw: Any) -> DistArray:
    """Evenly spaced values."""
    return creation.arange(start, stop, step, dtype, **dist_kw)


def linspace(start: Any, stop: Any, /, num: int, *, dtype: Any = None, device: Any = None,
             endpoint: bool = True, **dist_kw: Any) -> DistArray:
    """``num`` evenly spaced values from ``start`` to ``stop``, like :func:`numpy.linspace`."""
    ref = np.linspace(start, stop, 2 if endpoint else 1, endpoint=endpoint, dtype=dtype)
    out = creation.empty((num,), ref.dtype, **dist_kw)
    div = (num - 1) if endpoint else num
    sl = out.dist.local_slices()[0]
    i = np.arange(sl.start, sl.stop, dtype=np.result_type(ref.dtype, np.float64))
    step = (stop - start) / div if div > 0 else np.nan
    vals = i * step + start if div > 0 else i * (stop - start) + start
    if endpoint and num > 1 and sl.stop == num and sl.stop > sl.start:
        vals[-1] = stop
    out.local[...] = vals.astype(ref.dtype, copy=False)
    return out


def eye(n_rows: int, n_cols: int | None = None, /, *, k: int = 0, dtype: Any = None,
        device: Any = None, **dist_kw: Any) -> DistArray:
    """Ones on the ``k``-th diagonal."""
    n_cols = n_rows if n_cols is None else n_cols
    out = creation.zeros((n_rows, n_cols), _default_dtype(dtype), **dist_kw)
    r, c = out.dist.local_slices()
    rows = np.arange(r.start, r.stop)[:, None]
    cols = np.arange(c.start, c.stop)[None, :]
    out.local[...] = out.xp.asarray(cols - rows == k)
    return out


def _tri(x: DistArray, k: int, lower: bool) -> DistArray:
    if x.ndim < 2:
        raise ValueError("tril/triu need at least 2 dimensions")
    sl = x.dist.local_slices()
    rows = np.arange(sl[-2].start, sl[-2].stop)[:, None]
    cols = np.arange(sl[-1].start, sl[-1].stop)[None, :]
    keep = (cols - rows <= k) if lower else (cols - rows >= k)
    return wrap(x.xp.where(x.xp.asarray(keep), x.local, 0).astype(x.dtype), x.dist, x.xp)


def tril(x: DistArray, /, *, k: int = 0) -> DistArray:
    """Lower triangle (no communication)."""
    return _tri(x, k, True)


def triu(x: DistArray, /, *, k: int = 0) -> DistArray:
    """Upper triangle (no communication)."""
    return _tri(x, k, False)


def zeros_like(x: DistArray, /, *, dtype: Any = None, device: Any = None) -> DistArray:
    """Zeros with ``x``'s distribution."""
    return np.zeros_like(x, dtype=dtype)


def ones_like(x: DistArray, /, *, dtype: Any = None, device: Any = None) -> DistArray:
    """Ones with ``x``'s distribution."""
    return np.ones_like(x, dtype=dtype)


def empty_like(x: DistArray, /, *, dtype: Any = None, device: Any = None) -> DistArray:
    """Uninitialised, with ``x``'s distribution."""
    return np.empty_like(x, dtype=dtype)


def full_like(x: DistArray, /, fill_value: Any, *, dtype: Any = None,
              device: Any = None) -> DistArray:
    """Filled, with ``x``'s distribution."""
    return np.full_like(x, fill_value, dtype=dtype)


# ------------------------------------------------------------------ inspection


class _Info:
    """``__array_namespace_info__()``: capabilities, devices and default dtypes."""

    def capabilities(self) -> dict[str, Any]:
        return {"boolean indexing": True, "data-dependent shapes": True,
                "max dimensions": None}

    def default_device(self) -> str:
        return "cpu"

    def devices(self) -> list[str]:
        return ["cpu"]

    def default_dtypes(self, *, device: Any = None) -> dict[str, Any]:
        return {"real floating": np.dtype(np.float64), "complex floating":
                np.dtype(np.complex128), "integral": np.dtype(np.int64),
                "indexing": np.dtype(np.intp)}

    def dtypes(self, *, device: Any = None, kind: Any = None) -> dict[str, Any]:
        names = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "float32", "float64", "complex64", "complex128"]
        out = {n: np.dtype(n) for n in names}
        if kind is None:
            return out
        return {n: d for n, d in out.items() if np.isdtype(d, kind)}


def __array_namespace_info__() -> _Info:
    return _Info()
