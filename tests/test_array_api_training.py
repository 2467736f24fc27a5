"""Every layer type, the losses and the whole training loop on a non-NumPy array library.

``array_api_strict`` stands in for CuPy on machines without a GPU: it accepts
only what the array API standard defines (no ``out=``, no ``.flags``, no
methods such as ``.reshape``, its own dtype objects), so a NumPy-only
assumption in a layer, the optimizer, the gradient buckets, the data loader or
the driver fails here on CPU instead of on the first GPU run. Each result is
compared with the same computation on NumPy (itself checked against
independent references by the layer tests), on sample, spatial and uneven
splits at several world sizes; the training loop is compared loss by loss,
including a checkpoint written from the array_api_strict model and resumed on
NumPy.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor.backend import array_namespace, to_numpy
from disttensor.testing import collective_assert
from disttensor_nn.models.mesh import DepthToSpace
from disttensor_nn.training.driver import SetupError, TrainConfig, train

xps = pytest.importorskip("array_api_strict")

comm = MPI.COMM_WORLD
F64 = np.float64


@functools.cache
def grid(shape: tuple[int, ...]) -> dt.ProcessGrid:
    return dt.ProcessGrid(shape)


def _grid2(p: int) -> tuple[int, int]:
    return {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[p]


def layouts(shape: tuple[int, ...]) -> list[tuple[str, dt.Distribution]]:
    """Sample split, last spatial dim split with uneven blocks (an empty one), sample x space."""
    p = comm.Get_size()
    n = len(shape)
    last = [None] * n
    last[-1] = 0
    cuts = [None] * n
    cuts[-1] = [] if p == 1 else [0] + [min(shape[-1], 2)] * (p - 2)
    both = [None] * n
    both[0], both[2] = 0, 1
    return [("sample", dt.Distribution(shape, grid((p,)), (0,) + (None,) * (n - 1))),
            ("last dim uneven", dt.Distribution(shape, grid((p,)), last, cuts)),
            ("sample x space", dt.Distribution(shape, grid(_grid2(p)), both))]


# (name, input shape, layer factory); float64 so that both libraries agree to rounding
LAYERS = {
    "conv1d": ((3, 3, 11), lambda: nn.Conv1d(3, 4, 3, padding=1, dtype=F64, seed=1)),
    "conv2d_strided_groups": ((3, 4, 9, 8), lambda: nn.Conv2d(
        4, 6, (3, 2), stride=2, padding=(2, 1), dilation=2, groups=2, padding_mode="reflect",
        dtype=F64, seed=2)),
    "conv3d": ((2, 2, 5, 6, 5), lambda: nn.Conv3d(2, 3, 3, padding=1, dtype=F64, seed=3)),
    "batchnorm_global": ((4, 3, 6, 7), lambda: nn.BatchNorm2d(3, dtype=F64)),
    "batchnorm_group": ((4, 3, 6, 7), lambda: nn.BatchNorm2d(3, stats="group", dtype=F64)),
    "batchnorm_eval": ((4, 3, 6, 7), lambda: _eval(nn.BatchNorm2d(3, dtype=F64))),
    "relu": ((3, 2, 5, 6), nn.ReLU),
    "leaky_relu": ((3, 2, 5, 6), lambda: nn.LeakyReLU(0.1)),
    "sigmoid": ((3, 2, 5, 6), nn.Sigmoid),
    "maxpool": ((3, 2, 9, 7), lambda: nn.MaxPool2d(3, stride=2, padding=1)),
    "avgpool": ((3, 2, 8, 6), lambda: nn.AvgPool2d(2, padding=1)),
    "global_avgpool": ((3, 4, 5, 6), nn.GlobalAvgPool),
    "flatten_linear": ((4, 2, 3, 4), lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(24, 5, dtype=F64, seed=4))),
    "residual": ((3, 3, 6, 6), lambda: nn.Residual(
        nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, dtype=F64, seed=5), nn.ReLU()))),
    "depth_to_space": ((2, 8, 4, 5), lambda: DepthToSpace(2)),
    "conv_transpose2d": ((2, 3, 5, 6), lambda: nn.ConvTranspose2d(
        3, 4, 3, stride=2, padding=1, output_padding=1, dtype=F64, seed=6)),
    "conv_transpose3d": ((1, 2, 3, 4, 3), lambda: nn.ConvTranspose3d(2, 2, 2, stride=2,
                                                                      dtype=F64, seed=7)),
    "upsample_nearest": ((2, 2, 4, 5), lambda: nn.Upsample(scale_factor=2)),
    "upsample_bilinear": ((2, 2, 4, 5), lambda: nn.Upsample(scale_factor=2, mode="bilinear")),
    "groupnorm": ((2, 4, 5, 6), lambda: nn.GroupNorm(2, 4, dtype=F64)),
    "instancenorm": ((2, 4, 5, 6), lambda: nn.InstanceNorm(4, dtype=F64)),
    "dropout": ((2, 3, 4, 5), lambda: nn.Dropout(0.3, seed=2)),
    "softmax": ((2, 3, 4, 5), lambda: nn.Softmax(dim=1)),
    "skip_concat": ((2, 2, 4, 4), lambda: nn.Skip(nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, dtype=F64, seed=8), nn.ReLU()))),
}


def _eval(layer: nn.Layer) -> nn.Layer:
    layer.running_mean = np.linspace(-0.5, 0.5, 3)
    layer.running_var = np.linspace(0.5, 2.0, 3)
    return layer.eval()


def _run(layer: nn.Layer, xg: np.ndarray, dist: dt.Distribution, xp) -> tuple:
    """Forward and backward of ``layer`` moved to ``xp``: NumPy copies of y, dx, gradients."""
    layer.to(xp)
    x = dt.DistArray.from_global(xp.asarray(xg) if xp is not np else xg, dist)
    y = layer(x)
    dyg = np.random.default_rng(9).standard_normal(y.shape)
    dy = dt.DistArray.from_global(xp.asarray(dyg) if xp is not np else dyg, y.dist)
    dx = layer.call_backward(dy)
    assert array_namespace(y.local) is xp and array_namespace(dx.local) is xp
    grads = [to_numpy(p.grad) for p in layer.parameters()]
    state = {k: to_numpy(v) for k, v in layer.state_dict().items()}
    return to_numpy(y.local), to_numpy(dx.local), grads, state


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_layer_on_array_api_strict_equals_numpy(kind):
    shape, make = LAYERS[kind]
    xg = np.random.default_rng(7).standard_normal(shape)
    errors = []
    for name, dist in layouts(shape):
        y0, dx0, g0, s0 = _run(make(), xg, dist, np)
        y1, dx1, g1, s1 = _run(make(), xg, dist, xps)
        try:
            np.testing.assert_allclose(y1, y0, rtol=1e-12, atol=1e-12, err_msg="y")
            np.testing.assert_allclose(dx1, dx0, rtol=1e-12, atol=1e-12, err_msg="dx")
            assert len(g1) == len(g0)
            for a, b in zip(g1, g0):
                np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12, err_msg="gradient")
            assert s1.keys() == s0.keys()
            for k in s0:  # running statistics included
                np.testing.assert_allclose(s1[k], s0[k], rtol=1e-12, atol=1e-14, err_msg=k)
        except AssertionError as exc:
            errors.append(f"{kind} on {name}: {exc}")
    collective_assert(not errors, "\n".join(errors[:3]))


LOSSES = {
    "cross_entropy": ((6, 5), nn.SoftmaxCrossEntropy,
                      lambda: np.array([0, 4, 2, 2, 1, 3])),
    "mse": ((3, 2, 4, 5), nn.MSELoss,
            lambda: np.random.default_rng(3).standard_normal((3, 2, 4, 5))),
    "bce": ((3, 1, 4, 5), nn.BCEWithLogitsLoss,
            lambda: (np.random.default_rng(4).random((3, 1, 4, 5)) > 0.5).astype(F64)),
    "pixel_cross_entropy": ((3, 4, 5, 6), nn.CrossEntropyLoss,
                            lambda: np.random.default_rng(5).integers(0, 4, (3, 5, 6))),
    "dice": ((3, 4, 5, 6), nn.DiceLoss,
             lambda: np.random.default_rng(6).integers(0, 4, (3, 5, 6))),
}


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_loss_on_array_api_strict_equals_numpy(kind):
    shape, make, target = LOSSES[kind]
    pg = np.random.default_rng(5).standard_normal(shape)
    dist = dt.Distribution(shape, grid((comm.Get_size(),)), (0,) + (None,) * (len(shape) - 1))
    results = []
    for xp in (np, xps):
        pred = dt.DistArray.from_global(xp.asarray(pg) if xp is not np else pg, dist)
        loss = make()
        value = loss(pred, target())
        g = loss.backward()
        assert array_namespace(g.local) is xp
        results.append((value, to_numpy(g.local)))
    (v0, g0), (v1, g1) = results
    ok = abs(v1 - v0) <= 1e-12 * abs(v0) and np.allclose(g1, g0, rtol=1e-12, atol=1e-15)
    collective_assert(ok, f"{kind}: {v1} vs {v0}")


def _config(tmp: str | None = None, steps: int = 4, **kw) -> TrainConfig:
    return TrainConfig(model="mesh-demo", batch=4, steps=steps, size=(16, 16), samples=8,
                       metrics=None, progress=False, machine="v100-nvlink-edr",
                       checkpoint=tmp, **kw)


@pytest.mark.parallel([1, 2, 3])
def test_training_loop_on_array_api_strict_equals_numpy(tmp_path_factory):
    """train() on array_api_strict gives NumPy's losses; its checkpoint resumes on NumPy."""
    tmp = comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if comm.Get_rank() == 0 else None)
    whole = train(_config(steps=4))["history"]
    strict = train(_config(tmp, steps=2), xp=xps)["history"]
    resumed = train(_config(tmp, steps=4, resume=True))["history"]
    ok = np.allclose(strict, whole[:2], rtol=1e-5) and np.allclose(resumed, whole, rtol=1e-5)
    collective_assert(ok, f"strict {strict} then NumPy {resumed} vs NumPy {whole}")


@pytest.mark.parallel([1, 2])
def test_gpu_device_without_cupy_is_a_setup_error():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is importable here")
    except ImportError:
        pass
    with pytest.raises(SetupError, match="--device gpu: .*CuPy"):
        train(_config(device="gpu"))
