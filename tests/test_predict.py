"""Distributed inference (disttensor-predict) and the planner's inference memory model.

The reference for a prediction is the same model, loaded from the same
checkpoint, run in one process on the whole sample (``model(x)`` in eval
mode on a DistArray of one block), and the 1-rank run of ``predict``.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import assert_allclose, collective_assert, collective_outcome
from disttensor_nn import Conv2d
from disttensor_nn.memory import resident_bytes
from disttensor_nn.plan import CostModel, Planner, make_plan
from disttensor_nn.plan.machine import builtin_profiles
from disttensor_nn.training import MeshSynthetic, build_model, save_checkpoint
from disttensor_nn.training.cli import predict_main
from disttensor_nn.training.data import save_dataset
from disttensor_nn.training.inference import PredictConfig, predict

h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

comm = MPI.COMM_WORLD
P = comm.Get_size()
V100 = "v100-nvlink-edr"  # a rate-model profile: planning measures nothing


@pytest.fixture
def shared_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Rank 0's tmp_path, on every rank."""
    return pathlib.Path(comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0))


def trained_checkpoint(directory, size):
    """A mesh-demo checkpoint with non-trivial weights and batch-norm statistics."""
    model, _ = build_model("mesh-demo", size, 1, seed=11)
    rng = np.random.default_rng(3)
    for _, layer in model.named_modules():
        if hasattr(layer, "running_mean"):
            n = layer.running_mean.shape
            layer.running_mean = rng.normal(0, 0.3, n)
            layer.running_var = rng.uniform(0.5, 2.0, n)
    save_checkpoint(directory, model, None, step=1, comm=comm)
    return model


def reference(model, data, size):
    """Every output of ``model`` (eval mode) on whole samples, in this process alone."""
    model.eval()
    grid = dt.ProcessGrid((1,), MPI.COMM_SELF)
    outs = []
    for i in range(len(data)):
        x, _ = data.sample(i)
        xd = dt.DistArray.from_local(x[None], dt.Distribution((1, *x.shape), grid,
                                                              (None,) * 4))
        outs.append(model(xd).local[0])
    return np.stack(outs)


@pytest.mark.parallel([1, 2, 3])
def test_predict_equals_one_process_and_one_rank(shared_dir, capsys):
    size = (24, 16)
    data = MeshSynthetic(3, size, channels=18, seed=2)
    ckpt, inp = shared_dir / "ckpt", shared_dir / "in.h5"
    model = trained_checkpoint(ckpt, size)
    save_dataset(inp, data)
    out = shared_dir / "out.zarr"
    assert predict_main(["mesh-demo", "--checkpoint", str(ckpt), "--data", str(inp),
                         "--out", str(out), "--machine", V100, "--no-progress",
                         "--chunks", "8x8"]) == 0
    printed = capsys.readouterr().out
    if comm.Get_rank() == 0:
        assert "peak resident memory per rank (MiB)" in printed and "wrote 3 outputs" in printed
    got = zarr.open_array(out, mode="r")
    assert tuple(got.shape) == (3, 1, *size) and tuple(got.chunks) == (1, 1, 8, 8)
    want = reference(model, data, size)
    assert_allclose(got[...], want, rtol=1e-5, atol=1e-6)
    one = None
    if comm.Get_rank() == 0:  # the same prediction on one rank, into a .npy file
        cfg = PredictConfig(model="mesh-demo", checkpoint=str(ckpt), data=str(inp),
                            out=str(shared_dir / "one.npy"), machine=V100, progress=False)
        summary = predict(cfg, comm=MPI.COMM_SELF)
        assert len(summary["peak_memory_per_rank_bytes"]) == 1
        one = np.load(shared_dir / "one.npy")
    one = comm.bcast(one, root=0)
    assert_allclose(got[...], one, rtol=1e-5, atol=1e-6)


