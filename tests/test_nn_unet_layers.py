"""The U-Net layers against independent NumPy references on every layout of ``nn_reference``.

Transposed convolution: a direct loop over input positions and kernel taps
(PyTorch's definition, scattering each input into its outputs). Upsampling:
a loop over output positions that computes each one's source positions from
PyTorch's formula. Group/instance norm, softmax and the segmentation losses:
textbook formulas on the global array. Every gradient is checked against
central finite differences of the distributed layer along random
directions (and, for the linear layers, the loop references' adjoints).
Layouts: sample, each spatial dim, all spatial dims, replicas, one dim over
two grid axes, sample x space, empty and 1-element blocks; world sizes 1-4.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from mpi4py import MPI
from nn_reference import KERNELS, Checks, gdots, grid, layouts

import disttensor as dt
import disttensor_nn as nn

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD
F64 = np.float64


def dist_of(shape):
    return dt.Distribution(shape, grid((comm.Get_size(),)), [None] * len(shape))


def fd_directional(fn, xg, dist, grad, chk, what, eps=1e-6, count=2, seed=5, rtol=1e-6):
    """Check ``<grad, h>`` against ``(f(x + eps h) - f(x - eps h)) / 2 eps`` for random ``h``.

    ``fn(x)`` is a scalar (the same on every rank) of the DistArray ``x``.
    """
    rng = np.random.default_rng(seed)
    for _ in range(count):
        h = rng.standard_normal(xg.shape)
        fp = fn(dt.DistArray.from_global(xg + eps * h, dist))
        fm = fn(dt.DistArray.from_global(xg - eps * h, dist))
        want = (fp - fm) / (2 * eps)
        got = float(gdots([(grad, h)])[0]) if isinstance(grad, dt.DistArray) else \
            float(np.vdot(grad, h))
        chk.true(abs(got - want) <= rtol * (1 + abs(want)), f"{what}: {got} != FD {want}")


def linear_form(layer, dyg):
    """x -> <layer(x), dy> (collective)."""
    return lambda x: float(gdots([(layer(x), dyg)])[0])


# --------------------------------------------------------------------------- ConvTranspose
def convT_loop(x, w, b, stride, pad, outpad, dil, groups):
    """PyTorch's ConvTranspose by definition: each input scatters into its outputs."""
    n, cin = x.shape[:2]
    nd = x.ndim - 2
    og, ig = w.shape[1], cin // groups
    k = w.shape[2:]
    size = [(x.shape[2 + i] - 1) * stride[i] - 2 * pad[i] + dil[i] * (k[i] - 1) + outpad[i] + 1
            for i in range(nd)]
    y = np.zeros((n, og * groups, *size))
    for j in itertools.product(*map(range, x.shape[2:])):
        for t in itertools.product(*map(range, k)):
            o = tuple(stride[d] * j[d] - pad[d] + dil[d] * t[d] for d in range(nd))
            if all(0 <= o[d] < size[d] for d in range(nd)):
                for g in range(groups):
                    cs, os_ = slice(g * ig, (g + 1) * ig), slice(g * og, (g + 1) * og)
                    y[(slice(None), os_) + o] += x[(slice(None), cs) + j] @ w[(cs, slice(None)) + t]
    if b is not None:
        y += b.reshape((1, -1) + (1,) * nd)
    return y


CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
CONVT_CASES = [
    (1, (3, 2, 11), dict(kernel_size=3, stride=2, padding=1, output_padding=1)),
    (1, (3, 2, 9), dict(kernel_size=5, stride=2, padding=4, bias=False)),
    (1, (2, 2, 9), dict(kernel_size=1, stride=3)),
    (2, (3, 2, 7, 5), dict(kernel_size=2, stride=2)),
    (2, (2, 4, 5, 6), dict(kernel_size=(3, 4), stride=(1, 3), padding=(2, 1), dilation=(2, 1),
                           groups=2)),
    (3, (2, 2, 5, 4, 3), dict(kernel_size=2, stride=2)),
    (3, (1, 2, 3, 4, 5), dict(kernel_size=3, padding=1, output_padding=(0, 1, 0),
                              stride=(1, 2, 1))),
]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("nd,shape,kw", CONVT_CASES,
                         ids=[f"{nd}d-{i}" for i, (nd, _, _) in enumerate(CONVT_CASES)])
