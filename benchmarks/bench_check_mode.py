"""Per-call overhead of the collective-consistency check mode on small calls.

Run: mpiexec -n 4 python benchmarks/bench_check_mode.py [--reps 200]

Each small collective call (a reduction, an integer index, a halo exchange,
a redistribution, a gather to a root) is timed with check mode off and on,
alternating the two so that load changes hit both alike. For each call the
table gives the median (and the 10th to 90th percentile range) over
``--reps`` samples of the slowest rank's time, and the overhead of the mode
(median on minus median off). The mode's cost is one ``allgather`` of the
call's argument descriptions, so it matters for small calls only.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import print_table, write_json
from mpi4py import MPI

import disttensor as dt


def sample(fn, comm: MPI.Comm, check: bool) -> float:
    """The slowest rank's time of one ``fn()`` with check mode set to ``check`` (seconds)."""
    with dt.options(check_collective=check):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
    return comm.allreduce(elapsed, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="samples per call and mode")
    parser.add_argument("--n", type=int, default=64, help="rows of the (n, n) test array")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    grid = dt.ProcessGrid(comm.Get_size())
    dist = dt.Distribution((args.n, args.n), grid)
    x = dt.DistArray.from_global(np.ones((args.n, args.n)), dist)
    target = dist.with_axes((None, 0))
    calls = {
        "x.sum()": lambda: x.sum(),
        "x.sum(axis=0)": lambda: x.sum(axis=0),
        "x[3]": lambda: x[3],
        "x.exchange_halo(1)": lambda: x.exchange_halo(1),
        "x.redistribute(target)": lambda: x.redistribute(target),
        "x.to_global(root=0)": lambda: x.to_global(root=0),
        "x + 1": lambda: x + 1,
    }
    rows = []
    for name, fn in calls.items():
        for check in (False, True):  # warm up plans and caches in both modes
            for _ in range(3):
                sample(fn, comm, check)
        off, on = [], []
        for _ in range(args.reps):
            off.append(sample(fn, comm, False))
            on.append(sample(fn, comm, True))
        off_us, on_us = 1e6 * np.array(off), 1e6 * np.array(on)
        rows.append({
            "call": name,
            "off_median_us": float(np.median(off_us)),
            "off_p10_p90_us": f"{np.percentile(off_us, 10):.1f}-{np.percentile(off_us, 90):.1f}",
            "on_median_us": float(np.median(on_us)),
            "on_p10_p90_us": f"{np.percentile(on_us, 10):.1f}-{np.percentile(on_us, 90):.1f}",
            "overhead_us": float(np.median(on_us) - np.median(off_us)),
        })
    if comm.Get_rank() == 0:
        print(f"check mode overhead per call, ({args.n}, {args.n}) float64 on "
              f"{comm.Get_size()} ranks, median of {args.reps}")
        print_table(rows, list(rows[0]))
        print("wrote", write_json("check_mode", rows, n=args.n, reps=args.reps))


if __name__ == "__main__":
    main()
