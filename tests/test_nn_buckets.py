"""Bucketed, non-blocking gradient reduction (GradientBuckets) against the blocking path.

A small network (two convolutions, batch norm, ReLU, global pooling, Linear)
runs forward and backward twice without zeroing (gradient accumulation) on
every layout of ``nn_reference.layouts`` (sample, spatial, both, replica
axes, empty blocks), once with the blocking allreduces and once inside
GradientBuckets with tiny buckets (one reduction per gradient, several in
flight) and with one large bucket (everything fused). The gradients must
equal the blocking ones: bit for bit on one and two ranks, where each
element's sum has one order whatever the message; within rounding on more
ranks, where MPI may split messages differently. The blocking gradients are
themselves checked against one process (the gathered input, no split).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from mpi4py import MPI
from nn_reference import Checks, grid, layouts

import disttensor as dt
import disttensor_nn as nn
from disttensor.testing import collective_assert
from disttensor_nn.reduction import GradientBuckets, reduce_gradients_

SIZES = [1, 2, 3, 4]
SHAPE = (4, 3, 12, 10)


def _net():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, dtype=np.float64, seed=1),
                         nn.BatchNorm2d(4, dtype=np.float64), nn.ReLU(),
                         nn.Conv2d(4, 5, 3, stride=2, padding=1, dtype=np.float64, seed=2),
                         nn.GlobalAvgPool(), nn.Linear(5, 3, dtype=np.float64, seed=3))


def _grads(dist, x, dy, buckets):
    net = _net()
    for _ in range(2):  # accumulate over two backward passes
        y = net(dt.DistArray.from_global(x, dist))
        g = dt.DistArray.from_global(dy, y.dist)
        if buckets is None:
            net.call_backward(g)
        else:
            with GradientBuckets(buckets):
                net.call_backward(g)
    return {name: p.grad.copy() for name, p in net.named_parameters()}


@pytest.mark.parallel(SIZES)
def test_bucketed_reduction_equals_blocking():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(SHAPE)
    dy = rng.standard_normal((SHAPE[0], 3))
    size = MPI.COMM_WORLD.Get_size()
    serial = _grads(dt.Distribution(SHAPE, grid((size,)), (None,) * 4), x, dy, None)
    check = Checks()
    for name, dist in layouts(SHAPE):
        blocking = _grads(dist, x, dy, None)
        for key in serial:
            check.close(blocking[key], serial[key], f"{name}: blocking {key}", rtol=1e-10,
                        atol=1e-10)
        for bucket in (8, 2**20):
            bucketed = _grads(dist, x, dy, bucket)
            for key in blocking:
                what = f"{name}, {bucket}-byte buckets: {key}"
                if size <= 2:
                    check.equal(bucketed[key], blocking[key], what)
                else:
                    check.close(bucketed[key], blocking[key], what, rtol=1e-13, atol=1e-13)
    check.finish()


@pytest.mark.parallel(SIZES)
def test_bucket_size_is_checked_and_none_parameters_are_skipped():
    with pytest.raises((TypeError, ValueError)):
        GradientBuckets(0)
    p = nn.Parameter(np.ones(3))
    comm = MPI.COMM_WORLD
    with GradientBuckets(1):
        reduce_gradients_([(p, np.ones(3)), (None, np.ones(5))], comm)
        np.testing.assert_array_equal(p.grad, 0)  # not before the context ends
    np.testing.assert_array_equal(p.grad, comm.Get_size())


def _accumulated(dist, x, dy, mode):
    """Gradients of two micro-batches (the halves of x), the first under no_sync when
    ``mode`` says so, reduced blocking or in buckets."""
    net = _net()
    half = SHAPE[0] // 2
    for i in range(2):
        xs, dys = x[i * half:(i + 1) * half], dy[i * half:(i + 1) * half]
        d = dist.replace(global_shape=(half,) + SHAPE[1:])
        y = net(dt.DistArray.from_global(xs, d))
        g = dt.DistArray.from_global(dys, y.dist)
        keep = mode != "reduce each" and i == 0
        with (nn.no_sync() if keep else contextlib.nullcontext()), \
                (GradientBuckets(64) if mode == "no_sync, buckets" else
                 contextlib.nullcontext()):
            net.call_backward(g)
        if keep:  # nothing reduced yet: the convolutions' and Linear's grads are untouched
            held = [p for n, p in net.named_parameters() if not n.startswith("1.")]
            collective_assert(all(not np.any(p.grad) and p.unreduced is not None
                                  for p in held), "no_sync reduced or dropped a gradient")
    return {name: p.grad.copy() for name, p in net.named_parameters()}


@pytest.mark.parallel(SIZES)
def test_no_sync_accumulation_equals_reducing_every_micro_batch():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(SHAPE)
    dy = rng.standard_normal((SHAPE[0], 3))
    check = Checks()
    for name, dist in layouts(SHAPE):
        if dist.nblocks[0] > SHAPE[0] // 2:  # the micro-batches have 2 samples
            continue
        every = _accumulated(dist, x, dy, "reduce each")
        for mode in ("no_sync", "no_sync, buckets"):
            got = _accumulated(dist, x, dy, mode)
            for key in every:
                check.close(got[key], every[key], f"{name}, {mode}: {key}", rtol=1e-12,
                            atol=1e-12)
    check.finish()


@pytest.mark.parallel([1, 2])
def test_a_step_with_gradients_kept_back_by_no_sync_is_refused():
    p = nn.Parameter(np.ones(3))
    opt = nn.SGD([p], lr=0.1)
    with nn.no_sync():
        reduce_gradients_([(p, np.ones(3))], MPI.COMM_WORLD)
    with pytest.raises(RuntimeError, match="no_sync"):
        opt.step()
    np.testing.assert_array_equal(p.data, 1)  # nothing updated
    opt.zero_grad()  # drops what was kept back
    assert p.unreduced is None
    opt.step()
    with nn.no_sync():
        reduce_gradients_([(p, np.full(3, 2.0))], MPI.COMM_WORLD)
    reduce_gradients_([(p, np.ones(3))], MPI.COMM_WORLD)  # the kept part joins this sum
    np.testing.assert_array_equal(p.grad, 3.0 * MPI.COMM_WORLD.Get_size())
