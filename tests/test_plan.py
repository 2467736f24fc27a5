"""The cost model's arithmetic, the planner's DP against brute force, and the memory budget."""

from __future__ import annotations

import itertools
import json
import math
import os

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor.testing import assert_allclose, collective_assert
from disttensor_nn.layers import norm, sharding
from disttensor_nn.plan import (
    CostModel,
    KernelTimer,
    MachineProfile,
    Plan,
    Planner,
    apply_plan,
    candidates,
)
from disttensor_nn.training.cli import parse_bytes, plan_main

F64 = np.float64


def profile(**kw) -> MachineProfile:
    base = dict(name="test", p2p_alpha=1e-5, p2p_beta=1e-9, allreduce_alpha=2e-5,
                allreduce_beta=2e-9, alltoall_alpha=3e-5, alltoall_beta=3e-9,
                peak_flops=1e10, efficiency=0.5, mem_bandwidth=1e10, memory_per_rank=2**30)
    base.update(kw)
    return MachineProfile(**base)


def test_candidates_are_all_ordered_factorisations():
    for p, k in [(1, 2), (4, 2), (6, 1), (12, 3), (8, 2)]:
        got = sorted(candidates(p, k))
        want = sorted(c for c in itertools.product(range(1, p + 1), repeat=k + 1)
                      if math.prod(c) == p)
        assert got == want


def test_communication_formulas():
    p = profile()
    assert p.p2p(1000) == pytest.approx(1e-5 + 1e-6)
    assert p.p2p(0) == 0
    assert p.allreduce(4000, 4) == pytest.approx(2 * 2 * 2e-5 + 2 * 3 / 4 * 4000 * 2e-9)
    assert p.allreduce(4000, 1) == 0
    assert p.alltoall(1000, 3) == pytest.approx(3 * 3e-5 + 1000 * 3e-9)


def test_conv_cost_by_hand():
    """Conv2d 3x3 'same' on (2, 4, 8, 8) split over H by 2: halo, allreduce and FLOPs."""
    p = profile()
    cm = CostModel(p, 2, overlap=False)  # each layer's gradient allreduce blocks
    conv = nn.Conv2d(4, 6, 3, padding=1)
    c = cm.layer(conv, (2, 4, 8, 8), (1, 2, 1))
    # forward halo: one face of width 1 each way along H: N*C*W = 2*4*8 floats; backward alike
    face = 2 * 4 * 8 * 4
    params = 6 * 4 * 9 + 6
    assert c.comm == pytest.approx(2 * p.p2p(face) + p.allreduce(params * 4, 2))
    # FLOPs on the local output (2, 6, 4, 8) with the rate model (no timer)
    flops = 2.0 * (2 * 6 * 4 * 8) * 4 * 9
    ext = 2 * 4 * (4 + 2) * (8 + 2)  # the local input with its halo and the W padding
    t = max(flops / (p.peak_flops * p.efficiency), (ext + 2 * 6 * 4 * 8) * 4 / p.mem_bandwidth)
    assert c.fwd == pytest.approx(t) and c.bwd == pytest.approx(2 * t)
    # sample split: no halo, same allreduce
    c = cm.layer(conv, (2, 4, 8, 8), (2, 1, 1))
    assert c.comm == pytest.approx(p.allreduce(params * 4, 2))


def test_shuffle_by_hand():
    """N-split -> H-split of (4, 2, 8, 8) on 2 ranks: each rank receives half its block."""
    p = profile()
    cm = CostModel(p, 2)
    from disttensor_nn.plan.costmodel import dist_for

    t = cm.shuffle((4, 2, 8, 8), dist_for((4, 2, 8, 8), (2, 1, 1)), (1, 2, 1))
    assert t == pytest.approx(p.alltoall(2 * 2 * 4 * 8 * 4, 1))
    assert cm.shuffle((4, 2, 8, 8), dist_for((4, 2, 8, 8), (2, 1, 1)), (2, 1, 1)) == 0


LAYERS = st.sampled_from(["conv", "convs2", "bn", "relu", "pool", "res", "resconv"])


def build(kinds: list[str], c: int = 4) -> nn.Sequential:
    layers = []
    for i, k in enumerate(kinds):
        if k == "conv":
            layers.append(nn.Conv2d(c, c, 3, padding=1, seed=i))
        elif k == "convs2":
            layers.append(nn.Conv2d(c, c, 3, stride=2, padding=1, seed=i))
        elif k == "bn":
            layers.append(nn.BatchNorm2d(c))
        elif k == "relu":
            layers.append(nn.ReLU())
        elif k == "pool":
            layers.append(nn.MaxPool2d(2))
        elif k == "res":
            layers.append(nn.Residual(nn.Sequential(nn.Conv2d(c, c, 3, padding=1, seed=i),
                                                    nn.ReLU()), None, nn.ReLU()))
        else:
            layers.append(nn.Residual(nn.Conv2d(c, c, 3, stride=2, padding=1, seed=i),
                                      nn.Conv2d(c, c, 1, stride=2, seed=i + 100)))
    return nn.Sequential(*layers)


@settings(max_examples=25, deadline=None)
@given(kinds=st.lists(LAYERS, min_size=1, max_size=5), nprocs=st.sampled_from([2, 4]),
       alpha=st.floats(1e-7, 1e-2), beta=st.floats(1e-12, 1e-7), flops=st.floats(1e6, 1e12),
       size=st.sampled_from([8, 12, 16]), batch=st.sampled_from([1, 2, 4]))
