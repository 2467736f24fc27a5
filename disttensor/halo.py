"""Halo exchange plans and their adjoint: fill, or sum back, the margins around each block.

For a DistArray ``x`` of global array ``a``, ``x.exchange_halo(widths, mode)``
returns this rank's block extended by ``widths``, holding exactly the values
``numpy.pad(a, widths, mode)`` has there. Dimensions are exchanged one after
another, each slab spanning the already-extended extent of the earlier
dimensions, so corners arrive without diagonal messages and every mode matches
``numpy.pad`` (which pads axis by axis too). Halos may be wider than a
neighbour's block: the plan then receives from ranks further away.

:func:`halo_accumulate` is the adjoint: it takes an extended block (a gradient
with respect to the extended input, say) and adds each halo cell into the
cell of the global array it was copied from.

Importing this module gives :class:`~disttensor.DistArray` its
:meth:`~disttensor.DistArray.exchange_halo` method. The plans work on the
array's storage API (:meth:`~disttensor.DistArray.reserve_halo`,
:meth:`~disttensor.DistArray.extended`,
:meth:`~disttensor.DistArray.mark_halo_filled`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from mpi4py import MPI

from .array import DistArray, normalize_widths
from .backend import (
    array_namespace,
    contiguous,
    copy_view,
    device_of,
    empty,
    empty_like_layout,
    fill_view,
    host_view,
    mpi_buffer,
    numpy_dtype,
)
from .distribution import Distribution
from .settings import collective
from .transport import transport_for_arrays

__all__ = ["MODES", "AccumulateRequest", "FacesAccumulation", "FacesRequest", "HaloPlan",
           "HaloRequest", "halo_plan", "halo_accumulate", "normalize_widths"]

MODES = ("constant", "wrap", "reflect", "symmetric", "edge")
_RUNS_PER_DIM = 64  # runs from one sender to one receiver along one dimension
_MAX_DIMS = 32
_TAG_SPAN = _RUNS_PER_DIM * _MAX_DIMS  # tags one exchange uses; exchanges in flight differ above
_BOUND_LAYOUTS = 8  # buffer layouts (shape, margins) whose slab indices a plan keeps
_CACHED_FILLS = 8  # fill values (Python scalars, per dtype) whose conversion a plan keeps

Widths = tuple[tuple[int, int], ...]


def source_index(t: int, n: int, mode: str) -> int | None:
    """Index of ``numpy.pad(a, ..., mode)[t]`` in ``a`` (length ``n``); None for 'constant'."""
    if 0 <= t < n:
        return t
    if mode == "constant":
        return None
    if mode == "wrap":
        return t % n
    if mode == "edge":
        return 0 if t < 0 else n - 1
    if mode == "reflect":
        if n == 1:
            return 0
        period = 2 * (n - 1)
        r = t % period
        return r if r < n else period - r
    if mode == "symmetric":
        r = t % (2 * n)
        return r if r < n else 2 * n - 1 - r
    raise ValueError(f"unknown halo mode {mode!r}; expected one of {MODES}")


@dataclass(frozen=True)
class Run:
    """A run of halo cells along one dimension that comes from one rank.

    Cells ``dst, dst+1, ..., dst+length-1`` of the receiver's extended block
    (positions along the dimension) hold the sender's extended-block positions
    ``src, src+step, ...``; ``step`` is +1 or -1 (reflections).
    """

    sender: int
    receiver: int
    dst: int
    src: int
    length: int
    step: int
    tag: int


@dataclass
class _BoundDim:
    """One dimension's slabs as indices into a buffer of one layout (see ``HaloPlan._bind``)."""

    dim: int
    recvs: list[tuple[tuple[slice, ...], int, int]]  # (index, peer, tag)
    sends: list[tuple[tuple[slice, ...], int, int]]
    local: list[tuple[tuple[slice, ...], tuple[slice, ...]]]  # (destination, source)
    fills: list[tuple[tuple[slice, ...], int]]  # (index, side)


@dataclass
class _BoundFaces:
    """A one-dimension plan's slabs for a block and its two faces (see ``HaloPlan._bind_faces``):
    buffer 1 is the face before the block, 2 the one after (the same buffer when they touch,
    for an empty block), the block itself for sends and local copies."""

    dim: int
    joint: bool
    shapes: tuple[tuple[int, ...], tuple[int, ...]]  # the faces' shapes
    recvs: list[tuple[int, tuple[slice, ...], int, int]]  # (face, index, peer, tag)
    sends: list[tuple[tuple[slice, ...], int, int]]  # (index into the block, peer, tag)
    local: list[tuple[int, tuple[slice, ...], tuple[slice, ...]]]  # (face, dst, src in block)
    fills: list[tuple[int, tuple[slice, ...], int]]  # (face, index, side)


@dataclass
class _BlockSteps:
    """A plan's slabs for one block shape, as :meth:`HaloPlan.exchange_block` and
    :meth:`HaloPlan.accumulate_block` run them on NumPy views of host memory.

    The exchange works on the new extended block (``dims``: every slab an index into
    it). The adjoint adds, per dimension in reverse, what comes back into ``targets``
    (indices into the array it accumulates into), sends the halo's slabs (``returns``:
    indices into the extended block, or into its working copy) and adds this rank's own
    cells (``local``: target, source). With one exchanged dimension it accumulates
    straight into a new block (``into_block``): the interior copied, the extended block
    only read; with several, into a copy of the extended block, whose interior is the
    result (corners pass through the slabs of the dimensions after theirs).
    """

    ext_shape: tuple[int, ...]
    interior: tuple[slice, ...]
    dims: list[_BoundDim]
    into_block: bool
    # per exchanged dimension, in the adjoint's order (the exchange's reversed)
    targets: list[list[tuple[tuple[slice, ...], tuple[int, ...], int, int]]]  # (index, cells,
    # peer, tag)
    returns: list[list[tuple[tuple[slice, ...], int, int]]]  # (index, peer, tag)
    local: list[list[tuple[tuple[slice, ...], tuple[slice, ...]]]]  # (target, halo cells)


