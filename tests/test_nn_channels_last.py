"""Channels-last blocks through the layers, against independent references.

A block lies channels-last when its ``(N, C, H, W)`` elements lie in memory as
``(N, H, W, C)`` (``disttensor.backend.is_channels_last``). The torch kernels'
layers that say they take such blocks (``Layer.takes_channels_last``) must give
the float64 reference's output and gradients on every layout of
``nn_reference.layouts`` and keep the layout where they take it; every other
layer must be handed C-contiguous copies by the calling protocol. Whole networks
trained on channels-last input must follow the same losses and weights as on
C-order input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from nn_reference import Checks, bn_ref, conv_ref, conv_ref_backward, layouts, pad_pairs, pool_ref

import disttensor as dt
import disttensor_nn as nn
from disttensor.backend import dense_order, empty_in_order, is_channels_last
from disttensor.blockcache import BlockCache, block_cache
from disttensor_nn import SGD, MSELoss, SoftmaxCrossEntropy, kernels
from disttensor_nn.kernels import torch_kernels
from disttensor_nn.layout import MEMORY_FORMATS, memory_format_of, to_memory_format
from disttensor_nn.models import mesh_fcn, resnet
from disttensor_nn.plan import make_plan
from disttensor_nn.plan.timer import KernelTimer

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD
needs_torch = pytest.mark.skipif(not torch_kernels.available(), reason="needs PyTorch")


def _cl(a: np.ndarray) -> np.ndarray:
    """A channels-last copy of a 4-D or 5-D array."""
    out = empty_in_order(np, a.shape, a.dtype, (0, *range(2, a.ndim), 1))
    out[...] = a
    return out


def _reference_is_channels_last(a: np.ndarray) -> bool:
    """Channels-last by definition: the strides of a dense ``(N, *S, C)`` array, axes of
    one element ignored, and not C-contiguous."""
    if a.ndim not in (4, 5) or a.flags.c_contiguous:
        return False
    order = (0, *range(2, a.ndim), 1)
    expect = a.itemsize
    for d in reversed(order):
        if a.shape[d] > 1 and a.strides[d] != expect:
            return False
        expect *= a.shape[d]
    return True


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_is_channels_last_reads_the_strides(data):
    """``is_channels_last`` on dense arrays in random axis orders and on strided slices of
    them agrees with the definition."""
    nd = data.draw(st.integers(2, 6))
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=nd, max_size=nd)))
    order = tuple(data.draw(st.permutations(range(nd))))
    a = empty_in_order(np, shape, np.float32, order)
    steps = tuple(data.draw(st.lists(st.integers(1, 2), min_size=nd, max_size=nd)))
    for b in (a, a[tuple(slice(None, None, s) for s in steps)]):
        assert is_channels_last(b) == _reference_is_channels_last(b), (b.shape, b.strides)


def test_to_memory_format_copies_only_where_the_layout_differs():
    """Values kept; the same array where the block already lies so; C order back; bad
    formats and dimensions refused."""
    grid = dt.ProcessGrid((1,), MPI.COMM_SELF)
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    a = dt.DistArray.from_local(x.copy(), dt.Distribution(x.shape, grid, (0, None, None, None)))
    b = to_memory_format(a, "channels_last")
    assert memory_format_of(a) == "contiguous" and memory_format_of(b) == "channels_last"
    assert dense_order(b.local) == (0, 2, 3, 1) and np.array_equal(b.local, x)
    assert to_memory_format(b, "channels_last") is b
    c = to_memory_format(b, "contiguous")
    assert c.local.flags.c_contiguous and np.array_equal(c.local, x)
    for shape in [(2, 1, 4, 5), (2, 3, 1, 1)]:  # one channel or one pixel: both orders alike
        one = dt.DistArray.from_local(np.ones(shape, np.float32),
                                      dt.Distribution(shape, grid, (0, None, None, None)))
        assert to_memory_format(one, "channels_last") is one
    assert to_memory_format(a, "contiguous") is a
    assert MEMORY_FORMATS == ("contiguous", "channels_last")
    with pytest.raises(ValueError, match="memory_format must be one of"):
        to_memory_format(a, "nhwc")
    v = dt.DistArray.from_local(x[0].copy(), dt.Distribution(x.shape[1:], grid))
    with pytest.raises(ValueError, match="channels_last needs"):
        to_memory_format(v, "channels_last")


class _Recorder(nn.Layer):
    """A layer that does not take channels-last blocks: it records the layouts it is given."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def forward(self, x):
        self.seen.append(("x", x.local.flags.c_contiguous))
        return dt.DistArray(_cl(x.local * 2), x.dist)  # hands back a channels-last block

    def backward(self, dy):
        self.seen.append(("dy", dy.local.flags.c_contiguous))
        return dt.DistArray(dy.local * 2, dy.dist)


