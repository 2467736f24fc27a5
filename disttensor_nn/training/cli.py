"""Entry points ``disttensor-plan`` and ``disttensor-train``: parse arguments, call the library.

The models they accept are those of :mod:`disttensor_nn.training.registry`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict
from types import ModuleType
from typing import Any

from mpi4py import MPI

from ..kernels import BACKENDS, limit_threads
from ..layers.norm import BATCH_NORM_STATS, set_batch_norm_stats
from ..layout import MEMORY_FORMATS
from ..optim import STAGES
from ..plan import Plan, kernel_choice, make_plan, predict_scaling, wait_for_root
from ..plan.calibrate import calibrate, calibration_path, stale_calibration
from ..plan.machine import builtin_profiles
from ..precision import PRECISIONS, set_precision
from .checkpoint import CheckpointError
from .data import data_problem, save_dataset
from .driver import RECOMPUTE, SetupError, TrainConfig, plan_mismatch, train
from .inference import PredictConfig, predict
from .plot import plot_scaling
from .recipe import OPTIMIZERS, SCHEDULES, recipe_problem
from .registry import build_model, check_size, model_names, model_spec

__all__ = ["data_main", "parse_bytes", "parse_size", "plan_main", "predict_main", "train_main"]


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
    """``"256x256"`` -> ``(256, 256)``: positive ints joined by ``x``."""
    parts = text.lower().split("x")
    if not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"size must be positive ints joined by 'x', like 256x256, got {text!r}")
    size = tuple(int(p) for p in parts)
    if min(size) < 1:
        raise ValueError(f"size entries must be >= 1, got {text!r}")
    return size


def _arg_type(convert: Any, name: str) -> Any:
    """``convert`` as an argparse type whose errors are the usage message."""
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = name
    return parse


def _number(kind: type, low: float, strict: bool) -> Any:
    """An argparse type for ``kind`` values ``> low`` (``strict``) or ``>= low``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if value < low or (strict and value == low) or value != value:
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {low:g}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


_positive_int = _number(int, 0, True)
_count = _number(int, 0, False)
_positive = _number(float, 0, True)
_nonnegative = _number(float, 0, False)
_size = _arg_type(parse_size, "size")
_bytes = _arg_type(parse_bytes, "memory size")


