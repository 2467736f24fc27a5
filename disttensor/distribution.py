"""Distributions: which rank owns which block of a global array (pure metadata, no MPI)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from functools import cached_property

from .grid import ProcessGrid, _normalize_shape, coords_of, rank_of

__all__ = ["Distribution", "block_boundaries"]

AxisSpec = int | Sequence[int] | None


def block_boundaries(n: int, p: int) -> tuple[int, ...]:
    """Boundaries of ``p`` blocks over ``n`` elements by ``numpy.array_split``'s rule.

    The first ``n % p`` blocks get one element more than the others. The result
    has ``p + 1`` entries, from 0 to ``n``; block ``i`` is ``[b[i], b[i+1])``.

    Raises
    ------
    TypeError
        If ``n`` or ``p`` is not an integer.
    ValueError
        If ``n`` is negative or ``p`` is below 1.
    """
    n, p = _as_int(n, "block_boundaries: n"), _as_int(p, "block_boundaries: p")
    if n < 0:
        raise ValueError(f"block_boundaries: n must be >= 0, got {n}")
    if p < 1:
        raise ValueError(f"block_boundaries: p (the number of blocks) must be >= 1, got {p}")
    q, r = divmod(n, p)
    return tuple(i * q + min(i, r) for i in range(p + 1))


_DERIVED_KEPT = 64
"""Distributions :meth:`Distribution.replace` keeps per source distribution."""


def _frozen(value: object) -> tuple | None:
    """``value`` (None, ints, and sequences of them, nested) as nested tuples of Python
    ints, a key for the distributions derived by :meth:`Distribution.replace`; None for
    anything else."""
    if value is None or type(value) is int:
        return value  # type: ignore[return-value]
    if isinstance(value, (tuple, list)):
        parts = []
        for v in value:
            f = _frozen(v)
            if f is None and v is not None:
                return None
            parts.append(f)
        return tuple(parts)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)  # type: ignore[return-value]
    return None


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool):  # True is an int to Python, never a size, index or axis here
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        return int(value.__index__())  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None


class Distribution:
    """How a global N-D array is split into blocks over a process grid.

    A Distribution is immutable, hashable and makes no MPI calls: every rank
    can ask it about every rank's block.

    Parameters
    ----------
    global_shape : sequence of int
        Shape of the global array.
    grid : ProcessGrid or sequence of int
        The process grid, or only its shape (for pure metadata work, e.g.
        planning or tests without MPI).
    axes : sequence, optional
        One entry per array dimension: the grid axis that splits it, ``None``
        (not split), or a tuple of grid axes (the dimension is split over their
        row-major product). A grid axis may split at most one dimension; grid
        axes that split no dimension hold replicas of the data. By default
        dimension ``i`` is split by grid axis ``i`` for every ``i`` below both
        ``len(global_shape)`` and ``grid.ndim``.
    splits : sequence, optional
        One entry per array dimension: ``None`` for the default block rule (that
        of ``numpy.array_split``: the first ``n % p`` blocks get one extra
        element), or the ``p - 1`` cut indices of the ``p`` blocks, as in
        ``numpy.array_split(a, indices)``. Cut indices must be non-decreasing
        and lie in ``[0, n]``, so uneven and empty blocks are allowed.

    Raises
    ------
    ValueError, TypeError
        For a shape, axis or split that does not describe a valid distribution.

    Examples
    --------
    >>> d = Distribution((10, 7), (2, 3))
    >>> d.local_slices(5)
    (slice(5, 10, None), slice(5, 7, None))
    >>> d.owner((9, 6))
    5
    >>> Distribution((10,), (2,), splits=[[0]]).local_shape(0)
    (0,)
    """

    __slots__ = (
        "global_shape", "grid", "grid_shape", "_axes", "boundaries", "__dict__",
    )

    def __init__(
        self,
        global_shape: Iterable[int],
        grid: ProcessGrid | Iterable[int] | int,
        axes: Sequence[AxisSpec] | None = None,
        splits: Sequence[Sequence[int] | None] | None = None,
    ):
        if isinstance(global_shape, numbers.Integral):  # a single int, NumPy ints included
            global_shape = (global_shape,)
        if not isinstance(global_shape, Iterable):
            raise TypeError(
                f"global_shape must be an int or a sequence of ints, got {global_shape!r}"
            )
        shape = tuple(_as_int(s, "a global shape entry") for s in global_shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"global shape entries must be >= 0, got {shape}")
        if isinstance(grid, ProcessGrid):
            gshape = grid.shape
        else:
            gshape = _normalize_shape(grid)
            grid = None
        ndim = len(shape)

        if axes is None:
            norm_axes = tuple((i,) if i < len(gshape) else () for i in range(ndim))
        else:
            if not isinstance(axes, Iterable):
                raise TypeError(f"axes must be a sequence with one entry per dimension, "
                                f"got {axes!r}")
            axes = tuple(axes)
            if len(axes) != ndim:
                raise ValueError(
                    f"axes has {len(axes)} entries but the array has {ndim} dimensions"
                )
            norm = []
            for a in axes:
                if a is None:
                    norm.append(())
                elif isinstance(a, Sequence):
                    norm.append(tuple(_as_int(x, "a grid axis") for x in a))
                else:
                    norm.append((_as_int(a, "a grid axis"),))
            norm_axes = tuple(norm)
        used = [a for entry in norm_axes for a in entry]
        for a in used:
            if not 0 <= a < len(gshape):
                raise ValueError(f"grid axis {a} does not exist in a grid of shape {gshape}")
        if len(set(used)) != len(used):
            raise ValueError(f"a grid axis may split at most one dimension, got axes={axes}")

        nblocks = tuple(math.prod(gshape[a] for a in entry) for entry in norm_axes)
        if splits is None:
            splits = (None,) * ndim
        if not isinstance(splits, Iterable):
            raise TypeError(f"splits must be a sequence with one entry per dimension, "
                            f"got {splits!r}")
        splits = tuple(splits)
        if len(splits) != ndim:
            raise ValueError(f"splits has {len(splits)} entries but the array has {ndim} dims")
        bounds = []
        for d, (n, p, cuts) in enumerate(zip(shape, nblocks, splits)):
            if cuts is None:
                bounds.append(block_boundaries(n, p))
                continue
            if not isinstance(cuts, Iterable):
                raise TypeError(f"splits[{d}] must be None or a sequence of cut indices, "
                                f"got {cuts!r}")
            cuts = tuple(_as_int(c, "a split index") for c in cuts)
            if len(cuts) != p - 1:
                raise ValueError(
                    f"dimension {d} is split into {p} blocks, so splits[{d}] needs "
                    f"{p - 1} cut indices, got {len(cuts)}"
                )
            b = (0, *cuts, n)
            if any(b[i] > b[i + 1] for i in range(p)):
                raise ValueError(
                    f"splits[{d}]={list(cuts)} must be non-decreasing and lie in [0, {n}]"
                )
            bounds.append(b)

        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "grid_shape", gshape)
        object.__setattr__(self, "_axes", norm_axes)
        object.__setattr__(self, "boundaries", tuple(bounds))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Distribution is immutable")

    # ------------------------------------------------------------------ basics
    @property
    def ndim(self) -> int:
        """Number of array dimensions."""
        return len(self.global_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """Alias of :attr:`global_shape`."""
        return self.global_shape

    @property
    def size(self) -> int:
        """Number of elements of the global array."""
        return math.prod(self.global_shape)

    @property
    def nprocs(self) -> int:
        """Number of processes in the grid."""
        return math.prod(self.grid_shape)

    @property
    def axes(self) -> tuple[int | tuple[int, ...] | None, ...]:
        """Per dimension: the splitting grid axis, a tuple of them, or None."""
        return tuple(
            None if not e else (e[0] if len(e) == 1 else e) for e in self._axes
        )

    @property
    def dim_axes(self) -> tuple[tuple[int, ...], ...]:
        """Per dimension: the tuple of grid axes that split it (empty if none)."""
        return self._axes

    @cached_property
    def nblocks(self) -> tuple[int, ...]:
        """Number of blocks along each dimension."""
        return tuple(len(b) - 1 for b in self.boundaries)

    @cached_property
    def replica_axes(self) -> tuple[int, ...]:
        """Grid axes that split no dimension: ranks along them hold copies."""
        used = {a for e in self._axes for a in e}
        return tuple(a for a in range(len(self.grid_shape)) if a not in used)

    @cached_property
    def split_dims(self) -> tuple[int, ...]:
        """Dimensions split into more than one block."""
        return tuple(d for d, p in enumerate(self.nblocks) if p > 1)

    @cached_property
    def nreplicas(self) -> int:
        """Number of copies of each element."""
        return math.prod(self.grid_shape[a] for a in self.replica_axes)

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            if self.grid is None:
                raise ValueError("this Distribution has no ProcessGrid: pass rank=")
            return self.grid.rank
        rank = _as_int(rank, "rank")
        if not 0 <= rank < self.nprocs:
            raise ValueError(f"rank {rank} is not in a grid of {self.nprocs} processes")
        return rank

    # ----------------------------------------------------------- block lookup
    def block_index(self, rank: int | None = None) -> tuple[int, ...]:
        """Index of ``rank``'s block along each dimension."""
        if rank is None and self.grid is not None:
            return self._own_index
        return self._index_of(self._rank(rank))

    def _index_of(self, rank: int) -> tuple[int, ...]:
        c = coords_of(rank, self.grid_shape)
        return tuple(
            rank_of([c[a] for a in e], [self.grid_shape[a] for a in e]) if e else 0
            for e in self._axes
        )

    @cached_property
    def _own_index(self) -> tuple[int, ...]:
        # asked for by every layer on every call: computed once per Distribution
        return self._index_of(self.grid.rank)

    def local_slices(self, rank: int | None = None) -> tuple[slice, ...]:
        """Global slices of ``rank``'s block (this process's rank by default)."""
        if rank is None and self.grid is not None:
            return self._own_slices
        return self._slices_of(self.block_index(rank))

    def _slices_of(self, index: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(b[i], b[i + 1]) for b, i in zip(self.boundaries, index))

    @cached_property
    def _own_slices(self) -> tuple[slice, ...]:
        return self._slices_of(self._own_index)

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """Shape of ``rank``'s block."""
        if rank is None and self.grid is not None:
            return self._own_shape
        bi = self.block_index(rank)
        return tuple(b[i + 1] - b[i] for b, i in zip(self.boundaries, bi))

    @cached_property
    def _own_shape(self) -> tuple[int, ...]:
        # asked for on every DistArray construction: computed once per Distribution
        bi = self.block_index(None)
        return tuple(b[i + 1] - b[i] for b, i in zip(self.boundaries, bi))

    def local_start(self, rank: int | None = None) -> tuple[int, ...]:
        """Global index of the first element of ``rank``'s block."""
        bi = self.block_index(rank)
        return tuple(b[i] for b, i in zip(self.boundaries, bi))

    def block_of(self, dim: int, index: int) -> int:
        """Index of the block of dimension ``dim`` that holds global ``index``."""
        b = self.boundaries[dim]
        n = b[-1]
        if not 0 <= index < n:
            raise IndexError(f"index {index} is out of bounds for dimension {dim} of size {n}")
        lo, hi = 0, len(b) - 2
        while lo < hi:  # the last block with b[i] <= index (skips empty blocks)
            mid = (lo + hi + 1) // 2
            if b[mid] <= index:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def ranks_of_block(self, block: Sequence[int]) -> tuple[int, ...]:
        """All ranks (replicas included) that hold the block with these indices, sorted."""
        base = [0] * len(self.grid_shape)
        for e, i in zip(self._axes, block):
            for a, c in zip(e, coords_of(i, [self.grid_shape[a] for a in e])):
                base[a] = c
        rep = self.replica_axes
        ranks = []
        for k in range(math.prod(self.grid_shape[a] for a in rep)):
            c = list(base)
            for a, ca in zip(rep, coords_of(k, [self.grid_shape[a] for a in rep])):
                c[a] = ca
            ranks.append(rank_of(c, self.grid_shape))
        return tuple(sorted(ranks))

    def owners(self, index: Sequence[int]) -> tuple[int, ...]:
        """All ranks that hold global ``index`` (several when axes hold replicas)."""
        index = tuple(_as_int(i, "an index") for i in index)
        if len(index) != self.ndim:
            raise IndexError(f"index {index} does not have {self.ndim} entries")
        index = tuple(i + n if i < 0 else i for i, n in zip(index, self.global_shape))
        return self.ranks_of_block([self.block_of(d, i) for d, i in enumerate(index)])

    def owner(self, index: Sequence[int]) -> int:
        """The lowest rank that holds global ``index``."""
        return self.owners(index)[0]

    def intersection(
        self, other: Distribution, rank: int, other_rank: int
    ) -> tuple[slice, ...] | None:
        """Global slices of the overlap of ``rank``'s block here and ``other_rank``'s there.

        Returns None when the overlap is empty. Both distributions must have the
        same global shape.
        """
        if other.global_shape != self.global_shape:
            raise ValueError(
                f"global shapes differ: {self.global_shape} vs {other.global_shape}"
            )
        out = []
        for a, b in zip(self.local_slices(rank), other.local_slices(other_rank)):
            lo, hi = max(a.start, b.start), min(a.stop, b.stop)
            if lo >= hi:
                return None
            out.append(slice(lo, hi))
        return tuple(out)

    # ----------------------------------------------------------- derivation
    @cached_property
    def splits(self) -> tuple[tuple[int, ...] | None, ...]:
        """Per dimension: the cut indices of its blocks, or None where the block rule holds.

        In the form the constructor's ``splits=`` takes, so
        ``Distribution(d.global_shape, d.grid, d.axes, d.splits) == d``. A
        dimension whose boundaries are those of :func:`block_boundaries` (an
        unsplit one included) reads None.
        """
        return tuple(
            None if b == block_boundaries(b[-1], len(b) - 1) else tuple(b[1:-1])
            for b in self.boundaries
        )

    def replace(
        self,
        *,
        global_shape: Iterable[int] | None = None,
        splits: Sequence[Sequence[int] | None] | None = None,
        axes: Sequence[AxisSpec] | None = None,
    ) -> Distribution:
        """A Distribution on the same grid (or grid shape) with some fields changed.

        Validated like the constructor. Pure: no communication. The same
        arguments give the same object again (a Distribution is immutable, and
        keeps up to 64 it derived), so code that derives one per call, as a
        layer's output distribution at every step, does not build it again.

        Parameters
        ----------
        global_shape : sequence of int, optional
            The new global shape; by default this one.
        splits : sequence, optional
            The new cut indices, as the constructor takes them (None entries:
            the block rule). By default this Distribution's :attr:`splits` when
            neither ``global_shape`` nor ``axes`` is given, else the block rule
            in every dimension.
        axes : sequence, optional
            The new grid axes per dimension, as the constructor takes them; by
            default these :attr:`axes` (which needs an unchanged number of
            dimensions).

        Returns
        -------
        Distribution

        Raises
        ------
        ValueError, TypeError
            As the constructor, for a result that is not a valid distribution.

        Examples
        --------
        >>> d = Distribution((10, 7), (2, 3))
        >>> d.replace(splits=[[3], [1, 1]]).local_shape(0)
        (3, 1)
        >>> d.replace(global_shape=(4, 5)).local_shape(5)
        (2, 1)
        """
        if splits is None and global_shape is None and axes is None:
            splits = self.splits
        # a Distribution is immutable: the ones derived from it are kept with it, by their
        # arguments (a layer derives the same output distribution at every step)
        key = _frozen((global_shape, splits, axes))
        derived = self.__dict__.setdefault("_derived", {}) if key is not None else None
        if derived is not None and key in derived:
            return derived[key]
        shape = self.global_shape if global_shape is None else global_shape
        out = Distribution(shape, self.grid_arg, self.axes if axes is None else axes, splits)
        if derived is not None:
            if len(derived) >= _DERIVED_KEPT:
                derived.clear()
            derived[key] = out
        return out

    def with_axes(
        self, axes: Sequence[AxisSpec], splits: Sequence[Sequence[int] | None] | None = None
    ) -> Distribution:
        """The same global shape and grid, split by other ``axes``."""
        return Distribution(self.global_shape, self.grid_arg, axes, splits)

    def replicated(self) -> Distribution:
        """Every rank holds the whole array."""
        return self.with_axes((None,) * self.ndim)

    @property
    def grid_arg(self) -> ProcessGrid | tuple[int, ...]:
        """The grid as the constructor took it: the ProcessGrid, or the grid shape without one."""
        return self.grid if self.grid is not None else self.grid_shape

    @cached_property
    def _key(self) -> tuple:
        return (self.global_shape, self.grid_shape, self._axes, self.boundaries)

    def __eq__(self, other: object) -> bool:
        if self is other:  # the common case: a layer's output compared with its gradient's
            return True
        if not isinstance(other, Distribution):
            return NotImplemented
        if self._key != other._key:
            return False
        if self.grid is None or other.grid is None:
            return self.grid is other.grid
        return self.grid == other.grid

    @cached_property
    def _hash(self) -> int:
        return hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        splits = [None if c is None else list(c) for c in self.splits]
        s = f"Distribution(shape={self.global_shape}, grid={self.grid_shape}, axes={self.axes}"
        if any(x is not None for x in splits):
            s += f", splits={splits}"
        return s + ")"
