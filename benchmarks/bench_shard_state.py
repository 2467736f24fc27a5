"""Parameter state per rank under each ``--shard-state`` stage, counted, against the
replicated state and against the memory model's prediction.

A registered model (ResNet-50 by default) trains two steps sample-parallel over the
ranks of this job with SGD and momentum or Adam; after them, each rank counts the bytes
it holds of the parameters (their weights, or the pieces of them under ``full``), of
their gradients and of the optimizer's state, for each stage; the table gives the
median over the ranks (with the range) and the share of the unsharded state. The
state does not depend on the input's size, so a small image keeps the steps short.

Examples
--------
    mpiexec -n 4 python benchmarks/bench_shard_state.py
    mpiexec -n 4 python benchmarks/bench_shard_state.py --model resnet50 --optimizer adam
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import numpy as np
from mpi4py import MPI

import disttensor as dt
from disttensor_nn.optim import STAGES
from disttensor_nn.plan import CostModel, Planner, apply_plan, load_profile
from disttensor_nn.plan.tracing import leaf_nodes, trace
from disttensor_nn.training import TrainConfig, build_model
from disttensor_nn.training.recipe import make_optimizer, state_slots
from disttensor_nn.training.registry import model_spec


def _nbytes(a: Any) -> int:
    return int(getattr(a, "nbytes", 0) or 0)


def held_bytes(model: Any, opt: Any) -> dict[str, int]:
    """What this rank holds of the parameters, their gradients and the optimizer's state."""
    weights = sum(_nbytes(p.like) for p in model.parameters())  # the block, or the piece
    grads = sum(_nbytes(p.grad) for p in model.parameters())
    state = sum(_nbytes(a) for s in opt.state if s is not None
                for a in (s.values() if isinstance(s, dict) else [s]))
    return {"weights": weights, "grads": grads, "state": state,
            "total": weights + grads + state}


def plan_layout(model: Any, shape: tuple[int, ...]) -> Any:
    """The layout the plan gave the model's first layer (its input's)."""
    return leaf_nodes(trace(model, shape))[0].layer.layout


def run(name: str, size: tuple[int, ...], batch: int, optimizer: str, stage: str,
        comm: MPI.Comm) -> dict[str, Any]:
    model, shape = build_model(name, size, batch)
    p = comm.Get_size()
    planner = Planner(model, shape, CostModel(load_profile("v100-nvlink-edr"), p))
    plan = planner.uniform_plan((p,) + (1,) * (len(shape) - 2))  # every layer by sample
    apply_plan(model, plan, shape, comm)
    cfg = TrainConfig(model=name, optimizer=optimizer, shard_state=stage)
    opt = make_optimizer(cfg, model.parameters(), 1e-3)
    loss_fn = model_spec(name).loss()
    first = plan_layout(model, shape)
    rng = np.random.default_rng(0)
    x_global = rng.standard_normal(shape).astype(np.float32)
    x = dt.DistArray.from_global(x_global, first.distribution(shape))
    y = np.arange(batch) % 10
    for _ in range(2):
        opt.zero_grad()
        out = model(x)
        loss_fn(out, y)
        model.call_backward(loss_fn.backward())
        opt.step()
    mine = held_bytes(model, opt)
    every = comm.allgather(mine)
    # the memory model's figure also counts the reductions' buckets and an update's temporary
    predicted = CostModel(load_profile("v100-nvlink-edr"), p, shard_state=stage,
                          state_slots=state_slots(cfg)).params_memory(model)
    return {"stage": stage, "ranks": p, "per_rank": every, "predicted": predicted,
            **{k: statistics.median(r[k] for r in every) for k in mine}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--size", default="64x64", help="input size (the state does not depend on it)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"))
    ap.add_argument("--json", default="bench_shard_state.json")
    a = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    size = tuple(int(s) for s in a.size.split("x"))
    rows = [run(a.model, size, a.batch, a.optimizer, stage, comm) for stage in STAGES]
    if comm.Get_rank() == 0:
        base = rows[0]["total"]
        print(f"{a.model} b{a.batch}, {a.optimizer}, {comm.Get_size()} ranks (sample split): "
              "parameter state per rank, counted (median over ranks)")
        print(f"{'stage':<10} {'weights MiB':>11} {'grads MiB':>10} {'state MiB':>10} "
              f"{'total MiB':>10} {'range MiB':>15} {'share':>6} {'predicted MiB':>13}")
        for r in rows:
            tot = [x["total"] for x in r["per_rank"]]
            print(f"{r['stage']:<10} {r['weights'] / 2**20:11.1f} {r['grads'] / 2**20:10.1f} "
                  f"{r['state'] / 2**20:10.1f} {r['total'] / 2**20:10.1f} "
                  f"{min(tot) / 2**20:7.1f}-{max(tot) / 2**20:<7.1f} {r['total'] / base:6.3f} "
                  f"{r['predicted'] / 2**20:13.1f}")
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "batch": a.batch, "optimizer": a.optimizer,
                       "rows": rows}, f, indent=1)
        print(f"\nwritten to {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
