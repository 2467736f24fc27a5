"""Sorting: ``sort`` and ``argsort`` along any axis of a DistArray, on any distribution.

Along an axis that is not split, every rank sorts its block (no
communication). Along a split axis of a 1-D array the sort is a sample sort
over the ranks that share the other coordinates (``grid.subcomm`` of the
axis' grid axes), in block order:

1. every rank sorts its block (NumPy's fastest sort; for floats the zeros
   and NaNs are then put back in input order, which makes it stable);
2. every block sends regular samples of its sorted block, weighted by its
   size, to the others (one ``allgather`` of at most ``OVERSAMPLE * p``
   samples per block), and every rank picks the same ``p - 1`` splitters at
   the weighted quantiles of the *target* block boundaries, so that bucket
   ``k`` already holds about the elements that block ``k`` of the result
   needs (uneven and empty blocks included);
3. every rank cuts its sorted block at the splitters (binary searches) by the
   key (value, position), which orders equal values as their global indices
   do and is unique, so a run of equal values is spread over buckets and
   never piles up on one rank; one ``Alltoallv`` moves the slices, in place;
4. every rank merges the sorted runs it received with NumPy's stable sort
   (which finds the runs); they arrive in block order, so ties stay in input
   order: the sort is stable;
5. one redistribution (:mod:`disttensor.redistribute`) moves the buckets'
   few surplus elements to the input's block boundaries.

Each element moves about once; no rank ever holds more than its bucket.
Splitting an N-D array along the sorted axis moves that axis' split onto the
longest other dimension (one redistribution), sorts whole lines locally and
moves back: each rank then holds whole lines of a slab of the other
dimensions, never the whole array.

Order is NumPy's: NaNs last (first with ``descending=True``), ``-0.0`` and
``0.0`` equal (with ``stable=True`` they keep their input order), complex
numbers by real then imaginary part. ``descending=True`` is the standard's:
stable descending order keeps equal elements in their input order (it sorts
the reversed input and reverses the result, as ``array_api_strict`` does).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import disttensor.ops.shape as _shape

from ..array import DistArray
from ..backend import mpi_dtype, to_numpy
from ..distribution import Distribution
from ..settings import collective
from ._util import axis_index, block_coords, is_dist, subcomm_index, wrap

__all__ = ["sort", "argsort", "OVERSAMPLE", "block_ranks", "inverse_ranks"]

#: Samples per block and per target block that choose the splitters.
OVERSAMPLE = 64


def _check(x: Any, axis: Any, name: str) -> int:
    if not is_dist(x):
        raise TypeError(f"{name}: expected a DistArray, got {type(x).__name__}")
    return axis_index(axis, x.ndim)


def _check_flags(descending: Any, stable: Any) -> None:
    for name, v in (("descending", descending), ("stable", stable)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {v!r}")


@collective
def sort(x: DistArray, /, *, axis: int = -1, descending: bool = False,
         stable: bool = True) -> DistArray:
    """Sorted copy of ``x`` along ``axis``, with ``x``'s distribution.

    Parameters
    ----------
    x : DistArray
        Input of any dtype and distribution (at least one dimension).
    axis : int
        The axis to sort along.
    descending : bool
        Sort in descending order (NaNs first); equal elements keep their
        input order when ``stable``.
    stable : bool
        Keep equal elements (``-0.0`` and ``0.0``, NaNs) in input order. The
        distributed sort is always stable; ``False`` only allows a faster
        local sort.

    Returns
    -------
    DistArray
        Same shape, dtype and distribution as ``x``.

    Raises
    ------
    TypeError
        If ``x`` is not a DistArray or a flag is not a bool.
    numpy.exceptions.AxisError
        If ``axis`` is out of range (0-d arrays included), on every rank.
    """
    ax = _check(x, axis, "sort")
    _check_flags(descending, stable)
    if descending:
        return _shape.flip(_sort(_shape.flip(x, ax), ax, False, bool(stable)), ax)
    return _sort(x, ax, False, bool(stable))


@collective
def argsort(x: DistArray, /, *, axis: int = -1, descending: bool = False,
            stable: bool = True) -> DistArray:
    """Indices that sort ``x`` along ``axis`` (``intp``), with ``x``'s distribution.

    Parameters are those of :func:`sort`. Descending order is the standard's:
    ``argsort(x, descending=True)`` reverses the stable ascending argsort of
    the reversed input, so equal elements keep their input order.

    Returns
    -------
    DistArray
        Indices along ``axis`` (dtype ``intp``), distributed like ``x``.
    """
    ax = _check(x, axis, "argsort")
    _check_flags(descending, stable)
    if not descending:
        return _sort(x, ax, True, True)
    n = x.shape[ax]
    rev = _sort(_shape.flip(x, ax), ax, True, True)
    out = _shape.flip(rev, ax)
    out.local[...] = (n - 1) - out.local
    return out


# ------------------------------------------------------------------ dispatch


def _sort(x: DistArray, axis: int, index: bool, stable: bool) -> DistArray:
    """Ascending sort (``index``: argsort) along ``axis``, stable where it matters."""
    dist = x.dist
    if dist.nblocks[axis] == 1 or x.size == 0:
        return _local(x, dist, axis, index, stable)
    if x.ndim == 1:
        return _sample_sort(x, index, stable)
    lines = _lines_distribution(dist, axis)
    y = _local(x.redistribute(lines), lines, axis, index, stable)
    return y.redistribute(dist)


def _local(x: DistArray, dist: Distribution, axis: int, index: bool,
           stable: bool) -> DistArray:
    """Sort every rank's block along ``axis``, which no rank shares with another."""
    h = to_numpy(x.local)
    if index:
        out = np.argsort(h, axis=axis, kind="stable")
    else:
        out = np.sort(h, axis=axis, kind="stable" if stable else None)
    return wrap(x.xp.asarray(out), dist, x.xp)


