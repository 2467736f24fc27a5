"""Wide layers at 2 ranks: the planner with channel/filter splits against uniform plans.

Run (unset the OpenBLAS overrides for this command only)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE mpiexec -n 2 python \\
        benchmarks/bench_channel_filter_plan.py [--batch 2] [--channels 512] [--size 14]

The network is three wide 3x3 convolutions, each followed by batch norm and
ReLU (``Conv2d(C/2, C)``, ``Conv2d(C, C)``, ``Conv2d(C, C)``, as in the last
stages of ResNet-50), global average pooling and a ``Linear(C, 10)``, on an
(N, C/2, S, S) float32 batch (default 2x256x14x14). It measures the time
per training step (forward, backward, SGD step; the slowest rank; the
median of ``--iters`` steps in each of ``--rounds`` rounds interleaved over
the plans, each round starting at another plan, the fastest round kept) of:

* ``planner``: the planner's plan over every grid (N, C, H, W) of 2 ranks
  with channel and filter splits, each convolution in its cheapest mode, on
  this machine's calibrated profile with the kernels measured in this run;
* the uniform plans: ``sample`` (2, 1, 1, 1), ``spatial H`` (1, 1, 2, 1),
  and on (1, 2, 1, 1) every convolution ``channel``-parallel, ``filter``-
  parallel or filter-parallel on the gathered input (``C=F``) (the DP
  placing the other layers' channels split or whole);
* the baseline: PyTorch's same network in one process on one thread
  (``torch.set_num_threads(1)``), timed on rank 0 in the same run while
  rank 1 waits.

It prints each plan's predicted and measured time (median and range) and
the ratio to the best uniform plan, and writes
``benchmarks/results/bench_channel_filter_plan.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from _common import plan_step_times, print_table, write_json
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor_nn.plan import CostModel, KernelTimer, Planner, load_profile
from disttensor_nn.plan.calibrate import calibrate_if_stale
from disttensor_nn.plan.costmodel import machine_id


def wide_net(c: int) -> nn.Sequential:
    """Three wide 3x3 convolutions with batch norm and ReLU, pooling and a classifier."""
    layers: list = []
    for i, (a, b) in enumerate([(c // 2, c), (c, c), (c, c)]):
        layers += [nn.Conv2d(a, b, 3, padding=1, seed=i), nn.BatchNorm2d(b), nn.ReLU()]
    return nn.Sequential(*layers, nn.GlobalAvgPool(), nn.Linear(c, 10))


def torch_times(c: int, shape, iters: int) -> list[float] | None:
    """Seconds per training step of the same network in PyTorch (one process, one thread)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    layers: list = []
    for a, b in [(c // 2, c), (c, c), (c, c)]:
        layers += [torch.nn.Conv2d(a, b, 3, padding=1), torch.nn.BatchNorm2d(b),
                   torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(c, 10))
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    x = torch.randn(shape)
    target = torch.rand(shape[0], 10)
    times = []
    for it in range(iters + 1):
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(net(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if it:
            times.append(time.perf_counter() - t0)
    return times


def sleep_until(req: MPI.Request) -> None:
    while not req.Test():
        time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--size", type=int, default=14)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2 or min(args.batch, args.channels, args.size, args.iters,
                                   args.rounds) < 1 or args.channels % 2:
        if comm.rank == 0:
            print("run with 2 ranks and positive sizes (even --channels): mpiexec -n 2 python "
                  "benchmarks/bench_channel_filter_plan.py")
        raise SystemExit(2)
    dt.limit_blas_threads()
    calibrate_if_stale(comm)  # none yet, or taken with another number of ranks per node
    profile = load_profile("this")
    cache_dir = comm.bcast(tempfile.mkdtemp(prefix="disttensor-kernels-") if comm.rank == 0
                           else None)
    c = args.channels
    shape = (args.batch, c // 2, args.size, args.size)
    model = wide_net(c)
    timer = KernelTimer(machine_id(profile), cache_dir=cache_dir)
    planner = Planner(model, shape, CostModel(profile, 2, timer), channels=True)
    start = time.perf_counter()
    planner.calibrate(comm)
    calibration = time.perf_counter() - start
    plans = None
    if comm.rank == 0:
        plans = {"planner": planner.plan(),
                 "sample": planner.uniform_plan((2, 1, 1, 1)),
                 "spatial H": planner.uniform_plan((1, 1, 2, 1))}
        for name, mode in [("channel", "channel"), ("filter", "filter"), ("C=F", "gathered")]:
            plans[name] = Planner(model, shape, CostModel(profile, 2, timer),
                                  allowed=[(1, 2, 1, 1)], channels=True, modes=(mode,)).plan()
        print(plans["planner"].table())
    plans = comm.bcast(plans, root=0)
    samples: dict[str, list[list[float]]] = {k: [] for k in plans}
    samples["PyTorch, 1 process"] = []
    order = list(plans)
    for r in range(args.rounds):  # each round starts at another plan
        for key in order[r % len(order):] + order[:r % len(order)]:
            samples[key].append(plan_step_times(model, shape, plans[key], comm, args.iters))
        if comm.rank == 0:
            got = torch_times(c, shape, args.iters)
            if got is not None:
                samples["PyTorch, 1 process"].append(got)
        sleep_until(comm.Ibarrier())
    if comm.rank:
        return
    best = {k: min(v, key=statistics.median) for k, v in samples.items() if v}
    med = {k: statistics.median(v) for k, v in best.items()}
    uniform = [k for k in plans if k != "planner"]
    top = min(uniform, key=med.get)

    def layout(plan):
        return [(e.grid, e.split_channels, e.mode) for e in plan.entries]

    same = [k for k in uniform if layout(plans[k]) == layout(plans["planner"])]
    for e, f in zip(plans["planner"].entries, plans[top].entries):
        if (e.grid, e.split_channels, e.mode) != (f.grid, f.split_channels, f.mode):
            print(f"planner vs {top}: layer {e.name} {e.layer}: {e.grid} "
                  f"{'split' if e.split_channels else 'whole'} {e.mode} vs {f.grid} "
                  f"{'split' if f.split_channels else 'whole'} {f.mode}")
    rows = []
    for key, times in best.items():
        plan = plans.get(key)
        rows.append({
            "plan": key,
            "conv modes": " ".join(f"{e.grid}{e.mode[:4] and ':' + e.mode[:4]}"
                                   for e in plan.entries if e.layer == "Conv2d")
            if plan else "-",
            "predicted_ms": 1e3 * plan.time if plan else float("nan"),
            "measured_ms": 1e3 * med[key], "min_ms": 1e3 * min(times),
            "max_ms": 1e3 * max(times),
            "vs_best_uniform": med[key] / med[top],
        })
    print_table(rows, list(rows[0]))
    print(f"best uniform plan: {top}; planner / best uniform = "
          f"{med['planner'] / med[top]:.3f}; the planner's plan is "
          + (f"the same as {', '.join(same)}" if same else "none of the uniform plans")
          + f"; calibration {calibration:.1f} s")
    print("wrote", write_json("bench_channel_filter_plan", rows, shape=shape,
                              best_uniform=top, ratio=med["planner"] / med[top],
                              planner_same_as=same))


if __name__ == "__main__":
    main()
