"""Validate the cost model and the planner against measured training iterations.

Run once per rank count, e.g.::

    for p in 1 2 4; do mpiexec -n $p python benchmarks/validate_planner.py; done

For a small mesh-tangling network the script plans on this machine's
calibrated profile (calibrating first if needed), then measures, for the
planner's plan and for every uniform plan (each layer in the same
distribution: sample-parallel, spatial, hybrid), the real time of each
layer's forward + backward (slowest rank, median of the timed iterations)
and of whole iterations. It prints predicted vs measured per layer for the
planner's plan, the median absolute error per layer and on the iteration,
and the planner's measured time against the best uniform plan measured in
the same run. With ``--budget`` it also plans under a per-rank memory
budget and reports the measured peak resident memory next to the prediction.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

import numpy as np
from _common import print_table, write_json
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor_nn.plan import (
    CostModel,
    KernelTimer,
    Planner,
    apply_plan,
    load_profile,
    wait_for_root,
)
from disttensor_nn.plan.calibrate import calibrate_if_stale
from disttensor_nn.plan.costmodel import machine_id
from disttensor_nn.plan.machine import this_machine_path
from disttensor_nn.plan.planner import leaf_nodes, trace
from disttensor_nn.training import build_model
from disttensor_nn.training.cli import parse_bytes
from disttensor_nn.training.clocks import LayerClocks


def measure(model, shape, plan, comm, iters, target):
    """Per-layer times (slowest and fastest rank) and iteration times of ``plan``'s timed
    iterations (the first, which builds plans and caches, is left out).

    A layer's time on the slowest rank includes waiting, inside the layer's
    collectives, for ranks delayed by earlier layers; the fastest rank's
    time is the layer's own cost.
    """
    apply_plan(model, plan, shape)
    nodes = leaf_nodes(trace(model, shape))
    clocks = LayerClocks(nodes)  # the training driver's per-layer clocks
    first = nodes[0].layer.layout
    x = dt.random.default_rng(1).standard_normal(first.distribution(shape), np.float32)
    loss_fn = nn.MSELoss()
    opt = nn.SGD(model.parameters(), lr=1e-3)
    per_layer, per_layer_min, per_iter = [], [], []
    for it in range(iters + 1):
        clocks.discard()
        comm.Barrier()
        clocks.start_step()
        t0 = time.perf_counter()
        y = model.forward(x)
        loss_fn(y, target(y))
        model.backward(loss_fn.backward())
        opt.step()
        opt.zero_grad()
        t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        mine = clocks.durations()
        lt, lmin = mine.copy(), mine.copy()
        comm.Allreduce(MPI.IN_PLACE, lt, op=MPI.MAX)
        comm.Allreduce(MPI.IN_PLACE, lmin, op=MPI.MIN)
        if it:  # the first iteration builds plans and caches
            per_iter.append(t)
            per_layer.append(lt)
            per_layer_min.append(lmin)
    clocks.remove()
    return per_layer, per_layer_min, per_iter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mesh-small")
    parser.add_argument("--size", default="128x128")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per round")
    parser.add_argument("--rounds", type=int, default=6,
                        help="rounds over all plans; a plan's time is the median of its "
                        "iterations in every round")
    parser.add_argument("--kernel-reps", type=int, default=15,
                        help="timed rounds of the kernel measurement (median per kernel)")
    parser.add_argument("--budget", type=parse_bytes, help="also plan under this memory budget")
    parser.add_argument("--kernel-cache", help="kernel-time cache directory to use (default: a "
                        "fresh one, so that every kernel is measured in this run)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    dt.limit_blas_threads()
    if p < 2 and not os.path.exists(this_machine_path()):
        raise SystemExit("calibrate first: mpiexec -n 2 disttensor-plan --calibrate")
    if p > 1:
        calibrate_if_stale(comm)  # none yet, or taken with another number of ranks per node
    size = tuple(int(v) for v in args.size.split("x"))
    model, shape = build_model(args.model, size, args.batch)
    target = _target_fn()
    # Kernel times are measured in network order on all ranks at once (as they will
    # run), then rank 0 plans; everyone gets the same plans.
    profile = load_profile("this")
    cache_dir = args.kernel_cache
    if cache_dir is None:  # a fresh cache: the kernels are measured in this run
        cache_dir = comm.bcast(tempfile.mkdtemp(prefix="disttensor-kernels-")
                               if comm.rank == 0 else None)
    timer = KernelTimer(machine_id(profile), cache_dir=cache_dir)
    planner = Planner(model, shape, CostModel(profile, p, timer))
    t0 = time.perf_counter()
    # more rounds than a training job's planning takes (3, within 1.5 s): on a shared
    # machine the speed of two ranks computing at once drifts by 20% over a second
    measured = planner.calibrate(comm, reps=args.kernel_reps, max_seconds=60.0)
    if comm.rank == 0:
        print(f"measured kernels in network order for {measured} candidate distributions "
              f"in {time.perf_counter() - t0:.1f} s")
        plans = {"planner": planner.plan()}
        for cand in planner.cands:
            plans[f"uniform {cand}"] = planner.uniform_plan(cand)
        if args.budget:
            budget_planner = Planner(model, shape, CostModel(profile, p, timer), args.budget)
            plans["budget"] = budget_planner.plan()
        timer.save()
    else:
        plans = None
    wait_for_root(comm)  # the others sleep while rank 0 measures what is still missing
    plans = comm.bcast(plans, root=0)
    # Rounds over all plans, so that every plan meets the machine's slower and faster
    # phases alike; a plan's times are medians over the timed iterations of all rounds
    # (the median, as the kernel times, not the fastest round, which picks a fast phase).
    # A first, untimed round pays for the page faults and cold caches that would
    # otherwise fall on the first plan measured.
    samples: dict[str, tuple[list, list, list]] = {name: ([], [], []) for name in plans}
    rss = dict.fromkeys(plans, 0)
    for r in range(args.rounds + 1):
        for name, plan in plans.items():
            got = measure(model, shape, plan, comm, args.iters, target)
            if r:  # round 0 is the untimed one
                for acc, new in zip(samples[name], got):
                    acc += new
            rss[name] = max(rss[name], comm.allreduce(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, op=MPI.MAX))
    results = {name: (np.median(np.array(lt), axis=0), statistics.median(it),
                      rss[name] * 1024, np.median(np.array(lmin), axis=0))
               for name, (lt, lmin, it) in samples.items()}
    if comm.rank != 0:
        return
    plan = plans["planner"]
    layers, it_time, _, layers_min = results["planner"]
    rows, errs, errs_min = [], [], []
    for e, m, mmin in zip(plan.entries, layers, layers_min):
        pred = e.fwd + e.bwd + e.comm
        err = (pred - m) / m if m > 0 else 0.0
        err_min = (pred - mmin) / mmin if mmin > 0 else 0.0
        errs.append(abs(err))
        errs_min.append(abs(err_min))
        rows.append({"layer": f"{e.name} {e.layer}", "grid": str(e.grid),
                     "predicted_ms": 1e3 * pred, "slowest_rank_ms": 1e3 * m,
                     "fastest_rank_ms": 1e3 * mmin, "error_vs_slowest_%": 100 * err,
                     "error_vs_fastest_%": 100 * err_min})
    print(f"{args.model} {shape} on {p} ranks: planner's plan, per layer (fwd+bwd+comm)")
    print_table(rows, list(rows[0]))
    iter_err = (plan.time - it_time) / it_time
    uniform = {k: v[1] for k, v in results.items() if k.startswith("uniform")}
    best_name = min(uniform, key=uniform.get)
    # every measured plan's layers: each layer under each distribution it ran in
    all_errs = [abs(e.fwd + e.bwd + e.comm - m) / m
                for k, v in results.items() for e, m in zip(plans[k].entries, v[0]) if m > 0]
    summary = [{
        "ranks": p, "median_layer_error_%": 100 * statistics.median(errs),
        "median_layer_error_all_plans_%": 100 * statistics.median(all_errs),
        "median_layer_error_fastest_rank_%": 100 * statistics.median(errs_min),
        "iteration_predicted_ms": 1e3 * plan.time, "iteration_measured_ms": 1e3 * it_time,
        "iteration_error_%": 100 * iter_err,
        "best_uniform": best_name, "best_uniform_ms": 1e3 * uniform[best_name],
        "planner_vs_best_uniform": it_time / uniform[best_name],
    }]
    print()
    print_table(summary, list(summary[0]))
    print("\nall plans measured (ms per iteration, predicted vs measured):")
    allrows = [{"plan": k, "predicted_ms": 1e3 * plans[k].time, "measured_ms": 1e3 * v[1],
                "error_%": 100 * (plans[k].time - v[1]) / v[1],
                "median_layer_error_%": 100 * statistics.median(
                    abs(e.fwd + e.bwd + e.comm - m) / m
                    for e, m in zip(plans[k].entries, v[0]) if m > 0),
                "predicted_peak_MiB": plans[k].peak_memory / 2**20,
                "measured_maxrss_MiB": v[2] / 2**20} for k, v in results.items()]
    print_table(allrows, list(allrows[0]))
    print("wrote", write_json(f"validate_planner_p{p}", rows, summary=summary, plans=allrows,
                              model=args.model, shape=shape))


def _target_fn():
    cache = {}

    def target(y):
        key = (y.dist, y.shape)
        if key not in cache:
            cache[key] = dt.random.default_rng(2).random(y.dist, np.float32)
        return cache[key]
    return target


if __name__ == "__main__":
    main()
