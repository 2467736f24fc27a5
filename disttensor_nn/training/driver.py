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

from ..module import Layer, Layout, RemovableHandle
from ..optim import SGD
from ..plan import Plan, apply_plan, make_plan
from ..plan.calibrate import calibrate
from ..plan.machine import this_machine_path
from ..plan.planner import leaf_nodes, trace
from .checkpoint import load_checkpoint, save_checkpoint
from .data import Loader
from .registry import build_model, model_spec

__all__ = ["TrainConfig", "train"]


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


def _plan(cfg: TrainConfig, model: Any, shape: tuple[int, ...], comm: MPI.Comm) -> Plan:
    if cfg.layout != "auto":
        with open(cfg.layout) as f:
            return Plan.from_json(f.read())
    if cfg.machine == "this" and not os.path.exists(this_machine_path()):
        if comm.Get_size() > 1:
            calibrate(comm)
        else:
            cfg.machine = "v100-nvlink-edr"  # nothing to calibrate communication with
    plan, _ = make_plan(model, shape, comm.Get_size(), cfg.machine, cfg.memory_per_rank,
                        comm=comm)
    return plan


def train(cfg: TrainConfig, comm: MPI.Comm | None = None) -> dict[str, Any]:
    """Run the training loop; collective. Returns the summary (same on every rank)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    spec = model_spec(cfg.model)
    model, shape = build_model(cfg.model, cfg.size, cfg.batch, seed=cfg.seed)
    plan = _plan(cfg, model, shape, comm)
    apply_plan(model, plan, shape, comm)
    nodes = leaf_nodes(trace(model, shape))
    data, loss_fn = spec.dataset(cfg.samples, tuple(shape[1:]), cfg.seed), spec.loss()
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
        loader.load_state_dict(state["extra"]["loader"])
        history = [dict(h) for h in state["extra"].get("history", [])]
    clocks, _ = _timed(nodes)
    bar = None
    if rank == 0 and cfg.progress:
        bar = tqdm(total=cfg.steps, initial=step, desc=f"{cfg.model} on {comm.Get_size()} ranks",
                   unit="step")
    it = iter(loader)
    times = []
    while step < cfg.steps:
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        model.call_backward(loss_fn.backward())
        opt.step()
        dt_step = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        step += 1
        times.append(dt_step)
        history.append({"step": step, "loss": loss, "time_s": dt_step,
                        "samples_per_s": cfg.batch / dt_step})
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{cfg.batch / dt_step:.1f}")
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
        "time_per_iteration_s": float(np.median(times)) if times else None,
        "samples_per_s": cfg.batch / float(np.median(times)) if times else None,
        "predicted_time_per_iteration_s": plan.time,
        "peak_memory_per_rank_bytes": peak, "predicted_peak_memory_bytes": plan.peak_memory,
        "layers": [{"name": e.name, "layer": e.layer, "grid": list(e.grid),
                    "predicted_s": e.fwd + e.bwd + e.comm, "measured_s": float(m)}
                   for e, m in zip(plan.entries, measured)],
        "config": {k: v for k, v in asdict(cfg).items()},
    }
    if rank == 0:
        print(plan.table())
        _write_metrics(cfg.metrics, history, summary)
        _print_summary(summary)
    return summary


def _write_metrics(prefix: str | None, history: list[dict], summary: dict) -> None:
    if not prefix:
        return
    with open(f"{prefix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "loss", "time_s", "samples_per_s"])
        w.writeheader()
        w.writerows(history)
    with open(f"{prefix}.json", "w") as f:
        json.dump({"history": history, "summary": summary}, f, indent=1)


def _print_summary(s: dict) -> None:
    print(f"\n{s['model']} {tuple(s['batch_shape'])} on {s['ranks']} ranks: {s['steps']} steps")
    if s["first_loss"] is not None:
        print(f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}")
    if s["time_per_iteration_s"]:
        print(f"time per iteration {1e3 * s['time_per_iteration_s']:.1f} ms (predicted "
              f"{1e3 * s['predicted_time_per_iteration_s']:.1f} ms), "
              f"{s['samples_per_s']:.1f} samples/s")
    print(f"peak memory per rank {s['peak_memory_per_rank_bytes'] / 2**20:.0f} MiB (resident; "
          f"predicted {s['predicted_peak_memory_bytes'] / 2**20:.0f} MiB for the model's data)")
