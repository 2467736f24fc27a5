"""Distributed Conv1d/2d/3d against an independent serial reference on the global array.

The reference (``nn_reference.conv_ref``) pads the global array with
``numpy.pad`` and correlates it with ``scipy.signal``; its gradients are the
transposed convolution and a correlation with the stride-spread output
gradient, the padding cells summed back into their sources. Every rank
computes the reference serially on the whole array, so the distributed
layer must match the one-process result to float64 rounding on every
layout of ``nn_reference.layouts``: sample-only, each spatial dim, all spatial
dims, replicas, a dim over two grid axes, sample x space, explicit splits with
empty and 1-element blocks. Both forward paths (``overlap`` on and off) are
checked. The reference gradients are themselves checked against the
bilinearity identity <y - b, dy> = <x, dx> = <W, dW>, and the layer's
gradients once more against central finite differences.

Comparisons are local (each rank's block against the same block of the
reference) and agreed on once per test (``nn_reference.Checks``): collectives
dominate the run time on an oversubscribed machine.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from nn_reference import (
    KERNELS,
    Checks,
    conv_ref,
    conv_ref_backward,
    gdots,
    grid,
    layouts,
    pad_pairs,
    pool_ref,
)

import disttensor as dt
import disttensor_nn as nn
from disttensor.blockcache import BlockCache, block_cache
from disttensor.testing import assert_allclose, collective_assert
from disttensor_nn.kernels import torch_kernels
from disttensor_nn.reduction import GradientBuckets

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD
TOL = {"rtol": 1e-12, "atol": 1e-12}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SHAPE = {1: (3, 2, 11), 2: (3, 2, 13, 11), 3: (2, 2, 7, 6, 5)}  # N, C, *S

# (id, keyword arguments); in_channels defaults to SHAPE's C, out_channels to 3 (2 in 3-D)
SPECS = {
    1: [
        ("k3_p1", dict(kernel_size=3, padding=1)),
        ("k2_even", dict(kernel_size=2)),
        ("k4_s3_asym_circular", dict(kernel_size=4, stride=3, padding=((1, 2),),
                                     padding_mode="circular")),
        ("k5_d2_same_reflect", dict(kernel_size=5, dilation=2, padding="same",
                                    padding_mode="reflect")),
        ("k7_valid", dict(kernel_size=7)),
        ("k7_p5_s2", dict(kernel_size=7, padding=5, stride=2)),
        ("groups2_replicate", dict(in_channels=4, out_channels=2, kernel_size=3, padding=3,
                                   groups=2, padding_mode="replicate")),
    ],
    2: [
        ("k3_p1", dict(kernel_size=3, padding=1)),
        ("k2_even_valid", dict(kernel_size=2, padding="valid")),
        ("k4_same", dict(kernel_size=4, padding="same")),
        ("k2x4_asym", dict(kernel_size=(2, 4), padding=((1, 0), (1, 2)))),
        ("s2_asym", dict(kernel_size=3, stride=2, padding=((1, 2), (2, 1)))),
        ("s3_k3x5", dict(kernel_size=(3, 5), stride=3, padding=(0, 2))),
        ("s2x3_k4", dict(kernel_size=4, stride=(2, 3), padding=1)),
        ("d2_same", dict(kernel_size=3, dilation=2, padding="same")),
        ("d2x1_s2_p3", dict(kernel_size=3, dilation=(2, 1), stride=2, padding=(3, 0))),
        ("k3x7_wide", dict(kernel_size=(3, 7), padding=(1, 3))),
        ("k7_valid", dict(kernel_size=7)),
        ("k3_p4", dict(kernel_size=3, padding=4)),
        ("groups2_nobias", dict(in_channels=4, out_channels=4, kernel_size=3, padding=1,
                                groups=2, bias=False)),
        ("reflect_asym", dict(kernel_size=(3, 4), padding=((1, 2), (2, 1)),
                              padding_mode="reflect")),
        ("reflect_k7", dict(kernel_size=7, padding=3, padding_mode="reflect")),
        ("circular_s2_p4", dict(kernel_size=5, stride=2, padding=(4, 3),
                                padding_mode="circular")),
        ("replicate_d2", dict(kernel_size=3, dilation=2, padding=((2, 3), (3, 2)),
                              padding_mode="replicate")),
        ("groups2_circular_s2", dict(in_channels=4, out_channels=2, kernel_size=(4, 3),
                                     stride=2, padding=((2, 1), 1), groups=2,
                                     padding_mode="circular")),
    ],
    3: [
        ("k3_p1", dict(kernel_size=3, padding=1)),
        ("k2x3x4_s_asym_circular", dict(kernel_size=(2, 3, 4), stride=(2, 1, 3),
                                        padding=((1, 0), (0, 2), 1),
                                        padding_mode="circular")),
        ("d2_same_reflect", dict(kernel_size=3, dilation=(1, 2, 1), padding="same",
                                 padding_mode="reflect")),
        ("k5_valid", dict(kernel_size=(5, 2, 5))),
        ("groups2_replicate_s2", dict(in_channels=4, out_channels=2, kernel_size=3, stride=2,
                                      padding=2, groups=2, padding_mode="replicate")),
    ],
}


def make_conv(nd, kw, seed=0, **extra):
    """A float64 conv layer with weights drawn from ``seed`` (the same on every rank)."""
    kw = dict(kw, **extra)
    c_in = kw.pop("in_channels", SHAPE[nd][1])
    c_out = kw.pop("out_channels", 3 if nd < 3 else 2)
    conv = CONV[nd](c_in, c_out, dtype=np.float64, **kw)
    rng = np.random.default_rng(seed)
    conv.weight.data[...] = rng.standard_normal(conv.weight.shape)
    if conv.bias is not None:
        conv.bias.data[...] = rng.standard_normal(conv.bias.shape)
    return conv


def ref_args(nd, conv, kw):
    stride = kw.get("stride", 1)
    dilation = kw.get("dilation", 1)
    pads = pad_pairs(kw.get("padding", 0), kw["kernel_size"], dilation, nd)
    return dict(stride=stride, pads=pads, dilation=dilation, groups=conv.groups,
                mode=kw.get("padding_mode", "zeros"))


def input_shape(nd, conv):
    shape = list(SHAPE[nd])
    shape[1] = conv.in_channels
    return tuple(shape)


# --------------------------------------------------------------------------- forward + backward
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("nd,name,kw", [(nd, name, kw) for nd, specs in SPECS.items()
                                        for name, kw in specs],
                         ids=[f"{nd}d-{name}" for nd, specs in SPECS.items()
                              for name, _ in specs])
def test_conv_matches_reference_on_every_layout(nd, name, kw, kernels):
    conv = make_conv(nd, kw)
    conv.kernel_backend = kernels
    shape = input_shape(nd, conv)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape)
    args = ref_args(nd, conv, kw)
    b = None if conv.bias is None else conv.bias.data
    want = conv_ref(x, conv.weight.data, b, **args)
    dy = rng.standard_normal(want.shape)
    dx_want, dw_want, db_want = conv_ref_backward(x, conv.weight.data, dy, **args)
    # bilinearity of conv_W(x) = y - b: <conv_W(x), dy> = <x, dx> = <W, dW>
    unbiased = want if b is None else want - b.reshape((1, -1) + (1,) * nd)
    ip = np.vdot(unbiased, dy)
    check = Checks()
    check.close(np.vdot(x, dx_want), ip, "reference <x, dx>", rtol=1e-11, atol=1e-11)
    check.close(np.vdot(conv.weight.data, dw_want), ip, "reference <W, dW>", rtol=1e-11,
                atol=1e-11)
    for lname, dist in layouts(shape):
        outputs = {}
        for overlap in (False, True):
            msg = f"{name} on {lname} {dist} overlap={overlap}"
            conv.overlap = overlap
            xd = dt.DistArray.from_global(x, dist)
            y = conv(xd)
            check.true(y.dtype == np.float64, f"{msg}: dtype {y.dtype}")
            check.close(y, want, msg)
            conv.zero_grad()
            dx = conv.backward(dt.DistArray.from_global(dy, y.dist))
            check.true(dx.dist == dist, f"{msg}: dx in {dx.dist}")
            check.close(dx, dx_want, f"{msg}: dx")
            check.close(conv.weight.grad, dw_want, f"{msg}: dW")
            if conv.bias is not None:
                check.close(conv.bias.grad, db_want, f"{msg}: db")
            check.equal(xd.local, x[dist.local_slices()], f"{msg}: input modified")
            outputs[overlap] = (y.local.copy(), dx.local.copy())
        for a, b_ in zip(outputs[False], outputs[True]):
            check.close(a, b_, f"{name} on {lname}: overlap changes the result", rtol=1e-14,
                        atol=1e-14)
    check.finish()


@pytest.mark.skipif(not torch_kernels.available(), reason="needs PyTorch")
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("route", ["always", "tuned"])
def test_torch_kernels_float32_conv_on_channels_last_copies_match_reference(route,
                                                                            monkeypatch):
    """The torch kernels' float32 2-D convolution on channels-last copies of its blocks
    (every call, or where the first call of a shape found it faster): output and every
    gradient within float32 rounding of the float64 reference on every layout, with the
    kernel's padding and a halo's, a stride and a bias."""
    monkeypatch.setattr(torch_kernels, "CONV_CHANNELS_LAST", route)
    shape = (3, 5, 13, 11)
    rng = np.random.default_rng(11)
    x = rng.standard_normal(shape)
    check = Checks()
    for kw in ({"kernel_size": 3, "padding": 1}, {"kernel_size": (5, 3), "stride": 2,
                                                   "padding": (2, 1), "bias": False}):
        conv = nn.Conv2d(5, 6, dtype=np.float32, **kw)
        conv.kernel_backend = "torch"
        w = conv.weight.data.astype(np.float64)
        b = None if conv.bias is None else conv.bias.data.astype(np.float64)
        args = dict(stride=kw.get("stride", 1), pads=pad_pairs(kw["padding"], kw["kernel_size"],
                                                                1, 2),
                    dilation=1, groups=1, mode="zeros")
        want = conv_ref(x, w, b, **args)
        dy = rng.standard_normal(want.shape)
        dx_want, dw_want, db_want = conv_ref_backward(x, w, dy, **args)
        tol = {"rtol": 1e-4, "atol": 1e-4 * float(np.abs(want).max())}
        for lname, dist in layouts(shape):
            msg = f"{kw} on {lname}"
            y = conv(dt.DistArray.from_global(x.astype(np.float32), dist))
            check.close(y, want, msg, **tol)
            conv.zero_grad()
            dx = conv.backward(dt.DistArray.from_global(dy.astype(np.float32), y.dist))
            check.close(dx, dx_want, f"{msg}: dx", **tol)
            check.close(conv.weight.grad, dw_want, f"{msg}: dW", rtol=1e-4,
                        atol=1e-4 * float(np.abs(dw_want).max()))
            if b is not None:
                check.close(conv.bias.grad, db_want, f"{msg}: db", rtol=1e-4, atol=1e-3)
    check.finish()


@pytest.mark.skipif(not torch_kernels.available(), reason="needs PyTorch")
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_torch_kernels_channels_last_copies_give_the_plain_convolution(data):
    """Random float32 2-D convolutions (channels, kernel, stride, dilation, padding, bias,
    which gradients): on channels-last copies the output and gradients equal the plain
    call's to float32 rounding, come back C-contiguous, and a tuned process repeats its
    results bit for bit."""
    draw = data.draw
    c_in, c_out = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    kernel = tuple(draw(st.integers(1, 4)) for _ in range(2))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(2))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(2))
    pads = tuple(draw(st.integers(0, 2)) for _ in range(2))
    size = tuple(draw(st.integers(max(1, d * (k - 1) + 1 - 2 * p), 12))
                 for k, d, p in zip(kernel, dilation, pads))
    need = (draw(st.booleans()), draw(st.booleans()), draw(st.booleans()))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rng.standard_normal((draw(st.integers(1, 3)), c_in, *size)).astype(np.float32)
    w = rng.standard_normal((c_out, c_in, *kernel)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32) if need[2] else None
    results = {}
    for route in ("never", "always", "tuned", "tuned"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch_kernels, "CONV_CHANNELS_LAST", route)
            y = torch_kernels.conv_forward(x, w, b, stride, dilation, padding=pads)
            dy = np.linspace(-1, 1, y.size, dtype=np.float32).reshape(y.shape)
            grads = torch_kernels.conv_backward(dy, x, w, stride, dilation, need_dx=need[0],
                                                need_dw=need[1], need_db=need[2],
                                                padding=pads)
        got = [y, *grads]
        assert all(g is None or g.flags.c_contiguous for g in got)
        if route in results:  # the process kept its choice
            for a, b_ in zip(got, results[route]):
                assert (a is None) == (b_ is None)
                if a is not None:
                    np.testing.assert_array_equal(a, b_)
        results[route] = got
    for route in ("always", "tuned"):
        for a, b_ in zip(results[route], results["never"]):
            assert (a is None) == (b_ is None)
            if a is not None:
                np.testing.assert_allclose(a, b_, rtol=1e-4,
                                           atol=1e-4 * max(1.0, float(np.abs(b_).max())))


# --------------------------------------------------------------------------- finite differences
FD_CASES = {
    1: dict(kernel_size=4, stride=2, padding=((2, 1),), dilation=1, padding_mode="reflect"),
    2: dict(kernel_size=(3, 2), stride=(2, 1), padding=((1, 2), (0, 1)), dilation=(1, 2),
            padding_mode="reflect", groups=2, in_channels=2, out_channels=2),
    3: dict(kernel_size=(2, 3, 2), stride=(1, 2, 1), padding=(1, (2, 0), 1),
            padding_mode="replicate"),
}
FD_SHAPE = {1: (2, 2, 7), 2: (2, 2, 7, 6), 3: (1, 2, 4, 5, 3)}


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_gradients_match_finite_differences(nd, kernels):
    conv = make_conv(nd, FD_CASES[nd], seed=3, out_channels=2)
    conv.kernel_backend = kernels
    shape = FD_SHAPE[nd]
    lname = {1: "sample x L", 2: "HxW", 3: "DxHxW"}[nd]
    dist = dict(layouts(shape))[lname]
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape)
    y = conv(dt.DistArray.from_global(x, dist))
    r = rng.standard_normal(y.shape)
    conv.zero_grad()
    dx = conv.backward(dt.DistArray.from_global(r, y.dist))

    def loss(xg):
        return gdots([(conv(dt.DistArray.from_global(xg, dist)), r)])[0]

    h = 1e-5
    pick = np.random.default_rng(7)
    check = Checks()
    dxg = dx.to_global()
    for _ in range(5):
        i = tuple(int(pick.integers(n)) for n in shape)
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        check.close(dxg[i], (loss(xp) - loss(xm)) / (2 * h), f"{lname}: dx{i}", rtol=1e-7,
                    atol=1e-8)
    params = [conv.weight] + ([conv.bias] if conv.bias is not None else [])
    grads = [p.grad.copy() for p in params]
    for p, g in zip(params, grads):
        for _ in range(3):
            i = tuple(int(pick.integers(n)) for n in p.shape)
            old = p.data[i]
            p.data[i] = old + h
            lp = loss(x)
            p.data[i] = old - h
            lm = loss(x)
            p.data[i] = old
            check.close(g[i], (lp - lm) / (2 * h), f"{lname}: param grad {p.shape}{i}",
                        rtol=1e-7, atol=1e-8)
    check.finish()


@pytest.mark.parallel(SIZES)
def test_weight_gradients_accumulate_and_backward_twice():
    conv = make_conv(2, dict(kernel_size=3, padding=1))
    shape = SHAPE[2]
    rng = np.random.default_rng(8)
    x = rng.standard_normal(shape)
    dist = dict(layouts(shape))["HxW"]
    y = conv(dt.DistArray.from_global(x, dist))
    dy = rng.standard_normal(y.shape)
    conv.zero_grad()
    dx1 = conv.backward(dt.DistArray.from_global(dy, y.dist)).to_global()
    dx2 = conv.backward(dt.DistArray.from_global(dy, y.dist)).to_global()
    dx_want, dw_want, db_want = conv_ref_backward(x, conv.weight.data, dy, 1, [(1, 1)] * 2, 1)
    assert_allclose(dx1, dx_want, **TOL)
    assert_allclose(dx2, dx_want, **TOL)
    assert_allclose(conv.weight.grad, 2 * dw_want, **TOL)
    assert_allclose(conv.bias.grad, 2 * db_want, **TOL)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("layout", ["sample", "HxW"])
def test_no_input_gradient_keeps_parameter_gradients(layout):
    """input_grad = False: backward returns None, the parameter gradients are the reference's;
    in a Sequential the first layer's None ends the backward pass."""
    shape = SHAPE[2]
    rng = np.random.default_rng(9)
    x = rng.standard_normal(shape)
    dist = dict(layouts(shape))[layout]
    conv = make_conv(2, dict(kernel_size=3, stride=2, padding=1))
    model = nn.Sequential(conv, nn.MaxPool2d(2, padding=1))
    conv.input_grad = False
    y = model(dt.DistArray.from_global(x, dist))
    dy = rng.standard_normal(y.shape)
    dpool = model[1].backward(dt.DistArray.from_global(dy, y.dist))
    conv.zero_grad()
    collective_assert(model.backward(dt.DistArray.from_global(dy, y.dist)) is None,
                      "backward returned an input gradient")
    _, dw_want, db_want = conv_ref_backward(x, conv.weight.data, dpool.to_global(), 2,
                                            [(1, 1)] * 2, 1)
    assert_allclose(conv.weight.grad, dw_want, **TOL)
    assert_allclose(conv.bias.grad, db_want, **TOL)
    # a later layer without an input gradient: the layers before it get nothing, no error
    first = make_conv(2, dict(kernel_size=3, padding=1), seed=4)
    model = nn.Sequential(first, nn.ReLU(),
                          make_conv(2, dict(kernel_size=3, padding=1, in_channels=3)))
    model[2].input_grad = False
    y = model(dt.DistArray.from_global(x, dist))
    model.zero_grad()
    dy = rng.standard_normal(y.shape)
    collective_assert(model.backward(dt.DistArray.from_global(dy, y.dist)) is None,
                      "backward returned an input gradient")
    collective_assert(not np.any(first.weight.grad) and np.any(model[2].weight.grad),
                      "gradients of the layers before the one without an input gradient")