def _plural(n: int, word: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose messages (help, usage errors) come from rank 0 only.

    Every rank parses the same command line and exits with the same status
    (2 for a usage error), so the job ends on all ranks with one message.
    """

    def _print_message(self, message: str, file: Any = None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show every option's default, keep the description's line breaks."""


def _bn_stats_option(parser: argparse.ArgumentParser) -> None:
    """``--bn-stats``: the batch norms' statistics in training (``TrainConfig.bn_stats``)."""
    parser.add_argument("--bn-stats", choices=BATCH_NORM_STATS, default="global",
                        help="the batch norms' statistics in training: global, over the whole "
                        "batch (the same as one process on it: a sum over the ranks in each batch "
                        "norm's forward and backward); group, over each group of ranks that "
                        "holds the same samples alone (one rank where only the samples are "
                        "split), as PyTorch's batch norms under DistributedDataParallel, the "
                        "running statistics averaged over the groups")


def _kernel_options(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    """The options that choose the local kernels and their threads."""
    parser.add_argument("--kernels", choices=("auto", *BACKENDS), default=default,
                        help="local kernels: NumPy's, PyTorch's (the torch extra: oneDNN on "
                        "CPUs, cuDNN on GPUs), or auto: each layer's faster of those "
                        "installed, timed by the planner")
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                        help="kernel threads per rank (default: the cores of a node divided "
                        "by its ranks)")
    parser.add_argument("--memory-format", choices=("auto", *MEMORY_FORMATS), default="auto",
                        help="how the activations' (N, C, H, W) blocks lie in memory: C order, "
                        "channels-last ((N, H, W, C): the torch kernels' convolutions, pooling, "
                        "batch norms and element-wise layers run on them and keep them; each "
                        "step's input is put so), or auto: both planned where the torch kernels "
                        "may run, the faster kept (the plan table says which)")


def _check_kernels(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any work, kernels this installation cannot run (one message, exit 2)."""
    try:
        kernel_choice(args.kernels)
    except (ValueError, ImportError) as exc:
        parser.error(f"--kernels {args.kernels}: {exc}")


def _read_plan(parser: argparse.ArgumentParser, path: str) -> Plan:
    """The plan in ``path``; a usage error naming the file and what is wrong with it."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        parser.error(f"--ranks-layout {path}: cannot read the plan file ({exc.strerror})")
    try:
        json.loads(text)
    except ValueError as exc:
        parser.error(f"--ranks-layout {path}: not JSON ({exc})")
    try:
        return Plan.from_json(text)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        parser.error(f"--ranks-layout {path}: not a plan written by disttensor-plan --json "
                     f"({type(exc).__name__}: {exc})")
    raise AssertionError  # parser.error exits


def _torch_driver(parser: argparse.ArgumentParser) -> ModuleType:
    """:mod:`disttensor_nn.training.torch_driver`, imported for ``--model-file`` only (it
    needs PyTorch, an optional extra); without PyTorch a usage error naming the extra."""
    try:
        return importlib.import_module(f"{__package__}.torch_driver")
    except ImportError as exc:
        parser.error(f"--model-file: {exc}")
    raise AssertionError  # parser.error exits


def _model_file_options(parser: argparse.ArgumentParser) -> None:
    """``--model-file`` and ``--in-channels``: a PyTorch model of the user's, instead of MODEL."""
    parser.add_argument("--model-file", metavar="PATH.py:FUNCTION",
                        help="instead of MODEL: a PyTorch model of your own, the "
                        "torch.nn.Module FUNCTION() in PATH.py returns (unchanged, run by "
                        "disttensor_nn.torch.parallelize; the torch extra)")
    parser.add_argument("--in-channels", type=_positive_int, metavar="C",
                        help="with --model-file: the input's channels (its spatial size is "
                        "--size; both come from --data where that is given)")


def _model_or_file(parser: argparse.ArgumentParser, a: argparse.Namespace,
                   default: str | None) -> None:
    """MODEL and ``--model-file`` exclude each other; ``a.model`` becomes the name shown."""
    if a.model_file is not None:
        if a.model is not None:
            parser.error(f"give a MODEL or --model-file, not both (got {a.model} and "
                         f"--model-file {a.model_file})")
        a.model = a.model_file
    else:
        if a.in_channels is not None:
            parser.error("--in-channels is for --model-file (a registered MODEL knows its "
                         "channels)")
        a.model = default if a.model is None else a.model


def plan_main(argv: Sequence[str] | None = None) -> int:
    """``disttensor-plan MODEL --ranks P --batch N [...]``: print (and save) a plan."""
    profiles = builtin_profiles()
    parser = _Parser(
        prog="disttensor-plan", formatter_class=_Help,
        description="Choose every layer's distribution for a network and print the plan.",
        epilog="built-in machine profiles (--machine):\n" + "\n".join(
            f"  {name}: {p.notes.split('.')[0]}" for name, p in profiles.items()))
    parser.add_argument("model", nargs="?", choices=model_names(),
                        help="the network to plan (one of the registered models)")
    parser.add_argument("--ranks", type=_positive_int,
                        help="number of ranks (default: this job's)")
    parser.add_argument("--batch", type=_positive_int, default=None,
                        help="global mini-batch size (default: the model's)")
    parser.add_argument("--size", type=_size,
                        help="input spatial size, e.g. 256x256 (default: the model's)")
    parser.add_argument("--memory-per-rank", type=_bytes,
                        help="memory budget per rank, e.g. 8GiB (default: the machine's)")
    parser.add_argument("--machine", default="this",
                        help="'this' or 'this-gpu' (calibrated here), a built-in profile "
                        f"({', '.join(profiles)}), or a JSON profile file")
    parser.add_argument("--json", help="write the plan as JSON to this file (for "
                        "disttensor-train --ranks-layout)")
    parser.add_argument("--no-measure", action="store_true",
                        help="estimate missing kernel times instead of measuring them")
    parser.add_argument("--recompute", choices=("auto", "always", "never"), default="auto",
                        help="recompute segments of layers in backward instead of keeping "
                        "their activations: when no plan fits the memory budget otherwise "
                        "(auto), always or never (default: %(default)s)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's profile (run under mpiexec, >= 2 ranks)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="with --calibrate: ranks compute on CPU cores or one GPU each; the "
                        "GPU profile is then --machine this-gpu")
    parser.add_argument("--scaling", type=_rank_counts,
                        help="comma-separated rank counts: predicted strong scaling")
    parser.add_argument("--channel-splits", action="store_true",
                        help="also split channels and filters (grids over (N, C, S..)); with "
                        "--model-file, channel-parallel convolutions")
    parser.add_argument("--plot", help="with --scaling: write a PNG plot here")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="the activations' dtype the plan is for (disttensor-train "
                        "--precision): bf16 and fp16 blocks count 2 bytes and their kernels "
                        "are timed in 16 bits")
    _bn_stats_option(parser)
    _model_file_options(parser)
    _kernel_options(parser)
    args = parser.parse_args(argv)
    if args.plot and not args.scaling:
        parser.error("--plot needs --scaling")
    _model_or_file(parser, args, None)
    if args.model_file is not None:
        return _plan_model_file(parser, args)
    if args.model is not None:
        try:
            check_size(args.model, args.size)
        except ValueError as exc:
            parser.error(f"--size: {exc}")
    _check_kernels(parser, args)
    comm = MPI.COMM_WORLD
    limit_threads(args.threads, comm=comm, kernels=args.kernels)
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
        if args.machine in ("this", "this-gpu"):
            # the calibration taken with this job's ranks per node: kept, or measured now
            device = "gpu" if args.machine == "this-gpu" else "cpu"
            why = stale_calibration(comm, device)
            if why is not None and args.no_measure:  # nothing measured: said, and planned on
                if comm.Get_rank() == 0:
                    print(f"warning: {why}; planning on it all the same (--no-measure)")
            else:
                if why is not None:
                    if comm.Get_rank() == 0:
                        print(f"{why}: calibrating this machine on {comm.Get_size()} "
                              "ranks...", flush=True)
                    calibrate(comm, device=device)
                args.machine = calibration_path(comm, device)
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
    set_precision(model, args.precision)
    set_batch_norm_stats(model, args.bn_stats)
    if args.scaling:
        return _scaling(args, model, shape)
    nprocs = args.ranks or MPI.COMM_WORLD.Get_size()
    root = comm is None or comm.Get_rank() == 0
    try:
        plan, _ = make_plan(model, shape, nprocs, args.machine, args.memory_per_rank,
                            not args.no_measure, comm=comm, recompute=RECOMPUTE[args.recompute],
                            channels=args.channel_splits, kernels=args.kernels,
                            memory_format=args.memory_format)
    except (ValueError, FileNotFoundError) as exc:
        if root:
            print(f"disttensor-plan: error: {exc}", file=sys.stderr)
        return 2
    if not root:
        return 0
    print(f"{args.model}, batch {shape}, {_plural(nprocs, 'rank')}")
    print(plan.table())
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json())
        print(f"wrote {args.json}")
    return 0


