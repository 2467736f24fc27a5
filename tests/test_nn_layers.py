"""Pooling, batch norm, element-wise layers, Add, Flatten + Linear, losses, containers, SGD.

Every expected value is computed serially on the global array by every rank
with the formulas in this file and ``nn_reference`` (pooling as a loop over
output positions, batch norm as the textbook formula), never with the
library; gradients are also checked against central finite differences.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from nn_reference import (
    KERNELS,
    Checks,
    bn_ref,
    conv_ref,
    conv_ref_backward,
    gdots,
    grid,
    grid2_shape,
    layouts,
    pad_pairs,
    pool_ref,
)

import disttensor as dt
import disttensor_nn as nn
from disttensor.testing import assert_allclose
from disttensor_nn.kernels import torch_kernels
from disttensor_nn.optim.optimizer import CHUNK
from disttensor_nn.reduction import GradientBuckets

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD
TOL = {"rtol": 1e-12, "atol": 1e-12}
HAS_TORCH = torch_kernels.available()
SHAPE = {1: (3, 2, 11), 2: (3, 2, 13, 11), 3: (2, 2, 7, 6, 5)}


def distinct(shape, seed=0):
    """Values 0.01 apart in random order: no ties in any max-pooling window."""
    rng = np.random.default_rng(seed)
    return rng.permutation(int(np.prod(shape))).reshape(shape) * 0.01 - 1.0


def named_layout(shape, name):
    return dict(layouts(shape))[name]


def fd_check(check, loss, x, grad, indices, h, what, rtol=1e-6, atol=1e-8):
    """Central differences of ``loss`` at the given entries of ``x`` (modified in place)."""
    for i in indices:
        old = x[i]
        x[i] = old + h
        lp = loss()
        x[i] = old - h
        lm = loss()
        x[i] = old
        check.close(grad[i], (lp - lm) / (2 * h), f"{what}{i}", rtol=rtol, atol=atol)


def some_indices(shape, k, seed=11):
    rng = np.random.default_rng(seed)
    return [tuple(int(rng.integers(n)) for n in shape) for _ in range(k)]


# --------------------------------------------------------------------------- pooling
POOL = {("max", 1): nn.MaxPool1d, ("max", 2): nn.MaxPool2d, ("max", 3): nn.MaxPool3d,
        ("avg", 1): nn.AvgPool1d, ("avg", 2): nn.AvgPool2d, ("avg", 3): nn.AvgPool3d}
POOL_SPECS = {
    1: [dict(kernel_size=4, stride=1, padding=2),
        dict(kernel_size=3, stride=2, padding=1, dilation=2)],
    2: [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=(4, 3), stride=(3, 1), padding=(2, 1)),
        dict(kernel_size=(5, 5), stride=(2, 1), dilation=(1, 2))],
    3: [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=(3, 1, 2), stride=(1, 1, 2), padding=(1, 0, 1))],
}
POOL_CASES = [(op, nd, kw) for op in ("max", "avg") for nd, specs in POOL_SPECS.items()
              for kw in specs]


def pool_ref_for(nd, kw, x):
    k = kw["kernel_size"]
    stride = kw.get("stride", k)
    dil = kw.get("dilation", 1)
    pads = pad_pairs(kw.get("padding", 0), k, dil, nd)
    return lambda op: pool_ref(x, k, stride, pads, dil, op)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("op,nd,kw", POOL_CASES,
                         ids=[f"{op}{nd}d-" + ",".join(f"{k}={v}" for k, v in kw.items())
                              for op, nd, kw in POOL_CASES])
def test_pool_matches_reference_on_every_layout(op, nd, kw, kernels):
    shape = SHAPE[nd]
    x = distinct(shape, seed=nd)
    want, dx_of = pool_ref_for(nd, kw, x)(op)
    dy = np.random.default_rng(2).standard_normal(want.shape)
    dx_want = dx_of(dy)
    check = Checks()
    for k, (lname, dist) in enumerate(layouts(shape)):
        overlap = k % 2 == 1  # both forward paths, on alternate layouts
        msg = f"{op} {kw} on {lname} {dist} overlap={overlap}"
        pool = POOL[op, nd](overlap=overlap, **kw)
        pool.kernel_backend = kernels
        y = pool(dt.DistArray.from_global(x, dist))
        check.close(y, want, msg)
        dx = pool.backward(dt.DistArray.from_global(dy, y.dist))
        check.true(dx.dist == dist, f"{msg}: dx in {dx.dist}")
        check.close(dx, dx_want, f"{msg}: dx")
    check.finish()


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch")
@pytest.mark.parallel(SIZES)
def test_max_pool_of_many_channels_with_torch_kernels_matches_reference_on_every_layout():
    """A 2-D max pool of enough channels runs on a channels-last copy of the block with the
    torch kernels (a channel split leaves fewer on some layouts: the other route); its
    output and gradient equal the reference on every layout, with the kernel's padding,
    a halo's, strides and a dilation."""
    c = torch_kernels.MAX_POOL_CHANNELS_LAST_MIN + 1
    shape = (3, c, 13, 11)
    x = distinct(shape, seed=9)
    check = Checks()
    for kw in ({"kernel_size": 3, "stride": 2, "padding": 1},
               {"kernel_size": (2, 3), "stride": (1, 2), "dilation": (2, 1)}):
        want, dx_of = pool_ref_for(2, kw, x)("max")
        dy = np.random.default_rng(4).standard_normal(want.shape)
        dx_want = dx_of(dy)
        for lname, dist in layouts(shape):
            pool = nn.MaxPool2d(**kw)
            pool.kernel_backend = "torch"
            y = pool(dt.DistArray.from_global(x, dist))
            check.close(y, want, f"{kw} on {lname}")
            dx = pool.backward(dt.DistArray.from_global(dy, y.dist))
            check.close(dx, dx_want, f"{kw} on {lname}: dx")
    check.finish()


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch")
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_torch_kernels_max_pool_on_a_channels_last_copy_gives_atens_indices(data):
    """The channels-last route of the torch kernels' 2-D max pool against ATen on the block
    as it is: the same values and flat indices bit for bit (ties, NaN, windows of nothing
    but -inf, padding, strides, dilations), and the same input gradient as the NumPy
    kernels on finite values."""
    draw = data.draw
    c = draw(st.integers(torch_kernels.MAX_POOL_CHANNELS_LAST_MIN, 9))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(2))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(2))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(2))
    pads = tuple(draw(st.integers(0, k // 2)) for k in kernel)
    size = tuple(draw(st.integers(d * (k - 1) + 1 - 2 * p, 13))
                 for k, d, p in zip(kernel, dilation, pads))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (2, c, *[max(n, 1) for n in size])).astype(np.float32)
    finite = x.astype(np.float64)
    u = rng.random(x.shape)
    x[u < 0.05] = np.nan
    x[(u >= 0.05) & (u < 0.15)] = -np.inf
    x[:, :draw(st.integers(0, 2))] = -np.inf
    y, idx = torch_kernels.pool_forward(x, kernel, stride, dilation, "max", padding=pads)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_kernels, "MAX_POOL_CHANNELS_LAST_MIN", 10**9)
        y0, idx0 = torch_kernels.pool_forward(x, kernel, stride, dilation, "max",
                                              padding=pads)
    assert y.flags.c_contiguous and idx.is_contiguous()
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(idx.numpy(), idx0.numpy())
    yf, arg = torch_kernels.pool_forward(finite, kernel, stride, dilation, "max", padding=pads)
    yn, argn = nn.kernels.numpy_kernels.pool_forward(finite, kernel, stride, dilation, "max",
                                                     padding=pads)
    np.testing.assert_array_equal(yf, yn)
    dy = rng.standard_normal(yf.shape)
    np.testing.assert_array_equal(
        torch_kernels.pool_backward(dy, finite.shape, kernel, stride, dilation, "max", arg,
                                    padding=pads),
        nn.kernels.numpy_kernels.pool_backward(dy, finite.shape, kernel, stride, dilation,
                                               "max", argn, padding=pads))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("op", ["max", "avg"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_pool_gradient_finite_differences(op, nd):
    kw = POOL_SPECS[nd][1]  # kernel 3, stride 2, padding 1 (1-D: and dilation 2)
    shape = SHAPE[nd]
    lname = {1: "sample x L", 2: "HxW", 3: "DxHxW"}[nd]
    dist = named_layout(shape, lname)
    x = distinct(shape, seed=5)
    pool = POOL[op, nd](**kw)
    y = pool(dt.DistArray.from_global(x, dist))
    r = np.random.default_rng(3).standard_normal(y.shape)
    dx = pool.backward(dt.DistArray.from_global(r, y.dist)).to_global()

    def loss():
        return gdots([(pool(dt.DistArray.from_global(x, dist)), r)])[0]

    # the adjoint identity for the (locally) linear map, and a few central differences
    check = Checks()
    check.close(np.vdot(x, dx), gdots([(y, r)])[0], f"{lname}: <x, J^T r> != <J x, r>",
                rtol=1e-11)
    fd_check(check, loss, x, dx, some_indices(shape, 5), 1e-3, f"{op} pool on {lname}: dx",
             rtol=1e-8, atol=1e-9)
    check.finish()


@pytest.mark.parallel(SIZES)
def test_pool_bad_arguments():
    with pytest.raises(ValueError, match="half"):
        nn.MaxPool2d(3, padding=2)
    with pytest.raises(ValueError, match="half"):
        nn.AvgPool1d(2, padding=(2,))
    with pytest.raises(ValueError):
        nn.MaxPool2d(2, stride=0)
    with pytest.raises(ValueError):
        nn.AvgPool3d((2, 2))
    pool = nn.MaxPool2d(2)
    with pytest.raises(ValueError):
        pool(dt.DistArray.from_global(np.zeros((2, 3, 4)),
                                      dt.Distribution((2, 3, 4), grid((comm.Get_size(),)))))
    # a window larger than the padded input: refused as in PyTorch (an empty output before)
    shape = (2, 2, 5, 11)
    x = distinct(shape)
    check = Checks()
    for op in ("max", "avg"):
        for lname, dist in layouts(shape):
            pool = POOL[op, 2]((8, 3), padding=(1, 0))
            with pytest.raises(ValueError, match=r"padded input size \(7, 11\).*kernel \(8, 3\)"):
                pool(dt.DistArray.from_global(x, dist))
            check.true(True, f"{op} on {lname}")
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_global_avg_pool(nd):
    shape = SHAPE[nd]
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape)
    spatial = tuple(range(2, 2 + nd))
    want = x.mean(axis=spatial)
    dy = rng.standard_normal(want.shape)
    dx_want = np.broadcast_to(dy.reshape(dy.shape + (1,) * nd) / np.prod(shape[2:]), shape)
    check = Checks()
    for lname, dist in layouts(shape):
        gap = nn.GlobalAvgPool()
        y = gap(dt.DistArray.from_global(x, dist))
        check.true(y.dist.boundaries[0] == dist.boundaries[0], f"{lname}: {y.dist}")
        check.close(y, want, lname)
        dx = gap.backward(dt.DistArray.from_global(dy, y.dist))
        check.true(dx.dist == dist, f"{lname}: {dx.dist}")
        check.close(dx, dx_want, lname)
    check.finish()


# --------------------------------------------------------------------------- batch norm
BN = {2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def bn_layer(nd, stats, momentum=0.3, eps=1e-5, seed=0):
    c = SHAPE[nd][1]
    bn = BN[nd](c, eps=eps, momentum=momentum, stats=stats, dtype=np.float64)
    rng = np.random.default_rng(seed)
    bn.weight.data[...] = rng.uniform(0.5, 1.5, c)
    bn.bias.data[...] = rng.standard_normal(c)
    return bn


def groups_of(dist):
    """Sample ranges of the blocks of dim 0 (one statistics group each), non-empty ones."""
    b = dist.boundaries[0]
    return [(b[i], b[i + 1]) for i in range(len(b) - 1) if b[i + 1] > b[i]]


def bn_expected(x, gamma, beta, eps, dy, groups):
    """Group-wise batch norm (one group = the whole batch for stats='global')."""
    y, dx = np.zeros_like(x), np.zeros_like(x)
    dgamma, dbeta = np.zeros_like(gamma), np.zeros_like(beta)
    means, uvars = [], []
    for a, b in groups:
        yg, back, mean, uvar = bn_ref(x[a:b], gamma, beta, eps)
        y[a:b] = yg
        dxg, dgg, dbg = back(dy[a:b])
        dx[a:b] = dxg
        dgamma += dgg
        dbeta += dbg
        means.append(mean)
        uvars.append(uvar)
    return y, dx, dgamma, dbeta, np.mean(means, axis=0), np.mean(uvars, axis=0)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("stats", ["global", "group"])
def test_batchnorm_float32_input_far_from_zero(stats, kernels):
    """float32 channels whose mean is 300 times their spread: outputs and gradients match
    the float64 formulas to float32 accuracy (no sum of squares that cancels)."""
    shape = (4, 3, 12, 10)
    rng = np.random.default_rng(21)
    x = (rng.standard_normal(shape) + np.array([300.0, -1000.0, 0.5])[:, None, None])
    x = x.astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    check = Checks()
    for lname, dist in layouts(shape):
        groups = [(0, shape[0])] if stats == "global" else groups_of(dist)
        bn = nn.BatchNorm2d(3, stats=stats)
        bn.kernel_backend = kernels
        want = bn_expected(x.astype(np.float64), np.ones(3), np.zeros(3), bn.eps,
                           dy.astype(np.float64), groups)
        y = bn(dt.DistArray.from_global(x, dist))
        dx = bn.backward(dt.DistArray.from_global(dy, y.dist))
        check.close(y, want[0], f"{stats} on {lname}: y", rtol=0, atol=2e-5)
        check.close(dx, want[1], f"{stats} on {lname}: dx", rtol=0, atol=2e-5)
        check.close(bn.weight.grad, want[2], f"{stats} on {lname}: dgamma", rtol=1e-5,
                    atol=2e-3)
        check.close(bn.running_mean, 0.1 * want[4], f"{stats} on {lname}: running mean",
                    rtol=1e-6)
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("stats", ["global", "group"])
@pytest.mark.parametrize("nd", [2, 3])
def test_batchnorm_train_running_stats_and_eval(nd, stats, kernels):
    shape = SHAPE[nd]
    m, eps = 0.3, 1e-5
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal(shape) * (1 + k) + k for k in range(2)]
    dys = [rng.standard_normal(shape) for _ in range(2)]
    bshape = (1, -1) + (1,) * nd
    check = Checks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _batchnorm_cases(check, nd, stats, shape, m, eps, xs, dys, bshape, kernels)
    # e.g. no 0/0 on a rank whose sample block is empty
    check.true(not [w for w in caught if issubclass(w.category, RuntimeWarning)],
               f"warnings: {[str(w.message) for w in caught]}")
    check.finish()


def _batchnorm_cases(check, nd, stats, shape, m, eps, xs, dys, bshape, kernels):
    for lname, dist in layouts(shape):
        bn = bn_layer(nd, stats, momentum=m, eps=eps)
        bn.kernel_backend = kernels
        gamma, beta = bn.weight.data.copy(), bn.bias.data.copy()
        groups = [(0, shape[0])] if stats == "global" else groups_of(dist)
        rm, rv = np.zeros(shape[1]), np.ones(shape[1])
        msg = f"{stats} on {lname} {dist}"
        for k, (x, dy) in enumerate(zip(xs, dys)):
            y_want, dx_want, dg_want, db_want, mean, uvar = bn_expected(x, gamma, beta, eps,
                                                                         dy, groups)
            rm, rv = (1 - m) * rm + m * mean, (1 - m) * rv + m * uvar
            y = bn(dt.DistArray.from_global(x, dist))
            check.true(y.dist == dist, f"{msg}: {y.dist}")
            check.close(y, y_want, msg, rtol=1e-11, atol=1e-11)
            bn.zero_grad()
            # the second pass's parameter sums in gradient buckets, as in training
            with GradientBuckets() if k else contextlib.nullcontext():
                dx = bn.backward(dt.DistArray.from_global(dy, dist))
            check.close(dx, dx_want, f"{msg}: dx", rtol=1e-10, atol=1e-10)
            check.close(bn.weight.grad, dg_want, f"{msg}: dgamma", rtol=1e-11, atol=1e-11)
            check.close(bn.bias.grad, db_want, f"{msg}: dbeta", rtol=1e-11, atol=1e-11)
        check.close(bn.running_mean, rm, f"{msg}: running mean")
        check.close(bn.running_var, rv, f"{msg}: running var")
        # evaluation mode: the running statistics, which it leaves alone
        bn.eval()
        kept = (bn.running_mean.copy(), bn.running_var.copy())
        x, dy = xs[0], dys[0]
        inv = 1 / np.sqrt(rv + eps)
        xhat = (x - rm.reshape(bshape)) * inv.reshape(bshape)
        y = bn(dt.DistArray.from_global(x, dist))
        check.close(y, xhat * gamma.reshape(bshape) + beta.reshape(bshape), f"{msg}: eval",
                    rtol=1e-11, atol=1e-11)
        bn.zero_grad()
        dx = bn.backward(dt.DistArray.from_global(dy, dist))
        check.close(dx, dy * (gamma * inv).reshape(bshape), f"{msg}: eval dx", rtol=1e-11,
                    atol=1e-11)
        axes = (0, *range(2, 2 + nd))
        check.close(bn.weight.grad, (dy * xhat).sum(axis=axes), f"{msg}: eval dgamma",
                    rtol=1e-11, atol=1e-11)
        check.close(bn.bias.grad, dy.sum(axis=axes), f"{msg}: eval dbeta", rtol=1e-11,
                    atol=1e-11)
        check.equal(bn.running_mean, kept[0], f"{msg}: eval changed the running mean")
        check.equal(bn.running_var, kept[1], f"{msg}: eval changed the running var")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("stats", ["global", "group"])
def test_batchnorm_finite_differences(stats):
    nd = 2
    shape = (4, 2, 5, 4)
    dist = named_layout(shape, "sample x H")
    rng = np.random.default_rng(12)
    x = rng.standard_normal(shape)
    bn = bn_layer(nd, stats, seed=2)
    y = bn(dt.DistArray.from_global(x, dist))
    r = rng.standard_normal(shape)
    bn.zero_grad()
    dx = bn.backward(dt.DistArray.from_global(r, y.dist)).to_global()
    grads = {"gamma": (bn.weight.data, bn.weight.grad.copy()),
             "beta": (bn.bias.data, bn.bias.grad.copy())}

    def loss():
        return gdots([(bn(dt.DistArray.from_global(x, dist)), r)])[0]

    check = Checks()
    fd_check(check, loss, x, dx, some_indices(shape, 6), 1e-5, f"BN {stats} dx")
    for name, (p, g) in grads.items():
        fd_check(check, loss, p, g, [(0,), (1,)], 1e-5, f"BN {stats} d{name}")
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batchnorm_without_running_stats_or_affine(mode, kernels):
    # track_running_stats=False: batch statistics in both modes (as torch.nn.BatchNorm2d)
    shape = SHAPE[2]
    rng = np.random.default_rng(24)
    x = rng.standard_normal(shape) * 2 + 1
    dy = rng.standard_normal(shape)
    c = shape[1]
    y_want, back, _, _ = bn_ref(x, np.ones(c), np.zeros(c), 1e-5)
    dx_want = back(dy)[0]
    check = Checks()
    for lname, dist in layouts(shape)[:5]:
        bn = nn.BatchNorm2d(c, affine=False, track_running_stats=False, dtype=np.float64)
        bn.kernel_backend = kernels
        bn.train(mode == "train")
        check.true(list(bn.parameters()) == [], "affine=False has no parameters")
        y = bn(dt.DistArray.from_global(x, dist))
        check.close(y, y_want, f"{mode} on {lname}", rtol=1e-11, atol=1e-11)
        dx = bn.backward(dt.DistArray.from_global(dy, dist))
        check.close(dx, dx_want, f"{mode} on {lname}: dx", rtol=1e-10, atol=1e-10)
        check.equal(bn.running_mean, np.zeros(c), f"{mode} on {lname}: running mean")
    check.finish()


@pytest.mark.parallel(SIZES)
def test_batchnorm_bad_input():
    p = comm.Get_size()
    g = grid((p,))
    bn = nn.BatchNorm2d(3, dtype=np.float64)
    with pytest.raises(ValueError, match="channels"):
        bn(dt.DistArray.from_global(np.zeros((2, 4, 5, 5)),
                                    dt.Distribution((2, 4, 5, 5), g, (None, None, 0, None))))
    with pytest.raises(ValueError):
        bn(dt.DistArray.from_global(np.zeros((2, 3, 5)),
                                    dt.Distribution((2, 3, 5), g, (None, None, 0))))
    with pytest.raises(TypeError):
        nn.BatchNorm2d(3)(dt.DistArray.from_global(
            np.zeros((2, 3, 5, 5)), dt.Distribution((2, 3, 5, 5), g, (None, None, 0, None))))
    # a split channel dimension is accepted (tests/test_nn_channel_filter.py)
    with pytest.raises(ValueError):
        nn.BatchNorm3d(3, stats="local")


# --------------------------------------------------------------------------- element-wise
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("kind", ["relu", "leaky", "sigmoid"])
def test_elementwise(kind, kernels):
    shape = SHAPE[2]
    rng = np.random.default_rng(13)
    x = rng.standard_normal(shape) * 3
    x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink
    dy = rng.standard_normal(shape)
    if kind == "relu":
        layer, want, deriv = nn.ReLU(), np.maximum(x, 0), (x > 0).astype(float)
    elif kind == "leaky":
        layer = nn.LeakyReLU(0.2)
        want, deriv = np.where(x > 0, x, 0.2 * x), np.where(x > 0, 1.0, 0.2)
    else:
        layer = nn.Sigmoid()
        want = 1 / (1 + np.exp(-x))
        deriv = want * (1 - want)
    layer.kernel_backend = kernels
    check = Checks()
    for lname, dist in layouts(shape)[:4]:
        y = layer(dt.DistArray.from_global(x, dist))
        check.close(y, want, lname, rtol=1e-14, atol=1e-15)
        dx = layer.backward(dt.DistArray.from_global(dy, dist))
        check.true(dx.dist == dist, lname)
        check.close(dx, dy * deriv, lname, rtol=1e-14, atol=1e-15)
    # finite differences at a few points (the last layout)
    dxg = dx.to_global()

    def loss():
        return gdots([(layer(dt.DistArray.from_global(x, dist)), dy)])[0]

    fd_check(check, loss, x, dxg, some_indices(shape, 4), 1e-6, f"{kind} dx", rtol=1e-7)
    check.finish()
    big = np.array([[-800.0, -40.0, 0.0, 40.0, 800.0]] * comm.Get_size())
    d = dt.Distribution(big.shape, grid((comm.Get_size(),)), (0, None))
    if kind == "sigmoid":  # no overflow warnings, exact limits
        sig = nn.Sigmoid()
        sig.kernel_backend = kernels
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            s = sig(dt.DistArray.from_global(big, d)).to_global()
        assert_allclose(s[0], [0.0, 1 / (1 + np.exp(40.0)), 0.5, 1 / (1 + np.exp(-40.0)), 1.0],
                        rtol=1e-14, atol=0)


@pytest.mark.parallel(SIZES)
def test_add_with_two_distributions():
    shape = SHAPE[2]
    rng = np.random.default_rng(14)
    a, b, dy = (rng.standard_normal(shape) for _ in range(3))
    lay = layouts(shape)
    check = Checks()
    for (na, da), (nb, db) in zip(lay, lay[3:] + lay[:3]):
        add = nn.Add()
        y = add(dt.DistArray.from_global(a, da), dt.DistArray.from_global(b, db))
        check.true(y.dist == da, f"{na}+{nb}: {y.dist}")
        check.close(y, a + b, f"{na}+{nb}", rtol=1e-15, atol=0)
        ga, gb = add.backward(dt.DistArray.from_global(dy, da))
        check.true(ga.dist == da and gb.dist == db, f"{na}+{nb}: {ga.dist} {gb.dist}")
        check.equal(ga, dy, f"{na}+{nb}: da")
        check.equal(gb, dy, f"{na}+{nb}: db")
    check.finish()
    with pytest.raises(ValueError):
        nn.Add()(dt.DistArray.from_global(a, lay[0][1]),
                 dt.DistArray.from_global(a[:, :1], dt.Distribution(a[:, :1].shape,
                                                                    lay[0][1].grid,
                                                                    lay[0][1].axes)))


# --------------------------------------------------------------------------- Flatten + Linear
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
def test_flatten_linear_on_spatially_split_input(kernels):
    shape = (3, 2, 5, 4)
    rng = np.random.default_rng(15)
    x = rng.standard_normal(shape)
    lin = nn.Linear(40, 3, dtype=np.float64, seed=1)
    lin.kernel_backend = kernels
    W, b = lin.weight.data.copy(), lin.bias.data.copy()
    xf = x.reshape(3, 40)
    want = xf @ W.T + b
    dy = rng.standard_normal(want.shape)
    check = Checks()
    for lname, dist in layouts(shape):
        flat = nn.Flatten()
        h = flat(dt.DistArray.from_global(x, dist))
        check.equal(h, xf, lname)
        y = lin(h)
        check.close(y, want, lname)
        lin.zero_grad()
        dh = lin.backward(dt.DistArray.from_global(dy, y.dist))
        dx = flat.backward(dh)
        check.true(dx.dist == dist, f"{lname}: {dx.dist}")
        check.close(dx, (dy @ W).reshape(shape), lname)
        check.close(lin.weight.grad, dy.T @ xf, lname)
        check.close(lin.bias.grad, dy.sum(0), lname)

    def loss():
        return gdots([(lin(flat(dt.DistArray.from_global(x, dist))), dy)])[0]

    dxg = dx.to_global()
    gW = lin.weight.grad.copy()
    fd_check(check, loss, x, dxg, some_indices(shape, 3), 1e-4, "Linear dx", rtol=1e-8)
    fd_check(check, loss, lin.weight.data, gW, some_indices(W.shape, 3), 1e-4, "Linear dW",
             rtol=1e-8)
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
def test_linear_feature_split_and_bad_input(kernels):
    p = comm.Get_size()
    rng = np.random.default_rng(16)
    x = rng.standard_normal((5, 6))
    lin = nn.Linear(6, 2, dtype=np.float64)
    lin.kernel_backend = kernels
    w = lin.weight.data.copy()
    d = dt.Distribution((5, 6), grid((p,)), (None, 0))  # features split: row-parallel
    y = lin(dt.DistArray.from_global(x, d))
    assert_allclose(y, x @ w.T + lin.bias.data, **TOL)
    lin.zero_grad()
    dy = rng.standard_normal((5, 2))
    dx = lin.backward(dt.DistArray.from_global(dy, y.dist))
    assert_allclose(dx, dy @ w, **TOL)
    wd = lin.weight.dist  # each rank holds the weight's columns of its features
    assert_allclose(lin.weight.grad, (dy.T @ x)[wd.local_slices()] if wd else dy.T @ x, **TOL)
    with pytest.raises(ValueError):
        lin(dt.DistArray.from_global(x[:, :5], dt.Distribution((5, 5), grid((p,)), (0, None))))
    with pytest.raises(TypeError):
        nn.Linear(6, 2)(dt.DistArray.from_global(x, dt.Distribution((5, 6), grid((p,)),
                                                                    (0, None))))


# --------------------------------------------------------------------------- losses
def logits_layouts(n, k):
    p = comm.Get_size()
    g1, g2 = grid((p,)), grid(grid2_shape(p))
    cuts = [] if p == 1 else [0] + [min(n, 2)] * (p - 2)
    return [("sample", dt.Distribution((n, k), g1, (0, None))),
            ("sample + replicas", dt.Distribution((n, k), g2, (0, None))),
            ("replicated", dt.Distribution((n, k), g1, (None, None))),
            ("empty blocks", dt.Distribution((n, k), g1, (0, None), [cuts, None]))]


@pytest.mark.parallel(SIZES)
def test_softmax_cross_entropy():
    n, k = 5, 4
    rng = np.random.default_rng(17)
    z = rng.standard_normal((n, k)) * 3
    labels = rng.integers(0, k, n)
    zs = z - z.max(1, keepdims=True)
    logp = zs - np.log(np.exp(zs).sum(1, keepdims=True))
    want = -logp[np.arange(n), labels].mean()
    grad = np.exp(logp)
    grad[np.arange(n), labels] -= 1
    grad /= n
    check = Checks()
    for (lname, dist), label_kind in itertools.product(logits_layouts(n, k), ("global", "dist")):
        loss = nn.SoftmaxCrossEntropy()
        if label_kind == "global":
            lab = labels
        else:  # labels in another distribution than the logits
            lab = dt.DistArray.from_global(labels, dt.Distribution((n,), grid((comm.Get_size(),)),
                                                                   (None,)))
        value = loss(dt.DistArray.from_global(z, dist), lab)
        check.close(value, want, f"{lname}, {label_kind} labels", rtol=1e-13)
        g = loss.backward()
        check.true(g.dist == dist, lname)
        check.close(g, grad, f"{lname}, {label_kind} labels", rtol=1e-12, atol=1e-14)

    def f():
        return nn.SoftmaxCrossEntropy()(dt.DistArray.from_global(z, dist), labels)

    fd_check(check, f, z, grad, some_indices(z.shape, 4), 1e-6, "softmax CE dz", rtol=1e-6)
    check.finish()
    with pytest.raises(ValueError, match="range"):
        nn.SoftmaxCrossEntropy()(dt.DistArray.from_global(z, dist), np.full(n, k))
    with pytest.raises(ValueError):
        nn.SoftmaxCrossEntropy()(dt.DistArray.from_global(z, dist), labels[:-1])


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kind", ["mse", "bce"])
def test_pointwise_losses(kind):
    shape = (3, 2, 5, 4)
    rng = np.random.default_rng(18)
    p = rng.standard_normal(shape) * 2
    t = rng.standard_normal(shape) if kind == "mse" else rng.uniform(0, 1, shape)
    if kind == "mse":
        want, grad = np.mean((p - t) ** 2), 2 * (p - t) / p.size
        make = nn.MSELoss
    else:
        sig = 1 / (1 + np.exp(-p))
        want = np.mean(-(t * np.log(sig) + (1 - t) * np.log(1 - sig)))
        grad = (sig - t) / p.size
        make = nn.BCEWithLogitsLoss
    lay = layouts(shape)
    check = Checks()
    for k, ((lname, dist), (tname, tdist)) in enumerate(zip(lay, lay[::-1])):
        # the target as a global array, or a DistArray in another distribution
        target = t if k % 2 else dt.DistArray.from_global(t, tdist)
        loss = make()
        value = loss(dt.DistArray.from_global(p, dist), target)
        check.close(value, want, f"{lname} / {tname}", rtol=1e-13)
        g = loss.backward()
        check.true(g.dist == dist, lname)
        check.close(g, grad, f"{lname} / {tname}", rtol=1e-12, atol=1e-15)

    def f():
        return make()(dt.DistArray.from_global(p, dist), t)

    fd_check(check, f, p, grad, some_indices(shape, 4), 1e-5, f"{kind} dp", rtol=1e-6,
             atol=1e-10)
    check.finish()
    with pytest.raises(ValueError):
        make()(dt.DistArray.from_global(p, dist), t[:2])


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_mse_on_16_and_32_bit_predictions(dtype):
    """A float32 or float16 prediction: the loss is the float64 reference's to float32
    accuracy, the gradient is in the prediction's dtype, and each backward call returns
    an array of its own (a layer may write over its dy)."""
    shape = (3, 2, 7, 5)
    rng = np.random.default_rng(19)
    p = (rng.standard_normal(shape) * 2).astype(dtype)
    p64 = p.astype(np.float64)
    check = Checks()
    for k, (lname, dist) in enumerate(layouts(shape)):
        t = rng.standard_normal(shape).astype(np.float32 if k % 2 else np.float64)
        want = np.mean((p64 - t) ** 2)
        grad = 2 * (p64 - t) / p.size
        loss = nn.MSELoss()
        value = loss(dt.DistArray.from_global(p, dist), t)
        check.close(value, want, f"{lname} loss", rtol=1e-6)
        g = loss.backward()
        check.true(g.dtype == np.dtype(dtype) and g.dist == dist, f"{lname} dtype {g.dtype}")
        tol = 1e-6 if dtype == "float32" else 2e-3
        check.close(g.to_global().astype(np.float64), grad, f"{lname} grad", rtol=tol,
                    atol=tol * np.abs(grad).max())
        g.local[...] = 0
        again = loss.backward(scale=2.0)
        check.close(again.to_global().astype(np.float64), 2 * grad, f"{lname} again",
                    rtol=tol, atol=2 * tol * np.abs(grad).max())
    check.finish()


# --------------------------------------------------------------------------- containers
def _set(layer, seed):
    rng = np.random.default_rng(seed)
    for prm in layer.parameters():
        prm.data[...] = rng.standard_normal(prm.shape) * 0.5


def conv_args(conv):
    return dict(stride=conv.spec.stride, pads=list(conv.spec.padding),
                dilation=conv.spec.dilation, groups=conv.groups, mode=conv.padding_mode)


@pytest.mark.parallel(SIZES)
def test_sequential_with_layouts_forcing_redistributions():
    p = comm.Get_size()
    shape = (3, 2, 13, 11)
    g1, g2 = grid((p,)), grid(grid2_shape(p))
    c0 = nn.Conv2d(2, 3, 3, padding=1, dtype=np.float64)
    c2 = nn.Conv2d(3, 2, (2, 3), stride=2, padding=(0, 1), padding_mode="circular",
                   dtype=np.float64)
    pool = nn.AvgPool2d(2)
    lin = nn.Linear(18, 3, dtype=np.float64)
    net = nn.Sequential(c0, nn.ReLU(), c2, pool, nn.Flatten(), lin)
    net.set_layouts([nn.Layout(g2, (None, None, 0, 1)), nn.Layout(g1, (0, None, None, None)),
                     nn.Layout(g1, (None, None, None, 0)), nn.Layout(g2, (0, None, 1, None)),
                     None, None])
    _set(net, 19)
    rng = np.random.default_rng(20)
    x = rng.standard_normal(shape)
    # reference forward
    a0 = conv_args(c0)
    h0 = conv_ref(x, c0.weight.data, c0.bias.data, **a0)
    h1 = np.maximum(h0, 0)
    a2 = conv_args(c2)
    h2 = conv_ref(h1, c2.weight.data, c2.bias.data, **a2)
    h3, pool_back = pool_ref(h2, 2, 2, [(0, 0)] * 2, 1, "avg")
    h4 = h3.reshape(3, -1)
    want = h4 @ lin.weight.data.T + lin.bias.data
    dy = rng.standard_normal(want.shape)
    # reference backward
    dh4 = dy @ lin.weight.data
    dh2 = pool_back(dh4.reshape(h3.shape))
    dh1, dw2, db2 = conv_ref_backward(h1, c2.weight.data, dh2, **a2)
    dh0 = dh1 * (h0 > 0)
    dx, dw0, db0 = conv_ref_backward(x, c0.weight.data, dh0, **a0)
    check = Checks()
    for lname, dist in layouts(shape)[:5]:
        y = net(dt.DistArray.from_global(x, dist))
        check.close(y, want, lname)
        net.zero_grad()
        g = net.backward(dt.DistArray.from_global(dy, y.dist))
        check.true(g.dist == dist, f"{lname}: {g.dist}")
        check.close(g, dx, lname)
        for got, ref in ((c0.weight.grad, dw0), (c0.bias.grad, db0), (c2.weight.grad, dw2),
                         (c2.bias.grad, db2), (lin.weight.grad, dy.T @ h4),
                         (lin.bias.grad, dy.sum(0))):
            check.close(got, ref, lname)
    check.true(len(list(net.parameters())) == 6 and len(net) == 6
               and net[2] is c2 and "Conv2d" in repr(net), "container API")
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("variant", ["conv_shortcut", "identity_moved"])
def test_residual_block(variant):
    p = comm.Get_size()
    shape = (3, 2, 13, 11)
    g1, g2 = grid((p,)), grid(grid2_shape(p))
    c1 = nn.Conv2d(2, 2, 3, padding=1, dtype=np.float64)
    bn = nn.BatchNorm2d(2, dtype=np.float64)
    c2 = nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect", dtype=np.float64)
    c1.layout = nn.Layout(g1, (None, None, None, 0))  # the branch runs W-split
    branch = nn.Sequential(c1, bn, nn.ReLU(), c2)
    shortcut = nn.Conv2d(2, 2, 1, bias=False, dtype=np.float64) \
        if variant == "conv_shortcut" else None
    block = nn.Residual(branch, shortcut, post=nn.ReLU())
    if variant == "identity_moved":
        block.layout = nn.Layout(g2, (0, None, 1, None))
    _set(block, 21)
    bn.weight.data[...] = np.abs(bn.weight.data) + 0.5
    rng = np.random.default_rng(22)
    x = rng.standard_normal(shape)
    pads = [(1, 1)] * 2
    h1 = conv_ref(x, c1.weight.data, c1.bias.data, 1, pads, 1)
    h2, bn_back, _, _ = bn_ref(h1, bn.weight.data, bn.bias.data, bn.eps)
    h3 = np.maximum(h2, 0)
    h4 = conv_ref(h3, c2.weight.data, c2.bias.data, 1, pads, 1, mode="reflect")
    s = conv_ref(x, shortcut.weight.data, None, 1, [(0, 0)] * 2, 1) if shortcut else x
    z = h4 + s
    want = np.maximum(z, 0)
    dy = rng.standard_normal(shape)
    dz = dy * (z > 0)
    dh3, dw2, db2 = conv_ref_backward(h3, c2.weight.data, dz, 1, pads, 1, mode="reflect")
    dh1, dgamma, dbeta = bn_back(dh3 * (h2 > 0))
    dx, dw1, db1 = conv_ref_backward(x, c1.weight.data, dh1, 1, pads, 1)
    if shortcut:
        dxs, dws, _ = conv_ref_backward(x, shortcut.weight.data, dz, 1, [(0, 0)] * 2, 1)
        dx = dx + dxs
    else:
        dx = dx + dz
    def refs():
        got = [(c1.weight.grad, dw1), (c1.bias.grad, db1), (bn.weight.grad, dgamma),
               (bn.bias.grad, dbeta), (c2.weight.grad, dw2), (c2.bias.grad, db2)]
        return got + ([(shortcut.weight.grad, dws)] if shortcut else [])

    check = Checks()
    _check_block(check, block, shape, x, want, dy, dx, refs)
    check.finish()


def _check_block(check, block, shape, x, want, dy, dx, refs):
    """``block``'s output, input gradient (in the input's distribution) and the
    parameters' gradients (``refs()``: pairs read after backward) against references,
    on the first five layouts of ``shape``."""
    for lname, dist in layouts(shape)[:5]:
        y = block(dt.DistArray.from_global(x, dist))
        check.close(y, want, lname, rtol=1e-11, atol=1e-11)
        block.zero_grad()
        g = block.backward(dt.DistArray.from_global(dy, y.dist))
        check.true(g.dist == dist, f"{lname}: {g.dist}")
        check.close(g, dx, lname, rtol=1e-10, atol=1e-10)
        for got, ref in refs():
            check.close(got, ref, lname, rtol=1e-10, atol=1e-10)


class _DoubleInPlace(nn.Layer):
    """``2 x``, whose backward doubles ``dy`` in its own buffer (reads_grad_only False)."""

    def forward(self, x):
        return dt.DistArray(x.local * 2, x.dist)

    def backward(self, dy):
        dy.local[...] *= 2
        return dy


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("variant", ["bn_last", "writes_dy"])
def test_residual_gradient_shared_or_copied(variant, kernels):
    """A branch whose first backward layer only reads ``dy`` shares it with the identity
    shortcut (no copy); one that writes it gets its own: both give the reference
    gradients."""
    shape = (3, 2, 13, 11)
    conv = nn.Conv2d(2, 2, 3, padding=1, dtype=np.float64)
    bn = nn.BatchNorm2d(2, dtype=np.float64)
    layers = [conv, bn] + ([_DoubleInPlace()] if variant == "writes_dy" else [])
    branch = nn.Sequential(*layers)
    nn.kernels.use_kernels(branch, kernels)
    block = nn.Residual(branch, post=nn.ReLU())
    _set(block, 31)
    bn.weight.data[...] = np.abs(bn.weight.data) + 0.5
    rng = np.random.default_rng(32)
    x = rng.standard_normal(shape)
    pads = [(1, 1)] * 2
    h1 = conv_ref(x, conv.weight.data, conv.bias.data, 1, pads, 1)
    h2, bn_back, _, _ = bn_ref(h1, bn.weight.data, bn.bias.data, bn.eps)
    scale = 2.0 if variant == "writes_dy" else 1.0
    z = scale * h2 + x
    want = np.maximum(z, 0)
    dy = rng.standard_normal(shape)
    dz = dy * (z > 0)
    dh1, dgamma, dbeta = bn_back(scale * dz)
    dx, dw, db = conv_ref_backward(x, conv.weight.data, dh1, 1, pads, 1)
    dx = dx + dz
    check = Checks()
    shares = variant == "bn_last"
    check.true(branch.reads_grad_only == shares and block.reads_grad_only
               and nn.Residual(branch).reads_grad_only == shares,
               f"reads_grad_only of {variant}")
    _check_block(check, block, shape, x, want, dy, dx, lambda: [
        (conv.weight.grad, dw), (conv.bias.grad, db), (bn.weight.grad, dgamma),
        (bn.bias.grad, dbeta)])
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("batch", [1, 3])
def test_skip_gradient_written_by_the_branch(batch):
    """A concatenation's backward gives each path its channels of ``dy``: a branch that
    writes its gradient in place leaves the other path's as it was, and both give the
    reference gradients (one sample per block: channel slices of ``dy`` are contiguous)."""
    shape = (batch, 2, 13, 11)
    c1 = nn.Conv2d(2, 3, 3, padding=1, dtype=np.float64)
    c2 = nn.Conv2d(5, 2, 3, padding=1, dtype=np.float64)
    block = nn.Skip(nn.Sequential(c1, _DoubleInPlace()), post=c2)
    _set(block, 51)
    rng = np.random.default_rng(52)
    x = rng.standard_normal(shape)
    pads = [(1, 1)] * 2
    h = conv_ref(x, c1.weight.data, c1.bias.data, 1, pads, 1)
    cat = np.concatenate([2 * h, x], axis=1)
    want = conv_ref(cat, c2.weight.data, c2.bias.data, 1, pads, 1)
    dy = rng.standard_normal(want.shape)
    dcat, dw2, db2 = conv_ref_backward(cat, c2.weight.data, dy, 1, pads, 1)
    dx, dw1, db1 = conv_ref_backward(x, c1.weight.data, 2 * dcat[:, :3], 1, pads, 1)
    dx = dx + dcat[:, 3:]
    check = Checks()
    _check_block(check, block, shape, x, want, dy, dx, lambda: [
        (c1.weight.grad, dw1), (c1.bias.grad, db1), (c2.weight.grad, dw2),
        (c2.bias.grad, db2)])
    check.finish()


def _reads_grad_only_cases():
    return [("conv3x3", lambda: nn.Conv2d(2, 3, 3, padding=1, dtype=np.float64)),
            ("conv_stride2", lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1,
                                               padding_mode="reflect", dtype=np.float64)),
            ("conv1x1", lambda: nn.Conv2d(2, 3, 1, bias=False, dtype=np.float64)),
            ("batchnorm", lambda: nn.BatchNorm2d(2, dtype=np.float64)),
            ("batchnorm_group", lambda: nn.BatchNorm2d(2, stats="group", dtype=np.float64)),
            ("relu", lambda: nn.ReLU()), ("leaky_relu", lambda: nn.LeakyReLU(0.1))]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
def test_reads_grad_only_layers_leave_dy(kernels):
    """Every layer that says its backward only reads ``dy`` leaves ``dy``'s buffer as it
    was, on every layout (halos, shared statistics, empty blocks) and backend."""
    shape = (3, 2, 13, 11)
    x = np.random.default_rng(41).standard_normal(shape)
    check = Checks()
    for name, make in _reads_grad_only_cases():
        for lname, dist in layouts(shape):
            layer = make()
            check.true(layer.reads_grad_only, f"{name} says it reads dy only")
            layer.kernel_backend = kernels
            _set(layer, 42)
            y = layer(dt.DistArray.from_global(x, dist))
            g = np.random.default_rng(43).standard_normal(y.shape)
            dy = dt.DistArray.from_global(g, y.dist)
            before = dy.local.copy()
            layer.backward(dy)
            check.true(np.array_equal(dy.local, before), f"{name} on {lname} wrote dy")
    check.finish()


# --------------------------------------------------------------------------- SGD
SGD_CASES = [dict(), dict(momentum=0.9), dict(momentum=0.8, dampening=0.5),
             dict(weight_decay=0.01), dict(momentum=0.9, weight_decay=0.05),
             dict(momentum=0.9, nesterov=True), dict(momentum=0.7, nesterov=True,
                                                     weight_decay=0.02)]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in
                                                                   kw.items()) or "plain")
