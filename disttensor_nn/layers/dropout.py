"""Dropout whose mask is a hash of the global index: the same on any split."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import as_module, device_of, writes_in_place
from disttensor.random import splitmix64

from ..costspec import CostSpec, largest_block
from ..module import Layer

__all__ = ["Dropout"]


def _global_index(dist: Distribution, xp: Any) -> Any:
    """Row-major global index (uint64) of every element of this rank's block."""
    shape = dist.global_shape
    idx = xp.zeros((1,) * len(shape), dtype=xp.uint64)
    stride = 1
    for d in reversed(range(len(shape))):
        sl = dist.local_slices()[d]
        r = xp.arange(sl.start, sl.stop, dtype=xp.uint64) * xp.uint64(stride)
        idx = idx + r.reshape((1,) * d + (-1,) + (1,) * (len(shape) - d - 1))
        stride *= shape[d]
    return idx


class Dropout(Layer):
    """Zero each element with probability ``p`` in training, scaling the others by ``1/(1-p)``.

    The mask is a counter-based hash (:func:`disttensor.random.splitmix64`)
    of the element's global index, the layer's ``seed`` and the number of
    backward passes run so far (the buffer ``draws``, saved in checkpoints),
    so a split run draws exactly what one process draws, a resumed run what
    the uninterrupted one draws, and a recomputed forward pass
    (:mod:`disttensor_nn.recompute`) draws its mask again. Evaluation mode
    passes the input through.

    Parameters
    ----------
    p : float
        Probability of zeroing, in [0, 1).
    seed : int
        Selects the masks; the same on every rank.
    """

    saved_for_backward = ("_mask",)

    def __init__(self, p: float = 0.5, *, seed: int = 0):
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p < 1:
            raise ValueError(f"p must be a number in [0, 1), got {p!r}")
        self.p, self.seed = float(p), int(seed)
        # backward passes so far (the masks' counter): a buffer, so checkpoints restore it
        self.register_buffer("draws", np.zeros((), np.int64))

    def _key(self) -> int:
        seed = np.random.SeedSequence([self.seed, 0x6D61736B]).generate_state(1, np.uint64)[0]
        return int(splitmix64(np.uint64(int(self.draws)), np.uint64(seed)))

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray):
            raise TypeError(f"Dropout expects a DistArray, got {type(x).__name__}")
        if not self.training or self.p == 0:
            self._mask = None
            return x
        # NumPy and CuPy hash on their own arrays; other libraries get the host's mask
        xp = x.xp if writes_in_place(x.xp) else np
        key = np.uint64(self._key())
        bits = splitmix64(splitmix64(_global_index(x.dist, xp), key), key)
        u = (bits >> xp.uint64(11)).astype(np.float64) * (2.0 ** -53)
        scale = x.dtype.type(1.0 / (1.0 - self.p))
        mask = xp.where(u >= self.p, scale, x.dtype.type(0))
        self._mask = mask if xp is x.xp else as_module(mask, x.xp, device_of(x.local))
        return DistArray(x.local * self._mask, x.dist)

    def backward(self, dy: DistArray) -> DistArray:
        mask = self._mask
        if mask is None:
            return dy
        self.draws[...] = int(self.draws) + 1
        return DistArray(dy.local * mask, dy.dist)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """A hash per element; the scaled mask is kept for backward."""
        block = largest_block(dist)
        n = math.prod(block)
        return CostSpec(block, flops=20.0 * n, nbytes=3 * n * itemsize, saved=n * itemsize,
                        workspace=2 * n * 8)

    def kernel_signature(self) -> str:
        return "dropout"

    def __repr__(self) -> str:
        return f"Dropout(p={self.p})"