def test_dp_equals_brute_force(kinds, nprocs, alpha, beta, flops, size, batch):
    model = build(kinds)
    try:
        model.output_shape((batch, 4, size, size))
    except ValueError:  # windows larger than their input: such a network is refused
        assume(False)
    prof = profile(p2p_alpha=alpha, p2p_beta=beta, allreduce_alpha=2 * alpha,
                   allreduce_beta=beta, alltoall_alpha=alpha, alltoall_beta=3 * beta,
                   peak_flops=flops)
    cost = CostModel(prof, nprocs, overlap=False)  # additive: the DP is exact
    planner = Planner(model, (batch, 4, size, size), cost)
    if len(planner.cands) ** len(planner.nodes) > 20000:
        planner = Planner(model, (batch, 4, size, size), cost,
                          allowed=[(nprocs, 1, 1), (1, nprocs, 1), (1, 1, nprocs)])
    nodes = planner.nodes
    n = len(planner.cands)
    brute = min(planner.assignment_cost({id(node): c for node, c in zip(nodes, a)})[0]
                for a in itertools.product(range(n), repeat=len(nodes)))
    plan = planner.plan()
    assert plan.time == pytest.approx(brute, rel=1e-9, abs=1e-15)
    # the plan's own accounting adds up: entries plus shuffles
    total = sum(e.fwd + e.bwd + e.comm for e in plan.entries)
    assert total <= plan.time + 1e-12


def test_memory_budget_forces_spatial_split():
    """A large sample that one rank cannot hold: the planner splits it spatially."""
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
    shape = (1, 8, 256, 256)
    cm = CostModel(profile(), 4)
    free = Planner(model, shape, cm).plan()
    one_rank = Planner(model, shape, CostModel(profile(), 1)).plan().peak_memory
    budget = 0.6 * one_rank  # the transient im2col tile does not shrink with the split
    plan = Planner(model, shape, cm, budget).plan()
    assert plan.peak_memory <= budget
    assert all(math.prod(e.grid[1:]) > 1 for e in plan.entries)  # every layer splits space
    assert free.time <= plan.time + 1e-15
    with pytest.raises(ValueError, match="fits"):
        Planner(model, shape, CostModel(profile(), 4), memory_budget=1e3).plan()


def test_per_layer_filter_drops_candidates_that_cannot_fit():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1))
    shape = (4, 4, 64, 64)
    cm = CostModel(profile(), 4)
    planner = Planner(model, shape, cm, memory_budget=None)
    costs = [planner.layer_cost(planner.nodes[0], i) for i in range(len(planner.cands))]
    mems = {c: lc.memory + lc.transient for c, lc in zip(planner.cands, costs)}
    budget = min(mems.values()) + planner.base_memory + 1
    plan = Planner(model, shape, cm, budget).plan()
    assert mems[plan.entries[0].grid] == min(mems.values())


def test_plan_json_round_trip_and_table():
    model = build(["conv", "bn", "relu", "res", "convs2"])
    plan = Planner(model, (2, 4, 16, 16), CostModel(profile(), 4)).plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    text = plan.table()
    assert "predicted time per iteration" in text and str(plan.entries[0].grid) in text


def test_cli_prints_and_writes_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["mesh-small", "--ranks", "4", "--batch", "2", "--size", "64x64",
                      "--machine", "v100-nvlink-edr", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted time per iteration" in text
    plan = Plan.from_json(out.read_text())
    assert plan.nprocs == 4 and plan.batch_shape == (2, 18, 64, 64)
    assert json.loads(out.read_text())["machine"] == "v100-nvlink-edr"
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("1.5GB") == 1.5e9
    assert parse_bytes("512") == 512


@pytest.mark.parallel([1, 2, 3, 4])
@pytest.mark.parametrize("inner", ["space", "sample"])
def test_applied_plan_trains_like_one_rank(inner):
    """A plan (mixed distributions) applied to a model gives the 1-rank forward and gradients,
    with the grids laid on the ranks either way (spatial or sample splits inside a node)."""
    comm = MPI.COMM_WORLD
    p = comm.Get_size()

    def model():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, dtype=F64, seed=1),
                             nn.BatchNorm2d(4, dtype=F64), nn.ReLU(),
                             nn.Conv2d(4, 4, 3, stride=2, padding=1, dtype=F64, seed=2),
                             nn.GlobalAvgPool(), nn.Linear(4, 3, dtype=F64, seed=3))

    shape = (4, 3, 12, 10)
    m = model()
    cost = CostModel(profile(), p)
    cost.inner = inner
    planner = Planner(m, shape, cost)
    # alternate distributions layer by layer to exercise the shuffles
    nodes = planner.nodes
    assign = {id(node): i % len(planner.cands) for i, node in enumerate(nodes)}
    t, mem = planner.assignment_cost(assign)
    plan = planner._make_plan(assign, t, mem, [])
    assert plan.inner == inner
    plan = Plan.from_json(plan.to_json())
    apply_plan(m, plan, shape)
    for node, entry in zip(nodes, plan.entries):  # the sample split's grid axis is the last
        dist = node.layer.layout.distribution(node.in_shape)
        assert dist.nblocks[0] == entry.grid[0]
        if inner == "sample" and len(entry.grid) > 1:
            assert dist.dim_axes[0] == (len(entry.grid) - 1,), (entry.grid, dist)
    rng = np.random.default_rng(0)
    a = rng.standard_normal(shape)
    labels = np.array([0, 2, 1, 2])
    x = dt.DistArray.from_global(a, nodes[0].layer.layout.distribution(shape))
    loss_fn = nn.SoftmaxCrossEntropy()
    loss = loss_fn(m.forward(x), labels)
    dx = m.backward(loss_fn.backward())
    ref = model()
    g1 = dt.ProcessGrid((1, 1, 1), MPI.COMM_SELF)
    x1 = dt.DistArray.from_global(a, dt.Distribution(shape, g1, (0, None, 1, 2)))
    ref_loss = loss_fn(ref.forward(x1), labels)
    ref_dx = ref.backward(loss_fn.backward()).local
    collective_assert(abs(loss - ref_loss) < 1e-12, f"loss {loss} vs {ref_loss}")
    assert_allclose(dx, ref_dx, rtol=1e-10, atol=1e-12)
    for q, r in zip(m.parameters(), ref.parameters()):
        assert_allclose(q.grad, r.grad, rtol=1e-9, atol=1e-12)


def _small_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))


