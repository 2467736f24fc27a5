"""A wide convolution under filter, channel, spatial and sample splits, against PyTorch.

Run (unset the OpenBLAS overrides for this command only):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE mpiexec -n 2 python \\
        benchmarks/bench_channel_filter.py [--batch 1] [--channels 512] [--size 28] [--reps 5]

The layer is ``Conv2d(C, C, 3, padding=1)`` on an (N, C, S, S) float32 input
(default 1x512x28x28 -> 512), forward + backward (input, weight and bias
gradients), one rank per process and one BLAS thread each, under the splits
over a 1-D grid of all ranks:

* ``filter``: input whole, the filters split (each rank: weight[F/p]); the
  input gradient's partial sums allreduced over all ranks;
* ``channel``: the input split along C, the weight as weight[:, C/p]; the
  partial outputs allreduced (the output whole on every rank);
* ``C=F``: the input split along C over the filter axis (the planner's
  channel split): input gathered along C, weight[F/p], the input gradient
  summed back by a reduce-scatter; the output split along F;
* ``spatial``: H split, replicated weights (halo exchange; the weight
  gradient allreduced);
* ``sample``: N split (only when N >= ranks), replicated weights.

Per split: the median and range over ``--reps`` (interleaved with the other
splits) of the slowest rank's time of one forward + backward; the peak of
``tracemalloc`` (NumPy's allocations) during one forward + backward, the
largest over ranks, above the input; the weight bytes per rank (data and
gradient); and the bytes each rank sums in allreduces / reduce-scatters per
iteration, counted by hand from the layer's communication (not measured):
filter ``N C S^2`` (the input gradient), channel ``N F S^2`` (the output),
C=F a reduce-scatter of ``N C S^2`` (gathering the same amount forward),
spatial and sample ``F C 9 + F`` (the weight and bias gradients). The
baseline is ``torch.nn.Conv2d`` forward + backward in one process on one
thread (``torch.set_num_threads(1)``), timed on rank 0 in the same run while
the other ranks wait.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np
from _common import interleaved_stats, print_table, timing_columns, write_json
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn

comm = MPI.COMM_WORLD


def torch_time(n: int, c: int, s: int, reps: int) -> dict[str, float] | None:
    """Median, min and max seconds of torch's Conv2d forward + backward (rank 0, 1 thread)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    conv = torch.nn.Conv2d(c, c, 3, padding=1)
    x = torch.randn(n, c, s, s, requires_grad=True)
    dy = torch.randn(n, c, s, s)

    def step():
        x.grad = None
        conv.zero_grad()
        conv(x).backward(dy)

    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--channels", type=int, default=512)
    ap.add_argument("--size", type=int, default=28)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    p = comm.Get_size()
    n, c, s = args.batch, args.channels, args.size
    shape = (n, c, s, s)
    g = dt.ProcessGrid((p,))
    x_full = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    splits = {
        "filter": ((None, None, None, None), (0,), n * c * s * s),
        "channel": ((None, 0, None, None), (), n * c * s * s),
        "C=F": ((None, 0, None, None), (0,), n * c * s * s),
        "spatial": ((None, None, 0, None), (), c * c * 9 + c),
    }
    if n >= p:
        splits["sample"] = ((0, None, None, None), (), c * c * 9 + c)
    fns, info = {}, {}
    for name, (axes, fa, reduced) in splits.items():
        conv = nn.Conv2d(c, c, 3, padding=1, filter_axes=fa)
        dist = dt.Distribution(shape, g, axes)
        x = dt.DistArray.from_global(x_full, dist)
        y = conv(x)
        dy = dt.DistArray.from_global(np.ones(y.shape, np.float32), y.dist)
        conv.backward(dy)

        def step(conv=conv, x=x, dy=dy):
            conv(x)
            conv.backward(dy)

        tracemalloc.start()
        tracemalloc.reset_peak()
        step()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        weights = sum(q.data.nbytes + q.grad.nbytes for q in conv.parameters())
        info[name] = {"peak_MiB": comm.allreduce(peak, op=MPI.MAX) / 2**20,
                      "weights_MiB": comm.allreduce(weights, op=MPI.MAX) / 2**20,
                      "reduced_MiB": reduced * 4 / 2**20 if p > 1 else 0.0}
        fns[name] = step
    stats = interleaved_stats(fns, comm, args.reps, warmup=1)
    base = torch_time(n, c, s, args.reps) if comm.Get_rank() == 0 else None
    base = comm.bcast(base)
    rows = []
    for name in fns:
        row = {"split": name, "ranks": p, **timing_columns("fwd_bwd", stats[name]),
               **info[name]}
        if base is not None:
            row.update(timing_columns("torch_1proc", base))
            row["torch_over_ours"] = base["median"] / stats[name]["median"]
        rows.append(row)
    if comm.Get_rank() == 0:
        print(f"Conv2d({c}, {c}, 3, padding=1) on {shape} float32, fwd+bwd, {p} ranks, "
              f"medians of {args.reps}")
        cols = ["split", "fwd_bwd_us", "fwd_bwd_range_us", "peak_MiB", "weights_MiB",
                "reduced_MiB"]
        if base is not None:
            cols += ["torch_1proc_us", "torch_1proc_range_us", "torch_over_ours"]
        print_table(rows, cols)
        path = write_json(f"bench_channel_filter_p{p}_n{n}", rows, shape=list(shape),
                          reps=args.reps)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
