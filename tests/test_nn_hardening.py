"""Bad input to the layers and losses: the same clear exception on every rank, never a hang.

Every layer's ``backward`` checks its ``dy`` against the last forward output
(shape, dtype; another distribution is redistributed) and refuses to run
before a forward call; window layers refuse kernels larger than the padded
input, batch norm refuses one value per channel in training, the softmax
cross-entropy refuses float labels, and layer arguments that are not
positive ints are refused naming the argument. A rank that did not raise
while another did would leave the job waiting: the plugin's agreement step
then ends it after its timeout, and the test fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from nn_reference import conv_ref_backward, grid

import disttensor as dt
import disttensor_nn as nn
from disttensor.testing import assert_allclose, collective_assert

comm = MPI.COMM_WORLD
SIZES = [1, 2, 3]


def same_error(fn, *args, **kw) -> tuple[str, str]:
    """Call ``fn``; require an exception of the same type and message on every rank."""
    try:
        fn(*args, **kw)
        got = None
    except Exception as exc:  # noqa: BLE001 - any exception is compared across ranks
        got = (type(exc).__name__, str(exc))
    everyone = comm.allgather(got)
    collective_assert(got is not None, f"nothing was raised (rank {comm.Get_rank()})")
    collective_assert(all(e == everyone[0] for e in everyone), f"ranks differ: {everyone}")
    return got


def h_split(shape: tuple[int, ...]) -> dt.Distribution:
    return dt.Distribution(shape, grid((comm.Get_size(),)), (None, None, 0, None))


def values(shape: tuple[int, ...], seed: int = 0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------- backward's dy
@pytest.mark.parallel(SIZES)
def test_conv_backward_with_a_wrong_gradient_shape_raises_on_every_rank():
    # the case that left rank 1 waiting: forward on (2, 2, 6, 6) split over H, dy (2, 3, 7, 6)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = dt.DistArray.from_global(values((2, 2, 6, 6)), h_split((2, 2, 6, 6)))
    y = conv(x)
    kind, msg = same_error(conv.backward, dt.DistArray.zeros(h_split((2, 3, 7, 6)), np.float32))
    collective_assert(kind == "ValueError" and "(2, 3, 7, 6)" in msg and "(2, 3, 6, 6)" in msg,
                      msg)
    kind, msg = same_error(conv.backward, dt.DistArray.zeros(y.dist, np.float64))
    collective_assert(kind == "TypeError" and "float64" in msg and "float32" in msg, msg)
    kind, msg = same_error(conv.backward, np.zeros(y.shape, np.float32))
    collective_assert(kind == "TypeError" and "DistArray" in msg, msg)


@pytest.mark.parallel(SIZES)
def test_a_gradient_in_another_distribution_is_redistributed():
    shape = (3, 2, 7, 5)
    conv = nn.Conv2d(2, 3, 3, padding=1, dtype=np.float64)
    xg = values(shape, 1, np.float64)
    y = conv(dt.DistArray.from_global(xg, h_split(shape)))
    dyg = values(y.shape, 2, np.float64)
    by_samples = dt.Distribution(y.shape, grid((comm.Get_size(),)), (0, None, None, None))
    dx = conv.backward(dt.DistArray.from_global(dyg, by_samples))
    want, dw, db = conv_ref_backward(xg, conv.weight.data, dyg, 1, [(1, 1), (1, 1)], 1)
    collective_assert(dx.dist == h_split(shape), f"dx in {dx.dist}")
    assert_allclose(dx, want, rtol=1e-10, atol=1e-12)
    assert_allclose(conv.weight.grad, dw, rtol=1e-10, atol=1e-12)
    # element-wise layers too: dx = dy where x > 0
    relu = nn.ReLU()
    relu(dt.DistArray.from_global(xg, h_split(shape)))
    dx = relu.backward(dt.DistArray.from_global(xg, dt.Distribution(
        shape, grid((comm.Get_size(),)), (None, None, None, 0))))
    collective_assert(dx.dist == h_split(shape), f"dx in {dx.dist}")
    assert_allclose(dx, np.where(xg > 0, xg, 0.0))


def _layers() -> dict[str, tuple[nn.Layer, tuple[int, ...]]]:
    """A layer of every kind with an input shape it accepts."""
    img = (3, 2, 6, 5)
    return {
        "Conv2d": (nn.Conv2d(2, 3, 3, padding=1), img),
        "MaxPool2d": (nn.MaxPool2d(2), img),
        "AvgPool2d": (nn.AvgPool2d(3, stride=1, padding=1), img),
        "BatchNorm2d": (nn.BatchNorm2d(2), img),
        "ReLU": (nn.ReLU(), img),
        "LeakyReLU": (nn.LeakyReLU(0.1), img),
        "Sigmoid": (nn.Sigmoid(), img),
        "GlobalAvgPool": (nn.GlobalAvgPool(), img),
        "Flatten": (nn.Flatten(), img),
        "Linear": (nn.Linear(60, 4), (3, 60)),
        "Sequential": (nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU()), img),
        "Residual": (nn.Residual(nn.Conv2d(2, 2, 3, padding=1)), img),
    }


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", list(_layers()))
def test_every_layer_checks_its_gradient_and_refuses_backward_before_forward(name):
    layer, shape = _layers()[name]
    dist = dt.Distribution(shape, grid((comm.Get_size(),)), (0,) + (None,) * (len(shape) - 1))
    kind, msg = same_error(layer.backward, dt.DistArray.zeros(dist, np.float32))
    collective_assert(kind == "RuntimeError" and f"{name}.backward" in msg and
                      "before a successful forward" in msg, msg)
    y = layer(dt.DistArray.from_global(values(shape), dist))
    wrong = dt.Distribution((y.shape[0] + 1,) + y.shape[1:], grid((comm.Get_size(),)),
                            y.dist.axes)
    kind, msg = same_error(layer.backward, dt.DistArray.zeros(wrong, np.float32))
    collective_assert(kind == "ValueError" and str(y.shape) in msg, msg)
    kind, msg = same_error(layer.backward, dt.DistArray.zeros(y.dist, np.float64))
    collective_assert(kind == "TypeError" and "float64" in msg, msg)
    dx = layer.backward(dt.DistArray.zeros(y.dist, np.float32))  # the right one still works
    collective_assert(dx.shape == shape, str(dx.shape))


@pytest.mark.parallel(SIZES)
def test_a_failed_forward_leaves_no_output_to_take_the_gradient_of():
    conv = nn.Conv2d(2, 3, 3)
    dist = h_split((2, 2, 6, 6))
    y = conv(dt.DistArray.from_global(values((2, 2, 6, 6)), dist))
    same_error(conv, dt.DistArray.zeros(h_split((2, 4, 6, 6)), np.float32))  # 4 channels
    kind, msg = same_error(conv.backward, dt.DistArray.zeros(y.dist, np.float32))
    collective_assert(kind == "RuntimeError", msg)


@pytest.mark.parallel(SIZES)
def test_add_and_losses_refuse_backward_before_forward_and_check_dy():
    kind, msg = same_error(nn.Add().backward, None)
    collective_assert(kind == "RuntimeError" and "Add.backward" in msg, msg)
    for loss in (nn.SoftmaxCrossEntropy(), nn.MSELoss(), nn.BCEWithLogitsLoss()):
        kind, msg = same_error(loss.backward)
        collective_assert(kind == "RuntimeError" and type(loss).__name__ in msg, msg)
    add = nn.Add()
    a = dt.DistArray.from_global(values((4, 3)), dt.Distribution((4, 3), grid((comm.Get_size(),)),
                                                                 (0, None)))
    add(a, a)
    kind, msg = same_error(add.backward, dt.DistArray.zeros(
        dt.Distribution((4, 4), grid((comm.Get_size(),)), (0, None)), np.float32))
    collective_assert(kind == "ValueError" and "(4, 3)" in msg, msg)


# --------------------------------------------------------------------------- forward's input
@pytest.mark.parallel(SIZES)
def test_kernels_larger_than_the_padded_input_are_refused_like_pytorch():
    shape = (2, 2, 6, 4)
    x = dt.DistArray.from_global(values(shape), h_split(shape))
    for layer in (nn.Conv2d(2, 3, 5), nn.Conv2d(2, 3, 3, dilation=3), nn.MaxPool2d(5),
                  nn.AvgPool2d((2, 6), padding=(1, 0)), nn.MaxPool1d(7)):
        if isinstance(layer, nn.MaxPool1d):
            x = dt.DistArray.from_global(values((2, 2, 6)), dt.Distribution(
                (2, 2, 6), grid((comm.Get_size(),)), (None, None, 0)))
        kind, msg = same_error(layer, x)
        collective_assert(kind == "ValueError" and "padded input size" in msg, msg)


@pytest.mark.parallel(SIZES)
def test_batch_norm_with_one_value_per_channel_in_training_is_refused():
    p = comm.Get_size()
    one = dt.DistArray.from_global(values((1, 3, 1, 1)), dt.Distribution(
        (1, 3, 1, 1), grid((p,)), (0, None, None, None)))
    bn = nn.BatchNorm2d(3)
    kind, msg = same_error(bn, one)
    collective_assert(kind == "ValueError" and "more than 1 value per channel" in msg, msg)
    bn.eval()
    y = bn(one)  # evaluation uses the running statistics: fine
    collective_assert(y.shape == (1, 3, 1, 1))
    # per-group statistics over groups of one 1x1 sample
    shape = (p, 3, 1, 1)
    x = dt.DistArray.from_global(values(shape), dt.Distribution(shape, grid((p,)),
                                                                (0, None, None, None)))
    group = nn.BatchNorm2d(3, stats="group")
    if p > 1:
        kind, msg = same_error(group, x)
        collective_assert("stats='group'" in msg, msg)
    global_bn = nn.BatchNorm2d(3)
    if p > 1:
        collective_assert(global_bn(x).shape == shape)


@pytest.mark.parallel(SIZES)
def test_float_labels_are_refused():
    dist = dt.Distribution((4, 3), grid((comm.Get_size(),)), (0, None))
    logits = dt.DistArray.from_global(values((4, 3)), dist)
    loss = nn.SoftmaxCrossEntropy()
    for labels in (np.array([0.0, 1.5, 2.0, 1.0]), [0.0, 1.0, 2.0, 1.0],
                   dt.DistArray.from_global(np.array([0.0, 1.0, 2.0, 1.0]), dt.Distribution(
                       (4,), grid((comm.Get_size(),)), (0,)))):
        kind, msg = same_error(loss, logits, labels)
        collective_assert(kind == "TypeError" and "integer" in msg, msg)
    collective_assert(np.isfinite(loss(logits, np.array([0, 1, 2, 1]))))


# --------------------------------------------------------------------------- constructors
BAD_ARGS = [
    (lambda: nn.Conv2d(2, 3, 2.5), "TypeError", "kernel_size"),
    (lambda: nn.Conv2d(2, 3, 3, padding=1.5), "TypeError", "padding"),
    (lambda: nn.Conv2d(2, 3, 3, padding=((1, 0.5), 1)), "TypeError", "padding"),
    (lambda: nn.Conv2d(-2, 4, 3), "ValueError", "in_channels"),
    (lambda: nn.Conv2d(2, 0, 3), "ValueError", "out_channels"),
    (lambda: nn.Conv2d(2.0, 4, 3), "TypeError", "in_channels"),
    (lambda: nn.Conv2d(2, 4, 3, groups=0), "ValueError", "groups"),
    (lambda: nn.Conv2d(2, 4, 3, stride=True), "TypeError", "stride"),
    (lambda: nn.Conv2d(2, 4, (3, "a")), "TypeError", "kernel_size"),
    (lambda: nn.Conv2d(2, 4, 3, dilation=None), "TypeError", "dilation"),
    (lambda: nn.MaxPool2d(2.5), "TypeError", "kernel_size"),
    (lambda: nn.AvgPool2d(2, stride=1.0), "TypeError", "stride"),
    (lambda: nn.Linear(-1, 3), "ValueError", "in_features"),
    (lambda: nn.Linear(4, 2.0), "TypeError", "out_features"),
    (lambda: nn.BatchNorm2d(0), "ValueError", "num_features"),
]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("case", range(len(BAD_ARGS)))
def test_bad_layer_arguments_name_the_argument(case):
    make, kind, word = BAD_ARGS[case]
    got, msg = same_error(make)
    collective_assert(got == kind and word in msg, f"{got}: {msg}")


# --------------------------------------------------------------------------- random arguments
ARG = st.one_of(st.integers(-3, 6), st.floats(-2, 6), st.just(float("nan")), st.booleans(),
                st.none(),
                st.text(max_size=2), st.tuples(st.integers(-1, 4), st.integers(-1, 4)),
                st.lists(st.floats(0, 3), max_size=3))

LAYERS = {
    "Conv2d": lambda a, b, c, d: nn.Conv2d(a, b, c, stride=d),
    "Conv2d padding": lambda a, b, c, d: nn.Conv2d(2, 2, 3, padding=a, dilation=b),
    "MaxPool2d": lambda a, b, c, d: nn.MaxPool2d(a, stride=b, padding=c),
    "AvgPool1d": lambda a, b, c, d: nn.AvgPool1d(a, stride=b, padding=c, dilation=d),
    "Linear": lambda a, b, c, d: nn.Linear(a, b),
    "BatchNorm2d": lambda a, b, c, d: nn.BatchNorm2d(a),
}


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("kind", list(LAYERS))
@settings(max_examples=40, deadline=None)
@given(a=ARG, b=ARG, c=ARG, d=ARG)
def test_random_layer_arguments_give_a_layer_or_the_same_clear_error_everywhere(kind, a, b, c,
                                                                                 d):
    try:
        layer = LAYERS[kind](a, b, c, d)
        got = None
    except (TypeError, ValueError) as exc:
        got = (type(exc).__name__, str(exc))
    except Exception as exc:  # noqa: BLE001 - anything else is an unclear error
        got = ("unclear", f"{type(exc).__name__}: {exc}")
    everyone = comm.allgather(got)
    collective_assert(all(e == everyone[0] for e in everyone), f"ranks differ: {everyone}")
    collective_assert(got is None or got[0] != "unclear", f"{kind}{(a, b, c, d)}: {got}")
    if got is None and kind == "Conv2d":  # accepted: the arguments were valid ints
        collective_assert(layer.weight.shape == (b, a) + (c, c), f"{layer.weight.shape}")
