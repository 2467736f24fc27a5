"""Element-wise functions that are not ufuncs: where, clip, round, real, imag, isclose, ...

They follow the operand rule of :mod:`disttensor.ops.align` (the result takes
the first full-shape DistArray operand's distribution) and run NumPy's own
function on each block. Whole-array predicates (``allclose``,
``array_equal``) reduce over all ranks and return a Python bool on every
rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..array import DistArray
from ..settings import collective
from ._util import is_dist, wrap
from .reductions import all as dall
from .ufuncs import local_function

__all__ = [
    "where",
    "clip",
    "round",
    "real",
    "imag",
    "isclose",
    "allclose",
    "array_equal",
    "astype",
    "nan_to_num",
]

_builtin_round = round


@collective
def where(condition: Any, x: Any = None, y: Any = None) -> DistArray:
    """``x`` where ``condition`` holds, else ``y``, like :func:`numpy.where` (3 arguments)."""
    if x is None or y is None:
        raise TypeError("where of DistArrays needs x and y (the 1-argument form, nonzero, "
                        "is not supported)")
    return local_function(np.where, [condition, x, y])


@collective
def clip(a: Any, a_min: Any = np._NoValue, a_max: Any = np._NoValue,  # type: ignore[attr-defined]
         out: Any = None, *, min: Any = np._NoValue, max: Any = np._NoValue,  # type: ignore[attr-defined]
         **kwargs: Any) -> DistArray:
    """Limit values to ``[a_min, a_max]``, like :func:`numpy.clip` (bounds may be arrays)."""
    novalue = np._NoValue  # type: ignore[attr-defined]
    lo = a_min if a_min is not novalue else (None if min is novalue else min)
    hi = a_max if a_max is not novalue else (None if max is novalue else max)
    if kwargs:
        raise TypeError(f"clip of a DistArray does not take {sorted(kwargs)}")
    return local_function(np.clip, [a, lo, hi], out=out)


def round(a: Any, decimals: int = 0, out: Any = None) -> DistArray:
    """Round to ``decimals`` decimals, like :func:`numpy.round`."""
    return local_function(np.round, [a], out=out, decimals=decimals)


def real(a: Any) -> DistArray:
    """The real part, like :func:`numpy.real`."""
    return local_function(np.real, [a])


def imag(a: Any) -> DistArray:
    """The imaginary part, like :func:`numpy.imag`."""
    return local_function(np.imag, [a])


def nan_to_num(x: Any, copy: bool = True, nan: float = 0.0, posinf: Any = None,
               neginf: Any = None) -> DistArray:
    """Replace NaN and infinities, like :func:`numpy.nan_to_num` (always a new array)."""
    return local_function(np.nan_to_num, [x], nan=nan, posinf=posinf, neginf=neginf)


@collective
def isclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08,
            equal_nan: bool = False) -> DistArray:
    """Element-wise closeness, like :func:`numpy.isclose`."""
    return local_function(np.isclose, [a, b], rtol=rtol, atol=atol, equal_nan=equal_nan)


@collective
def allclose(a: Any, b: Any, rtol: float = 1e-05, atol: float = 1e-08,
             equal_nan: bool = False) -> bool:
    """Whether all elements are close, like :func:`numpy.allclose` (collective; a bool)."""
    return bool(dall(isclose(a, b, rtol, atol, equal_nan)).local[()])


@collective
def array_equal(a1: Any, a2: Any, equal_nan: bool = False) -> bool:
    """Whether two arrays have the same shape and elements (collective; a bool)."""
    if tuple(np.shape(a1) if not is_dist(a1) else a1.shape) != tuple(
            np.shape(a2) if not is_dist(a2) else a2.shape):
        return False
    if equal_nan:
        eq = local_function(lambda x, y: (x == y) | (np.isnan(x) & np.isnan(y)), [a1, a2])
    else:
        eq = np.equal(a1, a2)
    return bool(dall(eq).local[()])


def astype(x: DistArray, dtype: Any, /, *, copy: bool = True, casting: str = "unsafe",
           device: Any = None) -> DistArray:
    """``x`` cast to ``dtype`` (same distribution), like :func:`numpy.astype`."""
    if not is_dist(x):
        raise TypeError(f"astype: expected a DistArray, got {type(x).__name__}")
    np.empty((0,), x.dtype).astype(dtype, casting=casting)  # NumPy's errors on every rank
    if not copy and np.dtype(dtype) == x.dtype:
        return x
    return wrap(x.local.astype(dtype, casting=casting), x.dist, x.xp)
