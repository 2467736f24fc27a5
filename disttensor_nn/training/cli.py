"""Entry points ``disttensor-plan`` and ``disttensor-train``: parse arguments, call the library.

The models they accept are those of :mod:`disttensor_nn.training.registry`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from disttensor import limit_blas_threads

from ..plan import make_plan, predict_scaling, wait_for_root
from ..plan.calibrate import calibrate
from .driver import TrainConfig, train
from .plot import plot_scaling
from .registry import build_model, model_names, model_spec

__all__ = ["parse_bytes", "parse_size", "plan_main", "train_main"]


def parse_bytes(text: str) -> float:
    """``"8GiB"``, ``"512MiB"``, ``"1.5GB"`` or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", text)
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r}")
    value, unit, binary = float(m.group(1)), m.group(2), m.group(3)
    power = " KMGT".index(unit) if unit else 0
    return value * (1024 if binary or not unit else 1000) ** power


def _rank_counts(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (positive ints)."""
    try:
        ranks = [int(v) for v in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"expected positive rank counts like 1,4,16, got {text!r}")
    return ranks


def parse_size(text: str) -> tuple[int, ...]:
    """``"256x256"`` -> ``(256, 256)``."""
    try:
        return tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"size must look like 256x256, got {text!r}") from None


def plan_main(argv: Sequence[str] | None = None) -> int:
    """``disttensor-plan MODEL --ranks P --batch N [...]``: print (and save) a plan."""
    parser = argparse.ArgumentParser(
        prog="disttensor-plan",
        description="Choose every layer's distribution for a network and print the plan.")
    parser.add_argument("model", nargs="?", choices=model_names())
    parser.add_argument("--ranks", type=int, help="number of ranks (default: this job's)")
    parser.add_argument("--batch", type=int, default=None, help="global mini-batch size")
    parser.add_argument("--size", type=parse_size, help="input spatial size, e.g. 256x256")
    parser.add_argument("--memory-per-rank", type=parse_bytes, help="e.g. 8GiB")
    parser.add_argument("--machine", default="this",
                        help="'this' or 'this-gpu' (calibrated), a builtin profile, "
                        "or a JSON profile")
    parser.add_argument("--json", help="write the plan as JSON to this file")
    parser.add_argument("--no-measure", action="store_true",
                        help="estimate missing kernel times instead of measuring them")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's profile (run under mpiexec, >= 2 ranks)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="with --calibrate: ranks compute on CPU cores or one GPU each; the "
                        "GPU profile is then --machine this-gpu")
    parser.add_argument("--scaling", type=_rank_counts,
                        help="comma-separated rank counts: predicted strong scaling")
    parser.add_argument("--plot", help="with --scaling: write a PNG plot here")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    limit_blas_threads(comm=comm)
    if args.calibrate:
        profile = calibrate(comm, device=args.device)
        if comm.Get_rank() == 0:
            print(f"calibrated {profile.name}: p2p alpha {profile.p2p_alpha * 1e6:.1f} us, "
                  f"{1e-9 / profile.p2p_beta:.2f} GB/s; allreduce alpha "
                  f"{profile.allreduce_alpha * 1e6:.1f} us, {1e-9 / profile.allreduce_beta:.2f}"
                  f" GB/s; GEMM {profile.peak_flops / 1e9:.1f} GFLOP/s per rank")
        if args.model is None:
            return 0
    if args.model is None:
        parser.error("a MODEL is needed (or --calibrate)")
    nprocs = args.ranks or comm.Get_size()
    if nprocs == comm.Get_size() > 1 and not args.scaling:
        return _plan(args, comm)  # planning for this very job: measure on all its ranks
    if comm.Get_rank() != 0:
        wait_for_root(comm)
        return 0
    try:
        return _plan(args, None)
    finally:
        wait_for_root(comm)


def _plan(args: argparse.Namespace, comm: MPI.Comm | None) -> int:
    """Plan and print on rank 0 of ``comm`` (collective), or in this process alone."""
    batch = args.batch or model_spec(args.model).batch
    model, shape = build_model(args.model, args.size, batch)
    if args.scaling:
        return _scaling(args, model, shape)
    nprocs = args.ranks or MPI.COMM_WORLD.Get_size()
    root = comm is None or comm.Get_rank() == 0
    try:
        plan, _ = make_plan(model, shape, nprocs, args.machine, args.memory_per_rank,
                            not args.no_measure, comm=comm)
    except ValueError as exc:
        if root:
            print(f"disttensor-plan: {exc}", file=sys.stderr)
        return 1
    if not root:
        return 0
    print(f"{args.model}, batch {shape}, {nprocs} ranks")
    print(plan.table())
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json())
        print(f"wrote {args.json}")
    return 0


def _scaling(args: argparse.Namespace, model: Any, shape: tuple[int, ...]) -> int:
    rows = predict_scaling(model, shape, args.scaling, args.machine, args.memory_per_rank,
                           not args.no_measure)
    base = next((r["time_ms"] for r in rows if r["time_ms"]), None)
    print(f"predicted strong scaling of {args.model}, batch {shape}, machine {args.machine}")
    print(f"{'ranks':>6} {'ms/iter':>10} {'speedup':>8} {'sample-par ms':>14} {'peak MiB':>9}"
          "  grids used (N, S..)")
    for r in rows:
        if r["time_ms"] is None:
            print(f"{r['ranks']:>6} {'-':>10}  {r['note']}")
            continue
        sp = f"{r['sample_parallel_ms']:.2f}" if r["sample_parallel_ms"] else "-"
        print(f"{r['ranks']:>6} {r['time_ms']:10.2f} {base / r['time_ms']:8.2f} {sp:>14} "
              f"{r['peak_MiB']:9.1f}  {r['grids']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "batch_shape": shape, "machine": args.machine,
                       "rows": rows}, f, indent=1)
    if args.plot:
        plot_scaling(rows, args.plot, f"{args.model} {shape} on {args.machine}")
        print(f"wrote {args.plot}")
    return 0


def train_main(argv: Sequence[str] | None = None) -> int:
    """``disttensor-train MODEL [...]``: train with the planner's (or a given) plan."""
    d = TrainConfig()
    parser = argparse.ArgumentParser(
        prog="disttensor-train",
        description="Train a network on synthetic data with per-layer distributions chosen by "
                    "the planner (run under mpiexec -n P).")
    parser.add_argument("model", nargs="?", default=d.model, choices=model_names())
    parser.add_argument("--ranks-layout", default="auto",
                        help="'auto' (plan on this machine) or a plan JSON from disttensor-plan")
    parser.add_argument("--batch", type=int, default=d.batch)
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--size", type=parse_size)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--momentum", type=float, default=d.momentum)
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--samples", type=int, default=d.samples, help="synthetic data set size")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--checkpoint", help="directory for checkpoints")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--metrics", default=d.metrics,
                        help="prefix of the metrics files (PREFIX.csv, PREFIX.json)")
    parser.add_argument("--machine", default=d.machine)
    parser.add_argument("--memory-per-rank", type=parse_bytes)
    parser.add_argument("--no-progress", action="store_true")
    a = parser.parse_args(argv)
    limit_blas_threads()
    cfg = TrainConfig(model=a.model, layout=a.ranks_layout, batch=a.batch, steps=a.steps,
                      size=a.size, lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay,
                      seed=a.seed, samples=a.samples, checkpoint=a.checkpoint,
                      checkpoint_every=a.checkpoint_every, resume=a.resume, metrics=a.metrics,
                      machine=a.machine, memory_per_rank=a.memory_per_rank,
                      progress=not a.no_progress)
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(plan_main())
