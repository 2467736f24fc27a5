"""An unchanged PyTorch model under ``parallelize`` against the same model in plain PyTorch.

One rank: the parallelized model (grid of ones) against the plain model in the
same process. Several ranks: the parallelized model with a grid over the
samples (``--split N``) or the height (``--split H``) against
``DistributedDataParallel`` over gloo on the same ranks (each rank its share of
the batch). Training steps (forward, mean squared error, backward, SGD),
interleaved in ``--rounds`` blocks; medians and ranges of the slowest rank.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_torch_parallel.py
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE mpiexec -n 2 python \\
        benchmarks/bench_torch_parallel.py --batch 4 --split N

``--model mesh-small`` takes the registry's mesh-small instead. ``--ceiling`` (several
ranks, ``--split H``) also times the plain model on the whole batch on rank 0 alone (the
others idle) and the two-process ceiling: every rank training the plain model on its
own H-slice at once, with no message and no halo; it prints the speedup of the
parallelized model over one rank and its share of the ceiling's. The ceiling's rounds
are interleaved with the others' (a noisy machine drifts between phases), and the share
is also given round by round: the halves' median over the parallelized steps' median in
the same round (the one-rank time cancels out of the share).

``--bn-stats`` chooses the parallelized model's batch-norm statistics: ``global`` (the
default of ``parallelize``: the whole batch, as one process), ``group`` (each rank's own
samples where the samples are split, as PyTorch's batch norms under DDP take them:
``parallelize(batch_norm_stats="group")``), or ``both`` (the default here: both models,
interleaved, each against the same DDP steps; with ``--split H`` the two are the same and
only ``global`` runs).

``--channels-last`` puts the parallelized model's input blocks in channels-last layout
(``parallelize(memory_format=torch.channels_last)``), and adds the baseline in the same
layout (``ddp-cl``, or ``torch-cl`` on one rank: the reference model and its input
converted, as PyTorch's recipe for it goes), so that the ratios are given against both; the
ceiling's plain halves then run channels-last as well. The input is then converted once,
before the steps, for the parallelized models as for the baseline (without the flag a
parallelized model that chose channels-last converts each step's input block, as it
would a data loader's batch).

``--auto`` lays the parallelized models out by the planner (``layout="auto"``, the
default of ``parallelize``) instead of one grid over ``--split``'s dimension, in the memory
format it predicts faster (``memory_format="auto"``, the default too, unless
``--channels-last``), and prints the plan; ``--split`` then still says how DDP and the
ceiling split the batch.

``--channel-splits`` (with ``--auto``) adds a parallelized model whose planner may split
convolutions' input channels too (``parallelize(channel_splits=True)``,
``parallelize-channels``), timed in the same rounds; with ``--ceiling`` its speedup and
share are printed beside the first's.

``--precision bf16`` runs both forwards under ``torch.autocast`` (bfloat16, float32
weights) and times the parallelized model in float32 beside them (``parallelize-fp32``).

The model is the mesh FCN of ``bench_step.py``'s ``mesh-demo``, converted layer
by layer to plain ``torch.nn``, up to its last convolution (:func:`trunk`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as tdist
from bench_step import MODELS, to_torch
from mpi4py import MPI
from torch import nn

import disttensor as dt
from disttensor_nn.torch import parallelize
from disttensor_nn.training import build_model


def trunk(model) -> nn.Module:
    """The model in plain torch up to its last convolution, without the PixelShuffle
    (DepthToSpace) the mesh FCN ends with: the model every figure of this benchmark since
    its first was taken on (parallelize splits PixelShuffle too now)."""
    layers = list(to_torch(model))
    while not isinstance(layers[-1], nn.Conv2d):
        layers.pop()
    return nn.Sequential(*layers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--split", choices=("N", "H"), default="N")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--model", choices=("mesh-demo", "mesh-small"), default="mesh-demo")
    p.add_argument("--ceiling", action="store_true")
    p.add_argument("--bn-stats", choices=("global", "group", "both"), default="both")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--auto", action="store_true")
    p.add_argument("--channel-splits", action="store_true")
    p.add_argument("--json", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "bench_torch_parallel.json"))
    a = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if min(a.batch, a.size, a.reps, a.rounds) < 1 or (a.split == "N" and a.batch % size) \
            or (a.ceiling and (size < 2 or a.split != "H")):
        if rank == 0:
            print("counts must be >= 1, --split N needs a batch divisible by the ranks, and "
                  "--ceiling several ranks and --split H", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dt.limit_blas_threads(1)
    if a.model == "mesh-demo":
        build = MODELS["mesh-demo"][0]
        channels = 18
    else:
        def build():
            return build_model(a.model, (a.size, a.size), a.batch)[0]
        channels = build_model(a.model, (a.size, a.size), a.batch)[1][1]
    torch.manual_seed(0)
    plain = trunk(build())
    solo = trunk(build())  # the plain model outside DDP, for --ceiling
    solo.load_state_dict(plain.state_dict())
    if a.channels_last:
        solo = solo.to(memory_format=torch.channels_last)
    lasting = trunk(build())  # the baseline in channels-last layout
    lasting.load_state_dict(plain.state_dict())
    lasting = lasting.to(memory_format=torch.channels_last)
    shape = (a.batch, channels, a.size, a.size)
    x_all = torch.rand(shape)
    grid = "auto" if a.auto else (size, 1, 1, 1) if a.split == "N" else (1, 1, size, 1)
    par = trunk(build())
    par.load_state_dict(plain.state_dict())
    # --auto: parallelize's defaults, the memory format the planner's too
    fmt = torch.channels_last if a.channels_last else "auto" if a.auto else None
    pm = parallelize(par, shape, layout=grid, memory_format=fmt)
    x = dt.DistArray.from_global(x_all, pm.input_dist, xp=torch)
    if a.channels_last:  # given in the layout the channels-last baseline's input is given in
        x = dt.DistArray(x.local.contiguous(memory_format=torch.channels_last), x.dist)
    if a.auto and rank == 0:
        print(pm.plan.table())
    grouped = a.split == "N" and size > 1 and a.bn_stats != "global"
    if grouped:
        par_g = trunk(build())
        par_g.load_state_dict(plain.state_dict())
        pm_g = parallelize(par_g, shape, layout=grid, batch_norm_stats="group",
                           memory_format=fmt)
        gopt = torch.optim.SGD(pm_g.parameters(), lr=0.01, momentum=0.9)
        # its own input: with --auto its plan may want another layout than pm's
        x_g = dt.DistArray.from_global(x_all, pm_g.input_dist, xp=torch)
        if a.channels_last:
            x_g = dt.DistArray(x_g.local.contiguous(memory_format=torch.channels_last),
                               x_g.dist)
        if a.auto and rank == 0:
            print(f"with batch_norm_stats='group': blocks {pm_g.plan.memory_format}, "
                  f"predicted {1e3 * pm_g.plan.time:.2f} ms")
    channels = a.auto and a.channel_splits
    if channels:
        par_c = trunk(build())
        par_c.load_state_dict(plain.state_dict())
        pm_c = parallelize(par_c, shape, layout=grid, memory_format=fmt, channel_splits=True)
        copt = torch.optim.SGD(pm_c.parameters(), lr=0.01, momentum=0.9)
        x_c = dt.DistArray.from_global(x_all, pm_c.input_dist, xp=torch)
        if rank == 0:
            print(pm_c.plan.table())
    out_shape = plain(x_all[:1]).shape[1:]
    t_all = torch.rand((a.batch, *out_shape))
    y_dist = None

    popt = torch.optim.SGD(pm.parameters(), lr=0.01, momentum=0.9)
    planned = {"parallelize": pm, **({"parallelize-group": pm_g} if grouped else {}),
               **({"parallelize-channels": pm_c} if channels else {})}

    def cast(on: bool = True) -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=torch.bfloat16) \
            if on and a.precision == "bf16" else contextlib.nullcontext()

    def ours(half: bool = True, model: nn.Module = pm, opt: torch.optim.Optimizer = popt,
             inputs: dt.DistArray = x) -> None:
        nonlocal y_dist
        opt.zero_grad()
        with cast(half):
            y = model(inputs)
        y_dist = y.dist
        t = t_all[y.dist.local_slices()]
        # the global mean: each rank's sum over its block, divided by every element
        loss = ((y.local.float() - t) ** 2).sum() / t_all.numel()
        loss.backward()
        opt.step()

    steps: dict[str, Callable[[], None]] = {}
    if not grouped or a.bn_stats == "both":
        steps["parallelize"] = ours
    if grouped:
        steps["parallelize-group"] = lambda: ours(model=pm_g, opt=gopt, inputs=x_g)
    if channels:
        steps["parallelize-channels"] = lambda: ours(model=pm_c, opt=copt, inputs=x_c)
    if a.precision == "bf16" and "parallelize" in steps:
        steps["parallelize-fp32"] = lambda: ours(False)
    if size == 1:
        ref, ref_cl = plain, lasting
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = comm.bcast(str(29500 + os.getpid() % 1000))
        tdist.init_process_group("gloo", rank=rank, world_size=size)
        ref = nn.parallel.DistributedDataParallel(plain)
        ref_cl = nn.parallel.DistributedDataParallel(lasting) if a.channels_last else None
    lo, hi = a.batch * rank // size, a.batch * (rank + 1) // size
    rx, rt = x_all[lo:hi], t_all[lo:hi]
    rx_cl = rx.contiguous(memory_format=torch.channels_last)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    copt = torch.optim.SGD(lasting.parameters(), lr=0.01, momentum=0.9)

    def theirs(model: nn.Module = ref, opt: torch.optim.Optimizer = ropt,
               inputs: torch.Tensor = rx) -> None:
        opt.zero_grad()
        with cast():
            out = model(inputs)
        loss = ((out.float() - rt) ** 2).mean()
        loss.backward()
        opt.step()

    base = "torch" if size == 1 else "ddp"
    steps[base] = theirs
    if a.channels_last:
        steps[base + "-cl"] = lambda: theirs(ref_cl, copt, rx_cl)
    samples: dict[str, list[float]] = {k: [] for k in steps}
    per = max(1, a.reps // a.rounds)
    # the ceiling's rounds interleaved with these, so that both see the same machine: its
    # share of a round is that round's halves' median over its parallelized steps' median
    ceiling_round = _ceiling_round(a, comm, solo, x_all, t_all, cast) if a.ceiling else None
    ones: list[float] = []
    halves: list[float] = []
    shares: list[float] = []
    shares_c: list[float] = []  # parallelize-channels
    for _ in range(a.rounds):
        for k, fn in steps.items():
            fn()  # untimed
            for _ in range(per):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                samples[k].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        if ceiling_round is not None:
            one, half = ceiling_round()
            ones += one
            halves += half
            mine = samples["parallelize"][-per:]
            shares.append(statistics.median(half) / statistics.median(mine))
            if channels:
                shares_c.append(statistics.median(half) /
                                statistics.median(samples["parallelize-channels"][-per:]))
    ceiling = None
    if a.ceiling:
        ceiling = (comm.bcast(statistics.median(ones) if rank == 0 else None),
                   statistics.median(halves))
    if rank == 0:
        med = {k: statistics.median(v) for k, v in samples.items()}
        print(f"{a.precision}: the ratio is parallelize against {base} in the same precision")
        print(f"{'ranks':>5} {'batch':>5} {'split':>5} "
              + " ".join(f"{k + ' ms':>22}" for k in steps) + f" {'ratio':>6}")
        ratios = {k: med[k] / med[base] for k in steps if k.startswith("parallelize")}
        print(f"{size:>5} {a.batch:>5} {a.split:>5} " + " ".join(
            f"{1e3 * med[k]:8.1f} ({1e3 * min(v):.0f}-{1e3 * max(v):.0f})".rjust(22)
            for k, v in samples.items()) + f" {next(iter(ratios.values())):6.3f}")
        if len(ratios) > 1:
            print("ratios against " + base + ": " + ", ".join(
                f"{k} {r:.3f}" for k, r in ratios.items()))
        if a.channels_last:
            ratios_cl = {k: med[k] / med[base + "-cl"] for k in ratios}
            print(f"ratios against {base}-cl (channels-last): " + ", ".join(
                f"{k} {r:.3f}" for k, r in ratios_cl.items()))
        print(f"output blocks: {y_dist}")
        if ceiling is not None:
            one, half = ceiling
            speedup, best = one / med["parallelize"], one / half
            print(f"1 rank, plain model: {1e3 * one:.1f} ms; each rank its H-slice alone, at "
                  f"once: {1e3 * half:.1f} ms; speedup {speedup:.2f} of a ceiling of "
                  f"{best:.2f}: {speedup / best:.0%}; by round (the halves' median over the "
                  f"parallelized steps' in the same round): median {statistics.median(shares):.0%}"
                  f", {min(shares):.0%}-{max(shares):.0%}")
            if channels:
                speedup = one / med["parallelize-channels"]
                print(f"parallelize-channels: speedup {speedup:.2f}: {speedup / best:.0%}; "
                      f"by round median {statistics.median(shares_c):.0%}, "
                      f"{min(shares_c):.0%}-{max(shares_c):.0%}")
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"ranks": size, "batch": a.batch, "split": a.split, "size": a.size,
                       "layout": "auto" if a.auto else "split",
                       "precision": a.precision, "model": a.model,
                       "ceiling_s": ceiling,
                       "ceiling_share_by_round": shares,
                       "channels_ceiling_share_by_round": shares_c if channels else None,
                       "samples_s": samples,
                       # the parallelized models that ran and their ratios to the baseline
                       "ratios": ratios,
                       "channels_last": a.channels_last,
                       # the blocks' memory format each parallelized model's plan chose
                       "memory_format": {k: m.plan.memory_format for k, m in planned.items()
                                         if m.plan is not None},
                       "ratios_against_channels_last_baseline": (
                           {k: med[k] / med[base + "-cl"] for k in ratios}
                           if a.channels_last else None),
                       "ratio": next(iter(ratios.values()))}, f, indent=1)
    return 0


def _idle(comm: MPI.Comm) -> None:
    """Wait for the others' barrier without spinning on a core."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def _ceiling_round(a: argparse.Namespace, comm: MPI.Comm, model: nn.Module,
                   x_all: torch.Tensor, t_all: torch.Tensor, cast
                   ) -> Callable[[], tuple[list[float], list[float]]]:
    """One round of the ceiling: seconds per step of the plain model on the whole batch on
    rank 0 alone (empty elsewhere), and of every rank training it on its own H-slice at
    once (the slowest rank's)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    h, oh = x_all.shape[2], t_all.shape[2]
    lo, hi = h * rank // size, h * (rank + 1) // size
    olo, ohi = oh * rank // size, oh * (rank + 1) // size
    layout = torch.channels_last if a.channels_last else torch.contiguous_format
    xs, ts = x_all[:, :, lo:hi].contiguous(memory_format=layout), \
        t_all[:, :, olo:ohi].contiguous()
    x_all = x_all.contiguous(memory_format=layout)
    per = max(1, a.reps // a.rounds)

    def step(x: torch.Tensor, t: torch.Tensor) -> None:
        opt.zero_grad()
        with cast():
            out = model(x)
        ((out.float() - t) ** 2).mean().backward()
        opt.step()

    def one_round() -> tuple[list[float], list[float]]:
        ones, halves = [], []
        comm.Barrier()
        if rank == 0:
            step(x_all, t_all)
            for _ in range(per):
                t0 = time.perf_counter()
                step(x_all, t_all)
                ones.append(time.perf_counter() - t0)
            comm.Ibarrier().Wait()
        else:
            _idle(comm)
        step(xs, ts)
        for _ in range(per):
            comm.Barrier()
            t0 = time.perf_counter()
            step(xs, ts)
            halves.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        return ones, halves

    return one_round


if __name__ == "__main__":
    raise SystemExit(main())
