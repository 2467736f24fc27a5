"""The mesh-tangling fully convolutional network and its DepthToSpace output layer.

The model (LBANN's mesh-tangling model, see BACKGROUND.md) predicts a
per-pixel mask from a stack of per-pixel physics fields and mesh-quality
metrics: 18 x 2048 x 2048 inputs, 1 x 2048 x 2048 targets, trained with
MSE on sigmoid outputs, mini-batch 64 with the height split over 16 ranks.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import contiguous, permute_dims

from ..checks import check_input
from ..container import Sequential
from ..costspec import CostSpec, largest_block
from ..layers.conv import Conv2d
from ..layers.elementwise import ReLU, Sigmoid
from ..layers.norm import BatchNorm2d
from ..module import Layer
from ._seeds import SeedStream

__all__ = ["DepthToSpace", "mesh_fcn"]


class DepthToSpace(Layer):
    """Channels to spatial blocks, as ``torch.nn.PixelShuffle`` in N-D.

    (N, C * prod(b), S1, ..., Sk) -> (N, C, S1 * b1, ..., Sk * bk) with

        y[n, c, s1*b1 + i1, ..., sk*bk + ik] = x[n, c*prod(b) + flat(i1..ik), s1, ..., sk]

    where ``flat`` is the row-major index in a ``b1 x ... x bk`` block. Every
    input position becomes its own output block, so the layer is a local
    reshape and transpose of each rank's block with no communication: the
    output is split like the input, with the spatial block boundaries
    multiplied by ``b`` (sample boundaries unchanged). Backward is the
    inverse reshape. The channels may be split where every block boundary
    falls on a multiple of ``prod(b)`` (each rank's channels then make whole
    output channels, and the output's channel boundaries are the input's
    divided by ``prod(b)``); any other channel split is refused.

    Parameters
    ----------
    block : int or sequence of int
        Block edge per spatial dimension (an int: the same for all).
    """

    def __init__(self, block: int | Sequence[int]):
        self.block = int(block) if isinstance(block, numbers.Integral) else \
            tuple(int(b) for b in block)
        sizes = self.block if isinstance(self.block, tuple) else (self.block,)
        if not sizes or any(b < 1 for b in sizes):
            raise ValueError(f"block sizes must be >= 1, got {block}")

    def _blocks(self, nd: int) -> tuple[int, ...]:
        if isinstance(self.block, int):
            return (self.block,) * nd
        if len(self.block) != nd:
            raise ValueError(f"DepthToSpace{self.block} needs {len(self.block)} spatial "
                             f"dimensions, got {nd}")
        return self.block

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """(N, C * prod(b), *S) -> (N, C, *(S * b)); ValueError for channels not divisible."""
        b = self._blocks(len(in_shape) - 2)
        prod = math.prod(b)
        n, cb, *space = in_shape
        if cb % prod:
            raise ValueError(f"DepthToSpace({self.block}) needs channels divisible by {prod}, "
                             f"got {cb}")
        return (n, cb // prod, *(s * k for s, k in zip(space, b)))

    def output_distribution(self, in_dist: Distribution) -> Distribution:
        """Distribution of the output for an input distributed as ``in_dist``.

        Raises
        ------
        ValueError
            For a channel split with a block boundary that is not a multiple
            of ``prod(b)`` (an output channel would straddle two ranks).
        """
        b = self._blocks(in_dist.ndim - 2)
        shape = self.output_shape(in_dist.global_shape)
        prod = math.prod(b)
        chans = in_dist.boundaries[1]
        if any(c % prod for c in chans):
            raise ValueError(f"DepthToSpace({self.block}) on channels split at {list(chans)}: "
                             f"every block boundary must be a multiple of {prod}")
        splits = [[c * f for c in bounds[1:-1]] for bounds, f in zip(in_dist.boundaries,
                                                                      (1, 1, *b))]
        splits[1] = [c // prod for c in chans[1:-1]]
        return in_dist.replace(global_shape=shape, splits=splits)

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray) or x.ndim < 3:
            raise ValueError("DepthToSpace expects an (N, C, *S) DistArray")
        check_input(x, x.ndim, "DepthToSpace", split_channels=True)
        out_dist = self.output_distribution(x.dist)
        nd = x.ndim - 2
        b = self._blocks(nd)
        n, cb, *s = x.local_shape
        c = cb // math.prod(b)
        # (n, c, b1..bk, s1..sk) -> (n, c, s1, b1, ..., sk, bk)
        order = (0, 1, *(a for i in range(nd) for a in (2 + nd + i, 2 + i)))
        xp = x.xp
        y = permute_dims(xp.reshape(x.local, (n, c, *b, *s)), order)
        self._dists = (x.dist, out_dist)
        return DistArray(xp.reshape(contiguous(y, copy=True), out_dist.local_shape()), out_dist)

    def backward(self, dy: DistArray) -> DistArray:
        in_dist, out_dist = self._dists
        if dy.dist != out_dist:
            dy = dy.redistribute(out_dist)
        nd = in_dist.ndim - 2
        b = self._blocks(nd)
        n, cb, *s = in_dist.local_shape()
        c = cb // math.prod(b)
        # (n, c, s1, b1, ..., sk, bk) -> (n, c, b1..bk, s1..sk)
        split = (n, c, *(a for i in range(nd) for a in (s[i], b[i])))
        order = (0, 1, *(3 + 2 * i for i in range(nd)), *(2 + 2 * i for i in range(nd)))
        xp = dy.xp
        dx = permute_dims(xp.reshape(dy.local, split), order)
        return DistArray(xp.reshape(contiguous(dx, copy=True), (n, cb, *s)), in_dist)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """A copy of the block each way; nothing is kept for backward.

        Raises ValueError for a channel split it refuses (as :meth:`output_distribution`).
        """
        self.output_distribution(dist)
        block = largest_block(dist)
        n = math.prod(block)
        return CostSpec(block, flops=float(n), nbytes=2 * n * itemsize)

    def __repr__(self) -> str:
        return f"DepthToSpace({self.block})"


def mesh_fcn(in_channels: int = 18, widths: Sequence[int] = (128, 256, 256, 384, 384, 128),
             convs_per_stage: int = 3, block: int | Sequence[int] | None = None,
             dtype: Any = np.float32, seed: int = 0, *, first_kernel: int = 5,
             bias: bool = True, bn_stats: str = "global", overlap: bool = False) -> Sequential:
    """The mesh-tangling fully convolutional network (LBANN model zoo), at any width.

    One flat :class:`~disttensor_nn.Sequential`; with the defaults
    (``S = len(widths) = 6`` stages of 3 convolutions)::

        stage 1:   Conv2d(18, 128, 5, stride=2, padding=2), ReLU, BatchNorm2d(128)
                   2 x [Conv2d(128, 128, 3, padding=1), ReLU, BatchNorm2d(128)]
        stage i:   Conv2d(w[i-1], w[i], 3, stride=2, padding=1), ReLU, BatchNorm2d(w[i])
        (i=2..6)   2 x [Conv2d(w[i], w[i], 3, padding=1), ReLU, BatchNorm2d(w[i])]
        head:      Conv2d(128, 64*64, 1)        # 4096 channels per position
                   DepthToSpace(64)            # each position -> a 64 x 64 output patch
                   Sigmoid()

    Each stage halves H and W (``ceil(n / 2)``), so a 2048 x 2048 input is
    32 x 32 after stage 6 and the head turns its 4096 channels into a
    1 x 2048 x 2048 mask (the reference's "1x1 conv to 4096 channels reshaped
    to 2048x2048"). Generally the output is ``(N, 1, b1 * ceil(H / 2**S),
    b2 * ceil(W / 2**S))``, i.e. the input size when H and W are multiples
    of ``2**S`` and ``block`` is the default. Train it with
    :class:`~disttensor_nn.MSELoss` against the target mask.

    Every layer keeps the input's distribution (sample, spatial or hybrid
    split; strided convolutions derive their output boundaries); DepthToSpace
    needs no communication.

    Parameters
    ----------
    in_channels : int
        Input channels (18 in the reference).
    widths : sequence of int
        Output channels of each stage (one stage per entry).
    convs_per_stage : int
        (conv, ReLU, BN) triples per stage; the first one has stride 2.
    block : int or (int, int), optional
        Output patch per final position: the head convolution has
        ``prod(block)`` output channels. Default ``2**len(widths)`` per
        dimension (the total downsampling), so the output matches the input.
    dtype : dtype
        Parameter dtype; inputs must match it.
    seed : int
        Model seed; each convolution gets a distinct seed derived from it.
    first_kernel : int
        Kernel of the first convolution (5 in the reference), padding
        ``first_kernel // 2``.
    bias : bool
        Biases in the convolutions (kept, since BN comes after the ReLU).
    bn_stats : {'global', 'group'}
        Batch-norm statistics (see :class:`~disttensor_nn.BatchNorm2d`).
    overlap : bool
        Overlap halo exchanges with interior computation in every convolution.
    """
    if len(widths) < 1 or convs_per_stage < 1:
        raise ValueError("mesh_fcn needs at least one stage and one convolution per stage")
    dtype = np.dtype(dtype)
    if block is None:
        block = 2 ** len(widths)
    blocks = (int(block),) * 2 if isinstance(block, numbers.Integral) else tuple(block)
    if len(blocks) != 2:
        raise ValueError(f"block must be an int or a pair, got {block}")
    seeds = SeedStream(seed)
    layers: list[Layer] = []
    cin = in_channels
    for i, w in enumerate(widths):
        for j in range(convs_per_stage):
            k = first_kernel if (i == 0 and j == 0) else 3
            layers += [Conv2d(cin, w, k, stride=2 if j == 0 else 1, padding=k // 2, bias=bias,
                              overlap=overlap, dtype=dtype, seed=seeds()),
                       ReLU(), BatchNorm2d(w, stats=bn_stats, dtype=dtype)]
            cin = w
    layers += [Conv2d(cin, math.prod(blocks), 1, bias=True, overlap=overlap, dtype=dtype,
                      seed=seeds()),
               DepthToSpace(block), Sigmoid()]
    return Sequential(*layers)
