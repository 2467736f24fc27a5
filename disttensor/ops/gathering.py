"""Layouts with some dimensions whole, and the policy when that means a gather.

:func:`whole_axes` gives the layout in which chosen dimensions are not
split, moving their grid axes onto the other dimensions (the FFT's pencil
step, the batch dimensions of stacked matrices). A few operations have no
reasonable distributed algorithm for some inputs (an FFT of a split 1-D
array, a general square matrix factorisation): they move the data they need to every rank
that computes with it. They call :func:`warn_gather`, which warns with a
:class:`GatherWarning` when the gathered piece is at least
:data:`GATHER_WARN_BYTES` per rank, so that users see the cost and can
silence it with :mod:`warnings` filters.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

from ..distribution import Distribution

__all__ = ["GatherWarning", "GATHER_WARN_BYTES", "warn_gather", "whole_axes",
           "max_block_elements"]

#: Gathers of at least this many bytes per rank warn (64 MiB).
GATHER_WARN_BYTES = 64 << 20


class GatherWarning(UserWarning):
    """An operation gathered a large split array onto the ranks that compute with it."""


def warn_gather(what: str, nbytes: int, stacklevel: int = 3) -> None:
    """Warn (a :class:`GatherWarning`) that ``what`` gathers ``nbytes`` bytes per rank.

    Silent below :data:`GATHER_WARN_BYTES`. Every rank decides alike, from
    metadata, so every rank warns or none does.
    """
    if nbytes >= GATHER_WARN_BYTES:
        warnings.warn(f"{what} gathers {nbytes / 2**20:.1f} MiB onto every rank that computes "
                      "with it (no distributed algorithm applies to this layout)",
                      GatherWarning, stacklevel=stacklevel)


def whole_axes(dist: Distribution, axes: Iterable[int], avoid: Iterable[int] = ()
               ) -> Distribution:
    """``dist`` with the dimensions ``axes`` whole (not split); pure metadata.

    The grid axes that split each of ``axes`` move, together, onto one
    other dimension: one without empty blocks before one with, one not in
    ``avoid`` (say, the dimensions an FFT transforms next) before one in it,
    then one whose blocks come out within 10% of even, the outermost (the
    pieces of the move are then the longest contiguous runs: whole planes
    rather than short rows, which MPI moves several times faster), else the
    one with the most elements per block. Dimensions whose grid
    axes do not change keep their boundaries. Where no other dimension
    exists (1-D arrays, or all dimensions in ``axes``), the grid axes are
    dropped: their ranks then hold replicas, and moving to this layout is a
    gather.
    """
    axes = [a % dist.ndim if dist.ndim else a for a in axes]
    avoid = set(avoid)
    g = dist.grid_shape
    for axis in axes:
        dim_axes = [list(e) for e in dist.dim_axes]
        moving = [a for a in dim_axes[axis] if g[a] > 1]
        if not moving:
            continue
        dim_axes[axis] = [a for a in dim_axes[axis] if g[a] == 1]
        splits = list(dist.splits)
        splits[axis] = None
        pm = math.prod(g[a] for a in moving)
        others = [d for d in range(dist.ndim) if d not in axes]
        if others:
            b = min(others, key=lambda d, dist=dist, pm=pm: _target_key(dist, d, pm, avoid))
            dim_axes[b] += moving
            splits[b] = None
        dist = dist.replace(axes=[tuple(e) for e in dim_axes], splits=splits)
    return dist


def _target_key(dist: Distribution, d: int, pm: int, avoid: set[int]) -> tuple:
    """Order of preference of dimension ``d`` as the one that takes ``pm`` more blocks."""
    n, k = dist.global_shape[d], dist.nblocks[d] * pm
    per = n / k
    even = per > 0 and math.ceil(per) <= 1.1 * per
    return (n < k, d in avoid, not even, 0.0 if even else -per, d)


def max_block_elements(dist: Distribution) -> int:
    """The most elements any rank holds in ``dist`` (the same answer on every rank)."""
    return max(math.prod(dist.local_shape(r)) for r in range(dist.nprocs))