def test_contention_applies_only_to_times_taken_on_fewer_ranks(tmp_path):
    """A time measured with all ranks running is used as is; one taken alone is scaled."""
    layer = nn.ReLU()
    prof = profile(measured=True, cores_per_node=2)
    timer = KernelTimer("t", cache_dir=str(tmp_path), measure=False)
    f4 = np.dtype(np.float32)
    local = (1, 4, 8, 8)  # N split 4 ways: blocks of 1 sample (the largest block)
    timer.table[timer.key(layer, local, f4)] = [1e-3, 2e-3, 0.0]
    c = CostModel(prof, 4, timer).layer(layer, (4, 4, 8, 8), (4, 1, 1))
    assert (c.fwd, c.bwd) == pytest.approx((2e-3, 4e-3))
    timer.table[timer.key(layer, local, f4, 4)] = [3e-3, 5e-3, 0.0]  # in sequence, 4 at once
    c = CostModel(prof, 4, timer).layer(layer, (4, 4, 8, 8), (4, 1, 1))
    assert (c.fwd, c.bwd) == pytest.approx((3e-3, 5e-3))
    timer.table[timer.key(layer, local, f4, 1)] = [7e-3, 9e-3, 0.0]  # in sequence, alone
    c = CostModel(prof, 4, timer).layer(layer, (4, 4, 8, 8), (4, 1, 1))
    assert (c.fwd, c.bwd) == pytest.approx((3e-3, 5e-3))  # the 4-rank one wins
    del timer.table[timer.key(layer, local, f4, 4)]
    c = CostModel(prof, 4, timer).layer(layer, (4, 4, 8, 8), (4, 1, 1))
    assert (c.fwd, c.bwd) == pytest.approx((14e-3, 18e-3))


def test_layers_that_communicate_are_priced_until_the_ranks_meet(tmp_path):
    """Where ranks share cores, the timer keeps each layer's time until a barrier after it
    too (key + SYNCED); a layer whose kind communicates (a convolution with a halo, a batch
    norm) is priced with it on every layout, an element-wise one with its kernel's alone."""
    from disttensor_nn.plan.timer import SYNCED

    prof = profile(measured=True, cores_per_node=2)
    timer = KernelTimer("t", cache_dir=str(tmp_path), measure=False)
    f4 = np.dtype(np.float32)
    for layer, local in ((nn.ReLU(), (1, 4, 8, 8)), (nn.BatchNorm2d(4), (1, 4, 8, 8)),
                         (nn.Conv2d(4, 4, 3, padding=1), (1, 4, 10, 10))):
        key = timer.key(layer, local, f4, 4)
        timer.table[key] = [1e-3, 2e-3, 0.0]
        timer.table[key + SYNCED] = [4e-3, 6e-3]
        c = CostModel(prof, 4, timer).layer(layer, (4, 4, 8, 8), (4, 1, 1))  # no halo here
        want = (1e-3, 2e-3) if isinstance(layer, nn.ReLU) else (4e-3, 6e-3)
        assert (c.fwd, c.bwd) == pytest.approx(want), type(layer).__name__
        del timer.table[key + SYNCED]  # taken without a barrier: the kernel's time
        c = CostModel(prof, 4, timer).layer(layer, (4, 4, 8, 8), (4, 1, 1))
        assert (c.fwd, c.bwd) == pytest.approx((1e-3, 2e-3))


@pytest.mark.parallel([3])
def test_measure_chain_keeps_the_time_until_the_barrier_where_ranks_share_cores(
        tmp_path, monkeypatch):
    """With more ranks on the node than cores, measure_chain keeps both times of every
    layer, the one until the barrier at least the kernel's; with cores enough, only one."""
    from disttensor_nn.plan import timer as timer_module

    comm = MPI.COMM_WORLD
    f4 = np.dtype(np.float32)
    layers = [(nn.Conv2d(2, 2, 3, padding=1), (1, 2, 12, 12)), (nn.ReLU(), (1, 2, 12, 12))]
    for cores in (1, 64):
        monkeypatch.setattr(timer_module.os, "cpu_count", lambda c=cores: c)
        timer = KernelTimer("t", cache_dir=str(tmp_path / str(cores)), reps=2)
        timer.measure_chain([(layer, shape, f4, 1.0) for layer, shape in layers], comm, reps=2)
        for layer, shape in layers:
            key = timer.key(layer, shape, f4, comm.Get_size())
            both = timer.table.get(key + timer_module.SYNCED)
            if cores == 1:
                ok = both is not None and all(b >= k for b, k in zip(both, timer.table[key][:2]))
            else:
                ok = both is None
            collective_assert(ok, f"{cores} cores: {timer.table[key]}, {both}")


@pytest.mark.parallel([1, 2])
def test_measure_chain_times_the_first_layers_input_out_of_the_caches(tmp_path, monkeypatch):
    """The network's first layer reads the data loader's block, which no layer wrote just
    before: measure_chain evicts the caches before its forward (each round, on every layout
    asked of it and for the planner's copy of it for another kernel backend, within the
    chain's memory), and before no other layer's."""
    from disttensor_nn.plan import timer as timer_module

    comm = MPI.COMM_WORLD
    f4 = np.dtype(np.float32)
    evicted = []
    running = []
    monkeypatch.setattr(timer_module, "_evict_caches", lambda nbytes: evicted.append(nbytes))
    for cls in (nn.Conv2d, nn.ReLU):
        original = cls.forward

        def spy(self, x, original=original):
            running.append((type(self).__name__, tuple(x.local_shape), len(evicted)))
            return original(self, x)

        monkeypatch.setattr(cls, "forward", spy)
    first, relu = nn.Conv2d(2, 2, 3, padding=1), nn.ReLU()
    other = nn.kernels.with_backend(first, "numpy")  # shares its parameters
    queries = [(first, (1, 2, 12, 12), f4, 1.0), (relu, (1, 2, 12, 12), f4, 1.0),
               (other, (1, 2, 6, 12), f4, 1.0), (relu, (1, 2, 6, 12), f4, 1.0),
               (nn.Conv2d(2, 2, 3, padding=1), (1, 2, 4, 12), f4, 1.0)]
    timer = KernelTimer("t", cache_dir=str(tmp_path), reps=2)
    timer.measure_chain(queries, comm, reps=2, max_seconds=1e9, memory=2**22)
    # each forward's count of evictions so far: one more right before each Conv2d's
    grew = [(name, shape, n - (running[i - 1][2] if i else 0))
            for i, (name, shape, n) in enumerate(running)]
    ok = all(d == (1 if name == "Conv2d" and shape != (1, 2, 4, 12) else 0)
             for name, shape, d in grew) and \
        {shape for name, shape, _ in grew if name == "Conv2d"} == {(1, 2, 12, 12),
                                                                   (1, 2, 6, 12),
                                                                   (1, 2, 4, 12)} and \
        all(n <= 2**20 for n in evicted)
    collective_assert(ok, f"{grew} {evicted}")


