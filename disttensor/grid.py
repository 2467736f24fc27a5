"""Process grids: a Cartesian arrangement of the ranks of a communicator."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Sequence

from mpi4py import MPI

from .settings import collective, validating

__all__ = ["ProcessGrid", "coords_of", "factorizations", "rank_of"]


def coords_of(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Grid coordinates of ``rank`` in a row-major grid of ``shape`` (pure)."""
    coords = []
    for extent in reversed(shape):
        coords.append(rank % extent)
        rank //= extent
    return tuple(reversed(coords))


def rank_of(coords: Sequence[int], shape: Sequence[int]) -> int:
    """Rank at ``coords`` in a row-major grid of ``shape`` (pure)."""
    rank = 0
    for c, extent in zip(coords, shape):
        rank = rank * extent + c
    return rank


def factorizations(p: int, k: int) -> list[tuple[int, ...]]:
    """All ordered ``k``-tuples of positive integers whose product is ``p`` (pure).

    The candidate grid shapes of ``p`` processes with ``k`` axes, in
    lexicographic order.

    Parameters
    ----------
    p : int
        The product, at least 1.
    k : int
        The tuple length, at least 1.

    Returns
    -------
    list of tuple of int

    Raises
    ------
    ValueError
        If ``p`` or ``k`` is below 1.

    Examples
    --------
    >>> factorizations(4, 2)
    [(1, 4), (2, 2), (4, 1)]
    """
    p, k = operator.index(p), operator.index(k)
    if p < 1 or k < 1:
        raise ValueError(f"factorizations needs p >= 1 and k >= 1, got p={p}, k={k}")
    if k == 1:
        return [(p,)]
    return [(f, *rest) for f in range(1, p + 1) if p % f == 0
            for rest in factorizations(p // f, k - 1)]


def _grid_axis(axis: object, ndim: int, what: str) -> int:
    """``axis`` as a grid axis in ``[0, ndim)`` (negative counts from the end, as NumPy)."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {axis!r}")
    a = int(axis)
    if not -ndim <= a < ndim:
        raise ValueError(f"{what} {a} is out of range for a grid of {ndim} axes")
    return a % ndim


def _check_comm(comm: object) -> MPI.Intracomm:
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {type(comm).__name__}")
    return comm


def _normalize_shape(shape: int | Iterable[int]) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral):  # a single int, NumPy integers included
        shape = (shape,)
    try:
        # operator.index, not int: 2.5 or "2" must not pass for a grid extent
        shape = tuple(operator.index(s) for s in shape)
    except TypeError as exc:
        raise TypeError(f"grid shape must be a sequence of ints, got {shape!r}") from exc
    if len(shape) == 0:
        raise ValueError("grid shape must have at least one axis")
    if any(s < 1 for s in shape):
        raise ValueError(f"grid shape entries must be >= 1, got {shape}")
    return shape


class ProcessGrid:
    """A Cartesian grid of the ranks of a communicator.

    Ranks are laid out in row-major (C) order: the rank of a process in the
    grid equals its rank in ``comm``, and its coordinates are
    ``numpy.unravel_index(rank, shape)``.

    Parameters
    ----------
    shape : int or sequence of int
        Number of processes along each grid axis. Its product must equal the
        size of ``comm``.
    comm : mpi4py.MPI.Intracomm, optional
        The communicator to arrange; ``MPI.COMM_WORLD`` by default.

    Raises
    ------
    ValueError
        On every rank, before any communication, if the product of ``shape``
        differs from the communicator size. In check mode (where creating a
        grid is collective over ``comm``) also when the shape differs between
        ranks, or is valid on some ranks only: then every rank raises alike.
    TypeError
        If ``comm`` is not an intracommunicator or ``shape`` holds non-integers.

    Examples
    --------
    >>> grid = ProcessGrid((2, 2))          # doctest: +SKIP
    >>> grid.coords, grid.neighbor(0, +1)   # doctest: +SKIP
    """

    def __init__(self, shape: int | Iterable[int], comm: MPI.Intracomm | None = None):
        arguments = {"shape": shape, "comm": MPI.COMM_WORLD if comm is None else comm}
        # check mode: a shape valid on some ranks only raises on every rank, not on those alone
        with validating("ProcessGrid", arguments,
                        comm if isinstance(comm, MPI.Intracomm) else MPI.COMM_WORLD):
            self.shape = arguments["shape"] = _normalize_shape(shape)
            self.comm = _check_comm(comm)
            if math.prod(self.shape) != self.comm.Get_size():
                raise ValueError(
                    f"process grid {self.shape} has {math.prod(self.shape)} processes but "
                    f"the communicator has {self.comm.Get_size()}"
                )
        self.rank = self.comm.Get_rank()
        self.coords = coords_of(self.rank, self.shape)
        self._subcomms: dict[tuple[int, ...], MPI.Intracomm] = {}
        self._p2p: MPI.Intracomm | None = None
        self._tag_seq = -1

    @classmethod
    def create(cls, ndim: int = 1, comm: MPI.Intracomm | None = None) -> ProcessGrid:
        """A balanced ``ndim``-axis grid over ``comm`` (``MPI.Compute_dims``).

        Raises
        ------
        TypeError, ValueError
            If ``ndim`` is not an int of at least 1, or ``comm`` is not an
            intracommunicator.
        """
        comm = _check_comm(comm)
        if isinstance(ndim, bool) or not isinstance(ndim, numbers.Integral):
            raise TypeError(f"ProcessGrid.create: ndim must be an int, got {ndim!r}")
        if ndim < 1:
            raise ValueError(f"ProcessGrid.create: ndim must be >= 1, got {ndim}")
        return cls(MPI.Compute_dims(comm.Get_size(), ndim), comm)

    @property
    def p2p_comm(self) -> MPI.Intracomm:
        """A duplicate of ``comm`` reserved for the library's point-to-point messages.

        Created (collectively) on first use, so that halo traffic never matches
        a user's own messages on ``comm``.
        """
        if self._p2p is None:
            self._p2p = self.comm.Dup()
        return self._p2p

    def tag_block(self, span: int) -> int:
        """First tag of a fresh block of ``span`` tags on :attr:`p2p_comm`.

        Every rank must call this in the same order (it counts calls), so
        operations started in the same order get the same tags everywhere and
        several of them can be in flight without their messages matching each
        other's receives.
        """
        if isinstance(span, bool) or not isinstance(span, numbers.Integral) or span < 1:
            raise ValueError(f"tag_block: span must be an int >= 1, got {span!r}")
        slots = max(1, self.p2p_comm.Get_attr(MPI.TAG_UB) // span)
        self._tag_seq = (self._tag_seq + 1) % slots
        return self._tag_seq * span

    @property
    def ndim(self) -> int:
        """Number of grid axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of processes in the grid."""
        return math.prod(self.shape)

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank``."""
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise TypeError(f"coords_of: rank must be an int, got {rank!r}")
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a grid of {self.size} processes")
        return coords_of(rank, self.shape)

    def rank_of(self, coords: Sequence[int]) -> int:
        """Rank at ``coords``; each coordinate must lie inside the grid."""
        if not isinstance(coords, Sequence) or any(
                isinstance(c, bool) or not isinstance(c, numbers.Integral) for c in coords):
            raise TypeError(f"rank_of: coordinates must be a sequence of ints, got {coords!r}")
        if len(coords) != self.ndim or any(
            not 0 <= c < s for c, s in zip(coords, self.shape)
        ):
            raise ValueError(f"coordinates {tuple(coords)} are outside grid {self.shape}")
        return rank_of(coords, self.shape)

    def neighbor(self, axis: int, offset: int, periodic: bool = False) -> int | None:
        """Rank ``offset`` steps away along ``axis``; None off the edge unless ``periodic``.

        Raises
        ------
        TypeError, ValueError
            If ``axis`` is not a grid axis or ``offset`` is not an int.
        """
        axis = _grid_axis(axis, self.ndim, "neighbor: axis")
        if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
            raise TypeError(f"neighbor: offset must be an int, got {offset!r}")
        c = list(self.coords)
        c[axis] += int(offset)
        if periodic:
            c[axis] %= self.shape[axis]
        elif not 0 <= c[axis] < self.shape[axis]:
            return None
        return rank_of(c, self.shape)

    @collective
    def subcomm(self, axes: int | Iterable[int]) -> MPI.Intracomm:
        """Communicator of the ranks that differ only along ``axes``.

        This is collective over the grid the first time a given set of axes is
        requested; the communicator is cached afterwards. With ``axes=()`` each
        rank gets a communicator of its own (``MPI.COMM_SELF``).

        Raises
        ------
        TypeError, ValueError
            If an entry of ``axes`` is not an int in ``[-ndim, ndim)``.
        """
        if isinstance(axes, numbers.Integral):
            axes = (axes,)
        if not isinstance(axes, Iterable):
            raise TypeError(f"subcomm: axes must be an int or a sequence of ints, got {axes!r}")
        key = tuple(sorted({_grid_axis(a, self.ndim, "subcomm: axis") for a in axes}))
        if key not in self._subcomms:
            if not key:
                self._subcomms[key] = MPI.COMM_SELF
            else:
                color = rank_of(
                    [0 if a in key else c for a, c in enumerate(self.coords)], self.shape
                )
                self._subcomms[key] = self.comm.Split(color, self.rank)
        return self._subcomms[key]

    def same_processes(self, other: ProcessGrid | MPI.Comm) -> bool:
        """Whether ``other`` spans the same processes, in the same rank order (any shape).

        True when the two communicators are identical or congruent (a
        ``Dup`` of this one, say): data can then move between arrays on the
        two grids. Local: no communication.

        Parameters
        ----------
        other : ProcessGrid or mpi4py.MPI.Comm
            The grid, or a communicator, to compare with.

        Raises
        ------
        TypeError
            If ``other`` is neither.
        """
        if isinstance(other, ProcessGrid):
            if self is other:
                return True
            other = other.comm
        elif not isinstance(other, MPI.Comm):
            raise TypeError(f"expected a ProcessGrid or an MPI communicator, got "
                            f"{type(other).__name__}")
        return (self.comm.Get_size() == other.Get_size()
                and MPI.Comm.Compare(self.comm, other) in (MPI.IDENT, MPI.CONGRUENT))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessGrid):
            return NotImplemented
        return self is other or (self.shape == other.shape and self.same_processes(other))

    def __hash__(self) -> int:
        return hash(self.shape)

    def __repr__(self) -> str:
        return f"ProcessGrid(shape={self.shape}, size={self.size})"
