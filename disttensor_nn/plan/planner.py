"""The planner: choose every layer's distribution by dynamic programming over the layer graph.

The network is traced into a chain of layers and residual blocks. With ``C``
candidate distributions, each step of the chain is a ``C x C`` matrix of
costs (input arriving in distribution ``a``, layer run in ``c``: the shuffle
``a -> c`` plus the layer's cost in ``c``); a residual block's matrix is its
branch's chain matrix plus the shortcut's (whose output must meet the
branch's in one distribution, or pay the shuffle). Chaining is a min-plus
matrix product, so the cheapest plan is exact for a step whose costs add
up. A per-rank memory budget is met by minimising ``time + lambda * memory``
with the smallest ``lambda`` (found by bisection) whose plan fits; layers'
candidates that cannot fit even alone are dropped.

When gradient reductions overlap backward (``CostModel.overlap``), a step's
time is a critical path (:func:`~disttensor_nn.plan.costmodel.step_time`), a
maximum over layers that no chain of min-plus products minimises exactly.
The planner then solves the additive problem in which each layer pays a
share ``w`` of its gradient reduction (``w`` in :data:`GRADIENT_WEIGHTS`:
from "hidden entirely" to "fully exposed"), prices each solution on the
critical path, and keeps the fastest. Every plan it returns is priced
exactly; only its optimality is approximate (the test suite measures the
gap to brute force on small networks).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import ProcessGrid

from ..container import Residual, Sequential
from ..costspec import largest_block
from ..kernels import check_backend
from ..module import Layer, Layout
from .costmodel import (
    NODE_INNER,
    Candidate,
    CostModel,
    LayerCost,
    StepTime,
    candidates,
    dist_for,
    same_placement,
    step_time,
)
from .timer import KernelTimer, QueryRecorder

__all__ = ["Node", "Block", "trace", "leaf_nodes", "Planner", "Plan", "PlanEntry",
           "apply_plan", "GRADIENT_WEIGHTS", "MODES"]

#: Shares of a layer's gradient reduction the DP charges when reductions overlap backward.
GRADIENT_WEIGHTS = (1.0, 0.5, 0.25, 0.125, 0.0)

#: A convolution's modes under a grid over (N, C, S..) (``PlanEntry.mode``).
MODES = {
    "gathered": "filter-parallel on the input gathered along C",
    "channel": "channel-parallel, partial outputs allreduced",
    "filter": "filter-parallel, partial input gradients allreduced",
    "replicated": "the whole layer on each replica",
    "grouped": "grouped, each rank's whole groups, no message",
}
_MODE_LABEL = {"gathered": "C>F", "channel": "C>-", "filter": "->F", "replicated": "->-",
               "grouped": "C>F g"}


def _split_label(e: PlanEntry) -> str:
    """The C/F column of a plan's table."""
    if len(e.in_shape) != len(e.grid) or e.grid[1] == 1:
        return ""
    return _MODE_LABEL.get(e.mode, "C" if e.split_channels else "-")


@dataclass
class Node:
    """One layer of the traced network."""

    name: str
    layer: Layer
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


@dataclass
class Block:
    """A residual block: ``post(branch(x) + shortcut(x))``."""

    name: str
    branch: list
    shortcut: list | None
    post: list
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


def trace(model: Layer, in_shape: tuple[int, ...], prefix: str = "") -> list:
    """Flatten ``model`` into a chain of :class:`Node` and :class:`Block` items."""
    items: list = []
    if isinstance(model, Sequential):
        for i, layer in enumerate(model):
            sub = trace(layer, in_shape, f"{prefix}{i}.")
            items += sub
            in_shape = (sub[-1].out_shape if sub else in_shape)
        return items
    if isinstance(model, Residual):
        branch = trace(model.branch, in_shape, prefix + "branch.")
        mid = model.merged_shape(in_shape)
        shortcut = trace(model.shortcut, in_shape, prefix + "shortcut.") \
            if model.shortcut is not None else None
        post = trace(model.post, mid, prefix + "post.") if model.post is not None else []
        return [Block(prefix.rstrip("."), branch, shortcut, post, tuple(in_shape),
                      model.output_shape(in_shape))]
    out = model.output_shape(in_shape)
    return [Node(prefix.rstrip(".") or type(model).__name__, model, tuple(in_shape), out)]


