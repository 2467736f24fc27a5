"""Integer-array (advanced) indexing: ``x[i, j]`` and ``x[..., idx] = v`` by routing points.

A key with at least one integer array (a DistArray, a NumPy array or a
list) follows NumPy's advanced-indexing rules: the integer arrays and the
integers of the key broadcast together to a shape ``B``; where they are
adjacent in the key the dimensions ``B`` replace them in the result, where
they are not they come first. Slices, ``...`` and ``numpy.newaxis`` apply as
in basic indexing.

Reading, ``x[key]``: the basic part of the key (the slices and new axes)
is applied first (:func:`disttensor.ops.indexing.getitem`); then every rank
asks, for the points of ``B`` it will hold, the ranks that own them: one
``Alltoallv`` of the indices and one of the answers (the point's values
over the other dimensions), among the ranks that share the coordinates of
the grid axes that do not split an indexed dimension. The first dimension
of ``B`` in the result is split over the grid axes of all indexed
dimensions (block rule), the others of ``B`` are whole; the remaining
dimensions keep their layout.

Writing, ``x[key] = value``: the value is broadcast to the target shape and
laid out like the read's result (a DistArray value is redistributed, a
NumPy value is sliced, a scalar is used as it is); every rank sends its
points (indices, position, values) to their owners in one exchange, and
the owners write them. When an index repeats, the value at the **last
position** of the broadcast index arrays (row-major order) is written,
which is what NumPy does on one process; the result is deterministic on
any distribution. With slices or new axes elsewhere in the key, the
region they select is read, written into and written back (basic
indexing both ways).

Indices outside ``[-n, n)`` raise NumPy's IndexError on every rank before
any data moves (an allreduce of the range for DistArray indices); index
arrays that do not broadcast together raise NumPy's IndexError too.

``x[mask] = values`` with a boolean mask and a 1-D value of one element per
selected element writes through the mask's :func:`~disttensor.ops.indexing.nonzero`
indices with this mechanism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from mpi4py import MPI

from ..array import DistArray
from ..backend import is_numpy, mpi_dtype, to_numpy
from ..distribution import Distribution
from ..settings import collective
from ..transport import allreduce
from ._util import is_dist, make_dist, same_comm, split_grid_axes, wrap
from .align import (
    aligned,
    as_operand,
    check_move,
    numpy_part,
    operand_distribution,
)
from .indexing import (
    check_value,
    getitem,
    integer_array_key,
    mask_key,
    nonzero,
    parse_key,
    setitem,
)
from .searching import take

__all__ = ["AdvancedKey", "advanced_key", "advanced_getitem", "advanced_setitem",
           "mask_assign", "index", "assign"]


def _index_array(k: Any) -> Any:
    """``k`` as an integer index array of at least one dimension, else None."""
    if isinstance(k, list):
        a = np.asarray(k)
        k = a.astype(np.intp) if a.size == 0 else a  # x[[]] selects nothing, as in NumPy
    if (is_dist(k) or isinstance(k, np.ndarray)) and k.ndim >= 1 and k.dtype.kind in "iu":
        return k
    return None


def _is_mask(k: Any) -> bool:
    return ((is_dist(k) or isinstance(k, np.ndarray)) and k.ndim >= 1
            and k.dtype == np.bool_)


@dataclass(frozen=True)
class AdvancedKey:
    """A key with integer arrays, normalised (every rank computes the same from metadata)."""

    basic: tuple[Any, ...]      # the key with each advanced entry a full slice
    dims: tuple[int, ...]       # dimensions of ``x[basic]`` that the arrays index
    sizes: tuple[int, ...]      # their lengths
    arrays: tuple[Any, ...]     # the index arrays (ints as 0-d NumPy arrays), not wrapped
    bshape: tuple[int, ...]     # the broadcast shape of the arrays

    @property
    def adjacent(self) -> bool:
        """Whether the advanced entries are next to each other (``B`` stays in place)."""
        return self.dims == tuple(range(self.dims[0], self.dims[0] + len(self.dims)))

    @property
    def only_full_slices(self) -> bool:
        """Whether every other entry is a full slice (no slicing, no new axes)."""
        return all(k == slice(None) for k in self.basic)


def advanced_key(key: Any, x: DistArray) -> AdvancedKey | None:
    """The normalised advanced key, or None when ``key`` has no integer array.

    Raises NumPy's IndexError (too many indices, several ellipses, an
    integer or index out of range, arrays that do not broadcast, a boolean
    mask mixed with integer arrays) on every rank alike; for DistArray
    indices the range check is one allreduce, before any data moves.
    """
    items = list(key) if isinstance(key, tuple) else [key]
    if not any(_index_array(k) is not None for k in items):
        return None
    ndim = x.ndim
    ellipses = sum(k is Ellipsis for k in items)
    if ellipses > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    consumed = sum(k is not None and k is not Ellipsis for k in items)
    if consumed > ndim:
        raise IndexError(f"too many indices for array: array is {ndim}-dimensional, but "
                         f"{consumed} were indexed")
    fill = [slice(None)] * (ndim - consumed)
    if ellipses:
        at = items.index(Ellipsis)
        items[at:at + 1] = fill
    else:
        items += fill
    basic, dims, xdims, sizes, arrays = [], [], [], [], []
    xd = 0  # dimension of x
    for pos, k in enumerate(items):
        if k is None or isinstance(k, slice):
            basic.append(k)
            xd += k is not None
            continue
        if _is_mask(k):
            raise IndexError("a boolean mask cannot be combined with integer arrays in one "
                             "index of a DistArray")
        a = _index_array(k)
        if a is None:
            parse_key(k, (x.shape[xd],))  # NumPy's IndexError for a bad entry or integer
            a = np.asarray(int(k), dtype=np.intp)
        if is_dist(a) and not same_comm(a.dist, x.dist):
            raise ValueError("an index array must live on the same processes as the array")
        basic.append(slice(None))
        dims.append(pos)
        xdims.append(xd)
        sizes.append(x.shape[xd])
        arrays.append(a)
        xd += 1
    try:
        bshape = tuple(np.broadcast_shapes(*(tuple(a.shape) for a in arrays)))
    except ValueError:
        raise IndexError(
            "shape mismatch: indexing arrays could not be broadcast together with shapes "
            + " ".join(str(tuple(a.shape)) for a in arrays)) from None
    _check_ranges(arrays, sizes, xdims, x)
    return AdvancedKey(tuple(basic), tuple(dims), tuple(sizes), tuple(arrays), bshape)


def _check_ranges(arrays: list[Any], sizes: list[int], xdims: list[int], x: DistArray
                  ) -> None:
    """NumPy's IndexError for any index outside ``[-n, n)``, on every rank alike."""
    lo = np.zeros(len(arrays), np.int64)
    hi = np.zeros(len(arrays), np.int64)
    dist = [j for j, a in enumerate(arrays) if is_dist(a)]
    for j, a in enumerate(arrays):
        v = to_numpy(a.local) if is_dist(a) else np.asarray(a)
        v = v.astype(np.int64, copy=False)
        lo[j] = v.min() if v.size else np.iinfo(np.int64).max
        hi[j] = v.max() if v.size else np.iinfo(np.int64).min
    if dist:
        lo = allreduce(np.ascontiguousarray(lo), x.comm, MPI.MIN)
        hi = allreduce(np.ascontiguousarray(hi), x.comm, MPI.MAX)
    for j, n in enumerate(sizes):
        if hi[j] >= lo[j] and (lo[j] < -n or hi[j] >= n):
            bad = int(lo[j] if lo[j] < -n else hi[j])
            raise IndexError(f"index {bad} is out of bounds for axis {xdims[j]} with size {n}")


