"""disttensor in one page: make, transform, redistribute and gather a distributed array.

Run it on any number of ranks, for example four::

    mpiexec -n 4 python -m mpi4py examples/demo.py

Every rank generates only its own block of a random global array, takes the
square root of it locally, then the array is redistributed from a block
layout over a 2-D process grid to column slabs over all ranks and gathered
on rank 0, which checks the result against NumPy.
"""

import sys

import numpy as np
from mpi4py import MPI

import disttensor as dt


def span(s: slice) -> str:
    return f"{s.start}:{s.stop}"


def describe(x: dt.DistArray) -> str:
    """One line about this rank's block of ``x``."""
    rows, cols = x.dist.local_slices()
    return (
        f"  rank {x.grid.rank}  coords {x.grid.coords}  rows {span(rows):>5}  "
        f"cols {span(cols):>5}  block {x.local_shape}"
    )


def show(comm: MPI.Comm, line: str) -> None:
    """Print one line per rank, in rank order, from rank 0."""
    lines = comm.gather(line, root=0)
    if comm.rank == 0:
        print("\n".join(lines))


def main() -> int:
    comm = MPI.COMM_WORLD
    grid = dt.ProcessGrid.create(2)  # a balanced 2-D grid: 2 x 2 on 4 ranks
    shape = (7, 10)

    # Rows split by grid axis 0, columns by grid axis 1. Each rank computes
    # only its own block; the global array is the same on any number of ranks.
    blocks = dt.Distribution(shape, grid, axes=(0, 1))
    x = dt.random.default_rng(0).random(blocks)
    before = x.to_global(root=0)  # the input, gathered for the check below

    if comm.rank == 0:
        ranks = "rank" if grid.size == 1 else "ranks"
        print(f"disttensor demo on {grid.size} {ranks}, process grid {grid.shape}")
        print(f"random {shape} array, {blocks}:")
    show(comm, describe(x))

    x.local[...] = np.sqrt(x.local)  # purely local work on this rank's block

    # Whole columns: the column dimension is split over both grid axes
    # (all ranks), the rows are not split. One MPI_Alltoallw moves the data.
    slabs = blocks.with_axes((None, (0, 1)))
    y = x.redistribute(slabs)
    if comm.rank == 0:
        print(f"after sqrt, redistributed to {slabs}:")
    show(comm, describe(y))

    result = y.to_global(root=0)
    ok = None
    if comm.rank == 0:
        ok = bool(np.array_equal(result, np.sqrt(before)))
        verdict = "equals" if ok else "DIFFERS FROM"
        print(f"gathered on rank 0: result {verdict} numpy.sqrt(gathered input)")
    ok = comm.bcast(ok, root=0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