@pytest.mark.parallel([1, 2, 3])
def test_a_layer_that_does_not_take_channels_last_blocks_gets_c_order_copies():
    """The calling protocol hands a layer that does not say it takes channels-last blocks
    (the default) C-contiguous copies of its input and of its output gradient, with the
    same values, and puts its output and input gradient back on channels-last blocks (as
    the layers around it were planned to get them); a C-order input stays C order
    throughout; a container passes the blocks on as they are."""
    shape = (5, 3, 4, 6)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape)
    check = Checks()
    for lname, dist in layouts(shape):
        rec = _Recorder()
        model = nn.Sequential(rec)
        assert model.takes_channels_last(dist) and not rec.takes_channels_last(dist)
        xa = dt.DistArray.from_global(x, dist)
        y = model(to_memory_format(xa, "channels_last"))
        check.close(y, 2 * x, f"{lname}: forward")
        dy = to_memory_format(dt.DistArray.from_global(x, dist), "channels_last")
        dx = model.call_backward(dy)
        check.close(dx, 2 * x, f"{lname}: backward")
        check.true(all(flag for _, flag in rec.seen), f"{lname}: {rec.seen}")
        if min(xa.local.shape[1:]) > 1:
            check.true(is_channels_last(y.local) and is_channels_last(dx.local),
                       f"{lname}: results given back in {y.local.strides}, "
                       f"{dx.local.strides}")
        model(xa)  # C order in: the results as the layer gives them (no copies)
        dx = model.call_backward(dt.DistArray.from_global(x, dist))
        check.true(dx.local.flags.c_contiguous, f"{lname}: C order given back as "
                   f"{dx.local.strides}")
    check.finish()


def _layers(dtype=np.float32):
    """(name, layer, reference) for each layer kind that takes channels-last blocks."""
    c = 5
    rng = np.random.default_rng(21)
    conv = nn.Conv2d(c, 4, kernel_size=3, padding=1, dtype=dtype)
    conv_s = nn.Conv2d(c, 6, kernel_size=(5, 3), stride=2, padding=(2, 1), bias=False,
                       dtype=dtype)
    bn = nn.BatchNorm2d(c, dtype=dtype)
    bn.weight.data[...] = rng.uniform(0.5, 1.5, c)
    bn.bias.data[...] = rng.uniform(-1, 1, c)

    def conv_reference(layer, kw):
        w = layer.weight.data.astype(np.float64)
        b = None if layer.bias is None else layer.bias.data.astype(np.float64)
        args = dict(stride=kw.get("stride", 1),
                    pads=pad_pairs(kw["padding"], kw["kernel_size"], 1, 2), dilation=1,
                    groups=1, mode="zeros")

        def ref(x, dy_of):
            y = conv_ref(x, w, b, **args)
            dy = dy_of(y.shape)
            dx, dw, db = conv_ref_backward(x, w, dy, **args)
            return y, dy, dx, {"weight": dw, "bias": db}
        return ref

    def bn_reference(x, dy_of):
        y, back, _, _ = bn_ref(x, bn.weight.data.astype(np.float64),
                               bn.bias.data.astype(np.float64), bn.eps)
        dy = dy_of(y.shape)
        dx, dg, db = back(dy)
        return y, dy, dx, {"weight": dg, "bias": db}

    def pool_reference(x, dy_of):
        y, dx_of = pool_ref(x, 3, 2, [(1, 1), (1, 1)], 1, "max")
        dy = dy_of(y.shape)
        return y, dy, dx_of(dy), {}

    def relu_reference(x, dy_of):
        dy = dy_of(x.shape)
        return np.maximum(x, 0), dy, dy * (x > 0), {}

    def gap_reference(x, dy_of):
        y = x.mean(axis=(2, 3))
        dy = dy_of(y.shape)
        return y, dy, np.broadcast_to(dy[:, :, None, None] / 20, x.shape), {}

    return [
        ("conv k3 p1", conv, conv_reference(conv, {"kernel_size": 3, "padding": 1})),
        ("conv k5x3 s2", conv_s, conv_reference(conv_s, {"kernel_size": (5, 3), "stride": 2,
                                                         "padding": (2, 1)})),
        ("batch norm", bn, bn_reference),
        ("max pool k3 s2 p1", nn.MaxPool2d(3, 2, padding=1), pool_reference),
        ("relu", nn.ReLU(), relu_reference),
        ("relu (NumPy)", nn.ReLU(), relu_reference),
        ("global average pool", nn.GlobalAvgPool(), gap_reference),
    ]


