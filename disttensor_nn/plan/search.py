"""The planner's search: the min-plus dynamic program over a traced chain, given each layer's
prices and the shuffles' costs, with its exact pruning by lower bounds.

Layers' states index the planner's list of activation layouts. A layer's
price in each state is a pair ``(stay, swap)`` of arrays over the states:
``stay[o]`` runs it with its input and output in ``o``; ``swap[o]`` (None
for a layer that cannot change the state) with its output in ``o`` and its
input in ``o``'s peer, the other state of ``o``'s grid. With ``C`` states,
each step of the chain is a ``C x C`` matrix (the shuffle from the arriving
state to the layer's input state, plus the layer's price); a residual
block's is its branch's chain matrix plus its shortcut's; chaining is a
min-plus matrix product (:func:`minplus`). :class:`ChainSearch` runs the
DP over given sets of states, :func:`lower_bounds` bounds every layer's
states from below, and :func:`solve_pruned` runs the DP over only the
states that can be in a cheapest assignment.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .tracing import Block, Node

__all__ = ["minplus", "ChainSearch", "backtrack", "lower_bounds", "touching", "solve_pruned"]

#: Largest ``rows x middle x columns`` a min-plus product broadcasts at once.
_MINPLUS_CUBE = 2**17
#: States of smallest lower bound whose DP gives the pruning bound (solve_pruned).
_FIRST_STATES = 16
#: Relative slack of the pruning test, far above the rounding of summing layer prices.
_SLACK = 1e-9

#: Each layer's ``(stay, swap)`` prices over the states, by ``id`` of its node.
Prices = dict[int, tuple[np.ndarray, "np.ndarray | None"]]
#: Seconds to move an activation of a shape from states ``rows`` to states ``cols``.
Shuffles = Callable[[tuple[int, ...], np.ndarray, np.ndarray], np.ndarray]


def minplus(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


class ChainSearch:
    """The DP over a traced chain with each layer's states in ``sets`` (by ``id``,
    ascending indices into the states).

    Parameters
    ----------
    prices : dict
        Each layer's ``(stay, swap)`` prices over all states, by ``id``.
    sets : dict
        The states each layer may use, by ``id``.
    peer : ndarray
        The other state of each state's grid (the state itself where there is none).
    shuffles : callable
        ``shuffles(shape, rows, cols)``: seconds to move an activation of
        ``shape`` from each state of ``rows`` to each of ``cols``.
    modal : callable
        ``modal(node)``: whether the layer may change the state (has a ``swap`` price).
    """

    def __init__(self, prices: Prices, sets: dict[int, np.ndarray], peer: np.ndarray,
                 shuffles: Shuffles, modal: Callable[[Node], bool]):
        self.prices, self.sets, self.peer = prices, sets, peer
        self.shuffles, self.modal = shuffles, modal

    def solve(self, items: list) -> tuple[dict[int, int] | None, float]:
        """The cheapest assignment of the chain ``items`` (its input in the layout of its
        first layer) and its price; ``(None, inf)`` where nothing runs."""
        m, steps, _, _ = self.chain(items, None, pin=True)
        a, c = np.unravel_index(np.argmin(m), m.shape)
        if not np.isfinite(m[a, c]):
            return None, np.inf
        out: dict[int, int] = {}
        backtrack(steps, int(a), int(c), out)
        return out, float(m[a, c])

    def modal_step(self, sh: np.ndarray, node: Node, st: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        """A convolution's step matrix: the shuffle to its input state ``c`` (``sh``), then
        the layer from ``c`` to its output state ``o`` (one of the two states of ``o``'s
        grid); and the chosen ``c`` for each (arriving state, ``o``). Over the layer's
        states ``st`` (local indices into it)."""
        stay, swap = (v[st] for v in self.prices[id(node)])
        own = np.arange(len(st))
        local = np.full(len(self.peer), -1, dtype=np.intp)
        local[st] = own
        peer = local[self.peer[st]]
        swap = np.where(peer >= 0, swap, np.inf)  # the other state is not searched
        peer = np.where(peer >= 0, peer, own)
        t1 = sh + stay[None, :]
        t2 = sh[:, peer] + swap[None, :]
        return np.minimum(t1, t2), np.where(t2 < t1, peer[None, :], own[None, :])

    def chain(self, items: list, rows: np.ndarray | None, pin: bool = False):
        """Matrix M[a, c] of a chain (input in state ``rows[a]``, output in ``cols[c]``),
        its backtracking record, ``rows`` and ``cols``. Each layer's states are its
        set in :attr:`sets`.

        With ``pin`` the input arrives in the layout of the chain's first layer
        (as the data loader provides it): ``a`` is that layout, at no cost, and
        ``rows`` (None) is the first layer's states.
        """
        steps = []
        acc = None
        cur = rows
        for k, it in enumerate(items):
            if isinstance(it, Node):
                st = self.sets[id(it)]
                if pin and k == 0:
                    rows = cur = st
                    sh = np.where(np.eye(len(st), dtype=bool), 0.0, np.inf)
                else:
                    sh = self.shuffles(it.in_shape, cur, st)
                if self.modal(it):  # input moved to c, the layer from c to its output's state
                    t, sub = self.modal_step(sh, it, st)
                else:
                    t, sub = sh + self.prices[id(it)][0][st][None, :], None
                cur = st
            else:
                t, sub, first, cur = self.block(it, cur, pin and k == 0)
                if pin and k == 0:
                    rows = first
                st = cur
            if acc is None:
                acc, arg = t, None
            else:
                acc, arg = minplus(acc, t)
            steps.append((it, arg, sub, st))
        if acc is None:  # empty chain: identity, moving costs nothing
            acc = np.where(np.eye(len(rows), dtype=bool), 0.0, np.inf)
            cur = rows
        return acc, steps, rows, cur

    def block(self, blk: Block, rows: np.ndarray | None, pin: bool = False):
        """A residual block's matrix (as :meth:`chain` gives a chain's): its branch's plus
        its shortcut's (or the shuffle of its input to the branch's output), then its
        post-chain."""
        b, bsteps, rows, bcols = self.chain(blk.branch, rows, pin)
        if blk.shortcut is None:
            s, ssteps = self.shuffles(blk.in_shape, rows, bcols), None
            sarg = None
        else:
            sm, ssteps, _, scols = self.chain(blk.shortcut, rows)
            s, sarg = minplus(sm, self.shuffles(blk.shortcut[-1].out_shape, scols, bcols))
        pre = b + s
        cols = bcols
        if blk.post:
            p, psteps, _, cols = self.chain(blk.post, bcols)
            t, parg = minplus(pre, p)
        else:
            t, parg, psteps = pre, None, []
        return t, (bsteps, ssteps, sarg, psteps, parg), rows, cols


def backtrack(steps: list, a: int, c: int, out: dict) -> None:
    """Fill ``out[id(node)]`` (a state, or (input state, output state) where they differ)
    for a chain whose input is in its ``a``-th row state, output in its ``c``-th
    column state (``steps``: :meth:`ChainSearch.chain`'s record)."""
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
                backtrack(psteps, mid, c, out)
            backtrack(bsteps, prev, mid, out)
            if ssteps is not None:
                backtrack(ssteps, prev, sarg[prev, mid], out)
        c = prev


def touching(prices: Prices, peer: np.ndarray, node: Node) -> np.ndarray:
    """The cheapest price of ``node`` with its input or output in each state."""
    stay, swap = prices[id(node)]
    return stay if swap is None else np.minimum(stay, np.minimum(swap, swap[peer]))


def lower_bounds(path: list[Node], side: list[Node], prices: Prices, peer: np.ndarray,
                 shuffle_bounds: Callable[[tuple[int, ...]], np.ndarray]
                 ) -> dict[int, np.ndarray] | None:
    """``LB_l(s)`` of :func:`solve_pruned` for every layer ``l`` (by ``id``) and state
    ``s``, infinite where the layer cannot run so; None where some layer runs in no state.

    ``path`` and ``side`` are the chain's spine and its other layers
    (:func:`~disttensor_nn.plan.tracing.spine`); ``shuffle_bounds(shape)``
    bounds the matrix of shuffle costs of an activation of ``shape`` from below.

    Every price and shuffle is at least zero and each layer is priced once,
    so an assignment costs at least its price along the spine (the layers
    from the input to the output through every residual block's branch
    and post-chain), with each shuffle between them
    priced at a lower bound (:meth:`CostModel.redistribution_bounds`),
    plus the cheapest price of every other layer (the shortcuts'). A
    forward and a backward pass along the spine give, for each of its
    layers and each state, the least such bound of the assignments that
    run the layer with its input or output in that state; a shortcut's
    layer in a state adds its excess over its cheapest price to the
    least bound of all.
    """
    n = len(peer)
    least_side = 0.0
    for node in side:
        least = touching(prices, peer, node).min()
        if not np.isfinite(least):
            return None
        least_side += least
    # forward: the least bound of the chain up to each spine layer's output state
    arrive, leave = [], None
    for node in path:
        a = np.zeros(n) if leave is None else \
            (leave[:, None] + shuffle_bounds(node.in_shape)).min(axis=0)
        stay, swap = prices[id(node)]
        leave = a + stay if swap is None else np.minimum(a + stay, a[peer] + swap)
        arrive.append(a)
    if leave is None or not np.isfinite(leave.min()):
        return None
    best = least_side + leave.min()
    bounds = {}
    for node in side:
        touch = touching(prices, peer, node)
        bounds[id(node)] = best + (touch - touch.min())
    after = np.zeros(n)  # backward: the least bound from each output state on
    for node, a in zip(reversed(path), reversed(arrive)):
        stay, swap = prices[id(node)]
        via = a + stay + after
        if swap is not None:  # in the other state of the grid, out in s; in s, out there
            via = np.minimum(via, np.minimum(a[peer] + swap + after,
                                             a + swap[peer] + after[peer]))
        bounds[id(node)] = least_side + via
        into = stay + after if swap is None else \
            np.minimum(stay + after, (swap + after)[peer])
        after = (shuffle_bounds(node.in_shape) + into[None, :]).min(axis=1)
    return bounds


def solve_pruned(bounds: dict[int, np.ndarray], nstates: int,
                 solve_on: Callable[[dict[int, np.ndarray]],
                                    tuple[dict[int, int] | None, float]],
                 max_states: int | None = None) -> dict[int, int] | None:
    """The DP's cheapest assignment over the states that can be in one (None: nothing fits).

    ``solve_on(sets)`` runs the DP with each layer's states in ``sets``
    (:meth:`ChainSearch.solve`); ``bounds`` are :func:`lower_bounds`'. The DP
    runs, for each layer, over the states in which it can be in a
    cheapest assignment (exact pruning): an assignment that runs layer
    ``l`` with its input or output in state ``s`` costs at least
    ``LB_l(s)``; the DP over each layer's few
    states of smallest ``LB_l`` gives an assignment of cost ``U``, which
    the optimum cannot exceed, so a layer is not run in a state with
    ``LB_l(s) > U`` in any cheapest assignment, and the DP over the other
    states finds the assignment the DP over all states finds (its ties
    broken the same way: leaving out options it does not take leaves
    every choice it takes unchanged). With ``max_states``, each layer keeps
    only those of these states among its ``max(max_states, 16)`` of smallest
    bound: no longer exact.
    """
    finite = min(int(np.count_nonzero(np.isfinite(b))) for b in bounds.values())
    k = min(finite, _FIRST_STATES)
    while True:
        first = {i: np.sort(np.argsort(b, kind="stable")[:k])
                 for i, b in bounds.items()}
        assign, value = solve_on(first)
        if assign is not None or k >= nstates:
            break
        k = min(nstates, 2 * k)
    if assign is None:
        return None
    keep = {i: np.flatnonzero(b <= value + _SLACK * abs(value))
            for i, b in bounds.items()}
    if max_states is not None:  # the most promising states only: not exact
        keep = {i: np.intersect1d(v, np.argsort(bounds[i], kind="stable")[
            :max(max_states, _FIRST_STATES)]) for i, v in keep.items()}
    if any(not np.array_equal(keep[i], first[i]) for i in keep):
        assign = solve_on(keep)[0] or assign  # (fewer states: no worse)
    return assign
