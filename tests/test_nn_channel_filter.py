"""Channel and filter splits: convolution, batch norm, pooling, Linear, sharded parameters.

Every layer runs on activations split along C (and its convolutions with
their filters split along F) and is compared with the independent serial
references of ``nn_reference`` on the global arrays: outputs, input
gradients, and each rank's shard of the weight gradients. The layouts
cover filter-only, channel-only, channel x filter, an input split along
C over the filter axes (gathered), replicas, C/F combined with N and H
splits, and explicit channel splits with empty blocks; world sizes 1-4
give uneven and empty channel and filter slices. State written under one
split loads under another, and a small network trained with channel and
filter splits reproduces the one-process loss curve.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from mpi4py import MPI
from nn_reference import (
    Checks,
    bn_ref,
    conv_ref,
    conv_ref_backward,
    empty_cuts,
    grid,
    pool_ref,
)

import disttensor as dt
import disttensor_nn as nn
from disttensor_nn.models import DepthToSpace
from disttensor_nn.plan import CostModel, Planner, apply_plan, load_profile, make_plan
from disttensor_nn.reduction import GradientBuckets
from disttensor_nn.training.checkpoint import load_checkpoint, save_checkpoint

SIZES = [1, 2, 3, 4]
comm = MPI.COMM_WORLD
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
SHAPE = {1: (2, 3, 9), 2: (2, 3, 7, 6), 3: (2, 3, 5, 4, 3)}  # C = 3: empty slices at 4 ranks


def g2(p):
    return {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2)}[p]


def g3(p):
    return {1: (1, 1, 1), 2: (2, 1, 1), 3: (1, 3, 1), 4: (2, 1, 2)}[p]


def cf_layouts(shape):
    """(name, input Distribution, filter_axes) of an (N, C, *S) array for this world size."""
    p = comm.Get_size()
    nd = len(shape) - 2
    free = (None,) * nd
    c_split = [None, empty_cuts(shape[1], p) or None] + [None] * nd
    h = (0,) + (None,) * (nd - 1)
    return [
        ("filter", dt.Distribution(shape, grid((p,)), (None, None) + free), (0,)),
        ("channel", dt.Distribution(shape, grid((p,)), (None, 0) + free), ()),
        ("channel, empty blocks",
         dt.Distribution(shape, grid((p,)), (None, 0) + free, c_split), ()),
        ("gathered C = F", dt.Distribution(shape, grid((p,)), (None, 0) + free), (0,)),
        ("channel x filter", dt.Distribution(shape, grid(g2(p)), (None, 0) + free), (1,)),
        ("C = F + replicas", dt.Distribution(shape, grid(g2(p)), (None, 0) + free), (0,)),
        ("N x C x F", dt.Distribution(shape, grid(g3(p)), (0, 1) + free), (2,)),
        ("H x C = F", dt.Distribution(shape, grid(g2(p)), (None, 1) + h), (1,)),
        ("N x H x C", dt.Distribution(shape, grid(g3(p)), (0, 2) + tuple(
            1 if i == 0 else None for i in range(nd))), ()),
    ]


def block(p, full):
    """This rank's shard of a parameter's full value ``full``."""
    return full if p.dist is None else full[p.dist.local_slices()]


def make_conv(nd, filter_axes, seed=0, **kw):
    conv = CONV[nd](3, 3, 3, stride=2, padding=1, dtype=np.float64, filter_axes=filter_axes,
                    **kw)
    rng = np.random.default_rng(seed)
    conv.weight.data[...] = rng.standard_normal(conv.weight.shape)
    conv.bias.data[...] = rng.standard_normal(conv.bias.shape)
    return conv


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_channel_filter_splits_match_reference(nd):
    shape = SHAPE[nd]
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape)
    check = Checks()
    for name, dist, fa in cf_layouts(shape):
        for overlap in (False, True) if name == "N x C x F" else (False,):
            conv = make_conv(nd, fa, overlap=overlap)
            w, b = conv.weight.data.copy(), conv.bias.data.copy()
            want = conv_ref(x, w, b, 2, [(1, 1)] * nd, 1)
            dy = rng.standard_normal(want.shape)
            dx_want, dw_want, db_want = conv_ref_backward(x, w, dy, 2, [(1, 1)] * nd, 1)
            msg = f"{nd}-D {name} {dist} filter_axes={fa} overlap={overlap}"
            y = conv(dt.DistArray.from_global(x, dist))
            check.close(y, want, msg)
            check.true(y.dist.dim_axes[1] == fa, f"{msg}: output split {y.dist}")
            dx = conv.backward(dt.DistArray.from_global(dy, y.dist))
            check.true(dx.dist == dist, f"{msg}: dx in {dx.dist}")
            check.close(dx, dx_want, f"{msg}: dx")
            check.close(conv.weight.grad, block(conv.weight, dw_want), f"{msg}: dW")
            check.close(conv.bias.grad, block(conv.bias, db_want), f"{msg}: db")
            ranks = int(np.prod([dist.grid_shape[a] for a in {*fa, *dist.dim_axes[1]}]))
            sharded = ranks > 1
            check.true((conv.weight.dist is not None) == sharded,
                       f"{msg}: weight split {conv.weight.dist}")
            check.close(conv.state_dict()["weight"], w, f"{msg}: state_dict weight", 0, 0)
    check.finish()


@pytest.mark.parallel(SIZES)
def test_conv_weight_shard_sizes_and_gradient_communicators():
    """channel x filter: each rank holds weight[F_slice, C_slice]; the shards tile the weight."""
    p = comm.Get_size()
    conv = make_conv(2, (1,))
    dist = dt.Distribution(SHAPE[2], grid(g2(p)), (None, 0, None, None))
    conv(dt.DistArray.from_global(np.ones(SHAPE[2]), dist))
    wd = conv.weight.dist
    sizes = comm.allgather(conv.weight.data.size)
    check = Checks()
    if p > 1:
        check.true(wd.dim_axes[:2] == ((1,), (0,)), f"weight split {wd}")
        check.true(sum(sizes) == 3 * 3 * 9, f"shards {sizes} do not tile the weight")
    check.finish()


@pytest.mark.parallel(SIZES)
def test_conv_channel_filter_bad_arguments():
    p = comm.Get_size()
    shape = SHAPE[2]
    x = dt.DistArray.from_global(np.ones(shape), dt.Distribution(shape, grid((p,)),
                                                                 (None, None, 0, None)))
    with pytest.raises(ValueError, match="also split the input's sample or spatial"):
        make_conv(2, (0,))(x)
    with pytest.raises(ValueError, match="outside the 1-axis grid"):
        make_conv(2, (3,))(x)
    with pytest.raises(TypeError, match="filter_axes"):
        make_conv(2, ("a",))
    xc = dt.DistArray.from_global(np.ones((2, 4, 5, 5)), dt.Distribution(
        (2, 4, 5, 5), grid(g2(p)), (None, (0, 1), None, None)))
    with pytest.raises(ValueError, match="overlap in part"):
        nn.Conv2d(4, 4, 3, dtype=np.float64, filter_axes=(1,))(xc)
    if p > 1:  # channel-parallel grouped (one rank: nothing is split, nothing refused)
        with pytest.raises(ValueError, match="groups=2 with a split channel"):
            nn.Conv2d(4, 4, 3, groups=2, dtype=np.float64)(xc)


@pytest.mark.parallel(SIZES)
def test_grouped_and_depthwise_conv_on_whole_groups():
    """Channels and filters split alike, each rank holding whole groups: no message, the
    reference's values and gradients; any other split of a grouped layer is refused."""
    p = comm.Get_size()
    shape = (2, 24, 5, 4)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape)
    check = Checks()
    layouts = [("C = F", grid((p,)), (None, 0, None, None), (0,)),
               ("N x C = F", grid(g2(p)), (0, 1, None, None), (1,))]
    for groups, f in [(12, 24), (24, 24)]:  # grouped, depthwise
        for name, g, axes, fa in layouts:
            conv = nn.Conv2d(24, f, 3, padding=1, groups=groups, dtype=np.float64,
                             filter_axes=fa)
            w, b = conv.weight.data.copy(), conv.bias.data.copy()
            want = conv_ref(x, w, b, 1, [(1, 1)] * 2, 1, groups)
            dy = rng.standard_normal(want.shape)
            dx_want, dw_want, db_want = conv_ref_backward(x, w, dy, 1, [(1, 1)] * 2, 1, groups)
            dist = dt.Distribution(shape, g, axes)
            msg = f"groups={groups} {name} {dist}"
            y = conv(dt.DistArray.from_global(x, dist))
            check.close(y, want, msg)
            dx = conv.backward(dt.DistArray.from_global(dy, y.dist))
            check.true(dx.dist == dist, f"{msg}: dx in {dx.dist}")
            check.close(dx, dx_want, f"{msg}: dx")
            check.close(conv.weight.grad, block(conv.weight, dw_want), f"{msg}: dW")
            check.close(conv.bias.grad, block(conv.bias, db_want), f"{msg}: db")
            spec = conv.cost_spec(dist)  # priced as it runs: no gather, no sum but dW's
            check.true(spec.redistributions == () and len(spec.allreduces) == 1, msg)
    check.finish()
    if p == 1:
        return
    bad = [(dt.Distribution(shape, grid((p,)), (None, 0, None, None)), ()),  # channel-parallel
           (dt.Distribution(shape, grid((p,)), (None, 0, None, None),
                            (None, [1] * (p - 1), None, None)), (0,))]  # groups cut in two
    for dist, fa in bad:
        conv = nn.Conv2d(24, 24, 3, padding=1, groups=12, dtype=np.float64, filter_axes=fa)
        with pytest.raises(ValueError, match="groups=12 with a split channel or filter"):
            conv(dt.DistArray.from_global(x, dist))


