"""Recompute (activation checkpointing): a run of layers keeps only its input between passes.

A segment is a run of consecutive layers that their container calls one
after the other in one layout. After the segment's forward pass, what its
layers saved for backward is dropped
(:meth:`~disttensor_nn.Layer.release_saved`) and only the segment's input is kept;
before its backward pass, the segment's forward is run again from that
input (halo exchanges and statistics included, collectively on every
rank), with the layers' buffers (batch-norm running statistics) restored
afterwards, so the recomputation changes nothing but the time. The
mechanism is hooks on the layers (:meth:`~disttensor_nn.Layer.register_forward_hook`
and friends): the model's structure and state dict are unchanged. The
planner chooses segments when the budget demands it
(:class:`~disttensor_nn.plan.Planner` ``recompute=``), and
:func:`recompute_segments` installs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .module import Layer, RemovableHandle

__all__ = ["Segment", "recompute_segments"]


class Segment:
    """Recompute one run of consecutive layers (see the module's description).

    Parameters
    ----------
    layers : sequence of Layer
        Consecutive leaf layers that their container calls in this order, all
        in one layout (no redistribution between them).
    """

    def __init__(self, layers: Sequence[Layer]):
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("a recompute segment needs at least one layer")
        self._input: Any = None
        first, last = self.layers[0], self.layers[-1]
        self.handles: list[RemovableHandle] = [
            first.register_forward_pre_hook(self._keep_input),
            last.register_forward_hook(self._drop_after_forward),
            last.register_full_backward_pre_hook(self._recompute),
            first.register_full_backward_hook(self._drop_after_backward),
        ]

    def _keep_input(self, layer: Layer, x: Any) -> None:
        self._input = x

    def _drop(self) -> None:
        for layer in self.layers:
            layer.release_saved()

    def _drop_after_forward(self, layer: Layer, x: Any, y: Any) -> None:
        self._drop()

    def _recompute(self, layer: Layer, dy: Any) -> None:
        if self._input is None:
            raise RuntimeError("recompute segment: backward without a forward pass")
        buffers = [(m, name, value) for m in self.layers
                   for name, value in m.named_buffers(recurse=False)]
        x = self._input
        for m in self.layers:
            x = m.forward(x)
        for m, name, value in buffers:  # running statistics are updated once per step
            setattr(m, name, value)

    def _drop_after_backward(self, layer: Layer, dx: Any, dy: Any) -> None:
        self._drop()
        self._input = None

    def remove(self) -> None:
        """Stop recomputing: remove the hooks (the layers keep their state again)."""
        for h in self.handles:
            h.remove()
        self.handles = []


def recompute_segments(layers: Sequence[Layer], groups: Sequence[int]) -> list[Segment]:
    """Install a :class:`Segment` for every run of ``layers`` with the same group number.

    ``layers`` are leaf layers in network order and ``groups`` their group
    numbers (``-1``: not recomputed), as the planner's entries give them
    (:attr:`disttensor_nn.plan.PlanEntry.recompute`).
    """
    if len(layers) != len(groups):
        raise ValueError(f"{len(layers)} layers but {len(groups)} group numbers")
    runs: dict[int, list[Layer]] = {}
    for layer, g in zip(layers, groups):
        if g >= 0:
            runs.setdefault(g, []).append(layer)
    return [Segment(run) for run in runs.values()]