@dataclass
class _DimPlan:
    dim: int
    sends: list[Run]
    recvs: list[Run]
    local: list[Run]  # sender == receiver == this rank
    fills: list[tuple[int, int, int]]  # (start, stop, side) positions of constant cells


class HaloPlan:
    """The messages that fill the halo of width ``widths`` for ``dist``, on this rank.

    Built from the Distribution alone (no communication) and cached by
    :func:`halo_plan`; run it with :meth:`start`/:meth:`HaloRequest.finish`
    (non-blocking) or :meth:`exchange`, and its adjoint with :meth:`accumulate`.
    Faces that are contiguous in memory (those of the outermost split
    dimension) are sent and received in place; other faces are packed once
    into pooled buffers, which measured faster here than MPI derived datatypes
    for the narrow strided faces of inner dimensions. Cells whose source lies
    on this rank are copied locally. Messages go through the transport of the
    array's module (:func:`disttensor.transport.transport_for`): GPU faces are
    packed by a copy kernel and sent from device memory, staged through
    page-locked host buffers, or sent with NCCL.
    """

    def __init__(self, dist: Distribution, widths: Widths, mode: str):
        if mode not in MODES:
            raise ValueError(f"unknown halo mode {mode!r}; expected one of {MODES}")
        if dist.grid is None:
            raise ValueError("halo exchange needs a Distribution built on a ProcessGrid")
        for d, ((lo, hi), n) in enumerate(zip(widths, dist.global_shape)):
            if (lo or hi) and n == 0 and mode != "constant":
                raise ValueError(
                    f"cannot pad the empty dimension {d} with mode {mode!r} (as numpy.pad)"
                )
        self.dist, self.widths, self.mode = dist, widths, mode
        me = dist.grid.rank
        self.dims = [
            self._plan_dim(d, me) for d, (lo, hi) in enumerate(widths) if lo or hi
        ]
        self._bound: dict[tuple, tuple] = {}  # by (buffer shape, margins)
        # fills of Python scalars (0, the default, above all), by (type, value, dtype)
        self._fills: dict[tuple, list[list[Any]]] = {}

    def _line(self, d: int, me: int) -> list[int]:
        """Ranks that share this rank's block in every dimension but ``d``, by block index."""
        dist = self.dist
        mine = list(dist.block_index(me))
        rep = [c for a, c in enumerate(dist.grid.coords_of(me)) if a in dist.replica_axes]
        out = []
        for b in range(dist.nblocks[d]):
            mine[d] = b
            ranks = dist.ranks_of_block(mine)
            out.append(ranks[_replica_position(dist, rep)])
        return out

    def _runs_into(self, d: int, b: int, line: list[int]) -> tuple[list[Run], list]:
        """Runs that fill the halo of block ``b`` of the line along ``d``; constant fills."""
        dist = self.dist
        bounds = dist.boundaries[d]
        n = dist.global_shape[d]
        lo, hi = self.widths[d]
        start, stop = bounds[b], bounds[b + 1]
        runs: list[list[int]] = []  # [sender_block, dst, src_global, length, step]
        fills = []
        positions = list(range(start - lo, start)) + list(range(stop, stop + hi))
        for t in positions:
            side = 0 if t < start else 1
            g = source_index(t, n, self.mode)
            dst = t - (start - lo)
            if g is None:
                if fills and fills[-1][1] == dst and fills[-1][2] == side:
                    fills[-1] = (fills[-1][0], dst + 1, side)
                else:
                    fills.append((dst, dst + 1, side))
                continue
            sb = dist.block_of(d, g)
            if runs and runs[-1][0] == sb and runs[-1][1] + runs[-1][3] == dst:
                r = runs[-1]
                if r[3] == 1 and abs(g - r[2]) == 1:
                    r[3], r[4] = 2, g - r[2]
                    continue
                if r[3] > 1 and g == r[2] + r[3] * r[4]:
                    r[3] += 1
                    continue
            runs.append([sb, dst, g, 1, 1])
        receiver = line[b]
        out, count = [], {}
        for sb, dst, g, length, step in runs:
            sender = line[sb]
            k = count.get(sender, 0)
            count[sender] = k + 1
            src = g - bounds[sb] + lo  # position in the sender's extended block
            # Beyond _RUNS_PER_DIM runs from one sender (halos much wider than the array)
            # tags repeat; messages with one tag between two ranks match in posting order,
            # and both ranks post these runs in this same order.
            tag = d * _RUNS_PER_DIM + k % _RUNS_PER_DIM
            out.append(Run(sender, receiver, dst, src, length, step, tag))
        return out, fills

    def _plan_dim(self, d: int, me: int) -> _DimPlan:
        line = self._line(d, me)
        my_b = line.index(me)
        sends, recvs, local = [], [], []
        for b in range(len(line)):
            runs, fills = self._runs_into(d, b, line)
            for r in runs:
                if r.sender == me and r.receiver == me:
                    local.append(r)
                elif r.sender == me:
                    sends.append(r)
                elif r.receiver == me:
                    recvs.append(r)
            if b == my_b:
                my_fills = fills
        return _DimPlan(d, sends, recvs, local, my_fills)

    # ------------------------------------------------------------- views
    def _index(self, shape: tuple[int, ...], margins: Widths, d: int, pos: int, length: int,
               step: int) -> tuple[slice, ...]:
        """Index, into a buffer of ``shape`` with ``margins``, of the slab at extended-block
        positions ``pos, pos+step, ...`` along ``d``.

        Dimensions before ``d`` span their extended extent, later ones only the
        owned block (their halo is not filled yet).
        """
        idx = []
        for e, ((lo, hi), (mlo, mhi)) in enumerate(zip(self.widths, margins)):
            if e < d:
                idx.append(slice(mlo - lo, shape[e] - mhi + hi))
            elif e == d:
                start = mlo - lo + pos
                stop = start + step * length
                idx.append(slice(start, stop if stop >= 0 else None, step))
            else:
                idx.append(slice(mlo, shape[e] - mhi))
        return tuple(idx)

    def _bind(self, shape: tuple[int, ...], margins: Widths
              ) -> tuple[list[_BoundDim], tuple[slice, ...]]:
        """Every slab of the plan as an index into a buffer of ``shape`` with ``margins``.

        Cached per layout, so that running the plan only slices, packs and posts.
        Slabs without cells are left out. Also returns the index of the
        extended block.
        """
        key = (shape, margins)
        bound = self._bound.get(key)
        if bound is not None:
            return bound
        size = math.prod

        def index(d: int, pos: int, length: int, step: int) -> tuple[slice, ...] | None:
            idx = self._index(shape, margins, d, pos, length, step)
            n = [len(range(*sl.indices(m))) for sl, m in zip(idx, shape)]
            return idx if size(n) else None

        bound = []
        for dp in self.dims:
            d = dp.dim
            recvs = [(i, r.sender, r.tag) for r in dp.recvs
                     if (i := index(d, r.dst, r.length, 1)) is not None]
            sends = [(i, r.receiver, r.tag) for r in dp.sends
                     if (i := index(d, r.src, r.length, r.step)) is not None]
            local = [(index(d, r.dst, r.length, 1), index(d, r.src, r.length, r.step))
                     for r in dp.local]
            local = [(a, b) for a, b in local if a is not None]
            fills = [(i, side) for start, stop, side in dp.fills
                     if (i := index(d, start, stop - start, 1)) is not None]
            bound.append(_BoundDim(d, recvs, sends, local, fills))
        ext = tuple(slice(mlo - lo, n - mhi + hi)
                    for n, (lo, hi), (mlo, mhi) in zip(shape, self.widths, margins)) + (...,)
        bound = (bound, ext)
        if len(self._bound) >= _BOUND_LAYOUTS:
            self._bound.pop(next(iter(self._bound)))
        self._bound[key] = bound
        return bound

    # ------------------------------------------------------------- forward
    @collective
    def start(self, x: DistArray, constant_values: Any = 0) -> HaloRequest:
        """Begin filling the halo of ``x`` (grown in place if its margins are too small).

        Returns a :class:`HaloRequest`; messages of the first dimension are in
        flight when this returns, so the caller can compute on the interior.
        """
        if x.dist != self.dist:
            raise ValueError(f"halo plan is for {self.dist}, got an array with {x.dist}")
        constants = self._constants(constant_values, x.dtype)
        if x.margins != self.widths:
            x.reserve_halo(self.widths)
        return HaloRequest(self, x, constants)

    def _constants(self, constant_values: Any, dtype: np.dtype) -> list[list[Any]]:
        """The fill values per dimension and side as Python scalars (those given as one
        Python scalar converted once per plan and dtype)."""
        kind = type(constant_values)
        key = (kind, constant_values, dtype) if kind in (int, float, bool) else None
        constants = None if key is None else self._fills.get(key)
        if constants is None:
            constants = _python_scalars(_constants(constant_values, dtype, len(self.widths)))
            if key is not None and len(self._fills) < _CACHED_FILLS:
                self._fills[key] = constants
        return constants

    def exchange(self, x: DistArray, constant_values: Any = 0) -> Any:
        """Fill the halo of ``x`` and return the extended block (blocking)."""
        return self.start(x, constant_values).finish()

    # ------------------------------------------------------------- faces
    def _bind_faces(self, shape: tuple[int, ...]) -> _BoundFaces:
        """The plan's slabs as (buffer, index) pairs for a block of ``shape`` and its two faces
        (one exchanged dimension; cached per block shape)."""
        if len(self.dims) != 1:
            raise ValueError(f"halo faces are for a plan that exchanges one dimension; this one "
                             f"exchanges {len(self.dims)}")
        key = ("faces", shape)
        bound = self._bound.get(key)
        if bound is not None:
            return bound
        dp = self.dims[0]
        d = dp.dim
        lo, hi = self.widths[d]
        n = shape[d]
        joint = n == 0  # the faces touch: one buffer holds both (a run may span them)
        hi_at = 0 if joint else lo + n

        def index(start: int, length: int, step: int) -> tuple[slice, ...]:
            stop = start + step * length
            return (slice(None),) * d + (slice(start, stop if stop >= 0 else None, step),)

        def face(pos: int, length: int) -> tuple[int, tuple[slice, ...]]:
            return (1, index(pos, length, 1)) if pos < lo else (2, index(pos - hi_at, length, 1))

        recvs = [(*face(r.dst, r.length), r.sender, r.tag) for r in dp.recvs if r.length]
        sends = [(index(r.src - lo, r.length, r.step), r.receiver, r.tag)
                 for r in dp.sends if r.length]
        local = [(*face(r.dst, r.length), index(r.src - lo, r.length, r.step))
                 for r in dp.local if r.length]
        fills = [(*face(start, stop - start), side) for start, stop, side in dp.fills]
        faces = [list(shape), list(shape)]
        faces[0][d], faces[1][d] = lo, hi
        bound = _BoundFaces(d, joint, (tuple(faces[0]), tuple(faces[1])), recvs, sends, local,
                            fills)
        if len(self._bound) >= _BOUND_LAYOUTS:
            self._bound.pop(next(iter(self._bound)))
        self._bound[key] = bound
        return bound

    def check_faces(self, block: Any, constant_values: Any = 0) -> None:
        """Raise ValueError unless the plan exchanges one dimension and ``block`` has this
        rank's block shape (local): :meth:`start_faces`'s validation, which check mode
        agrees on across the ranks before any of them raises."""
        if len(self.dims) != 1:
            raise ValueError(f"halo faces are for a plan that exchanges one dimension; this one "
                             f"exchanges {len(self.dims)}")
        if tuple(block.shape) != self.dist.local_shape():
            raise ValueError(f"halo faces: the block has shape {tuple(block.shape)}, expected "
                             f"{self.dist.local_shape()}")

    def check_face_gradients(self, before: Any, after: Any) -> None:
        """Raise ValueError unless ``before`` and ``after`` have the faces' shapes (local):
        :meth:`start_accumulate_faces`'s validation."""
        bound = self._bind_faces(self.dist.local_shape())
        for what, a, want in (("before", before, bound.shapes[0]),
                              ("after", after, bound.shapes[1])):
            if tuple(a.shape) != want:
                raise ValueError(f"halo faces: {what} has shape {tuple(a.shape)}, expected "
                                 f"{want}")

    @collective(ignore=("block",), check=check_faces)
    def start_faces(self, block: Any, constant_values: Any = 0) -> FacesRequest:
        """Begin receiving the halo of ``block`` as two separate arrays, its faces.

        For a plan that exchanges one dimension ``d``: the cells that
        :meth:`exchange` puts before and after the block along ``d``, in two
        arrays of the block's shape with ``d`` of the widths' length, and no
        copy of the block (messages are sent from its memory). A convolution
        can then run on the block as it is, zero-padded by its kernel, while
        the faces are in flight, and correct its edges from them.

        Parameters
        ----------
        block : array
            This rank's block (shape ``dist.local_shape()``).
        constant_values : scalar or pairs
            As for :meth:`exchange`.

        Returns
        -------
        FacesRequest
            Its ``finish()`` returns ``(before, after)``.

        Raises
        ------
        ValueError
            If the plan exchanges more or fewer than one dimension, or
            ``block`` has another shape than this rank's block (local).
        """
        self.check_faces(block)
        bound = self._bind_faces(tuple(block.shape))
        constants = self._constants(constant_values, np.dtype(numpy_dtype(block.dtype)))
        return FacesRequest(self, bound, block, constants)

    @collective(ignore=("before", "after"), check=check_face_gradients)
    def start_accumulate_faces(self, before: Any, after: Any) -> FacesAccumulation:
        """Adjoint of :meth:`start_faces`: send the faces' cells back to their sources.

        ``before`` and ``after`` are shaped as :meth:`start_faces` returns
        them (gradients of the faces, say). The request's ``finish(target)``
        adds into ``target`` (this rank's block, in place) every face cell,
        on any rank, that was copied from it; constant cells are dropped. The
        messages fly between the two calls, so that the block's own gradient
        can be computed meanwhile.

        Returns
        -------
        FacesAccumulation
        """
        self.check_face_gradients(before, after)
        return FacesAccumulation(self, self._bind_faces(self.dist.local_shape()), before, after)

    # ------------------------------------------------------------- adjoint
    def accumulate(self, extended: Any, overwrite_input: bool = False) -> DistArray:
        """Adjoint of :meth:`exchange`: sum halo cells back into their sources.

        ``extended`` has the shape of this rank's block plus the widths. Cells
        that hold constant padding are dropped; every other halo cell is added
        to the global cell it was copied from (on whichever rank owns it, with
        the mode's mapping at the global edges). Returns a DistArray with
        ``dist``.
        """
        return self.start_accumulate(extended, overwrite_input).finish()

    def check_extended(self, extended: Any, overwrite_input: bool = False) -> None:
        """Raise ValueError unless ``extended`` has this rank's extended block shape (local).

        The validation of :meth:`start_accumulate`, which check mode agrees
        on across the ranks before any of them raises (each rank checks its
        own block).
        """
        lshape = self.dist.local_shape()
        want = tuple(n + lo + hi for n, (lo, hi) in zip(lshape, self.widths))
        if tuple(extended.shape) != want:
            raise ValueError(f"extended block has shape {tuple(extended.shape)}, expected {want}")

    @collective(ignore=("extended",), check=check_extended)
    def start_accumulate(self, extended: Any, overwrite_input: bool = False
                         ) -> AccumulateRequest:
        """Non-blocking :meth:`accumulate`: returns a request whose ``finish()`` gives the result.

        Messages of the last exchanged dimension are in flight when this
        returns, so the caller can compute (a weight gradient, say) meanwhile.
        """
        self.check_extended(extended)
        # overwrite_input permits, not requires, working in place (a copy when not C-ordered)
        return AccumulateRequest(self, contiguous(extended, copy=not overwrite_input))

    # ------------------------------------------------------------- blocks
    def _block_steps(self, shape: tuple[int, ...]) -> _BlockSteps:
        """The slabs of :meth:`exchange_block` and :meth:`accumulate_block` for a block of
        ``shape`` (cached per shape)."""
        key = ("block", shape)
        steps = self._bound.get(key)
        if steps is not None:
            return steps
        widths = self.widths
        ext_shape = tuple(n + lo + hi for n, (lo, hi) in zip(shape, widths))
        bound, _ = self._bind(ext_shape, widths)
        interior = tuple(slice(lo, lo + n) for n, (lo, _) in zip(shape, widths))
        into_block = len(self.dims) == 1
        zero = ((0, 0),) * len(shape)

        def cells(idx: tuple[slice, ...], of: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(len(range(*sl.indices(n))) for sl, n in zip(idx, of))

        targets, returns, local = [], [], []
        for dp, bd in zip(reversed(self.dims), reversed(bound)):
            if into_block:  # the sources' cells in a block without margins
                d = dp.dim
                t, loc = [], []
                for r in dp.sends:
                    idx = self._index(shape, zero, d, r.src, r.length, r.step)
                    if math.prod(n := cells(idx, shape)):
                        t.append((idx, n, r.receiver, r.tag))
                for r in dp.local:
                    dst = self._index(ext_shape, widths, d, r.dst, r.length, 1)
                    if math.prod(cells(dst, ext_shape)):
                        loc.append((self._index(shape, zero, d, r.src, r.length, r.step), dst))
            else:
                t = [(i, cells(i, ext_shape), peer, k) for i, peer, k in bd.sends]
                loc = [(src, dst) for dst, src in bd.local]
            targets.append(t)
            returns.append(list(bd.recvs))
            local.append(loc)
        steps = _BlockSteps(ext_shape, interior, bound, into_block, targets, returns, local)
        if len(self._bound) >= _BOUND_LAYOUTS:
            self._bound.pop(next(iter(self._bound)))
        self._bound[key] = steps
        return steps

    def check_block(self, block: Any, constant_values: Any = 0) -> None:
        """Raise ValueError unless ``block`` has this rank's block shape (local):
        :meth:`exchange_block`'s validation."""
        if tuple(block.shape) != self.dist.local_shape():
            raise ValueError(f"halo exchange: the block has shape {tuple(block.shape)}, "
                             f"expected {self.dist.local_shape()}")

    @collective(ignore=("block",), check=check_block)
    def exchange_block(self, block: Any, constant_values: Any = 0) -> Any:
        """This rank's block grown by the halo, in a new array (blocking).

        The array-in, array-out form of :meth:`exchange`, for code that holds
        plain blocks rather than DistArrays (an autograd function, say): a
        new array of ``block``'s module, dtype and device, of
        the extended block's shape, holding ``block`` in its interior and the
        halo as :meth:`exchange` fills it (laid out as ``block`` where it is dense in
        another order of its axes: a channels-last block's halo-extended block is
        channels-last). Blocks in host memory (NumPy
        arrays, PyTorch's CPU tensors) are worked on as NumPy views, the
        slabs' indices made once per block shape: per call, one copy of the
        block, the messages, and a packing copy for each slab that is not
        contiguous. Others go through :meth:`exchange`.

        Parameters
        ----------
        block : array
            This rank's block (shape ``dist.local_shape()``).
        constant_values : scalar or pairs
            As for :meth:`exchange`.

        Returns
        -------
        array
            The extended block.

        Raises
        ------
        ValueError
            If ``block`` has another shape than this rank's block (local).
        """
        self.check_block(block)
        shape = tuple(block.shape)
        steps = self._block_steps(shape)
        src = host_view(block)
        if src is None:  # device memory: through a DistArray and its transport
            ext = empty(array_namespace(block), steps.ext_shape, block.dtype, device_of(block))
            x = DistArray(ext, self.dist, self.widths)
            copy_view(x.local, block)
            self.exchange(x, constant_values)
            return ext
        ext = empty_like_layout(block, steps.ext_shape)
        h = host_view(ext)
        copy_view(h[steps.interior], src)
        if not self.dims:
            return ext
        constants = self._constants(constant_values, h.dtype)
        grid = self.dist.grid
        comm, tag = grid.p2p_comm, grid.tag_block(_TAG_SPAN)
        for bd in steps.dims:
            reqs, pending = [], []
            for idx, peer, k in bd.recvs:
                view = h[idx]
                if view.flags.c_contiguous:
                    reqs.append(comm.Irecv(mpi_buffer(view), peer, tag + k))
                else:
                    msg = np.empty(view.shape, view.dtype)
                    reqs.append(comm.Irecv(mpi_buffer(msg), peer, tag + k))
                    pending.append((view, msg))
            for idx, peer, k in bd.sends:
                reqs.append(comm.Isend(mpi_buffer(_packed(h[idx])), peer, tag + k))
            for dst, s in bd.local:
                copy_view(h[dst], h[s])
            if bd.fills:
                values = constants[bd.dim]
                for idx, side in bd.fills:
                    fill_view(h[idx], values[side])
            MPI.Request.Waitall(reqs)
            for view, msg in pending:
                copy_view(view, msg)
        return ext

    @collective(ignore=("extended",), check=check_extended)
    def accumulate_block(self, extended: Any) -> Any:
        """Adjoint of :meth:`exchange_block`: this rank's block of the sums, in a new array.

        The array-in, array-out form of :meth:`accumulate`: a new
        C-contiguous array of this rank's block shape (``extended``'s
        module, dtype and device) holding the interior of ``extended`` plus
        every halo cell, on any rank, that :meth:`exchange_block` copied
        from this block (constant cells are dropped). ``extended`` is only
        read. Host memory is worked on as in :meth:`exchange_block`; with
        one exchanged dimension the sums go straight into the new block.

        Parameters
        ----------
        extended : array
            This rank's extended block (a gradient with respect to
            :meth:`exchange_block`'s result, say).

        Returns
        -------
        array
            The accumulated block.

        Raises
        ------
        ValueError
            If ``extended`` has another shape than this rank's extended block
            (local).
        """
        self.check_extended(extended)
        shape = self.dist.local_shape()
        steps = self._block_steps(shape)
        h = host_view(extended)
        if h is None:  # device memory: through the transport
            out = empty(array_namespace(extended), shape, extended.dtype, device_of(extended))
            copy_view(out, self.accumulate(extended).local)
            return out
        out = empty_like_layout(extended, shape)
        o = host_view(out)
        if not self.dims:
            copy_view(o, h[steps.interior])
            return out
        if steps.into_block:
            copy_view(o, h[steps.interior])
            work, into = h, o
        else:
            work = np.empty(h.shape, h.dtype)
            copy_view(work, h)
            into = work
        grid = self.dist.grid
        comm, tag = grid.p2p_comm, grid.tag_block(_TAG_SPAN)
        for targets, returns, local in zip(steps.targets, steps.returns, steps.local):
            reqs, pending = [], []
            for idx, cells, peer, k in targets:  # the exchange's senders get their cells back
                msg = np.empty(cells, h.dtype)
                reqs.append(comm.Irecv(mpi_buffer(msg), peer, tag + k))
                pending.append((idx, msg))
            for idx, peer, k in returns:  # the exchange's receivers send them back
                reqs.append(comm.Isend(mpi_buffer(_packed(work[idx])), peer, tag + k))
            for dst, s in local:
                cell = into[dst]
                cell += work[s]
            MPI.Request.Waitall(reqs)
            for idx, msg in pending:
                cell = into[idx]
                cell += msg
        if not steps.into_block:
            copy_view(o, work[steps.interior])
        return out


class _DimRequest:
    """Messages of one dimension in flight at a time; the next dimension is posted on completion.

    Subclasses set ``bound`` (the plan's slabs for their buffer), give the
    order of the dimensions (``_order``) and post and complete one
    dimension's messages (``_post_dim``, ``_complete_dim``).
    """

    bound: list[_BoundDim]

    def __init__(self, plan: HaloPlan, order: list[int]):
        self.plan = plan
        self._order = order
        grid = plan.dist.grid
        # the duplicate communicator is created (collectively) only by exchanges that post
        self._comm = grid.p2p_comm if order else None
        self._tag = grid.tag_block(_TAG_SPAN) if order else 0
        self._reqs: list[MPI.Request] = []
        self._step = 0
        self._post()

    def _post(self) -> None:
        if self._step < len(self._order):
            self._reqs = self._post_dim(self.bound[self._order[self._step]])
        else:
            self._reqs = []
            self._done()

    def _advance(self) -> None:
        self._complete_dim()
        self._step += 1
        self._post()

    def test(self) -> bool:
        """Progress without blocking; True once every dimension is done."""
        while self._step < len(self._order):
            if not MPI.Request.Testall(self._reqs):
                return False
            self._advance()
        return True

    def _wait(self) -> None:
        while self._step < len(self._order):
            if self._reqs:
                MPI.Request.Waitall(self._reqs)
            self._advance()

    def _post_dim(self, bd: _BoundDim) -> list[MPI.Request]:  # pragma: no cover - interface
        raise NotImplementedError

    def _complete_dim(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _done(self) -> None:
        """Called once every dimension has completed."""


class _Receiving(_DimRequest):
    """A request that receives into views: ``_incoming`` messages are delivered into their
    views, and ``_outgoing`` packed copies released, when a dimension completes."""

    _incoming: list[tuple[Any, Any]]  # (view, message buffer)
    _outgoing: list[Any]  # packed or staged copies being sent
    transport: Any

    def _complete_dim(self) -> None:
        t = self.transport
        for view, msg in self._incoming:
            t.deliver(view, msg)
        for msg in self._outgoing:
            t.release(msg)
        self._incoming, self._outgoing = [], []


class HaloRequest(_Receiving):
    """A halo exchange in flight; :meth:`finish` completes it and returns the extended block."""

    def __init__(self, plan: HaloPlan, x: DistArray, constants: list[list[Any]]):
        self.x = x
        self.constants = constants  # Python scalars, per dimension and side
        self._native = x.buffer
        # the buffer worked on: the array's own, or the NumPy view of its host memory
        self.transport, (self.buffer,) = transport_for_arrays(x.xp, x.buffer)
        self.bound, self._ext_index = plan._bind(tuple(self.buffer.shape), x.margins)
        self._incoming: list[tuple[Any, Any]] = []  # (face, message buffer)
        self._outgoing: list[Any] = []  # packed or staged copies being sent
        super().__init__(plan, list(range(len(plan.dims))))

    def _post_dim(self, bd: _BoundDim) -> list[MPI.Request]:
        buf, t, tag = self.buffer, self.transport, self._tag
        recvs, sends = [], []
        for idx, peer, k in bd.recvs:
            view = buf[idx]
            msg = t.incoming(view)
            recvs.append((msg, peer, tag + k))
            if msg is not view:
                self._incoming.append((view, msg))
        for idx, peer, k in bd.sends:
            view = buf[idx]
            msg = t.outgoing(view)
            sends.append((msg, peer, tag + k))
            if msg is not view:
                self._outgoing.append(msg)
        reqs = t.post(self._comm, recvs, sends) if recvs or sends or t.nccl else []
        for dst, src in bd.local:
            copy_view(buf[dst], buf[src])
        if bd.fills:
            values = self.constants[bd.dim]
            for idx, side in bd.fills:
                fill_view(buf[idx], values[side])
        return reqs

    def _done(self) -> None:
        self.x.mark_halo_filled()  # a new fill: layers compare tokens to detect overwrites

    @property
    def ext(self) -> Any:
        """The extended block being filled (a view into the array's buffer)."""
        return self._native[self._ext_index]

    def finish(self) -> Any:
        """Wait for every dimension's messages; return the extended block (a view)."""
        self._wait()
        return self._native[self._ext_index]


class AccumulateRequest(_DimRequest):
    """A halo accumulation in flight; :meth:`finish` completes it and returns the DistArray.

    Dimensions go in the reverse order of the exchange (the adjoint of a
    product is the reversed product of the adjoints).
    """

    def __init__(self, plan: HaloPlan, work: Any):
        self.work = work  # the result's storage; _work is what is worked on (a host view)
        self.transport, (self._work,) = transport_for_arrays(array_namespace(work), work)
        self.bound, _ = plan._bind(tuple(work.shape), plan.widths)
        self._pending: list[tuple[Any, Any]] = []  # (target cells, message buffer)
        self._outgoing: list[Any] = []
        super().__init__(plan, list(reversed(range(len(plan.dims)))))

    def _post_dim(self, bd: _BoundDim) -> list[MPI.Request]:
        work, t, tag = self._work, self.transport, self._tag
        recvs, sends = [], []
        for idx, peer, k in bd.sends:  # the forward's senders get their cells back
            target = work[idx]
            msg = t.receive_buffer(target)
            recvs.append((msg, peer, tag + k))
            self._pending.append((target, msg))
        for idx, peer, k in bd.recvs:  # the forward's receivers send their cells back
            view = work[idx]
            msg = t.outgoing(view)
            sends.append((msg, peer, tag + k))
            if msg is not view:
                self._outgoing.append(msg)
        reqs = t.post(self._comm, recvs, sends) if recvs or sends or t.nccl else []
        for dst, src in bd.local:
            work[src] += work[dst]
        return reqs

    def _complete_dim(self) -> None:
        t = self.transport
        for target, msg in self._pending:
            target += t.array(msg, target)
            t.release(msg)
        for msg in self._outgoing:
            t.release(msg)
        self._pending, self._outgoing = [], []

    def finish(self) -> DistArray:
        """Wait for the remaining messages; return the accumulated DistArray."""
        self._wait()
        # The work buffer becomes the result's storage, its halo cells as margins: no copy.
        return DistArray(self.work, self.plan.dist, self.plan.widths)



class FacesRequest(_Receiving):
    """A halo exchange into separate faces in flight (:meth:`HaloPlan.start_faces`);
    :meth:`finish` returns ``(before, after)``."""

    def __init__(self, plan: HaloPlan, bound: _BoundFaces, block: Any, constants: list):
        xp = array_namespace(block)
        shapes = bound.shapes
        if bound.joint:
            joint, *faces = _joint_faces(bound, xp, block)
            self.faces = tuple(faces)
            buffers = (block, joint, joint)
        else:
            self.faces = (_empty_like(xp, block, shapes[0]), _empty_like(xp, block, shapes[1]))
            buffers = (block, *self.faces)
        self.transport, self._face_arrays = transport_for_arrays(xp, *buffers)
        self._faces_bound = bound
        self.constants = constants
        self._incoming: list[tuple[Any, Any]] = []
        self._outgoing: list[Any] = []
        self.bound = [None]  # type: ignore[list-item]  # one dimension: posted whole
        super().__init__(plan, [0])

    def _post_dim(self, _: Any) -> list[MPI.Request]:
        bf, bufs, t, tag = self._faces_bound, self._face_arrays, self.transport, self._tag
        recvs, sends = [], []
        for which, idx, peer, k in bf.recvs:
            view = bufs[which][idx]
            msg = t.incoming(view)
            recvs.append((msg, peer, tag + k))
            if msg is not view:
                self._incoming.append((view, msg))
        for idx, peer, k in bf.sends:
            view = bufs[0][idx]
            msg = t.outgoing(view)
            sends.append((msg, peer, tag + k))
            if msg is not view:
                self._outgoing.append(msg)
        reqs = t.post(self._comm, recvs, sends) if recvs or sends or t.nccl else []
        for which, dst, src in bf.local:
            copy_view(bufs[which][dst], bufs[0][src])
        values = self.constants[bf.dim]
        for which, idx, side in bf.fills:
            fill_view(bufs[which][idx], values[side])
        return reqs

    def finish(self) -> tuple[Any, Any]:
        """Wait for the messages; return the faces ``(before, after)``."""
        self._wait()
        return self.faces


class FacesAccumulation(_DimRequest):
    """The adjoint of a faces exchange in flight (:meth:`HaloPlan.start_accumulate_faces`);
    :meth:`finish` adds what came back into a block."""

    def __init__(self, plan: HaloPlan, bound: _BoundFaces, before: Any, after: Any):
        xp = array_namespace(before)
        if bound.joint:  # one buffer, the faces side by side (a run may span both)
            joint, first, second = _joint_faces(bound, xp, before)
            copy_view(first, before)
            copy_view(second, after)
            buffers = (joint, joint)
        else:
            buffers = (before, after)
        self.transport, faces = transport_for_arrays(xp, *buffers)
        self._face_arrays = (None, *faces)
        self._faces_bound = bound
        self._pending: list[tuple[tuple[slice, ...], Any]] = []  # (target cells, message)
        self._outgoing: list[Any] = []
        self.bound = [None]  # type: ignore[list-item]
        super().__init__(plan, [0])

    def _post_dim(self, _: Any) -> list[MPI.Request]:
        bf, bufs, t, tag = self._faces_bound, self._face_arrays, self.transport, self._tag
        shape = self.plan.dist.local_shape()
        face = bufs[1]
        fxp = array_namespace(face)
        one = empty(fxp, (1,), face.dtype, device_of(face))  # shapes the message buffers
        recvs, sends = [], []
        for idx, peer, k in bf.sends:  # the forward's senders get their cells back
            cells = tuple(len(range(*sl.indices(n))) for sl, n in zip(idx, shape)) + \
                shape[len(idx):]
            msg = t.receive_buffer(fxp.broadcast_to(one, cells))
            recvs.append((msg, peer, tag + k))
            self._pending.append((idx, msg))
        for which, idx, peer, k in bf.recvs:  # the faces' cells go back to their sources
            view = bufs[which][idx]
            msg = t.outgoing(view)
            sends.append((msg, peer, tag + k))
            if msg is not view:
                self._outgoing.append(msg)
        return t.post(self._comm, recvs, sends) if recvs or sends or t.nccl else []

    def _complete_dim(self) -> None:
        for msg in self._outgoing:
            self.transport.release(msg)
        self._outgoing = []

    def finish(self, target: Any) -> Any:
        """Wait for the messages; add them into ``target`` (this rank's block, in place).

        Returns ``target``.
        """
        shape = self.plan.dist.local_shape()
        if tuple(target.shape) != shape:
            raise ValueError(f"halo faces: the target has shape {tuple(target.shape)}, "
                             f"expected {shape}")
        self._wait()
        t, bufs = self.transport, self._face_arrays
        _, (work,) = transport_for_arrays(array_namespace(target), target)
        for idx, msg in self._pending:
            cells = work[idx]
            cells += t.array(msg, cells)
            t.release(msg)
        self._pending = []
        for which, dst, src in self._faces_bound.local:
            cells = work[src]
            cells += bufs[which][dst]
        return target


def _packed(view: np.ndarray) -> np.ndarray:
    """``view`` as a message: itself when contiguous, else a packed copy."""
    if view.flags.c_contiguous:
        return view
    msg = np.empty(view.shape, view.dtype)
    copy_view(msg, view)
    return msg


def _joint_faces(bound: _BoundFaces, xp: Any, like: Any) -> tuple[Any, Any, Any]:
    """An empty block's faces in one new buffer, side by side: the buffer and the two views."""
    d = bound.dim
    lo = bound.shapes[0][d]
    joint = _empty_like(xp, like, tuple(a + b if e == d else a
                                        for e, (a, b) in enumerate(zip(*bound.shapes))))
    cut = (slice(None),) * d
    return joint, joint[cut + (slice(0, lo),)], joint[cut + (slice(lo, None),)]


def _empty_like(xp: Any, like: Any, shape: tuple[int, ...]) -> Any:
    """An uninitialised array of ``shape`` with ``like``'s dtype and device."""
    return empty(xp, shape, like.dtype, device_of(like))


def _constants(values: Any, dtype: np.dtype, ndim: int) -> np.ndarray:
    """The ``(ndim, 2)`` fill values of ``dtype``, converted exactly as :func:`numpy.pad` does.

    Values the dtype cannot hold (300 for int8, NaN for an integer dtype) raise
    the error ``numpy.pad`` raises, on every rank alike (the check is local).
    """
    if not ndim:
        return np.zeros((0, 2), dtype)
    if type(values) is int and values == 0 and dtype.kind in "biufc":  # the default: no work
        return np.zeros((ndim, 2), dtype)
    try:
        shape = np.broadcast_shapes(np.shape(values), (ndim, 2))
    except ValueError:
        shape = None
    if shape != (ndim, 2) and np.size(values) not in (1, 2):
        raise ValueError(
            f"constant_values {values!r} must be a scalar, a pair or one pair per dimension"
        )
    # numpy.pad on a one-element array: each padded cell beside the centre holds the
    # value of one (dimension, side), cast (or refused) by numpy.pad's own rules
    padded = np.pad(np.zeros((1,) * ndim, dtype), 1, "constant", constant_values=values)
    centre = [1] * ndim
    out = np.empty((ndim, 2), dtype)
    for d in range(ndim):
        for side in (0, 1):
            out[d, side] = padded[tuple(centre[:d] + [2 * side] + centre[d + 1:])]
    return out


def _python_scalars(constants: np.ndarray) -> list[list[Any]]:
    """The ``(ndim, 2)`` fill values as Python scalars (cheaper to assign than NumPy's)."""
    return [[c.item() for c in pair] for pair in constants]


def _replica_position(dist: Distribution, rep_coords: Sequence[int]) -> int:
    shape = [dist.grid_shape[a] for a in dist.replica_axes]
    k = 0
    for c, s in zip(rep_coords, shape):
        k = k * s + c
    return k


@lru_cache(maxsize=256)
def _cached_plan(dist: Distribution, widths: Widths, mode: str) -> HaloPlan:
    return HaloPlan(dist, widths, mode)


def halo_plan(dist: Distribution, widths: Any, mode: str = "constant") -> HaloPlan:
    """The cached :class:`HaloPlan` for ``dist``, ``widths`` and ``mode``.

    Parameters
    ----------
    dist : Distribution
        The distribution of the arrays the plan serves (on a ProcessGrid).
    widths : int, (int, int) or sequence of (int, int)
        As :func:`normalize_widths` reads them.
    mode : str
        One of :data:`MODES`.

    Returns
    -------
    HaloPlan
        Built once per ``(dist, widths, mode)``, without communication.

    Raises
    ------
    TypeError
        If ``dist`` is not a Distribution or ``mode`` not a string.
    ValueError
        For widths or a mode that :meth:`DistArray.exchange_halo` refuses.
    """
    if not isinstance(dist, Distribution):
        raise TypeError(f"halo_plan: dist must be a Distribution, got {type(dist).__name__}")
    if not isinstance(mode, str):
        raise TypeError(f"halo mode must be a string, one of {MODES}, got {mode!r}")
    return _cached_plan(dist, normalize_widths(widths, dist.ndim), mode)


def _check_accumulate(extended: Any, dist: Distribution, widths: Any, mode: str = "constant",
                      overwrite_input: bool = False) -> None:
    """:func:`halo_accumulate`'s validation of this rank's block (for check mode's agreement)."""
    halo_plan(dist, widths, mode).check_extended(extended)


@collective(ignore=("extended",), check=_check_accumulate)
def halo_accumulate(
    extended: Any,
    dist: Distribution,
    widths: Any,
    mode: str = "constant",
    overwrite_input: bool = False,
) -> DistArray:
    """Adjoint of the halo exchange: add each halo cell back into its owner.

    Parameters
    ----------
    extended : array
        This rank's block extended by ``widths`` (as returned by
        :meth:`DistArray.exchange_halo`, or a gradient of that shape).
    dist : Distribution
        Distribution of the array the halo was exchanged for.
    widths, mode
        As for :meth:`DistArray.exchange_halo`.
    overwrite_input : bool
        Allow the function to use ``extended`` as its work space; the result
        may then keep ``extended``'s memory as its storage.

    Returns
    -------
    DistArray
        With distribution ``dist``: the block plus every halo cell (on any
        rank) whose source is in it. ``<exchange(x), e> == <x, accumulate(e)>``
        for the inner products that sum over all ranks.
    """
    return halo_plan(dist, widths, mode).accumulate(extended, overwrite_input)


@collective
def exchange_halo(self: DistArray, widths: Any, mode: str = "constant",
                  constant_values: Any = 0, *, copy: bool = False) -> Any:
    """This rank's block extended by ``widths``, filled as :func:`numpy.pad` would.

    Collective over the grid. The result holds exactly the values that
    ``numpy.pad(global_array, widths, mode, constant_values=...)`` has at
    the positions of this block extended by ``widths``.

    Parameters
    ----------
    widths : int, (int, int) or sequence of (int, int)
        Halo width before and after the block per dimension, read like
        ``numpy.pad``'s ``pad_width``. Widths may exceed a neighbour's block,
        and the whole array, in every mode (as ``numpy.pad``).
    mode : {'constant', 'wrap', 'reflect', 'symmetric', 'edge'}
        Values beyond the global edges, with ``numpy.pad``'s meaning.
    constant_values : scalar or pairs
        Fill value(s) for ``mode='constant'``, as in ``numpy.pad``, and
        converted to the dtype as ``numpy.pad`` converts them: a value the
        dtype cannot hold raises ``numpy.pad``'s error (OverflowError for
        300 in int8, ValueError for NaN in an integer dtype) on every rank.
    copy : bool
        Return a copy instead of a view.

    Returns
    -------
    array
        By default a view into this array's storage (its halo margins, grown
        once if too small): it stays valid until the next exchange.

    See Also
    --------
    disttensor.halo.HaloPlan : the reusable plan, with a non-blocking form.
    disttensor.halo_accumulate : the adjoint.
    """
    plan = halo_plan(self.dist, widths, mode)
    ext = plan.exchange(self, constant_values)
    return contiguous(ext, copy=True) if copy else ext


DistArray.exchange_halo = exchange_halo  # type: ignore[attr-defined]