def _plan_model_file(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``disttensor-plan --model-file PATH.py:FUNCTION``: plan the user's PyTorch model on
    this job's ranks and print the plan (collective)."""
    for flag, given in (("--scaling", args.scaling), ("--calibrate", args.calibrate),
                        ("--precision", args.precision != "fp32"),
                        ("--recompute", args.recompute != "auto")):
        if given:
            parser.error(f"{flag} is for the registered models, not --model-file")
    comm = MPI.COMM_WORLD
    if args.ranks is not None and args.ranks != comm.Get_size():
        parser.error(f"--ranks {args.ranks}: --model-file plans for the ranks of this job "
                     f"({comm.Get_size()}); run it under mpiexec -n {args.ranks}")
    if args.size is None or args.in_channels is None:
        parser.error("--model-file needs the input's shape: --in-channels C and --size HxW "
                     "(or DxHxW)")
    torch_driver = _torch_driver(parser)
    shape = (args.batch or 4, args.in_channels, *args.size)
    limit_threads(args.threads, comm=comm)
    try:
        pm = torch_driver.plan_model_file(args.model_file, shape, machine=args.machine,
                                          memory_per_rank=args.memory_per_rank, comm=comm,
                                          bn_stats=args.bn_stats,
                                          channel_splits=args.channel_splits)
    except ValueError as exc:  # a SetupError, raised on every rank alike
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if comm.Get_rank() == 0:
        print(f"{args.model_file}, batch {shape} -> output "
              f"{tuple(pm.output_dist.global_shape)}, {_plural(comm.Get_size(), 'rank')}")
        print(pm.plan.table())
        if args.json:
            with open(args.json, "w") as f:
                f.write(pm.plan.to_json())
            print(f"wrote {args.json}")
    comm.Barrier()  # the JSON is written when any rank returns
    return 0


def _scaling(args: argparse.Namespace, model: Any, shape: tuple[int, ...]) -> int:
    rows = predict_scaling(model, shape, args.scaling, args.machine, args.memory_per_rank,
                           not args.no_measure, channels=args.channel_splits)
    first = next((r["time_ms"] for r in rows if r["time_ms"]), None)  # speedup's base
    print(f"predicted strong scaling of {args.model}, batch {shape}, machine {args.machine}")
    print(f"{'ranks':>6} {'ms/iter':>9} {'speedup':>8} {'compute':>9} {'exposed':>9} "
          f"{'hidden':>9} {'sample-par':>11} {'s-p exposed':>11} {'peak MiB':>9}"
          f"  grids used {'(N, C, S..)' if args.channel_splits else '(N, S..)'}")
    for r in rows:
        if r["time_ms"] is None:
            print(f"{r['ranks']:>6} {'-':>9}  {r['note']}")
            continue
        sp = f"{r['sample_parallel_ms']:.2f}" if r["sample_parallel_ms"] else "-"
        spx = f"{r['sample_parallel_split'][1]:.2f}" if r["sample_parallel_split"] else "-"
        print(f"{r['ranks']:>6} {r['time_ms']:9.2f} {first / r['time_ms']:8.2f} "
              f"{r['compute_ms']:9.2f} {r['exposed_ms']:9.2f} {r['hidden_ms']:9.2f} {sp:>11} "
              f"{spx:>11} {r['peak_MiB']:9.1f}  {r['grids']}"
              + (" (sample split inside the nodes)" if r["inner"] == "sample" else ""))
    print("ms per iteration: compute + exposed communication = the step; hidden communication "
          "runs under compute; s-p: the sample-parallel plan")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "batch_shape": shape, "machine": args.machine,
                       "rows": rows}, f, indent=1)
    if args.plot:
        plot_scaling(rows, args.plot, f"{args.model} {shape} on {args.machine}")
        print(f"wrote {args.plot}")
    return 0