@pytest.mark.parallel(SIZES)
def test_layers_sharing_one_input_keep_their_own_halos():
    # three window layers read the same DistArray with different halo widths and modes;
    # each backward must use its own halo even though the others overwrote the margins
    shape = SHAPE[2]
    rng = np.random.default_rng(9)
    x = rng.standard_normal(shape)
    conv_a = make_conv(2, dict(kernel_size=3, padding=1), seed=1)
    conv_b = make_conv(2, dict(kernel_size=5, stride=2, padding=(4, 2),
                               padding_mode="circular"), seed=2)
    pool = nn.MaxPool2d(3, stride=2, padding=1)
    xp = np.random.default_rng(10).permutation(x.size).reshape(shape) * 0.01
    check = Checks()
    for lname, dist in layouts(shape):
        xd = dt.DistArray.from_global(x + xp, dist)
        ya, yb, yc = conv_a(xd), conv_b(xd), pool(xd)
        dys = [rng.standard_normal(y.shape) for y in (ya, yb, yc)]
        conv_a.zero_grad()
        conv_b.zero_grad()
        dxa = conv_a.backward(dt.DistArray.from_global(dys[0], ya.dist))
        dxc = pool.backward(dt.DistArray.from_global(dys[2], yc.dist))
        dxb = conv_b.backward(dt.DistArray.from_global(dys[1], yb.dist))
        for conv, y, dy, dx in ((conv_a, ya, dys[0], dxa), (conv_b, yb, dys[1], dxb)):
            args = dict(stride=conv.spec.stride, pads=list(conv.spec.padding),
                        dilation=conv.spec.dilation, mode=conv.padding_mode)
            check.close(y, conv_ref(x + xp, conv.weight.data, conv.bias.data, **args), lname)
            dx_want, dw_want, _ = conv_ref_backward(x + xp, conv.weight.data, dy, **args)
            check.close(dx, dx_want, f"{lname}: dx")
            check.close(conv.weight.grad, dw_want, f"{lname}: dW")
        want, dx_of = pool_ref(x + xp, 3, 2, [(1, 1)] * 2, 1, "max")
        check.close(yc, want, f"{lname}: max pool")
        check.close(dxc, dx_of(dys[2]), f"{lname}: max pool dx")
    check.finish()


