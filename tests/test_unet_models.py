"""U-Net 2-D/3-D and CosmoFlow: split training reproduces one process's training.

The one-process run uses a 1-rank grid over ``MPI.COMM_SELF`` (every rank
trains the serial network on its own); the split runs (sample x H with
uneven blocks, D x H x W, and a plan that changes layout inside the
U-Net) must reproduce its 10 losses and final parameters to float64
rounding. The synthetic data sets must give every rank the block of the
whole sample that one process generates.
"""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest
from mpi4py import MPI
from nn_reference import Checks, grid, grid2_shape, grid3_shape

import disttensor as dt
import disttensor_nn as nn
from disttensor_nn.models import cosmoflow, unet
from disttensor_nn.plan import CostModel, MachineProfile, Planner
from disttensor_nn.plan.planner import leaf_nodes, trace
from disttensor_nn.training.cli import train_main
from disttensor_nn.training.registry import build_model, check_size, model_spec
from disttensor_nn.training.volumes import CosmoSynthetic, SegmentationSynthetic

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD
STEPS = 10
F64 = np.float64


def batches(shape, classes, n=2):
    data = SegmentationSynthetic(2 * shape[0], shape[2:], channels=shape[1], classes=classes,
                                 seed=3)
    out = []
    for b in range(n):
        xs, ys = zip(*(data.sample(b * shape[0] + i) for i in range(shape[0])))
        out.append((np.stack(xs).astype(F64), np.stack(ys)))
    return out


def train_unet(nd, norm, shape, in_dist, loss_fn, layouts=None):
    net = unet(nd, shape[1], 3, depth=3, width=2, norm=norm, dtype=F64, seed=5)
    if layouts is not None:
        for node, layout in zip(leaf_nodes(trace(net, shape)), layouts):
            node.layer.layout = layout
    opt = nn.SGD(net.parameters(), lr=0.2, momentum=0.9)
    data = batches(shape, 3)
    losses = []
    for step in range(STEPS):
        x, y = data[step % len(data)]
        out = net(dt.DistArray.from_global(x, in_dist))
        losses.append(loss_fn(out, y))
        opt.zero_grad()
        net.backward(loss_fn.backward())
        opt.step()
    return np.array(losses), [p.data.copy() for p in net.parameters()]


@cache
def serial_unet(nd, norm, shape, loss):
    """One process's training (cached: the 2-D variants share it)."""
    serial = dt.Distribution(shape, dt.ProcessGrid((1,), MPI.COMM_SELF),
                             (0,) + (None,) * (len(shape) - 1))
    return train_unet(nd, norm, shape, serial, loss())


def check_same(run, ref, what):
    check = Checks()
    losses, params = run
    want_losses, want_params = ref
    # two batches alternate: the loss of the first one falls
    check.true(want_losses[0] - want_losses[-2] > 0.02, f"{what}: no learning {want_losses}")
    check.close(losses, want_losses, f"{what}: losses", rtol=1e-9, atol=1e-12)
    for k, (a, b) in enumerate(zip(params, want_params)):
        check.close(a, b, f"{what}: parameter {k}", rtol=1e-8, atol=1e-10)
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("variant", ["sample x H uneven", "H, then sample (planned)"])
def test_unet2d_split_training_matches_one_process(variant):
    shape = (2, 1, 12, 8)
    p = comm.Get_size()
    layouts = None
    if variant == "sample x H uneven":
        g = grid(grid2_shape(p))
        cuts = [5] if g.shape[1] == 2 else None  # blocks of 5 and 7 rows
        dist = dt.Distribution(shape, g, (0, None, 1, None), [None, None, cuts, None])
    else:  # the encoder split in H, the rest sample-parallel: Skip's Concat redistributes
        g = grid((p,))
        dist = dt.Distribution(shape, g, (None, None, 0, None))
        n = len(leaf_nodes(trace(unet(2, 1, 3, depth=3, width=2), shape)))
        sample = nn.Layout(g, (0, None, None, None))
        layouts = [None] * 6 + [sample] * (n - 6)
    ref = serial_unet(2, "batch", shape, nn.CrossEntropyLoss)
    run = train_unet(2, "batch", shape, dist, nn.CrossEntropyLoss(), layouts)
    check_same(run, ref, variant)


@pytest.mark.parallel(SIZES)
def test_unet3d_split_training_matches_one_process():
    shape = (1, 1, 8, 4, 8)
    p = comm.Get_size()
    dist = dt.Distribution(shape, grid(grid3_shape(p)), (None, None, 0, 1, 2))
    ref = serial_unet(3, "group", shape, nn.DiceLoss)
    run = train_unet(3, "group", shape, dist, nn.DiceLoss())
    check_same(run, ref, "D x H x W")


@pytest.mark.parallel([1, 2, 3])
def test_cosmoflow_split_training_matches_one_process():
    shape = (2, 4, 8, 8, 8)
    data = CosmoSynthetic(2, shape[2:], seed=1)
    x = np.stack([data.sample(i)[0] for i in range(2)]).astype(F64)
    y = np.stack([data.sample(i)[1] for i in range(2)]).astype(F64)

    def run(dist):
        net = cosmoflow(4, 8, conv_layers=3, width=2, fc=(8, 4), dropout=0.2, dtype=F64,
                        seed=2)
        opt = nn.SGD(net.parameters(), lr=0.05, momentum=0.9)
        loss_fn = nn.MSELoss()
        losses = []
        for _ in range(STEPS):
            losses.append(loss_fn(net(dt.DistArray.from_global(x, dist)), y))
            opt.zero_grad()
            net.backward(loss_fn.backward())
            opt.step()
        return np.array(losses), [q.data.copy() for q in net.parameters()]

    serial = dt.Distribution(shape, dt.ProcessGrid((1,), MPI.COMM_SELF), (0,) + (None,) * 4)
    p = comm.Get_size()
    dist = dt.Distribution(shape, grid((p,)), (None, None, 0, None, None))
    check_same(run(dist), run(serial), "cosmoflow D split")