@pytest.mark.parametrize("kernels", KERNELS)
def test_sgd_against_hand_written_update(kw, kernels, monkeypatch):
    """SGD's update against the formula over five steps and a checkpoint round trip; with
    the torch kernels the parameter of more than CHUNK elements goes through ATen (its
    calls counted), the small ones through NumPy."""
    lr = 0.1
    mom, damp = kw.get("momentum", 0.0), kw.get("dampening", 0.0)
    wd, nesterov = kw.get("weight_decay", 0.0), kw.get("nesterov", False)
    rng = np.random.default_rng(23)
    params = [nn.Parameter(rng.standard_normal(s)) for s in ((3, 2), (4,), (CHUNK + 3,))]
    ref = [prm.data.copy() for prm in params]
    bufs = [None] * len(params)
    opt = nn.SGD(params, lr=lr, **kw)
    opt.kernel_backend = kernels
    calls = []
    if kernels == "torch":
        from disttensor_nn.kernels import torch_kernels
        update = torch_kernels.sgd_update_
        monkeypatch.setattr(torch_kernels, "sgd_update_",
                            lambda *a, **k: calls.append(a[0].size) or update(*a, **k))
    check = Checks()
    for step in range(5):
        grads = [rng.standard_normal(prm.shape) for prm in params]
        for prm, g in zip(params, grads):
            prm.grad[...] = g
        opt.step()
        for i, g in enumerate(grads):
            d = g + wd * ref[i]
            if mom:
                bufs[i] = d.copy() if step == 0 else mom * bufs[i] + (1 - damp) * d
                d = d + mom * bufs[i] if nesterov else bufs[i]
            ref[i] = ref[i] - lr * d
        for prm, r in zip(params, ref):
            check.close(prm.data, r, f"step {step}", rtol=1e-14, atol=1e-15)
        opt.zero_grad()
        check.true(all(not prm.grad.any() for prm in params), "zero_grad")
    # a checkpoint round trip continues identically
    state = opt.state_dict()
    other = nn.SGD([nn.Parameter(prm.data.copy()) for prm in params], lr=lr, **kw)
    other.kernel_backend = kernels
    other.load_state_dict(state)
    g = [rng.standard_normal(prm.shape) for prm in params]
    for a, b, gi in zip(params, other.params, g):
        a.grad[...] = gi
        b.grad[...] = gi
    opt.step()
    other.step()
    for a, b in zip(params, other.params):
        check.equal(a.data, b.data, "after load_state_dict")
    check.true(calls == ([CHUNK + 3] * 7 if kernels == "torch" else []), f"ATen calls {calls}")
    check.finish()


