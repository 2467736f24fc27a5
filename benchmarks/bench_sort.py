"""Distributed sort vs ``numpy.sort`` of the whole array on one rank, in the same run.

Run: mpiexec -n P python benchmarks/bench_sort.py [--log2n 26] [--reps 5]

A float64 array of 2**log2n uniform random values (``disttensor.random``),
split in blocks over P ranks, is sorted along its only axis by
``xp.sort`` (stable, the standard's default) and ``xp.argsort``. The
baseline, interleaved with ours, is NumPy on rank 0 sorting the whole array
(``numpy.sort`` with its default, fastest kind, and with ``kind="stable"``;
``numpy.argsort(kind="stable")``) while the other ranks wait; every time is
the slowest rank's, median and min-max range over ``--reps``. The breakdown
row ``local_block_sort`` is every rank sorting its own block at once, no
communication: the floor of any distributed sort that sorts every element
once, on this machine (ranks share memory bandwidth and, oversubscribed,
cores). Heat's
``ht.sort`` on the same split is a further column when Heat is importable.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from _common import interleaved_stats, print_table, write_json
from mpi4py import MPI

import disttensor as dt

try:
    import heat as ht
except Exception as exc:  # noqa: BLE001 - any import failure means no Heat column
    ht = None
    HEAT_ERROR = f"{type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log2n", type=int, default=26)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p = comm.size
    n = 1 << args.log2n
    grid = dt.ProcessGrid((p,))
    dist = dt.Distribution((n,), grid)
    x = dt.random.default_rng(0).random(dist, np.float64)
    xp = x.__array_namespace__()
    whole = x.to_global(root=0) if p > 1 else x.local.copy()  # rank 0's copy of it all
    rank0 = comm.rank == 0

    def np_sort() -> None:
        if rank0:
            np.sort(whole)

    def np_stable() -> None:
        if rank0:
            np.sort(whole, kind="stable")

    def np_argsort() -> None:
        if rank0:
            np.argsort(whole, kind="stable")

    fns = {
        "dt_sort": lambda: xp.sort(x),
        "local_block_sort": lambda: np.sort(x.local),
        "numpy_sort": np_sort,
        "numpy_stable_sort": np_stable,
        "dt_argsort": lambda: xp.argsort(x),
        "numpy_argsort": np_argsort,
    }
    if ht is not None:
        hx = ht.array(x.local, is_split=0)
        fns["heat_sort"] = lambda: ht.sort(hx, axis=0)

    # correctness of what is timed, against NumPy on the gathered array
    s = xp.sort(x).to_global(root=0)
    a = xp.argsort(x).to_global(root=0)
    if rank0:
        ok = np.array_equal(s, np.sort(whole)) and np.array_equal(a, np.argsort(whole,
                                                                               kind="stable"))
        if not ok:
            raise SystemExit("bench_sort: the distributed sort differs from numpy.sort")
    del s, a

    stats = interleaved_stats(fns, comm, args.reps, warmup=1)
    oversub = p > (os.cpu_count() or 1)
    rows = []
    for name, st in stats.items():
        base = stats["numpy_argsort" if "argsort" in name else "numpy_sort"]["median"]
        rows.append({
            "function": name, "ranks": 1 if name.startswith("numpy") else p,
            "median_s": st["median"], "range_s": f"{st['min']:.3f}-{st['max']:.3f}",
            "vs_numpy": st["median"] / base,
        })
    if rank0:
        print(f"sort of 2^{args.log2n} float64 over {p} ranks"
              + (" (oversubscribed: more ranks than cores)" if oversub else "")
              + f", {args.reps} reps")
        print_table(rows, ["function", "ranks", "median_s", "range_s", "vs_numpy"])
        if ht is None:
            print(f"heat: not importable ({HEAT_ERROR.splitlines()[0][:100]})")
        path = write_json(f"bench_sort_p{p}", rows, log2n=args.log2n, reps=args.reps,
                          oversubscribed=oversub, cores=os.cpu_count(),
                          heat=None if ht is None else ht.__version__)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
