"""The planner's faster search: the same plans as the DP over every state, the same prices."""

from __future__ import annotations

import numpy as np
import pytest

import disttensor_nn as nn
from disttensor_nn.plan import CostModel, MachineProfile, Planner
from disttensor_nn.plan.costmodel import dist_for
from disttensor_nn.plan.planner import GRADIENT_WEIGHTS


def profile(rng: np.random.Generator) -> MachineProfile:
    alpha = 10 ** rng.uniform(-7, -3)
    beta = 10 ** rng.uniform(-11, -8)
    return MachineProfile(name="test", p2p_alpha=alpha, p2p_beta=beta,
                          allreduce_alpha=2 * alpha, allreduce_beta=beta,
                          alltoall_alpha=alpha, alltoall_beta=3 * beta,
                          peak_flops=10 ** rng.uniform(8, 12), efficiency=0.5,
                          mem_bandwidth=1e10, memory_per_rank=2**30, ranks_per_node=2,
                          inter_alpha=4 * alpha, inter_beta=4 * beta)


def network(rng: np.random.Generator, c: int) -> nn.Sequential:
    """A random chain of convolutions, BN, ReLU, pooling and residual blocks ending in
    a Linear layer."""
    layers: list = []
    for i in range(int(rng.integers(2, 5))):
        k = rng.choice(["conv", "bn", "res", "down", "pool"])
        if k == "conv":
            layers += [nn.Conv2d(c, 2 * c, 3, padding=1, seed=i), nn.ReLU()]
            c *= 2
        elif k == "bn":
            layers.append(nn.BatchNorm2d(c))
        elif k == "pool":
            layers.append(nn.MaxPool2d(2))
        elif k == "res":
            layers.append(nn.Residual(nn.Sequential(nn.Conv2d(c, c, 3, padding=1, seed=i),
                                                    nn.BatchNorm2d(c), nn.ReLU()),
                                      None, nn.ReLU()))
        else:
            layers.append(nn.Residual(nn.Conv2d(c, c, 3, stride=2, padding=1, seed=i),
                                      nn.Conv2d(c, c, 1, stride=2, seed=i + 100)))
    return nn.Sequential(*layers, nn.GlobalAvgPool(), nn.Flatten(), nn.Linear(c, 10))


def every_state(planner: Planner, lam: float) -> dict | None:
    """The DP over every state of every layer (no pruning)."""
    planner._prices = planner._node_prices(lam)
    try:
        every = np.arange(len(planner.states))
        return planner._solve_on({id(n): every for n in planner.nodes})[0]
    finally:
        planner._prices, planner._sets = {}, {}


def test_pruned_search_finds_the_plans_of_the_search_over_every_state():
    """On random networks, profiles and rank counts, at every gradient weight, memory
    weight and mask, the pruned DP returns exactly the assignment of the DP over all
    states; on some it prunes."""
    rng = np.random.default_rng(7)
    pruned_some = False
    for case in range(10):
        nprocs = int(rng.choice([4, 6, 8]))
        size = int(rng.choice([8, 12, 16]))  # square images: equal costs under H and W splits
        c = int(rng.choice([4, 6, 8]))
        model = network(rng, c)
        shape = (int(rng.choice([1, 2, 4, 8])), c, size, size)
        try:
            model.output_shape(shape)
        except ValueError:
            continue
        planner = Planner(model, shape, CostModel(profile(rng), nprocs), channels=True)
        masks = [None, np.array([len(g) != 4 or g[1] == 1 for g, _ in planner.states])]
        for inner in planner.placements():
            planner._place(inner)
            for mask in masks:
                planner._mask = mask
                for w in GRADIENT_WEIGHTS:
                    planner._weight = w
                    for lam in (0.0, 1e-9, np.inf):
                        got = planner._solve(lam)
                        pruned_some |= planner.searched < len(planner.states)
                        assert got == every_state(planner, lam), (case, inner, w, lam)
        planner._mask, planner._weight = None, 1.0
    assert pruned_some