def test_conv_transpose_matches_loop_and_finite_differences(nd, shape, kw, kernels):
    layer = CONVT[nd](shape[1], 4, dtype=F64, seed=3, **kw)
    layer.kernel_backend = kernels
    rng = np.random.default_rng(1)
    xg = rng.standard_normal(shape)
    s, d = layer.spec.stride, layer.spec.dilation
    p = [lo for lo, _ in layer.spec.padding]
    b = None if layer.bias is None else layer.bias.data
    yref = convT_loop(xg, layer.weight.data, b, s, p, layer.output_padding, d, layer.groups)
    dyg = rng.standard_normal(yref.shape)
    # the loop reference's adjoints: <convT(x) - b, dy> = <x, dx> = <w, dw>
    zero_b = convT_loop(xg, layer.weight.data, None, s, p, layer.output_padding, d, layer.groups)
    chk = Checks()
    chk.true(layer.output_shape(shape) == yref.shape, "output_shape")
    db_ref = dyg.sum(axis=(0, *range(2, 2 + nd)))
    for name, dist in layouts(shape):
        layer.zero_grad()
        y = layer(dt.DistArray.from_global(xg, dist))
        chk.close(y, yref, f"{name} forward")
        dx = layer.backward(dt.DistArray.from_global(dyg, y.dist))
        # <x, dx> = <y - b, dy> and <w, dw> = <y - b, dy>: the gradients by bilinearity
        ydy = float(np.vdot(zero_b, dyg))
        chk.close(gdots([(dx, xg)])[0], ydy, f"{name} <x, dx>", rtol=1e-10, atol=1e-10)
        chk.close(np.vdot(layer.weight.grad, layer.weight.data), ydy, f"{name} <w, dw>",
                  rtol=1e-10, atol=1e-10)
        if layer.bias is not None:
            chk.close(layer.bias.grad, db_ref, f"{name} db", rtol=1e-10, atol=1e-10)
    # finite differences on the last (most irregular) layout, input and weight
    name, dist = layouts(shape)[-1]
    layer.zero_grad()
    y = layer(dt.DistArray.from_global(xg, dist))
    dx = layer.backward(dt.DistArray.from_global(dyg, y.dist))
    fd_directional(linear_form(layer, dyg), xg, dist, dx, chk, f"{name} dx FD")
    w0 = layer.weight.data.copy()
    h = rng.standard_normal(w0.shape)
    vals = []
    for sgn in (1, -1):
        layer.weight.data[...] = w0 + sgn * 1e-6 * h
        vals.append(linear_form(layer, dyg)(dt.DistArray.from_global(xg, dist)))
    layer.weight.data[...] = w0
    want = (vals[0] - vals[1]) / 2e-6
    got = float(np.vdot(layer.weight.grad, h))
    chk.true(abs(got - want) <= 1e-6 * (1 + abs(want)), f"dw FD {got} != {want}")
    chk.finish()


@pytest.mark.parallel([1, 3])
def test_conv_transpose_bad_arguments():
    with pytest.raises(ValueError, match="output_padding"):
        nn.ConvTranspose2d(2, 2, 3, stride=2, output_padding=2)
    with pytest.raises(ValueError, match="divisible"):
        nn.ConvTranspose2d(3, 2, 3, groups=2)
    layer = nn.ConvTranspose2d(2, 3, 3, dtype=F64)
    x = dt.zeros((1, 3, 4, 4), dist=dist_of((1, 3, 4, 4)).replace(axes=(None, None, 0, None)))
    with pytest.raises(ValueError, match="channels"):
        layer(x)
    with pytest.raises(ValueError, match="empty"):
        nn.ConvTranspose1d(1, 1, 1, padding=3).output_shape((1, 1, 2))