@pytest.mark.parallel(SIZES)
def test_depth_to_space_on_channel_split_input():
    """Channel blocks on multiples of b^2: a local rearrangement, as the NumPy formula; other
    channel splits refused before any message."""
    p = comm.Get_size()
    n, c, h, w, b = 2, 3, 3, 4, 2
    x = np.random.default_rng(9).standard_normal((n, c * b * b, h, w))
    want = x.reshape(n, c, b, b, h, w).transpose(0, 1, 4, 2, 5, 3).reshape(n, c, h * b, w * b)
    cuts = [0, 4, 8][:p - 1]  # channel blocks of 0, 4, 4, 4 (.. 12) channels: whole outputs
    check = Checks()
    for name, g, axes in [("C", grid((p,)), (None, 0, None, None)),
                          ("C x H", grid(g2(p)), (None, 1, 0, None))]:
        pc = g.shape[axes[1]]  # C x H: 8 + 4 channels where two ranks split them
        splits = [None, cuts if name == "C" else [8][:pc - 1] or None, None, None]
        dist = dt.Distribution(x.shape, g, axes, splits)
        layer = DepthToSpace(b)
        y = layer(dt.DistArray.from_global(x, dist))
        check.close(y, want, f"{name}: forward", 0, 0)
        check.true(y.dist.boundaries[1] == tuple(v // 4 for v in dist.boundaries[1]),
                   f"{name}: output channels {y.dist}")
        dy = np.random.default_rng(10).standard_normal(want.shape)
        dx = layer.backward(dt.DistArray.from_global(dy, y.dist))
        # the adjoint of a permutation: <y, dy> = <x, dx>
        check.close(float(np.vdot(dx.to_global(), x)), float(np.vdot(dy, want)), f"{name}: dx")
    check.finish()
    if p > 1:
        dist = dt.Distribution(x.shape, grid((p,)), (None, 0, None, None),
                               (None, [2] * (p - 1), None, None))
        with pytest.raises(ValueError, match="every block boundary must be a multiple of 4"):
            DepthToSpace(b)(dt.DistArray.from_global(x, dist))


# --------------------------------------------------------------------------- other layers
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("stats", ["global", "group"])
def test_batchnorm_on_channel_split_input(stats):
    p = comm.Get_size()
    shape = (4, 3, 5, 4)
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape) * 2 + 1
    gamma, beta = rng.standard_normal(3), rng.standard_normal(3)
    check = Checks()
    for name, dist in [
        ("C", dt.Distribution(shape, grid((p,)), (None, 0, None, None))),
        ("C empty blocks", dt.Distribution(shape, grid((p,)), (None, 0, None, None),
                                           [None, empty_cuts(3, p) or None, None, None])),
        ("N x H x C", dt.Distribution(shape, grid(g3(p)), (0, 2, 1, None))),
    ]:
        bn = nn.BatchNorm2d(3, dtype=np.float64, stats=stats)
        bn.weight.data[...], bn.bias.data[...] = gamma, beta
        y = bn(dt.DistArray.from_global(x, dist))
        dy = rng.standard_normal(shape)
        dx = bn.backward(dt.DistArray.from_global(dy, y.dist))
        sl = dist.local_slices()
        # "group": the ranks that hold the same samples normalise over them alone
        a_, b_ = (0, shape[0]) if stats == "global" else (sl[0].start, sl[0].stop)
        if b_ == a_:
            continue
        y_want, back, mean, uvar = bn_ref(x[a_:b_], gamma, beta, 1e-5)
        dx_want, dg_want, db_want = back(dy[a_:b_])
        rows = slice(sl[0].start - a_, sl[0].stop - a_)
        check.close(y.local, y_want[(rows,) + sl[1:]], f"{stats} {name}: y")
        check.close(dx.local, dx_want[(rows,) + sl[1:]], f"{stats} {name}: dx")
        if stats == "global":
            check.close(bn.weight.grad, dg_want, f"{name}: dgamma")
            check.close(bn.bias.grad, db_want, f"{name}: dbeta")
            check.close(bn.running_mean, 0.1 * mean, f"{name}: running mean")
            check.close(bn.running_var, 0.9 + 0.1 * uvar, f"{name}: running var")
    check.finish()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("op", ["max", "avg"])