@pytest.mark.parallel(SIZES)
def test_sgd_bad_arguments():
    prm = [nn.Parameter(np.zeros(2))]
    with pytest.raises(ValueError):
        nn.SGD(prm, lr=0)
    with pytest.raises(ValueError):
        nn.SGD(prm, lr=0.1, nesterov=True)
    with pytest.raises(ValueError):
        nn.SGD(prm, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("native_max", [0, 2**30])
@pytest.mark.parametrize("threads", [1, 2])
def test_batchnorm_torch_kernels_in_one_call_or_centred_passes(monkeypatch, native_max,
                                                               dtype, threads):
    """The torch kernels normalise a block whose statistics are its own in one ATen call
    up to NATIVE_BATCH_NORM_MAX elements (any size on more than one PyTorch thread) and
    by the centred passes above it: both match
    the float64 formulas (outputs, gradients, running statistics over two steps) on
    every layout, channels far from zero included, and neither writes into the running
    statistics' arrays (a forward replaces them: recomputation restores the old ones)."""
    if "torch" not in nn.kernels.available_backends():
        pytest.skip("needs PyTorch")
    from disttensor_nn.kernels import torch_kernels
    from disttensor_nn.layers import norm

    monkeypatch.setattr(norm, "NATIVE_BATCH_NORM_MAX", native_max)
    monkeypatch.setattr(torch_kernels, "num_threads", lambda: threads)
    calls = []
    one_call = torch_kernels.batch_norm_train
    monkeypatch.setattr(torch_kernels, "batch_norm_train",
                        lambda *a, **k: calls.append(1) or one_call(*a, **k))
    shape = (4, 3, 12, 10)
    rng = np.random.default_rng(5)
    shift = np.array([300.0, -1000.0, 0.5])[:, None, None]
    xs = [(rng.standard_normal(shape) * (1 + k) + shift).astype(dtype) for k in range(2)]
    dys = [rng.standard_normal(shape).astype(dtype) for _ in range(2)]
    m = 0.3
    tol = (5e-5, 1e-4, 1e-5) if dtype == np.float32 else (1e-9, 1e-9, 1e-10)
    check = Checks()
    for lname, dist in layouts(shape):
        bn = nn.BatchNorm2d(3, momentum=m, dtype=dtype)
        bn.kernel_backend = "torch"
        bn.weight.data[...] = [0.5, 1.0, 1.5]
        bn.bias.data[...] = [0.0, 1.0, -2.0]
        rm, rv = np.zeros(3), np.ones(3)
        own = all(dist.nblocks[d] == 1 for d in (0, 2, 3))  # no other rank shares them
        calls_before = len(calls)
        for x, dy in zip(xs, dys):
            want = bn_expected(x.astype(np.float64), bn.weight.data.astype(np.float64),
                               bn.bias.data.astype(np.float64), bn.eps,
                               dy.astype(np.float64), [(0, shape[0])])
            rm, rv = (1 - m) * rm + m * want[4], (1 - m) * rv + m * want[5]
            bn.zero_grad()
            before = (bn.running_mean, bn.running_mean.copy())
            y = bn(dt.DistArray.from_global(x, dist))
            msg = f"{np.dtype(dtype)} on {lname} (one call up to {native_max}, {threads} " \
                "threads)"
            check.equal(before[0], before[1], f"{msg}: the running mean written in place")
            dx = bn.backward(dt.DistArray.from_global(dy, y.dist))
            check.close(y, want[0], f"{msg}: y", rtol=0, atol=tol[0])
            check.close(dx, want[1], f"{msg}: dx", rtol=0, atol=tol[0])
            check.close(bn.weight.grad, want[2], f"{msg}: dgamma", rtol=tol[1],
                        atol=2e-3 if dtype == np.float32 else 1e-9)
            check.close(bn.bias.grad, want[3], f"{msg}: dbeta", rtol=tol[1],
                        atol=2e-3 if dtype == np.float32 else 1e-9)
        check.close(bn.running_mean, rm, f"{msg}: running mean", rtol=tol[2])
        check.close(bn.running_var, rv, f"{msg}: running var", rtol=10 * tol[2])
        used = len(calls) - calls_before
        one = own and (native_max or threads > 1)
        check.true(used == (2 if one else 0), f"{msg}: {used} one-call passes")
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunk", [24, 200, 2**19])
def test_batchnorm_numpy_pieces(monkeypatch, chunk, dtype):
    """The NumPy batch norm's element-wise passes run piece by piece (CHUNK_BYTES): pieces
    of part of one channel's positions (24 bytes), of whole channels (200) or of whole
    samples (the default here) all match the float64 formulas, channels far from zero
    included, on every layout (empty blocks too), with a temporary no larger than one
    piece."""
    from disttensor_nn.layers import norm

    monkeypatch.setattr(norm, "CHUNK_BYTES", chunk)
    sizes = []
    real_empty = np.empty
    monkeypatch.setattr(norm.np, "empty", lambda n, *a, **k: sizes.append(n) or
                        real_empty(n, *a, **k))
    shape = (3, 3, 7, 5)
    rng = np.random.default_rng(11)
    shift = np.array([300.0, -1000.0, 0.5])[:, None, None]
    x = (rng.standard_normal(shape) * 2 + shift).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    tol = 5e-5 if dtype == np.float32 else 1e-9
    check = Checks()
    for lname, dist in layouts(shape):
        bn = nn.BatchNorm2d(3, dtype=dtype)
        bn.weight.data[...] = [0.5, 1.0, 1.5]
        bn.bias.data[...] = [0.0, 1.0, -2.0]
        want = bn_expected(x.astype(np.float64), bn.weight.data.astype(np.float64),
                           bn.bias.data.astype(np.float64), bn.eps, dy.astype(np.float64),
                           [(0, shape[0])])
        y = bn(dt.DistArray.from_global(x, dist))
        dx = bn.backward(dt.DistArray.from_global(dy, y.dist))
        msg = f"{np.dtype(dtype)} on {lname}, pieces of {chunk} bytes"
        check.close(y, want[0], f"{msg}: y", rtol=0, atol=tol)
        check.close(dx, want[1], f"{msg}: dx", rtol=0, atol=tol)
        check.close(bn.weight.grad, want[2], f"{msg}: dgamma", rtol=tol,
                    atol=2e-3 if dtype == np.float32 else 1e-9)
        check.close(bn.bias.grad, want[3], f"{msg}: dbeta", rtol=tol,
                    atol=2e-3 if dtype == np.float32 else 1e-9)
        bn.eval()  # the running statistics' normalisation, piece by piece too
        rm, rv = (np.asarray(v, np.float64)[None, :, None, None]
                  for v in (bn.running_mean, bn.running_var))
        w, b = (np.asarray(v, np.float64)[None, :, None, None]
                for v in (bn.weight.data, bn.bias.data))
        want_eval = (x.astype(np.float64) - rm) / np.sqrt(rv + bn.eps) * w + b
        check.close(bn(dt.DistArray.from_global(x, dist)), want_eval, f"{msg}: eval y",
                    rtol=0, atol=1e-3 if dtype == np.float32 else 1e-9)
    itemsize = np.dtype(dtype).itemsize
    flat = [n for n in sizes if isinstance(n, int)]
    check.true(max(flat, default=0) <= max(1, chunk // itemsize),
               f"a temporary of {max(flat, default=0)} elements for pieces of {chunk} bytes")
    check.finish()
