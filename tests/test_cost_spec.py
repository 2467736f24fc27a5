"""The planner protocol: what each layer states about its work, and how the cost model prices it.

Every built-in layer's :class:`~disttensor_nn.costspec.CostSpec` on one small
case equals values computed by hand (FLOPs, bytes, halo widths, allreduces,
redistributions, memory), their kernel signatures are the cache keys they
always were, and their twins own their parameters. A layer defined here,
outside the library, with its own cost spec is planned with the costs it
states.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import disttensor_nn as nn
import disttensor_nn.plan
from disttensor import DistArray, Distribution
from disttensor_nn.costspec import Allreduce, CostSpec, largest_block
from disttensor_nn.kernels import threads_now
from disttensor_nn.models import DepthToSpace
from disttensor_nn.plan import CostModel, KernelTimer, MachineProfile, Planner

F4 = np.dtype(np.float32)


def profile(**kw) -> MachineProfile:
    base = dict(name="test", p2p_alpha=1e-5, p2p_beta=1e-9, allreduce_alpha=2e-5,
                allreduce_beta=2e-9, alltoall_alpha=3e-5, alltoall_beta=3e-9,
                peak_flops=1e10, efficiency=0.5, mem_bandwidth=1e10, memory_per_rank=2**30)
    base.update(kw)
    return MachineProfile(**base)


def pure(shape, grid) -> Distribution:
    """(N, C, *S) split as the planner's candidates: N by grid axis 0, S_i by axis i."""
    axes = (0, None) if len(shape) == 2 else (0, None, *range(1, len(shape) - 1))
    return Distribution(shape, grid, axes)


# (2, 4, 9, 8) with H split in two: blocks of 5 and 4 rows; the largest block is (2, 4, 5, 8)
X = pure((2, 4, 9, 8), (1, 2, 1))
BLOCK = 2 * 4 * 5 * 8


def test_largest_block():
    assert largest_block(X) == (2, 4, 5, 8)
    assert largest_block(pure((5, 3, 7), (2, 3))) == (3, 3, 3)


def test_conv_spec_by_hand():
    conv = nn.Conv2d(4, 6, 3, padding=1)
    s = conv.cost_spec(X)
    # 'same' 3x3: one halo row each side along the split H, one padding column each side of W
    assert s.halo == ((0, 0), (0, 0), (1, 1), (1, 1))
    assert s.local_shape == (2, 4, 7, 10)
    out = 2 * 6 * 5 * 8  # the largest output block
    assert s.flops == 2 * out * 4 * 9
    assert s.nbytes == (2 * 4 * 7 * 10 + out) * 4
    ext, block = 2 * 4 * 7 * 10 * 4, 2 * 4 * 5 * 8 * 4
    assert s.keeps_input and not s.keeps_output
    assert s.saved == ext - block  # the halo margins grown into the kept input
    # im2col: C*k*k rows, one per output pixel (here all of them: below the 4 MiB tile);
    # forward the columns (the kernel's output is the block), backward the extended
    # gradient and one tile (unit stride: the input gradient is a correlation of dy)
    cols = (4 * 9) * (2 * 5 * 8) * 4
    assert s.forward_workspace == cols
    assert s.workspace == ext + cols
    assert s.kept(block, out * 4) == ext
    params = 6 * 4 * 9 + 6
    assert s.allreduces == (Allreduce(params * 4, (0, 1, 2, 3), gradient=True),)
    assert s.timed and s.redistributions == ()
    grouped = nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False).cost_spec(X, itemsize=8)
    assert grouped.flops == 2 * out * 2 * 9
    # the weight gradients in the parameters' dtype (float32), whatever the activations'
    assert grouped.allreduces == (Allreduce(6 * 2 * 9 * 4, (0, 1, 2, 3), gradient=True),)