# ------------------------------------------------------------------ the points' layout


def _result_distribution(dist: Distribution, k: AdvancedKey) -> tuple[Distribution, int]:
    """The layout of ``x[key]`` for the basic-indexed ``dist``, and where ``B`` starts."""
    rest = [d for d in range(dist.ndim) if d not in k.dims]
    q = k.dims[0] if k.adjacent else 0
    union = tuple(sorted({a for d in k.dims for a in dist.dim_axes[d]}))
    b_axes = [union] + [()] * (len(k.bshape) - 1)
    axes = [dist.dim_axes[d] for d in rest]
    bounds: list[Any] = [dist.boundaries[d] for d in rest]
    axes[q:q] = b_axes
    bounds[q:q] = [None] * len(k.bshape)
    shape = [dist.global_shape[d] for d in rest]
    shape[q:q] = k.bshape
    return make_dist(shape, dist.grid, axes, bounds), q


def _my_points(k: AdvancedKey, res: Distribution, q: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's points: their indices (one row per point, one column per indexed
    dimension, non-negative) and their row-major positions in ``B``."""
    nb = len(k.bshape)
    bdist = make_dist(k.bshape, res.grid, res.dim_axes[q:q + nb], [None] * nb)
    local = bdist.local_shape()
    npts = math.prod(local)
    cols = []
    for a, n in zip(k.arrays, k.sizes):
        if is_dist(a):
            need = operand_distribution(bdist, a.shape)
            part = to_numpy(aligned(a, need, check_move(a, need, "an index array")))
        elif a.ndim:
            part = numpy_part(a, bdist, np)
        else:
            part = a
        v = np.broadcast_to(np.asarray(part, dtype=np.int64), local).reshape(npts)
        cols.append(np.where(v < 0, v + n, v))
    idx = np.stack(cols, axis=1) if cols else np.empty((npts, 0), np.int64)
    r0 = bdist.local_slices()[0].start if nb else 0
    pos = r0 * math.prod(k.bshape[1:]) + np.arange(npts, dtype=np.int64)
    return np.ascontiguousarray(idx), pos


def _owners(dist: Distribution, dims: tuple[int, ...], idx: np.ndarray) -> np.ndarray:
    """Rank, in ``grid.subcomm(split_grid_axes(dist, dims))``, owning each point."""
    g = dist.grid_shape
    sub = split_grid_axes(dist, dims)
    stride = {a: math.prod(g[b] for b in sub if b > a) for a in sub}
    owner = np.zeros(len(idx), np.int64)
    for j, d in enumerate(dims):
        if dist.nblocks[d] == 1:
            continue
        rem = np.searchsorted(np.asarray(dist.boundaries[d][1:]), idx[:, j], "right")
        for a in reversed(dist.dim_axes[d]):
            if a in stride:
                owner += (rem % g[a]) * stride[a]
            rem = rem // g[a]
    return owner


def _alltoallv(comm: MPI.Comm, send: np.ndarray, sc: np.ndarray, rc: np.ndarray
               ) -> np.ndarray:
    """Items (rows of ``send``) ``sc[r]`` to rank ``r``; ``rc[r]`` from it, in rank order."""
    row = math.prod(send.shape[1:])
    recv = np.empty((int(rc.sum()),) + send.shape[1:], send.dtype)
    if comm.Get_size() == 1:
        recv[...] = send
        return recv
    sd = np.concatenate([[0], np.cumsum(sc)[:-1]]) * row
    rd = np.concatenate([[0], np.cumsum(rc)[:-1]]) * row
    t = mpi_dtype(send.dtype)
    comm.Alltoallv([np.ascontiguousarray(send), ((sc * row).tolist(), sd.tolist()), t],
                   [recv, ((rc * row).tolist(), rd.tolist()), t])
    return recv


@dataclass
class _Routes:
    comm: MPI.Comm
    order: np.ndarray   # this rank's points sorted by owner
    sc: np.ndarray      # points sent to each rank
    rc: np.ndarray      # points received from each rank


def _routes(dist: Distribution, dims: tuple[int, ...], idx: np.ndarray) -> _Routes:
    comm = dist.grid.subcomm(split_grid_axes(dist, dims))
    owner = _owners(dist, dims, idx)
    sc = np.bincount(owner, minlength=comm.Get_size()).astype(np.int64)
    rc = np.asarray(comm.alltoall(sc.tolist()), np.int64)
    return _Routes(comm, np.argsort(owner, kind="stable"), sc, rc)


def _local_indices(dist: Distribution, dims: tuple[int, ...], idx: np.ndarray
                   ) -> tuple[np.ndarray, ...]:
    start = dist.local_start()
    return tuple(idx[:, j] - start[d] for j, d in enumerate(dims))


# ------------------------------------------------------------------ reading and writing


@collective
def advanced_getitem(x: DistArray, k: AdvancedKey) -> DistArray:
    """``x[key]`` for a key with integer arrays (see the module docstring)."""
    xb = x if k.only_full_slices else getitem(x, k.basic)
    dist, xp = xb.dist, xb.xp
    res, q = _result_distribution(dist, k)
    idx, _ = _my_points(k, res, q)
    r = _routes(dist, k.dims, idx)
    req = _alltoallv(r.comm, idx[r.order], r.sc, r.rc)
    h = np.moveaxis(to_numpy(xb.local), k.dims, range(len(k.dims)))
    rows = np.ascontiguousarray(h[_local_indices(dist, k.dims, req)])
    got = _alltoallv(r.comm, rows, r.rc, r.sc)
    out = np.empty_like(got)
    out[r.order] = got
    nb = len(k.bshape)
    out = out.reshape(tuple(res.local_shape()[q:q + nb]) + out.shape[1:])
    out = np.moveaxis(out, range(nb), range(q, q + nb))
    return wrap(out if is_numpy(xp) else xp.asarray(out), res, xp)


@collective
def advanced_setitem(x: DistArray, k: AdvancedKey, value: Any) -> None:
    """``x[key] = value`` for a key with integer arrays (see the module docstring)."""
    if not k.only_full_slices:  # write into the basic region's copy, then write it back
        region = getitem(x, k.basic)
        advanced_setitem(region, replace(k, basic=(slice(None),) * region.ndim), value)
        setitem(x, k.basic, region)
        return None
    dist, xp = x.dist, x.xp
    res, q = _result_distribution(dist, k)
    value = as_operand(value)
    vshape, lead = check_value(x, value, res.global_shape)
    if is_dist(value):
        v = getitem(value, (0,) * lead) if lead else value
        need = operand_distribution(res, v.shape)
        part = to_numpy(aligned(v, need, check_move(v, need, "the assigned value")))
    elif hasattr(value, "shape"):
        a = value if isinstance(value, (np.ndarray, np.generic)) else to_numpy(value)
        part = numpy_part(np.asarray(a)[(0,) * lead], res, np)
    else:
        part = value
    idx, pos = _my_points(k, res, q)
    nb = len(k.bshape)
    full = np.empty(res.local_shape(), dtype=np.dtype(x.dtype))
    full[...] = part  # NumPy's broadcast and cast
    rows = np.moveaxis(full, range(q, q + nb), range(nb)).reshape((len(idx),) + tuple(
        s for i, s in enumerate(res.local_shape()) if not q <= i < q + nb))
    r = _routes(dist, k.dims, idx)
    req = _alltoallv(r.comm, idx[r.order], r.sc, r.rc)
    where = _alltoallv(r.comm, pos[r.order], r.sc, r.rc)
    got = _alltoallv(r.comm, np.ascontiguousarray(rows[r.order]), r.sc, r.rc)
    if not len(req):
        return None
    # the points in their order in B (they arrive in it: blocks of B in rank order)
    order = (np.arange(len(where)) if np.all(where[1:] >= where[:-1])
             else np.argsort(where, kind="stable"))
    local = _local_indices(dist, k.dims, req[order])
    dshape = tuple(x.local_shape[d] for d in k.dims)
    keep = _last_of_each(np.ravel_multi_index(local, dshape), math.prod(dshape))
    sel = tuple(c[keep] for c in local)
    target = xp.moveaxis(x.local, k.dims, tuple(range(len(k.dims))))
    vals = got[order][keep]
    if is_numpy(xp):
        target[sel] = vals
    else:
        target[tuple(xp.asarray(c) for c in sel)] = xp.asarray(vals)
    return None


def _last_of_each(flat: np.ndarray, domain: int) -> np.ndarray:
    """Positions in ``flat`` of the last occurrence of each value (values in ``[0, domain)``)."""
    pos = np.arange(len(flat))
    if domain <= 4 * len(flat):  # linear: the largest position per value
        last = np.full(domain, -1, np.int64)
        np.maximum.at(last, flat, pos)
        return pos[last[flat] == pos]
    _, first = np.unique(flat[::-1], return_index=True)
    return len(flat) - 1 - first


@collective
def mask_assign(x: DistArray, mask: Any, value: Any) -> None:
    """``x[mask] = value`` for an array ``value`` broadcasting to one element per selected
    element (NumPy's order: row-major), through the mask's ``nonzero`` indices."""
    m = mask if is_dist(mask) else DistArray.from_global(
        np.asarray(mask), Distribution(np.shape(mask), x.grid, (None,) * np.ndim(mask)),
        xp=x.xp)
    key = advanced_key(nonzero(m), x)
    if key is None:  # pragma: no cover - nonzero always gives index arrays
        raise AssertionError("nonzero gave no index arrays")
    advanced_setitem(x, key, value)


def _array_value(value: Any) -> bool:
    return (is_dist(value) or hasattr(value, "shape")) and len(value.shape) > 0


@collective
def index(x: DistArray, key: Any) -> DistArray:
    """``x[key]`` for every supported key: one 1-D integer array along one axis
    (:func:`~disttensor.ops.searching.take`), integer arrays
    (:func:`advanced_getitem`), basic keys and boolean masks
    (:func:`~disttensor.ops.indexing.getitem`)."""
    one = integer_array_key(key, x.ndim)
    if one is not None:
        return take(x, one[1], axis=one[0])
    k = advanced_key(key, x)
    if k is not None:
        return advanced_getitem(x, k)
    return getitem(x, key)


@collective
def assign(x: DistArray, key: Any, value: Any) -> None:
    """``x[key] = value`` for every supported key (see :func:`index`)."""
    k = advanced_key(key, x)
    if k is not None:
        return advanced_setitem(x, k, value)
    value = as_operand(value)
    mask = mask_key(x, key)
    if mask is not None and _array_value(value):
        return mask_assign(x, mask, value)
    return setitem(x, key, value)