def test_pooling_on_channel_split_input(op):
    p = comm.Get_size()
    shape = (2, 3, 7, 6)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape)
    want, dx_of = pool_ref(x, 3, 2, [(1, 1)] * 2, 1, op)
    dy = rng.standard_normal(want.shape)
    dx_want = dx_of(dy)
    cls = nn.MaxPool2d if op == "max" else nn.AvgPool2d
    check = Checks()
    for name, dist in [
        ("C", dt.Distribution(shape, grid((p,)), (None, 0, None, None),
                              [None, empty_cuts(3, p) or None, None, None])),
        ("N x C x H", dt.Distribution(shape, grid(g3(p)), (0, 1, 2, None))),
    ]:
        pool = cls(3, 2, 1)
        y = pool(dt.DistArray.from_global(x, dist))
        check.true(y.dist.dim_axes[1] == dist.dim_axes[1] and
                   y.dist.boundaries[1] == dist.boundaries[1], f"{name}: output {y.dist}")
        check.close(y, want, f"{op} {name}: y")
        check.close(pool.backward(dt.DistArray.from_global(dy, y.dist)), dx_want,
                    f"{op} {name}: dx")
        gap = nn.GlobalAvgPool()
        z = gap(dt.DistArray.from_global(x, dist))
        check.close(z, x.mean(axis=(2, 3)), f"{name}: global average")
        dz = rng.standard_normal(z.shape)
        check.close(gap.backward(dt.DistArray.from_global(dz, z.dist)),
                    np.broadcast_to(dz[:, :, None, None] / 42, shape), f"{name}: global dx")
    check.finish()


