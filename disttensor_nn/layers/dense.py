"""Flatten and the fully connected layer, which work on sample-parallel data."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import contiguous, numpy_dtype

from ..costspec import Allreduce, CostSpec, largest_block
from ..kernels import kernels_for
from ..module import Layer, Parameter, check_int, reduce_gradients_, split_axes_comm
from ..precision import io_dtype, is_half, to_dtype
from .sharding import (
    gather_channels,
    normalize_axes,
    shard_parameters,
    sum_input_grad,
    sum_partial_outputs,
    weight_splits,
)

__all__ = ["Flatten", "Linear"]


def sample_parallel(dist: Distribution) -> Distribution:
    """``dist`` with only the sample dimension split (as before); other grid axes hold replicas."""
    axes = (dist.axes[0],) + (None,) * (dist.ndim - 1)
    splits = [dist.splits[0]]
    return Distribution(dist.global_shape, dist.grid, axes, splits + [None] * (dist.ndim - 1))


class Flatten(Layer):
    """(N, C, *S) -> (N, C * prod(S)), after gathering whole samples on each rank.

    Spatially split inputs are first redistributed so that only N stays split
    (the grid axes that split space then hold replicas).
    """

    saved_for_backward = ("_in_dist", "_mid")

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (in_shape[0], int(np.prod(in_shape[1:])))

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray) or x.ndim < 2:
            raise ValueError("Flatten expects an (N, ...) DistArray")
        self._in_dist = x.dist
        target = sample_parallel(x.dist)
        xs = x if target == x.dist else x.redistribute(target)
        self._mid = target
        n = x.shape[0]
        features = int(np.prod(x.shape[1:]))
        out = Distribution((n, features), x.grid, (x.dist.axes[0], None),
                           [target.splits[0], None])
        return DistArray(xs.xp.reshape(xs.local, (xs.local_shape[0], features)), out)

    def backward(self, dy: DistArray) -> DistArray:
        local = dy.xp.reshape(dy.local, self._mid.local_shape())
        g = DistArray(contiguous(local), self._mid)
        return g if self._mid == self._in_dist else g.redistribute(self._in_dist)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """No kernel work; a spatially split input is gathered into whole samples and back.

        The gathered layout keeps the grid axes that split N and shrinks the
        others to one rank (ranks along them hold copies and receive the same).
        """
        block = largest_block(dist)
        if not any(n > 1 for n in dist.nblocks[1:]):
            return CostSpec(block, timed=False)
        samples = set(dist.dim_axes[0])
        grid = tuple(n if a in samples else 1 for a, n in enumerate(dist.grid_shape))
        return CostSpec(block, timed=False,
                        redistributions=(Distribution(dist.global_shape, grid, dist.axes),))


class Linear(Layer):
    """``y = x W^T + b`` on (N, in_features) DistArrays split over N (replicas allowed).

    The features may be split too, as a convolution's channels (see
    :mod:`disttensor_nn.layers.sharding`): an input split along its
    features makes the layer row-parallel (each rank holds ``W[:, in_slice]``
    and the partial outputs are summed by an allreduce); ``out_axes`` make it
    column-parallel (each rank holds ``W[out_slice]`` and computes those
    outputs; the input gradient's partial sums are summed over them). With
    both over the same axes the input is gathered first. The weight
    gradient is summed over the grid axes that split N, each rank's shard
    only, in the parameters' dtype.

    The products are the array module's ``matmul`` or, with the torch
    kernels (``kernel_backend = "torch"``), ATen's ``addmm`` and ``mm`` over
    PyTorch's intra-op threads.

    Parameters
    ----------
    in_features, out_features : int
    bias : bool
    dtype : dtype
    seed : int
        Initialisation seed (PyTorch's default uniform bounds), same on every rank.
    out_axes : int or tuple of int
        Grid axes that split the output features (none by default).
    """

    saved_for_backward = ("_x",)
    kernel_backends = ("numpy", "torch")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: Any = np.float32, seed: int = 0, out_axes: Any = ()):
        self.in_features = check_int(in_features, "in_features")
        self.out_axes = normalize_axes(out_axes, "out_axes")
        self.out_features = check_int(out_features, "out_features")
        self.dtype = np.dtype(dtype)
        bound = 1.0 / np.sqrt(in_features)
        rng = np.random.default_rng(seed)
        self.weight = Parameter(rng.uniform(-bound, bound, (out_features, in_features))
                                .astype(self.dtype))
        self.bias = Parameter(rng.uniform(-bound, bound, out_features).astype(self.dtype)) \
            if bias else None

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """``(N, out_features)``; ValueError for an input that is not ``(N, in_features)``."""
        if len(in_shape) != 2 or in_shape[1] != self.in_features:
            raise ValueError(f"Linear expects (N, {self.in_features}) inputs, got {in_shape}")
        return (in_shape[0], self.out_features)

    def compute_dtype(self, dtype: Any, backend: str | None = None,
                      device: str = "cpu") -> np.dtype:
        """16-bit blocks are computed in the parameters' dtype (converted); others as they are."""
        return self.dtype if is_half(dtype) else numpy_dtype(dtype)

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray) or x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Linear expects an (N, {self.in_features}) DistArray, "
                             f"got {getattr(x, 'shape', type(x))}")
        if x.dtype != io_dtype(self):
            raise TypeError(f"Linear takes {io_dtype(self)} inputs (its parameters are "
                            f"{self.dtype}), but the input is {x.dtype}")
        a_f, a_c = weight_splits("Linear", x.dist, self.out_axes)
        shard_parameters(self.weight, self.bias, x, a_f, a_c)
        xin, x = x, gather_channels(x, a_c)
        self._x, self._splits = (xin, x), (a_f, a_c)
        # 16-bit activations: the product in the parameters' dtype, the output in 16 bits
        xl, w = to_dtype(x.local, self.dtype), self.weight.data
        b = self.bias.data if self.bias is not None and not a_c else None
        if self.kernel_backend == "torch":  # ATen's addmm, over PyTorch's threads
            y = kernels_for(xl, "torch").linear_forward(xl, w, b)
        else:
            y = xl @ w.T
            if b is not None:
                y = y + b
        y = to_dtype(y, x.dtype)
        out = Distribution((x.shape[0], self.out_features), x.grid,
                           (x.dist.axes[0], a_f or None), [x.dist.splits[0], None])
        out = DistArray(contiguous(y), out)
        sum_partial_outputs(out, a_c, self.bias)
        return out

    def backward(self, dy: DistArray) -> DistArray:
        xin, x = self._x
        xp = x.xp
        g, xl, w = to_dtype(dy.local, self.dtype), to_dtype(x.local, self.dtype), \
            self.weight.data
        if self.kernel_backend == "torch":
            dxl, dw, db = kernels_for(g, "torch").linear_backward(
                g, xl, w, need_db=self.bias is not None)
        else:
            dw, dxl = g.T @ xl, g @ w
            db = xp.sum(g, axis=0) if self.bias is not None else None
        # in the parameters' dtype, summed over the ranks that split N (each rank's shard);
        # fresh products, given to the parameters where they are their first gradients
        reduce_gradients_([(self.weight, dw), (self.bias, db)], split_axes_comm(x.dist, (0,)),
                          owned=True)
        dx = DistArray(contiguous(to_dtype(dxl, dy.dtype)), x.dist)
        return sum_input_grad(dx, xin, self._splits[0])

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """A GEMM on the sample block, which is kept for backward.

        The weight and bias gradients, in the parameters' dtype, are summed
        over the ranks that split N.
        """
        block = largest_block(dist)
        n = math.prod(block)
        params = sum(math.prod(q.shape) for q in self.own_parameters())
        weights = params * self.dtype.itemsize
        return CostSpec(block, flops=2.0 * block[0] * self.in_features * self.out_features,
                        nbytes=n * itemsize,
                        allreduces=(Allreduce(weights, (0,), gradient=True, weights=weights),),
                        keeps_input=True)

    def kernel_signature(self) -> str:
        return f"linear:{self.in_features}>{self.out_features}"

    def local_twin(self) -> Linear:
        return Linear(self.in_features, self.out_features, self.bias is not None,
                      dtype=self.dtype)
