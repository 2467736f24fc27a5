"""The NumPy kernels with a pool of threads, and the running-maximum pooling kernels.

Convolutions with :func:`~disttensor_nn.kernels.set_num_threads` above one
split the batch over threads; their outputs and gradients (every path: im2col,
col2im with strides, the transposed correlation, 1x1 GEMMs, row tiles) are
compared with the serial scipy references of ``nn_reference``. Pooling (max
with the flat input index of each maximum, average) is compared with
``pool_ref`` for overlapping and strided windows, ties included (the first
maximum wins), max pooling also padded by the kernel itself; windows of -inf
or NaN are compared with PyTorch's indices where torch is installed.
Local computations, identical on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from nn_reference import conv_ref, conv_ref_backward, pool_ref

from disttensor_nn.kernels import get_num_threads, numpy_kernels, set_num_threads

TOL = {"rtol": 1e-11, "atol": 1e-11}

# (id, x shape, w shape, stride, groups, workspace bytes or None)
CASES = [
    ("3x3", (5, 3, 9, 8), (4, 3, 3, 3), (1, 1), 1, None),
    ("5x5s2", (4, 3, 12, 11), (5, 3, 5, 5), (2, 2), 1, None),
    ("s2_groups", (3, 4, 10, 9), (6, 2, 3, 3), (2, 1), 2, None),
    ("1x1", (3, 4, 24, 24), (5, 4, 1, 1), (1, 1), 1, None),
    ("rowtiles", (2, 3, 15, 14), (5, 3, 3, 3), (1, 1), 1, 2000),
    ("one_sample", (1, 2, 7, 7), (3, 2, 3, 3), (1, 1), 1, None),
]


@pytest.fixture(params=[2, 3], ids=["2threads", "3threads"])
def threads(request):
    set_num_threads(request.param)
    yield request.param
    set_num_threads(1)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_threaded_conv_matches_reference(case, threads):
    _, xs, ws, stride, groups, workspace = case
    assert get_num_threads() == threads
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    b = rng.standard_normal(ws[0])
    kw = {} if workspace is None else {"workspace_bytes": workspace}
    pads = [(0, 0)] * 2
    y = numpy_kernels.conv_forward(x, w, b, stride, (1, 1), groups, **kw)
    np.testing.assert_allclose(y, conv_ref(x, w, b, stride, pads, 1, groups), **TOL)
    dy = rng.standard_normal(y.shape)
    dx_want, dw_want, db_want = conv_ref_backward(x, w, dy, stride, pads, 1, groups)
    for need_dx, need_dw in [(True, True), (True, False), (False, True)]:
        dx, dw, db = numpy_kernels.conv_backward(dy, x, w, stride, (1, 1), groups,
                                                 need_dx=need_dx, need_dw=need_dw, **kw)
        np.testing.assert_allclose(db, db_want, **TOL)
        if need_dx:
            np.testing.assert_allclose(dx, dx_want, **TOL)
        if need_dw:
            np.testing.assert_allclose(dw, dw_want, **TOL)


def test_set_num_threads_refuses_non_positive():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            set_num_threads(bad)
    assert get_num_threads() == 1


@pytest.mark.parametrize("op", ["max", "avg"])
@pytest.mark.parametrize("kernel,stride", [((3, 3), (2, 2)), ((2, 3), (1, 2)), ((2, 2), (2, 2)),
                                           ((17, 16), (1, 2))])
def test_pool_kernels_match_reference(op, kernel, stride):
    # (17, 16): windows of over 256 elements, whose running offsets take more than a byte
    _check_pool(op, kernel, stride, (2, 3, 9, 8) if max(kernel) < 4 else (2, 3, 19, 20))


@pytest.mark.parametrize("op", ["max", "avg"])
def test_pool_kernels_threaded_match_reference(op, threads):
    # parts of the batch on the kernels' pool (5 samples: uneven parts)
    _check_pool(op, (3, 3), (2, 2), (5, 3, 9, 8))


PADDED = [((3, 3), (2, 2), (1, 1), (1, 1), (2, 3, 9, 8)),
          ((3, 2), (1, 2), (1, 1), (1, 1), (2, 3, 10, 7)),
          ((3, 3), (2, 1), (1, 1), (2, 1), (1, 2, 11, 9)),
          ((3, 3, 3), (2, 2, 2), (1, 0, 1), (1, 1, 1), (2, 2, 6, 7, 5))]


@pytest.mark.parametrize("kernel,stride,pads,dilation,shape", PADDED)
def test_max_pool_padded_by_the_kernel(kernel, stride, pads, dilation, shape, threads):
    """Max pooling padded by the kernel (-inf): outputs and gradients as the reference's on
    the padded input, the gradient of ``x``'s own shape (indices into ``x``, none in the
    padding), ties won by the first maximum; on the kernels' pool of threads."""
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, shape).astype(np.float64)
    y, idx = numpy_kernels.pool_forward(x, kernel, stride, dilation, "max", padding=pads)
    y_want, dx_of = pool_ref(x, kernel, stride, [(p, p) for p in pads], dilation, "max")
    np.testing.assert_array_equal(y, y_want)
    assert idx.min() >= 0 and idx.max() < x.size
    np.testing.assert_array_equal(x.reshape(-1)[idx], y_want)
    dy = rng.standard_normal(y.shape)
    dx = numpy_kernels.pool_backward(dy, x.shape, kernel, stride, dilation, "max", idx,
                                     padding=pads)
    assert dx.shape == x.shape
    np.testing.assert_allclose(dx, dx_of(dy), **TOL)


