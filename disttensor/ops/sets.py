"""Set functions: ``unique_values``, ``unique_counts``, ``unique_inverse``, ``unique_all``.

All four flatten ``x`` and sort it with the distributed sort
(:mod:`~disttensor.ops.sorting`); a value starts a group where it differs
from its predecessor (the last element of the previous non-empty block comes
from one small ``allgather``). NaNs are all distinct (``equal_nan=False``,
as the standard and NumPy's ``unique_*`` have it); ``-0.0`` and ``0.0`` are
one value.

**Distribution of the results.** Their size depends on the data. The 1-D
results (``values``, ``counts``, ``indices``) are split over the grid axes of
the flattened, sorted array (every axis of the input's grid that splits
it; replicas elsewhere), with data-dependent block boundaries: each block
holds the groups that *start* in its block of the sorted array, so they are
made without moving any value. ``inverse_indices`` has ``x``'s shape and the
distribution of ``x.ravel()`` reshaped back (that of ``x`` when reshaping
keeps it). Use ``redistribute`` to balance a result.

``unique_inverse`` and ``unique_all`` sort twice (``argsort`` of ``x``, then
of the permutation, to send every group number back to the elements' places)
and gather twice (:func:`~disttensor.ops.searching.take`).
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np

import disttensor.ops.shape as _shape

from ..array import DistArray
from ..backend import to_numpy
from ..settings import collective
from ._util import is_dist, wrap
from .searching import take
from .sorting import argsort, block_ranks, sort

__all__ = ["unique_values", "unique_counts", "unique_inverse", "unique_all"]

UniqueAllResult = namedtuple("UniqueAllResult", ["values", "indices", "inverse_indices",
                                                 "counts"])
UniqueCountsResult = namedtuple("UniqueCountsResult", ["values", "counts"])
UniqueInverseResult = namedtuple("UniqueInverseResult", ["values", "inverse_indices"])


def _flat(x: Any, name: str) -> DistArray:
    if not is_dist(x):
        raise TypeError(f"{name}: expected a DistArray, got {type(x).__name__}")
    return x if x.ndim == 1 else _shape.reshape(x, (-1,))


class _Groups:
    """The groups of equal values of a sorted 1-D DistArray ``s``, on this rank."""

    def __init__(self, s: DistArray):
        dist = s.dist
        self.s = s
        h = to_numpy(s.local)
        comm = dist.grid.subcomm(dist.dim_axes[0])
        ranks = block_ranks(dist)
        me = dist.block_index()[0]
        b = dist.boundaries[0]
        n = b[-1]
        info = comm.allgather(h[-1:].copy())
        last = [info[ranks[k]] for k in range(len(ranks))]
        mask = np.ones(len(h), dtype=bool)
        if len(h) > 1:
            mask[1:] = h[1:] != h[:-1]
        prev = next((last[k] for k in range(me - 1, -1, -1) if len(last[k])), None)
        if len(h) and prev is not None:
            mask[0] = bool(h[0] != prev[0])
        self.mask = mask
        self.starts = b[me] + np.flatnonzero(mask)   # global positions of the group starts
        sel = comm.allgather((len(self.starts), self.starts[:1].copy()))
        sel = [sel[ranks[k]] for k in range(len(ranks))]
        counts = [c for c, _ in sel]
        self.dist = dist.replace(global_shape=(int(sum(counts)),),
                                 splits=[np.cumsum(counts)[:-1].tolist()])
        self.first_group = int(sum(counts[:me]))
        nxt = next((int(f[0]) for c, f in sel[me + 1:] if c), n)
        self.next_start = nxt

    def values(self) -> DistArray:
        return wrap(self.s.xp.asarray(to_numpy(self.s.local)[self.mask]), self.dist,
                    self.s.xp)

    def counts(self) -> DistArray:
        c = np.diff(np.append(self.starts, self.next_start)).astype(np.intp)
        return wrap(self.s.xp.asarray(c), self.dist, self.s.xp)

    def positions(self) -> DistArray:
        return wrap(self.s.xp.asarray(self.starts.astype(np.intp)), self.dist, self.s.xp)

    def group_of_sorted(self) -> DistArray:
        """The group number of every element of ``s`` (its distribution)."""
        g = self.first_group + np.cumsum(self.mask, dtype=np.intp) - 1
        return wrap(self.s.xp.asarray(g), self.s.dist, self.s.xp)


def _inverse(x: DistArray, perm: DistArray, groups: _Groups) -> DistArray:
    """Group number of every element of ``x``, in ``x``'s shape."""
    rank = argsort(perm)  # position in sorted order of every element of the flat x
    inv = take(groups.group_of_sorted(), rank)
    return inv if x.ndim == 1 else _shape.reshape(inv, x.shape)


@collective
def unique_values(x: DistArray, /) -> DistArray:
    """The distinct values of ``x``, sorted (1-D; distribution: module docstring)."""
    return _Groups(sort(_flat(x, "unique_values"))).values()


@collective
def unique_counts(x: DistArray, /) -> UniqueCountsResult:
    """The distinct values of ``x`` and how often each occurs."""
    g = _Groups(sort(_flat(x, "unique_counts")))
    return UniqueCountsResult(g.values(), g.counts())


@collective
def unique_inverse(x: DistArray, /) -> UniqueInverseResult:
    """The distinct values of ``x`` and, for each element, the index of its value."""
    flat = _flat(x, "unique_inverse")
    perm = argsort(flat)
    g = _Groups(take(flat, perm))
    return UniqueInverseResult(g.values(), _inverse(x, perm, g))


@collective
def unique_all(x: DistArray, /) -> UniqueAllResult:
    """Distinct values, the index of each one's first occurrence (in ``x.ravel()``), the
    inverse indices (``x``'s shape) and the counts."""
    flat = _flat(x, "unique_all")
    perm = argsort(flat)
    g = _Groups(take(flat, perm))
    first = take(perm, g.positions())
    if first.dist != g.dist:
        first = first.redistribute(g.dist)
    return UniqueAllResult(g.values(), first, _inverse(x, perm, g), g.counts())
