"""Spatial strong scaling of one Conv2d layer: 1 rank vs 2 ranks splitting H.

Run (unset the OpenBLAS overrides for this command only):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE mpiexec -n 2 python
        benchmarks/bench_conv_scaling.py [--reps 5] [--size 1024]

``disttensor_nn.Conv2d(16, 16, 3, padding=1)`` on a (1, 16, S, S) float32
input (S = 1024), forward + backward, one BLAS thread per rank:

* ``t1``: the layer on a one-process grid (``ProcessGrid((1,), COMM_SELF)``)
  on rank 0 while rank 1 sleeps (it polls a non-blocking barrier with
  ``time.sleep``, so it does not take a core);
* ``t2``: the same layer on both ranks, the input split over H (slowest rank
  per repetition);

alternated repetition by repetition, medians of ``--reps``. Parallel
efficiency is ``t1 / (2 * t2)``; ``efficiency_best`` uses the fastest
repetitions instead (less sensitive to other processes on a shared machine,
which slow the two-rank run more than the one-rank run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from _common import print_table, write_json
from mpi4py import MPI
from threadpoolctl import threadpool_limits

import disttensor as dt
import disttensor_nn as nn


def idle_until_released(comm: MPI.Comm) -> None:
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def fwd_bwd(layer, x, dy):
    layer.zero_grad()
    layer.forward(x)
    layer.backward(dy)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--channels", type=int, default=16)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run with mpiexec -n 2")
    threadpool_limits(limits=1, user_api="blas")
    c, s = args.channels, args.size
    shape = (1, c, s, s)
    rng = dt.random.default_rng(0)

    # two ranks, H split
    layer2 = nn.Conv2d(c, c, 3, padding=1, dtype=np.float32)
    d2 = dt.Distribution(shape, dt.ProcessGrid((2,)), axes=(None, None, 0, None))
    x2 = rng.standard_normal(d2, np.float32)
    dy2 = rng.standard_normal(layer2.output_distribution(d2), np.float32)

    # one rank (rank 0 only)
    if comm.rank == 0:
        layer1 = nn.Conv2d(c, c, 3, padding=1, dtype=np.float32)
        d1 = dt.Distribution(shape, dt.ProcessGrid((1,), MPI.COMM_SELF),
                             axes=(None, None, 0, None))
        x1 = dt.random.default_rng(0).standard_normal(d1, np.float32)
        dy1 = dt.random.default_rng(1).standard_normal(layer1.output_distribution(d1),
                                                        np.float32)

    def run1():
        if comm.rank == 0:
            t0 = time.perf_counter()
            fwd_bwd(layer1, x1, dy1)
            dt_ = time.perf_counter() - t0
            comm.Ibarrier().Wait()
        else:
            idle_until_released(comm)
            dt_ = 0.0
        return comm.bcast(dt_, root=0)

    def run2():
        comm.Barrier()
        t0 = time.perf_counter()
        fwd_bwd(layer2, x2, dy2)
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    run1()
    run2()
    t1s, t2s = [], []
    for _ in range(args.reps):
        t1s.append(run1())
        t2s.append(run2())
    t1, t2 = statistics.median(t1s), statistics.median(t2s)
    flops = 3 * 2.0 * c * c * 9 * s * s
    rows = [{
        "shape": "x".join(map(str, shape)), "kernel": "3x3 p1",
        "t1_ms": 1e3 * t1, "t2_ms": 1e3 * t2,
        "gflops_1": flops / t1 / 1e9, "gflops_2": flops / t2 / 1e9,
        "speedup": t1 / t2, "efficiency": t1 / (2 * t2),
        "efficiency_best": min(t1s) / (2 * min(t2s)),
    }]
    if comm.rank == 0:
        print(f"Conv2d({c}, {c}, 3, padding=1) fwd+bwd on {shape} float32, one BLAS thread "
              f"per rank; medians of {args.reps} (alternating 1-rank and 2-rank runs)")
        print_table(rows, list(rows[0]))
        print("wrote", write_json("conv_scaling", rows, reps=args.reps,
                                  t1_samples=t1s, t2_samples=t2s,
                                  loadavg_1min_after=os.getloadavg()[0]))


if __name__ == "__main__":
    main()