# --------------------------------------------------------------------------- bad input
def _x(shape, dist_axes=None, dtype=np.float64, g=None):
    p = comm.Get_size()
    g = grid((p,)) if g is None else g
    axes = dist_axes if dist_axes is not None else (None, None, 0) + (None,) * (len(shape) - 3)
    dist = dt.Distribution(shape, g, axes)
    return dt.DistArray.from_global(np.ones(shape, dtype), dist)


@pytest.mark.parallel(SIZES)
def test_wrong_channel_count_ndim_and_dtype():
    conv = nn.Conv2d(3, 2, 3, padding=1, dtype=np.float64)
    with pytest.raises(ValueError, match="channels"):
        conv(_x((2, 4, 6, 5)))
    with pytest.raises(ValueError, match="4-D"):
        conv(_x((2, 3, 6, 5, 4)))
    with pytest.raises(ValueError):
        conv(_x((2, 3, 6)))
    with pytest.raises(TypeError):
        conv(_x((2, 3, 6, 5), dtype=np.float32))
    conv32 = nn.Conv2d(3, 2, 3, padding=1)  # float32 parameters by default
    with pytest.raises(TypeError, match="float32"):
        conv32(_x((2, 3, 6, 5)))
    with pytest.raises(TypeError):
        conv(np.ones((2, 3, 6, 5)))
    # the layer still works afterwards: nobody is left inside a collective
    y = conv(_x((2, 3, 6, 5)))
    collective_assert(y.shape == (2, 2, 6, 5), f"{y.shape}")