# --------------------------------------------------------------------------- Upsample
def upsample_loop(x, size, scales, mode, align):
    """PyTorch's interpolation, one output position at a time, dimension by dimension."""
    y = x
    for i, (m, scale) in enumerate(zip(size, scales)):
        n = y.shape[2 + i]
        out = np.zeros(y.shape[:2 + i] + (m,) + y.shape[3 + i:])
        for o in range(m):
            ratio = scale if scale is not None else n / m
            if mode == "nearest":
                taps = [(min(int(math.floor(o * ratio)), n - 1), 1.0)]
            else:
                if align:
                    src = o * (n - 1) / (m - 1) if m > 1 else 0.0
                else:
                    src = max(ratio * (o + 0.5) - 0.5, 0.0)
                i0 = min(int(math.floor(src)), n - 1)
                i1 = min(i0 + 1, n - 1)
                taps = [(i0, 1 - (src - i0)), (i1, src - i0)]
            for src_i, wgt in taps:
                out[(slice(None),) * (2 + i) + (o,)] += wgt * y[(slice(None),) * (2 + i) + (src_i,)]
        y = out
    return y


UP_CASES = [
    ((2, 3, 7), dict(scale_factor=2, mode="nearest"), None),
    ((2, 3, 7), dict(scale_factor=2.5, mode="linear"), None),
    ((2, 3, 7), dict(size=12, mode="linear", align_corners=True), None),
    ((2, 2, 5, 6), dict(scale_factor=2, mode="bilinear"), None),
    ((2, 2, 5, 6), dict(size=(9, 4), mode="nearest"), None),
    ((1, 2, 4, 3, 5), dict(scale_factor=(2, 3, 1.5), mode="trilinear"), None),
]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("shape,kw,_", UP_CASES, ids=[f"{len(s) - 2}d-{k['mode']}-{i}"
                                                       for i, (s, k, _) in enumerate(UP_CASES)])
def test_upsample_matches_loop_and_finite_differences(shape, kw, _):
    layer = nn.Upsample(**kw)
    nd = len(shape) - 2
    out = layer.output_shape(shape)
    if "size" in kw:
        scales = (None,) * nd
    else:
        f = kw["scale_factor"]
        scales = tuple(1.0 / v for v in (f if isinstance(f, tuple) else (f,) * nd))
    rng = np.random.default_rng(2)
    xg = rng.standard_normal(shape)
    yref = upsample_loop(xg, out[2:], scales, kw["mode"], kw.get("align_corners"))
    dyg = rng.standard_normal(yref.shape)
    chk = Checks()
    for name, dist in layouts(shape):
        y = layer(dt.DistArray.from_global(xg, dist))
        chk.close(y, yref, f"{name} forward")
        dx = layer.backward(dt.DistArray.from_global(dyg, y.dist))
        chk.close(gdots([(dx, xg)])[0], np.vdot(yref, dyg), f"{name} adjoint", rtol=1e-10,
                  atol=1e-10)
    name, dist = layouts(shape)[-1]
    y = layer(dt.DistArray.from_global(xg, dist))
    dx = layer.backward(dt.DistArray.from_global(dyg, y.dist))
    fd_directional(linear_form(layer, dyg), xg, dist, dx, chk, f"{name} FD")
    chk.finish()


@pytest.mark.parallel([1, 3])
@pytest.mark.parametrize("shape,kw", [
    ((2, 3, 3, 7), dict(scale_factor=1.3, mode="bilinear")),  # H kept: copied
    ((2, 3, 7), dict(scale_factor=2.5, mode="linear")),
    ((2, 2, 9, 6), dict(scale_factor=(0.6, 1.5), mode="nearest")),
    ((1, 2, 11, 10), dict(scale_factor=(1.05, 2.05), mode="nearest")),  # kept, doubled
    ((1, 2, 45), dict(scale_factor=1.3, mode="nearest")),  # a row found in float32
    ((1, 2, 7), dict(scale_factor=0.6, mode="nearest")),
    ((2, 2, 5, 6), dict(size=(11, 4), mode="bilinear", align_corners=True)),
    ((1, 2, 4, 3, 5), dict(scale_factor=(1.5, 1.0, 2.5), mode="trilinear")),
])
def test_upsample_equals_torch_interpolate(shape, kw):
    torch = pytest.importorskip("torch")
    layer = nn.Upsample(**kw)
    xg = np.random.default_rng(4).standard_normal(shape)
    want = torch.nn.functional.interpolate(torch.from_numpy(xg), **kw).numpy()
    chk = Checks()
    for name, dist in layouts(shape):
        chk.close(layer(dt.DistArray.from_global(xg, dist)), want, f"{name} forward")
    chk.finish()


