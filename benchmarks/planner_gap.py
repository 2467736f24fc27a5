"""How far the planner's overlapped-step plans are from the best of all assignments.

Runs in one process::

    python benchmarks/planner_gap.py [--cases 300] [--seed 0]

Random small networks (convolutions, strided convolutions, batch norm, ReLU,
pooling, residual blocks), 2 or 4 ranks, random link and compute constants
and bucket sizes: each plan's critical-path time is compared with the
minimum over every assignment of candidates to layers (brute force).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

import disttensor_nn as nn
from disttensor_nn.plan import CostModel, MachineProfile, Planner

KINDS = ["conv", "convs2", "bn", "relu", "pool", "res", "resconv"]


def build(kinds: list[str], c: int) -> nn.Sequential:
    layers = []
    for i, k in enumerate(kinds):
        if k == "conv":
            layers.append(nn.Conv2d(c, c, 3, padding=1, seed=i))
        elif k == "convs2":
            layers.append(nn.Conv2d(c, c, 3, stride=2, padding=1, seed=i))
        elif k == "bn":
            layers.append(nn.BatchNorm2d(c))
        elif k == "relu":
            layers.append(nn.ReLU())
        elif k == "pool":
            layers.append(nn.MaxPool2d(2))
        elif k == "res":
            layers.append(nn.Residual(nn.Sequential(nn.Conv2d(c, c, 3, padding=1, seed=i),
                                                    nn.ReLU()), None, nn.ReLU()))
        else:
            layers.append(nn.Residual(nn.Conv2d(c, c, 3, stride=2, padding=1, seed=i),
                                      nn.Conv2d(c, c, 1, stride=2, seed=i + 100)))
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    gaps = []
    for _ in range(args.cases):
        kinds = list(rng.choice(KINDS, size=rng.integers(1, 6)))
        size, batch = int(rng.choice([8, 12, 16])), int(rng.choice([1, 2, 4]))
        nprocs, c = int(rng.choice([2, 4])), int(rng.choice([4, 16, 64]))
        model = build(kinds, c)
        shape = (batch, c, size, size)
        try:
            model.output_shape(shape)
        except ValueError:  # windows larger than their input
            continue
        alpha, beta = 10 ** rng.uniform(-7, -2), 10 ** rng.uniform(-12, -7)
        prof = MachineProfile(
            name="random", p2p_alpha=alpha, p2p_beta=beta, allreduce_alpha=2 * alpha,
            allreduce_beta=beta * 10 ** rng.uniform(-1, 2), alltoall_alpha=alpha,
            alltoall_beta=3 * beta, peak_flops=10 ** rng.uniform(6, 12), efficiency=0.5,
            mem_bandwidth=1e10, memory_per_rank=2**30)
        cost = CostModel(prof, nprocs, bucket_bytes=float(rng.choice([1e2, 1e4, 1e7])))
        planner = Planner(model, shape, cost)
        if len(planner.cands) ** len(planner.nodes) > 20000:
            planner = Planner(model, shape, cost,
                              allowed=[(nprocs, 1, 1), (1, nprocs, 1), (1, 1, nprocs)])
        nodes, n = planner.nodes, len(planner.cands)
        brute = min(planner.assignment_cost({id(node): k for node, k in zip(nodes, a)})[0]
                    for a in itertools.product(range(n), repeat=len(nodes)))
        gaps.append(planner.plan().time / brute - 1)
    g = np.array(gaps)
    print(f"{len(g)} networks: optimal in {100 * np.mean(g < 1e-9):.1f}%, median gap "
          f"{100 * np.median(g):.3f}%, 95th percentile {100 * np.quantile(g, 0.95):.3f}%, "
          f"largest {100 * g.max():.3f}%")


if __name__ == "__main__":
    main()