def test_pool_specs_by_hand():
    x = pure((2, 4, 8, 8), (1, 2, 1))  # blocks of 4 rows: 2x2 windows never cross them
    s = nn.MaxPool2d(2).cost_spec(x)
    assert s.halo == ((0, 0),) * 4 and s.local_shape == (2, 4, 4, 8)
    assert s.flops == (2 * 4 * 2 * 4) * 4
    assert s.nbytes == (2 * 4 * 4 * 8 + 2 * 4 * 2 * 4) * 4
    # no halo: nothing grown; an 8-byte input index per output kept, the NumPy forward's
    # running offsets, their step and a mask (a byte each per output) and three copies of
    # the indices' chunk (here all of them); backward builds the gradient of the block
    out = 2 * 4 * 2 * 4
    assert s.allreduces == () and s.saved == out * 8
    assert s.workspace == 2 * 4 * 4 * 8 * 4 + out * 3 + 3 * out * 8
    # unsplit rows: the NumPy kernel pads (-inf) a copy of its own, scratch, and keeps no
    # margins; the halo-padded twin on split rows keeps its grown block
    padded = nn.MaxPool2d(3, 2, padding=1)
    own = padded.cost_spec(pure((2, 4, 8, 8), (1, 1, 1)))
    halo = padded.cost_spec(pure((2, 4, 8, 8), (1, 2, 1)))
    assert own.saved == 2 * 4 * 4 * 4 * 8
    assert halo.local_shape == (2, 4, 5, 9)  # a row and a column of halo before the block
    assert halo.saved == (2 * 4 * 5 * 9 - 2 * 4 * 4 * 8) * 4 + 2 * 4 * 2 * 4 * 8
    assert s.keeps_input
    s = nn.AvgPool2d(3, stride=1, padding=1).cost_spec(X)
    assert s.halo == ((0, 0), (0, 0), (1, 1), (1, 1))
    assert s.flops == BLOCK * 9 and s.saved == (2 * 4 * 7 * 10 - BLOCK) * 4
    assert s.workspace == 2 * 4 * 7 * 10 * 4 and s.keeps_input


def test_batchnorm_spec_and_price_by_hand():
    s = nn.BatchNorm2d(4).cost_spec(X)
    assert (s.local_shape, s.flops, s.nbytes, s.saved) == ((2, 4, 5, 8), 8 * BLOCK,
                                                          4 * BLOCK * 4, 0)
    # the input is kept (not the normalised input); backward's scratch is one sample
    assert s.workspace == BLOCK // 2 * 4 and s.keeps_input and not s.keeps_output
    sums = 2 * 4 * 8  # sum and sum of squares per channel, float64
    assert s.allreduces == (Allreduce(sums, (0, 2, 3)),) * 2
    group = nn.BatchNorm2d(4, stats="group").cost_spec(X)
    assert group.allreduces == (Allreduce(sums, (2, 3)),) * 2
    # priced on a (2, 3, 1) grid: global statistics over all 6 ranks, group ones over the 3
    p = profile()
    shape = (4, 4, 9, 8)
    cm = CostModel(p, 6)
    c = cm.layer(nn.BatchNorm2d(4), shape, (2, 3, 1))
    assert c.comm == pytest.approx(2 * p.allreduce(sums, 6))
    c = cm.layer(nn.BatchNorm2d(4, stats="group"), shape, (2, 3, 1))
    assert c.comm == pytest.approx(2 * p.allreduce(sums, 3))


def test_elementwise_specs_by_hand():
    # ReLU: a one-byte mask kept; the output and the gradient written in place, no scratch
    for layer in [nn.ReLU(), nn.LeakyReLU(0.1)]:
        s = layer.cost_spec(X)
        assert s == CostSpec((2, 4, 5, 8), flops=BLOCK, nbytes=2 * BLOCK * 4, saved=BLOCK), layer
    assert nn.Sigmoid().cost_spec(X) == CostSpec(
        (2, 4, 5, 8), flops=4 * BLOCK, nbytes=2 * BLOCK * 4, keeps_output=True,
        workspace=4 * BLOCK * 4)
    assert DepthToSpace(2).cost_spec(X) == CostSpec((2, 4, 5, 8), flops=BLOCK,
                                                    nbytes=2 * BLOCK * 4)


def test_global_pool_flatten_linear_specs_by_hand():
    s = nn.GlobalAvgPool().cost_spec(X)
    assert s.timed and s.nbytes == BLOCK * 4 and s.saved == s.workspace == 0
    assert s.allreduces == (Allreduce(2 * 4 * 8, (2, 3)),)  # (N, C) float64 sums over space
    s = nn.Flatten().cost_spec(X)
    assert not s.timed and s.nbytes == 0 and s.allreduces == ()
    assert s.redistributions == (Distribution((2, 4, 9, 8), (1, 1, 1), (0, None, 1, 2)),)
    assert nn.Flatten().cost_spec(pure((2, 4, 9, 8), (2, 1, 1))).redistributions == ()
    assert nn.Flatten().cost_spec(pure((6, 12), (3, 2, 1))).redistributions == ()
    s = nn.Linear(12, 5).cost_spec(pure((6, 12), (3, 2, 1)))
    assert (s.local_shape, s.flops, s.nbytes, s.saved) == ((2, 12), 2 * 2 * 12 * 5, 24 * 4, 0)
    assert s.keeps_input and s.kept(24 * 4, 10 * 4) == 24 * 4
    # the gradients summed in the parameters' float32, as the weights they update (what
    # sharded state gathers)
    assert s.allreduces == (Allreduce((12 * 5 + 5) * 4, (0,), gradient=True,
                                      weights=(12 * 5 + 5) * 4),)


