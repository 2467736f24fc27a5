"""Model definitions: ResNet parameter counts and shapes, the mesh-tangling FCN, DepthToSpace.

Serial tests (no marker) build the models and check counts and shapes on
one process. MPI tests run the same model with the height (or other
dimensions) split over the world and compare with the one-rank run of an
identically seeded model on ``COMM_SELF``; DepthToSpace is compared with a
NumPy reference written as strided slice assignments.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor.testing import assert_allclose, assert_equal, collective_assert
from disttensor_nn.models import DepthToSpace, mesh_fcn, resnet, resnet18, resnet50

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD
TINY = (2, 4, 4, 6, 6, 4)  # mesh FCN stage widths small enough for tests
# (batch, (H, W)): two samples at 64x64 so that the 1x1 last stage still has batch statistics
SPLIT_CASES = [(2, (64, 64)), (1, (128, 128)), (1, (128, 256))]


def assert_close(actual, desired, what):
    """Collective comparison relative to the largest entry of ``desired``.

    Batch norm over few values (N=2 samples of 2x2 positions in the last
    stages) amplifies the rounding of differently ordered sums, so backward
    results agree to ~1e-11 of their scale, not elementwise.
    """
    scale = float(np.abs(desired).max()) if np.size(desired) else 0.0
    assert_allclose(actual, desired, rtol=1e-9, atol=1e-9 * scale, err_msg=what)


def assert_grads_close(model, grads_ref):
    """Every parameter gradient within 1e-9 of its largest entry, in one collective check."""
    bad = []
    params = list(model.parameters())
    for i, (p, g) in enumerate(zip(params, grads_ref, strict=True)):
        err = float(np.abs(p.grad - g).max()) if g.size else 0.0
        scale = float(np.abs(g).max()) if g.size else 0.0
        if not err <= 1e-9 * scale:
            bad.append(f"parameter {i} {p.shape}: max error {err:.3g}, scale {scale:.3g}")
    collective_assert(not bad, "; ".join(bad))


@cache
def grid(shape: tuple[int, ...]) -> dt.ProcessGrid:
    return dt.ProcessGrid(shape)


@cache
def self_grid() -> dt.ProcessGrid:
    return dt.ProcessGrid((1,), MPI.COMM_SELF)


def count(model: nn.Layer) -> int:
    return sum(p.data.size for p in model.parameters())


def whole(x: np.ndarray, g: dt.ProcessGrid | None = None) -> dt.DistArray:
    g = self_grid() if g is None else g
    return dt.DistArray.from_global(x, dt.Distribution(x.shape, g, (None,) * x.ndim))


def walk(layer: nn.Layer):
    yield layer
    for child in layer.children():
        yield from walk(child)


# --------------------------------------------------------------------------- ResNet (serial)
def test_resnet18_parameter_count_matches_torchvision():
    # ResNet-50's 25,557,032 is checked below; 34/101/152 (21,797,672, 44,549,160,
    # 60,192,808) were checked once by hand and are left out to keep the suite fast
    assert count(resnet18()) == 11_689_512


def test_resnet50_structure_and_forward_shape():
    model = resnet50()
    assert count(model) == 25_557_032
    layers = list(walk(model))
    convs = [m for m in layers if isinstance(m, nn.Conv2d)]
    assert len(convs) == 53  # 1 stem + 16 blocks x 3 + 4 downsample shortcuts
    assert all(c.bias is None for c in convs)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in layers) == 53
    assert sum(isinstance(m, nn.Residual) for m in layers) == 16
    stem, pool = model[0], model[3]
    assert (stem.spec.kernel, stem.spec.stride, stem.spec.padding) == \
        ((7, 7), (2, 2), ((3, 3), (3, 3)))
    assert isinstance(pool, nn.MaxPool2d)
    assert (pool.spec.kernel, pool.spec.stride, pool.spec.padding) == \
        ((3, 3), (2, 2), ((1, 1), (1, 1)))
    # ImageNet shapes, metadata only: 224 -> 112 (conv1) -> 56 (maxpool)
    d = dt.Distribution((1, 3, 224, 224), self_grid(), (None, None, 0, None))
    assert pool.output_distribution(stem.output_distribution(d)).global_shape == (1, 64, 56, 56)
    # v1.5: the stride of a downsampling bottleneck sits on its 3x3 conv
    first_of_stage2 = [m for m in model if isinstance(m, nn.Residual)][3]
    strides = [c.spec.stride for c in first_of_stage2.branch if isinstance(c, nn.Conv2d)]
    assert strides == [(1, 1), (2, 2), (1, 1)]
    # every layer seeded differently: no two 3x3 convs of equal shape share weights
    same = [c.weight.data for c in convs if c.weight.shape == (64, 64, 3, 3)]
    assert len(same) == 3 and not np.array_equal(same[0], same[1])
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    y = model(whole(x))
    assert y.shape == (1, 1000) and y.dtype == np.float32
    assert np.isfinite(y.local).all()


def test_resnet_is_deterministic_in_its_seed():
    a, b, c = (resnet18(width=8, num_classes=10, seed=s) for s in (3, 3, 4))
    pa, pb, pc = (list(m.parameters()) for m in (a, b, c))
    assert all(np.array_equal(p.data, q.data) for p, q in zip(pa, pb))
    assert not np.array_equal(pa[0].data, pc[0].data)
    with pytest.raises(ValueError, match="depth"):
        resnet(20)


# --------------------------------------------------------------------------- mesh FCN (serial)
def test_mesh_fcn_reference_stack():
    model = mesh_fcn()
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    assert len(convs) == 6 * 3 + 1
    assert [c.out_channels for c in convs[:-1]] == [w for w in (128, 256, 256, 384, 384, 128)
                                                    for _ in range(3)]
    assert (convs[0].in_channels, convs[0].spec.kernel, convs[0].spec.stride) == \
        (18, (5, 5), (2, 2))
    assert [c.spec.stride[0] for c in convs[:-1]] == [2, 1, 1] * 6
    assert all(c.spec.kernel == (3, 3) for c in convs[1:-1])
    assert (convs[-1].out_channels, convs[-1].spec.kernel) == (4096, (1, 1))
    kinds = [type(m).__name__ for m in model][:6]
    assert kinds == ["Conv2d", "ReLU", "BatchNorm2d"] * 2
    assert [type(m) for m in model][-2:] == [DepthToSpace, nn.Sigmoid]
    # shapes only (no data): 64 x 18 x 2048 x 2048 -> 64 x 128 x 32 x 32 -> 64 x 1 x 2048 x 2048
    d = dt.Distribution((64, 18, 2048, 2048), self_grid(), (None, None, 0, None))
    for m in model:
        if hasattr(m, "output_distribution"):
            d = m.output_distribution(d)
            if m is convs[-2]:
                assert d.global_shape == (64, 128, 32, 32)
    assert d.global_shape == (64, 1, 2048, 2048)
    # DepthToSpace scales the height blocks of 16 ranks: 2 rows each -> 128 rows each
    d = DepthToSpace(64).output_distribution(
        dt.Distribution((64, 4096, 32, 32), (16,), (None, None, 0, None)))
    assert d.global_shape == (64, 1, 2048, 2048)
    assert d.boundaries[2] == tuple(range(0, 2049, 128))


@pytest.mark.parametrize("n,hw", SPLIT_CASES)
def test_mesh_fcn_output_shape(n, hw):
    model = mesh_fcn(widths=TINY, dtype=np.float64)
    x = np.random.default_rng(1).standard_normal((n, 18, *hw))
    y = model(whole(x))
    assert y.shape == (n, 1, *hw) and y.dtype == np.float64
    assert ((y.local > 0) & (y.local < 1)).all()
    dx = model.backward(dt.DistArray(np.ones(y.local_shape), y.dist))
    assert dx.shape == x.shape


def test_mesh_fcn_options():
    model = mesh_fcn(in_channels=3, widths=(4, 4), convs_per_stage=2, block=(2, 8),
                     first_kernel=3, bias=False, dtype=np.float64)
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    assert len(convs) == 5 and convs[-1].out_channels == 16
    y = model(whole(np.ones((2, 3, 12, 8))))
    assert y.shape == (2, 1, 3 * 2, 2 * 8)  # 12 x 8 -> 3 x 2 after two stride-2 stages


# --------------------------------------------------------------------------- distributed runs
def serial_and_split(make, x, dist):
    """Forward + backward of two identically seeded models: one rank vs ``dist``.

    Rank 0 runs the one-rank model on ``COMM_SELF`` and broadcasts its output,
    input gradient and parameter gradients (one serial run, not one per rank).
    """
    if comm.rank == 0:
        ref = make()
        y_ref = ref(whole(x)).local
        dy = np.random.default_rng(7).standard_normal(y_ref.shape)
        dx_ref = ref.backward(whole(dy)).local
        ref_out = (y_ref, dy, dx_ref, [p.grad for p in ref.parameters()])
    else:
        ref_out = None
    y_ref, dy, dx_ref, grads_ref = comm.bcast(ref_out, root=0)
    model = make()
    y = model(dt.DistArray.from_global(x, dist))
    dx = model.backward(dt.DistArray.from_global(dy, y.dist))
    return (y_ref, dx_ref, grads_ref), (y, dx, model)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("n,hw", SPLIT_CASES)
def test_mesh_fcn_height_split_matches_one_rank(n, hw):
    p = comm.Get_size()
    x = np.random.default_rng(2).standard_normal((n, 18, *hw))
    dist = dt.Distribution(x.shape, grid((p,)), (None, None, 0, None))
    (y_ref, dx_ref, grads_ref), (y, dx, model) = serial_and_split(
        lambda: mesh_fcn(widths=TINY, dtype=np.float64, seed=5), x, dist)
    collective_assert(y.shape == (n, 1, *hw), f"output shape {y.shape}")
    # the output stays split over the height, boundaries scaled by the block
    collective_assert(y.dist.nblocks == (1, 1, p, 1), f"output {y.dist}")
    assert_close(y, y_ref, "forward")
    collective_assert(dx.dist == dist, f"dx in {dx.dist}")
    assert_close(dx, dx_ref, "dx")
    assert_grads_close(model, grads_ref)


@pytest.mark.parallel(SIZES)
def test_mesh_fcn_hybrid_split_and_mse_step_match_one_rank():
    # samples x height on a 2-D grid where the world size allows; one SGD step
    p = comm.Get_size()
    gshape = {1: (1, 1), 2: (2, 1), 3: (1, 3), 4: (2, 2)}[p]
    x = np.random.default_rng(3).standard_normal((2, 18, 64, 128))
    target = (np.random.default_rng(4).random((2, 1, 64, 128)) > 0.5).astype(np.float64)
    dist = dt.Distribution(x.shape, grid(gshape), (0, None, 1, None))

    def train(xd):
        model = mesh_fcn(widths=TINY, dtype=np.float64, seed=9)
        opt = nn.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loss = nn.MSELoss()
        losses = []
        for _ in range(2):
            model.zero_grad()
            losses.append(loss(model(xd), target))
            model.backward(loss.backward())
            opt.step()
        return np.array(losses), model(xd).to_global()

    loss_ref, y_ref = comm.bcast(train(whole(x)) if comm.rank == 0 else None, root=0)
    loss_split, y_split = train(dt.DistArray.from_global(x, dist))
    assert_close(loss_split, loss_ref, "losses")
    assert_close(y_split, y_ref, "output after two SGD steps")


@pytest.mark.parallel(SIZES)
def test_small_resnet_height_split_matches_one_rank():
    p = comm.Get_size()
    x = np.random.default_rng(5).standard_normal((2, 3, 32, 32))
    dist = dt.Distribution(x.shape, grid((p,)), (None, None, 0, None))
    (y_ref, dx_ref, grads_ref), (y, dx, model) = serial_and_split(
        lambda: resnet(18, num_classes=10, width=4, dtype=np.float64, seed=1), x, dist)
    collective_assert(y.shape == (2, 10), f"logits {y.shape}")
    assert_close(y, y_ref, "logits")
    assert_close(dx, dx_ref, "dx")
    assert_grads_close(model, grads_ref)


# --------------------------------------------------------------------------- DepthToSpace
def d2s_ref(x: np.ndarray, b: tuple[int, ...]) -> np.ndarray:
    """y[n, c, s*b + i] = x[n, c*prod(b) + flat(i), s], one block offset i at a time."""
    n, cb, *s = x.shape
    k = math.prod(b)
    y = np.empty((n, cb // k, *(a * f for a, f in zip(s, b))), x.dtype)
    for f, offs in enumerate(itertools.product(*(range(e) for e in b))):
        y[(slice(None), slice(None), *(slice(o, None, e) for o, e in zip(offs, b)))] = \
            x[:, f::k]
    return y


def d2s_ref_backward(dy: np.ndarray, b: tuple[int, ...]) -> np.ndarray:
    n, c, *s = dy.shape
    k = math.prod(b)
    dx = np.empty((n, c * k, *(a // f for a, f in zip(s, b))), dy.dtype)
    for f, offs in enumerate(itertools.product(*(range(e) for e in b))):
        dx[:, f::k] = dy[(slice(None), slice(None), *(slice(o, None, e) for o, e in zip(offs, b)))]
    return dx


def test_d2s_reference_matches_pixel_shuffle_formula():
    # PyTorch's pixel_shuffle written out: (N, C, b1, b2, H, W) -> (N, C, H, b1, W, b2)
    x = np.arange(2 * 12 * 3 * 5.0).reshape(2, 12, 3, 5)
    want = x.reshape(2, 2, 2, 3, 3, 5).transpose(0, 1, 4, 2, 5, 3).reshape(2, 2, 6, 15)
    np.testing.assert_array_equal(d2s_ref(x, (2, 3)), want)
    np.testing.assert_array_equal(d2s_ref_backward(want, (2, 3)), x)


def d2s_layouts(shape):
    p = comm.Get_size()
    nd = len(shape) - 2
    none = [None] * len(shape)

    def ax(**where):
        a = list(none)
        for d, g in where.items():
            a[int(d[1:])] = g
        return a

    out = [("sample", dt.Distribution(shape, grid((p,)), ax(d0=0)))]
    for d in range(2, 2 + nd):
        out.append((f"dim{d}", dt.Distribution(shape, grid((p,)), ax(**{f"d{d}": 0}))))
    g2 = {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[p]
    out.append(("NxS0", dt.Distribution(shape, grid(g2), ax(d0=0, d2=1))))
    if nd >= 2:
        out.append(("S0xS1", dt.Distribution(shape, grid(g2), ax(d2=0, d3=1))))
    n2 = shape[2]
    cuts = {1: [], 2: [0], 3: [0, n2 - 1], 4: [1, 1, n2]}[p]  # empty and uneven blocks
    splits = [None] * len(shape)
    splits[2] = cuts
    out.append(("uneven", dt.Distribution(shape, grid((p,)), ax(d2=0), splits)))
    return out


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("shape,block", [((3, 12, 5, 7), 2), ((2, 6, 5, 4), (3, 2)),
                                         ((2, 8, 4, 3, 5), (2, 1, 4)), ((2, 5, 3), (5,))],
                         ids=["2d-int", "2d-pair", "3d", "1d"])
def test_depth_to_space_matches_reference(shape, block):
    layer = DepthToSpace(block)
    nd = len(shape) - 2
    b = (block,) * nd if isinstance(block, int) else block
    rng = np.random.default_rng(8)
    x = rng.standard_normal(shape)
    want = d2s_ref(x, b)
    dy = rng.standard_normal(want.shape)
    dx_want = d2s_ref_backward(dy, b)
    for name, dist in d2s_layouts(shape):
        msg = f"{name} {dist}"
        y = layer(dt.DistArray.from_global(x, dist))
        # no communication: the output blocks are the input blocks scaled by b
        scale = (1, 1, *b)
        collective_assert(
            y.dist.boundaries[0] == dist.boundaries[0] and all(
                y.dist.boundaries[d] == tuple(c * scale[d] for c in dist.boundaries[d])
                for d in range(2, len(shape))) and y.dist.axes == dist.axes,
            f"{msg}: output {y.dist}")
        assert_equal(y, want)
        dx = layer.backward(dt.DistArray.from_global(dy, y.dist))
        collective_assert(dx.dist == dist, f"{msg}: dx in {dx.dist}")
        assert_equal(dx, dx_want)
        # a gradient arriving in another distribution is moved to the output's first
        other = dt.Distribution(want.shape, grid((comm.Get_size(),)),
                                (0,) + (None,) * (len(shape) - 1))
        assert_equal(layer.backward(dt.DistArray.from_global(dy, other)), dx_want)


def test_depth_to_space_rejects_bad_inputs():
    with pytest.raises(ValueError, match="divisible"):
        DepthToSpace(2)(whole(np.zeros((1, 6, 2, 2))))
    with pytest.raises(ValueError, match="spatial"):
        DepthToSpace((2, 2, 2))(whole(np.zeros((1, 8, 2, 2))))
    with pytest.raises(ValueError, match=">= 1"):
        DepthToSpace((2, 0))
    y = DepthToSpace([np.int64(2), 3])(whole(np.zeros((1, 12, 2, 2))))
    assert y.shape == (1, 2, 4, 6)
