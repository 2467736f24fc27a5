"""Element-wise layers (ReLU, LeakyReLU, Sigmoid) and the residual Add: local, no communication."""

from __future__ import annotations

import math

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import empty_like_layout, writes_in_place

from ..costspec import CostSpec, largest_block
from ..kernels import kernels_for, torch_kernels
from ..module import Layer, check_grad

__all__ = ["ReLU", "LeakyReLU", "Sigmoid", "Add"]


class LeakyReLU(Layer):
    """``max(x, 0) + negative_slope * min(x, 0)``, applied to each local element.

    Backward keeps only the one-byte mask ``x > 0`` (with the torch kernels
    and a slope of at least 0, the output, whose sign is the input's).
    """

    saved_for_backward = ("_mask",)
    kernel_backends = ("numpy", "torch")
    reads_grad_only = True

    def __init__(self, negative_slope: float = 0.01):
        self.negative_slope = negative_slope

    def takes_channels_last(self, dist: Distribution) -> bool:
        """True: its output, mask and input gradient are made in its input's layout."""
        return True

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray):
            raise TypeError(f"{type(self).__name__} expects a DistArray")
        xp, xl = x.xp, x.local
        if self.kernel_backend == "torch":
            y, self._mask = kernels_for(xl, "torch").relu_forward(xl, self.negative_slope)
            return DistArray(y, x.dist)
        if writes_in_place(xp):  # into blocks of the block cache where one is active
            self._mask = mask = xp.greater(xl, 0, out=empty_like_layout(xl, xl.shape, bool))
            y = empty_like_layout(xl, xl.shape)
            if self.negative_slope == 0:
                xp.maximum(xl, 0, out=y)
            else:
                xp.multiply(xl, self.negative_slope, out=y)
                xp.copyto(y, xl, where=mask)
        else:
            self._mask = mask = xp.greater(xl, 0)
            y = xp.where(mask, xl, xl * self.negative_slope)
        return DistArray(y, x.dist)

    def backward(self, dy: DistArray) -> DistArray:
        g, xp = dy.local, dy.xp
        if self.kernel_backend == "torch":
            return DistArray(kernels_for(g, "torch").relu_backward(g, self._mask,
                                                                   self.negative_slope), dy.dist)
        if not writes_in_place(xp):
            return DistArray(xp.where(self._mask, g, g * self.negative_slope), dy.dist)
        dx = empty_like_layout(g, g.shape)
        if self.negative_slope == 0:
            return DistArray(xp.multiply(g, self._mask, dtype=g.dtype, out=dx), dy.dist)
        xp.multiply(g, self.negative_slope, out=dx)
        xp.copyto(dx, g, where=self._mask)
        return DistArray(dx, dy.dist)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """As :meth:`Layer.cost_spec`, but what backward keeps is a one-byte mask per element;
        with the torch kernels (and a slope of at least 0) the output itself."""
        block = largest_block(dist)
        n = math.prod(block)
        if self.kernel_backend == "torch" and self.negative_slope >= 0:
            return CostSpec(block, flops=float(n), nbytes=2 * n * itemsize, keeps_output=True)
        return CostSpec(block, flops=float(n), nbytes=2 * n * itemsize, saved=n)


class ReLU(LeakyReLU):
    """``max(x, 0)`` element-wise."""

    def __init__(self) -> None:
        super().__init__(0.0)


class Sigmoid(Layer):
    """``1 / (1 + exp(-x))`` element-wise (computed without overflow); backward keeps the
    output."""

    saved_for_backward = ("_y",)
    kernel_backends = ("numpy", "torch")

    def takes_channels_last(self, dist: Distribution) -> bool:
        """With the torch kernels (ATen's element-wise kernels keep the layout)."""
        return self.kernel_backend == "torch"

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray):
            raise TypeError("Sigmoid expects a DistArray")
        if self.kernel_backend == "torch":
            self._y = y = kernels_for(x.local, "torch").sigmoid_forward(x.local)
            return DistArray(y, x.dist)
        xp = x.xp
        z = xp.exp(-xp.abs(x.local))
        y = xp.where(x.local >= 0, 1 / (1 + z), z / (1 + z))
        self._y = y
        return DistArray(y, x.dist)

    def backward(self, dy: DistArray) -> DistArray:
        if self.kernel_backend == "torch":
            return DistArray(kernels_for(dy.local, "torch").sigmoid_backward(dy.local, self._y),
                             dy.dist)
        return DistArray(dy.local * self._y * (1 - self._y), dy.dist)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """A few FLOPs per element; the output is kept for backward (the NumPy kernels' four
        temporaries as workspace, none with the torch kernels)."""
        block = largest_block(dist)
        n = math.prod(block)
        temporaries = 0 if self.kernel_backend == "torch" else 4
        return CostSpec(block, flops=4.0 * n, nbytes=2 * n * itemsize, keeps_output=True,
                        workspace=temporaries * n * itemsize)


def add_blocks(a: DistArray, b: DistArray) -> DistArray:
    """``a + b`` of two arrays of one distribution and dtype, a new block: NumPy blocks
    over PyTorch's threads where the torch kernels are in use (:func:`torch_kernels.in_use
    <disttensor_nn.kernels.torch_kernels.in_use>`; ResNet-50 at 224^2, batch 4, on one
    process: a step 7-12 ms shorter on one thread, 26-27 ms on two), else the array
    module's addition (the same sums)."""
    xa, xb = a.local, b.local
    if torch_kernels.in_use() and isinstance(xa, np.ndarray) and isinstance(xb, np.ndarray) \
            and xa.dtype == xb.dtype and xa.shape == xb.shape:
        return DistArray(torch_kernels.add(xa, xb), a.dist)
    return DistArray(xa + xb, a.dist)


class Add:
    """Residual addition ``a + b``: local when both share a distribution.

    Otherwise ``b`` is redistributed to ``a``'s distribution first, and its
    gradient redistributed back in :meth:`backward`.
    """

    def forward(self, a: DistArray, b: DistArray) -> DistArray:
        if a.shape != b.shape:
            raise ValueError(f"Add needs equal shapes, got {a.shape} and {b.shape}")
        self._b_dist = b.dist
        if b.dist != a.dist:
            b = b.redistribute(a.dist)
        out = add_blocks(a, b)
        self._out = (out.dist, out.dtype)
        return out

    __call__ = forward

    def backward(self, dy: DistArray, *, copy: bool = True) -> tuple[DistArray, DistArray]:
        """Gradients with respect to ``a`` and ``b`` (each in its own distribution).

        ``dy`` is checked as every layer's (:func:`~disttensor_nn.module.check_grad`).
        Both are ``dy`` where ``b`` shares its distribution and ``copy`` is False (the
        caller knows that whoever takes the first does not write it); else ``b``'s is
        a copy of its own.
        """
        dy = check_grad(dy, getattr(self, "_out", None), "Add.backward")
        db = dy if self._b_dist == dy.dist else dy.redistribute(self._b_dist)
        return dy, db.copy() if db is dy and copy else db
