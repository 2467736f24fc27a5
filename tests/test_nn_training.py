"""Training a small CNN gives the same loss curve on one process and on a split batch.

The one-process run uses a 1-rank grid over ``MPI.COMM_SELF``: every rank
trains the serial network on its own, and the distributed run (sample x H,
or a layout that changes between the two convolution blocks) must reproduce
that run's 20 losses, final parameters and running statistics to float64
rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from nn_reference import Checks, empty_cuts, grid, grid2_shape

import disttensor as dt
import disttensor_nn as nn

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD
STEPS = 20
SHAPE = (4, 2, 12, 10)  # N, C, H, W
CLASSES = 3


def make_net():
    f64 = np.float64
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, dtype=f64), nn.BatchNorm2d(4, dtype=f64), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1, dtype=f64), nn.BatchNorm2d(4, dtype=f64), nn.ReLU(),
        nn.AvgPool2d(2),
        nn.GlobalAvgPool(), nn.Linear(4, CLASSES, dtype=f64),
    )
    rng = np.random.default_rng(30)
    for p in net.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5
    return net


def data():
    rng = np.random.default_rng(31)
    batches = []
    for _ in range(2):
        x = rng.standard_normal(SHAPE)
        # labels: where the first channel is brightest
        third = SHAPE[2] // 3
        scores = [x[:, 0, k * third:(k + 1) * third].mean(axis=(1, 2)) for k in range(CLASSES)]
        batches.append((x, np.argmax(scores, axis=0)))
    return batches


def train(in_dist, layouts=None):
    net = make_net()
    if layouts is not None:
        net.set_layouts(layouts)
    opt = nn.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss_fn = nn.SoftmaxCrossEntropy()
    batches = data()
    losses = []
    for step in range(STEPS):
        x, labels = batches[step % len(batches)]
        out = net(dt.DistArray.from_global(x, in_dist))
        losses.append(loss_fn(out, labels))
        opt.zero_grad()
        net.backward(loss_fn.backward())
        opt.step()
    params = [p.data.copy() for p in net.parameters()]
    stats = [a for layer in (net[1], net[5]) for a in (layer.running_mean, layer.running_var)]
    return np.array(losses), params, stats


def serial_run():
    g = dt.ProcessGrid((1,), MPI.COMM_SELF)
    return train(dt.Distribution(SHAPE, g, (0, None, None, None)))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("variant", ["sample x H", "H uneven, then sample"])
def test_training_curve_matches_one_process(variant):
    p = comm.Get_size()
    if variant == "sample x H":
        g = grid(grid2_shape(p))
        dist = dt.Distribution(SHAPE, g, (0, None, 1, None))
        layouts = None
    else:
        g = grid((p,))
        splits = [None, None, empty_cuts(SHAPE[2], p) or None, None]
        dist = dt.Distribution(SHAPE, g, (None, None, 0, None), splits)
        # the second block runs sample-parallel: the activations are redistributed
        layouts = [None] * 4 + [nn.Layout(g, (0, None, None, None))] + [None] * 5
    want_losses, want_params, want_stats = serial_run()
    losses, params, stats = train(dist, layouts)
    check = Checks()
    check.true(np.ptp(want_losses) > 0.1, f"training changes nothing: {want_losses}")
    check.close(losses, want_losses, f"{variant}: loss curve", rtol=1e-10, atol=1e-12)
    for k, (a, b) in enumerate(zip(params, want_params)):
        check.close(a, b, f"{variant}: parameter {k}", rtol=1e-9, atol=1e-11)
    for k, (a, b) in enumerate(zip(stats, want_stats)):
        check.close(a, b, f"{variant}: running stats {k}", rtol=1e-9, atol=1e-11)
    # every rank holds the same parameters (bit for bit)
    flat = np.concatenate([a.ravel() for a in params])
    check.true(np.array_equal(flat, comm.bcast(flat, root=0)),
               "parameters differ between ranks")
    check.finish()
