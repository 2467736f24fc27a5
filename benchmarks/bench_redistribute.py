"""Redistribution vs a raw MPI Alltoall of the same bytes.

Run: mpiexec -n P python benchmarks/bench_redistribute.py [--reps 20]

A 64 MiB float32 (N, C, H, W) array moves from sample-split (N over all
ranks) to H-split. Every rank sends (P-1)/P of its block to the others, which
is exactly what a raw ``Alltoall`` of contiguous buffers of the same size
moves; that is the baseline, measured in the same run.
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import interleaved, print_table, write_json
from mpi4py import MPI

import disttensor as dt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--shape", default="16,64,128,128")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p = comm.size
    shape = tuple(int(s) for s in args.shape.split(","))
    grid = dt.ProcessGrid((p,))
    src = dt.Distribution(shape, grid, axes=(0, None, None, None))
    dst = dt.Distribution(shape, grid, axes=(None, None, 0, None))
    x = dt.random.default_rng(0).random(src, np.float32)
    plan = dt.redistribution_plan(src, dst)
    out = dt.DistArray.empty(dst, np.float32)
    per_rank = x.local.nbytes
    send = np.ones(per_rank // 4, np.float32)
    recv = np.empty_like(send)
    rows = []
    impls = {"disttensor": lambda: plan(x, out), "raw_alltoall": lambda: comm.Alltoall(send, recv)}
    t = interleaved(impls, comm, args.reps)
    rows.append({
        "ranks": p, "global_MiB": x.size * 4 / 2**20, "local_MiB": per_rank / 2**20,
        "disttensor_ms": 1e3 * t["disttensor"], "raw_alltoall_ms": 1e3 * t["raw_alltoall"],
        "ratio": t["disttensor"] / t["raw_alltoall"],
    })
    if comm.rank == 0:
        print(f"redistribute {shape} float32 N-split -> H-split, median of {args.reps}")
        print_table(rows, list(rows[0]))
        print("wrote", write_json(f"redistribute_p{p}", rows, shape=shape, reps=args.reps))


if __name__ == "__main__":
    main()
