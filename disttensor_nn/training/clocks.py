"""Each layer's time in a training step: on this rank, and as the job sees it.

A rank's own clock of a layer (the time between the hooks around its
forward or backward) includes the time the layer waited, inside its halo
exchanges and reductions, for ranks that earlier layers delayed: on the
slowest rank the delay is in the slow layer, on the others in the first
layer after it that synchronises (a batch norm after a convolution whose
blocks differ, say). The slowest rank's clock of each layer therefore counts
such a delay twice. :class:`LayerClocks` keeps, besides the ranks' own
clocks, each pass's start and end in the step, and gives each layer the
time from the last rank's start of the pass to the last rank's end of it:
what the layer adds to the step on its critical path, a delay counted once,
in the layer that made it.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..module import RemovableHandle

__all__ = ["LayerClocks"]


class LayerClocks:
    """Forward and backward clocks of ``nodes``' layers (each with a ``layer``), kept by
    hooks on them from construction until :meth:`remove`.

    Call :meth:`start_step` at the start of each step, at the same moment on every rank
    (after a barrier: the steps' starts are the clocks' common origin). Every rank runs
    every layer in the same order, as the layers' collectives require.

    A layer's passes in a step are its forwards and backwards in the order they run (two
    for a step of one batch; ``2 K`` for ``K`` accumulated micro-batches); the k-th is
    matched with every other rank's k-th. A forward that a recomputed segment runs inside
    a backward calls the layers' own ``forward`` and is in no layer's clocks.

    Parameters
    ----------
    nodes : list
        Objects with a ``layer`` attribute (the planner's leaf nodes).
    passes : int
        The passes of a layer in one step that :meth:`spans` keeps (more are in the ranks'
        own clocks only).
    kept_steps : int
        How many of the last steps :meth:`spans` averages over (the ranks' own
        clocks, :meth:`durations`, cover every step).
    """

    def __init__(self, nodes: list, passes: int = 2, kept_steps: int = 256) -> None:
        n = len(nodes)
        # [row, node, pass, begin/end]: seconds since the row's step started; -inf unused
        self._stamps = np.full((max(kept_steps, 1), n, max(passes, 1), 2), -np.inf)
        self._own = np.zeros(n)
        self._steps = 0
        self._row = 0
        self._t0 = time.perf_counter()
        self._passes = np.zeros(n, dtype=np.int64)  # passes of each node begun this step
        self._open = np.zeros(n)  # when each node's pass now running began
        self._handles: list[RemovableHandle] = []
        for i, node in enumerate(nodes):
            layer = node.layer
            self._handles += [
                layer.register_forward_pre_hook(lambda *_, i=i: self._begin(i)),
                layer.register_forward_hook(lambda *_, i=i: self._end(i)),
                layer.register_full_backward_pre_hook(lambda *_, i=i: self._begin(i)),
                layer.register_full_backward_hook(lambda *_, i=i: self._end(i))]

    def _begin(self, i: int) -> None:
        now = time.perf_counter() - self._t0
        self._open[i] = now
        k = int(self._passes[i])
        self._passes[i] += 1
        if k < self._stamps.shape[2]:
            self._stamps[self._row, i, k, 0] = now

    def _end(self, i: int) -> None:
        now = time.perf_counter() - self._t0
        self._own[i] += now - self._open[i]
        k = int(self._passes[i]) - 1
        if k < self._stamps.shape[2]:
            self._stamps[self._row, i, k, 1] = now

    def start_step(self) -> None:
        """A new step starts now (on every rank at once)."""
        if self._steps:
            self._row = (self._row + 1) % len(self._stamps)
        self._stamps[self._row] = -np.inf
        self._passes[:] = 0
        self._steps += 1
        self._t0 = time.perf_counter()

    def discard(self) -> None:
        """Forget the steps so far (the first, which warmed caches and the allocator)."""
        self._stamps[:] = -np.inf
        self._own[:] = 0.0
        self._steps = 0
        self._row = 0

    @property
    def steps(self) -> int:
        """Steps recorded since construction or :meth:`discard`."""
        return self._steps

    def durations(self) -> np.ndarray:
        """This rank's own clocks.

        Returns
        -------
        numpy.ndarray
            Per layer, the seconds of its passes on this rank, summed over the recorded
            steps (waits for other ranks inside them included).
        """
        return self._own.copy()

    def spans(self, comm: MPI.Comm) -> np.ndarray:
        """What each layer adds to a step. Collective over ``comm``.

        Returns
        -------
        numpy.ndarray
            Per layer, the time from the last rank's start of each of its passes to the
            last rank's end of it, summed over its passes and averaged over the last
            recorded steps (at most ``kept_steps``); the same on every rank.
        """
        used = min(self._steps, len(self._stamps))
        stamps = np.ascontiguousarray(self._stamps[:used])
        if comm.Get_size() > 1:
            comm.Allreduce(MPI.IN_PLACE, stamps, op=MPI.MAX)
        if not used:
            return np.zeros(stamps.shape[1])
        begin, end = stamps[..., 0], stamps[..., 1]
        ran = np.isfinite(begin) & np.isfinite(end)
        per_step = np.where(ran, end - begin, 0.0).sum(axis=2)
        return per_step.mean(axis=0)

    def remove(self) -> None:
        """Remove the hooks: the clocks stop."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
