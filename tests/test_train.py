"""The training driver: distributed = serial losses, bitwise resume, and the demo learns."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from disttensor.testing import collective_assert
from disttensor_nn.plan import CostModel, Planner, builtin_profiles
from disttensor_nn.training import TrainConfig, build_model, train

V100 = "v100-nvlink-edr"  # a rate-model profile: planning measures nothing


def shared_tmpdir(comm: MPI.Comm) -> str:
    path = tempfile.mkdtemp(prefix="dt-train-") if comm.Get_rank() == 0 else None
    return comm.bcast(path, root=0)


def uniform_plan_file(model_name, size, batch, grid, directory) -> str:
    model, shape = build_model(model_name, size, batch)
    planner = Planner(model, shape, CostModel(builtin_profiles()[V100], int(np.prod(grid))))
    path = os.path.join(directory, f"plan-{'x'.join(map(str, grid))}.json")
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(path, "w") as f:
            f.write(planner.uniform_plan(grid).to_json())
    MPI.COMM_WORLD.Barrier()
    return path


def config(**kw) -> TrainConfig:
    base = dict(model="mesh-demo", size=(64, 64), batch=4, steps=10, samples=16,
                metrics=None, machine=V100, progress=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parallel(4)
def test_hybrid_training_matches_one_rank():
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    hybrid = uniform_plan_file("mesh-demo", (64, 64), 4, (2, 2, 1), tmp)
    dist = train(config(layout=hybrid))
    ref = None
    if comm.Get_rank() == 0:  # the same training on one rank
        model, shape = build_model("mesh-demo", (64, 64), 4)
        plan = Planner(model, shape, CostModel(builtin_profiles()[V100], 1)).uniform_plan(
            (1, 1, 1))
        path = os.path.join(tmp, "plan-1.json")
        with open(path, "w") as f:
            f.write(plan.to_json())
        ref = train(config(layout=path), comm=MPI.COMM_SELF)
    ref = comm.bcast(ref, root=0)
    a, b = np.array(_history(dist)), np.array(_history(ref))
    collective_assert(len(a) == 10 and np.allclose(a, b, rtol=2e-5, atol=0),
                      f"losses differ: {a} vs {b}")
    collective_assert(dist["ranks"] == 4 and ref["ranks"] == 1, "rank counts")


def _history(summary: dict) -> list[float]:
    return summary["history"]


@pytest.mark.parallel(3)
def test_resume_is_bitwise_identical():
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    ckpt = os.path.join(tmp, "ckpt")
    full = train(config(steps=6, metrics=os.path.join(tmp, "full")))
    train(config(steps=3, checkpoint=ckpt, metrics=os.path.join(tmp, "a")))
    resumed = train(config(steps=6, checkpoint=ckpt, resume=True,
                           metrics=os.path.join(tmp, "b")))
    collective_assert(_history(full) == _history(resumed),
                      f"{_history(full)} vs {_history(resumed)}")


@pytest.mark.parallel(4)
def test_default_demo_halves_the_loss():
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    d = TrainConfig()
    s = train(TrainConfig(machine=V100, progress=False, metrics=os.path.join(tmp, "demo")))
    h = _history(s)
    collective_assert(s["steps"] == d.steps and h[-1] <= 0.5 * h[0],
                      f"loss {h[0]} -> {h[-1]} in {s['steps']} steps")


def test_plot_writes_png_files(tmp_path):
    from disttensor_nn.training import plot_metrics

    prefix = str(tmp_path / "run")
    train(config(steps=2, metrics=prefix), comm=MPI.COMM_SELF)
    paths = plot_metrics(prefix + ".json")
    assert [p.rsplit("-", 1)[1] for p in paths] == ["loss.png", "layers.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_train_command_line(tmp_path, capsys):
    from disttensor_nn.training.cli import train_main

    prefix = str(tmp_path / "cli")
    assert train_main(["mesh-demo", "--size", "64x64", "--batch", "2", "--steps", "2",
                       "--machine", V100, "--no-progress", "--metrics", prefix]) == 0
    out = capsys.readouterr().out
    assert "predicted time per iteration" in out and "loss" in out
    assert os.path.exists(prefix + ".csv") and os.path.exists(prefix + ".json")