@pytest.mark.parallel(SIZES)
def test_linear_row_and_column_parallel():
    """Row-parallel (features split), column-parallel (out_axes), both, and gathered."""
    p = comm.Get_size()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 3))
    w, b = rng.standard_normal((3, 3)), rng.standard_normal(3)
    dy = rng.standard_normal((5, 3))
    check = Checks()
    for name, dist, oa in [
        ("row", dt.Distribution((5, 3), grid((p,)), (None, 0)), ()),
        ("row, empty blocks", dt.Distribution((5, 3), grid((p,)), (None, 0),
                                              [None, empty_cuts(3, p) or None]), ()),
        ("column", dt.Distribution((5, 3), grid((p,)), (None, None)), (0,)),
        ("gathered", dt.Distribution((5, 3), grid((p,)), (None, 0)), (0,)),
        ("N x row x column", dt.Distribution((5, 3), grid(g3(p)), (0, 1)), (2,)),
    ]:
        lin = nn.Linear(3, 3, dtype=np.float64, out_axes=oa)
        lin.weight.data[...], lin.bias.data[...] = w, b
        y = lin(dt.DistArray.from_global(x, dist))
        check.close(y, x @ w.T + b, f"{name}: y")
        lin.zero_grad()
        dx = lin.backward(dt.DistArray.from_global(dy, y.dist))
        check.true(dx.dist == dist, f"{name}: dx in {dx.dist}")
        check.close(dx, dy @ w, f"{name}: dx")
        check.close(lin.weight.grad, block(lin.weight, dy.T @ x), f"{name}: dW")
        check.close(lin.bias.grad, block(lin.bias, dy.sum(axis=0)), f"{name}: db")
    check.finish()


# --------------------------------------------------------------------------- state across splits
@pytest.mark.parallel(SIZES)
def test_state_and_momentum_move_between_splits(tmp_path):
    """Weights and momentum written under one split load under another (and replicated)."""
    p = comm.Get_size()
    shape = SHAPE[2]
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape)
    dist_a = dt.Distribution(shape, grid(g2(p)), (None, 0, None, None))  # channel x filter
    dist_b = dt.Distribution(shape, grid((p,)), (None, None, 0, None))  # H: replicated weights

    def step(conv, opt, dist):
        y = conv(dt.DistArray.from_global(x, dist))
        conv.zero_grad()
        conv.backward(dt.DistArray.from_global(np.ones(y.shape), y.dist))
        opt.step()
        return y.to_global()

    serial = make_conv(2, ())
    sopt = nn.SGD(serial.parameters(), lr=0.01, momentum=0.9)
    one = dt.Distribution(shape, dt.ProcessGrid((1,), MPI.COMM_SELF), (None,) * 4)
    ys, ws = [], []
    for _ in range(3):
        ys.append(step(serial, sopt, one))
        ws.append(serial.weight.data.copy())
    conv = make_conv(2, (1,))
    opt = nn.SGD(conv.parameters(), lr=0.01, momentum=0.9)
    ya = [step(conv, opt, dist_a) for _ in range(2)]
    directory = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None)
    save_checkpoint(directory + "/ck", conv, opt, step=2)
    check = Checks()
    for k in range(2):
        check.close(ya[k], ys[k], f"step {k} under channel x filter", 1e-12, 1e-12)
    # load under another split: a new layer, first sharded by a forward call
    other = make_conv(2, (), seed=9)
    other_opt = nn.SGD(other.parameters(), lr=0.01, momentum=0.9)
    load_checkpoint(directory + "/ck", other, other_opt)
    check.close(other.weight.data, ws[1], "weights loaded under H", 1e-12, 1e-12)
    yb = step(other, other_opt, dist_b)
    check.close(yb, ys[2], "step 3 under H after loading", 1e-12, 1e-12)
    check.close(other.weight.data, serial.weight.data, "weights after step 3", 1e-12, 1e-12)
    # the layer moves back to a channel split: its momentum follows its shards
    step(other, other_opt, dist_a)
    step(serial, sopt, one)
    check.close(other.state_dict()["weight"], serial.weight.data, "after re-splitting",
                1e-12, 1e-12)
    check.close(other_opt.state_dict()["state"][0], sopt.state_dict()["state"][0],
                "momentum after re-splitting", 1e-12, 1e-12)
    # a full state_dict loads into a sharded layer
    fresh = make_conv(2, (1,), seed=5)
    fresh(dt.DistArray.from_global(x, dist_a))
    fresh.load_state_dict(serial.state_dict())
    check.close(fresh.weight.data, block(fresh.weight, serial.weight.data), "loaded shard", 0, 0)
    check.finish()


