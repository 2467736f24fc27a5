"""Redistribution vs a raw MPI Alltoall(v) of the same bytes.

Run: mpiexec -n P python benchmarks/bench_redistribute.py [--reps 20]

float32 (N, C, H, W) arrays move between layouts whose contiguous runs are
large (N-split -> H-split: whole H-slabs of W) or small (H-split -> W-split:
runs of W/P elements, 256 bytes for W = 128 at 2 ranks), on blocks from
1 MiB to 64 MiB, with and without allocating the output. The baseline,
measured in the same run and interleaved with ours, is ``Alltoallv`` of
contiguous, preallocated buffers holding exactly the bytes each pair of ranks
exchanges (``Alltoall`` when they are equal): no gathering of the pieces out
of, or scattering into, the arrays. The target is disttensor <= 1.3x raw for
every layout. Every time is the median of ``--reps`` samples (each the
slowest rank's) with its min-max range.
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import interleaved_stats, print_table, timing_columns, write_json
from mpi4py import MPI

import disttensor as dt

# name, global shape, source split dim, target split dim
CASES = [
    ("N->H large runs", (16, 64, 128, 128), 0, 2),
    ("H->W 256B runs", (16, 64, 128, 128), 2, 3),
    ("N->H small", (4, 16, 64, 64), 0, 2),
    ("H->W small", (4, 16, 64, 64), 2, 3),
    ("C->H", (8, 64, 64, 64), 1, 2),
    ("W->N", (8, 32, 128, 128), 3, 0),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p = comm.size
    grid = dt.ProcessGrid((p,))
    rows = []
    for name, shape, sd, td in CASES:
        src_axes, dst_axes = [None] * 4, [None] * 4
        src_axes[sd], dst_axes[td] = 0, 0
        src = dt.Distribution(shape, grid, axes=tuple(src_axes))
        dst = dt.Distribution(shape, grid, axes=tuple(dst_axes))
        x = dt.random.default_rng(0).random(src, np.float32)
        plan = dt.redistribution_plan(src, dst)
        try:
            methods = {m: dt.redistribution_plan(src, dst, m) for m in ("pack", "datatype")}
        except TypeError:  # a version with one method (Alltoallw with datatypes)
            methods = {"pack": plan, "datatype": plan}
        out = dt.DistArray.empty(dst, np.float32)
        # the bytes each pair exchanges, from the plan-independent block intersections
        me = comm.rank
        scounts = [0 if r == me else _size(src.intersection(dst, me, r)) for r in range(p)]
        rcounts = [0 if r == me else _size(src.intersection(dst, r, me)) for r in range(p)]
        sbuf = np.ones(max(1, sum(scounts)), np.float32)
        rbuf = np.empty(max(1, sum(rcounts)), np.float32)
        sdis = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(int).tolist()
        rdis = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).astype(int).tolist()
        m = max(sd, td)  # pieces are contiguous below the later split dimension
        run = 4 * int(np.prod(shape[m + 1:])) * (shape[m] // p)
        t = interleaved_stats({
            "disttensor_out": lambda plan=plan, x=x, out=out: plan(x, out),
            "disttensor_alloc": lambda plan=plan, x=x: plan(x),
            "pack_out": lambda plan=methods["pack"], x=x, out=out: plan(x, out),
            "datatype_out": lambda plan=methods["datatype"], x=x, out=out: plan(x, out),
            "raw_alltoallv": lambda s=(sbuf, scounts, sdis), r=(rbuf, rcounts, rdis):
                comm.Alltoallv([s[0], (s[1], s[2]), MPI.FLOAT], [r[0], (r[1], r[2]), MPI.FLOAT]),
        }, comm, args.reps)
        sent = comm.allreduce(4 * sum(scounts), op=MPI.MAX)
        row = {"layout": name, "shape": "x".join(map(str, shape)), "ranks": p,
               "run_bytes": run, "max_bytes_sent_per_rank": sent,
               "method": getattr(plan, "method", "datatype")}
        for k in ("disttensor_out", "disttensor_alloc", "pack_out", "datatype_out",
                  "raw_alltoallv"):
            row.update(timing_columns(k, t[k]))
        raw = t["raw_alltoallv"]["median"]
        row["ratio_out"] = t["disttensor_out"]["median"] / raw
        row["ratio_alloc"] = t["disttensor_alloc"]["median"] / raw
        row["ratio_pack"] = t["pack_out"]["median"] / raw
        row["ratio_datatype"] = t["datatype_out"]["median"] / raw
        rows.append(row)
    if comm.rank == 0:
        print(f"redistribution, float32, {p} ranks, median of {args.reps} (range min-max), "
              "microseconds; out: into a preallocated output, alloc: allocating it")
        cols = ["layout", "shape", "run_bytes", "max_bytes_sent_per_rank", "method",
                "disttensor_out_us", "disttensor_out_range_us", "disttensor_alloc_us",
                "raw_alltoallv_us", "raw_alltoallv_range_us", "ratio_out", "ratio_alloc",
                "ratio_pack", "ratio_datatype"]
        print_table(rows, cols)
        print("wrote", write_json(f"redistribute_p{p}", rows, reps=args.reps))


def _size(inter) -> int:
    if inter is None:
        return 0
    return int(np.prod([s.stop - s.start for s in inter]))


if __name__ == "__main__":
    main()