@pytest.mark.parametrize("pads", [(0, 0), (1, 1)], ids=["halo", "padded"])
def test_max_pool_windows_of_inf_and_nan_take_torchs_index(pads):
    """A window whose maximum is -inf or NaN: PyTorch's index (its last NaN, else its first
    element inside the input), never one in the padding."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x = rng.integers(-3, 4, (2, 3, 9, 8)).astype(np.float64)
    x[0, 0] = -np.inf
    x[0, 1, ::3] = np.nan
    x[1, 2, :, 1::2] = np.nan
    y, idx = numpy_kernels.pool_forward(x, (3, 3), (2, 2), (1, 1), "max", padding=pads)
    yt, it = torch.nn.functional.max_pool2d(torch.from_numpy(x), 3, 2, pads,
                                            return_indices=True)
    np.testing.assert_array_equal(y, yt.numpy())
    planes = (np.arange(6) * 72).reshape(2, 3, 1, 1)  # torch's indices are per plane
    np.testing.assert_array_equal(idx, it.numpy() + planes)


def test_pool_kernel_padding_is_for_max_only():
    x = np.zeros((1, 1, 4, 4))
    with pytest.raises(ValueError, match="max pooling only"):
        numpy_kernels.pool_forward(x, (2, 2), (2, 2), (1, 1), "avg", padding=(1, 1))


def _check_pool(op, kernel, stride, shape):
    rng = np.random.default_rng(5)
    # small integers: many ties inside windows, where the first maximum must win
    x = rng.integers(-3, 4, shape).astype(np.float64)
    y, arg = numpy_kernels.pool_forward(x, kernel, stride, (1, 1), op)
    y_want, dx_of = pool_ref(x, kernel, stride, [(0, 0)] * 2, (1, 1), op)
    np.testing.assert_allclose(y, y_want, **TOL)
    if op == "max":  # the flat input index of each output's (first) maximum
        assert arg.dtype == np.intp and arg.shape == y.shape
        np.testing.assert_array_equal(x.reshape(-1)[arg], y_want)
    dy = rng.standard_normal(y.shape)
    dx = numpy_kernels.pool_backward(dy, x.shape, kernel, stride, (1, 1), op, arg)
    np.testing.assert_allclose(dx, dx_of(dy), **TOL)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_conv_scratch_arena_and_chunked_sums(monkeypatch, case, bias):
    """Serial convolutions on row tiles of a few columns, their weight gradients summed
    through partial products of a few rows (ACC_CHUNK_BYTES), with and without a bias,
    every case after every other one from the same scratch arena (which grows to the
    largest call's need and is reused): all match the references. Nothing a call returns
    lies in the arena."""
    monkeypatch.setattr(numpy_kernels, "ACC_CHUNK_BYTES", 8)
    monkeypatch.setattr(numpy_kernels, "MIN_TILE_COLS", 1)
    _, xs, ws, stride, groups, _ = case
    rng = np.random.default_rng(7)
    for other in [c for c in CASES if c is not case] + [case]:  # the arena grown by others
        ox, ow = rng.standard_normal(other[1]), rng.standard_normal(other[2])
        numpy_kernels.conv_backward(numpy_kernels.conv_forward(ox, ow, None, other[3],
                                                               (1, 1), other[4]),
                                    ox, ow, other[3], (1, 1), other[4])
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    b = rng.standard_normal(ws[0]) if bias else None
    pads = [(0, 0)] * 2
    kw = {"workspace_bytes": 200}
    y = numpy_kernels.conv_forward(x, w, b, stride, (1, 1), groups, **kw)
    np.testing.assert_allclose(y, conv_ref(x, w, b, stride, pads, 1, groups), **TOL)
    dy = rng.standard_normal(y.shape)
    dx_want, dw_want, db_want = conv_ref_backward(x, w, dy, stride, pads, 1, groups)
    arena = numpy_kernels._arena().buf
    for need_dx, need_dw in [(True, True), (True, False), (False, True)]:
        dx, dw, db = numpy_kernels.conv_backward(dy, x, w, stride, (1, 1), groups,
                                                 need_dx=need_dx, need_dw=need_dw, **kw)
        np.testing.assert_allclose(db, db_want, **TOL)
        for got, want in ((dx, dx_want), (dw, dw_want)):
            if got is not None:
                np.testing.assert_allclose(got, want, **TOL)
                assert not np.shares_memory(got, numpy_kernels._arena().buf)
        assert not np.shares_memory(y, arena)
    numpy_kernels.release_workspace()