@needs_torch
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("chunk,dy_format", [(None, "channels_last"), (7, "channels_last"),
                                             (None, "contiguous")])
def test_torch_layers_on_channels_last_blocks_match_reference(chunk, dy_format, monkeypatch):
    """Each layer that takes channels-last blocks (convolutions with the kernel's padding
    and a stride, batch norm, max pooling, ReLU, global pooling; the torch kernels), given
    a channels-last input and output gradient on every layout: output and gradients within
    float32 rounding of the float64 reference; its output and input gradient lie
    channels-last, whether it takes such blocks or (a split height or width: a halo) ran
    on a C-contiguous copy and gave its results back so. Also with the batch norms'
    channels-last sums taken in pieces of a few rows (``torch_kernels.SUMS_CHUNK``), and
    with a C-order output gradient (the values alike, the layout free)."""
    if chunk is not None:
        monkeypatch.setattr(torch_kernels, "SUMS_CHUNK", chunk)
    shape = (5, 5, 4, 5)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape)
    check = Checks()
    with block_cache(cache=BlockCache(min_bytes=1)):  # the kernels' out= blocks too
        for name, layer, ref in _layers():
            layer.kernel_backend = "numpy" if "NumPy" in name else "torch"
            want, dy, dx_want, grads_want = ref(x, lambda s: rng.standard_normal(s))
            scale = max(float(np.abs(want).max()), 1.0)
            tol = {"rtol": 2e-4, "atol": 2e-4 * scale}
            for lname, dist in layouts(shape):
                msg = f"{name} on {lname}"
                xa = to_memory_format(dt.DistArray.from_global(x.astype(np.float32), dist),
                                      "channels_last")
                takes = layer.takes_channels_last(dist)
                layer.zero_grad()
                y = layer(xa)
                check.close(y, want, msg, **tol)
                g = dt.DistArray.from_global(dy.astype(np.float32), y.dist)
                if y.ndim == 4:
                    g = to_memory_format(g, dy_format)
                dx = layer.call_backward(g)
                check.close(dx, dx_want, f"{msg}: dx", rtol=2e-4,
                            atol=2e-4 * max(float(np.abs(dx_want).max()), 1.0))
                for pname, gw in grads_want.items():
                    p = getattr(layer, pname)
                    if p is not None and gw is not None:
                        check.close(p.grad, gw, f"{msg}: d{pname}", rtol=2e-4,
                                    atol=2e-4 * max(float(np.abs(gw).max()), 1.0))
                big = min(xa.local.shape[1:]) > 1 and xa.local.shape[0] > 0
                # taken or not (then run on a C-order copy), the results lie channels-last
                if big and y.ndim == 4 and min(y.local.shape[1:]) > 1:
                    check.true(is_channels_last(y.local),
                               f"{msg}: output layout {y.local.strides} (takes: {takes})")
                if big and dy_format == "channels_last":
                    check.true(is_channels_last(dx.local),
                               f"{msg}: input gradient layout {dx.local.strides} (takes: "
                               f"{takes})")
    check.finish()


