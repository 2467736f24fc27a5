"""A whole training step (forward, loss, backward, SGD) of disttensor vs the same PyTorch model.

Run (unset the OpenBLAS overrides for timing only):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_step.py \
        [--models mesh-demo,resnet18] [--threads 1] [--reps 7] [--rounds 3] [--kernels torch]
        [--heap warm] [--memory-format channels_last] [--torch-memory-format channels_last]
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE mpiexec -n 2 python benchmarks/bench_step.py

Models (float32): ``mesh-demo`` (batch 4, 18x256x256), ``resnet18`` (batch 8,
3x112x112), ``resnet50`` (batch 4, 3x224x224) and ``mesh-narrow`` (the mesh
FCN at widths 16-64, batch 2, 18x512x512). The PyTorch model is built layer
by layer from ours (Conv2d, BatchNorm2d, ReLU, MaxPool2d, Sigmoid,
DepthToSpace as PixelShuffle, GlobalAvgPool, Linear, residual blocks) with
our weights copied, so the parameter counts are equal and the first losses
must agree (checked and printed).

With one rank, both run in this process with ``--threads`` threads: torch's
intra-op threads, and ours in the kernels' pool
(``disttensor_nn.kernels.set_num_threads``, BLAS single-threaded) or, with
``--threads-in blas``, in BLAS alone; with ``--kernels torch``, as the
training driver sets them (``disttensor_nn.kernels.limit_threads``):
PyTorch's and the NumPy kernels' pool both. With several ranks, ours splits
the batch over the ranks (sample parallelism, gradients summed by the
layers) and torch runs DistributedDataParallel over gloo on the same ranks,
one thread each. Our step reduces the gradients in ``GradientBuckets`` of
``--bucket-bytes`` (non-blocking, overlapped with backward), as the training
driver does. Our batch norms take their statistics over the whole batch (a sum
over the ranks in each layer's forward and backward, as one process on the
whole batch), where PyTorch's under DDP take each rank's own;
``--bn-stats group`` gives ours PyTorch's semantics (``BatchNorm2d(stats=
"group")``) for a like-for-like comparison.

Timing: ``--rounds`` alternating blocks of ours and torch (an untimed step,
then ``reps / rounds`` timed ones each), so that one library's idle thread
pools do not slow the other; medians and ranges (slowest rank per step), and
the ratio of the two fastest steps (``ratio_of_minima``: where other guests
share the machine they only add time, so the minima move least).
Both libraries run with the C allocator as the process starts, where large
scratch (oneDNN's reorders of a block, among others) is mapped afresh at each
call; ``--heap warm`` gives both the training driver's settings for its steps
(``map_large_allocations`` and ``keep_heap_top`` at ``--heap-mib``, 256 MiB), so
that such scratch stays in the heap from call to call.
``--memory-format channels_last`` runs our layers on channels-last blocks
(the input put so at each step, the copy timed;
``disttensor_nn.layout.to_memory_format``); ``--torch-memory-format
channels_last`` converts PyTorch's model and input so (the baseline as its
user would tune it; by default the model as written).
The per-layer-type breakdown comes from separate steps with forward and
backward hooks on every leaf layer (ours: the library's hooks; torch:
module hooks), so it includes the hooks' small overhead and is not used for
the totals. PyTorch's full backward hook on the first layer, whose input
needs no gradient, fires before that layer's weight gradient is computed:
that gradient's time is in none of PyTorch's per-layer clocks (the first
convolution's backward reads near 0 there), only in the totals. JSON goes to
``benchmarks/results/bench_step_MODELS_pN_tM.json``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
from _common import print_table, write_json
from mpi4py import MPI

import disttensor as dt
from disttensor.blockcache import BlockCache, block_cache
from disttensor_nn import SGD, MSELoss, SoftmaxCrossEntropy
from disttensor_nn import kernels as nn_kernels
from disttensor_nn.container import Residual, Sequential
from disttensor_nn.layers.conv import Conv2d
from disttensor_nn.layers.dense import Linear
from disttensor_nn.layers.elementwise import ReLU, Sigmoid
from disttensor_nn.layers.norm import BatchNorm2d, set_batch_norm_stats
from disttensor_nn.layers.pool import GlobalAvgPool, MaxPool2d
from disttensor_nn.layout import MEMORY_FORMATS, to_memory_format
from disttensor_nn.memory import keep_heap_top, map_large_allocations
from disttensor_nn.models import mesh_fcn, resnet
from disttensor_nn.models.mesh import DepthToSpace
from disttensor_nn.reduction import DEFAULT_BUCKET_BYTES, GradientBuckets

try:
    import torch
    import torch.distributed as tdist
    from torch import nn
except ImportError:  # torch is an optional benchmark extra
    torch = None

# name -> (builder, batch, sample shape, loss)
MODELS = {
    "mesh-demo": (lambda: mesh_fcn(widths=(16, 24, 32), convs_per_stage=2), 4,
                  (18, 256, 256), "mse"),
    "resnet18": (lambda: resnet(18), 8, (3, 112, 112), "ce"),
    "resnet50": (lambda: resnet(50), 4, (3, 224, 224), "ce"),
    "mesh-narrow": (lambda: mesh_fcn(widths=(16, 32, 48, 64), convs_per_stage=2), 2,
                    (18, 512, 512), "mse"),
}


# ---------------------------------------------------------------- the PyTorch twin
if torch is not None:
    class TorchResidual(nn.Module):
        def __init__(self, branch, shortcut, post):
            super().__init__()
            self.branch, self.shortcut, self.post = branch, shortcut, post

        def forward(self, x):
            y = self.branch(x) + (self.shortcut(x) if self.shortcut is not None else x)
            return self.post(y) if self.post is not None else y

    class GlobalAvg(nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3))


def _symmetric(padding) -> tuple[int, ...]:
    if any(lo != hi for lo, hi in padding):
        raise ValueError(f"asymmetric padding {padding} has no nn.Conv2d equivalent")
    return tuple(lo for lo, _ in padding)


def to_torch(layer):
    """The PyTorch module computing what ``layer`` computes, with its weights copied."""
    def param(a):
        return nn.Parameter(torch.from_numpy(np.array(a, copy=True)))

    if isinstance(layer, Sequential):
        return nn.Sequential(*(to_torch(child) for child in layer))
    if isinstance(layer, Residual):
        return TorchResidual(*(to_torch(m) if m is not None else None
                               for m in (layer.branch, layer.shortcut, layer.post)))
    if isinstance(layer, Conv2d):
        s = layer.spec
        m = nn.Conv2d(layer.in_channels, layer.out_channels, s.kernel, s.stride,
                      _symmetric(s.padding), s.dilation, layer.groups, layer.bias is not None)
        m.weight = param(layer.weight.data)
        if layer.bias is not None:
            m.bias = param(layer.bias.data)
        return m
    if isinstance(layer, BatchNorm2d):
        m = nn.BatchNorm2d(layer.num_features, layer.eps, layer.momentum, layer.affine)
        if layer.affine:
            m.weight, m.bias = param(layer.weight.data), param(layer.bias.data)
        return m
    if isinstance(layer, ReLU):
        return nn.ReLU()
    if isinstance(layer, Sigmoid):
        return nn.Sigmoid()
    if isinstance(layer, MaxPool2d):
        s = layer.spec
        return nn.MaxPool2d(s.kernel, s.stride, _symmetric(s.padding), s.dilation)
    if isinstance(layer, DepthToSpace):
        return nn.PixelShuffle(layer.block)
    if isinstance(layer, GlobalAvgPool):
        return GlobalAvg()
    if isinstance(layer, Linear):
        m = nn.Linear(layer.in_features, layer.out_features, layer.bias is not None)
        m.weight = param(layer.weight.data)
        if layer.bias is not None:
            m.bias = param(layer.bias.data)
        return m
    raise TypeError(f"no PyTorch equivalent for {type(layer).__name__}")


# ---------------------------------------------------------------- per-layer-type clocks
def hook_clocks(named: list[tuple[str, Any]]) -> tuple[dict[str, list[float]], list]:
    """Forward and backward seconds per layer type, kept by hooks on each ``(type, layer)``
    (both libraries' layers take the same four hooks)."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    handles = []
    for name, layer in named:
        start = [0.0]

        def begin(*_, start=start):
            start[0] = time.perf_counter()

        def end_f(*_, start=start, name=name):
            totals[name][0] += time.perf_counter() - start[0]

        def end_b(*_, start=start, name=name):
            totals[name][1] += time.perf_counter() - start[0]

        handles += [layer.register_forward_pre_hook(begin), layer.register_forward_hook(end_f),
                    layer.register_full_backward_pre_hook(begin),
                    layer.register_full_backward_hook(end_b)]
    return totals, handles


def ours_clocks(model) -> tuple[dict[str, list[float]], list]:
    """:func:`hook_clocks` on every leaf layer of our model."""
    return hook_clocks([(type(layer).__name__, layer) for _, layer in model.named_modules()
                        if not isinstance(layer, (Sequential, Residual))])


def torch_clocks(model) -> tuple[dict[str, list[float]], list]:
    """:func:`hook_clocks` on every leaf module of the torch model, named as ours."""
    rename = {"PixelShuffle": "DepthToSpace", "GlobalAvg": "GlobalAvgPool"}
    return hook_clocks([(rename.get(type(m).__name__, type(m).__name__), m)
                        for m in model.modules() if not list(m.children())])


# ---------------------------------------------------------------- one model
def bench_model(name: str, args, comm: MPI.Comm) -> tuple[dict, list[dict]]:
    size = comm.Get_size()
    build, batch, sample, loss_kind = MODELS[name]
    rng = np.random.default_rng(1234)
    x_all = rng.standard_normal((batch, *sample)).astype(np.float32)
    model = build()
    nn_kernels.use_kernels(model, args.kernels)
    set_batch_norm_stats(model, args.bn_stats)
    out_shape = model.output_shape(x_all.shape)
    if loss_kind == "mse":
        t_all = rng.random(out_shape).astype(np.float32)
        loss_fn = MSELoss()
    else:
        t_all = rng.integers(0, out_shape[1], batch)
        loss_fn = SoftmaxCrossEntropy()
    grid = dt.ProcessGrid((size,), comm)
    dist = dt.Distribution(x_all.shape, grid, (0, None, None, None))
    x = dt.DistArray.from_local(np.ascontiguousarray(x_all[dist.local_slices()]), dist)
    torch_model = to_torch(model) if torch is not None else None  # before any update
    model[0].input_grad = False  # fed data, as torch's input that requires no gradient
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt.kernel_backend = nn_kernels.optimizer_backend((args.kernels,))  # as the driver's

    def ours_step() -> float:
        opt.zero_grad()
        # the input in the layers' memory format: a copy each step where it differs
        loss = loss_fn(model(to_memory_format(x, args.memory_format)), t_all)
        if args.bucket_bytes:
            with GradientBuckets(args.bucket_bytes):
                model.call_backward(loss_fn.backward())
        else:
            model.call_backward(loss_fn.backward())
        opt.step()
        return loss

    cache = BlockCache()  # kept warm between the steps, as the training driver's

    def cached_step() -> float:
        with block_cache(cache=cache):
            return ours_step()

    steps = {"disttensor": cached_step if args.block_cache != "off" else ours_step}
    first = {"disttensor": steps["disttensor"]()}
    if args.block_cache == "both":  # today's blocks, mapped afresh each step, beside it
        steps["disttensor_nocache"] = ours_step
        first["disttensor_nocache"] = first["disttensor"]
    if torch is not None:
        lo, hi = dist.local_slices()[0].start, dist.local_slices()[0].stop
        tx = torch.from_numpy(x_all[lo:hi].copy())
        tt = torch.from_numpy(t_all[lo:hi].copy())
        torch_format = torch.channels_last if args.torch_memory_format == "channels_last" \
            else torch.contiguous_format
        torch_model.to(memory_format=torch_format)  # its parameters (the model as written:
        # contiguous ones)
        tm = torch_model
        if size > 1:
            tm = nn.parallel.DistributedDataParallel(torch_model)
        tloss = nn.MSELoss() if loss_kind == "mse" else nn.CrossEntropyLoss()
        topt = torch.optim.SGD(tm.parameters(), lr=0.01, momentum=0.9)

        def torch_step() -> float:
            topt.zero_grad()
            loss = tloss(tm(tx.contiguous(memory_format=torch_format)), tt)
            loss.backward()
            topt.step()
            return loss.item()

        steps["torch"] = torch_step
        # torch's mean is over this rank's block; the global mean averages the ranks'
        first["torch"] = comm.allreduce(torch_step(), op=MPI.SUM) / size
    samples: dict[str, list[float]] = {k: [] for k in steps}
    per_round = max(1, args.reps // args.rounds)
    for _ in range(args.rounds):
        for key, fn in steps.items():
            fn()  # untimed: wakes this library's threads
            for _ in range(per_round):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                samples[key].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    row = {"model": name, "ranks": size, "threads": args.threads, "kernels": args.kernels,
           "bn_stats": args.bn_stats, "memory_format": args.memory_format,
           "torch_memory_format": args.torch_memory_format,
           "bucket_bytes": args.bucket_bytes,
           "threads_in": args.threads_in, "batch": batch,
           "sample": "x".join(map(str, sample))}
    for key, ts in samples.items():
        row[f"{key}_ms"] = 1e3 * statistics.median(ts)
        row[f"{key}_range_ms"] = [1e3 * min(ts), 1e3 * max(ts)]
        row[f"{key}_first_loss"] = first[key]
    if "disttensor_nocache" in samples:
        row["cache_speedup"] = row["disttensor_nocache_ms"] / row["disttensor_ms"]
    if "torch" in samples:
        row["ratio"] = row["disttensor_ms"] / row["torch_ms"]
        # the fastest step of each: on a shared machine the other guests only add time, so
        # the minima's ratio moves least from run to run
        row["ratio_of_minima"] = row["disttensor_range_ms"][0] / row["torch_range_ms"][0]
        row["params"] = sum(p.data.size for p in model.parameters())
        row["torch_params"] = sum(p.numel() for p in torch_model.parameters())
    # per-layer-type breakdown (separate, hooked steps; medians of per-step sums)
    breakdown = []
    clocks = {"disttensor": ours_clocks(model)}
    if torch is not None:
        clocks["torch"] = torch_clocks(torch_model)
    types: dict[str, dict[str, list[float]]] = collections.defaultdict(dict)
    for key, totals_handles in clocks.items():
        fn = steps[key]
        totals, handles = totals_handles
        fn()
        per_step = []
        for _ in range(max(3, per_round)):
            totals.clear()
            fn()
            per_step.append({k: tuple(v) for k, v in totals.items()})
        for h in handles:
            h.remove()
        for k in per_step[0]:
            types[k][key] = [1e3 * statistics.median(s[k][i] for s in per_step) for i in (0, 1)]
    for k, v in sorted(types.items()):
        r = {"model": name, "layer": k}
        for key in clocks:
            fwd, bwd = v.get(key, [float("nan")] * 2)
            r[f"{key}_fwd_ms"], r[f"{key}_bwd_ms"] = fwd, bwd
        breakdown.append(r)
    return row, breakdown


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mesh-demo,resnet18")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES,
                   help="gradient bucket size of our step (GradientBuckets); 0: no buckets, "
                        "each layer's gradients reduced by a blocking allreduce")
    p.add_argument("--threads-in", choices=("kernels", "blas"), default="kernels",
                   help="where our threads go: the kernels' pool (BLAS single-threaded) "
                        "or BLAS alone (with --kernels torch: PyTorch's intra-op threads)")
    p.add_argument("--kernels", choices=nn_kernels.BACKENDS, default="numpy",
                   help="our layers' kernel backend (disttensor_nn.kernels.use_kernels)")
    p.add_argument("--block-cache", choices=("on", "off", "both"), default="on",
                   help="our steps' large blocks from a block cache kept warm between steps "
                        "(as disttensor-train), mapped afresh each step (off), or both, timed "
                        "in alternation (the disttensor_nocache column)")
    p.add_argument("--bn-stats", choices=("global", "group"), default="global",
                   help="our batch norms' statistics: over the whole batch (as one process "
                        "on it; a sum over the ranks per layer and pass) or over each "
                        "rank's samples (as PyTorch's BatchNorm under DDP)")
    p.add_argument("--heap", choices=("default", "warm"), default="default",
                   help="the C allocator as the process starts (both libraries' scratch "
                        "mapped afresh when it is large), or as disttensor-train sets it "
                        "for its steps (scratch of up to --heap-mib kept warm in the heap), "
                        "for both libraries alike (one process)")
    p.add_argument("--heap-mib", type=int, default=256)
    p.add_argument("--memory-format", choices=MEMORY_FORMATS, default="contiguous",
                   help="our blocks' memory format: the input is put in it each step (a "
                        "copy, timed) and the layers that run on channels-last blocks keep "
                        "it (disttensor_nn.layout.to_memory_format)")
    p.add_argument("--torch-memory-format", choices=MEMORY_FORMATS, default="contiguous",
                   help="PyTorch's: the model as written, or converted with "
                        "model.to(memory_format=torch.channels_last) and its input each step")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    names = args.models.split(",")
    bad = [n for n in names if n not in MODELS]
    if bad or min(args.threads, args.reps, args.rounds) < 1 or args.bucket_bytes < 0:
        if comm.Get_rank() == 0:
            print(f"unknown model(s) {bad} (choose from {list(MODELS)}) or a count below 1",
                  file=sys.stderr)
        return 2
    threads = 1 if comm.Get_size() > 1 else args.threads
    args.threads = threads
    if args.heap == "warm":  # as the training driver's steps: large scratch from the heap
        map_large_allocations(args.heap_mib * 2**20)
        keep_heap_top(args.heap_mib * 2**20)
    if args.kernels == "torch":  # as the training driver sets them: PyTorch's intra-op
        # threads, the NumPy kernels' pool of as many (the optimizer's sweep, NumPy layers)
        # and a one-thread BLAS beside them
        nn_kernels.check_backend("torch")
        nn_kernels.limit_threads(threads, kernels="torch")
    elif args.threads_in == "blas":
        dt.limit_blas_threads(threads)
    else:  # our kernels' pool of threads, each calling a one-thread BLAS
        dt.limit_blas_threads(1)
        nn_kernels.set_num_threads(threads)
    if torch is not None:
        torch.set_num_threads(threads)
        if comm.Get_size() > 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000
                                                     if comm.Get_rank() == 0 else 0))
            os.environ["MASTER_PORT"] = comm.bcast(os.environ["MASTER_PORT"])
            tdist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    rows, layers = [], []
    for n in names:
        row, breakdown = bench_model(n, args, comm)
        rows.append(row)
        layers += breakdown
    if comm.Get_rank() == 0:
        cols = ["model", "ranks", "threads", "kernels", "disttensor_ms"]
        if args.block_cache == "both":
            cols += ["disttensor_nocache_ms", "cache_speedup"]
        if torch is not None:
            cols += ["torch_ms", "ratio", "ratio_of_minima"]
        for r in rows:
            for key in ("disttensor", "disttensor_nocache", "torch"):
                if f"{key}_range_ms" in r:
                    lo, hi = r[f"{key}_range_ms"]
                    r[f"{key}_range"] = f"{lo:.0f}-{hi:.0f}"
        print_table(rows, cols + [c for c in ("disttensor_range", "disttensor_nocache_range",
                                              "torch_range") if c in rows[0]])
        print("first losses: " + "; ".join(
            f"{r['model']} {r['disttensor_first_loss']:.6g}"
            + (f" vs torch {r['torch_first_loss']:.6g}" if "torch_first_loss" in r else "")
            for r in rows))
        print("\nper layer type, ms per step (forward / backward; hooked steps):")
        print_table(layers, ["model", "layer"] + [c for c in layers[0] if c.endswith("_ms")])
        for r in rows:
            for key in ("disttensor", "torch"):
                r.pop(f"{key}_range", None)
        tag = f"_{'-'.join(names)}_p{comm.Get_size()}_t{threads}_{args.kernels}" + (
            "" if args.bn_stats == "global" else "_bngroup") + (
            "" if args.heap == "default" else "_warmheap") + (
            "" if args.memory_format == "contiguous" else "_cl") + (
            "" if args.torch_memory_format == "contiguous" else "_torchcl")
        path = write_json(f"bench_step{tag}", rows, layers=layers, reps=args.reps,
                          rounds=args.rounds, heap=args.heap,
                          heap_bytes=args.heap_mib * 2**20 if args.heap == "warm" else None)
        print(f"\nwrote {path}")
    if torch is not None and comm.Get_size() > 1:
        tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
