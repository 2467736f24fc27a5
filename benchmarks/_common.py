"""Shared helpers for the benchmark scripts: timing, tables and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor_nn.plan import Plan, apply_plan

# The convolution layers the conv benchmarks time (CPU: bench_conv.py, GPU: bench_gpu.py):
# name, N, C, H (= W), F, kernel, stride, padding
CONV_LAYERS = [
    ("resnet_conv1_7x7s2", 8, 3, 224, 64, 7, 2, 3),
    ("resnet_3x3_56", 8, 64, 56, 64, 3, 1, 1),
    ("resnet_3x3_28", 8, 128, 28, 128, 3, 1, 1),
    ("resnet_3x3_14", 8, 256, 14, 256, 3, 1, 1),
    ("resnet_3x3_7", 8, 512, 7, 512, 3, 1, 1),
    ("resnet_1x1_56", 8, 256, 56, 64, 1, 1, 0),
    ("mesh_3x3_1024", 1, 16, 1024, 16, 3, 1, 1),
    ("mesh_5x5s2_2048", 1, 18, 2048, 128, 5, 2, 2),
]


def time_collective(fn: Callable[[], Any], comm: MPI.Comm, reps: int, warmup: int = 2) -> float:
    """Median over ``reps`` of the slowest rank's wall time of ``fn()`` (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(comm.allreduce(dt, op=MPI.MAX))
    return statistics.median(times)


def interleaved_stats(fns: dict[str, Callable[[], Any]], comm: MPI.Comm, reps: int,
                      warmup: int = 3) -> dict[str, dict[str, float]]:
    """Time several functions in alternation (fair under noise); per function the median,
    min and max (s) of the slowest rank's wall time of one call, after a barrier."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            samples[k].append(comm.allreduce(dt, op=MPI.MAX))
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
            for k, v in samples.items()}


def interleaved(fns: dict[str, Callable[[], Any]], comm: MPI.Comm, reps: int,
                warmup: int = 2) -> dict[str, float]:
    """Median times of several functions measured in alternation (:func:`interleaved_stats`)."""
    return {k: s["median"] for k, s in interleaved_stats(fns, comm, reps, warmup).items()}


def timing_columns(name: str, s: dict[str, float]) -> dict[str, Any]:
    """Table/JSON columns for one timed function: median and range in microseconds."""
    return {f"{name}_us": 1e6 * s["median"],
            f"{name}_range_us": f"{1e6 * s['min']:.4g}-{1e6 * s['max']:.4g}"}


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Print ``rows`` as an aligned text table."""
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(fmt(r[c]).ljust(w) for c, w in zip(columns, widths)))


def write_json(name: str, rows: list[dict[str, Any]], **meta: Any) -> str:
    """Write ``rows`` and run metadata to ``benchmarks/results/NAME.json``; return the path."""
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    info = {
        "benchmark": name,
        "ranks": MPI.COMM_WORLD.Get_size(),
        "mpi": MPI.Get_library_version().splitlines()[0],
        "host": platform.node(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **meta,
    }
    with open(path, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=2)
    return path


def plan_step_times(model: Any, shape: tuple[int, ...], plan: Plan, comm: MPI.Comm,
                    iters: int) -> list[float]:
    """Seconds per training step (forward, MSE loss, backward, SGD step; the slowest rank)
    of ``model`` laid out by ``plan`` on ``comm``, ``iters`` steps after an untimed one
    (which shards the weights and builds the halo and redistribution plans)."""
    apply_plan(model, plan, shape, comm)
    first = model[0].layout if isinstance(model, nn.Sequential) else model.layout
    x = dt.random.default_rng(1).standard_normal(first.distribution(shape), np.float32)
    loss_fn = nn.MSELoss()
    opt = nn.SGD(model.parameters(), lr=1e-4)
    target = None
    times = []
    for it in range(iters + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        y = model.forward(x)
        if target is None:
            target = dt.random.default_rng(2).random(y.dist, np.float32)
        loss_fn(y, target)
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if it:
            times.append(t)
    return times