@pytest.mark.parallel([1, 2])
def test_upsample_bad_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        nn.Upsample()
    with pytest.raises(ValueError, match="mode"):
        nn.Upsample(scale_factor=2, mode="cubic")
    with pytest.raises(ValueError, match="align_corners"):
        nn.Upsample(scale_factor=2, align_corners=True)
    with pytest.raises(ValueError, match="2-D"):
        nn.Upsample(scale_factor=2, mode="bilinear").output_shape((1, 1, 4))


# --------------------------------------------------------------------------- GroupNorm
def groupnorm_ref(x, groups, gamma, beta, eps):
    n, c = x.shape[:2]
    xr = x.reshape(n, groups, -1)
    mean = xr.mean(axis=-1, keepdims=True)
    var = ((xr - mean) ** 2).mean(axis=-1, keepdims=True)
    y = ((xr - mean) / np.sqrt(var + eps)).reshape(x.shape)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return y * gamma.reshape(shape) + beta.reshape(shape) if gamma is not None else y


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("shape,kind", [((3, 4, 7, 5), "group"), ((2, 3, 5, 4, 3), "instance"),
                                        ((3, 4, 9), "group")])
def test_group_and_instance_norm(shape, kind):
    c = shape[1]
    layer = nn.GroupNorm(2, c, dtype=F64) if kind == "group" else \
        nn.InstanceNorm(c, affine=True, dtype=F64)
    groups = layer.num_groups
    rng = np.random.default_rng(3)
    layer.weight.data[...] = rng.standard_normal(c)
    layer.bias.data[...] = rng.standard_normal(c)
    xg = 3 + 2 * rng.standard_normal(shape)
    dyg = rng.standard_normal(shape)
    yref = groupnorm_ref(xg, groups, layer.weight.data, layer.bias.data, layer.eps)
    chk = Checks()
    for name, dist in layouts(shape):
        layer.zero_grad()
        y = layer(dt.DistArray.from_global(xg, dist))
        chk.close(y, yref, f"{name} forward", rtol=1e-10, atol=1e-10)
        dx = layer.backward(dt.DistArray.from_global(dyg, dist))
        chk.close(layer.bias.grad, dyg.sum(axis=(0, *range(2, len(shape)))), f"{name} dbeta",
                  rtol=1e-10, atol=1e-10)
        xhat = groupnorm_ref(xg, groups, None, None, layer.eps)
        chk.close(layer.weight.grad, (dyg * xhat).sum(axis=(0, *range(2, len(shape)))),
                  f"{name} dgamma", rtol=1e-10, atol=1e-10)
    fd_directional(linear_form(layer, dyg), xg, dist, dx, chk, f"{name} dx FD")
    chk.finish()


