"""Integer-array indexing (``x[i, j]``, ``x[idx] = v``) vs NumPy on one rank, in the same run.

Run: mpiexec -n P python benchmarks/bench_indexing.py [--log2n 22] [--log2m 20] [--reps 5]

A float64 array of ``2**log2n`` elements, ``(n / 1024, 1024)``, rows split
over P ranks; ``2**log2m`` random points (repeats included), the index
arrays DistArrays split like the points. Timed, interleaved: reading
``x[i, j]`` and writing ``x[i, j] = v`` (both route every point to its
owner: one ``Alltoallv`` of the indices, one of the values), reading whole
rows ``x[r]`` (one 1-D array along the split axis: ``take``), and NumPy doing
the same on the whole array on rank 0 while the other ranks sleep. Times
are the slowest rank's, medians and min-max over ``--reps``; JSON goes to
``benchmarks/results/bench_indexing_pP.json``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from _common import interleaved_stats, print_table, write_json
from mpi4py import MPI

import disttensor as dt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log2n", type=int, default=22)
    parser.add_argument("--log2m", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p = comm.size
    shape = ((1 << args.log2n) // 1024, 1024)
    m = 1 << args.log2m
    grid = dt.ProcessGrid((p,))
    x = dt.random.default_rng(0).random(dt.Distribution(shape, grid, (0, None)), np.float64)
    rng = np.random.default_rng(1)
    gi, gj = rng.integers(0, shape[0], m), rng.integers(0, shape[1], m)
    gr = rng.integers(0, shape[0], shape[0] // 4)
    pts = dt.Distribution((m,), grid, (0,))
    i, j = (dt.DistArray.from_global(a, pts) for a in (gi, gj))
    v = dt.DistArray.from_global(-np.arange(m, dtype=np.float64), pts)
    whole = x.to_global(root=0) if p > 1 else x.local.copy()
    rank0 = comm.rank == 0

    def sleep_wait() -> None:
        req = comm.Ibarrier()
        while not req.Test():
            time.sleep(0.002)

    def np_get() -> None:
        if rank0:
            whole[gi, gj]
        sleep_wait()

    def np_set() -> None:
        if rank0:
            whole[gi, gj] = -np.arange(m, dtype=np.float64)
        sleep_wait()

    def np_rows() -> None:
        if rank0:
            whole[gr]
        sleep_wait()

    def dt_set() -> None:
        x[i, j] = v

    # correctness of what is timed, against NumPy on the gathered array
    got = x[i, j].to_global(root=0)
    x[i, j] = v
    after = x.to_global(root=0)
    if rank0:
        ref = whole.copy()
        ok = np.array_equal(got, ref[gi, gj])
        ref[gi, gj] = -np.arange(m, dtype=np.float64)
        if not (ok and np.array_equal(after, ref)):
            raise SystemExit("bench_indexing: results differ from NumPy")
    fns = {"dt_get_points": lambda: x[i, j], "numpy_get_points": np_get,
           "dt_set_points": dt_set, "numpy_set_points": np_set,
           "dt_get_rows": lambda: x[gr], "numpy_get_rows": np_rows}
    stats = interleaved_stats(fns, comm, args.reps, warmup=1)
    rows = []
    for name, st in stats.items():
        base = stats["numpy_" + name.split("_", 1)[1]]["median"]
        rows.append({"operation": name, "ranks": 1 if name.startswith("numpy") else p,
                     "median_s": st["median"], "range_s": f"{st['min']:.4f}-{st['max']:.4f}",
                     "vs_numpy": st["median"] / base})
    if rank0:
        print(f"integer-array indexing, {shape[0]}x{shape[1]} float64 over {p} ranks, "
              f"{m} points, {len(gr)} rows, {args.reps} reps"
              + (" (oversubscribed)" if p > (os.cpu_count() or 1) else ""))
        print_table(rows, ["operation", "ranks", "median_s", "range_s", "vs_numpy"])
        path = write_json(f"bench_indexing_p{p}", rows, log2n=args.log2n, log2m=args.log2m,
                          reps=args.reps, cores=os.cpu_count())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
