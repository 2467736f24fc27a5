"""How the compiler's blocks lie: the distributions a rule derives from its input's, and
the moves and halo exchanges between them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from disttensor import Distribution, halo_plan

from .functional import _exchange_planned, broadcast, redistribute


def _split(dist: Distribution, dim: int) -> bool:
    """Whether ``dim`` of ``dist`` has more than one block."""
    return math.prod(dist.grid_shape[a] for a in dist.dim_axes[dim]) > 1


def _axes_key(dist: Distribution, dims: Sequence[int] | None = None) -> frozenset:
    """The grid axes (of more than one rank) that split ``dims`` of ``dist``."""
    dims = range(dist.ndim) if dims is None else dims
    return frozenset(a for d in dims for a in dist.dim_axes[d] if dist.grid_shape[a] > 1)


def _takes_channels(src: Distribution, dst: Distribution) -> bool:
    """Whether ``dst`` is ``src`` but for its channels, which ``src`` holds whole on every
    rank of one grid axis and ``dst`` splits along that axis: each rank's block of ``dst``
    is then its channels of its block of ``src``."""
    if src.ndim <= 2 or src.grid != dst.grid or src.dim_axes[1] or \
            len(dst.dim_axes[1]) != 1:
        return False
    axis = dst.dim_axes[1][0]
    return all(axis not in a for a in src.dim_axes) and all(
        src.dim_axes[d] == dst.dim_axes[d] and src.boundaries[d] == dst.boundaries[d]
        for d in range(src.ndim) if d != 1)


def _unsplit(dist: Distribution, dims: Sequence[int]) -> Distribution:
    """``dist`` with ``dims`` whole (their grid axes hold replicas)."""
    axes = [None if d in dims else a for d, a in enumerate(dist.axes)]
    splits = [None if d in dims else s for d, s in enumerate(dist.splits)]
    return Distribution(dist.global_shape, dist.grid_arg, axes, splits)


def _with_shape(dist: Distribution, shape: Sequence[int],
                splits: dict[int, Any] | None = None) -> Distribution:
    """``dist``'s axes and cuts on a new shape of as many dimensions; ``splits`` overrides."""
    cuts = list(dist.splits)
    for d, s in (splits or {}).items():
        cuts[d] = s
    return Distribution(tuple(shape), dist.grid_arg, dist.axes, cuts)


def _broadcast_to(dist: Distribution, target: Distribution) -> Distribution | None:
    """Where an operand of ``dist``'s shape must lie to broadcast against blocks of
    ``target`` on each rank as it does against the whole: its dimensions of the output's
    length cut as the output's, those of length 1 (against more) whole, their grid axes
    holding replicas; None where the shapes do not broadcast so (right-aligned, as in
    PyTorch)."""
    src, out = tuple(dist.global_shape), tuple(target.global_shape)
    lead = len(out) - len(src)
    if lead < 0:
        return None
    axes: list[Any] = []
    splits: list[Any] = []
    for i, n in enumerate(src):
        if n == out[lead + i]:
            axes.append(target.axes[lead + i])
            splits.append(target.splits[lead + i])
        elif n == 1:
            axes.append(None)
            splits.append(None)
        else:
            return None
    return Distribution(src, target.grid_arg, axes, splits)


def _move_then_share(src: Distribution, dst: Distribution, along: Sequence[int]
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A block of ``src`` moved to ``dst``, then shared by the ranks along the grid axes
    ``along`` (forward: as it is; backward: their gradients summed, :func:`broadcast`)."""
    grid, axes = dst.grid, tuple(along)

    def move(t: torch.Tensor) -> torch.Tensor:
        if src != dst:
            t = redistribute(t, src, dst)
        return broadcast(t, grid, axes=axes) if axes else t

    return move


def _extend(dist: Distribution, widths: Any, mode: str = "constant", fill: Any = 0.0
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A step's halo exchange of its input block: the plan made (and checked) once, when the
    step is compiled; the identity where every width is 0."""
    if not any(any(w) for w in widths):
        return lambda x: x
    plan = halo_plan(dist, widths, mode)
    return lambda x: _exchange_planned(x, plan, fill)
