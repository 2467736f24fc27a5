"""Arrays built from copies of others: ``tile``, ``repeat``, ``meshgrid``.

They are compositions of the distributed primitives, so they work on every
distribution and their communication is that of the primitives:

* ``tile`` concatenates copies along each axis
  (:func:`~disttensor.ops.shape.concatenate`);
* ``repeat`` gathers rows by index (:func:`~disttensor.ops.searching.take`),
  its repeat counts being known on every rank (a DistArray of counts is
  gathered, one integer per element);
* ``meshgrid`` reshapes each 1-D input and broadcasts it
  (:func:`~disttensor.ops.shape.broadcast_to`);
"""

from __future__ import annotations

from typing import Any

import numpy as np

import disttensor.ops.shape as _shape

from ..array import DistArray
from ..settings import collective
from ._util import axis_index, is_dist
from .searching import take

__all__ = ["tile", "repeat", "meshgrid"]


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