def test_kernel_signatures_are_the_cache_keys():
    assert nn.Conv2d(4, 6, 3, padding=1).kernel_signature() == \
        "conv2:4>6:k(3, 3)s(1, 1)d(1, 1)g1bTrue"
    assert nn.Conv3d(2, 2, 1, bias=False).kernel_signature() == \
        "conv3:2>2:k(1, 1, 1)s(1, 1, 1)d(1, 1, 1)g1bFalse"
    assert nn.MaxPool2d(2).kernel_signature() == "MaxPool2d:k(2, 2)s(2, 2)d(1, 1)"
    assert nn.AvgPool1d(3, 1, 1).kernel_signature() == "AvgPool1d:k(3,)s(1,)d(1,)"
    assert nn.BatchNorm2d(4, stats="group").kernel_signature() == "bn:4:group"
    assert nn.Linear(12, 5).kernel_signature() == "linear:12>5"
    assert nn.ReLU().kernel_signature() == "ReLU"
    assert DepthToSpace(2).kernel_signature() == "DepthToSpace"
    timer = KernelTimer("t", cache_dir="/nonexistent", measure=False)
    t = "|t{}.{}".format(*threads_now())  # the threads the kernels run on now
    assert timer.key(nn.Linear(12, 5), (2, 12), F4) == "linear:12>5|(2, 12)|<f4|alone" + t
    assert timer.key(nn.ReLU(), (1, 2), F4, 3) == "ReLU|(1, 2)|<f4|seq3" + t


def test_twins_own_their_state_and_drop_padding():
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2)
    twin = conv.local_twin()
    assert type(twin) is nn.Conv2d and twin.spec.padding == ((0, 0), (0, 0))
    assert (twin.spec.kernel, twin.spec.stride, twin.groups) == ((3, 3), (2, 2), 2)
    assert twin.weight is not conv.weight and twin.kernel_signature() == conv.kernel_signature()
    pool = nn.AvgPool2d(3, stride=1, padding=1)
    assert pool.local_twin().spec.padding == ((0, 0), (0, 0))
    bn = nn.BatchNorm2d(4, stats="group")
    twin = bn.local_twin()
    assert twin.running_mean is not bn.running_mean and twin.stats == "group"
    lin = nn.Linear(3, 2, bias=False)
    assert lin.local_twin().bias is None and lin.local_twin().weight is not lin.weight
    relu = nn.ReLU()
    assert type(relu.local_twin()) is nn.ReLU and relu.local_twin() is not relu


class Stencil(nn.Layer):
    """A layer the library does not know: a 5x3 stencil that keeps its input's distribution."""

    def forward(self, x: DistArray) -> DistArray:
        return DistArray(x.local * 2, x.dist)

    def backward(self, dy: DistArray) -> DistArray:
        return DistArray(dy.local * 2, dy.dist)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        n, c, h, w = largest_block(dist)
        return CostSpec((n, c, h + 4, w + 2), flops=15.0 * n * c * h * w,
                        nbytes=2 * n * c * h * w * itemsize,
                        halo=((0, 0), (0, 0), (2, 2), (1, 1)),
                        allreduces=(Allreduce(1000, (0,)),), saved=7, workspace=5)

    def kernel_signature(self) -> str:
        return "stencil:5x3"


def test_custom_layer_is_planned_with_the_costs_it_states():
    p = profile()
    shape = (4, 3, 8, 6)
    model = nn.Sequential(Stencil())
    cm = CostModel(p, 2)
    rate = p.peak_flops * p.efficiency
    # H split: block (4, 3, 4, 6); one halo exchange of 2 rows along H (W is not split)
    plan = Planner(model, shape, cm, allowed=[(1, 2, 1)]).plan()
    (e,) = plan.entries
    assert e.layer == "Stencil" and e.grid == (1, 2, 1)
    # the rate model: the slower of the FLOPs at the rate and the bytes at the bandwidth
    fwd = max(15 * 4 * 3 * 4 * 6 / rate, 2 * 4 * 3 * 4 * 6 * 4 / p.mem_bandwidth)
    assert (e.fwd, e.bwd) == pytest.approx((fwd, 2 * fwd))
    assert e.comm == pytest.approx(2 * (p.p2p_alpha + p.p2p_beta * 4 * 3 * 6 * 4 * 2))
    # kept: 7 saved bytes (the input is not kept); transient: the input and output blocks
    # (4 * 3 * 4 * 6 floats each) and 5 bytes of workspace
    assert e.memory == 7 and e.transient == 2 * 4 * 3 * 4 * 6 * 4 + 5 and e.estimated
    # N split: block (2, 3, 8, 6); no halo exchange, the allreduce over the 2 ranks splitting N
    plan = Planner(model, shape, cm, allowed=[(2, 1, 1)]).plan()
    (e,) = plan.entries
    fwd = max(15 * 2 * 3 * 8 * 6 / rate, 2 * 2 * 3 * 8 * 6 * 4 / p.mem_bandwidth)
    assert (e.fwd, e.bwd) == pytest.approx((fwd, 2 * fwd))
    assert e.comm == pytest.approx(2 * p.allreduce_alpha + 1000 * p.allreduce_beta)
    # planned freely, the cheaper of the two (and of (1, 1, 2)) is chosen
    best = Planner(model, shape, cm).plan()
    assert best.time == pytest.approx(min(Planner(model, shape, cm, allowed=[c]).plan().time
                                          for c in [(2, 1, 1), (1, 2, 1), (1, 1, 2)]))