@needs_torch
def test_torch_layers_say_where_they_take_channels_last_blocks():
    """Where each layer takes channels-last blocks: the torch kernels; 2-D windows with no
    spatial split and no channel or filter split; not a dilated average pool."""
    grid = dt.ProcessGrid((1, 1), MPI.COMM_SELF)
    shape = (4, 6, 8, 8)
    plain = dt.Distribution(shape, grid, (0, None, None, None))
    conv = nn.Conv2d(6, 6, 3, padding=1)
    assert not conv.takes_channels_last(plain)  # the NumPy kernels
    for layer in (conv, nn.BatchNorm2d(6), nn.ReLU(), nn.Sigmoid(), nn.MaxPool2d(2)):
        layer.kernel_backend = "torch"
        assert layer.takes_channels_last(plain), layer
    assert not nn.AvgPool2d(2, dilation=2).takes_channels_last(plain)
    conv3 = nn.Conv3d(6, 6, 3, padding=1)
    conv3.kernel_backend = "torch"
    assert not conv3.takes_channels_last(dt.Distribution(
        (4, 6, 4, 4, 4), dt.ProcessGrid((1,), MPI.COMM_SELF), (0, None, None, None, None)))
    assert nn.GlobalAvgPool().takes_channels_last(plain)
    assert not nn.Skip(nn.ReLU()).takes_channels_last(plain)
    assert nn.Residual(nn.ReLU()).takes_channels_last(plain)


@needs_torch
@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("model_name", ["resnet", "mesh"])
def test_torch_networks_train_alike_on_channels_last_input(model_name):
    """A small ResNet (residual sums, pooling, global pooling, a linear head) and the mesh
    network (a depth-to-space head), the samples split over the ranks, in float32 on C-order
    and on channels-last input and in float64 on C-order input: after one forward and
    backward pass every parameter's gradient on channels-last input is as close to the
    float64 one as on C-order input (within four times its distance, in norm); trained
    three steps with SGD, the losses follow the C-order run's."""
    size = comm.Get_size()
    batch = 2 * size
    if model_name == "resnet":
        sample, loss_cls = (3, 48, 48), SoftmaxCrossEntropy

        def build(dtype):
            return resnet(18, num_classes=5, dtype=dtype)
    else:
        sample, loss_cls = (18, 32, 32), MSELoss

        def build(dtype):
            return mesh_fcn(widths=(8, 8, 12, 12, 8, 8), convs_per_stage=1, dtype=dtype)
    x = np.random.default_rng(8).standard_normal((batch, *sample))
    grid = dt.ProcessGrid((size,), comm)
    dist = dt.Distribution(x.shape, grid, (0, None, None, None))
    runs = {}
    for fmt, dtype in (("contiguous", np.float64), ("contiguous", np.float32),
                       ("channels_last", np.float32)):
        model = build(dtype)
        kernels.use_kernels(model, "torch")
        out_shape = model.output_shape(x.shape)
        r = np.random.default_rng(9)
        t = r.integers(0, out_shape[1], batch) if model_name == "resnet" else \
            r.random(out_shape).astype(dtype)
        loss_fn = loss_cls()
        opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
        losses, grads = [], None
        with block_cache(cache=BlockCache()):
            for _ in range(3):
                opt.zero_grad()
                xa = to_memory_format(dt.DistArray.from_global(x.astype(dtype), dist), fmt)
                losses.append(float(loss_fn(model(xa), t)))
                model.call_backward(loss_fn.backward())
                if grads is None:
                    grads = [np.array(p.grad, np.float64) for p in model.parameters()]
                opt.step()
        runs[fmt, np.dtype(dtype).name] = np.array(losses), grads
    (_, g64), (lc, gc), (lcl, gcl) = runs.values()
    check = Checks()
    check.close(lcl, lc, "losses", rtol=1e-3, atol=1e-6)
    floor = 1e-6 * max(float(np.linalg.norm(w)) for w in g64)  # gradients that are 0 but
    # for rounding (a bias before a batch norm) have no relative error to speak of
    for i, (w64, wc, wcl) in enumerate(zip(g64, gc, gcl)):
        scale = float(np.linalg.norm(w64))
        err_c, err_cl = (float(np.linalg.norm(w - w64)) for w in (wc, wcl))
        check.true(err_cl <= 4 * err_c + floor,
                   f"parameter {i}'s gradient: channels-last {err_cl:.3g} from float64, "
                   f"C order {err_c:.3g} (norm {scale:.3g})")
    check.finish()


