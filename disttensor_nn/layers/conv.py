"""Distributed N-D convolution (Conv1d, Conv2d, Conv3d) over sample and spatial splits."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import namespace_dtype

from ..costspec import Allreduce, CostSpec
from ..kernels import kernels_for
from ..module import Parameter, check_input, check_int, reduce_gradients_, split_axes_comm
from ..window import WindowSpec
from .window_layer import PADDING_MODES, WindowLayer

__all__ = ["ConvNd", "Conv1d", "Conv2d", "Conv3d"]


class ConvNd(WindowLayer):
    """N-D convolution (cross-correlation) of a DistArray split over N and spatial dims.

    Arguments follow ``torch.nn.ConvNd``. Any kernel size (odd or even), stride,
    padding (an int, a ``(before, after)`` pair per dimension, ``'same'`` or
    ``'valid'``), dilation and groups are supported on any split of the
    sample and spatial dimensions; the channel dimension must not be split.

    Parameters
    ----------
    in_channels, out_channels : int
    kernel_size, stride, padding, dilation : int or tuple
    groups : int
    bias : bool
    padding_mode : {'zeros', 'reflect', 'circular', 'replicate'}
        Values beyond the global edges, applied by the halo exchange.
    overlap : bool
        Overlap communication with computation: the forward halo exchange
        with the outputs that need no halo, and the backward halo
        accumulation with the weight-gradient computation.
    dtype : dtype
        Parameter dtype; inputs must match it.
    seed : int
        Seed of the weight initialisation (PyTorch's default uniform bounds);
        identical on every rank.
    """

    nd = 0

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", *, overlap: bool = False,
                 dtype: Any = np.float32, seed: int = 0):
        in_channels = check_int(in_channels, "in_channels")
        out_channels = check_int(out_channels, "out_channels")
        groups = check_int(groups, "groups")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"in_channels ({in_channels}) and out_channels ({out_channels}) must be "
                f"divisible by groups ({groups})"
            )
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {list(PADDING_MODES)}, "
                             f"got {padding_mode!r}")
        self.spec = WindowSpec.make(self.nd, kernel_size, stride, padding, dilation)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.mode = PADDING_MODES[padding_mode]
        self.padding_mode = padding_mode
        self.overlap = overlap
        self.dtype = np.dtype(dtype)
        fan_in = in_channels // groups * int(np.prod(self.spec.kernel))
        bound = 1.0 / np.sqrt(fan_in)
        rng = np.random.default_rng(seed)
        shape = (out_channels, in_channels // groups, *self.spec.kernel)
        self.weight = Parameter(rng.uniform(-bound, bound, shape).astype(self.dtype))
        self.bias = Parameter(rng.uniform(-bound, bound, out_channels).astype(self.dtype)) \
            if bias else None

    def _check(self, x: DistArray) -> None:
        check_input(x, self.nd + 2, type(self).__name__, self.in_channels, self.dtype)

    def _channels_out(self, c_in: int) -> int:
        return self.out_channels

    def _kernel_forward(self, xwin: Any) -> Any:
        b = self.bias.data if self.bias is not None else None
        return kernels_for(xwin).conv_forward(xwin, self.weight.data, b, self.spec.stride,
                                              self.spec.dilation, self.groups)

    def _kernel_backward(self, dy: Any, xwin: Any) -> Any:
        dx, _, _ = kernels_for(xwin).conv_backward(
            dy, xwin, self.weight.data, self.spec.stride, self.spec.dilation, self.groups,
            need_dx=True, need_dw=False)
        return dx

    def _param_backward(self, dy: DistArray, xwin: Any | None) -> None:
        xp = dy.xp
        if xwin is None:
            dw = xp.zeros_like(self.weight.data)
            db = xp.zeros(self.out_channels, dtype=namespace_dtype(xp, self.dtype))
        else:
            _, dw, db = kernels_for(xwin).conv_backward(
                dy.local, xwin, self.weight.data, self.spec.stride, self.spec.dilation,
                self.groups, need_dx=False, need_dw=True)
        # Every rank that splits the input over N or space holds part of the sum.
        reduce_gradients_([(self.weight, dw), (self.bias, db)], split_axes_comm(dy.dist))

    def __repr__(self) -> str:
        s = self.spec
        return (f"{type(self).__name__}({self.in_channels}, {self.out_channels}, "
                f"kernel_size={s.kernel}, stride={s.stride}, padding={s.padding}, "
                f"dilation={s.dilation}, groups={self.groups})")

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """As :meth:`WindowLayer.cost_spec`, with the convolution's FLOPs and workspace.

        The workspace is the larger of forward's (an output block and a tile
        of im2col columns) and backward's (the extended block's gradient and
        two tiles of columns); a tile holds the columns of at least 512 output
        positions, about 4 MiB, at most 64 MiB. The weight and bias gradients
        are summed over every rank that splits the input.
        """
        ext, out_block, _ = self._window_blocks(dist)
        ck = self.in_channels // self.groups * math.prod(self.spec.kernel)
        params = sum(q.data.size for q in self.own_parameters())
        positions = math.prod(out_block) // max(out_block[1], 1)
        tile = min(ck * positions * itemsize, 64 * 2**20, max(4 * 2**20, ck * 512 * itemsize))
        return dataclasses.replace(
            super().cost_spec(dist, itemsize),
            flops=2.0 * math.prod(out_block) * self.in_channels // self.groups *
            math.prod(self.spec.kernel),
            allreduces=(Allreduce(params * itemsize, tuple(range(dist.ndim)), gradient=True),),
            workspace=max(math.prod(out_block) * itemsize + tile,
                          math.prod(ext) * itemsize + 2 * tile),
            forward_workspace=math.prod(out_block) * itemsize + tile)

    def kernel_signature(self) -> str:
        s = self.spec
        return (f"conv{self.nd}:{self.in_channels}>{self.out_channels}:k{s.kernel}s{s.stride}"
                f"d{s.dilation}g{self.groups}b{self.bias is not None}")

    def local_twin(self) -> ConvNd:
        s = self.spec
        return type(self)(self.in_channels, self.out_channels, s.kernel, s.stride, 0,
                          s.dilation, self.groups, self.bias is not None, dtype=self.dtype)


class Conv1d(ConvNd):
    """1-D convolution of (N, C, L) DistArrays; see :class:`ConvNd`."""

    nd = 1


class Conv2d(ConvNd):
    """2-D convolution of (N, C, H, W) DistArrays; see :class:`ConvNd`."""

    nd = 2


class Conv3d(ConvNd):
    """3-D convolution of (N, C, D, H, W) DistArrays; see :class:`ConvNd`."""

    nd = 3
