"""The training driver: plan, load data in the planned layout, train, checkpoint, report."""

from __future__ import annotations

import csv
import json
import os
import resource
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from mpi4py import MPI
from tqdm import tqdm

from ..container import Sequential
from ..module import GradientBuckets, Layer, Layout, RemovableHandle
from ..optim import SGD
from ..plan import Plan, apply_plan, make_plan
from ..plan.calibrate import calibrate
from ..plan.machine import MachineProfile, this_machine_path
from ..plan.planner import leaf_nodes, trace
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .data import Loader, NpyDataset
from .registry import build_model, check_size, model_spec

__all__ = ["TrainConfig", "train", "plan_mismatch", "SetupError"]

HEAVY_LOAD = 0.5
"""Load average per core above which a calibration is flagged as measured under load."""


class SetupError(ValueError):
    """A configuration that cannot train, found by :func:`train` before its first step.

    Raised with the same message on every rank (the checks use only what
    every rank knows, or agreed results such as a checkpoint's verdict):
    a plan file for another model, batch or number of ranks, a memory budget
    no plan fits, a checkpoint that cannot be resumed or whose step is not
    below ``steps``, data of the wrong shape.
    """


@dataclass
class TrainConfig:
    """Everything ``disttensor-train`` can be told; defaults are the built-in demo."""

    model: str = "mesh-demo"
    layout: str = "auto"  # "auto" (run the planner) or a plan JSON file
    batch: int = 4
    steps: int = 100
    size: tuple[int, ...] | None = None
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    samples: int = 64
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    metrics: str | None = "disttensor-metrics"
    machine: str = "this"
    memory_per_rank: float | None = None
    progress: bool = True
    data: str | None = None  # a directory of .npy samples (NpyDataset) instead of synthetic data
    recalibrate: bool = False  # measure this machine again even if a calibration is cached


def _timed(nodes: list) -> tuple[list[list[float]], list[RemovableHandle]]:
    """Accumulate each layer's forward+backward wall time (to compare with the plan).

    Returns one clock (``[seconds]``) per node, kept by forward and backward
    hooks on the node's layer, and the hooks' handles (``remove()`` them to stop).
    """
    clocks, handles = [], []
    for node in nodes:
        clock, start = [0.0], [0.0]

        def begin(layer: Layer, *args: Any, start: list[float] = start) -> None:
            start[0] = time.perf_counter()

        def end(layer: Layer, *args: Any, clock: list[float] = clock,
                start: list[float] = start) -> None:
            clock[0] += time.perf_counter() - start[0]

        layer = node.layer
        handles += [layer.register_forward_pre_hook(begin), layer.register_forward_hook(end),
                    layer.register_full_backward_pre_hook(begin),
                    layer.register_full_backward_hook(end)]
        clocks.append(clock)
    return clocks, handles


def plan_mismatch(plan: Plan, model: Layer, shape: tuple[int, ...], nprocs: int) -> str | None:
    """What makes ``plan`` unfit for ``model`` on a batch of ``shape`` over ``nprocs`` ranks.

    Returns None when the plan fits (:func:`~disttensor_nn.plan.apply_plan`
    accepts it), otherwise a sentence naming the first difference: the
    number of ranks, the batch shape, or the first layer whose kind or input
    shape differs (a plan made for another model).
    """
    if plan.nprocs != nprocs:
        return f"the plan is for {_plural(plan.nprocs, 'rank')}, this job has {nprocs}"
    if tuple(plan.batch_shape) != tuple(shape):
        return (f"the plan is for batches of shape {tuple(plan.batch_shape)}, this run's are "
                f"{tuple(shape)} (--batch and --size)")
    nodes = leaf_nodes(trace(model, tuple(shape)))
    for i, (node, entry) in enumerate(zip(nodes, plan.entries)):
        kind = type(node.layer).__name__
        if entry.layer != kind or tuple(entry.in_shape) != tuple(node.in_shape):
            return (f"layer {i} of the plan is {entry.layer} on {tuple(entry.in_shape)}, the "
                    f"model's is {kind} on {tuple(node.in_shape)}: the plan was made for "
                    "another model")
    if len(nodes) != len(plan.entries):
        return (f"the plan has {len(plan.entries)} layers, the model {len(nodes)}: it was made "
                "for another model")
    return None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _say(comm: MPI.Comm, text: str) -> None:
    """Print on rank 0 (progress messages of the long phases)."""
    if comm.Get_rank() == 0:
        print(text, flush=True)


