"""Interleaved timing with medians and ranges, for the data-movement benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI


def interleaved_stats(fns: dict[str, Callable[[], Any]], comm: MPI.Comm, reps: int,
                      warmup: int = 3) -> dict[str, dict[str, float]]:
    """Time several functions in alternation; per function the median, min and max (s).

    Each sample is the slowest rank's wall time of one call, after a barrier.
    """
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


def timing_columns(name: str, s: dict[str, float]) -> dict[str, Any]:
    """Table/JSON columns for one timed function: median and range in microseconds."""
    return {f"{name}_us": 1e6 * s["median"],
            f"{name}_range_us": f"{1e6 * s['min']:.4g}-{1e6 * s['max']:.4g}"}