def test_redistribution_matrix_equals_each_redistribution():
    """The matrix of shuffle prices is the pairwise prices; the bounds lie below them."""
    rng = np.random.default_rng(3)
    for nprocs, shape in [(4, (3, 5, 7, 9)), (6, (2, 12, 5, 4)), (8, (8, 3, 16, 1))]:
        cost = CostModel(profile(rng), nprocs)
        planner = Planner(nn.Sequential(nn.ReLU()), shape, cost, channels=True)
        dists = [dist_for(shape, *st) for st in planner.states]
        matrix = cost.redistributions(dists, dists)
        pairwise = np.array([[cost.redistribution(s, d) for d in dists] for s in dists])
        assert np.array_equal(matrix, pairwise)
        assert (matrix > 0).any()
        bounds = cost.redistribution_bounds(dists, dists, np.array([0, nprocs - 1]))
        assert (bounds <= matrix).all() and (bounds > 0).any()
        assert np.array_equal(cost.redistribution_bounds(dists, dists, np.arange(nprocs)) > 0,
                              matrix > 0)


@pytest.mark.parametrize("nprocs", [8])
def test_planner_plans_match_the_search_over_every_state(nprocs):
    """The whole plan (every placement, weight and mask kept as the planner keeps them):
    the same entries and time as a planner whose search prunes nothing."""
    rng = np.random.default_rng(11)
    model = network(rng, 8)
    shape = (4, 8, 16, 16)
    prof = profile(rng)
    fast = Planner(model, shape, CostModel(prof, nprocs), channels=True).plan()
    slow_planner = Planner(model, shape, CostModel(prof, nprocs), channels=True)
    slow_planner._solve = lambda lam: every_state(slow_planner, lam)
    slow = slow_planner.plan()
    assert fast.time == slow.time
    assert [(e.grid, e.split_channels, e.mode) for e in fast.entries] == \
        [(e.grid, e.split_channels, e.mode) for e in slow.entries]


def test_a_layer_stays_on_the_grid_that_lays_its_blocks_out_alike():
    """(N, F) activations lie alike (whole on every rank) on the grids (1, 2, 1, 1) and
    (1, 1, 1, 2): the DP ties them and would pick the first; the plan keeps the previous
    layer's grid at the same price, and leaves a grid that splits N as it is."""
    net = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.GlobalAvgPool(),
                        nn.Linear(16, 4))
    planner = Planner(net, (2, 8, 6, 6), CostModel(profile(np.random.default_rng(5)), 2),
                      channels=True)
    channel, width, sample = (planner.states.index((g, True))
                              for g in [(1, 2, 1, 1), (1, 1, 1, 2), (2, 1, 1, 1)])
    for other, moved in [(width, True), (sample, False)]:
        assign = {id(n): channel for n in planner.nodes}
        assign[id(planner.nodes[-1])] = other
        t, mem = planner.assignment_cost(assign)
        got, t2, mem2, _ = planner._steady(assign, t, mem, [])
        assert got[id(planner.nodes[-1])] == (channel if moved else other)
        assert (t2, mem2) == (t, mem) == planner.assignment_cost(got)


def test_a_training_step_pays_each_shuffle_forward_and_backward():
    """Between two layers of different layouts training moves the activation forward and
    its gradient back: the planner's shuffle prices (and their bounds) are twice the one
    move's; an inference pass moves it once."""
    prof = profile(np.random.default_rng(5))
    shape = (4, 6, 8, 8)
    matrices, bounds = {}, {}
    for training in (True, False):
        cost = CostModel(prof, 4, training=training)
        planner = Planner(nn.Sequential(nn.ReLU()), shape, cost)
        dists = [dist_for(shape, *st) for st in planner.states]
        one = cost.redistributions(dists, dists)
        assert (one > 0).any()
        matrices[training] = planner.shuffle_matrix(shape)
        assert np.array_equal(matrices[training], (2 if training else 1) * one)
        bounds[training] = planner._shuffle_bounds(shape)
        assert (bounds[training] <= matrices[training]).all()
    assert np.array_equal(bounds[True], 2 * bounds[False]) and (bounds[False] > 0).any()
