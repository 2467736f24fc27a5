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

import torch
import torch.distributed as tdist
from bench_step import MODELS, to_torch
from mpi4py import MPI
from torch import nn

import disttensor as dt
from disttensor_nn.torch import parallelize


def trunk(model) -> nn.Module:
    """The model in plain torch up to its last convolution: parallelize does not split
    PixelShuffle (DepthToSpace) yet, which the mesh FCN ends with."""
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
    p.add_argument("--json", default="bench_torch_parallel.json")
    a = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if min(a.batch, a.size, a.reps, a.rounds) < 1 or (a.split == "N" and a.batch % size):
        if rank == 0:
            print("counts must be >= 1 and --split N needs a batch divisible by the ranks",
                  file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dt.limit_blas_threads(1)
    build = MODELS["mesh-demo"][0]
    torch.manual_seed(0)
    plain = trunk(build())
    shape = (a.batch, 18, a.size, a.size)
    x_all = torch.rand(shape)
    grid = (size, 1, 1, 1) if a.split == "N" else (1, 1, size, 1)
    par = trunk(build())
    par.load_state_dict(plain.state_dict())
    pm = parallelize(par, shape, layout=grid)
    x = dt.DistArray.from_global(x_all, pm.input_dist, xp=torch)
    out_shape = plain(x_all[:1]).shape[1:]
    t_all = torch.rand((a.batch, *out_shape))
    y_dist = None

    popt = torch.optim.SGD(pm.parameters(), lr=0.01, momentum=0.9)

    def cast(on: bool = True) -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=torch.bfloat16) \
            if on and a.precision == "bf16" else contextlib.nullcontext()

    def ours(half: bool = True) -> None:
        nonlocal y_dist
        popt.zero_grad()
        with cast(half):
            y = pm(x)
        y_dist = y.dist
        t = t_all[y.dist.local_slices()]
        # the global mean: each rank's sum over its block, divided by every element
        loss = ((y.local.float() - t) ** 2).sum() / t_all.numel()
        loss.backward()
        popt.step()

    steps = {"parallelize": ours}
    if a.precision == "bf16":
        steps["parallelize-fp32"] = lambda: ours(False)
    if size == 1:
        ref = plain
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = comm.bcast(str(29500 + os.getpid() % 1000))
        tdist.init_process_group("gloo", rank=rank, world_size=size)
        ref = nn.parallel.DistributedDataParallel(plain)
    lo, hi = a.batch * rank // size, a.batch * (rank + 1) // size
    rx, rt = x_all[lo:hi], t_all[lo:hi]
    ropt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)

    def theirs() -> None:
        ropt.zero_grad()
        with cast():
            out = ref(rx)
        loss = ((out.float() - rt) ** 2).mean()
        loss.backward()
        ropt.step()

    steps["torch" if size == 1 else "ddp"] = theirs
    samples: dict[str, list[float]] = {k: [] for k in steps}
    per = max(1, a.reps // a.rounds)
    for _ in range(a.rounds):
        for k, fn in steps.items():
            fn()  # untimed
            for _ in range(per):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                samples[k].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    if rank == 0:
        med = {k: statistics.median(v) for k, v in samples.items()}
        base = "torch" if size == 1 else "ddp"
        print(f"{a.precision}: the ratio is parallelize against {base} in the same precision")
        print(f"{'ranks':>5} {'batch':>5} {'split':>5} "
              + " ".join(f"{k + ' ms':>22}" for k in steps) + f" {'ratio':>6}")
        print(f"{size:>5} {a.batch:>5} {a.split:>5} " + " ".join(
            f"{1e3 * med[k]:8.1f} ({1e3 * min(v):.0f}-{1e3 * max(v):.0f})".rjust(22)
            for k, v in samples.items()) + f" {med['parallelize'] / med[base]:6.3f}")
        print(f"output blocks: {y_dist}")
        with open(a.json, "w") as f:
            json.dump({"ranks": size, "batch": a.batch, "split": a.split, "size": a.size,
                       "precision": a.precision,
                       "samples_s": samples,
                       "ratio": med["parallelize"] / med[base]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
