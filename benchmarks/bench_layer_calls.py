"""What one layer call costs besides its kernel: ours against PyTorch's module, on small
blocks, with the caches cleared before each pass as a training step's large kernels leave them.

Run (unset the OpenBLAS overrides for timing only):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_layer_calls.py \
        [--shape 2,8,4,4] [--flush-mib 8] [--reps 300] [--rounds 3]

Each layer (a 3 x 3 convolution without bias, a batch norm, a ReLU, a 3 x 3 / 2 max
pool, on one process with the torch kernels and one thread) runs forward and
backward on a block so small that its ATen kernels take microseconds; before
each pass, and before PyTorch's module's forward and ``backward()``, the
script copies ``--flush-mib`` MiB between two arrays, so that the interpreter's
working set is out of the core's caches, as it is after a kernel that streams
megabytes (this machine's L2 holds 1 MiB a core). What is left besides the
kernels is the Python and the dispatch around them: ours is every layer's own
Python (checks, routes, wrappers, the kernel module's conversions), PyTorch's
its module call and its autograd engine. The ``excess`` column is ours minus
PyTorch's, forward plus backward; ``resnet18_ms`` weighs it by ResNet-18's
layer counts (20 convolutions and batch norms, 17 ReLUs, one max pool): about
what a training step of ResNet-18 spends in our layers' Python beyond PyTorch's.
Medians over ``--reps`` interleaved passes, per round; the table gives the
median round, the JSON every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
from _common import print_table, write_json
from mpi4py import MPI

import disttensor as dt
from disttensor.blockcache import BlockCache, block_cache
from disttensor_nn import kernels as nn_kernels
from disttensor_nn.layers.conv import Conv2d
from disttensor_nn.layers.elementwise import ReLU
from disttensor_nn.layers.norm import BatchNorm2d
from disttensor_nn.layers.pool import MaxPool2d

try:
    import torch
except ImportError:  # pragma: no cover - the bench extra
    torch = None

RESNET18_COUNTS = {"Conv2d": 20, "BatchNorm2d": 20, "ReLU": 17, "MaxPool2d": 1}


def _layers(c: int) -> list[tuple[str, Any, Any]]:
    conv = Conv2d(c, c, 3, padding=1, bias=False)
    tconv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
    tconv.weight.data = torch.from_numpy(conv.weight.data.copy())
    return [("Conv2d", conv, tconv), ("BatchNorm2d", BatchNorm2d(c), torch.nn.BatchNorm2d(c)),
            ("ReLU", ReLU(), torch.nn.ReLU()),
            ("MaxPool2d", MaxPool2d(3, 2, 1), torch.nn.MaxPool2d(3, 2, 1))]


def bench_layer(layer: Any, tlayer: Any, shape: tuple[int, ...], flush: Any, reps: int,
                rounds: int) -> list[dict[str, float]]:
    """Per round, the medians (us) of our and PyTorch's forward and backward passes."""
    grid = dt.ProcessGrid((1,), MPI.COMM_SELF)
    rng = np.random.default_rng(0)
    dist = dt.Distribution(shape, grid, (0, None, None, None))
    x = dt.DistArray.from_local(rng.standard_normal(shape).astype(np.float32), dist)
    nn_kernels.use_kernels(layer, "torch")
    cache = BlockCache()
    with block_cache(cache=cache):
        y = layer(x)
    dy = dt.DistArray.from_local(rng.standard_normal(y.local_shape).astype(np.float32), y.dist)
    tx = torch.from_numpy(x.local.copy()).requires_grad_()
    tdy = torch.from_numpy(dy.local.copy())
    clock = time.perf_counter

    def ours() -> tuple[float, float]:
        with block_cache(cache=cache):
            flush()
            t0 = clock()
            layer(x)
            t1 = clock()
            flush()
            t2 = clock()
            layer.call_backward(dy)
            return t1 - t0, clock() - t2

    def theirs() -> tuple[float, float]:
        flush()
        t0 = clock()
        out = tlayer(tx)
        t1 = clock()
        flush()
        t2 = clock()
        out.backward(tdy)
        return t1 - t0, clock() - t2

    for _ in range(10):
        ours()
        theirs()
    out = []
    for _ in range(rounds):
        a, b = [], []
        for _ in range(reps):
            a.append(ours())
            b.append(theirs())
        med = [1e6 * statistics.median(s[i] for s in samples) for samples in (a, b)
               for i in (0, 1)]
        out.append(dict(zip(("ours_fwd_us", "ours_bwd_us", "torch_fwd_us", "torch_bwd_us"),
                            med)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="2,8,4,4", help="N,C,H,W of the blocks")
    p.add_argument("--flush-mib", type=float, default=8.0,
                   help="MiB copied before each pass to clear the caches (0: none)")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    problems = []  # the same verdict on every rank: all exit alike, rank 0 says why
    if torch is None:
        problems.append("needs PyTorch (the bench extra: pip install -e '.[bench]')")
    try:
        shape = tuple(int(s) for s in args.shape.split(","))
        if len(shape) != 4 or min(shape) < 1:
            raise ValueError
    except ValueError:
        problems.append(f"--shape must be four positive ints N,C,H,W, got {args.shape!r}")
    if args.flush_mib < 0 or args.reps < 1 or args.rounds < 1:
        problems.append("--flush-mib must be >= 0, --reps and --rounds >= 1")
    if MPI.COMM_WORLD.Get_size() != 1:
        problems.append("runs on one process")
    if problems:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print("bench_layer_calls: " + "; ".join(problems), file=sys.stderr)
        return 2
    nn_kernels.limit_threads(1, kernels="torch")
    torch.set_num_threads(1)
    n = int(args.flush_mib * 2**20 / 8 / 2)
    src, dst = np.ones(max(n, 1)), np.ones(max(n, 1))

    def flush() -> None:
        if n:
            np.copyto(dst, src)

    rows = []
    total = []
    for name, layer, tlayer in _layers(shape[1]):
        per_round = bench_layer(layer, tlayer, shape, flush, args.reps, args.rounds)
        excess = [r["ours_fwd_us"] + r["ours_bwd_us"] - r["torch_fwd_us"] - r["torch_bwd_us"]
                  for r in per_round]
        mid = sorted(range(len(excess)), key=excess.__getitem__)[len(excess) // 2]
        rows.append({"layer": name, **{k: round(v, 1) for k, v in per_round[mid].items()},
                     "excess_us": round(excess[mid], 1),
                     "excess_range_us": f"{min(excess):.0f}-{max(excess):.0f}",
                     "rounds": per_round})
        total.append([e * RESNET18_COUNTS[name] / 1e3 for e in excess])
    resnet18 = [sum(t[i] for t in total) for i in range(args.rounds)]
    cols = ["layer", "ours_fwd_us", "ours_bwd_us", "torch_fwd_us", "torch_bwd_us", "excess_us",
            "excess_range_us"]
    print_table(rows, cols)
    print(f"\nResNet-18's layer counts: {statistics.median(resnet18):.2f} ms a step beyond "
          f"PyTorch's (rounds {', '.join(f'{v:.2f}' for v in resnet18)})")
    path = write_json("bench_layer_calls", rows, shape=list(shape), flush_mib=args.flush_mib,
                      reps=args.reps, rounds=args.rounds, resnet18_ms=resnet18)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