def train_main(argv: Sequence[str] | None = None) -> int:
    """``disttensor-train MODEL [...]``: train with the planner's (or a given) plan.

    Every argument is checked before any work: a bad one ends the job on
    every rank with one usage message from rank 0 and exit status 2, as
    :mod:`argparse` does; so does an error found later that the arguments
    caused (a checkpoint to resume that does not fit, a memory budget that no
    plan fits).
    """
    d = TrainConfig()
    parser = _Parser(
        prog="disttensor-train", formatter_class=_Help,
        description="Train a network with per-layer distributions chosen by the planner "
                    "(run under mpiexec -n P), on synthetic data or on a directory of .npy "
                    "samples (--data).")
    parser.add_argument("model", nargs="?", default=None, choices=model_names(),
                        help=f"the network to train (one of the registered models; default "
                        f"{d.model}), or --model-file")
    parser.add_argument("--ranks-layout", default="auto", metavar="auto|PLAN.json",
                        help="'auto' (plan on this machine) or a plan JSON written by "
                        "disttensor-plan --json for this model, batch and number of ranks")
    parser.add_argument("--batch", type=_positive_int, default=d.batch,
                        help="global mini-batch size")
    parser.add_argument("--steps", type=_positive_int, default=d.steps,
                        help="train until this step (counting the resumed ones)")
    parser.add_argument("--accumulate", type=_positive_int, default=d.accumulate, metavar="K",
                        help="micro-batches of --batch samples per step: their gradients "
                        "are accumulated and reduced over the ranks once per step "
                        "(default: %(default)s)")
    parser.add_argument("--size", type=_size,
                        help="input spatial size, e.g. 256x256 (default: the model's)")
    parser.add_argument("--lr", type=_positive, help="learning rate (default: the model's)")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=d.optimizer,
                        help="SGD (with --momentum), Adam or AdamW (decoupled weight decay), "
                        "as torch.optim's")
    parser.add_argument("--momentum", type=_nonnegative, default=d.momentum,
                        help="SGD momentum")
    parser.add_argument("--weight-decay", type=_nonnegative, default=d.weight_decay,
                        help="weight decay (None: the optimizer's, 0 for sgd and adam, 0.01 "
                        "for adamw)")
    parser.add_argument("--schedule", choices=SCHEDULES, default=d.schedule,
                        help="the learning rate over --schedule-steps: constant (none), "
                        "times --gamma every --step-size steps (step), or a cosine or linear "
                        "decay to --min-lr over the steps after the warm-up")
    parser.add_argument("--warmup-steps", type=_count, default=d.warmup_steps, metavar="K",
                        help="a linear warm-up from --warmup-start-factor x --lr to --lr over "
                        "the first K steps, before the schedule (fewer than --steps)")
    parser.add_argument("--warmup-start-factor", type=_positive,
                        default=d.warmup_start_factor, metavar="F",
                        help="the warm-up's first learning rate as a share of --lr, in (0, 1]")
    parser.add_argument("--step-size", type=_positive_int, default=d.step_size, metavar="N",
                        help="--schedule step: steps between decays (None: a third of the "
                        "steps after the warm-up)")
    parser.add_argument("--gamma", type=_nonnegative, default=d.gamma,
                        help="--schedule step: the factor of each decay")
    parser.add_argument("--min-lr", type=_nonnegative, default=d.min_lr,
                        help="--schedule cosine or linear: the learning rate at the end")
    parser.add_argument("--schedule-steps", type=_positive_int, default=d.schedule_steps,
                        metavar="N", help="the steps the schedule and warm-up span (None: "
                        "--steps); give the whole schedule's when training it in parts with "
                        "--resume")
    parser.add_argument("--clip-grad-norm", type=_positive, default=d.clip_grad_norm,
                        metavar="X", help="scale the gradients so that the norm of the whole "
                        "model's gradient (sharded parameters counted once) is at most X "
                        "(None: no clipping)")
    parser.add_argument("--shard-state", choices=(*STAGES, "auto"), default=d.shard_state,
                        help="parameter state sharded over the ranks that replicate it (ZeRO "
                        "stages): each keeps 1/R of the optimizer state (optimizer), also of "
                        "the reduced gradients (gradients), also of the weights (full); auto: "
                        "the planner's choice, the fastest stage whose plan fits the memory "
                        "budget; checkpoints stay whole")
    parser.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                        help="the activations' dtype: activations, saved tensors, halos and "
                        "redistributed blocks in 16 bits with bf16 or fp16 (parameters, "
                        "optimizer state, batch-norm statistics and reductions stay float32; "
                        "fp16 with dynamic loss scaling); kernels without a 16-bit version run "
                        "in float32 on converted blocks, as the plan table says")
    _bn_stats_option(parser)
    parser.add_argument("--samples", type=_positive_int, default=d.samples,
                        help="synthetic data set size (ignored with --data)")
    parser.add_argument("--data", metavar="PATH",
                        help="train on this data set instead of synthetic data: an HDF5 file "
                        "(*.h5), a Zarr store (*.zarr) with arrays (N, C, *spatial) named by "
                        "--data-input and --data-target, or a directory of sample_*.npy and "
                        "target_*.npy (as save_npy_dataset writes them); every rank reads only "
                        "its block of each sample")
    parser.add_argument("--data-input", default=d.data_input, metavar="NAME",
                        help="name of the input array in the --data file")
    parser.add_argument("--data-target", default=d.data_target, metavar="NAME",
                        help="name of the target array in the --data file")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="seed of the weights, the data and the shuffling")
    parser.add_argument("--checkpoint", metavar="DIR", help="directory for checkpoints")
    parser.add_argument("--checkpoint-every", type=_count, default=0, metavar="STEPS",
                        help="also checkpoint every this many steps (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--metrics", default=d.metrics, metavar="PREFIX",
                        help="write PREFIX.csv and PREFIX.json ('' for none)")
    parser.add_argument("--machine", default=d.machine,
                        help="the machine profile to plan for: 'this' (calibrated here) or "
                        f"a built-in one ({', '.join(builtin_profiles())})")
    parser.add_argument("--recalibrate", action="store_true",
                        help="measure this machine again instead of using its cached "
                        "calibration")
    parser.add_argument("--memory-per-rank", type=_bytes,
                        help="memory budget per rank, e.g. 8GiB (default: the machine's)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar")
    parser.add_argument("--recompute", choices=("auto", "always", "never"), default=d.recompute,
                        help="recompute segments of layers in backward instead of keeping "
                        "their activations: when no plan fits the memory budget otherwise "
                        "(auto), always or never (default: %(default)s)")
    parser.add_argument("--profile-memory", action="store_true",
                        help="print and save (metrics file) peak memory by phase and by layer, "
                        "with the largest allocations at the training step's peaks")
    parser.add_argument("--no-keep-data", action="store_true",
                        help="make a synthetic data set's blocks in each step instead of "
                        "making every sample's before the first step and keeping them (kept "
                        "only where all of them fit a quarter of the memory the plan leaves "
                        "free)")
    parser.add_argument("--no-block-cache", action="store_true",
                        help="map each step's large arrays afresh instead of reusing them "
                        "from a cache bounded by the plan's predicted step memory")
    parser.add_argument("--device", choices=("cpu", "gpu"), default=d.device,
                        help="compute on CPU cores (NumPy) or on one GPU per rank (CuPy; a "
                        "node's ranks take its GPUs in turn; --machine this then plans with "
                        "the GPU calibration this-gpu)")
    _kernel_options(parser, d.kernels)
    parser.add_argument("--prefetch", type=int, choices=(0, 1, 2), default=d.prefetch,
                        help="batches a thread reads or synthesises ahead while a step runs "
                        "(default: 1 where each rank of the node has a core for it besides "
                        "its kernel threads, else 0)")
    _model_file_options(parser)
    a = parser.parse_args(argv)
    _model_or_file(parser, a, d.model)
    _check_kernels(parser, a)
    if a.resume and not a.checkpoint:
        parser.error("--resume needs --checkpoint DIR (the checkpoint to continue from)")
    if a.checkpoint_every and not a.checkpoint:
        parser.error("--checkpoint-every needs --checkpoint DIR")
    if a.data is not None:
        problem = data_problem(a.data)
        if problem:
            parser.error(f"--data {a.data}: {problem}")
    if a.model_file is not None:
        if a.ranks_layout != "auto":
            _read_plan(parser, a.ranks_layout)  # parallelize checks that it fits the model
    else:
        try:
            check_size(a.model, a.size)
        except ValueError as exc:
            parser.error(f"--size: {exc}")
    if a.ranks_layout != "auto" and a.model_file is None:
        plan = _read_plan(parser, a.ranks_layout)
        model, shape = build_model(a.model, a.size, a.batch)
        problem = plan_mismatch(plan, model, shape, MPI.COMM_WORLD.Get_size())
        if problem:
            parser.error(f"--ranks-layout {a.ranks_layout}: {problem}")
    limit_threads(a.threads, kernels=a.kernels)
    cfg = TrainConfig(model=a.model, layout=a.ranks_layout, batch=a.batch, steps=a.steps,
                      size=a.size, lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay,
                      seed=a.seed, samples=a.samples, checkpoint=a.checkpoint,
                      checkpoint_every=a.checkpoint_every, resume=a.resume, metrics=a.metrics,
                      machine=a.machine, memory_per_rank=a.memory_per_rank,
                      progress=not a.no_progress, data=a.data, data_input=a.data_input,
                      data_target=a.data_target, recalibrate=a.recalibrate,
                      profile_memory=a.profile_memory, recompute=a.recompute,
                      block_cache=not a.no_block_cache, keep_data=not a.no_keep_data,
                      device=a.device, accumulate=a.accumulate, kernels=a.kernels,
                      threads=a.threads, prefetch=a.prefetch, optimizer=a.optimizer,
                      schedule=a.schedule, warmup_steps=a.warmup_steps,
                      warmup_start_factor=a.warmup_start_factor, step_size=a.step_size,
                      gamma=a.gamma, min_lr=a.min_lr, schedule_steps=a.schedule_steps,
                      clip_grad_norm=a.clip_grad_norm, shard_state=a.shard_state,
                      precision=a.precision, bn_stats=a.bn_stats,
                      memory_format=a.memory_format)
    if a.model_file is not None:
        return _train_model_file(parser, a, cfg)
    problem = recipe_problem(cfg, a.lr if a.lr is not None else model_spec(a.model).lr)
    if problem:
        parser.error(problem)
    try:
        train(cfg)
    except SetupError as exc:  # raised on every rank, before training
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return 0


