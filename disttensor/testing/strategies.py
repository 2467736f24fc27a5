"""Hypothesis strategies for grids, distributions and distributed arrays.

Under MPI every rank must draw the same examples: use the ``"mpi"`` settings
profile (``settings.load_profile("mpi")`` after importing this module, or
``@settings(parent=settings.get_profile("mpi"))``), which derandomises
Hypothesis and turns off its example database, and make every assertion
collective (:func:`disttensor.testing.assert_allclose`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mpi4py import MPI

from ..array import DistArray
from ..distribution import Distribution
from ..grid import ProcessGrid, factorizations

__all__ = ["grids", "process_grids", "distributions", "dist_arrays", "MPI_PROFILE"]

MPI_PROFILE = "mpi"
settings.register_profile(
    MPI_PROFILE,
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def grids(draw: st.DrawFn, max_ranks: int = 8, max_ndim: int = 3) -> tuple[int, ...]:
    """Grid shapes (tuples of ints >= 1) with at most ``max_ranks`` processes.

    For metadata-only work: :class:`~disttensor.Distribution` accepts a grid
    shape in place of a :class:`~disttensor.ProcessGrid`.
    """
    ndim = draw(st.integers(1, max_ndim))
    nprocs = draw(st.integers(1, max_ranks))
    return draw(st.sampled_from(factorizations(nprocs, ndim)))


@st.composite
def process_grids(draw: st.DrawFn, comm: Any = None, max_ndim: int = 3) -> ProcessGrid:
    """ProcessGrids over all of ``comm`` (``COMM_WORLD`` by default), of 1 to ``max_ndim`` axes.

    Creating a ProcessGrid communicates nothing, so drawing one is safe as
    long as every rank draws the same examples.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    ndim = draw(st.integers(1, max_ndim))
    shape = draw(st.sampled_from(factorizations(comm.Get_size(), ndim)))
    return ProcessGrid(shape, comm)


@st.composite
def distributions(
    draw: st.DrawFn,
    shape: Any = None,
    grid: Any = None,
    *,
    max_dims: int = 4,
    max_side: int = 9,
    allow_empty: bool = True,
    allow_multi_axis: bool = True,
) -> Distribution:
    """Distributions with random split axes, replicas and (uneven, empty) blocks.

    Parameters
    ----------
    shape : tuple or strategy, optional
        Global shape; by default 0 to ``max_dims`` dims of size 0 to ``max_side``.
    grid : ProcessGrid, tuple or strategy, optional
        The grid; by default :func:`grids` ``(8)`` shapes (metadata only).
    allow_empty : bool
        Whether explicit splits may produce empty blocks.
    allow_multi_axis : bool
        Whether one dimension may be split over several grid axes.
    """
    if shape is None:
        shape = hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=0, max_side=max_side)
    if isinstance(shape, st.SearchStrategy):
        shape = draw(shape)
    if grid is None:
        grid = grids(8)
    if isinstance(grid, st.SearchStrategy):
        grid = draw(grid)
    gshape = grid.shape if isinstance(grid, ProcessGrid) else tuple(grid)
    ndim = len(shape)
    free = list(draw(st.permutations(range(len(gshape)))))
    axes: list[Any] = [None] * ndim
    for d in draw(st.permutations(range(ndim))) if ndim else []:
        if not free or draw(st.booleans()):
            continue
        k = draw(st.integers(1, len(free) if allow_multi_axis else 1))
        chosen, free = free[:k], free[k:]
        axes[d] = chosen[0] if k == 1 else tuple(chosen)
    splits: list[Any] = []
    for d in range(ndim):
        entry = axes[d]
        p = 1 if entry is None else math.prod(
            gshape[a] for a in (entry if isinstance(entry, tuple) else (entry,))
        )
        if p > 1 and draw(st.booleans()):
            cuts = sorted(draw(st.lists(st.integers(0, shape[d]), min_size=p - 1,
                                        max_size=p - 1)))
            empty = len({0, *cuts, shape[d]}) != p + 1
            splits.append(None if empty and not allow_empty else cuts)
        else:
            splits.append(None)
    return Distribution(shape, grid, tuple(axes), splits)


@st.composite
def dist_arrays(
    draw: st.DrawFn,
    dist: Any = None,
    dtype: Any = np.float64,
    elements: st.SearchStrategy | None = None,
) -> DistArray:
    """DistArrays with a drawn global array; ``x.to_global()`` is the reference.

    ``dist`` is a Distribution on a ProcessGrid or a strategy of them (by
    default :func:`distributions` over a :func:`process_grids` grid). Every
    rank draws the same global array and keeps its block, so drawing
    communicates nothing.
    """
    if dist is None:
        dist = distributions(grid=process_grids())
    if isinstance(dist, st.SearchStrategy):
        dist = draw(dist)
    if elements is None and np.dtype(dtype).kind == "f":
        elements = st.floats(-1e6, 1e6, allow_nan=False, width=np.dtype(dtype).itemsize * 8)
    array = draw(hnp.arrays(dtype, dist.global_shape, elements=elements))
    return DistArray.from_global(array, dist)