def test_custom_layer_kernel_time_comes_from_its_signature(tmp_path):
    p = profile(measured=True, cores_per_node=2)
    timer = KernelTimer("t", cache_dir=str(tmp_path), measure=False)
    layer = Stencil()
    timer.table["stencil:5x3|(4, 3, 8, 8)|<f4|alone|t{}.{}".format(*threads_now())] = [
        1e-3, 3e-3, 0.0]
    c = CostModel(p, 2, timer).layer(layer, (4, 3, 8, 6), (1, 2, 1))  # the halo-extended block
    assert (c.fwd, c.bwd, c.estimated) == (1e-3, 3e-3, False)


def test_custom_layer_twin_is_measured_under_its_signature(tmp_path):
    """Planner.calibrate runs the custom layer's twin (the default: a copy) on its block."""
    timer = KernelTimer("t", cache_dir=str(tmp_path))
    planner = Planner(nn.Sequential(Stencil()), (4, 3, 8, 6),
                      CostModel(profile(measured=True), 1, timer), allowed=[(1, 1, 1)])
    assert planner.calibrate(reps=1) == 1
    (key,) = timer.table
    assert key == "stencil:5x3|(4, 3, 12, 8)|<f4|seq1|t{}.{}".format(*threads_now())
    assert all(t > 0 for t in timer.table[key][:2])
    assert timer.table[key][2] == 15.0 * 4 * 3 * 8 * 6


def test_plan_names_no_layer_class():
    """The planner package reaches layers only through the protocol: it imports no layer module."""
    root = Path(disttensor_nn.plan.__file__).parent
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = "." * node.level + (node.module or "")
                assert not target.lstrip(".").startswith(("layers", "models")) and \
                    "disttensor_nn.layers" not in target, f"{path.name} imports {target}"


class BadSpec(Stencil):
    def __init__(self, **spec):
        self.spec = spec

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        return CostSpec(largest_block(dist), **self.spec)


def test_a_spec_that_does_not_fit_its_input_is_refused_clearly():
    cm = CostModel(profile(), 2)
    with pytest.raises(ValueError, match="BadSpec.cost_spec on a 4-D input: halo"):
        cm.layer(BadSpec(halo=((1, 1),) * 3), (4, 3, 8, 6), (1, 2, 1))
    with pytest.raises(ValueError, match="halo"):
        cm.layer(BadSpec(halo=((0, 0),) * 3 + ((-1, 0),)), (4, 3, 8, 6), (1, 2, 1))
    with pytest.raises(ValueError, match=r"allreduce over dimensions \(0, 4\) out of range"):
        cm.layer(BadSpec(allreduces=(Allreduce(8, (0, 4)),)), (4, 3, 8, 6), (1, 2, 1))


def test_a_batch_norm_whose_statistics_other_ranks_share_is_timed_on_that_backward():
    """With the torch kernels a batch norm whose statistics are this rank's alone takes a
    one-call backward, one whose statistics are shared the reduction, a sum over the ranks
    and two passes: its twin is timed on the latter (another kernel signature)."""
    shape = (4, 8, 16, 16)
    bn = nn.BatchNorm2d(8)
    bn.kernel_backend = "torch"
    assert bn.cost_spec(pure(shape, (1, 1, 1))).twin is None
    for grid in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        spec = bn.cost_spec(pure(shape, grid))
        assert spec.twin is not None and spec.twin.shared_statistics, grid
        assert spec.twin.kernel_signature() == bn.kernel_signature() + ":shared"
        assert spec.twin.local_twin().shared_statistics  # the timer's twin of the twin
    group = nn.BatchNorm2d(8, stats="group")
    group.kernel_backend = "torch"
    assert group.cost_spec(pure(shape, (2, 1, 1))).twin is None  # each group's own
    assert group.cost_spec(pure(shape, (2, 2, 1))).twin is not None
    bn.kernel_backend = "numpy"  # NumPy's backward is the same either way
    assert bn.cost_spec(pure(shape, (2, 1, 1))).twin is None
