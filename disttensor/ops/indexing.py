"""Indexing: ``x[key]`` and ``x[key] = value`` with basic NumPy keys, and boolean masks.

Reading (``__getitem__``) returns a new DistArray on the same grid, never a
view. Its distribution is the image of ``x``'s blocks under the key:

* a slice keeps the dimension's grid axes; the new block boundaries are
  chosen so that every rank keeps exactly the selected elements it already
  holds (no communication);
* a slice with a negative step on a split dimension reverses the order of
  the blocks: ranks whose blocks mirror each other (block ``i`` and
  ``p - 1 - i``) swap their pieces in one ``Sendrecv``;
* an integer drops its dimension, whose grid axes become replica axes: the
  ranks that hold the index broadcast it along those grid axes (one
  ``Bcast`` for all integer indices together);
* ``np.newaxis`` inserts a dimension of size 1 that is not split; ``...``
  stands for as many full slices as needed.

Writing (``__setitem__``) takes a scalar, a NumPy array (the same on every
rank; each rank uses its part) or a DistArray, which is redistributed to the
layout of the target region (an implicit move, see
:mod:`disttensor.ops.align`).

A boolean DistArray (or NumPy array) of ``x``'s shape is a mask: ``x[mask]``
is the 1-D array of the selected elements in row-major order (``x`` and the
mask move to row slabs first, then one ``allgather`` of the counts), and
``x[mask] = scalar`` writes in place. A 0-d boolean mask (``True``, a 0-d
array) adds a dimension of length 1 (true) or 0 (false), as in NumPy.

Keys with integer arrays, and ``x[mask] = array``, are
:mod:`disttensor.ops.advanced`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..array import DistArray
from ..backend import is_numpy, mpi_dtype, to_numpy
from ..distribution import Distribution
from ..grid import rank_of
from ..settings import collective
from ._util import (
    bcast_array,
    block_coords,
    is_dist,
    make_dist,
    split_grid_axes,
    subcomm_index,
    wrap,
)
from .align import (
    aligned,
    as_operand,
    broadcast_shape,
    check_move,
    numpy_part,
    operand_distribution,
)

__all__ = ["getitem", "setitem", "parse_key", "integer_array_key", "check_value", "mask_key",
           "nonzero"]

_INDEX_ERROR = (
    "only integers, slices (`:`), ellipsis (`...`), numpy.newaxis (`None`) and a boolean "
    "mask of the array's shape are valid indices of a DistArray"
)


@dataclass(frozen=True)
class _Int:
    dim: int
    index: int


@dataclass(frozen=True)
class _Slice:
    dim: int
    start: int
    step: int
    length: int

    @property
    def ascending(self) -> tuple[int, int]:
        """(start, step) that select the same elements in increasing order."""
        if self.length == 0:
            return 0, 1
        if self.step > 0:
            return self.start, self.step
        return self.start + (self.length - 1) * self.step, -self.step


class _New:
    pass


_NEW = _New()
Entry = _Int | _Slice | _New


def _list_index(k: list) -> np.ndarray:
    a = np.asarray(k)
    return a.astype(np.intp) if a.size == 0 else a  # x[[]] selects nothing, as in NumPy


def _is_index_array(k: Any) -> bool:
    if isinstance(k, list):
        k = _list_index(k)
    return ((is_dist(k) or isinstance(k, np.ndarray)) and k.ndim == 1
            and k.dtype.kind in "iu")


def integer_array_key(key: Any, ndim: int) -> tuple[int, Any] | None:
    """``(axis, indices)`` when ``key`` is one 1-D integer array (DistArray, NumPy array or
    list) along one axis, every other entry a full slice ``:`` or ``...``; else None."""
    items = key if isinstance(key, tuple) else (key,)
    arrays = [i for i, k in enumerate(items) if _is_index_array(k)]
    if len(arrays) != 1:
        return None
    at = arrays[0]
    before, after = items[:at], items[at + 1:]
    for k in before + after:
        if not (k is Ellipsis or (isinstance(k, slice) and k == slice(None))):
            return None
    ell_before = any(k is Ellipsis for k in before)
    ell_after = any(k is Ellipsis for k in after)
    if ell_before and ell_after:
        return None
    axis = ndim - len(after) - 1 if ell_before else at
    if not 0 <= axis < ndim or len(items) - (ell_before or ell_after) > ndim:
        return None
    k = items[at]
    return axis, (_list_index(k) if isinstance(k, list) else k)


def _as_int(k: Any) -> int | None:
    if isinstance(k, (bool, np.bool_)):
        return None
    if isinstance(k, np.ndarray) and k.ndim == 0 and k.dtype.kind in "iu":
        return int(k)
    try:
        return operator.index(k)
    except TypeError:
        return None


def parse_key(key: Any, shape: Sequence[int]) -> list[Entry]:
    """Normalise a basic index against ``shape`` (NumPy's IndexErrors, on every rank alike)."""
    if not isinstance(key, tuple):
        key = (key,)
    items: list[Any] = []
    consumed = 0
    ellipses = 0
    for k in key:
        if k is Ellipsis:
            ellipses += 1
            items.append(k)
        elif k is None or isinstance(k, slice):
            consumed += k is not None
            items.append(k)
        else:
            i = _as_int(k)
            if i is None:
                raise IndexError(_INDEX_ERROR)
            consumed += 1
            items.append(i)
    ndim = len(shape)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if consumed > ndim:
        raise IndexError(
            f"too many indices for array: array is {ndim}-dimensional, but {consumed} were "
            "indexed"
        )
    if ellipses:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (ndim - consumed)
    else:
        items += [slice(None)] * (ndim - consumed)
    out: list[Entry] = []
    d = 0
    for k in items:
        if k is None:
            out.append(_NEW)
        elif isinstance(k, slice):
            start, stop, step = k.indices(shape[d])
            out.append(_Slice(d, start, step, len(range(start, stop, step))))
            d += 1
        else:
            n = shape[d]
            if not -n <= k < n:
                raise IndexError(f"index {k} is out of bounds for axis {d} with size {n}")
            out.append(_Int(d, k + n if k < 0 else k))
            d += 1
    return out


def _image(bounds: Sequence[int], s: _Slice) -> tuple[int, ...]:
    """Block boundaries, in the result, of the elements that ``s`` (ascending) selects."""
    start, step = s.ascending
    return tuple(min(s.length, max(0, -((start - v) // step))) for v in bounds)


def _local_slice(b0: int, j0: int, j1: int, s: _Slice) -> slice:
    """Slice of a block starting at global ``b0`` that holds result elements ``[j0, j1)``."""
    if j1 <= j0:
        return slice(0, 0)
    start, step = s.ascending
    return slice(start + j0 * step - b0, start + (j1 - 1) * step - b0 + 1, step)


@dataclass
class _Plan:
    """Everything about a key that every rank can compute from metadata."""

    entries: list[Entry]
    local_key: tuple[slice, ...]      # into this rank's block (ints as length-1 slices)
    owner: bool                       # this rank holds every integer index
    asc: Distribution                 # result, negative steps read ascending
    result: Distribution              # result distribution
    stage_shape: tuple[int, ...]      # this rank's piece, input-dim order, ints as 1


def _plan(x: DistArray, key: Any) -> _Plan:
    dist = x.dist
    entries = parse_key(key, x.shape)
    bidx = dist.block_index()
    start = dist.local_start()
    local_key: list[slice] = [slice(None)] * x.ndim
    stage: list[int] = [1] * x.ndim
    owner = True
    shape, axes, asc_b, res_b = [], [], [], []
    for e in entries:
        if isinstance(e, _New):
            shape.append(1)
            axes.append(())
            asc_b.append(None)
            res_b.append(None)
        elif isinstance(e, _Int):
            b0 = start[e.dim]
            if b0 <= e.index < b0 + x.local_shape[e.dim]:
                local_key[e.dim] = slice(e.index - b0, e.index - b0 + 1)
            else:
                local_key[e.dim] = slice(0, 0)
                owner = False
        else:
            img = _image(dist.boundaries[e.dim], e)
            i = bidx[e.dim]
            local_key[e.dim] = _local_slice(start[e.dim], img[i], img[i + 1], e)
            stage[e.dim] = img[i + 1] - img[i]
            shape.append(e.length)
            axes.append(dist.dim_axes[e.dim])
            asc_b.append(img)
            res_b.append(img if e.step > 0 else tuple(e.length - v for v in reversed(img)))
    asc = make_dist(shape, dist.grid, axes, asc_b)
    result = make_dist(shape, dist.grid, axes, res_b)
    return _Plan(entries, tuple(local_key), owner, asc, result, tuple(stage))


def _flip_key(entries: list[Entry], ndim: int) -> tuple[slice, ...]:
    key = [slice(None)] * ndim
    for e in entries:
        if isinstance(e, _Slice) and e.step < 0:
            key[e.dim] = slice(None, None, -1)
    return tuple(key)


def _swap_blocks(piece: Any, x: DistArray, p: _Plan) -> Any:
    """Give each rank the piece of the mirrored block along negatively stepped split dims."""
    dist = x.dist
    dims = [e.dim for e in p.entries if isinstance(e, _Slice) and e.step < 0
            and dist.nblocks[e.dim] > 1]
    if not dims:
        return piece
    grid = dist.grid
    comm = grid.p2p_comm  # collective on first use: every rank takes it, partner or not
    coords = list(grid.coords)
    bidx = dist.block_index()
    for d in dims:
        coords = block_coords(dist, d, dist.nblocks[d] - 1 - bidx[d], coords)
    partner = rank_of(coords, grid.shape)
    want = []
    res_local = p.result.local_shape()
    j = 0
    for e in p.entries:
        if isinstance(e, _Slice):
            want.append((e.dim, res_local[j]))
        if not isinstance(e, _Int):
            j += 1
    shape = list(p.stage_shape)
    for d, n in want:
        shape[d] = n
    if partner == grid.rank:
        return piece
    xp = x.xp
    send = np.ascontiguousarray(to_numpy(piece))
    recv = np.empty(shape, dtype=send.dtype)
    t = mpi_dtype(send.dtype)
    comm.Sendrecv([send, t], dest=partner, sendtag=71, recvbuf=[recv, t],
                           source=partner, recvtag=71)
    return recv if is_numpy(xp) else xp.asarray(recv)


def _scalar_mask(key: Any) -> bool | None:
    """The value of a 0-d boolean key (Python, NumPy or DistArray), else None."""
    k = key[0] if isinstance(key, tuple) and len(key) == 1 else key
    if isinstance(k, (bool, np.bool_)):
        return bool(k)
    if (is_dist(k) or isinstance(k, np.ndarray)) and k.ndim == 0 and k.dtype == np.bool_:
        return bool(k.local[()] if is_dist(k) else k[()])  # a 0-d DistArray: on every rank
    return None


@collective
def getitem(x: DistArray, key: Any) -> DistArray:
    """``x[key]`` for basic keys and boolean masks (see the module docstring)."""
    flag = _scalar_mask(key)
    if flag is not None:  # a 0-d mask: a new axis of length 1 (True) or 0 (False)
        y = getitem(x, None)
        return y if flag else getitem(y, slice(0, 0))
    mask = mask_key(x, key)
    if mask is not None:
        return _mask_getitem(x, mask)
    p = _plan(x, key)
    dist, xp, grid = x.dist, x.xp, x.grid
    ints = [e for e in p.entries if isinstance(e, _Int)]
    bcast_axes = split_grid_axes(dist, [e.dim for e in ints])
    piece = x.local[p.local_key] if p.owner else None
    fresh = False  # whether piece is a new buffer rather than a view of x
    if bcast_axes:
        coords = list(grid.coords)
        for e in ints:
            coords = block_coords(dist, e.dim, dist.block_of(e.dim, e.index), coords)
        root = subcomm_index(grid, bcast_axes, coords)
        comm = grid.subcomm(bcast_axes)
        if piece is None or comm.Get_rank() != root:
            piece = xp.empty(p.stage_shape, dtype=x.dtype)
        else:
            piece = piece.copy()  # C-contiguous, and no longer a view of x
        piece = bcast_array(piece, comm, root, xp)
        fresh = True
    flip = _flip_key(p.entries, x.ndim)
    piece = piece[flip]
    swapped = _swap_blocks(piece, x, p)
    fresh = fresh or swapped is not piece
    piece = xp.reshape(swapped, p.result.local_shape())
    return wrap(piece if fresh else piece.copy(), p.result, xp)


# ------------------------------------------------------------------ setitem


def _strip_leading_ones(shape: tuple[int, ...], ndim: int) -> int:
    """How many leading size-1 dims NumPy drops so that a value fits ``ndim`` dims."""
    k = 0
    while len(shape) - k > ndim and shape[k] == 1:
        k += 1
    return k


def check_value(x: DistArray, value: Any, target: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """``value``'s shape and how many leading 1s NumPy drops to assign it to ``target``.

    Raises NumPy's ValueError when it does not broadcast and NumPy's cast
    errors (an out-of-range Python integer, say), on every rank alike.
    """
    vshape = tuple(value.shape) if hasattr(value, "shape") else ()
    k = _strip_leading_ones(vshape, len(target))
    try:
        fits = broadcast_shape(vshape[k:], target) == target
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"could not broadcast input array from shape {vshape} into shape {target}"
        )
    dry = np.empty((), dtype=x.dtype)
    if is_dist(value) or hasattr(value, "dtype"):
        np.asarray(dry)[()] = np.zeros((), dtype=value.dtype)
    else:
        dry[()] = value
    return vshape, k


@collective
def setitem(x: DistArray, key: Any, value: Any) -> None:
    """``x[key] = value`` (see the module docstring)."""
    flag = _scalar_mask(key)
    if flag is not None:  # a 0-d mask: the whole array, or nothing
        return setitem(x, Ellipsis, value) if flag else None
    mask = mask_key(x, key)
    if mask is not None:
        return _mask_setitem(x, mask, value)
    p = _plan(x, key)
    xp = x.xp
    value = as_operand(value)
    target = p.result.global_shape
    vshape, k = check_value(x, value, target)
    # the value's dims that meet negatively stepped dims are reversed first
    vdims = len(vshape) - k
    off = len(target) - vdims
    slices = [e for e in p.entries if not isinstance(e, _Int)]
    flip = [slice(None)] * len(vshape)
    for t, e in enumerate(slices):
        v = t - off
        if v >= 0 and isinstance(e, _Slice) and e.step < 0 and vshape[k + v] > 1:
            flip[k + v] = slice(None, None, -1)
    lead = tuple(0 for _ in range(k))
    if is_dist(value):
        need = operand_distribution(p.asc, vshape[k:])
        if k or any(f.step for f in flip):
            fkey = lead + tuple(flip[k:])
            strip = getitem(value, fkey)
            move = check_move(strip, need, "the assigned value")
            part = aligned(strip, need, move)
        else:
            move = check_move(value, need, "the assigned value")
            part = aligned(value, need, move)
    elif hasattr(value, "shape"):
        v = xp.asarray(value)[lead + tuple(flip[k:])]
        part = numpy_part(v, p.asc, xp)
    else:
        part = value
    if not p.owner:
        return None
    region = x.local[p.local_key]
    if region.size == 0:
        return None
    if hasattr(part, "shape"):
        part = xp.reshape(xp.broadcast_to(part, p.asc.local_shape()), region.shape)
    x.local[p.local_key] = part
    return None


# ------------------------------------------------------------------ boolean masks


def mask_key(x: DistArray, key: Any) -> Any:
    """The boolean mask of ``x``'s shape that ``key`` is, else None (0-d masks: None).

    Raises IndexError for an array key that is not such a mask (a list, a
    non-boolean array, a mask of another shape), on every rank alike.
    """
    k = key[0] if isinstance(key, tuple) and len(key) == 1 else key
    if is_dist(k) and k.ndim == 0 and k.dtype.kind in "iub":
        return None  # a 0-d integer DistArray is an integer index, a 0-d boolean one a flag
    if is_dist(k) or (isinstance(k, np.ndarray) and k.ndim > 0):
        if k.dtype != np.bool_ or tuple(k.shape) != x.shape:
            raise IndexError(_INDEX_ERROR)
        if x.ndim == 0:
            raise IndexError("boolean masks of 0-d DistArrays are not supported")
        return k
    if isinstance(k, list):
        raise IndexError(_INDEX_ERROR)
    return None


def _mask_local(x: DistArray, mask: Any, dist: Distribution) -> Any:
    if is_dist(mask):
        need = operand_distribution(dist, mask.shape)
        return aligned(mask, need, check_move(mask, need, "the mask"))
    return numpy_part(mask, dist, x.xp)


def _mask_getitem(x: DistArray, mask: Any) -> DistArray:
    grid = x.grid
    every = tuple(range(grid.ndim))
    rows = Distribution(x.shape, grid, (every,) + (None,) * (x.ndim - 1))
    if is_dist(mask):
        need = operand_distribution(x.dist, mask.shape)
        check_move(mask, need, "the mask")  # the mask must line up with x like any operand
        m = mask if mask.dist == rows else mask.redistribute(rows)
        mlocal = m.local
    else:
        mlocal = numpy_part(mask, rows, x.xp)
    xr = x if x.dist == rows else x.redistribute(rows)
    sel = xr.local[mlocal]
    counts = grid.comm.allgather(int(sel.shape[0]))
    cuts = np.cumsum(counts)[:-1].tolist()
    dist = Distribution((int(sum(counts)),), grid, (every,), [cuts])
    return wrap(sel, dist, x.xp)


def _mask_setitem(x: DistArray, mask: Any, value: Any) -> None:
    value = as_operand(value)
    if is_dist(value):
        if value.ndim:
            raise ValueError("only a scalar or a 0-d array can be assigned through a mask")
        value = value.local[()]
    elif hasattr(value, "shape") and np.ndim(value):
        raise ValueError("only a scalar or a 0-d array can be assigned through a mask")
    np.empty((), dtype=x.dtype)[()] = value  # NumPy's cast errors, on every rank
    m = _mask_local(x, mask, x.dist)
    x.local[m] = value


# ------------------------------------------------------------------ nonzero


def nonzero(x: DistArray) -> tuple[DistArray, ...]:
    """Indices of the non-zero elements, one 1-D array per dimension, like
    :func:`numpy.nonzero` (a boolean-mask selection of each index array)."""
    if not is_dist(x):
        raise TypeError(f"nonzero: expected a DistArray, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError("Calling nonzero on 0d arrays is not allowed. Use np.atleast_1d("
                         "scalar).nonzero() instead.")
    xp = x.xp
    mask = wrap(xp.asarray(x.local != 0), x.dist, xp)
    sl = x.dist.local_slices()
    out = []
    for d in range(x.ndim):
        shape = [1] * x.ndim
        shape[d] = sl[d].stop - sl[d].start
        idx = xp.broadcast_to(xp.arange(sl[d].start, sl[d].stop, dtype=np.intp).reshape(shape),
                              x.local_shape)
        out.append(_mask_getitem(wrap(idx, x.dist, xp), mask))
    return tuple(out)


def flatnonzero(x: DistArray) -> DistArray:
    """Indices of the non-zero elements of the flattened array, like :func:`numpy.flatnonzero`."""
    if not is_dist(x):
        raise TypeError(f"flatnonzero: expected a DistArray, got {type(x).__name__}")
    return nonzero(x.ravel())[0]  # the method: this module sits below ops.shape


def argwhere(x: DistArray) -> DistArray:
    """Indices of the non-zero elements, one row each, like :func:`numpy.argwhere`."""
    if not is_dist(x) or x.ndim == 0:
        raise TypeError("argwhere needs a DistArray of at least one dimension")
    return np.stack(nonzero(x), axis=1)  # dispatches to ops.shape.stack, which sits above
