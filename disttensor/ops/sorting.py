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
An N-D array split along the sorted axis takes one of two ways. Moving that
axis' split onto the longest other dimension (one redistribution), sorting
whole lines locally and moving back leaves each rank whole lines of a slab
of the other dimensions; it is used unless some rank would then hold more
than :data:`LINES_IMBALANCE` times the input's largest block (the other
dimensions are too short to spread the lines: an ``(n, 1)`` array). Then
the sample sort runs on every line at once (``_batched_sample_sort``).

Order is NumPy's: NaNs last (first with ``descending=True``), ``-0.0`` and
``0.0`` equal (with ``stable=True`` they keep their input order), complex
numbers by real then imaginary part. ``descending=True`` is the standard's:
stable descending order keeps equal elements in their input order (it sorts
the reversed input and reverses the result, as ``array_api_strict`` does).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import disttensor.ops.shape as _shape

from ..array import DistArray
from ..backend import mpi_dtype, to_numpy
from ..distribution import Distribution
from ..settings import collective
from ._util import axis_index, block_coords, is_dist, subcomm_index, wrap
from .gathering import max_block_elements

__all__ = ["sort", "argsort", "OVERSAMPLE", "LINES_IMBALANCE", "block_ranks",
           "inverse_ranks"]

#: Samples per block and per target block that choose the splitters.
OVERSAMPLE = 64

#: An N-D sort along a split axis moves that split onto another dimension and sorts
#: whole lines locally, unless some rank would then hold more than this many times the
#: largest block of the input; then it runs the sample sort batched over the lines.
LINES_IMBALANCE = 1.5


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
    if max_block_elements(lines) <= LINES_IMBALANCE * max_block_elements(dist):
        y = _local(x.redistribute(lines), lines, axis, index, stable)
        return y.redistribute(dist)
    return _batched_sample_sort(x, axis, index, stable)


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


def _splitters(samples: list, b: list[int], ranks: list[int]
               ) -> tuple[np.ndarray, np.ndarray, int]:
    """The finite splitters (values, keys) and the number of empty leading buckets.

    A sample's key is its block's start plus its position in the sorted
    block: among equal values it orders like the global index, so (value,
    key) is the stable order. Bucket ``k`` holds the elements from splitter
    ``k - 1`` (inclusive) to splitter ``k``; the splitters sit at the
    weighted sample quantiles of the result's block boundaries. A boundary
    at 0 is a splitter below every element.
    """
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
    sv, sg, below = _splitters(samples, b, ranks)

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


