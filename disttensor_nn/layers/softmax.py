"""Softmax over the channels of (N, C, *S) activations: local, the channels are never split."""

from __future__ import annotations

import math

from disttensor import DistArray, Distribution

from ..costspec import CostSpec, largest_block
from ..module import Layer, check_input

__all__ = ["Softmax"]


class Softmax(Layer):
    """``exp(x) / sum(exp(x), axis=dim)`` over the channel dimension, as ``torch.nn.Softmax(1)``.

    Parameters
    ----------
    dim : int
        Only the channel dimension (1) is supported: it is never split, so
        the layer needs no communication on any sample or spatial split.
    """

    saved_for_backward = ("_y",)

    def __init__(self, dim: int = 1):
        if isinstance(dim, bool) or dim != 1:
            raise ValueError(f"Softmax runs over the channels (dim=1) only, got dim={dim!r}")
        self.dim = 1

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray) or x.ndim < 2:
            raise TypeError("Softmax expects an (N, C, ...) DistArray")
        check_input(x, x.ndim, "Softmax")
        xp = x.xp
        z = x.local - xp.max(x.local, axis=1, keepdims=True) if x.local.size else x.local
        e = xp.exp(z)
        y = e / xp.sum(e, axis=1, keepdims=True)
        self._y = y
        return DistArray(y, x.dist)

    def backward(self, dy: DistArray) -> DistArray:
        y, g = self._y, dy.local
        return DistArray(y * (g - dy.xp.sum(g * y, axis=1, keepdims=True)), dy.dist)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """A few FLOPs per element; the output is kept for backward."""
        block = largest_block(dist)
        n = math.prod(block)
        return CostSpec(block, flops=5.0 * n, nbytes=2 * n * itemsize, keeps_output=True,
                        workspace=2 * n * itemsize)