def leaf_nodes(items: list) -> list[Node]:
    """The :class:`Node` s of a traced chain (:func:`trace`) in network order, blocks opened."""
    out = []
    for it in items:
        if isinstance(it, Node):
            out.append(it)
        else:
            out += leaf_nodes(it.branch) + (leaf_nodes(it.shortcut) if it.shortcut else []) + \
                leaf_nodes(it.post)
    return out


def _io(value: int | tuple[int, int]) -> tuple[int, int]:
    """(input state, output state) of an assignment's value for one layer."""
    return (value, value) if isinstance(value, (int, np.integer)) else \
        (int(value[0]), int(value[1]))


def _minplus(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Min-plus product ``a (x) b`` and, per entry, the first middle index attaining it."""
    if a.shape[0] * a.shape[1] * b.shape[1] <= _MINPLUS_CUBE:
        s = a[:, :, None] + b[None, :, :]
        k = s.argmin(axis=1)
        return np.take_along_axis(s, k[:, None, :], axis=1)[:, 0, :], k
    best = a[:, :1] + b[:1, :]  # one middle index at a time: faster on large matrices
    arg = np.zeros(best.shape, dtype=np.intp)
    for m in range(1, a.shape[1]):
        s = a[:, m:m + 1] + b[m:m + 1, :]
        better = s < best  # strictly: the first index wins ties, as argmin's
        np.copyto(best, s, where=better)
        arg[better] = m
    return best, arg


#: Largest ``rows x middle x columns`` a min-plus product broadcasts at once.
_MINPLUS_CUBE = 2**17
#: States of smallest lower bound whose DP gives the pruning bound (Planner._solve).
_FIRST_STATES = 16
#: Ranks whose receipts bound a shuffle's cost from below (Planner._shuffle_bounds).
_BOUND_RANKS = 32
#: Relative slack of the pruning test, far above the rounding of summing layer prices.
_SLACK = 1e-9


def _spine(items: list) -> tuple[list[Node], list[Node]]:
    """The nodes from a chain's input to its output through every block's branch and
    post-chain (in order), and the others (those of the shortcuts)."""
    spine: list[Node] = []
    side: list[Node] = []
    for it in items:
        if isinstance(it, Node):
            spine.append(it)
            continue
        for part, on in ((it.branch, True), (it.shortcut or [], False), (it.post, True)):
            sp, sd = _spine(part)
            (spine if on else side).extend(sp)
            side.extend(sd)
    return spine, side


def _fields(costs: list[LayerCost]) -> np.ndarray:
    """The fields the DP prices, one column per layer cost: forward, total, gradient
    reduction, memory kept, transient memory and the input bytes kept."""
    return np.array([[c.fwd for c in costs], [c.total for c in costs],
                     [c.grad for c in costs], [c.memory for c in costs],
                     [c.transient for c in costs], [c.keeps_input for c in costs]],
                    dtype=float).reshape(6, len(costs))


@dataclass
class PlanEntry:
    """One layer of a plan."""

    name: str
    layer: str
    grid: tuple[int, ...]
    in_shape: tuple[int, ...]
    fwd: float
    bwd: float
    comm: float
    shuffle_in: float
    memory: float
    estimated: bool
    tiled: bool = False
    transient: float = 0.0
    recompute: int = -1  # recompute segment (activation checkpointing); -1: kept
    # under a grid over (N, C, S..): the input's channels split along the channel axis (or
    # whole, replicated along it), and a convolution's mode (MODES; "" for other layers)
    split_channels: bool = True
    mode: str = ""
    kernels: str = ""  # the kernel backend chosen ("" for a layer without a choice)


@dataclass
class Plan:
    """Per-layer distributions with predicted times (seconds) and memory (bytes per rank)."""

    nprocs: int
    batch_shape: tuple[int, ...]
    machine: str
    entries: list[PlanEntry]
    time: float
    peak_memory: float
    memory_budget: float | None = None
    notes: list[str] = field(default_factory=list)
    baseline_memory: float = 0.0
    compute: float = 0.0  # of time: kernels
    exposed_comm: float = 0.0  # of time: communication on the critical path
    hidden_comm: float = 0.0  # communication overlapped with kernels (not in time)
    training: bool = True  # a training step (False: an inference pass, nothing kept)
    inner: str = "space"  # grid axes inside a node: the spatial splits, or "sample" (dist_for)
    # the parameters' state sharded over the ranks that replicate them (optim.shard_state),
    # as the plan's time and memory count it
    shard_state: str = "none"

    def table(self) -> str:
        """The plan as a readable text table."""
        dims = "(N,C,S..)" if any(len(e.grid) == len(self.batch_shape) for e in self.entries) \
            else "(N,S..)"
        cf = dims == "(N,C,S..)"
        kern = len({e.kernels for e in self.entries} - {""}) > 1 or \
            any(e.kernels not in ("", "numpy") for e in self.entries)
        head = f"{'layer':<28} {'grid ' + dims:<16} " + (f"{'C/F':<8} " if cf else "") + \
            (f"{'kernels':<8} " if kern else "") + \
            f"{'fwd ms':>8} {'bwd ms':>8} {'comm ms':>8} {'shuffle ms':>10} {'mem MiB':>8}"
        lines = [head, "-" * len(head)]
        for e in self.entries:
            mark = ("*" if e.estimated else "~" if e.tiled else " ") + \
                ("R" if e.recompute >= 0 else "")
            lines.append(
                f"{(e.name + ' ' + e.layer)[:28]:<28} {str(e.grid):<16} "
                + (f"{_split_label(e):<8} " if cf else "")
                + (f"{e.kernels or '-':<8} " if kern else "") + f"{1e3 * e.fwd:8.2f} "
                f"{1e3 * e.bwd:8.2f} {1e3 * e.comm:8.2f} {1e3 * e.shuffle_in:10.2f} "
                f"{e.memory / 2**20:7.1f}{mark}")
        lines.append("-" * len(head))
        what = "iteration" if self.training else "inference pass (nothing kept for backward)"
        lines.append(f"predicted time per {what}: {1e3 * self.time:.2f} ms on "
                     f"{self.nprocs} rank{'' if self.nprocs == 1 else 's'} ({self.machine}); "
                     "peak memory per rank "
                     f"{self.peak_memory / 2**20:.1f} MiB"
                     + (f" of {self.memory_budget / 2**20:.0f} MiB" if self.memory_budget
                        else "")
                     + (f" (process baseline {self.baseline_memory / 2**20:.0f} MiB)"
                        if self.baseline_memory else ""))
        if self.compute:
            lines.append(f"of which compute {1e3 * self.compute:.2f} ms, exposed communication "
                         f"{1e3 * self.exposed_comm:.2f} ms; hidden communication "
                         f"{1e3 * self.hidden_comm:.2f} ms")
        if any(e.estimated for e in self.entries):
            lines.append("* compute estimated from a rate model, not measured")
        if any(e.tiled for e in self.entries):
            lines.append("~ compute measured on a tile of the local block, scaled by FLOPs")
        if cf:
            lines.append("C/F: the input's channels split over the grid's C axis (C) or whole "
                         "(-), and a convolution's output after '>': " + "; ".join(
                             f"{_MODE_LABEL[k]} {v}" for k, v in MODES.items()))
        if any(e.recompute >= 0 for e in self.entries):
            lines.append(f"R recomputed in backward from its segment's input "
                         f"({len({e.recompute for e in self.entries} - {-1})} segments): "
                         "memory kept only at each segment's start, forward run twice")
        if self.shard_state != "none":
            lines.append(f"parameter state sharded over the ranks that replicate it: "
                         f"{self.shard_state} (optim.shard_state; time and peak count it)")
        if self.inner != "space":
            lines.append("ranks placed so that the sample split stays inside a node and the "
                         "spatial splits span nodes (grids laid out (C.., S.., N))")
        lines += self.notes
        return "\n".join(lines)

    def to_json(self) -> str:
        """Serialise (the training driver loads it with :meth:`from_json`)."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        d["entries"] = [PlanEntry(**{**e, "grid": tuple(e["grid"]),
                                     "in_shape": tuple(e["in_shape"])}) for e in d["entries"]]
        d["batch_shape"] = tuple(d["batch_shape"])
        return cls(**d)


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
        self._shuffle_low: dict[tuple[int, ...], np.ndarray] = {}
        # the layers on the path from the input to the output through every residual
        # block's branch (a lower bound of every assignment follows it), and the others
        self._spine, self._side = _spine(self.items)
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
                    training=self.cost.training, backends=self.cost.backends).layer(
                        layer, node.in_shape, cand, split, out_split)
                if alone.memory + alone.transient + self.base_memory > self.budget:
                    alone.fwd = np.inf
                    self._layer_cost[key] = alone
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

    def shuffle_matrix(self, shape: tuple[int, ...]) -> np.ndarray:
        """Seconds to move an activation of ``shape`` from state ``i`` to ``j`` (all states)."""
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
            m[np.ix_(src, dst)] = self.cost.redistributions(
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

    def _modal_step(self, sh: np.ndarray, node: Node, st: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """A convolution's step matrix: the shuffle to its input state ``c`` (``sh``), then
        the layer from ``c`` to its output state ``o`` (one of the two states of ``o``'s
        grid); and the chosen ``c`` for each (arriving state, ``o``). Over the layer's
        states ``st`` (local indices into it)."""
        stay, swap = (v[st] for v in self._prices[id(node)])
        own = np.arange(len(st))
        local = np.full(len(self.states), -1, dtype=np.intp)
        local[st] = own
        peer = local[self._peer[st]]
        swap = np.where(peer >= 0, swap, np.inf)  # the other state is not searched
        peer = np.where(peer >= 0, peer, own)
        t1 = sh + stay[None, :]
        t2 = sh[:, peer] + swap[None, :]
        return np.minimum(t1, t2), np.where(t2 < t1, peer[None, :], own[None, :])

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
                          training=self.cost.training, backends=self.cost.backends)
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
        the memory budget; after one untimed round, timed rounds repeat up to
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
        dtype = np.dtype(f"f{self.cost.itemsize}")
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
    def _chain(self, items: list, rows: np.ndarray | None, pin: bool = False):
        """Matrix M[a, c] of a chain (input in state ``rows[a]``, output in ``cols[c]``),
        its backtracking record, ``rows`` and ``cols``. Each layer's states are its
        set in :attr:`_sets`.

        With ``pin`` the input arrives in the layout of the chain's first layer
        (as the data loader provides it): ``a`` is that layout, at no cost, and
        ``rows`` (None) is the first layer's states.
        """
        steps = []
        acc = None
        cur = rows
        for k, it in enumerate(items):
            if isinstance(it, Node):
                st = self._sets[id(it)]
                if pin and k == 0:
                    rows = cur = st
                    sh = np.where(np.eye(len(st), dtype=bool), 0.0, np.inf)
                else:
                    sh = self._shuffles(it.in_shape, cur, st)
                if self.modal(it):  # input moved to c, the layer from c to its output's state
                    t, sub = self._modal_step(sh, it, st)
                else:
                    t, sub = sh + self._prices[id(it)][0][st][None, :], None
                cur = st
            else:
                t, sub, first, cur = self._block(it, cur, pin and k == 0)
                if pin and k == 0:
                    rows = first
                st = cur
            if acc is None:
                acc, arg = t, None
            else:
                acc, arg = _minplus(acc, t)
            steps.append((it, arg, sub, st))
        if acc is None:  # empty chain: identity, moving costs nothing
            acc = np.where(np.eye(len(rows), dtype=bool), 0.0, np.inf)
            cur = rows
        return acc, steps, rows, cur

    def _block(self, blk: Block, rows: np.ndarray | None, pin: bool = False):
        b, bsteps, rows, bcols = self._chain(blk.branch, rows, pin)
        if blk.shortcut is None:
            s, ssteps = self._shuffles(blk.in_shape, rows, bcols), None
            sarg = None
        else:
            sm, ssteps, _, scols = self._chain(blk.shortcut, rows)
            s, sarg = _minplus(sm, self._shuffles(blk.shortcut[-1].out_shape, scols, bcols))
        pre = b + s
        cols = bcols
        if blk.post:
            p, psteps, _, cols = self._chain(blk.post, bcols)
            t, parg = _minplus(pre, p)
        else:
            t, parg, psteps = pre, None, []
        return t, (bsteps, ssteps, sarg, psteps, parg), rows, cols

    def _backtrack(self, steps: list, a: int, c: int, out: dict) -> None:
        """Fill ``out[id(node)]`` (a state, or (input state, output state) where they differ)
        for a chain whose input is in its ``a``-th row state, output in its ``c``-th
        column state."""
        for it, arg, sub, st in reversed(steps):
            prev = arg[a, c] if arg is not None else a
            if isinstance(it, Node):
                i = int(sub[prev, c]) if sub is not None else c
                o = int(st[c])
                out[id(it)] = o if i == c else (int(st[i]), o)
            else:
                bsteps, ssteps, sarg, psteps, parg = sub
                mid = parg[prev, c] if parg is not None else c
                if psteps:
                    self._backtrack(psteps, mid, c, out)
                self._backtrack(bsteps, prev, mid, out)
                if ssteps is not None:
                    self._backtrack(ssteps, prev, sarg[prev, mid], out)
            c = prev

    def _solve(self, lam: float) -> dict[int, int] | None:
        """The DP's cheapest assignment at memory weight ``lam`` (None: nothing fits).

        The DP runs, for each layer, over the states in which it can be in a
        cheapest assignment (exact pruning): an assignment that runs layer
        ``l`` with its input or output in state ``s`` costs at least
        ``LB_l(s)`` (:meth:`_lower_bounds`); the DP over each layer's few
        states of smallest ``LB_l`` gives an assignment of cost ``U``, which
        the optimum cannot exceed, so a layer is not run in a state with
        ``LB_l(s) > U`` in any cheapest assignment, and the DP over the other
        states finds the assignment the DP over all states finds (its ties
        broken the same way: leaving out options it does not take leaves
        every choice it takes unchanged).
        """
        self._prices = self._node_prices(lam)
        try:
            bounds = self._lower_bounds()
            if bounds is None:
                return None
            finite = min(int(np.count_nonzero(np.isfinite(b))) for b in bounds.values())
            k = min(finite, _FIRST_STATES)
            while True:
                first = {i: np.sort(np.argsort(b, kind="stable")[:k])
                         for i, b in bounds.items()}
                assign, value = self._solve_on(first)
                if assign is not None or k >= len(self.states):
                    break
                k = min(len(self.states), 2 * k)
            if assign is None:
                return None
            keep = {i: np.flatnonzero(b <= value + _SLACK * abs(value))
                    for i, b in bounds.items()}
            if self.max_states is not None:  # the most promising states only: not exact
                keep = {i: np.intersect1d(v, np.argsort(bounds[i], kind="stable")[
                    :max(self.max_states, _FIRST_STATES)]) for i, v in keep.items()}
            if any(not np.array_equal(keep[i], first[i]) for i in keep):
                assign = self._solve_on(keep)[0] or assign  # (fewer states: no worse)
            return assign
        finally:
            self._prices, self._sets = {}, {}

    def _lower_bounds(self) -> dict[int, np.ndarray] | None:
        """``LB_l(s)`` of :meth:`_solve` for every layer ``l`` (by ``id``) and state ``s``,
        infinite where the layer cannot run so; None where some layer runs in no state.

        Every price and shuffle is at least zero and each layer is priced once,
        so an assignment costs at least its price along the spine (the layers
        from the input to the output through every residual block's branch
        and post-chain, :func:`_spine`), with each shuffle between them
        priced at a lower bound (:meth:`CostModel.redistribution_bounds`),
        plus the cheapest price of every other layer (the shortcuts'). A
        forward and a backward pass along the spine give, for each of its
        layers and each state, the least such bound of the assignments that
        run the layer with its input or output in that state; a shortcut's
        layer in a state adds its excess over its cheapest price to the
        least bound of all.
        """
        n = len(self.states)
        peer = self._peer
        side = 0.0
        for node in self._side:
            least = self._touching(node).min()
            if not np.isfinite(least):
                return None
            side += least
        # forward: the least bound of the chain up to each spine layer's output state
        arrive, leave = [], None
        for node in self._spine:
            a = np.zeros(n) if leave is None else \
                (leave[:, None] + self._shuffle_bounds(node.in_shape)).min(axis=0)
            stay, swap = self._prices[id(node)]
            leave = a + stay if swap is None else np.minimum(a + stay, a[peer] + swap)
            arrive.append(a)
        if leave is None or not np.isfinite(leave.min()):
            return None
        best = side + leave.min()
        bounds = {}
        for node in self._side:
            touch = self._touching(node)
            bounds[id(node)] = best + (touch - touch.min())
        after = np.zeros(n)  # backward: the least bound from each output state on
        for node, a in zip(reversed(self._spine), reversed(arrive)):
            stay, swap = self._prices[id(node)]
            via = a + stay + after
            if swap is not None:  # in the other state of the grid, out in s; in s, out there
                via = np.minimum(via, np.minimum(a[peer] + swap + after,
                                                 a + swap[peer] + after[peer]))
            bounds[id(node)] = side + via
            into = stay + after if swap is None else \
                np.minimum(stay + after, (swap + after)[peer])
            after = (self._shuffle_bounds(node.in_shape) + into[None, :]).min(axis=1)
        return bounds

    def _touching(self, node: Node) -> np.ndarray:
        """The cheapest price of ``node`` with its input or output in each state."""
        stay, swap = self._prices[id(node)]
        return stay if swap is None else np.minimum(stay, np.minimum(swap, swap[self._peer]))

    def _shuffle_bounds(self, shape: tuple[int, ...]) -> np.ndarray:
        """Lower bounds of :meth:`shuffle_matrix` (what a few spread ranks receive)."""
        if shape not in self._shuffle_low:
            p = self.cost.nprocs
            ranks = np.unique(np.linspace(0, p - 1, min(p, _BOUND_RANKS)).astype(np.intp))
            dists = [dist_for(shape, *st, inner=self.cost.inner) for st in self.states]
            m = self.cost.redistribution_bounds(dists, dists, ranks)
            m[np.diag_indices(len(self.states))] = 0.0
            self._shuffle_low[shape] = m
        return self._shuffle_low[shape]

    def _solve_on(self, sets: dict[int, np.ndarray]) -> tuple[dict[int, int] | None, float]:
        """The DP with each layer's states in ``sets`` (by ``id``, ascending): the
        assignment and its price."""
        self._sets = sets
        self.searched = float(np.mean([len(v) for v in sets.values()]))
        m, steps, _, _ = self._chain(self.items, None, pin=True)
        a, c = np.unravel_index(np.argmin(m), m.shape)
        if not np.isfinite(m[a, c]):
            return None, np.inf
        out: dict[int, int] = {}
        self._backtrack(steps, int(a), int(c), out)
        return out, float(m[a, c])

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
        costs: list[LayerCost] = []  # layers and shuffles in network order
        memory = self.base_memory
        transient = 0.0
        prev: list[Any] = [None]  # the layer that produced the current activation, unmoved
        groups = self.segments(assign) if self._recomputing else {}
        held: dict[int, list[float]] = {}  # segment -> [memory when kept, largest transient]
        # inference: arrays that callers hold while later layers run (the network's input,
        # the input of each residual block being run, the merged array its post-chain reads)
        pending = [0.0]
        inference = not self.cost.training

        def nbytes(shape: tuple[int, ...], c: int) -> float:
            return self.cost.itemsize * math.prod(largest_block(
                dist_for(shape, *self.states[c], inner=self.cost.inner)))

        def walk(items: list, current: int | None, own: float = 0.0) -> int | None:
            # own: bytes of the chain's input counted in pending (the first layer's input,
            # unless it is redistributed first)
            nonlocal memory, transient
            for it in items:
                if isinstance(it, Node):
                    c, o = _io(assign[id(it)])
                    moved = current is not None and current != c
                    if moved:
                        costs.append(LayerCost(comm=self._shuffle_cost(it.in_shape, current, c)))
                    lc = self.layer_cost(it, c, o)
                    g = groups.get(id(it), -1)
                    if g >= 0:  # recomputed: forward again in backward; kept at the start only
                        costs.append(replace(lc, bwd=lc.bwd + lc.fwd))
                        first = g not in held
                        h = held.setdefault(g, [0.0, 0.0])
                        h[0] += lc.memory
                        h[1] = max(h[1], lc.transient)
                        memory += lc.memory if first else 0.0  # the input, grown halo
                        prev[0] = None
                        current = o
                        own = 0.0
                        continue
                    costs.append(lc)
                    memory += lc.memory
                    if prev[0] is not None and not moved:  # one array, kept by both
                        memory -= min(prev[0].keeps_output, lc.keeps_input)
                    transient = max(transient, lc.transient + pending[0] -
                                    (0.0 if moved else own))
                    prev[0] = lc
                    current = o
                else:
                    prev[0] = None
                    start = current if current is not None else \
                        _io(assign[id(leaf_nodes([it])[0])])[0]
                    # the block's input stays alive until the block returns (its caller holds
                    # it), unless it is the chain's input, counted already
                    held_in = nbytes(it.in_shape, start) if inference and not own else 0.0
                    pending[0] += held_in
                    out = walk(it.branch, start, held_in or own)
                    prev[0] = None
                    if it.shortcut is None:
                        s = start
                        shape = it.in_shape
                    else:
                        s = walk(it.shortcut, start, held_in or own)
                        shape = it.shortcut[-1].out_shape
                    if s != out:
                        costs.append(LayerCost(comm=self._shuffle_cost(shape, s, out)))
                    prev[0] = None
                    # the merged array is held by the post-chain's call until it returns
                    merged = nbytes(it.post[0].in_shape, out) if inference and it.post else 0.0
                    pending[0] += merged
                    current = walk(it.post, out, merged)
                    pending[0] -= merged + held_in
                own = 0.0
            return current

        # inference: the network's input is held by the caller until the pass returns
        first_in = nbytes(self.items[0].in_shape, _io(assign[id(self.nodes[0])])[0]) \
            if inference and self.items else 0.0
        pending[0] += first_in
        walk(self.items, None, first_in)
        for kept, most in held.values():  # a segment's backward holds it all again
            transient = max(transient, kept + most)
        return step_time(costs, self.cost.overlap), memory + transient

    def segments(self, assign: dict[int, int]) -> dict[int, int]:
        """Recompute segments of an assignment: ``{id(node): segment number}``.

        A segment is a run of two or more consecutive layers of one chain in
        one candidate, starting at a layer that keeps its input (so keeping
        the segment's input costs nothing more); it ends before the next such
        layer, a change of candidate or a residual block. A layer that keeps
        its input but would stand alone (the next layer starts a segment too)
        joins the segment before it, whose recomputation then gives its input.
        """
        out: dict[int, int] = {}
        count = 0

        def close(runs: list[list[Node]]) -> None:
            # runs of one chain; an empty run separates layers in no segment
            nonlocal count
            merged: list[list[Node]] = []
            for run in runs:
                if len(run) == 1 and merged and merged[-1] and \
                        assign[id(merged[-1][-1])] == assign[id(run[0])]:
                    merged[-1].append(run[0])
                else:
                    merged.append(run)
            for run in merged:
                if len(run) >= 2:
                    for n in run:
                        out[id(n)] = count
                    count += 1

        def walk(items: list) -> None:
            runs: list[list[Node]] = []
            for it in items:
                if isinstance(it, Node):
                    c = assign[id(it)]
                    starts = self.layer_cost(it, *_io(c)).keeps_input > 0
                    last = runs[-1] if runs else []
                    if starts:
                        runs.append([it])
                    elif last and assign[id(last[-1])] == c:
                        last.append(it)
                    elif last:
                        runs.append([])  # this layer is in no segment
                else:
                    close(runs)
                    runs = []
                    walk(it.branch)
                    if it.shortcut:
                        walk(it.shortcut)
                    walk(it.post)
            close(runs)

        walk(self.items)
        return out

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
            prev = _io(value)[1]
        return assign, t, mem, notes

    def _plan_at_weight(self) -> tuple[dict[int, int], float, float, list[str]]:
        """The DP's plan (assignment, time, memory, notes) at the current gradient weight."""
        assign = self._solve(0.0)
        notes = list(self.notes)
        if assign is None:
            raise ValueError(self._nothing_fits())
        t, mem = self.assignment_cost(assign)
        if self.budget is not None and mem > self.budget:
            hi = 1e-6
            best = None
            for _ in range(60):  # grow lambda until the plan fits
                cand = self._solve(hi)
                if cand is not None and self.assignment_cost(cand)[1] <= self.budget:
                    best = cand
                    break
                hi *= 4
            if best is None:
                raise ValueError(self._nothing_fits())
            lo = 0.0
            for _ in range(30):  # then shrink it to the cheapest plan that still fits
                mid = (lo + hi) / 2
                cand = self._solve(mid)
                if cand is not None and self.assignment_cost(cand)[1] <= self.budget:
                    best, hi = cand, mid
                else:
                    lo = mid
            assign = best
            notes.append("memory budget active: the fastest plan did not fit")
            t, mem = self.assignment_cost(assign)
        return assign, t, mem, notes

    def _nothing_fits(self) -> str:
        budget, self.budget = self.budget, None  # the least memory any plan needs
        try:
            m = self._solve(np.inf)
        finally:
            self.budget = budget
        smallest = self.assignment_cost(m)[1] if m else float("nan")
        return (f"no distribution of this network on {self.cost.nprocs} "
                f"rank{'' if self.cost.nprocs == 1 else 's'} fits "
                f"{(self.budget or 0) / 2**20:.0f} MiB per rank (the smallest plan found needs "
                f"{smallest / 2**20:.0f} MiB)")

    def _make_plan(self, assign: dict[int, int], t: float, mem: float, notes: list) -> Plan:
        entries = []
        prev = None
        groups = self.segments(assign) if self._recomputing else {}
        seen: set[int] = set()
        for node in self.nodes:
            c, o = _io(assign[id(node)])
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
                                     split, self.mode(node, c, o), lc.kernels))
            prev = o
        step = self.assignment_step(assign)
        return Plan(self.cost.nprocs, self.batch_shape, self.cost.profile.name, entries, t, mem,
                    self.budget, notes, self.baseline, step.compute, step.exposed, step.hidden,
                    self.cost.training, self.cost.inner, self.cost.shard_state)

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