def _lines_distribution(dist: Distribution, axis: int) -> Distribution:
    """``dist`` with ``axis`` whole and its grid axes added to the longest other dimension."""
    other = max((d for d in range(dist.ndim) if d != axis),
                key=lambda d: (dist.shape[d], -d))
    axes = list(dist.dim_axes)
    splits = list(dist.splits)
    axes[other] = axes[other] + axes[axis]
    axes[axis] = ()
    splits[other] = splits[axis] = None
    return Distribution(dist.shape, dist.grid, axes, splits)


# ------------------------------------------------------------------ sample sort


def block_ranks(dist: Distribution, dim: int = 0) -> list[int]:
    """Rank in ``grid.subcomm(dist.dim_axes[dim])`` of each block of ``dim``, around this rank."""
    grid = dist.grid
    e = dist.dim_axes[dim]
    return [subcomm_index(grid, e, block_coords(dist, dim, b, grid.coords))
            for b in range(dist.nblocks[dim])]


def _local_sort(h: np.ndarray, index: bool, stable: bool) -> tuple[np.ndarray, Any]:
    """This block sorted (stably where it matters) and, for ``index``, its sorting permutation."""
    if index or h.dtype.kind == "c":
        perm = np.argsort(h, kind="stable")
        return h[perm], perm if index else None
    out = np.sort(h)  # the fastest kind; equal elements differ only for floats:
    if stable and h.dtype.kind == "f":
        _restore_input_order(out, h)
    return out, None


def _splitters(samples: list, dist: Distribution, ranks: list[int]
               ) -> tuple[np.ndarray, np.ndarray, int]:
    """The finite splitters (values, keys) and the number of empty leading buckets.

    A sample's key is its block's start plus its position in the sorted
    block: among equal values it orders like the global index, so (value,
    key) is the stable order. Bucket ``k`` holds the elements from splitter
    ``k - 1`` (inclusive) to splitter ``k``; the splitters sit at the
    weighted sample quantiles of the result's block boundaries. A boundary
    at 0 is a splitter below every element.
    """
    b = dist.boundaries[0]
    n, p = b[-1], len(b) - 1
    vals, keys, wts = [], [], []
    for r in range(p):
        v, g = samples[ranks[r]]
        vals.append(v)
        keys.append(g)
        wts.append(np.full(len(g), (b[r + 1] - b[r]) / max(len(g), 1)))
    v, g, w = np.concatenate(vals), np.concatenate(keys), np.concatenate(wts)
    order = np.lexsort((g, v))
    v, g = v[order], g[order]
    cw = np.cumsum(w[order])
    below = sum(1 for k in range(1, p) if b[k] == 0)
    pick = [min(int(np.searchsorted(cw, b[k])), len(cw) - 1)
            for k in range(1, p) if 0 < b[k] < n]
    return v[pick], g[pick], below


