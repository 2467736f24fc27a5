"""Distributed N-D convolution (Conv1d, Conv2d, Conv3d) over sample, spatial, channel and
filter splits."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import array_namespace

from ..costspec import Allreduce, CostSpec, largest_block
from ..kernels import kernels_for
from ..module import Parameter, check_input, check_int, reduce_gradients_, split_axes_comm
from ..window import WindowSpec
from .sharding import (
    channel_split_axes,
    gather_channels,
    normalize_axes,
    shard_parameters,
    sum_input_grad,
    sum_partial_outputs,
    weight_splits,
)
from .window_layer import PADDING_MODES, WindowLayer

__all__ = ["ConvNd", "Conv1d", "Conv2d", "Conv3d"]


class ConvNd(WindowLayer):
    """N-D convolution (cross-correlation) of a DistArray split over N and spatial dims.

    Arguments follow ``torch.nn.ConvNd``. Any kernel size (odd or even), stride,
    padding (an int, a ``(before, after)`` pair per dimension, ``'same'`` or
    ``'valid'``), dilation and groups are supported on any split of the
    sample and spatial dimensions.

    The channels may be split too (``groups=1``), and the weight is then
    stored sharded (``weight.dist``; see ``docs/channel_filter.md``):

    * **filter-parallel**, ``filter_axes`` given and the input's channels
      whole: each rank holds ``weight[F_slice]`` and computes its output
      channels; backward sums the partial input gradients over the filter
      group (an allreduce);
    * **channel-parallel**, the input split along C over grid axes other
      than ``filter_axes``: each rank holds ``weight[F_slice, C_slice]``
      (``F_slice`` all filters when ``filter_axes`` is empty), computes a
      partial output from its channels and the partial outputs are summed
      by an allreduce over the channel group; with ``filter_axes`` too this
      is channel x filter, whose backward sums the input gradient over the
      filter group;
    * input split along C over exactly ``filter_axes``: the input is
      gathered along C (an allgather) and the layer is filter-parallel; the
      input gradient is summed back by a reduce-scatter (the adjoint of the
      gather).

    Weight and bias gradients are summed only over the ranks that hold the
    same shard (those that split N or space).

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
    filter_axes : int or tuple of int
        Grid axes (of the input's grid) that split the output channels (the
        filters); none by default. They must not split the input's sample or
        spatial dimensions.
    """

    nd = 0

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True,
                 padding_mode: str = "zeros", *, overlap: bool = False,
                 dtype: Any = np.float32, seed: int = 0, filter_axes: Any = ()):
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
        self.filter_axes = filter_axes
        self._splits: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self.dtype = np.dtype(dtype)
        fan_in = in_channels // groups * int(np.prod(self.spec.kernel))
        bound = 1.0 / np.sqrt(fan_in)
        rng = np.random.default_rng(seed)
        shape = (out_channels, in_channels // groups, *self.spec.kernel)
        self.weight = Parameter(rng.uniform(-bound, bound, shape).astype(self.dtype))
        self.bias = Parameter(rng.uniform(-bound, bound, out_channels).astype(self.dtype)) \
            if bias else None

    @property
    def filter_axes(self) -> tuple[int, ...]:
        """Grid axes that split the output channels (the filters)."""
        return self._filter_axes

    @filter_axes.setter
    def filter_axes(self, axes: Any) -> None:
        self._filter_axes = normalize_axes(axes, "filter_axes")

    def weight_splits(self, dist: Distribution) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Grid axes that split the weight's (filters, channels) for an input split as ``dist``.

        Pure (no communication): the planner asks for any candidate. Filters
        are split over :attr:`filter_axes`; channels over the axes that split
        the input's channels, unless those are the filter axes (the input is
        then gathered along C and the layer is filter-parallel); see
        :func:`disttensor_nn.layers.sharding.weight_splits`.

        Raises
        ------
        ValueError
            For filter axes outside the grid or splitting N or space, filter
            and channel axes that overlap in part, or a split channel or
            filter dimension with ``groups > 1``.
        """
        return weight_splits(type(self).__name__, dist, self.filter_axes, self.groups)

    def _check(self, x: DistArray) -> None:
        check_input(x, self.nd + 2, type(self).__name__, self.in_channels, self.dtype,
                    split_channels=True)
        self.weight_splits(x.dist)

    def _channels_out(self, c_in: int) -> int:
        return self.out_channels

    def output_distribution(self, in_dist: Distribution) -> Distribution:
        """As :meth:`WindowLayer.output_distribution`, the filters split over ``filter_axes``."""
        d = super().output_distribution(in_dist)
        return channel_split_axes(d, tuple(a % len(d.grid_shape) for a in self.filter_axes))

    # ------------------------------------------------------------ channel and filter splits
    def _kernel_input(self, x: DistArray) -> DistArray:
        """Shard the parameters for ``x``'s split; gather ``x`` along C if filter-parallel."""
        self._splits = a_f, a_c = self.weight_splits(x.dist)
        shard_parameters(self.weight, self.bias, x, a_f, a_c)
        return gather_channels(x, a_c)

    def _finish_output(self, y: DistArray) -> DistArray:
        """Channel-parallel: sum the partial outputs over the channel group, then add the bias."""
        sum_partial_outputs(y, self._splits[1], self.bias)
        return y

    def _input_grad(self, dx: DistArray, x: DistArray) -> DistArray:
        """Sum the partial input gradients over the filter group (reduce-scatter if gathered)."""
        return sum_input_grad(dx, x, self._splits[0])

    # ------------------------------------------------------------ kernels
    def _kernel_forward(self, xwin: Any) -> Any:
        b = self.bias.data if self.bias is not None and not self._splits[1] else None
        w = self.weight.data
        s = self.spec
        kernels = kernels_for(xwin)
        if w.size == 0:  # an empty filter or channel slice
            out = kernels.out_shape(xwin.shape[2:], s.kernel, s.stride, s.dilation)
            y = array_namespace(xwin).zeros((xwin.shape[0], w.shape[0], *out), dtype=xwin.dtype)
            if b is not None:
                y += b.reshape((-1,) + (1,) * self.nd)
            return y
        return kernels.conv_forward(xwin, w, b, s.stride, s.dilation, self.groups)

    def _kernel_backward(self, dy: Any, xwin: Any) -> Any:
        if self.weight.data.size == 0:
            return array_namespace(xwin).zeros(xwin.shape, dtype=dy.dtype)
        dx, _, _ = kernels_for(xwin).conv_backward(
            dy, xwin, self.weight.data, self.spec.stride, self.spec.dilation, self.groups,
            need_dx=True, need_dw=False)
        return dx

    def _param_backward(self, dy: DistArray, xwin: Any | None) -> None:
        xp = dy.xp
        w = self.weight.data
        sum_axes = (0, *range(2, dy.ndim))
        if xwin is None or w.size == 0:
            dw = xp.zeros_like(w)
            db = xp.sum(dy.local, axis=sum_axes) if self.bias is not None else None
        else:
            _, dw, db = kernels_for(xwin).conv_backward(
                dy.local, xwin, w, self.spec.stride, self.spec.dilation,
                self.groups, need_dx=False, need_dw=True)
        # The ranks that split N or space hold parts of the sums of the same shard.
        reduce_gradients_([(self.weight, dw), (self.bias, db)],
                          split_axes_comm(dy.dist, sum_axes))

    def __repr__(self) -> str:
        s = self.spec
        return (f"{type(self).__name__}({self.in_channels}, {self.out_channels}, "
                f"kernel_size={s.kernel}, stride={s.stride}, padding={s.padding}, "
                f"dilation={s.dilation}, groups={self.groups})")

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """As :meth:`WindowLayer.cost_spec`, with the convolution's FLOPs and workspace.

        The workspace is the larger of forward's (a tile of im2col columns,
        and an output block when the halo exchange overlaps, whose boxes are
        computed apart and copied in) and backward's (the extended block's gradient when
        there is a halo, and a tile of columns; two with a stride, whose input gradient
        is a col2im of its own columns); a tile holds the columns of at least 512 output
        positions, about 4 MiB, at most 64 MiB. The weight and bias gradients
        are summed over every rank that splits the input's samples or space.

        An input split along C is described as the planner applies it: the
        filters split over the same grid axes, the input gathered along C
        (a redistribution forward, its adjoint backward, and the gathered
        block kept for backward), each rank doing ``F_slice / F`` of the
        whole layer's kernel work (``share``) and reducing that share of the
        weight gradients. ``filter_axes`` alone (whole input channels) split
        the filters the same way without the gather.
        """
        a_c = tuple(a for a in dist.dim_axes[1] if dist.grid_shape[a] > 1)  # real splits
        gathered = dist
        if a_c:
            gathered = channel_split_axes(dist, None)
            a_f = a_c
        else:
            try:
                a_f = self.weight_splits(dist)[0]
            except ValueError:  # filter axes meant for another grid: whole filters
                a_f = ()
        pf = math.prod(dist.grid_shape[a] for a in a_f)
        share = -(-self.out_channels // pf) / self.out_channels
        ext, out_block, _ = self._window_blocks(gathered)
        ck = self.in_channels // self.groups * math.prod(self.spec.kernel)
        params = sum(math.prod(q.shape) for q in self.own_parameters())
        positions = math.prod(out_block) // max(out_block[1], 1)
        tile = min(ck * positions * itemsize, 64 * 2**20, max(4 * 2**20, ck * 512 * itemsize))
        if all(k == 1 for k in self.spec.kernel) and all(t == 1 for t in self.spec.stride) \
                and math.prod(out_block[2:]) >= 512:
            tile = 0  # a pointwise convolution is one GEMM per sample: no columns
        _, _, widths = self._window_blocks(gathered)
        # backward: the extended block's gradient (when there is a halo to sum back) and a tile
        grad_ext = math.prod(ext) * itemsize if any(lo or hi for lo, hi in widths) else 0
        out_bytes = math.prod(out_block) * itemsize * share
        base = super().cost_spec(gathered, itemsize)
        kept = math.prod(largest_block(gathered)) * itemsize if a_c else 0
        return dataclasses.replace(
            base,
            flops=2.0 * math.prod(out_block) * self.in_channels // self.groups *
            math.prod(self.spec.kernel),
            allreduces=(Allreduce(params * itemsize * share, tuple(
                d for d in range(dist.ndim) if d != 1 or not a_c), gradient=True),),
            redistributions=(gathered,) if a_c else (),
            saved=base.saved + kept, share=share,
            workspace=max(tile + (out_bytes if self.overlap else 0), grad_ext + tile * (
                2 if any(t != 1 for t in self.spec.stride) else 1)),
            # forward: a tile of columns (and with overlap, the boxes' outputs before they
            # are copied into the block)
            forward_workspace=tile + (out_bytes if self.overlap else 0))

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