def _plan(cfg: TrainConfig, model: Any, shape: tuple[int, ...], comm: MPI.Comm) -> Plan:
    if cfg.layout != "auto":
        with open(cfg.layout) as f:
            plan = Plan.from_json(f.read())
        problem = plan_mismatch(plan, model, shape, comm.Get_size())
        if problem:
            raise ValueError(f"{cfg.layout}: {problem}")
        return plan
    machine = cfg.machine
    if machine == "this":
        path = this_machine_path()
        if comm.Get_size() == 1:
            machine = "v100-nvlink-edr"  # nothing to calibrate communication with
            _say(comm, "1 rank: nothing to calibrate communication with; planning for the "
                       f"built-in profile {machine}")
        elif cfg.recalibrate or not os.path.exists(path):
            _say(comm, f"calibrating this machine's communication and compute on "
                       f"{_plural(comm.Get_size(), 'rank')} (kept in {path} for later runs)...")
            calibrate(comm)
        else:
            profile = MachineProfile.load(path)
            _say(comm, f"using the cached calibration {path} ({profile.notes}); "
                       "--recalibrate measures again")
            if (profile.load_per_core or 0) > HEAVY_LOAD:
                _say(comm, f"warning: that calibration was taken under a load of "
                           f"{profile.load_per_core:.1f} per core; its predictions will be "
                           "too slow if the machine is quieter now (use --recalibrate)")
    _say(comm, f"planning {cfg.model} for {_plural(comm.Get_size(), 'rank')} (kernels not "
               "timed before are measured first)...")
    plan, _ = make_plan(model, shape, comm.Get_size(), machine, cfg.memory_per_rank,
                        comm=comm)
    return plan


def _setup(cfg: TrainConfig, comm: MPI.Comm) -> tuple:
    """Everything before the first step: model, plan, data, optimizer, resumed state."""
    rank = comm.Get_rank()
    spec = model_spec(cfg.model)
    size = cfg.size
    if cfg.data is not None:
        data = NpyDataset(cfg.data)
        if data.sample_shape[0] != spec.in_channels or (
                size is not None and tuple(data.sample_shape[1:]) != tuple(size)):
            raise ValueError(f"the samples in {cfg.data} are {data.sample_shape}; model "
                             f"{cfg.model!r} takes {spec.in_channels} channels"
                             + (f" and --size {'x'.join(map(str, size))}" if size else ""))
        size = tuple(data.sample_shape[1:])
    model, shape = build_model(cfg.model, size, cfg.batch, seed=cfg.seed)
    check_size(cfg.model, size, model)
    if cfg.data is None:
        data = spec.dataset(cfg.samples, tuple(shape[1:]), cfg.seed)
    plan = _plan(cfg, model, shape, comm)
    apply_plan(model, plan, shape, comm)
    if rank == 0:
        print(f"{cfg.model}, batch {shape}, {_plural(comm.Get_size(), 'rank')}")
        print(plan.table(), flush=True)
    nodes = leaf_nodes(trace(model, shape))
    loss_fn = spec.loss()
    first: Layout = nodes[0].layer.layout
    target_layout = None
    if data.has_spatial_target:
        target_layout = Layout(first.grid, first.axes)
    loader = Loader(data, cfg.batch, first, shuffle=True, seed=cfg.seed,
                    target_layout=target_layout)
    lr = cfg.lr if cfg.lr is not None else spec.lr
    opt = SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    step = 0
    history: list[dict[str, float]] = []
    if cfg.resume:
        if not cfg.checkpoint:
            raise ValueError("--resume needs --checkpoint DIR")
        state = load_checkpoint(cfg.checkpoint, model, opt, comm=comm)
        step = int(state["step"])
        if step >= cfg.steps:
            raise ValueError(f"the checkpoint {cfg.checkpoint} is at step {step}; --steps "
                             f"{cfg.steps} is not above it, so there is nothing to train (ask "
                             f"for more than {_plural(step, 'step')})")
        loader.load_state_dict(state["extra"]["loader"])
        history = [dict(h) for h in state["extra"].get("history", [])]
        _say(comm, f"resumed from step {step} ({cfg.checkpoint})")
    return model, shape, plan, nodes, loss_fn, loader, opt, step, history


