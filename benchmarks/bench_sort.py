"""Distributed sort vs ``numpy.sort`` of the whole array on one rank, in the same run.

Run: mpiexec -n P python benchmarks/bench_sort.py [--log2n 26] [--reps 5] [--no-argsort]
     mpiexec -n P python benchmarks/bench_sort.py --nd [--log2n 22] [--reps 5]

A float64 array of 2**log2n uniform random values (``disttensor.random``),
split in blocks over P ranks, is sorted along its only axis by
``xp.sort`` (stable, the standard's default) and ``xp.argsort``. The
baseline, interleaved with ours, is NumPy on rank 0 sorting the whole array
(``numpy.sort`` with its default, fastest kind, and with ``kind="stable"``;
``numpy.argsort(kind="stable")``) while the other ranks wait, sleeping rather than
spinning in MPI (which with more ranks than cores would slow rank 0 down); every time is
the slowest rank's, median and min-max range over ``--reps``. The breakdown
row ``local_block_sort`` is every rank sorting its own block at once, no
communication: the floor of any distributed sort that sorts every element
once, on this machine (ranks share memory bandwidth and, oversubscribed,
cores). Heat's
``ht.sort`` on the same split is a further column when Heat is importable.

``--nd``: the two strategies of an N-D sort along a split axis, side by side,
on arrays of 2**log2n float64 elements of shapes ``(n / c, c)`` split along
axis 0 and sorted along it: moving the split to the other dimension and
sorting whole lines ("lines"), and the sample sort batched over the lines
("batched"); with the one the rule of :data:`disttensor.ops.sorting.LINES_IMBALANCE`
picks, and NumPy sorting the whole array on rank 0 as the baseline.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from _common import interleaved_stats, print_table, write_json
from mpi4py import MPI

import disttensor as dt
import disttensor.ops.sorting as sorting
from disttensor.ops.gathering import max_block_elements

try:
    import heat as ht
except Exception as exc:  # noqa: BLE001 - any import failure means no Heat column
    ht = None
    HEAT_ERROR = f"{type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log2n", type=int, default=26)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-argsort", action="store_true",
                        help="time sort only (argsort and its baseline take 2/3 of the run)")
    parser.add_argument("--nd", action="store_true",
                        help="time the two strategies of an N-D sort along a split axis")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if args.nd:
        return nd_strategies(args, comm)
    p = comm.size
    n = 1 << args.log2n
    grid = dt.ProcessGrid((p,))
    dist = dt.Distribution((n,), grid)
    x = dt.random.default_rng(0).random(dist, np.float64)
    xp = x.__array_namespace__()
    whole = x.to_global(root=0) if p > 1 else x.local.copy()  # rank 0's copy of it all
    rank0 = comm.rank == 0

    def polite_wait() -> None:
        """Wait for rank 0 sleeping, not spinning in MPI: with more ranks than cores a
        spinning rank takes CPU time from rank 0's NumPy baseline (2x at 4 ranks on 2 cores)."""
        polite_barrier(comm)

    def np_sort() -> None:
        if rank0:
            np.sort(whole)
        polite_wait()

    def np_stable() -> None:
        if rank0:
            np.sort(whole, kind="stable")
        polite_wait()

    def np_argsort() -> None:
        if rank0:
            np.argsort(whole, kind="stable")
        polite_wait()

    fns = {
        "dt_sort": lambda: xp.sort(x),
        "local_block_sort": lambda: np.sort(x.local),
        "numpy_sort": np_sort,
        "numpy_stable_sort": np_stable,
    }
    if not args.no_argsort:
        fns["dt_argsort"] = lambda: xp.argsort(x)
        fns["numpy_argsort"] = np_argsort
    if ht is not None:
        hx = ht.array(x.local, is_split=0)
        fns["heat_sort"] = lambda: ht.sort(hx, axis=0)

    # correctness of what is timed, against NumPy on the gathered array
    s = xp.sort(x).to_global(root=0)
    a = None if args.no_argsort else xp.argsort(x).to_global(root=0)
    if rank0:
        ok = np.array_equal(s, np.sort(whole)) and (
            a is None or np.array_equal(a, np.argsort(whole, kind="stable")))
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


def polite_barrier(comm: MPI.Comm) -> None:
    """A barrier at which waiting ranks sleep instead of spinning (see ``main``)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def nd_strategies(args: argparse.Namespace, comm: MPI.Comm) -> None:
    """Lines vs batched sample sort for (n / c, c) arrays split along the sorted axis 0."""
    p = comm.size
    n = 1 << args.log2n
    grid = dt.ProcessGrid((p,))
    rows = []
    for c in (1, 2, 4, 16, 256):
        shape = (n // c, c)
        dist = dt.Distribution(shape, grid, (0, None))
        x = dt.random.default_rng(0).random(dist, np.float64)
        whole = x.to_global(root=0) if p > 1 else x.local.copy()
        lines = sorting._lines_distribution(dist, 0)
        ratio = max_block_elements(lines) / max_block_elements(dist)
        pick = "lines" if ratio <= sorting.LINES_IMBALANCE else "batched"

        def run_lines(x=x, lines=lines, dist=dist) -> None:
            sorting._local(x.redistribute(lines), lines, 0, False, True).redistribute(dist)

        def run_batched(x=x) -> None:
            sorting._batched_sample_sort(x, 0, False, True)

        def np_sort(whole=whole) -> None:
            if comm.rank == 0:
                np.sort(whole, axis=0)
            polite_barrier(comm)

        want = np.sort(whole, axis=0) if comm.rank == 0 else None
        for fn in (run_lines, run_batched):
            got = (sorting._batched_sample_sort(x, 0, False, True) if fn is run_batched else
                   sorting._local(x.redistribute(lines), lines, 0, False, True
                                  ).redistribute(dist)).to_global(root=0)
            if comm.rank == 0 and not np.array_equal(got, want):
                raise SystemExit(f"bench_sort --nd: {fn.__name__} differs from numpy.sort")
        st = interleaved_stats({"lines": run_lines, "batched": run_batched,
                                "numpy": np_sort}, comm, args.reps, warmup=1)
        best = min(("lines", "batched"), key=lambda k: st[k]["median"])
        row = {"shape": f"{shape[0]}x{shape[1]}", "imbalance": ratio, "rule": pick,
               "faster": best}
        for k in ("lines", "batched", "numpy"):
            row[f"{k}_s"] = st[k]["median"]
            row[f"{k}_range_s"] = f"{st[k]['min']:.3f}-{st[k]['max']:.3f}"
        rows.append(row)
    if comm.rank == 0:
        print(f"N-D sort along split axis 0, 2^{args.log2n} float64 over {p} ranks"
              + (" (oversubscribed)" if p > (os.cpu_count() or 1) else "")
              + f", {args.reps} reps; numpy: one rank sorts the whole array")
        print_table(rows, ["shape", "imbalance", "rule", "faster", "lines_s", "lines_range_s",
                           "batched_s", "batched_range_s", "numpy_s", "numpy_range_s"])
        path = write_json(f"bench_sort_nd_p{p}", rows, log2n=args.log2n, reps=args.reps,
                          lines_imbalance=sorting.LINES_IMBALANCE, cores=os.cpu_count())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