def _train_model_file(parser: argparse.ArgumentParser, a: argparse.Namespace,
                      cfg: TrainConfig) -> int:
    """``disttensor-train --model-file PATH.py:FUNCTION [...]`` (collective)."""
    torch_driver = _torch_driver(parser)
    problem = recipe_problem(cfg, a.lr if a.lr is not None else torch_driver.DEFAULT_LR)
    if problem:
        parser.error(problem)
    cfg = torch_driver.ModelFileConfig(**asdict(cfg), model_file=a.model_file,
                                       in_channels=a.in_channels)
    try:
        torch_driver.train_model_file(cfg)
    except SetupError as exc:  # raised on every rank, before training
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return 0


def data_main(argv: Sequence[str] | None = None) -> int:
    """``disttensor-data make-synthetic MODEL OUT [...]``: write a model's synthetic data set.

    The data set is the model's default one (its registry entry), written to
    one HDF5 file (``OUT`` ending in ``.h5``/``.hdf5``) or Zarr store (any
    other ``OUT``, ``.zarr`` by convention) with arrays ``input`` and
    ``target``, for ``disttensor-train MODEL --data OUT`` and
    ``disttensor-predict``. Run it under mpiexec to write Zarr samples in
    parallel.
    """
    parser = _Parser(prog="disttensor-data", formatter_class=_Help,
                     description="Write data sets for disttensor-train --data and "
                                 "disttensor-predict.")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-synthetic", formatter_class=_Help,
                          help="write a model's synthetic data set to HDF5 or Zarr",
                          description="Write a model's built-in synthetic data set (the one "
                          "disttensor-train uses without --data) to an HDF5 file (OUT.h5) or "
                          "a Zarr store (OUT.zarr), arrays 'input' (N, C, *spatial) and "
                          "'target'.")
    make.add_argument("model", choices=model_names(), help="whose data set to write")
    make.add_argument("out", help="the file to write: *.h5 / *.hdf5 (HDF5) or *.zarr (Zarr)")
    make.add_argument("--samples", type=_positive_int, default=16, help="number of samples")
    make.add_argument("--size", type=_size,
                      help="spatial size, e.g. 64x64 (default: the model's)")
    make.add_argument("--seed", type=int, default=0, help="selects the data set")
    make.add_argument("--chunks", type=_size,
                      help="chunk extent along each spatial dimension, e.g. 32x32 (default: "
                      "64 each); a rank reads the chunks that meet its block")
    a = parser.parse_args(argv)
    try:
        check_size(a.model, a.size)
    except ValueError as exc:
        make.error(f"--size: {exc}")
    parent = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(parent):
        make.error(f"{a.out}: the directory {parent} does not exist")
    _, shape = build_model(a.model, a.size, 1)
    if a.chunks and len(a.chunks) != len(shape) - 2:
        make.error(f"--chunks needs {len(shape) - 2} extents for {a.model}'s samples "
                   f"{tuple(shape[1:])}")
    data = model_spec(a.model).dataset(a.samples, tuple(shape[1:]), a.seed)
    try:
        save_dataset(a.out, data, chunks=a.chunks)
    except (OSError, ImportError) as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n" if MPI.COMM_WORLD.Get_rank() == 0
                    else None)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"wrote {a.samples} samples of {a.model}'s data set, inputs {data.dtype} "
              f"{tuple(data.sample_shape)}, targets {data.target_dtype} "
              f"{tuple(data.target_shape)}, to {a.out}")
    return 0


