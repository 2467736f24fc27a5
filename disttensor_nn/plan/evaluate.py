"""Price a complete assignment of states to a traced chain exactly, by walking the graph:
its step time and peak memory, and its recompute segments.

An assignment maps ``id(node)`` of each layer (:func:`~disttensor_nn.plan.tracing.trace`)
to its state, or to ``(input state, output state)`` for a layer that changes
the state (:func:`io_states`). The planner checks the DP's assignments with
:func:`walk_assignment` and reports their prices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from .costmodel import LayerCost, StepTime, step_time
from .tracing import Node, leaf_nodes

__all__ = ["io_states", "walk_assignment", "segments"]

#: ``layer_cost(node, c, o)``: a layer's cost from state ``c`` to state ``o``.
LayerCosts = Callable[[Node, int, int], LayerCost]


def io_states(value: int | tuple[int, int]) -> tuple[int, int]:
    """(input state, output state) of an assignment's value for one layer."""
    return (value, value) if isinstance(value, (int, np.integer)) else \
        (int(value[0]), int(value[1]))


def walk_assignment(items: list, assign: dict, layer_cost: LayerCosts,
                    shuffle_cost: Callable[[tuple[int, ...], int, int], float],
                    nbytes: Callable[[tuple[int, ...], int], float], base_memory: float,
                    training: bool, overlap: bool, groups: dict[int, int]
                    ) -> tuple[StepTime, float]:
    """The step time (:func:`~disttensor_nn.plan.costmodel.step_time`) and peak memory of
    a complete assignment ``{id(node): state}`` of the chain ``items``.

    ``layer_cost(node, c, o)`` prices a layer from state ``c`` to ``o``,
    ``shuffle_cost(shape, i, j)`` moves an activation of ``shape`` from state
    ``i`` to ``j``, ``nbytes(shape, c)`` is the largest block of such an
    activation in state ``c``; ``base_memory`` is what the process holds
    besides the layers, ``groups`` the recompute segments (:func:`segments`;
    empty: every activation kept), ``training`` False for an inference pass
    (nothing kept), ``overlap`` whether gradient reductions overlap backward.
    The peak is ``base_memory`` plus what every layer keeps from forward to
    backward (an activation kept by both layers it joins counted once), plus
    the largest transient need of one layer's pass.
    """
    costs: list[LayerCost] = []  # layers and shuffles in network order
    memory = base_memory
    transient = 0.0
    prev: list[Any] = [None]  # the layer that produced the current activation, unmoved
    held: dict[int, list[float]] = {}  # segment -> [memory when kept, largest transient]
    # inference: arrays that callers hold while later layers run (the network's input,
    # the input of each residual block being run, the merged array its post-chain reads)
    pending = [0.0]
    inference = not training

    def walk(items: list, current: int | None, own: float = 0.0) -> int | None:
        # own: bytes of the chain's input counted in pending (the first layer's input,
        # unless it is redistributed first)
        nonlocal memory, transient
        for it in items:
            if isinstance(it, Node):
                c, o = io_states(assign[id(it)])
                moved = current is not None and current != c
                if moved:
                    costs.append(LayerCost(comm=shuffle_cost(it.in_shape, current, c)))
                lc = layer_cost(it, c, o)
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
                    io_states(assign[id(leaf_nodes([it])[0])])[0]
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
                    costs.append(LayerCost(comm=shuffle_cost(shape, s, out)))
                prev[0] = None
                # the merged array is held by the post-chain's call until it returns
                merged = nbytes(it.post[0].in_shape, out) if inference and it.post else 0.0
                pending[0] += merged
                current = walk(it.post, out, merged)
                pending[0] -= merged + held_in
            own = 0.0
        return current

    # inference: the network's input is held by the caller until the pass returns
    first_in = nbytes(items[0].in_shape, io_states(assign[id(leaf_nodes(items)[0])])[0]) \
        if inference and items else 0.0
    pending[0] += first_in
    walk(items, None, first_in)
    for kept, most in held.values():  # a segment's backward holds it all again
        transient = max(transient, kept + most)
    return step_time(costs, overlap), memory + transient


def segments(items: list, assign: dict, layer_cost: LayerCosts) -> dict[int, int]:
    """Recompute segments of an assignment: ``{id(node): segment number}``.

    A segment is a run of two or more consecutive layers of one chain in
    one candidate, starting at a layer that keeps its input (so keeping
    the segment's input costs nothing more); it ends before the next such
    layer, a change of candidate or a residual block. A layer that keeps
    its input but would stand alone (the next layer starts a segment too)
    joins the segment before it, whose recomputation then gives its input.
    ``layer_cost(node, c, o)`` prices a layer (as :func:`walk_assignment` takes it).
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
                starts = layer_cost(it, *io_states(c)).keeps_input > 0
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

    walk(items)
    return out
