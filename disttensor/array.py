"""DistArray: a Distribution plus this rank's block, stored with optional halo margins.

This module is the core of the array type: its storage and metadata. It
imports neither the NumPy-style operations nor the halo and redistribution
machinery; those modules import it and attach their methods to
:class:`DistArray` (``redistribute`` from :mod:`disttensor.redistribute`,
``exchange_halo`` from :mod:`disttensor.halo`, the operators and NumPy
protocols from :mod:`disttensor.ops`). Importing :mod:`disttensor` imports
them all.

The storage API, the seams that halo exchange, redistribution and layer
authors use: :attr:`DistArray.buffer` (the block with its halo margins),
:attr:`DistArray.margins`, :meth:`DistArray.reserve_halo` (grow the margins),
:meth:`DistArray.extended` (the block extended by given widths, a view) and
:attr:`DistArray.halo_token` with :meth:`DistArray.mark_halo_filled` (which
halo fill the margins hold).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI

from .backend import (
    _MOVABLE_DTYPE_TYPES,
    array_namespace,
    as_module,
    astype,
    check_movable,
    contiguous,
    device_of,
    empty,
    numpy_dtype,
    to_numpy,
)
from .device import resolve_array_module
from .distribution import Distribution
from .grid import ProcessGrid
from .settings import collective, validating

__all__ = ["DistArray"]

Margins = tuple[tuple[int, int], ...]


def _is_normalized(widths: Any, ndim: int) -> bool:
    return (type(widths) is tuple and len(widths) == ndim
            and all(type(w) is tuple and len(w) == 2 and type(w[0]) is int
                    and type(w[1]) is int and w[0] >= 0 and w[1] >= 0 for w in widths))


def normalize_widths(widths: Any, ndim: int) -> Margins:
    """Per-dimension ``(before, after)`` widths, as ``numpy.pad`` reads ``pad_width``.

    Parameters
    ----------
    widths : int, (int, int) or sequence of (int, int)
        The widths; a tuple of ``ndim`` pairs of non-negative Python ints is
        returned as it is, without further work.
    ndim : int
        Number of dimensions.

    Returns
    -------
    tuple of (int, int)
        One ``(before, after)`` pair per dimension.

    Raises
    ------
    ValueError
        For negative widths or a value that is not one of the forms above.
    """
    if _is_normalized(widths, ndim):
        return widths
    try:
        arr = np.asarray(widths)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError
        arr = np.broadcast_to(arr.astype(np.int64), (ndim, 2))
    except (TypeError, ValueError):
        raise ValueError(
            f"halo widths {widths!r} must be an int, a (before, after) pair, or one pair "
            f"per dimension of {ndim}"
        ) from None
    if (arr < 0).any():
        raise ValueError(f"halo widths must be non-negative, got {widths!r}")
    return tuple((int(a), int(b)) for a, b in arr)


class _NoMargins(dict):
    """Zero halo margins per number of dimensions, made once each."""

    def __missing__(self, ndim: int) -> tuple[tuple[int, int], ...]:
        self[ndim] = ((0, 0),) * ndim
        return self[ndim]


_NO_MARGINS = _NoMargins()


def _check_dist(dist: Distribution) -> None:
    if not isinstance(dist, Distribution):
        raise TypeError(f"expected a Distribution, got {type(dist).__name__}")
    if dist.grid is None:
        raise ValueError("a DistArray needs a Distribution built on a ProcessGrid, not a shape")


def check_root(root: Any, grid: ProcessGrid) -> int:
    """``root`` as a rank of ``grid``, or the same ValueError on every rank (non-ints too)."""
    if isinstance(root, (bool, np.bool_)) or not isinstance(root, (int, np.integer)):
        raise ValueError(f"root must be an int (a rank of {grid}), got {root!r}")
    if not 0 <= root < grid.size:
        raise ValueError(f"root must be a rank of {grid}, got {root!r}")
    return int(root)


def root_distribution(shape: tuple[int, ...], grid: ProcessGrid, root: int) -> Distribution:
    """A Distribution in which rank ``root`` holds the whole array and others nothing."""
    root = check_root(root, grid)
    if not shape:
        return Distribution(shape, grid, ())
    n, p = shape[0], grid.size
    cuts = [0] * root + [n] * (p - 1 - root)
    axes = (tuple(range(grid.ndim)),) + (None,) * (len(shape) - 1)
    return Distribution(shape, grid, axes, [cuts] + [None] * (len(shape) - 1))


def _as_array(array: Any, chosen: tuple[ModuleType, Any] | None) -> Any:
    """``array`` as an array of its own module, or of the chosen (module, device)."""
    if chosen is not None:
        return as_module(array, *chosen)
    if hasattr(array, "shape") and hasattr(array, "dtype"):
        return array
    return np.asarray(array)


def root_only_array(arguments: Mapping[str, Any]) -> tuple[str, ...]:
    """``from_global``'s arguments that may differ by rank: the array, when a root holds it.

    Without a root every rank passes the same array, so check mode compares it
    (its shape and dtype, and its values when it is small).
    """
    return ("array",) if arguments.get("root") is not None else ()


def _native(a: Any) -> Any:
    """``a`` in native byte order (MPI moves native data only)."""
    dt = getattr(a, "dtype", None)
    if isinstance(dt, np.dtype) and not dt.isnative:
        return a.astype(dt.newbyteorder("="))
    return a


class DistArray:
    """A global N-D array split into blocks over a process grid.

    Each rank stores its block of the global array (:attr:`local`) inside a
    buffer that may carry halo margins around it; :meth:`exchange_halo` fills
    those margins from neighbouring blocks. Replicas (ranks that hold the same
    block) are expected to hold identical values.

    Besides the methods defined here, :mod:`disttensor` gives every
    DistArray NumPy's operators and protocols (:class:`disttensor.ops.ArrayOperators`),
    :meth:`redistribute` and :meth:`exchange_halo`.

    Use the creation functions (:func:`disttensor.zeros`, :meth:`from_global`,
    :meth:`from_local`, ...) rather than the constructor.

    Parameters
    ----------
    buffer : array
        C-contiguous buffer of shape ``local_shape + lo + hi`` per dimension.
    dist : Distribution
        The distribution; its grid gives the communicator.
    margins : sequence of (int, int), optional
        Halo margin of the buffer before and after the block, per dimension.
    """

    __array_priority__ = 100

    def __init__(self, buffer: Any, dist: Distribution, margins: Margins | None = None):
        if type(dist) is not Distribution or dist.grid is None:
            _check_dist(dist)
        local_shape = dist.local_shape()
        if margins:
            margins = tuple((int(lo), int(hi)) for lo, hi in margins)
            want = tuple(n + lo + hi for n, (lo, hi) in zip(local_shape, margins))
        else:  # the common case, made each time a layer returns its output: no margins
            margins, want = _NO_MARGINS[dist.ndim], local_shape
        if tuple(buffer.shape) != want:
            raise ValueError(f"buffer shape {tuple(buffer.shape)} does not match {want}")
        if type(buffer) is np.ndarray:  # the common case: a NumPy block of a plain dtype
            if type(buffer.dtype) not in _MOVABLE_DTYPE_TYPES:
                check_movable(buffer.dtype)
            self.xp: ModuleType = np
        else:
            check_movable(buffer.dtype)
            self.xp = array_namespace(buffer)
        self._buffer = buffer
        self._margins = margins
        self.dist = dist
        self._halo_token: object | None = None  # identifies the last halo fill

    # ----------------------------------------------------------- creation
    @classmethod
    def empty(
        cls,
        dist: Distribution,
        dtype: Any = np.float64,
        *,
        xp: ModuleType | None = None,
        device: Any = None,
        margins: Margins | None = None,
    ) -> DistArray:
        """Uninitialised array with distribution ``dist``.

        Parameters
        ----------
        dist : Distribution
            The distribution.
        dtype : dtype
            Element type.
        xp : module, optional
            Array module of the local buffers (NumPy by default).
        device : {'cpu', 'gpu'} or device object, optional
            ``'gpu'``: CuPy on this rank's GPU (:func:`disttensor.use_device`),
            ``'cpu'``: NumPy; with an array API ``xp``, one of its devices.
        margins : sequence of (int, int), optional
            Halo margins of the buffer.
        """
        _check_dist(dist)
        xp, place = resolve_array_module(xp, device, dist.grid.comm)
        margins = margins or ((0, 0),) * dist.ndim
        shape = tuple(n + lo + hi for n, (lo, hi) in zip(dist.local_shape(), margins))
        dtype = check_movable(dtype).newbyteorder("=")
        return cls(empty(xp, shape, dtype, place), dist, margins)

    @classmethod
    def zeros(cls, dist: Distribution, dtype: Any = np.float64, *, xp: ModuleType | None = None,
              device: Any = None, margins: Margins | None = None) -> DistArray:
        """Array of zeros with distribution ``dist`` (keywords as :meth:`empty`)."""
        out = cls.empty(dist, dtype, xp=xp, device=device, margins=margins)
        out.buffer[...] = 0
        return out

    @classmethod
    def from_local(cls, local: Any, dist: Distribution) -> DistArray:
        """Wrap this rank's block ``local`` (copied into a contiguous buffer).

        ``local.shape`` must equal ``dist.local_shape()``; it is checked on this
        rank only (the call makes no communication). In check mode the call is
        collective: every rank compares ``dist`` and agrees on the verdict of
        its own block, so a block of a wrong shape on one rank raises on every
        rank (:mod:`disttensor.settings`).
        """
        with validating("DistArray.from_local", {"dist": dist}):
            _check_dist(dist)
            if tuple(local.shape) != dist.local_shape():
                raise ValueError(
                    f"local block has shape {tuple(local.shape)} but {dist} gives rank "
                    f"{dist.grid.rank} the shape {dist.local_shape()}"
                )
        return cls(_native(contiguous(local, copy=True)), dist)

    @classmethod
    @collective(ignore=root_only_array)
    def from_global(cls, array: Any, dist: Distribution, root: int | None = None, *,
                    xp: ModuleType | None = None, device: Any = None) -> DistArray:
        """Distribute a global array.

        Parameters
        ----------
        array : array_like
            The global array. Without ``root`` every rank passes the same array
            and keeps its block (no communication). With ``root`` only that
            rank's argument is read (others may pass None) and the blocks are
            scattered in one collective.
        dist : Distribution
            Target distribution; ``array.shape`` must equal its global shape.
        root : int, optional
            Rank that holds the data.
        xp, device : optional
            Array module and device of the result's blocks (see :meth:`empty`);
            by default those of ``array`` (with ``root``: of root's ``array``,
            broadcast with its shape).

        Raises
        ------
        ValueError
            On every rank (with ``root``, after a small broadcast of the shape
            and dtype) when the shape does not match ``dist``.
        TypeError
            On every rank alike for a dtype a DistArray cannot hold
            (:func:`disttensor.backend.check_movable`: object dtypes).
        """
        _check_dist(dist)
        chosen = None
        if xp is not None or device is not None:
            chosen = resolve_array_module(xp, device, dist.grid.comm)
        if root is None:
            array = _as_array(array, chosen)
            if tuple(array.shape) != dist.global_shape:
                raise ValueError(
                    f"array of shape {tuple(array.shape)} does not match {dist}"
                )
            return cls(_native(contiguous(array[dist.local_slices()], copy=True)), dist)
        grid = dist.grid
        root = check_root(root, grid)
        meta: Any = None
        if grid.rank == root:
            try:
                array = _native(_as_array(array, chosen))
                where = chosen or (array_namespace(array).__name__, device_of(array))
                # the dtype itself, not its .str: a record's str ('|V12') drops its fields
                dtype = check_movable(array.dtype)
                meta = (tuple(array.shape), dtype, where if chosen is None else None)
            except Exception as exc:  # sent on, so that every rank raises it, not root alone
                meta = exc
        meta = grid.comm.bcast(meta, root=root)
        if isinstance(meta, Exception):
            raise meta
        shape, dtype, where = meta
        if chosen is None:  # the root's array decides: its module by name, its device
            chosen = (importlib.import_module(where[0]), where[1])
        if shape != dist.global_shape:
            raise ValueError(f"array of shape {shape} on root {root} does not match {dist}")
        mod, place = chosen
        if dist.ndim == 0:  # every rank holds the one element: broadcast it
            value = grid.comm.bcast(to_numpy(array) if grid.rank == root else None, root=root)
            return cls(as_module(np.array(value), mod, place), dist)
        holder = root_distribution(shape, grid, root)
        if grid.rank == root:
            src = cls(contiguous(array, copy=True), holder)
        else:
            src = cls.empty(holder, np.dtype(dtype), xp=mod, device=place)
        return src.redistribute(dist)

    # ----------------------------------------------------------- properties
    @property
    def local(self) -> Any:
        """This rank's block, a view into the buffer (halo margins excluded)."""
        if self._margins is _NO_MARGINS[len(self._margins)] or \
                not any(lo or hi for lo, hi in self._margins):
            return self._buffer
        return self._buffer[
            tuple(slice(lo, lo + n) for (lo, _), n in zip(self._margins, self.local_shape))
        ]

    @property
    def buffer(self) -> Any:
        """The local buffer: this rank's block with its halo margins around it.

        Of shape ``local_shape[d] + margins[d][0] + margins[d][1]`` per
        dimension, C-contiguous; :attr:`local` is a view into it. The buffer is
        replaced (not grown in place) when :meth:`reserve_halo` needs wider
        margins.
        """
        return self._buffer

    @property
    def margins(self) -> Margins:
        """Halo margin (before, after) of the local buffer, per dimension."""
        return self._margins

    @property
    def shape(self) -> tuple[int, ...]:
        """Global shape."""
        return self.dist.global_shape

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's block."""
        return self.dist.local_shape()

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self.dist.ndim

    @property
    def size(self) -> int:
        """Number of elements of the global array."""
        return math.prod(self.shape)

    @property
    def dtype(self) -> np.dtype:
        """Element type (as a NumPy dtype, whatever the array module)."""
        dtype = self._buffer.dtype
        return dtype if isinstance(dtype, np.dtype) else numpy_dtype(dtype)

    @property
    def grid(self) -> ProcessGrid:
        """The process grid."""
        return self.dist.grid

    @property
    def comm(self) -> MPI.Intracomm:
        """The grid's communicator."""
        return self.dist.grid.comm

    # ----------------------------------------------------------- conversions
    @collective
    def to_global(self, root: int | None = None) -> Any:
        """Gather the global array.

        Without ``root`` every rank gets the whole array; with ``root`` only that
        rank does and the others get None. One collective either way.
        """
        if root is None:
            return self.redistribute(self.dist.replicated()).local
        target = root_distribution(self.shape, self.grid, root)
        out = self.redistribute(target).local
        return out if self.grid.rank == root else None

    def astype(self, dtype: Any, copy: bool = True) -> DistArray:
        """Copy with elements cast to ``dtype`` (same distribution)."""
        if not copy and numpy_dtype(dtype) == self.dtype:
            return self
        return DistArray(astype(self.local, dtype), self.dist)

    def copy(self) -> DistArray:
        """Deep copy (same distribution, margins dropped)."""
        return DistArray(contiguous(self.local, copy=True), self.dist)

    # ----------------------------------------------------------- storage
    def reserve_halo(self, widths: Any) -> None:
        """Grow the buffer's margins to at least ``widths`` (one copy, only if needed).

        After this, :meth:`exchange_halo` with these widths copies no interior
        data. Views of :attr:`local` taken before a growth no longer alias the
        array, and a growth resets :attr:`halo_token` to None.

        Parameters
        ----------
        widths : int, (int, int) or sequence of (int, int)
            As :func:`normalize_widths` reads them; already normalised widths
            (a tuple of ``ndim`` pairs of ints) cost no conversion.
        """
        widths = normalize_widths(widths, self.ndim)
        if all(a >= lo and b >= hi for (a, b), (lo, hi) in zip(self._margins, widths)):
            return
        grown = tuple((max(a, lo), max(b, hi)) for (a, b), (lo, hi) in zip(self._margins, widths))
        shape = tuple(n + lo + hi for n, (lo, hi) in zip(self.local_shape, grown))
        buffer = empty(self.xp, shape, self.dtype, device_of(self._buffer))
        buffer[tuple(slice(lo, lo + n) for (lo, _), n in zip(grown, self.local_shape))] = (
            self.local
        )
        self._buffer, self._margins = buffer, grown
        self._halo_token = None

    def extended(self, widths: Any) -> Any:
        """View of the buffer: this rank's block extended by ``widths`` into the margins.

        No communication, and no copy: the margin cells hold whatever the last
        halo fill (:meth:`exchange_halo`) wrote, or garbage before any; check
        :attr:`halo_token` to know whether they are still fresh.

        Parameters
        ----------
        widths : int, (int, int) or sequence of (int, int)
            As :func:`normalize_widths` reads them; each at most the margin.

        Returns
        -------
        array
            A view of shape ``local_shape[d] + widths[d][0] + widths[d][1]``.

        Raises
        ------
        ValueError
            If a width exceeds the buffer's margin (see :meth:`reserve_halo`).
        """
        widths = normalize_widths(widths, self.ndim)
        if not all(a >= lo and b >= hi for (a, b), (lo, hi) in zip(self._margins, widths)):
            raise ValueError(
                f"widths {widths} exceed the buffer's margins {self._margins}; "
                "call reserve_halo first"
            )
        return self._buffer[
            tuple(
                slice(m - lo, m + n + hi)
                for (m, _), (lo, hi), n in zip(self._margins, widths, self.local_shape)
            )
        ]

    @property
    def halo_token(self) -> object | None:
        """An object that identifies the last halo fill of the margins (None: no fill yet).

        Every completed halo exchange sets a new token (:meth:`mark_halo_filled`),
        and growing the margins resets it to None. A layer that keeps the
        token of the fill it used can tell later whether the margins still
        hold that fill (``x.halo_token is token``). Writes to :attr:`local`
        do not change it.
        """
        return self._halo_token

    def mark_halo_filled(self) -> object:
        """Record that the margins were just filled: set and return a new :attr:`halo_token`.

        Called by the halo exchange when it completes; a layer that fills
        the margins by other means calls it too.
        """
        self._halo_token = object()
        return self._halo_token

    # ----------------------------------------------------------- display
    def __repr__(self) -> str:
        # metadata only, so every rank prints the same; splits only where not the block rule
        splits = [None if c is None else list(c) for c in self.dist.splits]
        return (
            f"DistArray(shape={self.shape}, dtype={self.dtype}, grid={self.dist.grid_shape}, "
            f"axes={self.dist.axes}"
            + (f", splits={splits})" if any(s is not None for s in splits) else ")")
        )

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DistArray")
        return self.shape[0]
