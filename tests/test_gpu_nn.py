"""GPU kernels and layers (CuPy) against the NumPy results on the same data.

Skipped where CuPy is not importable or no GPU is visible. Kernels: conv
forward and backward (1-, 2-, 3-D, strides, dilation, groups) through cuDNN
when the frontend is importable and through im2col + cuBLAS, and max / avg
pooling, each compared with :mod:`disttensor_nn.kernels.numpy_kernels`.
Layers: Conv2d, MaxPool2d, AvgPool2d and BatchNorm2d on DistArrays whose
blocks are CuPy arrays, split spatially over the ranks (every rank on the one
GPU it is given), forward and backward, compared with the same layers on
NumPy blocks: this also runs the GPU halo exchange and accumulation and the
gradient allreduce of device arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from nn_reference import Checks, grid, grid2_shape

import disttensor as dt
import disttensor_nn as nn
from disttensor_nn.kernels import kernels_for, numpy_kernels

cupy = pytest.importorskip("cupy")
try:
    _ngpu = cupy.cuda.runtime.getDeviceCount()
except Exception:  # no driver, or no device
    _ngpu = 0
if _ngpu == 0:
    pytest.skip("no GPU visible", allow_module_level=True)

from disttensor_nn.kernels import cupy_kernels  # noqa: E402  (needs CuPy)

cupy.cuda.Device(MPI.COMM_WORLD.Get_rank() % _ngpu).use()

# float64 through im2col matches NumPy to rounding; cuDNN may use TF32 for float32
TOL = {np.float64: 1e-9, np.float32: 2e-2}

CONV_CASES = [
    ("1d_s2", (2, 3, 17), (4, 3, 3), (2,), (1,), 1),
    ("2d_3x3", (4, 16, 14, 13), (8, 16, 3, 3), (1, 1), (1, 1), 1),
    ("2d_5x5_s2", (1, 6, 33, 31), (8, 6, 5, 5), (2, 2), (1, 1), 1),
    ("2d_d2_groups2", (2, 8, 15, 12), (6, 4, 3, 3), (1, 2), (2, 1), 2),
    ("3d", (2, 3, 9, 8, 7), (4, 3, 3, 3, 2), (1, 2, 1), (1, 1, 2), 1),
]


def _close(actual, desired, dtype, what):
    actual = cupy.asnumpy(actual)
    scale = max(1.0, float(np.abs(desired).max())) if desired.size else 1.0
    np.testing.assert_allclose(actual, desired, rtol=TOL[dtype], atol=TOL[dtype] * scale,
                               err_msg=what)


def test_dispatch():
    assert kernels_for(cupy.zeros(3)) is cupy_kernels


@pytest.mark.parametrize("cudnn", [True, False], ids=["cudnn", "im2col"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_kernels(case, dtype, cudnn, monkeypatch):
    if cudnn and not cupy_kernels.cudnn_available():
        pytest.skip("the cuDNN frontend (nvidia-cudnn-frontend) is not importable")
    monkeypatch.setattr(cupy_kernels, "use_cudnn", cudnn)
    _, xs, ws, stride, dilation, groups = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal(xs).astype(dtype)
    w = rng.standard_normal(ws).astype(dtype)
    b = rng.standard_normal(ws[0]).astype(dtype)
    y = numpy_kernels.conv_forward(x, w, b, stride, dilation, groups)
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx, dw, db = numpy_kernels.conv_backward(dy, x, w, stride, dilation, groups)
    gx, gw, gb, gdy = (cupy.asarray(a) for a in (x, w, b, dy))
    _close(cupy_kernels.conv_forward(gx, gw, gb, stride, dilation, groups), y, dtype, "y")
    gdx, gdw, gdb = cupy_kernels.conv_backward(gdy, gx, gw, stride, dilation, groups)
    _close(gdx, dx, dtype, "dx")
    _close(gdw, dw, dtype, "dw")
    _close(gdb, db, dtype, "db")
    only_dw = cupy_kernels.conv_backward(gdy, gx, gw, stride, dilation, groups, need_dx=False)
    assert only_dw[0] is None
    _close(only_dw[1], dw, dtype, "dw alone")


@pytest.mark.parametrize("op", ["max", "avg"])
def test_pool_kernels(op):
    x = np.random.default_rng(1).standard_normal((2, 3, 11, 10))
    args = ((3, 2), (2, 2), (1, 2), op)
    y, arg = numpy_kernels.pool_forward(x, *args)
    gy, garg = cupy_kernels.pool_forward(cupy.asarray(x), *args)
    _close(gy, y, np.float64, "y")
    dy = np.random.default_rng(2).standard_normal(y.shape)
    dx = numpy_kernels.pool_backward(dy, x.shape, *args, arg)
    _close(cupy_kernels.pool_backward(cupy.asarray(dy), x.shape, *args, garg), dx, np.float64,
           "dx")


def _layer(name):
    return {
        "conv3x3": lambda: nn.Conv2d(4, 6, 3, padding=1, dtype=np.float64, seed=1),
        "conv5x5_s2_overlap": lambda: nn.Conv2d(4, 5, 5, stride=2, padding=2, overlap=True,
                                                dtype=np.float64, seed=2),
        "maxpool": lambda: nn.MaxPool2d(3, stride=2, padding=1),
        "avgpool": lambda: nn.AvgPool2d(2),
        "batchnorm": lambda: nn.BatchNorm2d(4, dtype=np.float64),
        "relu": lambda: nn.ReLU(),
    }[name]()


@pytest.mark.parallel([1, 2])
@pytest.mark.parametrize("name", ["conv3x3", "conv5x5_s2_overlap", "maxpool", "avgpool",
                                  "batchnorm", "relu"])
def test_layers_gpu_vs_cpu(name):
    p = MPI.COMM_WORLD.Get_size()
    shape = (2, 4, 18, 15)
    dist = dt.Distribution(shape, grid(grid2_shape(p)), (None, None, 0, 1))
    rng = np.random.default_rng(3)
    xg = rng.standard_normal(shape)
    cpu, gpu = _layer(name), nn.to_array_module(_layer(name), cupy)
    x = dt.DistArray.from_global(xg, dist)
    y = cpu(x)
    dyg = np.random.default_rng(4).standard_normal(y.shape)
    dy = dt.DistArray.from_global(dyg, y.dist)
    dx = cpu.backward(dy)

    gx = dt.DistArray.from_local(cupy.asarray(x.local), dist)
    gyv = gpu(gx)
    gdx = gpu.backward(dt.DistArray.from_local(cupy.asarray(dy.local), gyv.dist))
    chk = Checks()
    chk.true(isinstance(gyv.local, cupy.ndarray), "the output block is not on the GPU")
    chk.close(cupy.asnumpy(gyv.local), y.local, "y", rtol=1e-9, atol=1e-9)
    chk.close(cupy.asnumpy(gdx.local), dx.local, "dx", rtol=1e-9, atol=1e-9)
    for a, b in zip(gpu.parameters(), cpu.parameters()):
        chk.close(cupy.asnumpy(a.grad), b.grad, "parameter gradient", rtol=1e-9, atol=1e-9)
    chk.finish()


@pytest.mark.parallel([1, 2])
def test_sgd_step_on_gpu():
    """A conv + BN + ReLU model trains one step on the GPU as on the CPU."""
    p = MPI.COMM_WORLD.Get_size()
    shape = (2, 3, 12, 10)
    dist = dt.Distribution(shape, grid(grid2_shape(p)), (None, None, 0, 1))

    def model():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, dtype=np.float64, seed=5),
                             nn.BatchNorm2d(4, dtype=np.float64), nn.ReLU())

    xg = np.random.default_rng(6).standard_normal(shape)
    results = []
    for xp in (np, cupy):
        m = nn.to_array_module(model(), xp)
        opt = nn.SGD(m.parameters(), lr=0.1, momentum=0.9)
        x = dt.DistArray.from_local(xp.asarray(dt.DistArray.from_global(xg, dist).local), dist)
        y = m(x)
        loss = nn.MSELoss()
        loss(y, xp.zeros(y.shape))
        m.backward(loss.backward())
        opt.step()
        results.append([cupy.asnumpy(q.data) if xp is cupy else q.data for q in m.parameters()])
    chk = Checks()
    for a, b in zip(results[1], results[0]):
        chk.close(a, b, "parameter after one step", rtol=1e-9, atol=1e-9)
    chk.finish()