# --------------------------------------------------------------------------- Dropout
@pytest.mark.parallel(SIZES)
def test_dropout_split_draws_what_one_process_draws():
    shape = (3, 4, 9, 7)
    xg = np.random.default_rng(4).standard_normal(shape) + 5  # no zeros in x
    one = dist_of(shape)  # every rank holds the whole array: one process's draw
    chk = Checks()
    ref = nn.Dropout(0.3, seed=7)
    y1 = ref(dt.DistArray.from_global(xg, one)).local
    kept = y1 != 0
    chk.true(abs(kept.mean() - 0.7) < 0.05, f"kept fraction {kept.mean()}")
    chk.close(y1[kept], xg[kept] / 0.7, "scaling")
    ref.backward(dt.DistArray.from_global(np.ones(shape), one))
    y2 = ref(dt.DistArray.from_global(xg, one)).local
    chk.true((y2 != 0).mean() > 0.6 and ((y2 != 0) != kept).any(), "a new mask after backward")
    for name, dist in layouts(shape):
        layer = nn.Dropout(0.3, seed=7)
        y = layer(dt.DistArray.from_global(xg, dist))
        chk.equal(y, y1, f"{name} forward")
        dyg = np.arange(math.prod(shape), dtype=F64).reshape(shape)
        chk.close(layer.backward(dt.DistArray.from_global(dyg, dist)), dyg * y1 / xg,
                  f"{name} backward", rtol=1e-14, atol=0)
        chk.equal(layer(dt.DistArray.from_global(xg, dist)), y2, f"{name} second mask")
    resumed = nn.Dropout(0.3, seed=7)  # the counter travels in the state dict
    resumed.load_state_dict(ref.state_dict())
    chk.equal(resumed(dt.DistArray.from_global(xg, one)), y2, "resumed from a state dict")
    layer.eval()
    chk.equal(layer(dt.DistArray.from_global(xg, dist)), xg, "eval passes through")
    chk.finish()
    with pytest.raises(ValueError, match="p must"):
        nn.Dropout(1.0)