# --------------------------------------------------------------------------- training
STEPS = 20
PROFILE = "v100-nvlink-edr"
TSHAPE = (4, 2, 8, 8)


def make_net(g=None, a_f=()):
    f64 = np.float64
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, dtype=f64, filter_axes=a_f),  # F split
        nn.BatchNorm2d(4, dtype=f64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1, dtype=f64, filter_axes=a_f),  # gathered C = F
        nn.BatchNorm2d(4, dtype=f64), nn.ReLU(),
        nn.Conv2d(4, 4, 1, dtype=f64),  # channel-parallel: partial sums allreduced
        nn.GlobalAvgPool(), nn.Linear(4, 3, dtype=f64),
    )
    rng = np.random.default_rng(30)
    for prm in net.parameters():
        prm.data[...] = rng.standard_normal(prm.shape) * 0.5
    return net


#: Per layer of make_net: the input's channels split (S) or whole (R) over the channel axis,
#: and for a convolution the output's after it: filter-parallel (RS), channel-parallel (SR),
#: replicated (RR) and, in the second, filter-parallel on the gathered input (SS).
MODE_PLANS = {"modes": ["RS", "S", "S", "S", "SR", "R", "R", "RS", "S", "S"],
              "modes 2": ["RR", "R", "R", "R", "RS", "S", "S", "SS", "S", "S"]}


def mode_plan(net, p, modes):
    """A plan of ``net`` on grid (1, p, 1, 1) with the convolutions in the given modes."""
    planner = Planner(net, TSHAPE, CostModel(load_profile(PROFILE), p), channels=True)
    if p == 1:
        return planner.uniform_plan((1, 1, 1, 1))
    state = {"S": planner.states.index(((1, p, 1, 1), True)),
             "R": planner.states.index(((1, p, 1, 1), False))}
    assign = {}
    for node, m in zip(planner.nodes, modes):
        io = [state[ch] for ch in m]
        assign[id(node)] = io[0] if len(io) == 1 else tuple(io)
    return planner.assignment_plan(assign)


def train(dist, a_f=(), buckets=False, planned=False):
    net = make_net(a_f=a_f)
    if planned:  # as the planner applies it
        p = comm.Get_size()
        if planned is True:  # every layer split over the channels
            planner = Planner(net, TSHAPE, CostModel(load_profile(PROFILE), p), channels=True)
            apply_plan(net, planner.uniform_plan((1, p, 1, 1)), TSHAPE)
        else:
            plan = mode_plan(net, p, MODE_PLANS[planned.removesuffix(", N last")])
            want = ["gathered", "channel", "filter", "replicated"] if p > 1 else [""]
            assert {e.mode for e in plan.entries if e.layer == "Conv2d"} <= set(want)
            if planned.endswith("N last"):  # grids laid out (C, S.., N): C is grid axis 0
                plan.inner = "sample"
            apply_plan(net, plan, TSHAPE)
    opt = nn.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss_fn = nn.SoftmaxCrossEntropy()
    rng = np.random.default_rng(31)
    x = rng.standard_normal(TSHAPE)
    labels = np.argmax(x[:, 0, :, :3].mean(axis=(1, 2))[:, None] * [1, -1, 0.5], axis=1)
    losses = []
    for _ in range(STEPS):
        out = net(dt.DistArray.from_global(x, dist))
        losses.append(loss_fn(out, labels))
        opt.zero_grad()
        if buckets:
            with GradientBuckets(bucket_bytes=256):
                net.backward(loss_fn.backward())
        else:
            net.backward(loss_fn.backward())
        opt.step()
    if isinstance(planned, str) and comm.Get_size() > 1:  # the split modes held shards
        convs = [m for m in net if isinstance(m, nn.Conv2d)]
        modes = [m for m in MODE_PLANS[planned.removesuffix(", N last")] if len(m) == 2]
        for conv, m in zip(convs, modes):
            assert (conv.weight.dist is None) == (m == "RR"), (planned, m)
    return np.array(losses), net.state_dict()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("variant", ["N x F", "F, C = F, buckets", "planned C", "modes",
                                     "modes 2", "modes, N last"])