def test_inference_memory_model_keeps_nothing_for_backward():
    model, shape = build_model("mesh-demo", (64, 64), 2)
    profile = builtin_profiles()[V100]
    train = Planner(model, shape, CostModel(profile, 1))
    infer = Planner(model, shape, CostModel(profile, 1, training=False))
    params = sum(p.data.nbytes for p in model.parameters())
    out = 2 * 1 * 64 * 64 * 4  # the network's output, (2, 1, 64, 64) float32
    # parameters, gradients, momenta, and the local gradients the buckets hold at the end of
    # backward: the convolutions', each under 1 MiB, so also copied into a fused bucket
    # (batch norm sums its parameters' gradients with its statistics, at once)
    convs = [m for m in model.modules() if isinstance(m, Conv2d)]
    conv_params = sum(p.data.nbytes for m in convs for p in m.parameters())
    assert convs and all(p.data.nbytes < 2**20 for p in model.parameters())
    assert train.base_memory == 3 * params + 2 * conv_params + 2 * out
    assert infer.base_memory == params + out
    assign = {id(n): 0 for n in infer.nodes}
    # inference: the base plus the largest forward pass of one layer, i.e. its input and
    # output blocks, its forward scratch and what it saves until the pass ends; nothing kept
    passes = []
    for n in infer.nodes:
        dist = dt.Distribution(n.in_shape, (1,) * len(n.in_shape))
        spec = n.layer.cost_spec(dist, 4)
        in_b = 4 * np.prod(n.in_shape)
        out_b = 4 * np.prod(n.layer.output_shape(n.in_shape))
        scratch = spec.workspace if spec.forward_workspace is None else spec.forward_workspace
        passes.append(in_b + out_b + scratch + spec.saved)
        assert infer.layer_cost(n, 0).memory == 0 and infer.layer_cost(n, 0).bwd == 0
    assert infer.assignment_cost(assign)[1] == pytest.approx(infer.base_memory + max(passes))
    trained = train.assignment_cost({id(n): 0 for n in train.nodes})[1]
    assert infer.assignment_cost(assign)[1] < trained


@pytest.mark.parallel([3])
def test_a_sample_that_fits_no_rank_alone(shared_dir, capsys):
    size = (256, 256)
    model, shape = build_model("mesh-demo", size, 1)
    # the least inference memory of one rank and of three (the model's data alone)
    least = []
    for p in (1, 3):
        planner = Planner(model, shape, CostModel(builtin_profiles()[V100], p, training=False))
        least.append(planner.assignment_cost(planner._solve(np.inf))[1])
    budget = (least[0] + least[1]) / 2
    _, error = collective_outcome(make_plan, model, shape, 1, V100, budget, False,
                                  training=False)
    collective_assert(isinstance(error, ValueError), repr(error))
    data = MeshSynthetic(1, size, channels=18, seed=4)
    ckpt, inp, out = shared_dir / "ckpt", shared_dir / "in.zarr", shared_dir / "out.npy"
    trained = trained_checkpoint(ckpt, size)
    save_dataset(inp, data)
    baseline = comm.allreduce(resident_bytes(), op=MPI.MAX)
    cfg = PredictConfig(model="mesh-demo", checkpoint=str(ckpt), data=str(inp), out=str(out),
                        machine=V100, memory_per_rank=baseline + budget, progress=False)
    summary = predict(cfg)
    assert summary["predicted_peak_memory_bytes"] <= baseline + budget
    assert "(1, 3, 1)" in summary["plan"] or "(1, 1, 3)" in summary["plan"], summary["plan"]
    assert_allclose(np.load(out), reference(trained, data, size), rtol=1e-5, atol=1e-6)


@pytest.mark.parallel([1, 2])
def test_predict_on_another_array_module_and_without_a_gpu(shared_dir, capsys):
    """The model on array_api_strict (CuPy's stand-in) predicts what the NumPy run does;
    --device gpu without CuPy or a GPU is one clear error before any work."""
    xps = pytest.importorskip("array_api_strict")
    size = (16, 12)
    data = MeshSynthetic(2, size, channels=18, seed=4)
    ckpt, inp = shared_dir / "ckpt", shared_dir / "in.h5"
    model = trained_checkpoint(ckpt, size)
    save_dataset(inp, data)
    cfg = PredictConfig(model="mesh-demo", checkpoint=str(ckpt), data=str(inp),
                        out=str(shared_dir / "strict.zarr"), machine=V100, progress=False)
    predict(cfg, xp=xps)
    got = zarr.open_array(shared_dir / "strict.zarr", mode="r")[...]
    assert_allclose(got, reference(model, data, size), rtol=1e-5, atol=1e-6)
    try:
        import cupy  # noqa: F401
        return  # a machine with CuPy: the GPU tests cover it
    except ImportError:
        pass
    with pytest.raises(SystemExit) as exc:
        predict_main(["mesh-demo", "--checkpoint", str(ckpt), "--data", str(inp), "--out",
                      str(shared_dir / "gpu.zarr"), "--machine", V100, "--device", "gpu"])
    err = capsys.readouterr().err
    collective_assert(exc.value.code == 2, f"exit {exc.value.code}")
    if comm.Get_rank() == 0:
        assert "--device gpu" in err and "CuPy" in err and "Traceback" not in err
