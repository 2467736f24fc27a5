"""The planner: choose every layer's distribution by dynamic programming over the layer graph.

The network is traced into a chain of layers and residual blocks
(:mod:`~disttensor_nn.plan.tracing`). With ``C`` candidate distributions,
each step of the chain is a ``C x C`` matrix of costs (input arriving in
distribution ``a``, layer run in ``c``: the shuffle ``a -> c`` plus the
layer's cost in ``c``); a residual block's matrix is its branch's chain
matrix plus the shortcut's (whose output must meet the branch's in one
distribution, or pay the shuffle). Chaining is a min-plus matrix product
(:mod:`~disttensor_nn.plan.search`), so the cheapest plan is exact for a
step whose costs add up. A per-rank memory budget is met by minimising
``time + lambda * memory`` with the smallest ``lambda`` (found by bisection,
:mod:`~disttensor_nn.plan.budget`) whose plan fits; layers' candidates that
cannot fit even alone are dropped. :class:`Planner` prices the layers and
shuffles, runs those searches and prices their assignments exactly; the
result is a :class:`~disttensor_nn.plan.result.Plan`, which
:func:`~disttensor_nn.plan.apply.apply_plan` lays a model out by.

When gradient reductions overlap backward (``CostModel.overlap``), a step's
time is a critical path (:func:`~disttensor_nn.plan.costmodel.step_time`), a
maximum over layers that no chain of min-plus products minimises exactly.
The planner then solves the additive problem in which each layer pays a
share ``w`` of its gradient reduction (``w`` in :data:`GRADIENT_WEIGHTS`:
from "hidden entirely" to "fully exposed"), prices each solution on the
critical path, and keeps the fastest. Every plan it returns is priced
exactly; only its optimality is approximate (the test suite measures the
gap to brute force on small networks).

The names this module had before its parts moved out (:class:`Node`,
:class:`Block`, :func:`trace`, :func:`leaf_nodes`, :class:`Plan`,
:class:`PlanEntry`, :data:`MODES`, :func:`apply_plan`) are importable from it still.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from ..costspec import largest_block
from ..kernels import optimizer_backend
from ..module import Layer
from ..precision import is_half, precision_of
from .apply import apply_plan
from .budget import fit_budget
from .costmodel import (
    NODE_INNER,
    Candidate,
    CostModel,
    LayerCost,
    StepTime,
    candidates,
    dist_for,
    same_placement,
)
from .evaluate import io_states, segments, walk_assignment
from .result import MODES, Plan, PlanEntry
from .search import ChainSearch, lower_bounds, solve_pruned
from .timer import KernelTimer, QueryRecorder
from .tracing import Block, Node, leaf_nodes, spine, trace

__all__ = ["Node", "Block", "trace", "leaf_nodes", "Planner", "Plan", "PlanEntry",
           "apply_plan", "GRADIENT_WEIGHTS", "MODES"]

#: Shares of a layer's gradient reduction the DP charges when reductions overlap backward.
GRADIENT_WEIGHTS = (1.0, 0.5, 0.25, 0.125, 0.0)

#: Ranks whose receipts bound a shuffle's cost from below (Planner._shuffle_bounds).
_BOUND_RANKS = 32


def _fields(costs: list[LayerCost]) -> np.ndarray:
    """The fields the DP prices, one column per layer cost: forward, total, gradient
    reduction, memory kept, transient memory and the input bytes kept."""
    return np.array([[c.fwd for c in costs], [c.total for c in costs],
                     [c.grad for c in costs], [c.memory for c in costs],
                     [c.transient for c in costs], [c.keeps_input for c in costs]],
                    dtype=float).reshape(6, len(costs))



class Planner:
    """Chooses the distribution of every layer of ``model`` for one training iteration
    (or, with a cost model made with ``training=False``, for one inference pass).

    Parameters
    ----------
    model : Layer
        A :class:`Sequential` of layers and :class:`Residual` blocks.
    batch_shape : tuple
        Global input shape (N, C, *S).
    cost : CostModel
    memory_budget : float, optional
        Bytes per rank that the plan must fit.
    allowed : list of candidates, optional
        Restrict the candidate distributions (e.g. to compare uniform plans).
        Default: every grid of the ranks, including those that split the
        samples over more ranks than the batch has (some ranks then hold no
        sample for those layers).
    channels : bool
        Also split the channels (candidates over (N, C, *S), see
        :func:`~disttensor_nn.plan.candidates`). Under such a grid an
        activation has its channels split along the channel axis or whole
        (replicated along it), and each convolution is planned in the
        cheapest of its modes (:data:`MODES`): filter-parallel on a gathered
        input (split channels in, split filters out), channel-parallel
        (split in, whole out), filter-parallel (whole in, split out) or
        replicated (whole in and out).
    modes : sequence of str, optional
        Restrict the convolutions' modes under such grids to these (keys of
        :data:`MODES`; e.g. ``("channel",)`` with ``allowed=[(1, p, 1, 1)]``
        for a channel-parallel plan). Default: all.
    max_states : int, optional
        Search each layer over at most this many states, those of smallest
        lower bound (:meth:`_solve`): faster on many ranks, no longer exact
        (the plan is a valid plan, priced exactly, but a cheaper one may
        exist). Default: every state that can be in a cheapest plan.

    Attributes
    ----------
    cands : list of tuple
        The candidate grids.
    states : list of (tuple, bool)
        The activation layouts the DP chooses among: each candidate grid
        with its channels split (index ``i`` is ``cands[i]``), then each grid
        with a channel axis longer than one with its channels whole.
    searched : float
        States per layer the last DP searched, on average (after pruning).
    """

    def __init__(self, model: Layer, batch_shape: tuple[int, ...], cost: CostModel,
                 memory_budget: float | None = None, allowed: list[Candidate] | None = None,
                 baseline: float = 0.0, recompute: bool | str = False, channels: bool = False,
                 modes: Any = None, max_states: int | None = None):
        self.model, self.batch_shape, self.cost = model, tuple(batch_shape), cost
        if max_states is not None and max_states < 1:
            raise ValueError(f"max_states must be at least 1, got {max_states}")
        self.max_states = max_states
        if modes is not None and (isinstance(modes, str) or not set(modes) <= set(MODES)):
            raise ValueError(f"modes must be a sequence of {list(MODES)}, got {modes!r}")
        self.modes = None if modes is None else frozenset(modes)
        self.items = trace(model, self.batch_shape)
        self.nodes = leaf_nodes(self.items)
        nsp = len(self.batch_shape) - 2
        # grids whose sample axis has more ranks than the batch has samples are kept: they
        # leave some ranks idle for a layer, which costs less than splitting it further
        # where communication dominates (the memory model counts the larger blocks)
        self.cands = [tuple(c) for c in allowed] if allowed is not None else \
            candidates(cost.nprocs, nsp, channels)
        self.states: list[tuple[Candidate, bool]] = [(c, True) for c in self.cands] + [
            (c, False) for c in self.cands if len(c) == nsp + 2 and c[1] > 1]
        index = {st: i for i, st in enumerate(self.states)}  # the other state of each grid
        self._peer = np.array([index.get((g, not split), i)
                               for i, (g, split) in enumerate(self.states)])
        self.budget = memory_budget
        self.baseline = float(baseline)
        if recompute not in (False, True, "auto"):
            raise ValueError(f"recompute must be False, True or 'auto', got {recompute!r}")
        self.recompute = recompute
        self._recomputing = recompute is True
        if recompute is True and not cost.training:
            raise ValueError("recompute is for training: inference keeps no activations")
        # the process itself, parameters with their gradients, momenta and the local
        # gradients waiting for their reduction, and what the loss holds (the network's
        # output, the targets and the output's gradient); in inference the parameters and
        # the network's output alone
        out = self.nodes[-1].out_shape if self.nodes else self.batch_shape
        grads = [n for node in self.nodes for n in cost.local_gradient_bytes(node.layer,
                                                                             node.in_shape)]
        self.base_memory = self.baseline + cost.params_memory(model, grads) + \
            (2 if cost.training else 1) * math.prod(out) * cost.itemsize / cost.nprocs
        # costs under each placement of the grid on the nodes (CostModel.inner)
        self._caches: dict[str, tuple[dict, dict, dict, dict]] = {}
        self._layer_cost: dict[tuple[int, int, int], LayerCost] = {}
        self._shuffle: dict[tuple[int, ...], np.ndarray] = {}
        self._fields: dict[tuple[int, bool], np.ndarray] = {}
        self._over_budget: set[tuple[int, int, int]] = set()  # keys priced inf by the budget
        self._shuffle_low: dict[tuple[int, ...], np.ndarray] = {}
        # the layers on the path from the input to the output through every residual
        # block's branch (a lower bound of every assignment follows it), and the others
        self._spine, self._side = spine(self.items)
        self._place(cost.inner)
        self.notes: list[str] = []  # what calibration did, shown under the plan table
        self._weight = 1.0  # share of gradient reductions the DP charges
        self._mask: np.ndarray | None = None  # the states the DP may use (None: all)
        # while the DP runs: the prices of every layer in every state, and the states
        # each layer may use (indices into states, ascending; see _solve)
        self._prices: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self._sets: dict[int, np.ndarray] = {}
        self.searched = 0.0

    # ------------------------------------------------------------ tables
    def layer_cost(self, node: Node, c: int, o: int | None = None) -> LayerCost:
        """Cost of ``node`` with its input in state ``c`` and its output in ``o`` (cached).

        States index :attr:`states`; ``o`` defaults to ``c``. Only a
        convolution under a grid over (N, C, S..) may change the state (to the
        same grid, its channels split or whole: its mode, :meth:`mode`); any
        other change, or a channel split or mode the layer refuses (its
        ``cost_spec`` or ``weight_splits`` raising ValueError), costs infinite time. A
        layer whose memory alone exceeds the budget costs infinite time: it
        is not measured (which would need that memory) and cannot be chosen.
        """
        o = c if o is None else o
        key = (id(node), c, o)
        if key not in self._layer_cost:
            layer = self._moded(node, c, o)
            if layer is None:
                self._layer_cost[key] = LayerCost(fwd=np.inf)
                return self._layer_cost[key]
            cand, split = self.states[c]
            out_split = self.states[o][1]
            # without a kernel timer nothing is measured: the cost itself tells the memory
            priced = self.cost.layer(layer, node.in_shape, cand, split, out_split) \
                if self.cost.timer is None else None
            if self.budget is not None:
                alone = priced if priced is not None else CostModel(
                    self.cost.profile, self.cost.nprocs, QueryRecorder(), self.cost.itemsize,
                    training=self.cost.training, backends=self.cost.backends,
                    dtype=self.cost.dtype, runs_as=self.cost.runs_as).layer(
                        layer, node.in_shape, cand, split, out_split)
                if alone.memory + alone.transient + self.base_memory > self.budget:
                    alone.fwd = np.inf
                    self._layer_cost[key] = alone
                    self._over_budget.add(key)
                    return alone
            self._layer_cost[key] = priced if priced is not None else self.cost.layer(
                layer, node.in_shape, cand, split, out_split)
        return self._layer_cost[key]

    def modal(self, node: Node) -> bool:
        """Whether ``node`` may change the state: a convolution under channel grids."""
        return hasattr(node.layer, "filter_axes") and len(node.in_shape) > 2 and \
            len(self.states) > len(self.cands)

    def mode(self, node: Node, c: int, o: int) -> str:
        """The mode (:data:`MODES`) of a convolution from state ``c`` to ``o``; "" otherwise."""
        cand, split = self.states[c]
        if not self.modal(node) or len(cand) != len(node.in_shape) or cand[1] == 1:
            return ""
        out = self.states[o][1]
        if split and out and getattr(node.layer, "groups", 1) > 1:
            return "grouped"
        return {(True, True): "gathered", (True, False): "channel",
                (False, True): "filter", (False, False): "replicated"}[(split, out)]

    def _moded(self, node: Node, c: int, o: int) -> Layer | None:
        """The layer as it runs from state ``c`` to ``o`` (a copy with its filter axes set),
        or None where it cannot."""
        if c == o and not self.modal(node):
            g, split = self.states[c]
            if split and len(g) == len(node.in_shape) and g[1] > 1:
                try:  # a layer refuses a channel split it cannot take (its cost spec says)
                    node.layer.cost_spec(dist_for(node.in_shape, g), self.cost.itemsize)
                except ValueError:
                    return None
            return node.layer
        if not self.modal(node) or self.states[c][0] != self.states[o][0]:
            return None
        cand, split = self.states[c]
        if len(cand) != len(node.in_shape) or cand[1] == 1:
            return node.layer if c == o else None
        if self.modes is not None and self.mode(node, c, o) not in self.modes:
            return None
        layer = copy.copy(node.layer)
        layer.filter_axes = (1,) if self.states[o][1] else ()
        try:
            layer.weight_splits(dist_for(node.in_shape, cand, split))
        except ValueError:  # e.g. groups with a split channel or filter dimension
            return None
        return layer

    def _passes(self) -> int:
        """Moves per shuffle: the activation forward and, in training, its gradient back."""
        return 2 if self.cost.training else 1

    def shuffle_matrix(self, shape: tuple[int, ...]) -> np.ndarray:
        """Seconds to move an activation of ``shape`` from state ``i`` to ``j`` (all states):
        forward, and in training its gradient back in backward."""
        every = np.arange(len(self.states))
        return self._shuffles(shape, every, every)

    def _shuffles(self, shape: tuple[int, ...], rows: np.ndarray,
                  cols: np.ndarray) -> np.ndarray:
        """:meth:`shuffle_matrix` restricted to states ``rows`` x ``cols``, priced on demand."""
        m = self._shuffle.get(shape)
        if m is None:
            n = len(self.states)
            m = self._shuffle[shape] = np.full((n, n), np.nan)
            m[np.diag_indices(n)] = 0.0
        sub = m[np.ix_(rows, cols)]
        missing = np.isnan(sub)
        if missing.any():
            src, dst = rows[missing.any(axis=1)], cols[missing.any(axis=0)]
            inner = self.cost.inner
            m[np.ix_(src, dst)] = self._passes() * self.cost.redistributions(
                [dist_for(shape, *self.states[i], inner=inner) for i in src],
                [dist_for(shape, *self.states[j], inner=inner) for j in dst])
            m[np.diag_indices(len(self.states))] = 0.0
            sub = m[np.ix_(rows, cols)]
        return sub

    def _shuffle_cost(self, shape: tuple[int, ...], i: int, j: int) -> float:
        """Seconds to move an activation of ``shape`` from state ``i`` to ``j``."""
        return float(self._shuffles(shape, np.array([i]), np.array([j]))[0, 0])

    def _price_fields(self, f: np.ndarray, lam: float) -> np.ndarray:
        """The DP's price of the layer costs whose fields (:func:`_fields`) are ``f``:
        time plus ``lam`` times memory (infinite where a layer cannot run or fit)."""
        fwd, total, grad, memory, transient, keeps = f
        fits = np.isfinite(fwd)
        if self.budget is not None:
            fits &= memory + transient + self.base_memory <= self.budget
        time = total if not self.cost.overlap else total - (1.0 - self._weight) * grad
        if self._recomputing:  # each layer in a segment: kept only where one starts
            kept = np.where(keeps > 0, memory, 0.0)
            v = kept if lam == np.inf else time + fwd + lam * kept
        else:  # what the layer adds to the peak: kept (training) or its pass (inference)
            mem = memory if self.cost.training else transient
            v = mem if lam == np.inf else time + lam * mem
        with np.errstate(invalid="ignore"):
            return np.where(fits, v, np.inf)

    def _node_fields(self, node: Node, swap: bool) -> np.ndarray:
        """Fields (:func:`_fields`) of ``node``'s cost in every state ``o``: from ``o``
        itself, or with ``swap`` from the other state of ``o``'s grid (infinite where
        there is none)."""
        key = (id(node), swap)
        if key not in self._fields:
            costs = [self.layer_cost(node, int(self._peer[o]), o) if self._peer[o] != o
                     else LayerCost(fwd=np.inf) for o in range(len(self.states))] if swap \
                else [self.layer_cost(node, o) for o in range(len(self.states))]
            self._fields[key] = _fields(costs)
        return self._fields[key]

    def _node_prices(self, lam: float) -> dict[int, tuple[np.ndarray, np.ndarray | None]]:
        """Every node's price in every state (its input and output there), and a
        convolution's with its output in each state and its input in the other state
        of that grid (None for other layers); infinite outside the mask."""
        out = {}
        mask = self._mask
        for node in self.nodes:
            stay = self._price_fields(self._node_fields(node, False), lam)
            swap = self._price_fields(self._node_fields(node, True), lam) \
                if self.modal(node) else None
            if mask is not None:  # both ends in allowed states
                stay = np.where(mask, stay, np.inf)
                if swap is not None:
                    swap = np.where(mask & mask[self._peer], swap, np.inf)
            out[id(node)] = (stay, swap)
        return out

    def _time(self, lc: LayerCost) -> float:
        """The DP's additive price of a layer: its gradient reduction at the current weight."""
        if not self.cost.overlap:
            return lc.total
        return lc.total - (1.0 - self._weight) * lc.grad

    # ------------------------------------------------------------ calibration
    def kernel_queries(self, cand: Candidate, split_channels: bool = True) -> list:
        """The kernel measurements the cost model needs for the layers under ``cand``
        (with the activations' channels split or whole, under a grid over (N, C, S..)).

        Returns the ``(layer, local shape, dtype, flops)`` list in network
        order (as :meth:`KernelTimer.measure_chain` takes it), a convolution's
        for each of its modes from this state, without the layers whose
        memory alone (kept, transient and the base) exceeds the budget or
        that cannot run so: they cannot be chosen.
        """
        rec = QueryRecorder()
        model = CostModel(self.cost.profile, self.cost.nprocs, rec, self.cost.itemsize,
                          training=self.cost.training, backends=self.cost.backends,
                          dtype=self.cost.dtype, runs_as=self.cost.runs_as)
        c = self.states.index((tuple(cand), split_channels)) \
            if (tuple(cand), split_channels) in self.states else None
        for node in self.nodes:
            outs = dict.fromkeys((c, int(self._peer[c]))) if c is not None and \
                self.modal(node) else {c: None}
            for o in outs:
                layer = self._moded(node, c, o) if c is not None else node.layer
                if layer is None:
                    continue
                n = len(rec.queries)
                lc = model.layer(layer, node.in_shape, cand, split_channels,
                                 self.states[o][1] if o is not None else None)
                if self.budget is not None and \
                        lc.memory + lc.transient + self.base_memory > self.budget:
                    del rec.queries[n:]
        return rec.queries

    def calibrate(self, comm: Any = None, reps: int = 3, progress: bool = False,
                  max_seconds: float = 1.5) -> int:
        """Measure the layers' kernel times in network order, every candidate's layers at once.

        Collective over ``comm`` (default: this process alone): every rank
        runs the same 1-process twins at the same time, as the ranks of a job
        of ``comm``'s size share the machine, so pass the job's communicator
        when planning for it. The queries of every candidate, in network
        order, go to one :meth:`KernelTimer.measure_chain`, which times each
        distinct local shape once, large ones on tiles, in segments that fit
        the memory budget; after untimed rounds, timed rounds repeat up to
        ``reps`` times while they take less than ``max_seconds`` in all (at
        least one). Layers whose memory alone exceeds the budget are
        not measured (they cannot be chosen). Returns the number of
        candidates with something newly measured. Without a
        :class:`KernelTimer` this does nothing.
        """
        timer = self.cost.timer
        if not isinstance(timer, KernelTimer) or not timer.measure:
            return 0
        comm = MPI.COMM_SELF if comm is None else comm
        corun = comm.Get_size()
        dtype = self.cost.dtype
        params = list(self.model.parameters())
        slots = self.cost.state_slots
        # the optimizer's update, on every rank at once, where its arrays fit the budget too
        if self.cost.training and params and (
                self.budget is None or self.budget >= self.base_memory +
                timer.update_bytes(slots, params[0].dtype)):
            if timer.measure_update(slots, params[0].dtype, comm,
                                    optimizer_backend(self.cost.backends)):
                self.notes.append(f"optimizer update timed on {corun} "
                                  f"rank{'' if corun == 1 else 's'} at once")
        queries, news = [], 0
        for cand, split in self.states:
            cand_queries = self.kernel_queries(cand, split)
            news += any(not any(timer.key(q[0], q[1], dtype, co) in timer.table
                                for co in dict.fromkeys((corun, self.cost.corun)))
                        for q in cand_queries)
            queries += cand_queries
        # the same decision on every rank, or the collective measurement would hang
        if not comm.allreduce(news > 0, op=MPI.LOR):
            return 0
        start = time.perf_counter()
        shapes = timer.measure_chain(queries, comm, reps, max_seconds, memory=self.budget,
                                     progress=progress)
        tiled = sum(timer.tiled(q[0], q[1], q[2], corun) for q in queries)
        self.notes.append(f"kernels timed on {corun} rank{'' if corun == 1 else 's'} at once: "
                          f"{shapes} distinct local shapes for {len(queries)} layer queries "
                          f"({tiled} on tiles, scaled by FLOPs: ~) in "
                          f"{time.perf_counter() - start:.1f} s")
        return news

    # ------------------------------------------------------------ DP
    def _solve(self, lam: float) -> dict[int, int] | None:
        """The DP's cheapest assignment at memory weight ``lam`` (None: nothing fits).

        The DP runs, for each layer, over the states in which it can be in a
        cheapest assignment (exact pruning,
        :func:`~disttensor_nn.plan.search.solve_pruned`): an assignment that
        runs layer ``l`` with its input or output in state ``s`` costs at
        least ``LB_l(s)`` (:func:`~disttensor_nn.plan.search.lower_bounds`,
        along the spine, :func:`~disttensor_nn.plan.tracing.spine`).
        """
        self._prices = self._node_prices(lam)
        try:
            bounds = lower_bounds(self._spine, self._side, self._prices, self._peer,
                                  self._shuffle_bounds)
            if bounds is None:
                return None
            return solve_pruned(bounds, len(self.states), self._solve_on, self.max_states)
        finally:
            self._prices, self._sets = {}, {}

    def _shuffle_bounds(self, shape: tuple[int, ...]) -> np.ndarray:
        """Lower bounds of :meth:`shuffle_matrix` (what a few spread ranks receive)."""
        if shape not in self._shuffle_low:
            p = self.cost.nprocs
            ranks = np.unique(np.linspace(0, p - 1, min(p, _BOUND_RANKS)).astype(np.intp))
            dists = [dist_for(shape, *st, inner=self.cost.inner) for st in self.states]
            m = self._passes() * self.cost.redistribution_bounds(dists, dists, ranks)
            m[np.diag_indices(len(self.states))] = 0.0
            self._shuffle_low[shape] = m
        return self._shuffle_low[shape]

    def _solve_on(self, sets: dict[int, np.ndarray]) -> tuple[dict[int, int] | None, float]:
        """The DP with each layer's states in ``sets`` (by ``id``, ascending): the
        assignment and its price (:class:`~disttensor_nn.plan.search.ChainSearch`)."""
        self._sets = sets
        self.searched = float(np.mean([len(v) for v in sets.values()]))
        return ChainSearch(self._prices, sets, self._peer, self._shuffles,
                           self.modal).solve(self.items)

    # ------------------------------------------------------------ evaluation
    def assignment_cost(self, assign: dict[int, int]) -> tuple[float, float]:
        """(time, peak memory) of a complete assignment ``{id(node): candidate index}``.

        Computed directly by walking the graph (used to check the DP); the
        time is :meth:`assignment_step`'s. The peak is the process baseline,
        the parameters' state and what the loss holds, plus what every layer
        keeps from forward to backward (an activation kept by both layers it
        joins counted once), plus the largest transient need of one layer's
        pass.
        """
        step, memory = self._walk(assign)
        return step.time, memory

    def assignment_step(self, assign: dict[int, int]) -> StepTime:
        """The step time of an assignment and how it divides (:func:`step_time`)."""
        return self._walk(assign)[0]

    def _walk(self, assign: dict[int, int]) -> tuple[StepTime, float]:
        """(step time, peak memory) of an assignment (:func:`walk_assignment`)."""
        return walk_assignment(self.items, assign, self.layer_cost, self._shuffle_cost,
                               self._nbytes, self.base_memory, self.cost.training,
                               self.cost.overlap,
                               self.segments(assign) if self._recomputing else {})

    def _nbytes(self, shape: tuple[int, ...], c: int) -> float:
        """Bytes of the largest block of an activation of ``shape`` in state ``c``."""
        return self.cost.itemsize * math.prod(largest_block(
            dist_for(shape, *self.states[c], inner=self.cost.inner)))

    def segments(self, assign: dict[int, int]) -> dict[int, int]:
        """Recompute segments of an assignment: ``{id(node): segment number}``, as
        :func:`~disttensor_nn.plan.evaluate.segments` finds them with this planner's
        layer costs."""
        return segments(self.items, assign, self.layer_cost)

    def _place(self, inner: str) -> None:
        """Price layers and shuffles with the grids laid on the nodes as ``inner`` says."""
        self.cost.inner = inner
        self._layer_cost, self._shuffle, self._fields, self._shuffle_low = \
            self._caches.setdefault(inner, ({}, {}, {}, {}))

    def placements(self) -> tuple[str, ...]:
        """The placements the planner compares: both when the ranks span several nodes."""
        node = self.cost.profile.node_size
        return NODE_INNER if 1 < node < self.cost.nprocs else (self.cost.inner,)

    def plan(self) -> Plan:
        """The cheapest plan that fits the memory budget.

        With overlapped gradient reductions, the fastest on the critical path
        of the plans solved for each of :data:`GRADIENT_WEIGHTS`. When the
        ranks span several nodes, the fastest of the plans solved for each
        placement of the grids on the nodes (:meth:`placements`: spatial
        splits inside a node, or the sample split; ``Plan.inner``).

        Raises
        ------
        ValueError
            When no assignment fits the budget (with the smallest peak found).
        """
        start = self.cost.inner
        best: Plan | None = None
        error: ValueError | None = None
        try:
            for inner in self.placements():
                self._place(inner)
                try:
                    found = self._plan_placed()
                except ValueError as exc:
                    error = error or exc
                    continue
                if best is None or found.time < best.time:
                    best = found
        finally:
            self._place(start)
        if best is None:
            assert error is not None
            raise error
        return best

    def _plan_placed(self) -> Plan:
        """:meth:`plan` for the current placement."""
        if self.recompute != "auto" or not self.cost.training:
            return self._plan()
        try:
            return self._plan()  # keeping every activation, if a plan fits
        except ValueError:
            self._recomputing = True
            try:
                return self._plan()
            finally:
                self._recomputing = False

    def _plan(self) -> Plan:
        """The cheapest plan that fits the budget, recomputing or not as set now."""
        weights = GRADIENT_WEIGHTS if self.cost.overlap else (1.0,)
        # With overlap the DP is approximate, so more states could price worse on the
        # critical path: the channel splits' plans are also solved without them (a subset
        # of the states), so that adding channel splits never gives a slower plan.
        masks = [None]
        if self.cost.overlap and any(len(g) == len(self.batch_shape) and g[1] > 1
                                     for g, _ in self.states):
            masks.append(np.array([len(g) != len(self.batch_shape) or g[1] == 1
                                   for g, _ in self.states]))
        best = None
        try:
            for mask in masks:
                self._mask = mask
                for w in weights:
                    self._weight = w
                    try:
                        found = self._plan_at_weight()
                    except ValueError:
                        if mask is None:
                            raise
                        break  # nothing fits without channel splits
                    if best is None or found[1] < best[1]:
                        best = found
                    if not any(lc.grad > 0 for lc in self._layer_cost.values()):
                        break  # no gradient reduction anywhere: every weight gives this plan
        finally:
            self._weight, self._mask = 1.0, None
        assert best is not None
        return self._make_plan(*self._steady(*best))

    def _steady(self, assign: dict, t: float, mem: float, notes: list
                ) -> tuple[dict, float, float, list]:
        """``assign`` with each layer kept in the previous layer's state where both lay
        its input and output out alike (the same block on every rank, on another grid)
        and the plan is priced no higher in time or memory.

        Such states tie in the DP (no byte moves between them), which would otherwise
        pick the first; running on the previous layer's grid spares the runtime a
        change of grid.
        """
        inner = self.cost.inner
        prev = None
        for node in self.nodes:
            value = assign[id(node)]
            if prev is not None and isinstance(value, (int, np.integer)) and value != prev \
                    and all(same_placement(dist_for(shape, *self.states[value], inner=inner),
                                           dist_for(shape, *self.states[prev], inner=inner))
                            for shape in (node.in_shape, node.out_shape)
                            if len(shape) in (2, len(node.in_shape))):
                trial = {**assign, id(node): prev}
                t2, mem2 = self.assignment_cost(trial)
                if t2 <= t and mem2 <= mem:
                    assign, t, mem, value = trial, t2, mem2, prev
            prev = io_states(value)[1]
        return assign, t, mem, notes

    def _plan_at_weight(self) -> tuple[dict[int, int], float, float, list[str]]:
        """The DP's plan (assignment, time, memory, notes) at the current gradient weight."""
        assign = self._solve(0.0)
        notes = list(self.notes)
        if assign is None:
            raise ValueError(self._nothing_fits())
        t, mem = self.assignment_cost(assign)
        if self.budget is not None and mem > self.budget:
            assign = fit_budget(self._solve, lambda a: self.assignment_cost(a)[1],
                                self.budget)
            if assign is None:
                raise ValueError(self._nothing_fits())
            notes.append("memory budget active: the fastest plan did not fit")
            t, mem = self.assignment_cost(assign)
        return assign, t, mem, notes

    def _nothing_fits(self) -> str:
        # the least memory any plan needs: the DP by memory alone, where the layers that did
        # not fit the budget (untimed, their time infinite) run
        budget, self.budget = self.budget, None
        costs, fields = self._layer_cost, self._fields
        self._layer_cost = {k: dataclasses.replace(v, fwd=0.0) if k in self._over_budget
                            else v for k, v in costs.items()}
        self._fields = {}
        try:
            m = self._solve(np.inf)
            smallest = self.assignment_cost(m)[1] if m else None
        finally:
            self.budget, self._layer_cost, self._fields = budget, costs, fields
        need = f" (the smallest plan found needs {_bytes(smallest)})" if m else ""
        return (f"no distribution of this network on {self.cost.nprocs} "
                f"rank{'' if self.cost.nprocs == 1 else 's'} fits "
                f"{_bytes(self.budget or 0)} per rank{need}")

    def _make_plan(self, assign: dict[int, int], t: float, mem: float, notes: list) -> Plan:
        entries = []
        prev = None
        groups = self.segments(assign) if self._recomputing else {}
        seen: set[int] = set()
        for node in self.nodes:
            c, o = io_states(assign[id(node)])
            lc = self.layer_cost(node, c, o)
            sh = self._shuffle_cost(node.in_shape, prev, c) if prev is not None else 0.0
            g = groups.get(id(node), -1)
            kept, bwd = lc.memory, lc.bwd
            if g >= 0:  # the forward again in backward; kept only at the segment's start
                kept = lc.memory if g not in seen else 0.0
                bwd += lc.fwd
                seen.add(g)
            cand, split = self.states[c]
            entries.append(PlanEntry(node.name, type(node.layer).__name__, cand,
                                     node.in_shape, lc.fwd, bwd, lc.comm, float(sh),
                                     kept, lc.estimated, lc.tiled, lc.transient, g,
                                     split, self.mode(node, c, o), lc.kernels,
                                     self._kernel_dtype(node.layer, lc.kernels)))
            prev = o
        step = self.assignment_step(assign)
        # the optimizer's update: the same under every assignment, so not in the search
        update = self.cost.update_time(self.model)
        if update:
            notes = [*notes, f"optimizer update {1e3 * update:.2f} ms per step (timed), in "
                             "the time and the compute"]
        return Plan(self.cost.nprocs, self.batch_shape, self.cost.profile.name, entries,
                    t + update, mem, self.budget, notes, self.baseline, step.compute + update,
                    step.exposed, step.hidden,
                    self.cost.training, self.cost.inner, self.cost.shard_state,
                    precision_of(self.cost.dtype))

    def _kernel_dtype(self, layer: Layer, kernels: str) -> str:
        """``"float32"`` where ``layer``'s kernels run 16-bit blocks in float32, else ""."""
        act = self.cost.dtype
        if not is_half(act):
            return ""
        device = "gpu" if self.cost.profile.device == "gpu" else "cpu"
        run = layer.compute_dtype(act, kernels or layer.kernel_backend, device)
        return "" if run == act else run.name

    def uniform_plan(self, cand: Candidate) -> Plan:
        """Every layer in the same distribution (for comparisons); under a grid over
        (N, C, S..), every activation's channels split and every convolution
        in the gathered mode."""
        c = self.cands.index(tuple(cand))
        return self.assignment_plan({id(n): c for n in self.nodes},
                                    [f"uniform plan {tuple(cand)}"])

    def assignment_plan(self, assign: dict, notes: list[str] | None = None) -> Plan:
        """The plan of a complete assignment ``{id(node): state}`` (for comparisons).

        A state indexes :attr:`states`; a layer that changes the state (a
        convolution's mode, :meth:`mode`) is given as ``(input state, output
        state)``.
        """
        t, mem = self.assignment_cost(assign)
        return self._make_plan(assign, t, mem, list(notes or []))


def _bytes(n: float) -> str:
    """A size for a message: MiB, or KiB or bytes where that would print 0."""
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n:.0f} bytes"