def test_training_with_channel_filter_splits_matches_one_process(variant):
    p = comm.Get_size()
    serial = dt.Distribution(TSHAPE, dt.ProcessGrid((1,), MPI.COMM_SELF), (None,) * 4)
    want, want_state = train(serial)
    if variant == "N x F":
        dist = dt.Distribution(TSHAPE, grid(g2(p)), (0, None, None, None))
        losses, state = train(dist, a_f=(1,))
    elif variant == "planned C":
        dist = dt.Distribution(TSHAPE, grid((p,)), (0, None, None, None))
        losses, state = train(dist, planned=True)
    elif variant.startswith("modes"):  # planned filter-, channel-parallel, replicated convs
        dist = dt.Distribution(TSHAPE, grid((p,)), (None,) * 4)
        losses, state = train(dist, planned=variant)
    else:
        dist = dt.Distribution(TSHAPE, grid((p,)), (None,) * 4)
        losses, state = train(dist, a_f=(0,), buckets=True)
    check = Checks()
    check.true(np.ptp(want) > 0.1, f"training changes nothing: {want}")
    check.close(losses, want, f"{variant}: loss curve", rtol=1e-10, atol=1e-12)
    for k in want_state:
        check.close(state[k], want_state[k], f"{variant}: {k}", rtol=1e-9, atol=1e-11)
    check.finish()


# --------------------------------------------------------------------------- planner
def wide_net():
    return nn.Sequential(nn.Conv2d(64, 512, 3, padding=1), nn.BatchNorm2d(512), nn.ReLU(),
                         nn.Conv2d(512, 512, 3, padding=1), nn.BatchNorm2d(512), nn.ReLU(),
                         nn.GlobalAvgPool(), nn.Linear(512, 10))


def twin_of(spec):
    """(in, out) channels of the convolution a cost spec's kernels are timed as."""
    return (spec.twin.in_channels, spec.twin.out_channels) if spec.twin else None


def test_conv_cost_spec_under_a_channel_split():
    """Hand-computed: the gather, a quarter of the work and of the weight-gradient bytes."""
    conv = nn.Conv2d(64, 512, 3, padding=1, filter_axes=(1,))
    dist = dt.Distribution((4, 64, 14, 14), (1, 4, 2, 1), (0, 1, 2, 3))
    spec = conv.cost_spec(dist)
    params = 512 * 64 * 9 + 512
    assert spec.share == 1 and twin_of(spec) == (64, 128)  # 64 channels into 128 filters
    assert spec.redistributions == (dt.Distribution((4, 64, 14, 14), (1, 4, 2, 1),
                                                    (0, None, 2, 3)),)
    assert len(spec.allreduces) == 1 and spec.allreduces[0].gradient
    assert spec.allreduces[0].nbytes == params * 4 / 4 and spec.allreduces[0].dims == (0, 2, 3)
    # the gathered block, one halo (or padding) cell on each side of H and W
    assert spec.local_shape == (4, 64, 9, 16)
    assert spec.flops == 2.0 * 4 * 128 * 7 * 14 * 64 * 9  # a quarter of the filters
    assert spec.saved == (4 * 64 * 9 * 16 - 4 * 64 * 7 * 14) * 4 + 4 * 64 * 7 * 14 * 4


def test_planner_splits_channels_where_its_model_says_they_pay():
    net = wide_net()
    shape = (4, 64, 14, 14)
    prof = load_profile(PROFILE)
    plain = Planner(net, shape, CostModel(prof, 16)).plan()
    cf = Planner(net, shape, CostModel(prof, 16), channels=True).plan()
    assert cf.time < plain.time
    assert all(len(e.grid) == 4 for e in cf.entries)
    assert any(e.grid[1] > 1 for e in cf.entries if e.layer == "Conv2d")
    assert "grid (N,C,S..)" in cf.table() and "grid (N,S..)" in plain.table()
    # more candidates never give a slower plan, though the overlapped DP is approximate
    for p in (2, 8):
        plain = Planner(net, shape, CostModel(prof, p)).plan()
        assert Planner(net, shape, CostModel(prof, p), channels=True).plan().time <= \
            plain.time * (1 + 1e-12)
    # one rank: nothing to split, the same plan either way
    one = Planner(net, shape, CostModel(prof, 1), channels=True).plan()
    assert one.time == pytest.approx(Planner(net, shape, CostModel(prof, 1)).plan().time)


