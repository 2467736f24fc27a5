"""Shape functions: transpose and friends, reshape, expand/squeeze, concatenate, stack, broadcast.

* ``transpose``/``moveaxis``/``swapaxes`` only permute metadata (each
  dimension keeps its grid axes and boundaries) and the local block: no
  communication, ever.
* ``reshape`` works group by group of dimensions whose sizes multiply to the
  same number (a merge, a split, or both). A group needs no communication
  when only its first dimension is split and the block boundaries fall on
  whole rows of the new shape; otherwise the array is first redistributed (one
  Alltoallw for all groups) so that the group's first dimension is split over
  all the group's grid axes with aligned boundaries.
* ``concatenate`` keeps the first DistArray operand's grid axes; along the
  joined axis the result gets the default block rule when that axis is split,
  and every operand is redistributed so that each rank receives the parts of
  its result block (no message when the axis is not split and the operands
  are laid out alike). ``stack`` is ``expand_dims`` then ``concatenate``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..array import DistArray
from ..distribution import Distribution, block_boundaries
from ..settings import collective
from ._util import axis_index, is_dist, make_dist, normalize_axes, wrap
from .align import (
    aligned,
    as_operand,
    broadcast_shape,
    check_move,
    extend_distribution,
    operand_distribution,
    result_distribution,
)
from .indexing import getitem, setitem

__all__ = [
    "transpose",
    "permute_dims",
    "moveaxis",
    "swapaxes",
    "matrix_transpose",
    "expand_dims",
    "squeeze",
    "reshape",
    "ravel",
    "concatenate",
    "stack",
    "broadcast_to",
    "broadcast_arrays",
    "flip",
]


def _dist(x: Any, name: str) -> DistArray:
    if not is_dist(x):
        raise TypeError(f"{name}: expected a DistArray, got {type(x).__name__}")
    return x


# ------------------------------------------------------------------ axis permutations


@collective
def transpose(x: DistArray, axes: Sequence[int] | None = None) -> DistArray:
    """Permute the dimensions, like :func:`numpy.transpose` (metadata only, no messages).

    Dimension ``i`` of the result is dimension ``axes[i]`` of ``x``, with its
    grid axes and block boundaries.
    """
    x = _dist(x, "transpose")
    if axes is None:
        perm = tuple(reversed(range(x.ndim)))
    else:
        perm = tuple(axis_index(a, x.ndim) for a in axes)
        if sorted(perm) != list(range(x.ndim)):
            raise ValueError("axes don't match array")
    d = x.dist
    dist = make_dist([d.global_shape[a] for a in perm], d.grid, [d.dim_axes[a] for a in perm],
                     [d.boundaries[a] for a in perm])
    return wrap(x.xp.transpose(x.local, perm).copy(), dist, x.xp)


@collective
def permute_dims(x: DistArray, axes: Sequence[int] | None = None) -> DistArray:
    """Array API name of :func:`transpose`."""
    return transpose(x, axes)


@collective
def moveaxis(x: DistArray, source: Any, destination: Any) -> DistArray:
    """Move dimensions to new positions, like :func:`numpy.moveaxis` (metadata only)."""
    x = _dist(x, "moveaxis")
    src = [axis_index(a, x.ndim) for a in np.atleast_1d(source).tolist()]
    dst = [axis_index(a, x.ndim) for a in np.atleast_1d(destination).tolist()]
    if len(src) != len(dst):
        raise ValueError("`source` and `destination` arguments must have the same number of "
                         "elements")
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise ValueError("repeated axis in `source` or `destination` argument")
    order = [n for n in range(x.ndim) if n not in src]
    for dest, s in sorted(zip(dst, src)):
        order.insert(dest, s)
    return transpose(x, order)


@collective
def swapaxes(x: DistArray, axis1: int, axis2: int) -> DistArray:
    """Swap two dimensions, like :func:`numpy.swapaxes` (metadata only)."""
    x = _dist(x, "swapaxes")
    a, b = axis_index(axis1, x.ndim), axis_index(axis2, x.ndim)
    perm = list(range(x.ndim))
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(x, perm)


@collective
def matrix_transpose(x: DistArray) -> DistArray:
    """Swap the last two dimensions (``x.mT``)."""
    x = _dist(x, "matrix_transpose")
    if x.ndim < 2:
        raise ValueError("matrix_transpose needs at least 2 dimensions")
    return swapaxes(x, -1, -2)


# ------------------------------------------------------------------ size-1 dimensions


@collective
def expand_dims(x: DistArray, axis: Any) -> DistArray:
    """Insert dimensions of size 1 (not split), like :func:`numpy.expand_dims`; no messages."""
    x = _dist(x, "expand_dims")
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    nd = x.ndim + len(axes)
    new = set(normalize_axes(axes, nd))
    if len(new) != len(axes):
        raise ValueError("repeated axis")
    d = x.dist
    shape, dim_axes, bounds = [], [], []
    src = iter(range(x.ndim))
    for i in range(nd):
        if i in new:
            shape.append(1)
            dim_axes.append(())
            bounds.append(None)
        else:
            j = next(src)
            shape.append(d.global_shape[j])
            dim_axes.append(d.dim_axes[j])
            bounds.append(d.boundaries[j])
    dist = make_dist(shape, d.grid, dim_axes, bounds)
    return wrap(x.xp.reshape(x.local, dist.local_shape()).copy(), dist, x.xp)


@collective
def squeeze(x: DistArray, axis: Any = None) -> DistArray:
    """Drop dimensions of size 1, like :func:`numpy.squeeze`.

    A dropped dimension that is split (its one element lives on some ranks
    only) is read like ``x[..., 0, ...]``: its owners broadcast it.
    """
    x = _dist(x, "squeeze")
    if axis is None:
        dims = [d for d, n in enumerate(x.shape) if n == 1]
    else:
        dims = list(normalize_axes(axis, x.ndim))
        for d in dims:
            if x.shape[d] != 1:
                raise ValueError("cannot select an axis to squeeze out which has size not "
                                 "equal to one")
    return getitem(x, tuple(0 if d in dims else slice(None) for d in range(x.ndim)))


# ------------------------------------------------------------------ reshape


def _resolve_shape(newshape: Any, size: int) -> tuple[int, ...]:
    if isinstance(newshape, (int, np.integer)):
        newshape = (newshape,)
    try:
        # operator.index, not int: 4.0 or 24.9 must not pass for a dimension (as NumPy)
        newshape = [operator.index(s) for s in newshape]
    except TypeError:
        raise TypeError(
            f"reshape: shape must be an int or a sequence of ints, got {newshape!r}"
        ) from None
    unknown = [i for i, s in enumerate(newshape) if s == -1]
    if len(unknown) > 1:
        raise ValueError("can only specify one unknown dimension")
    if any(s < -1 for s in newshape):
        raise ValueError("negative dimensions not allowed")
    if unknown:
        rest = math.prod(s for s in newshape if s != -1)
        if rest == 0 or size % rest:
            raise ValueError(f"cannot reshape array of size {size} into shape "
                             f"{tuple(newshape)}")
        newshape[unknown[0]] = size // rest
    if math.prod(newshape) != size:
        raise ValueError(f"cannot reshape array of size {size} into shape {tuple(newshape)}")
    return tuple(newshape)


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Runs ``(i0, i1, j0, j1)`` with ``prod(a[i0:i1]) == prod(b[j0:j1])`` (no zero sizes)."""
    i = j = 0
    out = []
    while i < len(a) or j < len(b):
        i0, j0 = i, j
        pa = pb = 1
        if i < len(a):
            pa, i = a[i], i + 1
        if j < len(b):
            pb, j = b[j], j + 1
        while pa != pb:
            if pa < pb:
                pa, i = pa * a[i], i + 1
            else:
                pb, j = pb * b[j], j + 1
        while i < len(a) and a[i] == 1:
            i += 1
        while j < len(b) and b[j] == 1:
            j += 1
        out.append((i0, i, j0, j))
    return out