def _scripted_relu(monkeypatch, script: dict, now: list) -> None:
    """ReLU's passes advance the clock ``now`` by the next time of ``script[kind]``, and the
    kernel timer reads that clock."""
    from disttensor_nn.plan import timer as timer_module
    forward, backward = nn.ReLU.forward, nn.ReLU.backward

    def timed(original, kind):
        def run(self, x):
            now[0] += next(script[kind])
            return original(self, x)
        return run

    monkeypatch.setattr(nn.ReLU, "forward", timed(forward, "forward"))
    monkeypatch.setattr(nn.ReLU, "backward", timed(backward, "backward"))
    monkeypatch.setattr(timer_module.KernelTimer, "_clock", lambda self: now[0])


@pytest.mark.parallel([1, 2])
def test_measure_chain_takes_one_ranks_median_and_several_ranks_mean(tmp_path,
                                                                      monkeypatch):
    """A layer's time is the median of its repetitions for one rank alone (its step is the
    sum of its own layers, reported as a median over steps) and their mean where ranks ran
    at once (their waits for each other are part of the expected step). A clock driven by
    the layer itself: repetitions of 1, 1 and 10 ms forward (2, 2 and 20 backward) after
    two untimed rounds of 50 and 30 (WARM_ROUNDS)."""
    from disttensor_nn.plan import timer as timer_module

    comm = MPI.COMM_WORLD
    f4 = np.dtype(np.float32)
    now = [0.0]
    assert timer_module.WARM_ROUNDS == 2
    script = {"forward": iter([50e-3, 30e-3, 1e-3, 1e-3, 10e-3]),
              "backward": iter([50e-3, 30e-3, 2e-3, 2e-3, 20e-3])}
    _scripted_relu(monkeypatch, script, now)
    monkeypatch.setattr(timer_module.os, "cpu_count", lambda: 64)  # no barrier per layer
    layer, shape = nn.ReLU(), (1, 2, 6, 6)
    timer = KernelTimer("t", cache_dir=str(tmp_path), reps=3)
    timer.measure_chain([(layer, shape, f4, 1.0)], comm, reps=3, max_seconds=1e9)
    got = timer.table[timer.key(layer, shape, f4, comm.Get_size())][:2]
    want = (1e-3, 2e-3) if comm.Get_size() == 1 else (4e-3, 8e-3)
    collective_assert(np.allclose(got, want), f"{got} != {want}")


def test_group_norm_and_global_pooling_are_timed_on_their_twins(tmp_path):
    """Their passes are measured like any kernel's (priced at the memory bandwidth they came
    out several times under their measure): measure_chain times them, and the cost model
    prices them from the cache, not from the rate model."""
    f4 = np.dtype(np.float32)
    gn, gap = nn.GroupNorm(2, 4), nn.GlobalAvgPool()
    shape = (1, 4, 6, 8, 8)
    timer = KernelTimer("t", cache_dir=str(tmp_path), reps=1)
    assert timer.measure_chain([(gn, shape, f4, 1.0), (gap, shape, f4, 1.0)],
                               MPI.COMM_SELF, reps=1) == 2
    for layer in (gn, gap):
        timer.table[timer.key(layer, shape, f4, 1)] = [7e-3, 9e-3, 0.0]
        c = CostModel(profile(measured=True), 1, timer).layer(layer, shape, (1, 1, 1, 1))
        assert (c.fwd, c.bwd) == pytest.approx((7e-3, 9e-3)), type(layer).__name__


@pytest.mark.parametrize("make", [
    lambda: nn.Conv2d(3, 4, 3, padding=1), lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2),
    lambda: nn.ConvTranspose2d(3, 4, 2, stride=2), lambda: nn.BatchNorm2d(3),
    lambda: nn.MaxPool2d(2)])
def test_the_timer_runs_what_a_one_rank_job_runs(make, tmp_path, monkeypatch):
    """The timer's blocks are laid out as a one-rank job's: a twin makes the
    redistributions and reductions the layer makes there, and no others (the channels on
    a grid axis of one rank made a convolution's twin gather its input's channels and sum
    its partial outputs, copies the layer never makes)."""
    layer = make()
    shape = (2, 3 if not isinstance(layer, nn.Conv2d) or layer.groups == 1 else 4, 8, 8)
    calls: list[str] = []
    for module in (norm, sharding):
        def allreduce(buf, *args, _f=module.allreduce_, _m=module.__name__, **kw):
            calls.append(f"{_m}.allreduce_")
            return _f(buf, *args, **kw)
        monkeypatch.setattr(module, "allreduce_", allreduce)
    redistribute = dt.DistArray.redistribute

    def spy(self, *args, **kw):
        calls.append("redistribute")
        return redistribute(self, *args, **kw)
    monkeypatch.setattr(dt.DistArray, "redistribute", spy)
    dist = dt.Distribution(shape, dt.ProcessGrid((1,), MPI.COMM_SELF), (0, None, None, None))
    x = dt.DistArray.from_global(np.ones(shape, np.float32), dist)
    y = layer.forward(x)
    layer.backward(dt.DistArray(np.ones_like(y.local), y.dist))
    trained = set(calls)
    calls.clear()
    spec = layer.cost_spec(dist)
    timer = KernelTimer("t", cache_dir=str(tmp_path), reps=1)
    timer.measure_chain([(spec.twin or layer, spec.local_shape, np.dtype(np.float32), 1.0)],
                        MPI.COMM_SELF, reps=1)
    assert set(calls) == trained, (calls, trained)


