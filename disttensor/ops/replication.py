"""Arrays built from copies of others: ``tile``, ``repeat``, ``meshgrid``; and ``tensordot``.

They are compositions of the distributed primitives, so they work on every
distribution and their communication is that of the primitives:

* ``tile`` concatenates copies along each axis
  (:func:`~disttensor.ops.shape.concatenate`);
* ``repeat`` gathers rows by index (:func:`~disttensor.ops.searching.take`),
  its repeat counts being known on every rank (a DistArray of counts is
  gathered, one integer per element);
* ``meshgrid`` reshapes each 1-D input and broadcasts it
  (:func:`~disttensor.ops.shape.broadcast_to`);
* ``tensordot`` moves the contracted axes last (of ``x1``) and first (of
  ``x2``), reshapes both to matrices and multiplies them with the
  distributed matrix product (:func:`~disttensor.ops.linalg.matmul`, SUMMA).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import disttensor.ops.linalg as linalg
import disttensor.ops.shape as _shape

from ..array import DistArray
from ..settings import collective
from ._util import axis_index, is_dist
from .searching import take

__all__ = ["tile", "repeat", "meshgrid", "tensordot"]


def _dist(x: Any, name: str) -> DistArray:
    if not is_dist(x):
        raise TypeError(f"{name}: expected a DistArray, got {type(x).__name__}")
    return x


@collective
def tile(x: DistArray, repetitions: Any, /) -> DistArray:
    """``x`` repeated ``repetitions[i]`` times along dimension ``i``, like :func:`numpy.tile`."""
    x = _dist(x, "tile")
    reps = (repetitions,) if isinstance(repetitions, (int, np.integer)) else tuple(repetitions)
    if any(isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)) or r < 0
           for r in reps):
        raise ValueError(f"tile: repetitions must be non-negative ints, got {repetitions!r}")
    if len(reps) > x.ndim:
        x = _shape.reshape(x, (1,) * (len(reps) - x.ndim) + x.shape)
    reps = (1,) * (x.ndim - len(reps)) + reps
    for d, r in enumerate(reps):
        if r != 1:
            x = _shape.concatenate([x] * r, axis=d) if r else take(
                x, np.zeros(0, np.intp), axis=d)
    return x.copy() if all(r == 1 for r in reps) else x


@collective
def repeat(x: DistArray, repeats: Any, /, *, axis: int | None = None) -> DistArray:
    """Each element (along ``axis``; of the flattened array without) ``repeats`` times."""
    x = _dist(x, "repeat")
    if axis is None:
        x = _shape.reshape(x, (-1,))
        axis = 0
    axis = axis_index(axis, x.ndim)
    r = np.asarray(repeats.to_global() if is_dist(repeats) else repeats)
    if r.dtype.kind not in "iu" or r.ndim > 1:
        raise TypeError("repeat: repeats must be an int or a 1-D array of ints")
    idx = np.repeat(np.arange(x.shape[axis], dtype=np.intp), r)  # NumPy's errors
    return take(x, idx, axis=axis)


@collective
def meshgrid(*arrays: DistArray, indexing: str = "xy") -> list[DistArray]:
    """Coordinate grids from 1-D arrays, like :func:`numpy.meshgrid` (copies, not views)."""
    if indexing not in ("xy", "ij"):
        raise ValueError(f"indexing must be 'xy' or 'ij', got {indexing!r}")
    for a in arrays:
        if not is_dist(a) or a.ndim != 1:
            raise ValueError("meshgrid: every input must be a 1-D DistArray")
    shape = [a.shape[0] for a in arrays]
    if indexing == "xy" and len(arrays) > 1:
        shape[0], shape[1] = shape[1], shape[0]
    out = []
    for i, a in enumerate(arrays):
        d = (1 - i if i < 2 else i) if indexing == "xy" and len(arrays) > 1 else i
        s = [1] * len(arrays)
        s[d] = a.shape[0]
        out.append(_shape.broadcast_to(_shape.reshape(a, tuple(s)), tuple(shape)))
    return out


@collective
def tensordot(x1: DistArray, x2: DistArray, /, *, axes: Any = 2) -> DistArray:
    """Sum of products over ``axes``, like :func:`numpy.tensordot` (a distributed matmul)."""
    x1, x2 = _dist(x1, "tensordot"), _dist(x2, "tensordot")
    if isinstance(axes, (int, np.integer)):
        if axes < 0 or axes > min(x1.ndim, x2.ndim):
            raise ValueError(f"tensordot: axes={axes} is out of range")
        a1 = list(range(x1.ndim - axes, x1.ndim))
        a2 = list(range(axes))
    else:
        a1, a2 = ([axis_index(a, x.ndim) for a in (ax if isinstance(ax, (list, tuple))
                                                  else [ax])]
                  for ax, x in zip(axes, (x1, x2)))
        if len(a1) != len(a2):
            raise ValueError("tensordot: the two sequences of axes differ in length")
    if any(x1.shape[i] != x2.shape[j] for i, j in zip(a1, a2)):
        raise ValueError("shape-mismatch for sum")
    free1 = [d for d in range(x1.ndim) if d not in a1]
    free2 = [d for d in range(x2.ndim) if d not in a2]
    k = math.prod(x1.shape[d] for d in a1)
    m = math.prod(x1.shape[d] for d in free1)
    n = math.prod(x2.shape[d] for d in free2)
    left = _shape.reshape(_shape.transpose(x1, free1 + a1), (m, k))
    right = _shape.reshape(_shape.transpose(x2, a2 + free2), (k, n))
    prod = linalg.matmul(left, right)
    return _shape.reshape(prod, tuple(x1.shape[d] for d in free1)
                          + tuple(x2.shape[d] for d in free2))
