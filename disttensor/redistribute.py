"""Redistribution plans: move a DistArray from any Distribution to any other in one collective.

Importing this module gives :class:`~disttensor.DistArray` its
:meth:`~disttensor.DistArray.redistribute` method (on which ``to_global`` and
``from_global`` with a root build).
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Any

from mpi4py import MPI

from .array import DistArray, _check_dist
from .backend import copy_view, device_of, mpi_dtype, reshape, view_datatype
from .distribution import Distribution
from .settings import collective
from .transport import transport_for_arrays

__all__ = ["RedistributionPlan", "redistribution_plan", "check_compatible"]

Piece = tuple[int, tuple[slice, ...]]  # (peer rank, slices into the local block)

METHODS = ("auto", "pack", "datatype")
# Below this many bytes per contiguous run (anywhere in the plan) pieces are packed.
# Measured with benchmarks/bench_redistribute.py (MPICH 5, shared memory, 2 ranks):
# with 128 B runs packing and one Alltoallv took 0.6-0.7x the time of derived datatypes,
# with 256 B runs 0.6-1.2x (about even, over three runs); with 8-32 KiB runs the
# datatypes took 0.5-0.7x the time of packing.
PACK_BELOW_BYTES = 1024


def check_compatible(src: Distribution, dst: Distribution) -> None:
    """Raise unless data can move between ``src`` and ``dst`` (pure, no communication)."""
    for name, d in (("src", src), ("dst", dst)):
        if not isinstance(d, Distribution):
            raise TypeError(f"{name} must be a Distribution, got {type(d).__name__}")
    if src.global_shape != dst.global_shape:
        raise ValueError(
            f"cannot redistribute between global shapes {src.global_shape} and {dst.global_shape}"
        )
    if src.grid is None or dst.grid is None:
        raise ValueError("redistribution needs Distributions built on a ProcessGrid")
    if not src.grid.same_processes(dst.grid):
        raise ValueError(
            "cannot redistribute between grids over different communicators "
            f"({src.grid} and {dst.grid})"
        )


def source_rank(src: Distribution, block: tuple[int, ...], target: int) -> int:
    """Which replica of the ``src`` block ``block`` sends to ``target``.

    The target itself when it holds a replica (no message), otherwise replicas
    are chosen round-robin over targets so that senders share the load.
    """
    holders = src.ranks_of_block(block)
    if target in holders:
        return target
    return holders[target % len(holders)]


def _local(sl: tuple[slice, ...], start: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(s.start - o, s.stop - o) for s, o in zip(sl, start))


class RedistributionPlan:
    """Messages that move data from ``src`` to ``dst``, computed once for this rank.

    Every rank derives every message from the two Distributions alone: no
    metadata is exchanged. Running the plan costs one collective. When every
    piece of the plan (on any rank) has contiguous runs of at least
    ``PACK_BELOW_BYTES`` (counted for 4-byte elements) it is an
    ``MPI_Alltoallw`` whose datatypes select each piece straight out of the
    local buffers (no packing copies); with shorter runs, for which MPI's
    datatype engine measured slower, the pieces are packed into pooled
    contiguous buffers, one strided copy each, and moved by one
    ``MPI_Alltoallv`` (``method`` forces either). Peers that exchange nothing
    get zero counts, the piece a rank
    keeps is copied locally, and when no rank needs data from another the
    collective is skipped altogether (every rank can tell from the metadata).
    Arrays whose memory MPI cannot read (GPU arrays without a CUDA-aware MPI,
    other array API libraries) are staged through a host copy of the block
    (:mod:`disttensor.transport`); PyTorch's CPU tensors move as NumPy views
    of their memory, without a copy; with a CUDA-aware MPI the datatypes select
    the pieces straight out of device memory.

    Parameters
    ----------
    src, dst : Distribution
        Source and target distributions, over grids of one communicator.
    method : {'auto', 'pack', 'datatype'}
        How pieces reach MPI (see above); every rank must pass the same.
    """

    def __init__(self, src: Distribution, dst: Distribution, method: str = "auto"):
        check_compatible(src, dst)
        if method not in METHODS:
            raise ValueError(f"unknown redistribution method {method!r}; expected one of {METHODS}")
        self.src, self.dst = src, dst
        self.comm = src.grid.comm
        me = src.grid.rank
        nprocs = src.nprocs
        my_block = src.block_index(me)
        src_start, dst_start = src.local_start(me), dst.local_start(me)
        sends: list[Piece] = []
        for r in range(nprocs):
            inter = src.intersection(dst, me, r)
            if inter is not None and source_rank(src, my_block, r) == me:
                sends.append((r, _local(inter, src_start)))
        recvs: list[Piece] = []
        for s_block in _blocks_overlapping(src, dst.local_slices(me)):
            s = source_rank(src, s_block, me)
            inter = src.intersection(dst, s, me)
            if inter is not None:
                recvs.append((s, _local(inter, dst_start)))
        # The piece this rank keeps is copied locally, outside the collective.
        self.keep: tuple[tuple[slice, ...], tuple[slice, ...]] | None = None
        for (r, s_sl), (q, d_sl) in itertools.product(sends, recvs):
            if r == me and q == me:
                self.keep = (s_sl, d_sl)
        self.sends = [pc for pc in sends if pc[0] != me]
        self.recvs = [pc for pc in recvs if pc[0] != me]
        # Packed messages: element counts and offsets per peer, in rank order.
        self._send_shapes = _shapes(self.sends)
        self._recv_shapes = _shapes(self.recvs)
        self._send_layout = _counts(self.sends, self._send_shapes, nprocs)
        self._recv_layout = _counts(self.recvs, self._recv_shapes, nprocs)
        if method == "auto":  # every rank decides alike, from every rank's pieces
            method = "pack" if _shortest_run(src, dst) < PACK_BELOW_BYTES else "datatype"
        self.method = method
        # When every rank's new block lies inside its old one, no rank sends anything.
        self.local_only = all(
            all(a.start <= b.start and b.stop <= a.stop or b.start >= b.stop
                for a, b in zip(src.local_slices(r), dst.local_slices(r)))
            for r in range(nprocs)
        )

    # ------------------------------------------------------------ execution
    def _alltoallw(self, sbase: Any, sends: list, rbase: Any, recvs: list) -> MPI.Request:
        """Start one ``Alltoallw``; ``sends``/``recvs`` are (peer, view into the base) pairs."""
        n = self.comm.Get_size()
        zeros = [0] * n
        spec = []
        for base, pairs in ((sbase, sends), (rbase, recvs)):
            counts, types = [0] * n, [MPI.BYTE] * n
            for peer, view in pairs:
                if view.size:
                    counts[peer], types[peer] = 1, view_datatype(base, view)
            spec.append([base, (counts, zeros), types])
        return self.comm.Ialltoallw(*spec)

    def _packed(self, t: Any, xl: Any, ol: Any, keep: tuple | None) -> None:
        """One ``Alltoallv`` of the pieces packed into contiguous (pooled) buffers.

        The ``keep`` piece, if given, is copied while the messages move.
        """
        (scounts, sdispls, stotal), (rcounts, rdispls, rtotal) = (
            self._send_layout, self._recv_layout)
        sbuf = t.region_empty(xl, (stotal,))
        rbuf = t.region_empty(ol, (rtotal,))
        for (_, sl), shape, off in zip(self.sends, self._send_shapes, self._send_offsets()):
            if shape is not None:
                copy_view(reshape(sbuf[off[0]:off[1]], shape), xl[sl + (...,)])
        t.ready()
        mtype = mpi_dtype(xl.dtype)
        req = self.comm.Ialltoallv([sbuf, (scounts, sdispls), mtype],
                                   [rbuf, (rcounts, rdispls), mtype])
        if keep is not None:
            copy_view(ol[keep[1] + (...,)], xl[keep[0] + (...,)])
        req.Wait()
        for (_, sl), shape, off in zip(self.recvs, self._recv_shapes, self._recv_offsets()):
            if shape is not None:
                copy_view(ol[sl + (...,)], reshape(rbuf[off[0]:off[1]], shape))
        t.release(sbuf)
        t.release(rbuf)

    def _send_offsets(self) -> list[tuple[int, int]]:
        counts, displs, _ = self._send_layout
        return [(displs[p], displs[p] + counts[p]) for p, _ in self.sends]

    def _recv_offsets(self) -> list[tuple[int, int]]:
        counts, displs, _ = self._recv_layout
        return [(displs[p], displs[p] + counts[p]) for p, _ in self.recvs]

    @collective
    def __call__(self, x: DistArray, out: DistArray | None = None) -> DistArray:
        """Return ``x`` redistributed to ``dst``, in ``out`` if given (else a new array).

        ``out`` must have distribution ``dst`` and the dtype of ``x``; reusing it
        across calls saves an allocation per call.
        """
        if x.dist != self.src:
            raise ValueError(f"plan is for {self.src}, got an array with {x.dist}")
        if out is None:
            out = DistArray.empty(self.dst, dtype=x.dtype, xp=x.xp, device=device_of(x.buffer))
        elif out.dist != self.dst or out.dtype != x.dtype:
            raise ValueError(
                f"out must have {self.dst} and dtype {x.dtype}, got {out.dist} and {out.dtype}"
            )
        # the arrays worked on: the blocks themselves, or NumPy views of their host memory
        t, (xbuf, xloc, obuf, oloc) = transport_for_arrays(
            x.xp, x.buffer, x.local, out.buffer, out.local)
        if not self.local_only:
            xb, xl = t.region_to_send(xbuf, xloc)
            ob, ol = t.region_to_receive(obuf, oloc)
            # The kept piece is copied while the messages move, unless the block is staged
            # (the staged copy back writes the whole block, so it must come first).
            keep = self.keep if ob is obuf else None
            if self.method == "pack":
                self._packed(t, xl, ol, keep)
            else:
                t.ready()
                req = self._alltoallw(xb, [(p, xl[sl]) for p, sl in self.sends],
                                      ob, [(p, ol[sl]) for p, sl in self.recvs])
                if keep is not None:
                    copy_view(ol[keep[1] + (...,)], xl[keep[0] + (...,)])
                req.Wait()
            t.deliver_region(oloc, ob)
            if xb is not xbuf:
                t.release(xb)
            if keep is not None:
                return out
        if self.keep is not None:  # (an index ending in ... gives a view even of a 0-d block)
            copy_view(oloc[self.keep[1] + (...,)], xloc[self.keep[0] + (...,)])
        return out

    @collective
    def adjoint(self, y: DistArray) -> DistArray:
        """Apply the adjoint: move ``y`` (on ``dst``) back to ``src``, summing replicas.

        For the inner product that sums every rank's local ``vdot``,
        ``<plan(x), y> == <x, plan.adjoint(y)>``. Where ``dst`` holds replicas
        that came from one source block, their values are added up; replicas of
        ``src`` that sent nothing receive zeros.
        """
        if y.dist != self.dst:
            raise ValueError(f"plan maps to {self.dst}, got an array with {y.dist}")
        out = DistArray.zeros(self.src, dtype=y.dtype, xp=y.xp, device=device_of(y.buffer))
        t, (ybuf, yloc, olocal) = transport_for_arrays(y.xp, y.buffer, y.local, out.local)
        if self.keep is not None:
            olocal[self.keep[0]] += yloc[self.keep[1]]
        if self.local_only:
            return out
        # Receive each returning piece into its own slot of one temporary buffer.
        shapes = [tuple(s.stop - s.start for s in sl) for _, sl in self.sends]
        sizes = [math.prod(shp) for shp in shapes]
        tmp = t.region_empty(yloc, (sum(sizes),))
        offsets = list(itertools.accumulate([0] + sizes))
        views = [reshape(tmp[a:b], shp) for a, b, shp in zip(offsets, offsets[1:], shapes)]
        yb, yl = t.region_to_send(ybuf, yloc)
        t.ready()
        self._alltoallw(yb, [(p, yl[sl]) for p, sl in self.recvs],
                        tmp, [(p, v) for (p, _), v in zip(self.sends, views)]).Wait()
        if yb is not ybuf:
            t.release(yb)
        pieces = t.region_array(tmp, olocal)
        for (_, sl), a, b, shp in zip(self.sends, offsets, offsets[1:], shapes):
            olocal[sl] += reshape(pieces[a:b], shp)
        t.release(tmp)
        return out


def _shapes(pieces: list[Piece]) -> list[tuple[int, ...] | None]:
    """Shapes of the pieces; None for an empty one."""
    out = []
    for _, sl in pieces:
        shape = tuple(s.stop - s.start for s in sl)
        out.append(shape if math.prod(shape) else None)
    return out


def _counts(pieces: list[Piece], shapes: list, nprocs: int) -> tuple[list[int], list[int], int]:
    """Element counts and displacements per rank of the packed pieces; their total."""
    counts = [0] * nprocs
    for (peer, _), shape in zip(pieces, shapes):
        if shape is not None:
            counts[peer] = math.prod(shape)
    displs = list(itertools.accumulate([0] + counts[:-1]))
    return counts, displs, sum(counts)


def _run(block: tuple[int, ...], piece: tuple[slice, ...]) -> int:
    """Elements per contiguous run of ``piece`` (global slices) inside a C-ordered ``block``."""
    run = 1
    for n, s in zip(reversed(block), reversed(piece)):
        run *= s.stop - s.start
        if s.stop - s.start != n:
            break
    return run


def _shortest_run(src: Distribution, dst: Distribution) -> float:
    """Bytes per element times the shortest contiguous run of any rank's piece, on either side.

    Counted in elements of 4 bytes (the decision does not depend on the dtype's size
    enough to matter, and it must be taken before the dtype is known); inf without pieces.
    """
    shortest = math.inf
    for s in range(src.nprocs):
        for r in range(src.nprocs):
            inter = None if s == r else src.intersection(dst, s, r)
            if inter is None or not all(sl.stop > sl.start for sl in inter):
                continue
            n = min(_run(src.local_shape(s), inter), _run(dst.local_shape(r), inter))
            shortest = min(shortest, 4 * n)
    return shortest


def _blocks_overlapping(src: Distribution, box: tuple[slice, ...]):
    """Indices of the ``src`` blocks that intersect the global ``box``."""
    ranges = []
    for d, s in enumerate(box):
        if s.start >= s.stop:
            return
        b = src.boundaries[d]
        ranges.append([i for i in range(len(b) - 1) if b[i] < s.stop and b[i + 1] > s.start])
    yield from itertools.product(*ranges)


@lru_cache(maxsize=256)
def redistribution_plan(src: Distribution, dst: Distribution,
                        method: str = "auto") -> RedistributionPlan:
    """The cached :class:`RedistributionPlan` from ``src`` to ``dst``.

    ``method`` is ``"auto"`` (the plan's choice: see :class:`RedistributionPlan`),
    ``"pack"`` or ``"datatype"``; the same on every rank.
    """
    return RedistributionPlan(src, dst, method)


@collective
def redistribute(self: DistArray, dist: Distribution, out: DistArray | None = None) -> DistArray:
    """This array moved to another Distribution of the same global shape.

    Collective. The plan is computed from the two distributions alone and
    cached; the data moves in one collective. ``out`` (with ``dist`` and this
    dtype) receives the result when given.
    """
    _check_dist(dist)
    return redistribution_plan(self.dist, dist)(self, out)


DistArray.redistribute = redistribute  # type: ignore[attr-defined]