def apply_plan(model: Layer, plan: Plan, batch_shape: tuple[int, ...], comm: Any = None) -> None:
    """Set every layer's ``layout`` from ``plan`` (grids built over ``comm``).

    Layers are matched in traversal order; their input shapes must match the
    plan's, so a plan is only applied to the model and batch shape it was made for.
    Each layer's ``kernel_backend`` is set to the plan's choice
    (:attr:`PlanEntry.kernels`), which raises ImportError, before any layer
    changes, for a plan that chose the torch kernels in a process without PyTorch.
    Under a grid over (N, C, S..) a layer's input has its channels split
    along the channel axis or whole (``PlanEntry.split_channels``), and a
    layer with ``filter_axes`` (a convolution) splits its filters over that
    axis in the modes that do ("gathered", "filter", "grouped"; :data:`MODES`); a plan
    without modes (an older plan file) splits them wherever it splits the
    channels.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_size() != plan.nprocs:
        raise ValueError(f"the plan is for {plan.nprocs} rank{'' if plan.nprocs == 1 else 's'}, "
                         f"the job has {comm.Get_size()}")
    nodes = leaf_nodes(trace(model, tuple(batch_shape)))
    if len(nodes) != len(plan.entries) or any(
        tuple(n.in_shape) != tuple(e.in_shape) for n, e in zip(nodes, plan.entries)
    ):
        raise ValueError("the plan does not match this model and batch shape")
    for entry in plan.entries:
        check_backend(entry.kernels or None)
    grids: dict[tuple[int, ...], ProcessGrid] = {}
    for node, entry in zip(nodes, plan.entries):
        g = tuple(entry.grid)
        dist = dist_for(tuple(node.in_shape), g, entry.split_channels, inner=plan.inner)
        if dist.grid_shape not in grids:
            grids[dist.grid_shape] = ProcessGrid(dist.grid_shape, comm)
        ndim = len(node.in_shape)
        node.layer.layout = Layout(grids[dist.grid_shape], dist.axes)
        if entry.kernels:  # a plan that chose the layer's kernels (older plans did not)
            node.layer.kernel_backend = entry.kernels
        if hasattr(node.layer, "filter_axes") and ndim > 2:
            split = entry.mode in ("gathered", "filter", "grouped") if entry.mode else \
                len(g) == ndim
            # the grid axis of the channel factor (second in the candidate, first with
            # the sample split laid out last)
            channel_axis = dist_for(tuple(node.in_shape), g, inner=plan.inner).dim_axes[1] \
                if len(g) == ndim else ()
            node.layer.filter_axes = channel_axis if split else ()
