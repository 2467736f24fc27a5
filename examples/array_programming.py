"""Array programming on DistArrays: ordinary NumPy code, distributed.

Run it on any number of ranks, for example four::

    mpiexec -n 4 python -m mpi4py examples/array_programming.py

The same function, ``smooth_and_normalise``, runs twice: on a DistArray
split over a 2-D process grid and, on rank 0, on the gathered NumPy array.
It normalises the columns of a field, relaxes it with a few Jacobi sweeps of
a 5-point stencil written with slices, and reduces it. The distributed
result is gathered and compared with NumPy's.
"""

import sys

import numpy as np
from mpi4py import MPI

import disttensor as dt


def smooth_and_normalise(u, sweeps=3):
    """Plain NumPy code: no MPI, no distribution, nothing disttensor-specific."""
    u = (u - u.mean(axis=0)) / u.std(axis=0)          # normalise every column
    for _ in range(sweeps):                            # Jacobi sweeps, edges fixed
        inner = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        u[1:-1, 1:-1] = inner
    lap = u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4 * u[1:-1, 1:-1]
    summary = np.stack([np.sqrt(np.sum(lap**2, axis=1)), np.max(np.abs(lap), axis=1)])
    return u, summary, np.argmax(np.abs(lap))


def main() -> int:
    comm = MPI.COMM_WORLD
    grid = dt.ProcessGrid.create(2)                    # 2 x 2 on 4 ranks
    x = dt.random.default_rng(42).standard_normal((64, 48), grid=grid)
    start = x.to_global(root=0)                        # the input, for the NumPy run

    u, summary, peak = smooth_and_normalise(x)         # distributed
    if comm.rank == 0:
        print(f"{comm.size} ranks, input {x!r}")
        print(f"field   {u!r}")
        print(f"summary {summary!r}")
    got_u, got_s = u.to_global(root=0), summary.to_global(root=0)
    peak = int(peak)                                   # a 0-d DistArray, the same on every rank

    ok = None
    if comm.rank == 0:
        ref_u, ref_s, ref_peak = smooth_and_normalise(start)   # NumPy on the gathered input
        ok = bool(np.allclose(got_u, ref_u, rtol=1e-12, atol=1e-12)
                  and np.allclose(got_s, ref_s, rtol=1e-12) and peak == ref_peak)
        print(f"largest |laplacian| {got_s[1].max():.6f} at flat index {peak}")
        print(f"norm of the laplacian over rows 1..5: {np.round(got_s[0, :5], 6)}")
        print(f"result equal to NumPy's: {ok}")
    return 0 if comm.bcast(ok, root=0) else 1


if __name__ == "__main__":
    sys.exit(main())