@pytest.mark.parallel(SIZES)
def test_split_channel_dim_with_groups_is_rejected():
    """A split channel dimension is channel-parallel (tests/test_nn_channel_filter.py),
    except with groups > 1."""
    p = comm.Get_size()
    conv = nn.Conv2d(4, 2, 3, padding=1, dtype=np.float64)
    x = _x((2, 4, 6, 5), dist_axes=(None, 0, None, None))
    collective_assert(conv(x).shape == (2, 2, 6, 5))
    if p > 1:
        with pytest.raises(ValueError, match="split channel"):
            nn.Conv2d(4, 2, 3, padding=1, groups=2, dtype=np.float64)(x)
    # the channel dim may be "split" over one block together with a spatial split
    g = grid((p, 1))
    x = _x((2, 4, 6, 5), dist_axes=(None, 1, 0, None), g=g)
    collective_assert(conv(x).shape == (2, 2, 6, 5))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kw", [
    dict(kernel_size=3, stride=0), dict(kernel_size=3, stride=(1, 0)),
    dict(kernel_size=3, padding=-1), dict(kernel_size=3, padding=((1, -1), 0)),
    dict(kernel_size=0), dict(kernel_size=3, dilation=0), dict(kernel_size=(3, 3, 3)),
    dict(kernel_size=3, padding="same", stride=2), dict(kernel_size=3, padding="full"),
    dict(kernel_size=3, padding_mode="mirror"),
    dict(kernel_size=3, groups=2), dict(kernel_size=3, groups=0),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_bad_arguments_raise_value_error(kw):
    kw = dict(kw)
    c_in, c_out = (3, 4) if kw.get("groups") == 2 else (2, 4)
    with pytest.raises(ValueError):
        nn.Conv2d(c_in, c_out, dtype=np.float64, **kw)