def _segments(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The pieces ``flat[starts[i]:starts[i] + lengths[i]]``, concatenated."""
    starts, lengths = starts.ravel(), lengths.ravel()
    total = int(lengths.sum())
    if total == 0:
        return flat[:0].copy()
    before = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return flat[np.repeat(starts - before, lengths) + np.arange(total)]


def _alltoallv(comm: Any, send: np.ndarray, sc: np.ndarray, rc: np.ndarray) -> np.ndarray:
    """One ``Alltoallv`` of elements, ``sc[r]`` to and ``rc[r]`` from rank ``r``."""
    recv = np.empty(int(rc.sum()), dtype=send.dtype)
    sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
    rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
    t = mpi_dtype(send.dtype)
    comm.Alltoallv([send, (sc.tolist(), sd.tolist()), t], [recv, (rc.tolist(), rd.tolist()), t])
    return recv


def _batched_sample_sort(x: DistArray, axis: int, index: bool, stable: bool) -> DistArray:
    """The sample sort of every line along the split ``axis`` of an N-D array at once.

    The ``L`` lines of a rank's block (the product of its other dimensions)
    are those of every rank of the axis' sub-communicator. Each line is
    sorted, sampled and cut like a 1-D array (module docstring); one
    ``Alltoallv`` moves every line's buckets, each rank merges its runs per
    line, and a second ``Alltoallv`` moves each line's bucket to the input's
    block boundaries (the counts follow from one ``allgather`` of the
    bucket sizes).
    """
    dist = x.dist
    b = dist.boundaries[axis]
    p = len(b) - 1
    comm = dist.grid.subcomm(dist.dim_axes[axis])
    ranks = np.asarray(block_ranks(dist, axis))
    inv = np.asarray(inverse_ranks(list(ranks)))
    me = dist.block_index()[axis]
    start, nloc = b[me], b[me + 1] - b[me]
    h = np.moveaxis(to_numpy(x.local), axis, -1)
    other = h.shape[:-1]
    nl = math.prod(other)
    h = np.ascontiguousarray(h).reshape(nl, nloc)

    # 1. sort every line; 2. the same splitters per line on every rank
    s = np.empty_like(h)
    perm = np.empty((nl, nloc), np.int64) if index else None
    for ln in range(nl):
        s[ln], pl = _local_sort(h[ln], index, stable)
        if perm is not None:
            perm[ln] = pl
    m = min(nloc, OVERSAMPLE * p)
    pos = (np.arange(m, dtype=np.int64) * nloc + nloc // 2) // max(m, 1)
    samples = comm.allgather((s[:, pos], start + pos))
    cuts = np.empty((nl, p + 1), np.int64)
    for ln in range(nl):
        sv, sg, below = _splitters([(v[ln], g) for v, g in samples], b, list(ranks))
        cuts[ln] = _cuts(s[ln], start, sv, sg, below, p)

    # 3. every line's bucket k to the rank of block k, segments in (rank, line) order
    cnt = np.diff(cuts, axis=1)[:, inv]                   # (line, rank)
    rcnt = np.empty((p, nl), np.int64)                    # (source rank, line)
    comm.Alltoall([np.ascontiguousarray(cnt.T), mpi_dtype(np.dtype(np.int64))],
                  [rcnt, mpi_dtype(np.dtype(np.int64))])
    starts = (np.arange(nl, dtype=np.int64) * nloc)[None, :] + cuts[:, inv].T
    sc, rc = cnt.sum(axis=0), rcnt.sum(axis=1)
    # the received runs in (line, block) order
    rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
    within = np.cumsum(rcnt, axis=1) - rcnt
    rstarts = (rd[:, None] + within)[ranks].T            # (line, block)
    rlens = rcnt[ranks].T
    vals = _segments(_alltoallv(comm, _segments(s.ravel(), starts, cnt.T), sc, rc),
                     rstarts, rlens)
    sizes = rlens.sum(axis=1)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    if index:
        gidx = _segments(_alltoallv(comm, _segments((start + perm).ravel(), starts, cnt.T),
                                    sc, rc), rstarts, rlens)
        for ln in range(nl):
            sl = slice(offs[ln], offs[ln + 1])
            gidx[sl] = gidx[sl][np.argsort(vals[sl], kind="stable")]
        vals = gidx
    else:
        for ln in range(nl):
            vals[offs[ln]:offs[ln + 1]].sort(kind="stable")

    # 4. each line's bucket to the input's block boundaries
    bsizes = np.asarray(comm.allgather(sizes), np.int64).reshape(p, nl)[ranks]  # (block, line)
    boff = np.concatenate([np.zeros((1, nl), np.int64), np.cumsum(bsizes, axis=0)])
    bb = np.asarray(b, np.int64)[:, None]
    lo = np.maximum(boff[me][None, :], bb[:-1])           # (target block, line)
    hi = np.minimum(boff[me + 1][None, :], bb[1:])
    send_len = np.maximum(hi - lo, 0)[inv]                # (rank, line)
    send_at = (np.minimum(lo, boff[me + 1][None, :]) - boff[me][None, :])[inv] + offs[:-1]
    lo2 = np.maximum(boff[:-1], b[me])                    # (source block, line)
    recv_len = np.maximum(np.minimum(boff[1:], b[me + 1]) - lo2, 0)
    got = _alltoallv(comm, _segments(vals, send_at, send_len), send_len.sum(axis=1),
                     recv_len[inv].sum(axis=1))
    rd2 = np.concatenate([[0], np.cumsum(recv_len[inv].sum(axis=1))[:-1]])
    within2 = (np.cumsum(recv_len[inv], axis=1) - recv_len[inv])
    at = (rd2[:, None] + within2)[ranks].T                # (line, source block)
    out = _segments(got, at, recv_len.T).reshape(other + (nloc,))
    return wrap(x.xp.asarray(np.moveaxis(out, -1, axis)), dist, x.xp)


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