@pytest.mark.parallel([1, 3])
def test_synthetic_volumes_blocks_match_whole_samples():
    check = Checks()
    seg = SegmentationSynthetic(3, (5, 7, 4), channels=2, classes=3, seed=1)
    xs, ys = zip(*(seg.sample(i) for i in range(3)))
    xg, yg = np.stack(xs), np.stack(ys)
    check.true(yg.dtype == np.int64 and set(np.unique(yg)) == {0, 1, 2}, "three classes")
    # labels are thresholds of the first channel's values
    check.equal(yg[:, 0], (xg[:, 0, ..., None] > seg.thresholds.astype(np.float32)).sum(-1),
                "labels from channel 0")
    dist = dt.Distribution((3, 2, 5, 7, 4), grid(grid3_shape(comm.Get_size())),
                           (None, None, 0, 1, 2))
    x, y = seg.batch([0, 1, 2], dist)
    check.equal(x, xg, "inputs by block")
    check.equal(y, yg, "targets by block")
    cos = CosmoSynthetic(2, (4, 4, 4), seed=0)
    xc, theta = cos.sample(1)
    check.close(xc.mean(axis=(1, 2, 3)), theta, "channel means encode the parameters",
                rtol=0, atol=0.3)
    check.finish()


@pytest.mark.parallel([1])
def test_registry_entries_build_and_fit_their_data():
    for name, out in (("unet2d", (1, 2, 64, 64)), ("unet3d", (1, 2, 32, 32, 32)),
                      ("cosmoflow", (1, 4))):
        model, shape = build_model(name)
        assert model.output_shape(shape) == out
        spec = model_spec(name)
        assert spec.dataset(1, shape[1:], 0).sample_shape == shape[1:]
    model, shape = build_model("cosmoflow-mlperf")
    assert shape == (1, 4, 128, 128, 128) and model.output_shape(shape) == (1, 4)
    with pytest.raises(ValueError, match="norm"):
        unet(2, norm="layer")


@pytest.mark.parallel([1])
def test_cosmoflow_takes_any_size_its_poolings_divide(capsys):
    """``--size`` builds CosmoFlow for that size (its dense layer's width follows it); a size
    the five poolings do not divide is refused with the nearest sizes that work."""
    model, shape = build_model("cosmoflow", (64, 32, 96), 2)
    assert shape == (2, 4, 64, 32, 96) and model.output_shape(shape) == (2, 4)
    dense = [m for m in model if isinstance(m, nn.Linear)][0]
    # 8 * 2**4 = 128 channels after five poolings of (64, 32, 96) / 32 = (2, 1, 3)
    assert dense.weight.data.shape[1] == 128 * 2 * 1 * 3
    x = dt.DistArray.from_global(np.ones(shape, np.float32), dt.Distribution(
        shape, dt.ProcessGrid((1,) * 5, MPI.COMM_SELF), (0, None, 1, 2, 3)))
    assert model(x).shape == (2, 4)
    check_size("cosmoflow", (64, 32, 96))
    with pytest.raises(ValueError, match=r"dimension 0: 32 or 64; dimension 1: 64; "
                                         r"dimension 2: 64"):
        check_size("cosmoflow", (48, 64, 64))
    with pytest.raises(SystemExit):
        train_main(["cosmoflow", "--size", "48x64x64", "--steps", "1"])
    assert "dimension 0: 32 or 64" in capsys.readouterr().err


@pytest.mark.parallel([1])
@pytest.mark.parametrize("alpha,flops", [(1e-6, 1e9), (1e-3, 1e12), (1e-8, 1e7)])
def test_planner_solves_skip_blocks_exactly(alpha, flops):
    """The DP over a U-Net level (conv, then Skip(pool -> up-conv, post=conv)) equals the
    cheapest of all assignments, priced by walking the graph."""
    prof = MachineProfile(name="test", p2p_alpha=alpha, p2p_beta=1e-9, allreduce_alpha=2 * alpha,
                          allreduce_beta=2e-9, alltoall_alpha=alpha, alltoall_beta=3e-9,
                          peak_flops=flops, efficiency=0.5, mem_bandwidth=1e10,
                          memory_per_rank=2**30)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.Skip(nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(2, 4, 3, padding=1),
                              nn.ConvTranspose2d(4, 2, 2, stride=2)),
                post=nn.Sequential(nn.Conv2d(4, 2, 3, padding=1), nn.GroupNorm(2, 2))),
        nn.Conv2d(2, 3, 1))
    shape = (2, 1, 12, 12)
    assert model.output_shape(shape) == (2, 3, 12, 12)
    planner = Planner(model, shape, CostModel(prof, 4, overlap=False),
                      allowed=[(4, 1, 1), (1, 4, 1), (2, 2, 1)])
    nodes, n = planner.nodes, len(planner.cands)
    brute = min(planner.assignment_cost({id(node): c for node, c in zip(nodes, a)})[0]
                for a in itertools.product(range(n), repeat=len(nodes)))
    assert len(nodes) == 7
    assert planner.plan().time == pytest.approx(brute, rel=1e-9, abs=1e-15)