def _lead(shape: Sequence[int], lo: int, hi: int) -> int:
    """The first dimension of ``shape[lo:hi]`` bigger than 1 (``lo`` if there is none)."""
    for d in range(lo, hi):
        if shape[d] > 1:
            return d
    return lo


@collective
def reshape(x: DistArray, newshape: Any, order: str = "C", *, copy: Any = None,
            shape: Any = None) -> DistArray:
    """Give a new shape, like :func:`numpy.reshape` (C order only).

    See the module docstring for when data moves. The result's first
    dimension of each group keeps the group's grid axes; the others are not
    split.
    """
    x = _dist(x, "reshape")
    if shape is not None:
        newshape = shape
    if order != "C":
        raise ValueError("reshape of a DistArray supports order='C' only")
    if copy is False:
        raise ValueError("reshape of a DistArray always copies (copy=False is not possible)")
    new = _resolve_shape(newshape, x.size)
    d, xp = x.dist, x.xp
    if x.size == 0 or not new or x.ndim == 0:
        if x.size == 0:
            dist = Distribution(new, d.grid, (None,) * len(new))
            return wrap(xp.empty(dist.local_shape(), x.dtype), dist, xp)
        if not new:  # one element, maybe on some ranks only: read it like x[0, 0, ...]
            return getitem(x, (0,) * x.ndim)
        dist = Distribution(new, d.grid, (None,) * len(new))  # from 0-d: replicated
        return wrap(xp.reshape(x.local, dist.local_shape()).copy(), dist, xp)

    groups = _groups(x.shape, new)
    pre_axes: list[tuple[int, ...]] = list(d.dim_axes)
    pre_bounds: list[Any] = list(d.boundaries)
    out_axes: list[tuple[int, ...]] = [()] * len(new)
    out_bounds: list[Any] = [None] * len(new)
    moved = False
    for i0, i1, j0, j1 in groups:
        lead_in = _lead(x.shape, i0, i1)
        lead_out = _lead(new, j0, j1)
        inner = math.prod(x.shape[lead_in + 1 : i1])
        r = math.prod(new[lead_out + 1 : j1])
        others = [k for k in range(i0, i1) if k != lead_in]
        b = d.boundaries[lead_in]
        ok = all(d.nblocks[k] == 1 for k in others) and all(v * inner % r == 0 for v in b)
        if ok:
            axes = d.dim_axes[lead_in]
        else:
            moved = True
            axes = tuple(a for k in [lead_in, *others] for a in d.dim_axes[k])
            m = r // math.gcd(r, inner)
            nb = math.prod(d.grid_shape[a] for a in axes)
            b = tuple(m * v for v in block_boundaries(x.shape[lead_in] // m, nb))
            for k in others:
                pre_axes[k], pre_bounds[k] = (), None
            pre_axes[lead_in], pre_bounds[lead_in] = axes, b
        out_axes[lead_out] = axes
        out_bounds[lead_out] = tuple(v * inner // r for v in b)
    if moved:
        pre = make_dist(x.shape, d.grid, pre_axes, pre_bounds)
        check_move(x, pre, "the array to reshape")
        local = x.redistribute(pre).local
    else:
        local = x.local
    dist = make_dist(new, d.grid, out_axes, out_bounds)
    out = xp.reshape(local, dist.local_shape())
    return wrap(out if moved else out.copy(), dist, xp)


@collective
def ravel(x: DistArray, order: str = "C") -> DistArray:
    """The flattened array, like :func:`numpy.ravel` (a copy; see :func:`reshape`)."""
    return reshape(x, (-1,), order)


# ------------------------------------------------------------------ joining


def _dtype_of(v: Any) -> np.dtype:
    return v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype


@collective
def concatenate(arrays: Sequence[Any], axis: int | None = 0, out: Any = None, *,
                dtype: Any = None, casting: str = "same_kind") -> DistArray:
    """Join arrays along an existing axis, like :func:`numpy.concatenate`.

    Operands may mix DistArrays and NumPy arrays (the same on every rank);
    see the module docstring for the result's distribution.
    """
    arrays = [as_operand(a) for a in arrays]
    if not arrays:
        raise ValueError("need at least one array to concatenate")
    if not any(is_dist(a) for a in arrays):
        raise TypeError("concatenate: no DistArray operand")
    if axis is None:
        arrays = [ravel(a) if is_dist(a) else np.ravel(a) for a in arrays]
        axis = 0
    nd = np.ndim(arrays[0]) if not is_dist(arrays[0]) else arrays[0].ndim
    for i, a in enumerate(arrays):
        if (a.ndim if is_dist(a) else np.ndim(a)) == 0:
            raise ValueError(f"zero-dimensional arrays cannot be concatenated (operand {i})")
        if (a.ndim if is_dist(a) else np.ndim(a)) != nd:
            raise ValueError(
                "all the input array dimensions except for the concatenation axis must match "
                f"exactly, but the array at index 0 has {nd} dimension(s) and the array at "
                f"index {i} has {a.ndim} dimension(s)"
            )
    ax = axis_index(axis, nd)
    shapes = [tuple(a.shape) for a in arrays]
    for i, s in enumerate(shapes[1:], 1):
        for k in range(nd):
            if k != ax and s[k] != shapes[0][k]:
                raise ValueError(
                    "all the input array dimensions except for the concatenation axis must "
                    f"match exactly, but along dimension {k}, the array at index 0 has size "
                    f"{shapes[0][k]} and the array at index {i} has size {s[k]}"
                )
    res_dtype = np.concatenate([np.empty((0,), _dtype_of(a)) for a in arrays], dtype=dtype,
                               casting=casting).dtype
    total = sum(s[ax] for s in shapes)
    shape = tuple(total if k == ax else shapes[0][k] for k in range(nd))
    lead = next(a for a in arrays if is_dist(a))
    base = lead.dist
    bounds = [base.boundaries[k] if k != ax else
              (block_boundaries(total, base.nblocks[ax]) if base.nblocks[ax] > 1 else None)
              for k in range(nd)]
    target = make_dist(shape, base.grid, base.dim_axes, bounds)
    if out is not None:
        if not is_dist(out) or out.shape != shape:
            raise ValueError(f"out must be a DistArray of shape {shape}")
        target = out.dist
    tb = target.boundaries[ax]
    needs = []
    offset = 0
    for i, a in enumerate(arrays):
        n = shapes[i][ax]
        cut = [min(n, max(0, v - offset)) for v in tb]
        nb = [target.boundaries[k] if k != ax else cut for k in range(nd)]
        need = make_dist(shapes[i], target.grid, target.dim_axes, nb)
        move = check_move(a, need, f"operand {i}") if is_dist(a) else False
        needs.append((need, move))
        offset += n
    xp = lead.xp
    parts = []
    for a, (need, move) in zip(arrays, needs):
        if is_dist(a):
            parts.append(aligned(a, need, move))
        else:
            parts.append(xp.asarray(a)[need.local_slices()])
    local = xp.concatenate(parts, axis=ax, dtype=res_dtype, casting="unsafe")
    if out is not None:
        out.local[...] = local
        return out
    return wrap(local, target, xp)


@collective
def stack(arrays: Sequence[Any], axis: int = 0, out: Any = None, *, dtype: Any = None,
          casting: str = "same_kind") -> DistArray:
    """Join arrays along a new axis, like :func:`numpy.stack`."""
    arrays = [as_operand(a) for a in arrays]
    if not arrays:
        raise ValueError("need at least one array to stack")
    shapes = {tuple(a.shape) if hasattr(a, "shape") else () for a in arrays}
    if len(shapes) != 1:
        raise ValueError("all input arrays must have the same shape")
    nd = len(next(iter(shapes))) + 1
    ax = axis_index(axis, nd)
    grown = [expand_dims(a, ax) if is_dist(a) else np.expand_dims(a, ax) for a in arrays]
    return concatenate(grown, ax, out, dtype=dtype, casting=casting)


# ------------------------------------------------------------------ broadcasting


@collective
def broadcast_to(x: DistArray, shape: Any) -> DistArray:
    """``x`` repeated to ``shape`` (a new array; the grid axes of ``x`` are kept)."""
    x = _dist(x, "broadcast_to")
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if len(shape) < x.ndim or broadcast_shape(x.shape, shape) != shape:
        raise ValueError(f"operands could not be broadcast together with remapped shapes "
                         f"[original->remapped]: {x.shape} and requested shape {shape}")
    target = extend_distribution(x.dist, shape)
    return _broadcast_into(x, target)


def _broadcast_into(x: Any, target: Distribution) -> DistArray:
    need = operand_distribution(target, x.shape)
    part = aligned(x, need, check_move(x, need, "the array to broadcast"))
    xp = x.xp
    return wrap(xp.broadcast_to(part, target.local_shape()).copy(), target, xp)


@collective
def broadcast_arrays(*args: Any) -> list[DistArray]:
    """All operands broadcast to one shape, laid out by the mixed-distribution rule."""
    ops = [as_operand(a) for a in args]
    shape = broadcast_shape(*(tuple(getattr(o, "shape", ())) for o in ops))
    target = result_distribution(ops, shape)
    out = []
    for o in ops:
        if is_dist(o):
            out.append(_broadcast_into(o, target))
        else:
            xp = np
            a = xp.broadcast_to(np.asarray(o), shape)
            out.append(wrap(a[target.local_slices()].copy(), target, xp))
    return out


@collective
def flip(x: DistArray, axis: Any = None) -> DistArray:
    """Reverse the order of elements along ``axis`` (all by default), like :func:`numpy.flip`.

    Reversing a split dimension makes mirrored blocks swap their data.
    """
    x = _dist(x, "flip")
    dims = normalize_axes(axis, x.ndim)
    return getitem(x, tuple(slice(None, None, -1) if d in dims else slice(None)
                            for d in range(x.ndim)))



# ------------------------------------------------------------------ built from the above


def roll(x: DistArray, shift: Any, axis: Any = None) -> DistArray:
    """Roll elements along ``axis``, like :func:`numpy.roll`; the result keeps ``x``'s layout.

    Each rolled axis costs two slice assignments (one Alltoallw each).
    """
    x = _dist(x, "roll")
    if axis is None:
        return reshape(roll(ravel(x), shift, 0), x.shape)
    shifts, axes = np.broadcast_arrays(np.asarray(shift), np.asarray(axis))
    amount = [0] * x.ndim
    for s, a in zip(shifts.ravel().tolist(), axes.ravel().tolist()):
        amount[axis_index(a, x.ndim)] += int(s)
    out = x
    for d, s in enumerate(amount):
        n = x.shape[d]
        k = s % n if n else 0
        if not k:
            continue
        src, res = out, x.copy()
        head = tuple(slice(None) if e != d else slice(n - k, None) for e in range(x.ndim))
        tail = tuple(slice(None) if e != d else slice(None, n - k) for e in range(x.ndim))
        dst_head = tuple(slice(None) if e != d else slice(None, k) for e in range(x.ndim))
        dst_tail = tuple(slice(None) if e != d else slice(k, None) for e in range(x.ndim))
        setitem(res, dst_head, getitem(src, head))
        setitem(res, dst_tail, getitem(src, tail))
        out = res
    return out.copy() if out is x else out


def diff(x: DistArray, n: int = 1, axis: int = -1, prepend: Any = np._NoValue,  # type: ignore[attr-defined]
         append: Any = np._NoValue) -> DistArray:  # type: ignore[attr-defined]
    """``x[1:] - x[:-1]`` along ``axis``, ``n`` times, like :func:`numpy.diff`.

    The second slice is moved to the first one's layout (one Alltoallw per
    difference), which brings each block its neighbour's edge.
    """
    x = _dist(x, "diff")
    if prepend is not np._NoValue or append is not np._NoValue:  # type: ignore[attr-defined]
        raise TypeError("diff of a DistArray does not support prepend= or append=")
    if n < 0:
        raise ValueError(f"order must be non-negative but got {n}")
    if x.ndim == 0:
        raise ValueError("diff requires input that is at least one dimensional")
    a = axis_index(axis, x.ndim)
    hi = tuple(slice(1, None) if d == a else slice(None) for d in range(x.ndim))
    lo = tuple(slice(None, -1) if d == a else slice(None) for d in range(x.ndim))
    op = np.not_equal if x.dtype == np.bool_ else np.subtract
    for _ in range(n):
        x = op(getitem(x, hi), getitem(x, lo))
    return x


def _atleast(nd: int, arys: tuple[Any, ...]) -> Any:
    out = []
    for x in arys:
        x = _dist(x, f"atleast_{nd}d")
        if x.ndim >= nd:
            out.append(x)
        elif nd == 1 or x.ndim == 0:
            out.append(expand_dims(x, tuple(range(nd))))
        elif nd == 2:
            out.append(expand_dims(x, 0))
        else:
            out.append(expand_dims(x, (0, 2)) if x.ndim == 1 else expand_dims(x, 2))
    return out[0] if len(out) == 1 else tuple(out)


def atleast_1d(*arys: Any) -> Any:
    """Arrays with at least one dimension, like :func:`numpy.atleast_1d`."""
    return _atleast(1, arys)


def atleast_2d(*arys: Any) -> Any:
    """Arrays with at least two dimensions, like :func:`numpy.atleast_2d`."""
    return _atleast(2, arys)


def atleast_3d(*arys: Any) -> Any:
    """Arrays with at least three dimensions, like :func:`numpy.atleast_3d`."""
    return _atleast(3, arys)


def hstack(tup: Sequence[Any], *, dtype: Any = None, casting: str = "same_kind") -> DistArray:
    """Join column-wise (along axis 0 for 1-D arrays), like :func:`numpy.hstack`."""
    arrs = [atleast_1d(a) if is_dist(a) else np.atleast_1d(a) for a in tup]
    axis = 0 if arrs and arrs[0].ndim == 1 else 1
    return concatenate(arrs, axis, dtype=dtype, casting=casting)


def vstack(tup: Sequence[Any], *, dtype: Any = None, casting: str = "same_kind") -> DistArray:
    """Join row-wise, like :func:`numpy.vstack`."""
    arrs = [atleast_2d(a) if is_dist(a) else np.atleast_2d(a) for a in tup]
    return concatenate(arrs, 0, dtype=dtype, casting=casting)


def unstack(x: DistArray, /, *, axis: int = 0) -> tuple[DistArray, ...]:
    """The slices along ``axis``, like :func:`numpy.unstack` (one broadcast each)."""
    x = _dist(x, "unstack")
    if x.ndim == 0:
        raise ValueError("Input array must be at least 1-d.")
    a = axis_index(axis, x.ndim)
    return tuple(getitem(x, (slice(None),) * a + (i,)) for i in range(x.shape[a]))