def test_first_layer_is_timed_without_its_input_gradient(tmp_path, monkeypatch):
    """A layer with ``input_grad = False`` (a network's first) has its own timing entry.

    Training runs its backward without the input gradient, so its time must
    not be shared with (or taken from) the same layer that computes one.
    """

    f4 = np.dtype(np.float32)
    shape = (1, 3, 10, 10)
    full, first = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
    first.input_grad = False
    timer = KernelTimer("t", cache_dir=str(tmp_path), reps=1)
    assert timer.key(first, shape, f4, 1) != timer.key(full, shape, f4, 1)
    calls = []
    original = nn.Conv2d.backward

    def backward(self, dy):
        dx = original(self, dy)
        calls.append(dx is None)
        return dx

    monkeypatch.setattr(nn.Conv2d, "backward", backward)
    n = timer.measure_chain([(first, shape, f4, 1.0), (full, shape, f4, 1.0)],
                            MPI.COMM_SELF, reps=1)
    assert n == 2  # two distinct entries, not one shared
    # each round runs the chain backward: the full layer's twin returns dx, the first's none
    assert calls and calls[::2] == [False] * (len(calls) // 2)
    assert calls[1::2] == [True] * (len(calls) // 2)
    assert timer.table[timer.key(first, shape, f4, 1)][:2] != [0.0, 0.0]


def test_warm_up_runs_every_layer_and_leaves_the_model_alone(monkeypatch):
    """warm_up runs each layer's twin forward and backward once on a small block, also
    where the padded input is all a window fits in, and changes nothing of the model."""
    from disttensor_nn.plan.planner import leaf_nodes, trace
    from disttensor_nn.plan.timer import warm_up

    model = nn.Sequential(nn.Conv2d(3, 8, 5, padding=2), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(8, 4, 3, padding=1))
    shape = (6, 3, 3, 70)  # H shorter than the first kernel: only its padding makes it fit
    before = [p.data.copy() for p in model.parameters()]
    stats = (model[1].running_mean.copy(), model[1].running_var.copy())
    runs: list[tuple[str, str, tuple[int, ...]]] = []

    def spy(original, name):
        def run(self, x):
            runs.append((type(self).__name__, name, tuple(x.shape) if name == "forward" else ()))
            return original(self, x)
        return run

    for cls in (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d):
        for name in ("forward", "backward"):
            monkeypatch.setattr(cls, name, spy(getattr(cls, name), name))
    warm_up([(n.layer, n.in_shape) for n in leaf_nodes(trace(model, shape))])
    forwards = [(k, s) for k, p, s in runs if p == "forward"]
    # every layer, one sample, the first convolution on its padded height (3 + 4) and
    # at most 32 along W (70 + 4)
    assert [k for k, _ in forwards[:5]] == ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d",
                                             "Conv2d"]
    assert forwards[0][1] == (1, 3, 7, 32)
    assert all(s[0] == 1 for _, s in forwards)
    assert sum(p == "backward" for _, p, _ in runs) >= 5
    for p, b in zip(model.parameters(), before):
        assert np.array_equal(p.data, b)
        assert p.grad is None or not np.any(p.grad)  # the twins' gradients are their own
    assert np.array_equal(model[1].running_mean, stats[0])
    assert np.array_equal(model[1].running_var, stats[1])
    assert all(getattr(layer, "_saved", None) is None for layer in model)



@pytest.mark.parallel([1, 2, 3])
def test_the_optimizer_update_is_timed_on_every_rank_and_in_the_plan(tmp_path_factory):
    """Planner.calibrate times the optimizer's update on all ranks at once (the same costs
    on every rank, once); the plan's time and compute hold it beside the layers' (a note
    says so), in proportion to this rank's parameters; inference plans and rate profiles
    have none."""
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    cache = comm.bcast(str(tmp_path_factory.mktemp("update")) if comm.rank == 0 else None)
    model = _small_net()
    shape = (4, 3, 12, 10)
    timer = KernelTimer("u", cache_dir=cache)
    timer.update_elements = 2**16
    cost = CostModel(profile(measured=True, cores_per_node=2), p, timer, state_slots=2)
    planner = Planner(model, shape, cost)
    planner.calibrate(comm, reps=2)
    entry = timer.table.get(timer.update_key(2, np.float32, p))
    collective_assert(entry is not None and entry[0] > 0 and entry[1] > 0, f"{entry}")
    assert_allclose(np.array(entry), comm.bcast(np.array(entry)), rtol=0, atol=0)
    collective_assert(not timer.measure_update(2, np.float32, comm), "timed again")
    params = list(model.parameters())
    n = sum(q.data.size for q in params)
    update = entry[0] * len(params) + entry[1] * n
    collective_assert(cost.update_time(model) == pytest.approx(update, rel=1e-12))
    plan = planner.plan()
    layers = sum(e.fwd + e.bwd for e in plan.entries)
    collective_assert(plan.compute == pytest.approx(layers + update, rel=1e-9),
                      f"{plan.compute} {layers} {update}")
    collective_assert(any("optimizer update" in note for note in plan.notes), f"{plan.notes}")
    # sharded optimizer state: this rank's pieces
    sharded = CostModel(profile(measured=True, cores_per_node=2), p, timer, state_slots=2,
                        shard_state="optimizer")
    collective_assert(sharded.update_time(model) == pytest.approx(
        entry[0] * len(params) + entry[1] * int(n / p), rel=1e-12))
    inference = CostModel(profile(measured=True, cores_per_node=2), p, timer, training=False)
    collective_assert(inference.update_time(model) == 0.0)
    collective_assert(CostModel(profile(), p).update_time(model) == 0.0)


@pytest.mark.parallel([1, 2, 3, 4])
def test_calibration_in_network_order(tmp_path_factory):
    """Planner.calibrate measures every layer under every candidate on all ranks at once.

    Every query of every candidate gets a positive time under the key of the
    communicator's size, identical on all ranks; a second call measures
    nothing; the model's parameters and batch-norm statistics are untouched;
    a candidate whose uniform plan exceeds the budget is skipped.
    """

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    cache = comm.bcast(str(tmp_path_factory.mktemp("kernels")) if comm.rank == 0 else None)
    model = _small_net()
    before = [q.data.copy() for q in model.parameters()]
    bn = model[1]
    stats = (bn.running_mean.copy(), bn.running_var.copy())
    shape = (4, 3, 12, 10)
    prof = profile(measured=True, cores_per_node=2)
    timer = KernelTimer("t", cache_dir=cache)
    planner = Planner(model, shape, CostModel(prof, p, timer))
    n = planner.calibrate(comm, reps=2)
    collective_assert(n == len(planner.cands), f"{n} of {len(planner.cands)} candidates")
    for cand in planner.cands:
        queries = planner.kernel_queries(cand)
        collective_assert(0 < len(queries) <= len(planner.nodes), f"{len(queries)} queries")
        for layer, local, dtype, _ in queries:
            entry = timer.table.get(timer.key(layer, local, dtype, p))
            collective_assert(entry is not None, f"{layer} {local} not measured")
            collective_assert(entry[0] > 0 and entry[1] > 0, f"{layer} {local}: {entry}")
    values = np.array(sorted(v[:2] for v in timer.table.values())).ravel()
    assert_allclose(values, comm.bcast(values), rtol=0, atol=0)  # same on every rank
    collective_assert(planner.calibrate(comm) == 0, "measured again")
    for q, b in zip(model.parameters(), before):
        collective_assert(np.array_equal(q.data, b), "calibration changed the model's weights")
    collective_assert(np.array_equal(bn.running_mean, stats[0]) and
                      np.array_equal(bn.running_var, stats[1]), "running statistics changed")
    # a budget below every uniform plan's memory: nothing to measure in sequence
    timer2 = KernelTimer("t2", cache_dir=cache)
    tight = Planner(model, shape, CostModel(prof, p, timer2), memory_budget=1.0)
    collective_assert(tight.calibrate(comm) == 0, "measured over the budget")
    with pytest.raises(ValueError, match="fits"):
        tight.plan()
    collective_assert(not timer2.table, "layers that cannot fit the budget were measured")


@pytest.mark.parallel([1, 3])
def test_make_plan_collective_gives_every_rank_the_same_plan(tmp_path_factory, monkeypatch):
    from disttensor_nn.plan import make_plan

    comm = MPI.COMM_WORLD
    cache = comm.bcast(str(tmp_path_factory.mktemp("home")) if comm.rank == 0 else None)
    from disttensor_nn.plan import timer

    monkeypatch.setattr(timer, "default_cache_dir", lambda: cache)
    path = f"{cache}/prof.json"
    if comm.rank == 0:
        profile(name="prof", measured=True, cores_per_node=2).save(path)
    comm.Barrier()
    plan, planner = make_plan(_small_net(), (4, 3, 12, 10), comm.Get_size(), path, comm=comm)
    texts = comm.allgather(plan.to_json())
    collective_assert(all(t == texts[0] for t in texts), "plans differ between ranks")
    collective_assert((planner is not None) == (comm.rank == 0), "planner on rank 0 only")
    collective_assert(all(e.fwd > 0 for e in plan.entries), "kernel times missing")


def _cupy_with_gpu():
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device
        return None


@pytest.mark.skipif(_cupy_with_gpu() is None, reason="needs CuPy and a GPU")
def test_kernel_timer_measures_gpu_twins(tmp_path):
    """With xp=cupy the twins run on the GPU (synchronised timing), under their own keys."""

    cupy = _cupy_with_gpu()
    timer = KernelTimer("gpu", cache_dir=str(tmp_path), xp=cupy)
    planner = Planner(_small_net(), (4, 3, 12, 10),
                      CostModel(profile(measured=True), 1, timer))
    assert planner.calibrate() == 1
    assert timer.table and all(k.endswith("|cupy") for k in timer.table)
    assert all(v[0] > 0 and v[1] > 0 for v in timer.table.values())
    conv = planner.nodes[0].layer
    f, b, est, _ = timer.times(conv, (2, 3, 14, 12), np.dtype(np.float32), 1e6)  # alone
    assert f > 0 and b > 0 and not est


@pytest.mark.parallel([2, 3])
def test_machine_calibration(tmp_path_factory):
    """calibrate() gives every rank the same profile with positive constants and saves it."""
    from disttensor_nn.plan.calibrate import calibrate
    from disttensor_nn.plan.machine import this_machine_path

    comm = MPI.COMM_WORLD
    cache = comm.bcast(str(tmp_path_factory.mktemp("calib")) if comm.rank == 0 else None)
    prof = calibrate(comm, reps=2, cache_dir=cache)
    same = comm.allgather(prof)
    collective_assert(all(q == prof for q in same), "profiles differ between ranks")
    collective_assert(prof.measured and prof.device == "cpu", str(prof))
    constants = (prof.p2p_alpha, prof.p2p_beta, prof.allreduce_alpha, prof.allreduce_beta,
                 prof.alltoall_alpha, prof.alltoall_beta, prof.peak_flops, prof.mem_bandwidth)
    collective_assert(all(c > 0 and math.isfinite(c) for c in constants), str(constants))
    # the MPI library's temporaries per byte in flight: none, or about one buffer's worth
    collective_assert(0 <= prof.reduce_scratch <= 2, str(prof.reduce_scratch))
    collective_assert(MachineProfile.load(this_machine_path(cache)) == prof, "saved profile")
    with pytest.raises(ValueError, match="at least 2 ranks"):
        calibrate(MPI.COMM_SELF)


@pytest.mark.parallel([2, 3])
def test_a_calibration_cache_that_cannot_be_written_fails_alike(tmp_path_factory):
    """Rank 0 alone writes the cache: where it cannot, every rank raises the same
    OSError (none waits for rank 0 forever)."""
    from disttensor.testing import collective_outcome
    from disttensor_nn.plan.calibrate import calibrate

    comm = MPI.COMM_WORLD
    where = comm.bcast(str(tmp_path_factory.mktemp("unwritable")) if comm.rank == 0
                       else None)
    blocker = os.path.join(where, "a-file")
    if comm.rank == 0:
        with open(blocker, "w") as f:
            f.write("not a directory")
    comm.Barrier()
    _, exc = collective_outcome(calibrate, comm, reps=1, cache_dir=os.path.join(blocker, "c"))
    collective_assert(isinstance(exc, OSError) and "could not be saved" in str(exc),
                      repr(exc))


@pytest.mark.parallel([2, 3])
def test_calibration_holds_for_its_ranks_per_node(tmp_path_factory):
    """A calibration records how many ranks per node took it; a job with another number
    (or a profile that does not say, or cannot be read) is told to calibrate again, the
    same on every rank, unless a calibration kept for its number holds: that one is put
    back."""
    import dataclasses
    import json

    from disttensor_nn.plan.calibrate import (
        METHOD,
        calibrate,
        calibrate_if_stale,
        calibration_path,
        stale_calibration,
    )
    from disttensor_nn.plan.machine import this_machine_path

    comm = MPI.COMM_WORLD
    cache = comm.bcast(str(tmp_path_factory.mktemp("stale")) if comm.rank == 0 else None)
    path = this_machine_path(cache)
    why = stale_calibration(comm, cache_dir=cache)
    collective_assert(why is not None and "no calibration" in why, str(why))
    prof = calibrate(comm, reps=1, cache_dir=cache)
    # every rank of this job shares one node
    collective_assert(prof.calibrated_ranks_per_node == comm.Get_size(), str(prof))
    collective_assert(stale_calibration(comm, cache_dir=cache) is None, "fresh one is stale")
    comm.Barrier()
    if comm.rank == 0:  # the same machine, calibrated by a job with 2 more ranks per node
        dataclasses.replace(prof, calibrated_ranks_per_node=comm.Get_size() + 2).save(path)
    comm.Barrier()
    # the calibration kept for this job's number of ranks per node is put back
    kept = this_machine_path(cache, per_node=comm.Get_size())
    collective_assert(stale_calibration(comm, cache_dir=cache) is None, "kept one not used")
    collective_assert(MachineProfile.load(path) == prof, "another profile put back")
    comm.Barrier()
    if comm.rank == 0:  # and without it, the job is told to calibrate
        os.remove(kept)
        dataclasses.replace(prof, calibrated_ranks_per_node=comm.Get_size() + 2).save(path)
    comm.Barrier()
    why = stale_calibration(comm, cache_dir=cache)
    collective_assert(why is not None and f"{comm.Get_size() + 2} ranks per node" in why
                      and f"this job has {comm.Get_size()}" in why, str(why))
    collective_assert(len(set(comm.allgather(why))) == 1, "ranks disagree")
    comm.Barrier()
    if comm.rank == 0:  # written by a version that did not record it
        with open(path) as f:
            data = json.load(f)
        data.pop("calibrated_ranks_per_node")
        with open(path, "w") as f:
            json.dump(data, f)
    comm.Barrier()
    why = stale_calibration(comm, cache_dir=cache)
    collective_assert(why is not None and "unrecorded" in why, str(why))
    comm.Barrier()
    if comm.rank == 0:  # a file cut short: read on rank 0 alone, told on every rank
        with open(path, "w") as f:
            f.write('{"name": "this:')
    comm.Barrier()
    why = stale_calibration(comm, cache_dir=cache)
    collective_assert(why is not None and "could not be read" in why, str(why))
    comm.Barrier()
    if comm.rank == 0:  # valid JSON, a field of the wrong type
        dataclasses.replace(prof, calibration_method="two").save(path)
    comm.Barrier()
    why = stale_calibration(comm, cache_dir=cache)
    collective_assert(why is not None and "could not be read" in why, str(why))
    comm.Barrier()
    if comm.rank == 0:  # taken by an earlier method (allreduces timed from the caches),
        # and so was the one kept for this many ranks per node: not put back
        dataclasses.replace(prof, calibration_method=METHOD - 1).save(path)
        dataclasses.replace(prof, calibration_method=METHOD - 1).save(kept)
    comm.Barrier()
    why = stale_calibration(comm, cache_dir=cache)
    collective_assert(why is not None and "earlier method" in why, str(why))
    collective_assert(prof.calibration_method == METHOD, str(prof))
    # calibrate_if_stale calibrates then (saying why), and keeps the fresh one after
    why = calibrate_if_stale(comm, cache_dir=cache)
    collective_assert(why is not None and "earlier method" in why, str(why))
    collective_assert(calibrate_if_stale(comm, cache_dir=cache) is None, "calibrated twice")
    comm.Barrier()
    if comm.rank == 0:  # a calibration taken before they were kept: kept when it holds
        os.remove(kept)
    comm.Barrier()
    collective_assert(stale_calibration(comm, cache_dir=cache) is None, "fresh one is stale")
    collective_assert(os.path.exists(kept) and MachineProfile.load(kept) ==
                      MachineProfile.load(path), "the one that holds not kept")
    comm.Barrier()
    if comm.rank == 0:  # and put back where no cached profile is left
        os.remove(path)
    comm.Barrier()
    collective_assert(stale_calibration(comm, cache_dir=cache) is None, "kept one not used")
    collective_assert(calibration_path(comm, cache_dir=cache) == kept, "another path")


# ------------------------------------------------------------ the command line
@pytest.mark.parallel([2, 3])
def test_plan_command_plans_its_job_on_a_calibration_for_its_ranks_per_node(
        monkeypatch, tmp_path_factory, capsys):
    """`disttensor-plan` for its own job on 'this' never plans on a calibration taken with
    another number of ranks per node: the one kept for the job's is put back first."""
    import dataclasses

    from disttensor_nn.plan import machine as machine_module
    from disttensor_nn.plan import timer as timer_module
    from disttensor_nn.plan.calibrate import METHOD
    from disttensor_nn.plan.machine import builtin_profiles, this_machine_path

    comm = MPI.COMM_WORLD
    cache = comm.bcast(str(tmp_path_factory.mktemp("kept")) if comm.rank == 0 else None)
    monkeypatch.setattr(machine_module, "default_cache_dir", lambda: cache)
    monkeypatch.setattr(timer_module, "default_cache_dir", lambda: cache)
    size = comm.Get_size()  # every rank of this job shares one node
    base = dataclasses.replace(builtin_profiles()["v100-nvlink-edr"], measured=True,
                               device="cpu", calibration_method=METHOD)
    if comm.rank == 0:
        dataclasses.replace(base, name="other", calibrated_ranks_per_node=size + 2,
                            p2p_alpha=1e-3).save(this_machine_path())
        dataclasses.replace(base, name="mine", calibrated_ranks_per_node=size).save(
            this_machine_path(per_node=size))
    comm.Barrier()
    path = f"{cache}/plan.json"
    assert plan_main(["mesh-demo", "--size", "32x32", "--batch", "2", "--json", path]) == 0
    comm.Barrier()
    with open(path) as f:
        plan = Plan.from_json(f.read())
    collective_assert(plan.machine == "mine", plan.machine)
    capsys.readouterr()


@pytest.mark.parallel([2, 3])
def test_training_and_prediction_plan_on_the_file_kept_for_their_ranks_per_node(
        monkeypatch, tmp_path_factory, capsys):
    """`disttensor-train` and `disttensor-predict` on 'this' plan on the calibration kept
    for their number of ranks per node, by its own file: a job of another size that
    rewrites the shared cached calibration meanwhile does not change their plan."""
    import dataclasses

    from disttensor_nn.memory import MemoryProfile
    from disttensor_nn.plan import machine as machine_module
    from disttensor_nn.plan.calibrate import METHOD
    from disttensor_nn.plan.machine import builtin_profiles, load_profile, this_machine_path
    from disttensor_nn.training.driver import TrainConfig
    from disttensor_nn.training.inference import PredictConfig, predict_machine
    from disttensor_nn.training.loop import machine_profile

    comm = MPI.COMM_WORLD
    cache = comm.bcast(str(tmp_path_factory.mktemp("race")) if comm.rank == 0 else None)
    monkeypatch.setattr(machine_module, "default_cache_dir", lambda: cache)
    size = comm.Get_size()  # every rank of this job shares one node
    base = dataclasses.replace(builtin_profiles()["v100-nvlink-edr"], measured=True,
                               device="cpu", calibration_method=METHOD)
    mine = dataclasses.replace(base, name="mine", calibrated_ranks_per_node=size)
    other = dataclasses.replace(base, name="other", calibrated_ranks_per_node=size + 2,
                                p2p_alpha=1e-3)
    if comm.rank == 0:
        other.save(this_machine_path())
        mine.save(this_machine_path(per_node=size))
    comm.Barrier()
    found = [machine_profile(TrainConfig(), comm, MemoryProfile()),
             predict_machine(PredictConfig(), comm)]
    comm.Barrier()
    if comm.rank == 0:  # a job of another size calibrates meanwhile
        other.save(this_machine_path())
    comm.Barrier()
    names = [load_profile(m).name for m in found]
    collective_assert(names == ["mine", "mine"], str(names))
    capsys.readouterr()


def test_scaling_command_line_splits_the_step(tmp_path, capsys):
    path = tmp_path / "scaling.json"
    assert plan_main(["mesh-demo", "--machine", "v100-nvlink-edr", "--size", "32x32",
                      "--batch", "2", "--scaling", "1,2,8", "--json", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(word in out[1] for word in ("compute", "exposed", "hidden"))
    rows = json.loads(path.read_text())["rows"]
    assert [r["ranks"] for r in rows] == [1, 2, 8]
    for r in rows:
        assert r["compute_ms"] + r["exposed_ms"] == pytest.approx(r["time_ms"])
        assert r["hidden_ms"] >= 0 and r["exposed_ms"] >= 0
        c, e, _ = r["sample_parallel_split"]
        assert c + e == pytest.approx(r["sample_parallel_ms"])
    assert rows[0]["exposed_ms"] == 0 and rows[0]["hidden_ms"] == 0  # one rank: nothing to send


@pytest.mark.parametrize("ranks", [3, 4, 16])
def test_a_model_whose_small_tensors_lie_on_fewer_ranks_plans(ranks, capsys):
    """CosmoFlow's head (1x1x1 volumes) has layouts over grids of fewer processes than
    the job (the other ranks hold replicas); pricing a redistribution between such a
    layout and one over every rank failed with an IndexError."""
    assert plan_main(["cosmoflow", "--ranks", str(ranks), "--machine", "v100-nvlink-edr"]) == 0
    out = capsys.readouterr().out
    assert f"on {ranks} ranks (v100-nvlink-edr)" in out, out
    # every rank of a 4-rank grid receives the whole block a 1-process layout (held by
    # every rank) asks for, less what it holds: three quarters of it, from three peers
    from disttensor_nn.plan.costmodel import _received, dist_for

    shape = (4, 8, 1, 1, 4)
    split, whole = dist_for(shape, (1, 1, 1, 4)), dist_for(shape, (1, 1, 1, 1))
    assert _received(split, whole) == (96, 3)
    assert _received(whole, split) == (0, 0)  # each rank holds its quarter already


def test_measure_chain_warms_up_once_where_a_round_is_long(tmp_path, monkeypatch):
    """A first untimed round longer than a quarter of the time allowed is the only one: the
    timed rounds follow it (5 s untimed against 8 s allowed, then timed forward
    rounds of 1, 1 and 9 ms; a second untimed round would have taken the first 1 ms
    and left 1 and 9, whose median is 5)."""
    from disttensor_nn.plan import timer as timer_module

    f4 = np.dtype(np.float32)
    now = [0.0]
    script = {"forward": iter([5.0, 1e-3, 1e-3, 9e-3]),
              "backward": iter([0.0, 2e-3, 2e-3, 2e-3])}
    _scripted_relu(monkeypatch, script, now)
    monkeypatch.setattr(timer_module.time, "perf_counter", lambda: now[0])
    layer, shape = nn.ReLU(), (1, 2, 6, 6)
    timer = KernelTimer("t", cache_dir=str(tmp_path), reps=3)
    timer.measure_chain([(layer, shape, f4, 1.0)], MPI.COMM_SELF, reps=3, max_seconds=8.0)
    got = timer.table[timer.key(layer, shape, f4, 1)][:2]
    assert np.allclose(got, (1e-3, 2e-3)), got