def train(cfg: TrainConfig, comm: MPI.Comm | None = None) -> dict[str, Any]:
    """Run the training loop; collective. Returns the summary (same on every rank).

    Raises
    ------
    SetupError
        On every rank, before the first step, for a configuration that cannot
        train (see :class:`SetupError`).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    try:
        state = _setup(cfg, comm)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        raise SetupError(str(exc)) from exc
    model, shape, plan, nodes, loss_fn, loader, opt, step, history = state
    if isinstance(model, Sequential) and len(model):
        model[0].input_grad = False  # it is fed data: no input gradient to compute
    clocks, _ = _timed(nodes)
    bar = None
    if rank == 0 and cfg.progress:
        bar = tqdm(total=cfg.steps, initial=step,
                   desc=f"{cfg.model} on {_plural(comm.Get_size(), 'rank')}", unit="step")
    it = iter(loader)
    times, data_times = [], []
    while step < cfg.steps:
        t_data = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        dt_data = time.perf_counter() - t_data
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        with GradientBuckets():  # gradient sums fused and overlapped, done before the step
            model.call_backward(loss_fn.backward())
        opt.step()
        clocks_now = np.array([time.perf_counter() - t0, dt_data])
        comm.Allreduce(MPI.IN_PLACE, clocks_now, op=MPI.MAX)
        dt_step, dt_data = clocks_now.tolist()
        step += 1
        times.append(dt_step)
        data_times.append(dt_data)
        total = dt_step + dt_data
        history.append({"step": step, "loss": loss, "time_s": total, "compute_s": dt_step,
                        "data_s": dt_data, "samples_per_s": cfg.batch / total})
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", compute_ms=f"{1e3 * dt_step:.0f}",
                            data_ms=f"{1e3 * dt_data:.0f}")
            bar.update(1)
        if cfg.checkpoint and (step == cfg.steps or (cfg.checkpoint_every and
                                                     step % cfg.checkpoint_every == 0)):
            save_checkpoint(cfg.checkpoint, model, opt, step,
                            extra={"loader": loader.state_dict(), "history": history},
                            comm=comm)
    if bar is not None:
        bar.close()
    measured = np.array([c[0] for c in clocks])
    comm.Allreduce(MPI.IN_PLACE, measured, op=MPI.MAX)
    measured /= max(len(times), 1)
    peak = comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, op=MPI.MAX)
    summary = {
        "model": cfg.model, "batch_shape": list(shape), "ranks": comm.Get_size(),
        "steps": step, "final_loss": history[-1]["loss"] if history else None,
        "first_loss": history[0]["loss"] if history else None,
        "history": [h["loss"] for h in history],
        "time_per_iteration_s": float(np.median(np.add(times, data_times))) if times else None,
        "compute_time_per_iteration_s": float(np.median(times)) if times else None,
        "data_time_per_iteration_s": float(np.median(data_times)) if times else None,
        "samples_per_s": cfg.batch / float(np.median(np.add(times, data_times)))
        if times else None,
        "predicted_time_per_iteration_s": plan.time,
        "peak_memory_per_rank_bytes": peak, "predicted_peak_memory_bytes": plan.peak_memory,
        "layers": [{"name": e.name, "layer": e.layer, "grid": list(e.grid),
                    "predicted_s": e.fwd + e.bwd + e.comm, "measured_s": float(m)}
                   for e, m in zip(plan.entries, measured)],
        "config": {k: v for k, v in asdict(cfg).items()},
    }
    if rank == 0:
        _print_summary(summary)
        _write_metrics(cfg.metrics, history, summary)
    return summary


def _write_metrics(prefix: str | None, history: list[dict], summary: dict) -> None:
    if not prefix:
        return
    with open(f"{prefix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "loss", "time_s", "compute_s", "data_s",
                                          "samples_per_s"], extrasaction="ignore")
        w.writeheader()
        w.writerows(history)
    with open(f"{prefix}.json", "w") as f:
        json.dump({"history": history, "summary": summary}, f, indent=1)
    print(f"metrics written to {os.path.abspath(prefix)}.csv and .json (--metrics PREFIX; "
          "plot them with disttensor-plot)")


def _print_summary(s: dict) -> None:
    print(f"\n{s['model']} {tuple(s['batch_shape'])} on {_plural(s['ranks'], 'rank')}: "
          f"{_plural(s['steps'], 'step')}")
    if s["first_loss"] is not None:
        print(f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}")
    if s["time_per_iteration_s"]:
        print(f"time per iteration {1e3 * s['time_per_iteration_s']:.1f} ms: compute "
              f"{1e3 * s['compute_time_per_iteration_s']:.1f} ms (predicted "
              f"{1e3 * s['predicted_time_per_iteration_s']:.1f} ms), data loading "
              f"{1e3 * s['data_time_per_iteration_s']:.1f} ms; "
              f"{s['samples_per_s']:.1f} samples/s")
    print(f"peak memory per rank {s['peak_memory_per_rank_bytes'] / 2**20:.0f} MiB (resident; "
          f"predicted {s['predicted_peak_memory_bytes'] / 2**20:.0f} MiB for the model's data)")