def test_conv_cost_spec_of_each_mode():
    """Hand-computed shares, sums and kept bytes of channel-, filter-parallel and replicated."""
    params = 512 * 64 * 9 + 512
    grid_shape = (1, 4, 2, 1)
    split = dt.Distribution((4, 64, 14, 14), grid_shape, (0, 1, 2, 3))
    whole = dt.Distribution((4, 64, 14, 14), grid_shape, (0, None, 2, 3))
    # channel-parallel: a quarter of the input channels, every filter; the output summed
    spec = nn.Conv2d(64, 512, 3, padding=1).cost_spec(split)
    assert twin_of(spec) == (16, 512) and spec.redistributions == ()
    assert spec.local_shape == (4, 16, 9, 16)  # timed as a 16-channel convolution
    assert spec.flops == 2.0 * 4 * 512 * 7 * 14 * 16 * 9
    grad, out = spec.allreduces
    assert grad.gradient and grad.nbytes == params * 4 / 4 and grad.dims == (0, 2, 3)
    assert not out.gradient and out.dims == (1,) and out.nbytes == 4 * 512 * 7 * 14 * 4
    assert spec.saved == (4 * 16 * 9 * 16 - 4 * 16 * 7 * 14) * 4  # halo growth of 16 channels
    # filter-parallel on whole channels: a quarter of the filters; the input gradient summed
    spec = nn.Conv2d(64, 512, 3, padding=1, filter_axes=(1,)).cost_spec(whole)
    assert twin_of(spec) == (64, 128) and spec.redistributions == ()
    assert spec.local_shape == (4, 64, 9, 16) and spec.flops == 2.0 * 4 * 128 * 7 * 14 * 64 * 9
    grad, dx = spec.allreduces  # dims: the channels are whole, dimension 1 splits nothing
    assert grad.nbytes == params * 4 / 4 and grad.dims == (0, 1, 2, 3)
    assert not dx.gradient and dx.dims == () and dx.axes == (1,)
    assert dx.nbytes == 4 * 64 * 7 * 14 * 4
    assert spec.saved == (4 * 64 * 9 * 16 - 4 * 64 * 7 * 14) * 4
    # replicated: the whole layer on each of the 4 replicas
    spec = nn.Conv2d(64, 512, 3, padding=1).cost_spec(whole)
    assert spec.twin is None and len(spec.allreduces) == 1
    assert spec.allreduces[0].nbytes == params * 4
    # uneven: 6 input channels over 4 ranks, the largest slice holds 2
    spec = nn.Conv2d(6, 8, 1).cost_spec(dt.Distribution((2, 6, 4, 4), (1, 4, 1, 1),
                                                        (0, 1, 2, 3)))
    assert twin_of(spec) == (2, 8)
    assert spec.allreduces[0].nbytes == pytest.approx((8 * 6 + 8) * 4 * 2 / 6)


def test_cost_model_prices_each_mode_by_hand():
    """The LayerCost of a 1x1 convolution (no halo) in every mode, from the profile's formulas."""
    prof = load_profile(PROFILE)
    cm = CostModel(prof, 8, overlap=False)  # two nodes of 4: C inside one, N across both
    assert prof.node_size == 4
    conv = nn.Conv2d(64, 32, 1)
    shape, cand = (4, 64, 14, 14), (2, 4, 1, 1)
    params = (32 * 64 + 32) * 4
    block_in, block_out = 2 * 64 * 14 * 14 * 4, 2 * 32 * 14 * 14 * 4

    def price(filter_axes, split, split_out):
        conv.filter_axes = filter_axes
        return cm.layer(conv, shape, cand, split, split_out)

    def kernels(c, cin, f):  # the rate model on the rank's (2, cin, 14, 14) -> (2, f, 14, 14)
        t = prof.kernel_time(2.0 * 2 * f * 14 * 14 * cin, (2 * cin + 2 * f) * 14 * 14 * 4)
        assert c.fwd == pytest.approx(t) and c.bwd == pytest.approx(2 * t)

    # gathered: the allgather along C forward (3 peers send 3/4 of the block), its adjoint back
    c = price((1,), True, True)
    gather = prof.alltoall(block_in * 3 / 4, 3, inter=True)
    assert c.comm == pytest.approx(prof.allreduce(params / 4, 2, 1) + 2 * gather)
    kernels(c, 64, 8)
    # channel-parallel: the whole output block summed over the 4 channel ranks
    c = price((), True, False)
    assert c.comm == pytest.approx(prof.allreduce(params / 4, 2, 1) +
                                   prof.allreduce(block_out, 4, 4))
    kernels(c, 16, 32)
    # filter-parallel: the whole input gradient summed over the 4 filter ranks
    c = price((1,), False, True)
    assert c.comm == pytest.approx(prof.allreduce(params / 4, 2, 1) +
                                   prof.allreduce(block_in, 4, 4))
    kernels(c, 64, 8)
    # replicated: the whole weight gradient over the 2 sample ranks only
    c = price((), False, False)
    assert c.comm == pytest.approx(prof.allreduce(params, 2, 1))
    kernels(c, 64, 32)


def test_planner_dp_equals_brute_force_over_modes():
    """Every layer's state and every convolution's mode enumerated: the DP finds the minimum."""
    net = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64),
                        nn.Conv2d(64, 8, 1))
    shape = (2, 16, 8, 8)
    prof = load_profile(PROFILE)
    for p, allowed, slower in [(2, None, 1.0), (2, None, 100.0),
                               (4, [(4, 1, 1, 1), (1, 4, 1, 1), (2, 2, 1, 1), (1, 1, 2, 2)], 1.0)]:
        # slower kernels make splitting the work pay
        slow = dataclasses.replace(prof, peak_flops=prof.peak_flops / slower)
        planner = Planner(net, shape, CostModel(slow, p, overlap=False), allowed=allowed,
                          channels=True)
        n = len(planner.states)
        options = []
        for node in planner.nodes:
            if planner.modal(node):
                options.append([(c, o) for c in range(n) for o in range(n)
                                if planner.states[c][0] == planner.states[o][0]])
            else:
                options.append(list(range(n)))
        best, best_assign = np.inf, None
        for a in itertools.product(*options):
            t = planner.assignment_cost({id(node): v for node, v in zip(planner.nodes, a)})[0]
            if t < best:
                best, best_assign = t, a
        plan = planner.plan()
        assert plan.time == pytest.approx(best, rel=1e-9), (p, slower, best_assign)
        if slower > 1:  # here the model says: gathered filter-parallel, then channel-parallel
            assert [e.mode for e in plan.entries if e.layer == "Conv2d"][:2] == \
                ["gathered", "channel"], plan.table()