def predict_main(argv: Sequence[str] | None = None) -> int:
    """``disttensor-predict MODEL --checkpoint DIR --data PATH --out PATH [...]``.

    Runs the trained model on every sample of the data set with a plan made
    for inference memory, each rank writing its block of every output, and
    prints the plan and the peak memory of every rank. Arguments are checked
    first; a bad one ends the job with one usage message from rank 0.
    """
    d = PredictConfig()
    parser = _Parser(
        prog="disttensor-predict", formatter_class=_Help,
        description="Run a trained network (a disttensor-train checkpoint) on whole samples "
                    "of a data set, split over the ranks as the planner chooses for inference "
                    "memory (run under mpiexec -n P); every rank reads its block of each "
                    "input and writes its block of each output to one Zarr store or .npy file.")
    parser.add_argument("model", nargs="?", default=None, choices=model_names(),
                        help="the trained network (or --model-file)")
    parser.add_argument("--model-file", metavar="PATH.py:FUNCTION",
                        help="instead of MODEL: the PyTorch model of a disttensor-train "
                        "--model-file run (the torch extra)")
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="the checkpoint of disttensor-train --checkpoint DIR")
    parser.add_argument("--data", required=True, metavar="PATH",
                        help="the inputs: an HDF5 file (*.h5), a Zarr store (*.zarr), a "
                        "directory of sample_*.npy or of NAME.npy arrays")
    parser.add_argument("--data-input", default=d.data_input, metavar="NAME",
                        help="name of the input array in the --data file")
    parser.add_argument("--out", required=True, metavar="PATH",
                        help="where the outputs (N, C, *spatial) go: a Zarr store (*.zarr) or "
                        "one .npy file (*.npy); replaced if it exists")
    parser.add_argument("--chunks", type=_size,
                        help="Zarr output: chunk extent along each spatial dimension "
                        "(default: 64 each)")
    parser.add_argument("--memory-per-rank", type=_bytes,
                        help="memory budget per rank, e.g. 2GiB (default: the machine's)")
    parser.add_argument("--machine", default=d.machine,
                        help="the machine profile to plan for: 'this' (calibrated here) or "
                        f"a built-in one ({', '.join(builtin_profiles())})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--device", choices=("cpu", "gpu"), default=d.device,
                        help="compute on CPU cores (NumPy) or on one GPU per rank (CuPy; "
                        "--machine this then plans with the GPU calibration this-gpu)")
    _kernel_options(parser, d.kernels)
    a = parser.parse_args(argv)
    if a.model_file is not None and a.model is not None:
        parser.error(f"give a MODEL or --model-file, not both (got {a.model} and "
                     f"--model-file {a.model_file})")
    if a.model_file is None and a.model is None:
        parser.error("a MODEL is needed (or --model-file PATH.py:FUNCTION)")
    _check_kernels(parser, a)
    if not os.path.isdir(a.checkpoint):
        parser.error(f"--checkpoint {a.checkpoint}: not a directory")
    problem = data_problem(a.data)
    if problem:
        parser.error(f"--data {a.data}: {problem}")
    if not a.out.lower().rstrip("/").endswith((".zarr", ".npy")):
        parser.error(f"--out {a.out}: name a Zarr store (*.zarr) or a .npy file (*.npy)")
    if a.chunks and a.out.lower().endswith(".npy"):
        parser.error("--chunks is for a Zarr output")
    parent = os.path.dirname(os.path.abspath(a.out.rstrip("/")))
    if not os.path.isdir(parent):
        parser.error(f"--out {a.out}: the directory {parent} does not exist")
    limit_threads(a.threads, kernels=a.kernels)
    cfg = PredictConfig(model=a.model or a.model_file, checkpoint=a.checkpoint, data=a.data,
                        out=a.out,
                        data_input=a.data_input, machine=a.machine,
                        memory_per_rank=a.memory_per_rank, chunks=a.chunks,
                        progress=not a.no_progress, device=a.device, kernels=a.kernels,
                        memory_format=a.memory_format)
    torch_driver = _torch_driver(parser) if a.model_file is not None else None
    try:
        result = predict(cfg) if torch_driver is None else \
            torch_driver.predict_model_file(cfg, a.model_file)
    except (ValueError, FileNotFoundError, OSError, CheckpointError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(result["plan"])
        peaks = result["peak_memory_per_rank_bytes"]
        print(f"wrote {result['samples']} outputs {tuple(result['output_shape'])} to "
              f"{result['out']}; {result['time_per_sample_s'] * 1e3:.1f} ms per sample, of "
              f"which reading and writing {result['io_time_per_sample_s'] * 1e3:.1f} ms "
              f"(predicted compute and communication "
              f"{result['predicted_time_per_sample_s'] * 1e3:.1f} ms)")
        print("peak resident memory per rank (MiB): "
              + ", ".join(f"{p / 2**20:.0f}" for p in peaks)
              + f"; predicted {result['predicted_peak_memory_bytes'] / 2**20:.0f}")
    return 0


def _refuse_main(module: str) -> int:
    """What ``python -m`` on a module of both tools says: which module runs which tool."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"{module} holds both command-line tools; run `python -m disttensor_nn.train` "
              "(disttensor-train) or `python -m disttensor_nn.plan` (disttensor-plan)",
              file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_refuse_main("disttensor_nn.training.cli"))
