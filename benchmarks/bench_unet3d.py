"""3-D U-Net on one 1 x 128^3 volume: time per step and peak memory per rank, 1 vs P ranks.

Run (timing: nothing else running; unset the OpenBLAS overrides):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE mpiexec -n 2 python benchmarks/bench_unet3d.py \
        [--size 128] [--width 4] [--depth 4] [--norm group] [--reps 5]

The network is ``models.unet(3, 1, 2, depth, width, norm)`` (float32; the
papers' widths are 32-64, reduced here) trained with a per-voxel
cross-entropy and SGD on ``SegmentationSynthetic`` data, batch 1. In one
``mpiexec -n P`` job:

1. all P ranks train it with the volume split D x H over a ``--grid`` (default
   all ranks along D)
   (each rank generates only its block of the volume and the labels; the
   layers derive their distributions, the U-Net's Concat redistributes where
   the pooled cuts differ);
2. rank 0 alone trains the same network (a 1-rank grid over COMM_SELF)
   while the others wait without spinning;
3. rank 0 runs the same network in PyTorch (weights copied, first losses
   compared) with 1 thread and with P threads: the whole-step baseline on
   the same cores.

Per configuration: median and range of ``--reps`` timed steps (after one
untimed step); peak resident memory per rank over the training steps
(``VmHWM`` restarted after the set-up, freed heap returned first) and the
process baseline before the model and data existed; and the inference peak:
an eval-mode forward pass whose layers drop what they keep for backward and
the kernels' scratch as soon as they have run (forward hooks, as
``disttensor-predict``), i.e. the activations an inference pass needs. With
``--map-large`` every large array is mapped on its own
(:func:`disttensor_nn.memory.map_large_allocations`, as the tools do under
``--memory-per-rank``), so freed ones leave the resident set. Rows go to a table and to
``benchmarks/results/bench_unet3d_pP_DxH.json``.
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
from disttensor_nn import SGD, CrossEntropyLoss
from disttensor_nn.container import Sequential, Skip
from disttensor_nn.kernels import numpy_kernels
from disttensor_nn.layers.conv import Conv3d
from disttensor_nn.layers.elementwise import ReLU
from disttensor_nn.layers.groupnorm import GroupNorm
from disttensor_nn.layers.norm import BatchNorm3d
from disttensor_nn.layers.pool import MaxPool3d
from disttensor_nn.layers.transpose import ConvTranspose3d
from disttensor_nn.memory import (
    map_large_allocations,
    peak_resident_bytes,
    release_free_memory,
    reset_peak,
    resident_bytes,
)
from disttensor_nn.models import unet
from disttensor_nn.plan.make import wait_for_root
from disttensor_nn.training.volumes import SegmentationSynthetic

try:
    import torch
    from torch import nn
except ImportError:  # torch is an optional benchmark extra
    torch = None

MIB = 2.0**20


# ---------------------------------------------------------------- the PyTorch twin
if torch is not None:
    class TorchSkip(nn.Module):
        def __init__(self, branch, post):
            super().__init__()
            self.branch, self.post = branch, post

        def forward(self, x):
            return self.post(torch.cat([self.branch(x), x], dim=1))


def to_torch(layer: Any) -> Any:
    """The PyTorch module computing what ``layer`` computes, with its weights copied."""
    def param(a):
        return nn.Parameter(torch.from_numpy(np.array(a, copy=True)))

    if isinstance(layer, Skip):
        return TorchSkip(to_torch(layer.branch), to_torch(layer.post))
    if isinstance(layer, Sequential):
        return nn.Sequential(*(to_torch(child) for child in layer))
    if isinstance(layer, (Conv3d, ConvTranspose3d)):
        s = layer.spec
        pad = tuple(lo for lo, _ in s.padding)
        if isinstance(layer, Conv3d):
            m = nn.Conv3d(layer.in_channels, layer.out_channels, s.kernel, s.stride, pad,
                          s.dilation, layer.groups, layer.bias is not None)
        else:
            m = nn.ConvTranspose3d(layer.in_channels, layer.out_channels, s.kernel, s.stride,
                                   pad, layer.output_padding, layer.groups,
                                   layer.bias is not None, s.dilation)
        m.weight = param(layer.weight.data)
        if layer.bias is not None:
            m.bias = param(layer.bias.data)
        return m
    if isinstance(layer, GroupNorm):
        m = nn.GroupNorm(layer.num_groups, layer.num_channels, layer.eps, layer.affine)
        if layer.affine:
            m.weight, m.bias = param(layer.weight.data), param(layer.bias.data)
        return m
    if isinstance(layer, BatchNorm3d):
        m = nn.BatchNorm3d(layer.num_features, layer.eps, layer.momentum, layer.affine)
        if layer.affine:
            m.weight, m.bias = param(layer.weight.data), param(layer.bias.data)
        return m
    if isinstance(layer, ReLU):
        return nn.ReLU()
    if isinstance(layer, MaxPool3d):
        return nn.MaxPool3d(layer.spec.kernel, layer.spec.stride)
    raise TypeError(f"no PyTorch equivalent for {type(layer).__name__}")


def leaves(model: Any) -> list[Any]:
    """The layers of ``model`` without sub-layers."""
    return [m for m in model.modules() if not any(True for _ in m.children())]


def timed(fn, comm: MPI.Comm, reps: int) -> list[float]:
    fn()  # untimed
    out = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        out.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return out


def ours(comm: MPI.Comm, args, data) -> dict[str, Any]:
    """Train and infer on ``comm``'s ranks (D x H split); times and memory per rank."""
    p = comm.Get_size()
    release_free_memory()
    base = resident_bytes()
    grid = dt.ProcessGrid(args.grid if p > 1 else (1, 1), comm)
    shape = (1, 1, *(args.size,) * 3)
    dist = dt.Distribution(shape, grid, (None, None, 0, 1, None))
    model = unet(3, 1, 2, depth=args.depth, width=args.width, norm=args.norm, seed=0)
    x, y = data.batch([0], dist)
    model[0].input_grad = False  # fed data
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = CrossEntropyLoss()
    losses = []

    def step():
        opt.zero_grad()
        losses.append(loss_fn(model(x), y))
        model.call_backward(loss_fn.backward())
        opt.step()

    step()  # allocates the optimiser's state, warms the caches
    release_free_memory()
    reset_peak()
    steps = timed(step, comm, args.reps)
    train_peak = peak_resident_bytes()
    # inference: eval mode, every layer drops what it kept as soon as it has run
    model.eval()
    def drop(layer, _x, _y):  # as disttensor-predict: nothing saved, no scratch kept
        layer.release_saved()
        numpy_kernels.release_workspace()

    handles = [m.register_forward_hook(drop) for m in leaves(model)]
    for m in model.modules():
        m.release_saved()
    opt.zero_grad()
    release_free_memory()
    before_eval = resident_bytes()
    reset_peak()
    infer = timed(lambda: model(x), comm, max(1, args.reps // 2))
    eval_peak = peak_resident_bytes()
    for h in handles:
        h.remove()
    per_rank = comm.gather((base, train_peak, before_eval, eval_peak), root=0)
    return {"steps": steps, "infer": infer, "first_loss": losses[0], "per_rank": per_rank,
            "params": sum(q.data.size for q in model.parameters()), "model": model}


def torch_run(model: Any, data, args, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    release_free_memory()
    base = resident_bytes()
    tm = to_torch(model)
    xg, yg = data.sample(0)
    tx = torch.from_numpy(xg[None].copy())
    ty = torch.from_numpy(yg.astype(np.int64).copy())  # (1, D, H, W)
    tloss = nn.CrossEntropyLoss()
    topt = torch.optim.SGD(tm.parameters(), lr=0.01, momentum=0.9)
    losses = []

    def step():
        topt.zero_grad()
        loss = tloss(tm(tx), ty)
        loss.backward()
        topt.step()
        losses.append(loss.item())

    step()
    release_free_memory()
    reset_peak()
    steps = timed(step, MPI.COMM_SELF, args.reps)
    train_peak = peak_resident_bytes()
    tm.eval()
    topt.zero_grad(set_to_none=True)
    release_free_memory()
    reset_peak()
    with torch.no_grad():
        infer = timed(lambda: tm(tx), MPI.COMM_SELF, max(1, args.reps // 2))
    eval_peak = peak_resident_bytes()
    return {"steps": steps, "infer": infer, "first_loss": losses[0],
            "per_rank": [(base, train_peak, base, eval_peak)],
            "params": sum(q.numel() for q in tm.parameters())}


def row(name: str, ranks: int, threads: int, r: dict[str, Any]) -> dict[str, Any]:
    ts, inf = r["steps"], r["infer"]
    base = max(b for b, _, _, _ in r["per_rank"])
    train = max(t for _, t, _, _ in r["per_rank"])
    ev = max(e for _, _, _, e in r["per_rank"])
    return {"config": name, "ranks": ranks, "threads": threads,
            "step_s": statistics.median(ts), "step_range_s": f"{min(ts):.2f}-{max(ts):.2f}",
            "infer_s": statistics.median(inf),
            "train_peak_MiB": train / MIB, "train_above_base_MiB": (train - base) / MIB,
            "infer_peak_MiB": ev / MIB, "infer_above_base_MiB": (ev - base) / MIB,
            "base_MiB": base / MIB, "first_loss": r["first_loss"], "params": r["params"],
            "step_times_s": ts, "infer_times_s": inf,
            "per_rank_MiB": [[v / MIB for v in t] for t in r["per_rank"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--norm", default="group", choices=("batch", "group", "instance", "none"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--grid", default=None,
                    help="ranks along D and H, e.g. 2x1 (default: all ranks along D)")
    ap.add_argument("--map-large", action="store_true",
                    help="map every large array on its own (map_large_allocations, as the "
                         "tools do under --memory-per-rank): freed arrays leave the process, "
                         "new ones cost page faults")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    try:
        args.grid = tuple(int(v) for v in (args.grid or f"{p}x1").split("x"))
    except ValueError:
        args.grid = ()
    if len(args.grid) != 2 or args.grid[0] * args.grid[1] != p:
        if rank == 0:
            print(f"--grid must be DxH with D * H = {p} ranks, e.g. {p}x1", file=sys.stderr)
        return 2
    if args.size % 2 ** (args.depth - 1) or min(args.size, args.width, args.reps) < 1:
        if rank == 0:
            print(f"--size must be divisible by 2**(depth-1) = {2 ** (args.depth - 1)}, and "
                  "sizes, widths and reps positive", file=sys.stderr)
        return 2
    dt.limit_blas_threads(1)
    if args.map_large:
        map_large_allocations()
    data = SegmentationSynthetic(1, (args.size,) * 3, channels=1, classes=2, seed=0)
    rows = []
    split = ours(comm, args, data)
    del split["model"]
    if rank == 0:
        rows.append(row(f"disttensor D x H {args.grid}", p, 1, split))
    if p > 1:
        if rank == 0:
            single = ours(MPI.COMM_SELF, args, data)
            del single["model"]
            rows.append(row("disttensor 1 rank", 1, 1, single))
            if torch is not None:  # the untrained network, as ours started from
                for threads in sorted({1, p}):
                    rows.append(row(f"torch {threads} thread(s)", 1, threads,
                                    torch_run(split_model(args), data, args, threads)))
        wait_for_root(comm)
    elif torch is not None:
        rows.append(row("torch 1 thread(s)", 1, 1, torch_run(split_model(args), data, args, 1)))
    if rank == 0:
        one = next((r for r in rows if r["config"] == "disttensor 1 rank"), rows[0])
        for r in rows:
            r["train_vs_1rank"] = r["train_peak_MiB"] / one["train_peak_MiB"]
            r["train_above_base_vs_1rank"] = r["train_above_base_MiB"] / \
                one["train_above_base_MiB"]
            r["infer_above_base_vs_1rank"] = r["infer_above_base_MiB"] / \
                one["infer_above_base_MiB"]
            r["infer_vs_1rank"] = r["infer_peak_MiB"] / one["infer_peak_MiB"]
        print(f"3-D U-Net depth {args.depth} width {args.width} norm {args.norm} on "
              f"1 x 1 x {args.size}^3, float32, batch 1; {p} rank(s)")
        print_table(rows, ["config", "step_s", "step_range_s", "infer_s", "train_peak_MiB",
                           "train_vs_1rank", "train_above_base_MiB", "infer_peak_MiB",
                           "infer_vs_1rank", "infer_above_base_MiB", "first_loss"])
        path = write_json(f"bench_unet3d_p{p}_{args.grid[0]}x{args.grid[1]}", rows,
                          size=args.size, width=args.width, depth=args.depth, norm=args.norm,
                          reps=args.reps, grid=args.grid, map_large=args.map_large)
        print(f"wrote {path}")
    return 0


def split_model(args) -> Any:
    return unet(3, 1, 2, depth=args.depth, width=args.width, norm=args.norm, seed=0)


if __name__ == "__main__":
    sys.exit(main())