@pytest.mark.parallel(SIZES)
def test_groups_must_divide_out_channels():
    with pytest.raises(ValueError, match="divisible"):
        nn.Conv2d(4, 3, 3, groups=2)
    with pytest.raises(ValueError, match="divisible"):
        nn.Conv1d(6, 4, 3, groups=4)


@pytest.mark.parallel(SIZES)
def test_kernel_larger_than_padded_input_is_refused():
    # H: 5 + 1 + 0 < 7 -> no output rows: refused as in PyTorch (an empty output before)
    conv = make_conv(2, dict(kernel_size=7, padding=((1, 0), 1)), out_channels=2)
    shape = (2, 2, 5, 11)
    x = np.random.default_rng(0).standard_normal(shape)
    check = Checks()
    for (lname, dist), overlap in itertools.product(layouts(shape), (False, True)):
        conv.overlap = overlap
        with pytest.raises(ValueError, match=r"padded input size \(6, 13\).*kernel \(7, 7\)"):
            conv(dt.DistArray.from_global(x, dist))
        check.true(True, lname)
    with pytest.raises(ValueError, match="padded input size"):
        conv.output_shape(shape)
    check.finish()


@pytest.mark.parallel(SIZES)
def test_output_distribution_keeps_grid_and_samples():
    conv = make_conv(2, dict(kernel_size=3, padding="same"))
    check = Checks()
    for lname, dist in layouts(SHAPE[2]):
        y = conv(dt.DistArray.from_global(np.zeros(SHAPE[2]), dist))
        # stride-1 'same' keeps the spatial blocks of the input
        check.true(y.dist.grid == dist.grid and y.dist.dim_axes == dist.dim_axes
                   and y.dist.boundaries[0] == dist.boundaries[0]
                   and y.dist.boundaries[2:] == dist.boundaries[2:],
                   f"{lname}: {y.dist} from {dist}")
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("mode", ["blocking", "buckets", "block cache"])
def test_weight_gradients_over_steps_with_zero_grad_between(kernels, mode):
    """Three steps, zero_grad between: each step's weight and bias gradients are that
    step's alone (the reference's), on every layout, reduced blocking, in buckets, or
    with a block cache active. The torch kernels' own new gradient arrays become the
    gradients, with no copy: a gradient array given up by a step (a new one took its
    place) is not written by the next."""
    shape = SHAPE[2]
    rng = np.random.default_rng(41)
    conv = CONV[2](2, 3, 3, padding=1, dtype=np.float64)
    conv.kernel_backend = kernels
    w = conv.weight.data.copy()
    check = Checks()
    for lname, dist in layouts(shape)[:6]:
        given_up = None
        for step in range(3):
            x = rng.standard_normal(shape)
            dy = rng.standard_normal(conv.output_shape(shape))
            _, dw_want, db_want = conv_ref_backward(x, w, dy, (1, 1), [(1, 1), (1, 1)],
                                                    (1, 1))
            conv.zero_grad()
            with contextlib.ExitStack() as stack:
                if mode == "buckets":
                    stack.enter_context(GradientBuckets())
                elif mode == "block cache":
                    stack.enter_context(block_cache(cache=BlockCache(min_bytes=1)))
                y = conv(dt.DistArray.from_global(x, dist))
                conv.backward(dt.DistArray.from_global(dy, y.dist))
            msg = f"{kernels}, {mode}, on {lname}, step {step}"
            check.close(conv.weight.grad, dw_want, f"{msg}: dW", rtol=1e-11, atol=1e-11)
            check.close(conv.bias.grad, db_want, f"{msg}: db", rtol=1e-11, atol=1e-11)
            if given_up is not None and not np.shares_memory(given_up[0], conv.weight.grad):
                check.equal(given_up[0], given_up[1], f"{msg}: an earlier dW was written")
            given_up = (conv.weight.grad, conv.weight.grad.copy())
    check.finish()