def test_planner_prices_grouped_convolutions_only_where_they_run():
    """A depthwise convolution: whole groups per rank (split in, split out) or replicated."""
    net = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU())
    planner = Planner(net, (2, 8, 6, 6), CostModel(load_profile(PROFILE), 4), channels=True)
    node = planner.nodes[0]
    split, whole = (planner.states.index(((1, 4, 1, 1), s)) for s in (True, False))
    assert planner.mode(node, split, split) == "grouped"
    assert np.isfinite(planner.layer_cost(node, split, split).fwd)
    assert np.isfinite(planner.layer_cost(node, whole, whole).fwd)
    assert not np.isfinite(planner.layer_cost(node, split, whole).fwd)  # channel-parallel
    assert not np.isfinite(planner.layer_cost(node, whole, split).fwd)  # filter-parallel
    spec = planner.layer_cost(node, split, split)
    assert spec.comm == 0  # no gather, no partial sums, no weight gradient to share


def test_planner_keeps_depth_to_space_off_channel_splits_it_refuses():
    """64 channels into 8x8 blocks: no channel split of 2 ranks gives whole output channels."""
    net = nn.Sequential(nn.Conv2d(4, 64, 1), DepthToSpace(8))
    planner = Planner(net, (1, 4, 4, 4), CostModel(load_profile(PROFILE), 2), channels=True)
    node = planner.nodes[1]
    split = planner.states.index(((1, 2, 1, 1), True))
    whole = planner.states.index(((1, 2, 1, 1), False))
    assert not np.isfinite(planner.layer_cost(node, split).fwd)  # 32 | 32: cut mid-block
    assert np.isfinite(planner.layer_cost(node, whole).fwd)
    plan = planner.plan()
    assert not (plan.entries[1].grid[1] > 1 and plan.entries[1].split_channels)


@pytest.mark.parallel(SIZES)
def test_one_conv_through_every_layout_its_filter_axes_changed_between_calls():
    """One layer object reused: what it derived for a distribution (``module.derived``) must
    follow each new ``filter_axes`` and each new input distribution, called twice each and
    the first layout again at the end."""
    shape = SHAPE[2]
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape)
    conv = make_conv(2, ())
    w, b = conv.weight.full().copy(), conv.bias.full().copy()
    want = conv_ref(x, w, b, 2, [(1, 1)] * 2, 1)
    dy = rng.standard_normal(want.shape)
    dx_want, dw_want, db_want = conv_ref_backward(x, w, dy, 2, [(1, 1)] * 2, 1)
    check = Checks()
    layouts = cf_layouts(shape)
    for name, dist, fa in [*layouts, layouts[0]]:
        conv.filter_axes = fa
        for call in range(2):
            msg = f"{name} {dist} filter_axes={fa} call {call}"
            conv.zero_grad()
            y = conv(dt.DistArray.from_global(x, dist))
            check.close(y, want, msg)
            check.true(y.dist.dim_axes[1] == fa, f"{msg}: output split {y.dist}")
            dx = conv.backward(dt.DistArray.from_global(dy, y.dist))
            check.close(dx, dx_want, f"{msg}: dx")
            check.close(conv.weight.grad, block(conv.weight, dw_want), f"{msg}: dW")
            check.close(conv.bias.grad, block(conv.bias, db_want), f"{msg}: db")
    check.finish()


def test_make_plan_keeps_to_the_modes_it_is_given():
    """``make_plan(modes=...)`` chooses among those convolution modes alone: the gathered
    mode that it takes for these wide layers when free is not taken when not given."""
    net = nn.Sequential(nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(256, 256, 3, padding=1))
    shape = (1, 256, 32, 32)
    every, _ = make_plan(net, shape, 2, PROFILE, channels=True)
    assert "gathered" in {e.mode for e in every.entries}
    given = ("channel", "replicated")
    kept, _ = make_plan(net, shape, 2, PROFILE, channels=True, modes=given)
    assert {e.mode for e in kept.entries if e.layer == "Conv2d"} <= set(given)
    assert kept.time >= every.time  # fewer choices never plan faster
    with pytest.raises(ValueError, match="modes"):
        make_plan(net, shape, 2, PROFILE, channels=True, modes=("sideways",))