def test_make_plan_names_the_memory_format_and_refuses_others():
    """``make_plan(memory_format=...)``: the plan names the format it was made in; ``"auto"``
    keeps C order where no kernel is timed (a published profile); another name is
    refused before any work."""
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    shape = (4, 2, 16, 16)
    for fmt, want in (("contiguous", "contiguous"), ("channels_last", "channels_last"),
                      ("auto", "contiguous")):
        plan, _ = make_plan(net, shape, 1, "v100-nvlink-edr", memory_format=fmt)
        assert plan.memory_format == want, (fmt, plan.memory_format)
        assert ("blocks in channels_last memory format" in plan.table()) == \
            (want == "channels_last")
    with pytest.raises(ValueError, match="memory_format must be one of"):
        make_plan(net, shape, 1, "v100-nvlink-edr", memory_format="nhwc")


def test_a_channels_last_plan_counts_the_copies_around_a_layer_that_takes_none():
    """Planned on channels-last blocks, a layer that takes none needs the calling
    protocol's copies (its input in C order, its output put back) besides its own
    transient memory; one that takes them, and any layer in a C-order plan, does not."""
    from disttensor_nn.plan import CostModel, load_profile
    from disttensor_nn.plan.timer import QueryRecorder

    class Recorder(QueryRecorder):
        def __init__(self, memory_format):
            super().__init__()
            self.memory_format = memory_format

    profile = load_profile("v100-nvlink-edr")
    shape, cand = (4, 8, 32, 32), (2, 1, 1)  # two ranks over the samples
    halves = []
    for backend in ("numpy", "torch"):
        conv = kernels.with_backend(nn.Conv2d(8, 6, 3, padding=1), backend)
        plain, laid = (CostModel(profile, 2, Recorder(f)).layer(conv, shape, cand)
                       for f in MEMORY_FORMATS)
        halves.append(laid.transient - plain.transient)
    block_in, block_out = 2 * 8 * 32 * 32 * 4, 2 * 6 * 32 * 32 * 4
    if torch_kernels.available():  # the torch kernels pad this convolution: it takes them
        assert halves == [block_in + block_out, 0], halves
    else:
        assert halves[0] == block_in + block_out, halves


def test_the_kernel_timer_keys_and_lays_out_by_memory_format(tmp_path):
    """A channels-last timer keeps its 4-D and 5-D times apart from C order's (the key
    says so), times a twin on channels-last blocks, and refuses other formats."""
    relu = nn.ReLU()
    timers = {f: KernelTimer("probe", cache_dir=str(tmp_path), memory_format=f, reps=1)
              for f in MEMORY_FORMATS}
    c, cl = (timers[f].key(relu, (2, 3, 4, 5), np.float32) for f in MEMORY_FORMATS)
    assert c != cl and cl.endswith("|cl") and not c.endswith("|cl")
    assert timers["contiguous"].key(relu, (2, 3), np.float32) == \
        timers["channels_last"].key(relu, (2, 3), np.float32)
    with pytest.raises(ValueError, match="memory_format must be one of"):
        KernelTimer("probe", cache_dir=str(tmp_path), memory_format="nhwc")
    block = dt.DistArray.from_local(np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5),
                                    dt.Distribution((2, 3, 4, 5), dt.ProcessGrid(
                                        (1,), MPI.COMM_SELF), (0, None, None, None)))
    laid = timers["channels_last"]._laid_out(block)
    assert is_channels_last(laid.local) and np.array_equal(laid.local, block.local)
    assert timers["contiguous"]._laid_out(block) is block
    order = timers["channels_last"]._order((2, 3, 4, 5))
    assert order == (0, 2, 3, 1) and timers["contiguous"]._order((2, 3, 4, 5)) is None