def _cuts(s: np.ndarray, start: int, sv: np.ndarray, sg: np.ndarray, below: int,
          p: int) -> list[int]:
    """Where the sorted block ``s`` (keys ``start + position``) is cut into ``p`` buckets."""
    lo = np.searchsorted(s, sv, "left")
    hi = np.searchsorted(s, sv, "right")
    cut = np.clip(sg - start, lo, hi)  # equal values: by key
    n = len(s)
    return [0] * (below + 1) + [int(c) for c in cut] + [n] * (p - below - len(cut))


def _exchange(comm: Any, send: np.ndarray, cuts: list[int], ranks: list[int],
              rcounts_blocks: list[int]) -> np.ndarray:
    """One ``Alltoallv``: slice ``cuts[k]:cuts[k+1]`` of ``send`` to the rank of block ``k``;
    the pieces received are concatenated in block order."""
    p = len(ranks)
    scounts, sdispls, rcounts, rdispls = [0] * p, [0] * p, [0] * p, [0] * p
    roff = 0
    for blk in range(p):
        r = ranks[blk]
        scounts[r], sdispls[r] = cuts[blk + 1] - cuts[blk], cuts[blk]
        rcounts[r], rdispls[r] = rcounts_blocks[blk], roff
        roff += rcounts_blocks[blk]
    recv = np.empty(roff, dtype=send.dtype)
    t = mpi_dtype(send.dtype)
    comm.Alltoallv([send, (scounts, sdispls), t], [recv, (rcounts, rdispls), t])
    return recv


def _sample_sort(x: DistArray, index: bool, stable: bool) -> DistArray:
    """Stable sample sort of a 1-D DistArray split over several blocks (module docstring)."""
    dist = x.dist
    b = dist.boundaries[0]
    p = len(b) - 1
    comm = dist.grid.subcomm(dist.dim_axes[0])
    ranks = block_ranks(dist)
    me = dist.block_index()[0]
    start, nloc = b[me], b[me + 1] - b[me]

    # 1. sort the block
    s, perm = _local_sort(np.ascontiguousarray(to_numpy(x.local)), index, stable)

    # 2. regular samples of the sorted blocks, the same splitters on every rank
    m = min(nloc, OVERSAMPLE * p)
    pos = (np.arange(m, dtype=np.int64) * nloc + nloc // 2) // max(m, 1)
    samples = comm.allgather((s[pos], start + pos))
    sv, sg, below = _splitters(samples, dist, ranks)

    # 3. cut the sorted block into buckets (binary searches) and move each to its rank
    cuts = _cuts(s, start, sv, sg, below, p)
    by_rank = comm.alltoall([cuts[blk + 1] - cuts[blk] for blk in inverse_ranks(ranks)])
    rcounts = [by_rank[ranks[blk]] for blk in range(p)]
    recv = _exchange(comm, s, cuts, ranks, rcounts)

    # 4. merge the sorted runs; they arrived in block order, so a stable merge keeps ties
    #    in input order
    if index:
        gidx = _exchange(comm, start + perm, cuts, ranks, rcounts)
        out = gidx[np.argsort(recv, kind="stable")]
    else:
        recv.sort(kind="stable")
        out = recv

    # 5. to the input's block boundaries
    sizes = comm.allgather(len(out))
    bounds = np.cumsum([sizes[ranks[blk]] for blk in range(p)])[:-1].tolist()
    buckets = dist.replace(splits=[bounds])
    return wrap(x.xp.asarray(out), buckets, x.xp).redistribute(dist)


def inverse_ranks(ranks: list[int]) -> list[int]:
    """Block of each sub-communicator rank."""
    inv = [0] * len(ranks)
    for blk, r in enumerate(ranks):
        inv[r] = blk
    return inv


def _restore_input_order(out: np.ndarray, h: np.ndarray) -> None:
    """Put the zeros and NaNs of the sorted ``out`` in their order in ``h``.

    Every other group of equal floats is bitwise identical, so this makes
    ``numpy.sort``'s (unstable, fastest) result that of a stable sort.
    """
    zeros = h == 0
    nz = int(np.count_nonzero(zeros))
    if nz:
        at = int(np.searchsorted(out, 0.0, "left"))
        out[at:at + nz] = h[zeros]
    nan = np.isnan(h)
    nn = int(np.count_nonzero(nan))
    if nn:
        out[len(out) - nn:] = h[nan]
