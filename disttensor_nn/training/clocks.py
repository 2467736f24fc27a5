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
from typing import Any

import numpy as np
from mpi4py import MPI

from ..module import RemovableHandle

__all__ = ["LayerClocks"]

_PASSES = 3
"""Pass slots of a layer in one step: its forward, a second forward (a recomputed segment
runs its layers' forward again during backward), its backward."""


class LayerClocks:
    """Forward and backward clocks of ``nodes``' layers (each with a ``layer``), kept by
    hooks on them from construction until :meth:`remove`.

    Call :meth:`start_step` at the start of each step, at the same moment on every rank
    (after a barrier: the steps' starts are the clocks' common origin). Every rank runs
    every layer in the same order, as the layers' collectives require.

    Parameters
    ----------
    nodes : list
        Objects with a ``layer`` attribute (the planner's leaf nodes).
    kept_steps : int
        How many of the last steps :meth:`spans` averages over (the ranks' own
        clocks, :meth:`durations`, cover every step).
    """

    def __init__(self, nodes: list, kept_steps: int = 256) -> None:
        n = len(nodes)
        # [row, node, pass, begin/end]: seconds since the row's step started; -inf unused
        self._stamps = np.full((max(kept_steps, 1), n, _PASSES, 2), -np.inf)
        self._own = np.zeros(n)
        self._steps = 0
        self._row = 0
        self._t0 = time.perf_counter()
        self._forwards = np.zeros(n, dtype=np.int64)  # forward passes of each node this step
        self._open = np.zeros((n, 2))  # when each node's backward [0] or forward [1] began
        self._handles: list[RemovableHandle] = []
        for i, node in enumerate(nodes):
            layer = node.layer
            self._handles += [
                layer.register_forward_pre_hook(lambda *_, i=i: self._begin(i, True)),
                layer.register_forward_hook(lambda *_, i=i: self._end(i, True)),
                layer.register_full_backward_pre_hook(lambda *_, i=i: self._begin(i, False)),
                layer.register_full_backward_hook(lambda *_, i=i: self._end(i, False))]

    def _slot(self, i: int, forward: bool) -> int | None:
        """The pass slot of node ``i``'s pass now (None: a third forward in one step)."""
        if not forward:
            return 2
        return None if self._forwards[i] > 2 else int(self._forwards[i]) - 1

    def _begin(self, i: int, forward: bool) -> None:
        now = time.perf_counter() - self._t0
        self._forwards[i] += forward
        self._open[i, int(forward)] = now
        slot = self._slot(i, forward)
        if slot is not None:
            self._stamps[self._row, i, slot, 0] = now

    def _end(self, i: int, forward: bool) -> None:
        now = time.perf_counter() - self._t0
        self._own[i] += now - self._open[i, int(forward)]
        slot = self._slot(i, forward)
        if slot is not None:
            self._stamps[self._row, i, slot, 1] = now

    def start_step(self) -> None:
        """A new step starts now (on every rank at once)."""
        if self._steps:
            self._row = (self._row + 1) % len(self._stamps)
        self._stamps[self._row] = -np.inf
        self._forwards[:] = 0
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
        """Per layer, this rank's own seconds in its passes, summed over the recorded steps
        (waits for other ranks inside them included)."""
        return self._own.copy()

    def spans(self, comm: MPI.Comm) -> np.ndarray:
        """Per layer, the mean over the last recorded steps (``kept_steps``) of the time
        from the last rank's start of each of its passes to the last rank's end of it,
        summed over the passes. Collective over ``comm``; the same on every rank."""
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

    def __enter__(self) -> LayerClocks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
