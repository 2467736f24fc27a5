"""How arrays lie on process grids and in memory: a layer's :class:`Layout` (grid axes for
arrays of any shape), full arrays to and from a rank's block under a Distribution
(:func:`full_array`, :func:`local_block`), and a block's memory format
(:func:`to_memory_format`: C order or channels-last)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.backend import (
    contiguous,
    device_of,
    empty_in_order,
    is_c_contiguous,
    is_channels_last,
)

__all__ = ["Layout", "full_array", "local_block", "memory_format_of",
           "to_memory_format"]

MEMORY_FORMATS = ("contiguous", "channels_last")
"""How a layer's ``(N, C, *S)`` blocks may lie in memory: C order, or channels-last
(``(N, *S, C)`` in memory, PyTorch's ``channels_last`` and ``channels_last_3d``)."""


def memory_format_of(x: DistArray) -> str:
    """``"channels_last"`` where this rank's block of ``x`` lies channels-last
    (:func:`~disttensor.backend.is_channels_last`), else ``"contiguous"``."""
    return "channels_last" if is_channels_last(x.local) else "contiguous"


def to_memory_format(x: DistArray, memory_format: str) -> DistArray:
    """``x`` with its block in ``memory_format`` (:data:`MEMORY_FORMATS`): ``x`` itself where
    it is already, else a copy (no communication; margins dropped).

    A network whose layers run on channels-last blocks (the torch kernels' convolutions,
    pooling, batch norms, element-wise layers and residual sums, which keep the layout
    from layer to layer: :meth:`~disttensor_nn.Layer.takes_channels_last`) gets its input
    so once a step; the layers that do not take such blocks get C-contiguous copies (and
    give their results back on channels-last blocks).

    Raises
    ------
    ValueError
        For another format, or ``"channels_last"`` for an array of fewer than 4 or more
        than 5 dimensions.
    """
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"memory_format must be one of {MEMORY_FORMATS}, got "
                         f"{memory_format!r}")
    local = x.local
    if memory_format == "contiguous":
        return x if is_c_contiguous(local) else DistArray(contiguous(local), x.dist)
    if x.ndim not in (4, 5):
        raise ValueError(f"channels_last needs an (N, C, H, W) or (N, C, D, H, W) array, "
                         f"got {x.ndim} dimensions")
    if is_channels_last(local) or is_c_contiguous(local) and (
            local.shape[1] == 1 or math.prod(local.shape[2:]) == 1):
        return x  # (one channel or one pixel: the two orders lie alike)
    out = empty_in_order(x.xp, tuple(local.shape), local.dtype, (0, *range(2, x.ndim), 1),
                         device_of(local))
    out[...] = local
    return DistArray(out, x.dist)


def full_array(local: Any, dist: Distribution | None) -> Any:
    """The full array whose block ``local`` is under ``dist`` (``local`` itself for None).

    Collective over ``dist``'s grid (an allgather by redistribution).
    """
    if dist is None:
        return local
    return DistArray.from_local(local, dist).redistribute(dist.replicated()).local


def local_block(full: Any, dist: Distribution | None) -> Any:
    """A contiguous copy of this rank's block of ``full`` under ``dist`` (all of it for None)."""
    if dist is None:
        return contiguous(full, copy=True)
    return contiguous(full[dist.local_slices()], copy=True)


class Layout:
    """Which grid axes split which array dimensions, for arrays of any shape.

    A Layout turns into a :class:`~disttensor.Distribution` once the shape is
    known (``layout.distribution(shape)``), so a layer can be told how its
    input is to be split before the batch size or image size is fixed.

    Parameters
    ----------
    grid : ProcessGrid
    axes : sequence
        As ``Distribution(axes=...)``: per dimension a grid axis, a tuple of
        them, or None.
    """

    def __init__(self, grid: ProcessGrid, axes: Sequence[Any]):
        self.grid = grid
        self.axes = tuple(axes)
        # validates, and gives the axes in the form Distribution.axes reports them
        self._normal_axes = Distribution((0,) * len(self.axes), grid.shape, self.axes).axes

    def distribution(self, shape: Sequence[int]) -> Distribution:
        """The Distribution of an array of ``shape`` under this layout."""
        if len(shape) != len(self.axes):
            raise ValueError(f"layout {self.axes} is for {len(self.axes)}-D arrays, got {shape}")
        return Distribution(tuple(shape), self.grid, self.axes)

    def matches(self, dist: Distribution) -> bool:
        """Whether ``dist`` is split as this layout says (``Layout.of(dist) == self``)."""
        return dist.grid == self.grid and dist.axes == self._normal_axes

    @classmethod
    def of(cls, dist: Distribution) -> Layout:
        """The layout of an existing distribution (its explicit splits are dropped)."""
        return cls(dist.grid, dist.axes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and \
            (self.grid, self._normal_axes) == (other.grid, other._normal_axes)

    def __hash__(self) -> int:
        return hash((self.grid, self._normal_axes))

    def __repr__(self) -> str:
        return f"Layout(grid={self.grid.shape}, axes={self.axes})"