# --------------------------------------------------------------------------- Softmax, losses
def softmax_ref(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parallel(SIZES)
def test_softmax_and_segmentation_losses():
    shape = (3, 4, 7, 5)
    rng = np.random.default_rng(6)
    zg = 2 * rng.standard_normal(shape)
    labels = rng.integers(0, shape[1], (shape[0], *shape[2:]))
    labels[0, 0, 0] = 3
    onehot = (labels[:, None] == np.arange(shape[1])[None, :, None, None]).astype(F64)
    p = softmax_ref(zg)
    ce_ref = -np.mean(np.log((p * onehot).sum(axis=1)))
    inter = (p * onehot).sum(axis=(2, 3))
    dice_ref = 1 - np.mean((2 * inter + 1.0) / (p.sum(axis=(2, 3)) + onehot.sum(axis=(2, 3)) + 1))
    dyg = rng.standard_normal(shape)
    chk = Checks()
    sm = nn.Softmax(1)
    for name, dist in layouts(shape):
        z = dt.DistArray.from_global(zg, dist)
        y = sm(z)
        chk.close(y, p, f"{name} softmax", rtol=1e-12, atol=1e-14)
        dz = sm.backward(dt.DistArray.from_global(dyg, dist))
        chk.close(gdots([(dz, np.ones(shape))])[0], 0.0, f"{name} softmax grad sums",
                  atol=1e-10)
        tdist = dt.Distribution((shape[0], 1, *shape[2:]), dist.grid, dist.axes)
        targets = {"global (N, *S)": labels,
                   "DistArray (N, 1, *S)": dt.DistArray.from_global(labels[:, None], tdist)}
        for tname, t in targets.items():
            for loss, want in ((nn.CrossEntropyLoss(), ce_ref), (nn.DiceLoss(1.0), dice_ref)):
                got = loss(z, t)
                chk.close(got, want, f"{name} {type(loss).__name__} {tname}", rtol=1e-12)
    # gradients: finite differences on the last layout
    name, dist = layouts(shape)[-1]
    z = dt.DistArray.from_global(zg, dist)
    sm(z)
    dz = sm.backward(dt.DistArray.from_global(dyg, dist))
    fd_directional(lambda x: float(gdots([(sm(x), dyg)])[0]), zg, dist, dz, chk, "softmax FD")
    for loss in (nn.CrossEntropyLoss(), nn.DiceLoss(1.0)):
        loss(z, labels)
        g = loss.backward()
        fd_directional(lambda x, loss=loss: loss(x, labels), zg, dist, g, chk,
                       f"{type(loss).__name__} FD")
    chk.finish()
    bad = labels.copy()
    bad[-1, -1, -1] = 4
    with pytest.raises(ValueError, match="out of range"):
        nn.CrossEntropyLoss()(z, bad)
    with pytest.raises(TypeError, match="integer"):
        nn.DiceLoss()(z, labels.astype(F64))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_segmentation_losses_on_16_and_32_bit_logits(dtype):
    """float32 and float16 logits: each loss is the float64 reference's to float32 accuracy
    (float16 logits are exact in float64), the gradient in the logits' dtype matches the
    float64 loss's, and a second backward call is unaffected by writes into the first's."""
    shape = (3, 4, 7, 5)
    rng = np.random.default_rng(16)
    zg = (2 * rng.standard_normal(shape)).astype(dtype)
    labels = rng.integers(0, shape[1], (shape[0], *shape[2:]))
    z64 = zg.astype(F64)
    tol = 1e-5 if dtype == "float32" else 2e-3
    chk = Checks()
    for name, dist in layouts(shape):
        for make in (nn.CrossEntropyLoss, lambda: nn.DiceLoss(1.0)):
            ref = make()
            want = ref(dt.DistArray.from_global(z64, dist), labels)
            gwant = ref.backward().to_global()
            loss = make()
            got = loss(dt.DistArray.from_global(zg, dist), labels)
            what = f"{name} {type(loss).__name__}"
            chk.close(got, want, f"{what} loss", rtol=1e-6)
            g = loss.backward()
            chk.true(g.dtype == np.dtype(dtype) and g.dist == dist, f"{what} dtype {g.dtype}")
            atol = tol * np.abs(gwant).max()
            chk.close(g.to_global().astype(F64), gwant, f"{what} grad", rtol=tol, atol=atol)
            g.local[...] = 0
            chk.close(loss.backward(scale=2.0).to_global().astype(F64), 2 * gwant,
                      f"{what} again", rtol=tol, atol=2 * atol)
    chk.finish()


# --------------------------------------------------------------------------- Concat, Skip
@pytest.mark.parallel(SIZES)
def test_skip_concatenates_across_distributions():
    """Skip(pool -> up-conv -> convs): the branch's output is cut where the pool and the
    up-convolution put it, the input elsewhere (odd sizes), so Concat redistributes.

    The reference is the same layers on one process's whole array (each is
    checked against NumPy on its own) and NumPy's concatenate.
    """
    shape = (2, 2, 9, 7)
    up = nn.ConvTranspose2d(2, 3, 2, stride=2, output_padding=0, dtype=F64, seed=1)
    crop = nn.Conv2d(3, 3, (2, 1), dtype=F64, seed=2)  # (2*5 - 1 = 9, 2*4 = 8 -> 7 below)
    branch = nn.Sequential(nn.AvgPool2d(2, padding=(1, 1)), up, crop,
                           nn.Conv2d(3, 3, (1, 2), dtype=F64, seed=4))
    block = nn.Skip(branch, post=nn.Conv2d(5, 2, 3, padding=1, dtype=F64, seed=3))
    rng = np.random.default_rng(8)
    xg = rng.standard_normal(shape)
    chk = Checks()
    one = dist_of(shape)
    a_ref = branch(dt.DistArray.from_global(xg, one)).local
    chk.true(a_ref.shape == (2, 3, 9, 7), f"branch shape {a_ref.shape}")
    cat_ref = np.concatenate([a_ref, xg], axis=1)
    y_ref = block.post(dt.DistArray.from_global(cat_ref, dt.Distribution(
        cat_ref.shape, one.grid, [None] * 4))).local
    chk.true(block.output_shape(shape) == y_ref.shape, "output_shape")
    dyg = rng.standard_normal(y_ref.shape)
    for name, dist in layouts(shape):
        y = block(dt.DistArray.from_global(xg, dist))
        chk.close(y, y_ref, f"{name} forward", rtol=1e-11, atol=1e-11)
        block.zero_grad()
        dx = block.backward(dt.DistArray.from_global(dyg, y.dist))
        chk.true(dx.dist == dist, f"{name}: the gradient in the input's distribution")
    fd_directional(linear_form(block, dyg), xg, dist, dx, chk, f"{name} FD", rtol=1e-5)
    chk.finish()
    with pytest.raises(ValueError, match="channels"):
        nn.Concat().output_shape((1, 2, 4, 4), (1, 2, 4, 3))
    with pytest.raises(ValueError, match="dim=1"):
        nn.Concat(dim=2)
