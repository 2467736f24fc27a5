"""Distributed N-D convolution (Conv1d, Conv2d, Conv3d) over sample, spatial, channel and
filter splits."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution
from disttensor.backend import array_namespace, namespace_dtype, numpy_dtype

from ..checks import check_input_layout
from ..costspec import Allreduce, CostSpec, largest_block
from ..kernels import kernels_for, numpy_kernels
from ..module import Parameter, check_int, derived, reduce_gradients_, split_axes_comm
from ..precision import compute_dtype, io_dtype, kernel_dtype, to_dtype
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
    kernel_backends = ("numpy", "torch")
    reads_grad_only = True
    _pending: tuple[Any, Any] | None = None  # weight and bias gradients from the dx call

    def compute_dtype(self, dtype: Any, backend: str | None = None,
                      device: str = "cpu") -> np.dtype:
        """16-bit blocks in 16 bits where ``backend`` has such kernels, else in float32
        (:func:`disttensor_nn.precision.compute_dtype`)."""
        return compute_dtype(dtype, backend, device)

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
        self._whole_groups = False  # grouped, each rank holding whole groups
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

    @derived
    def weight_splits(self, dist: Distribution) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Grid axes that split the weight's (filters, channels) for an input split as ``dist``.

        Pure (no communication): the planner asks for any candidate. Filters
        are split over :attr:`filter_axes`; channels over the axes that split
        the input's channels, unless those are the filter axes (the input is
        then gathered along C and the layer is filter-parallel); see
        :func:`disttensor_nn.layers.sharding.weight_splits`. With ``groups >
        1`` the channels and filters may be split only over the same grid
        axes, each rank holding whole groups of both (its groups' channels
        in, their filters out: purely local); the weight is then split by
        filters alone.

        Raises
        ------
        ValueError
            For filter axes outside the grid or splitting N or space, filter
            and channel axes that overlap in part, or, with ``groups > 1``, a
            channel or filter split that does not give each rank whole groups.
        """
        name = type(self).__name__
        a_f, a_c = weight_splits(name, dist, self.filter_axes)
        if self.groups > 1 and self._grouped_local(dist, a_f):
            return a_f, ()
        return a_f, a_c

    def _grouped_local(self, dist: Distribution, a_f: tuple[int, ...]) -> bool:
        """Whether a grouped layer's split gives each rank whole groups (ValueError if it
        splits the channels or filters otherwise); False when nothing is split."""
        def real(axes: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(a for a in axes if dist.grid_shape[a] > 1)

        rc, rf = real(dist.dim_axes[1]), real(a_f)
        if not rc and not rf:
            return False
        cg, fg = self.in_channels // self.groups, self.out_channels // self.groups
        cb = dist.boundaries[1]
        fb = Distribution((self.out_channels,), dist.grid_shape, (rc,)).boundaries[0]
        if rc != rf or any(c % cg or f % fg or c // cg != f // fg for c, f in zip(cb, fb)):
            raise ValueError(
                f"{type(self).__name__}: groups={self.groups} with a split channel or filter "
                "dimension needs the channels and the filters split over the same grid axes, "
                f"each rank holding whole groups ({cg} channels, {fg} filters each); got "
                f"channels split over {rc} at {list(cb)} and filters over {rf}")
        return True

    def _local_groups(self, channels: int) -> int:
        """Groups in a block of ``channels`` input channels (whole groups of this layer)."""
        return self.groups if self.groups == 1 or channels == self.in_channels else \
            channels // (self.in_channels // self.groups)

    @derived
    def takes_channels_last(self, dist: Distribution) -> bool:
        """As :meth:`WindowLayer.takes_channels_last`, with neither the channels nor the
        filters split (over grid axes of more than one rank)."""
        return super().takes_channels_last(dist) and not any(
            dist.grid_shape[a] > 1 for axes in self.weight_splits(dist) for a in axes)

    @derived
    def _check_layout(self, dist: Distribution, dtype: np.dtype) -> bool:
        """As :meth:`WindowLayer._check_layout`, with the channels, the dtype and the
        weight's splits checked."""
        check_input_layout(dist, dtype, self.nd + 2, type(self).__name__, self.in_channels,
                           io_dtype(self), split_channels=True)
        self._check_window(dist.global_shape)
        self.weight_splits(dist)
        return True

    def _channels_out(self, c_in: int) -> int:
        return self.out_channels

    @derived
    def output_distribution(self, in_dist: Distribution) -> Distribution:
        """As :meth:`WindowLayer.output_distribution`, the filters split over ``filter_axes``."""
        d = super().output_distribution(in_dist)
        return channel_split_axes(d, tuple(a % len(d.grid_shape) for a in self.filter_axes))

    # ------------------------------------------------------------ channel and filter splits
    @derived
    def _input_route(self, dist: Distribution) -> tuple[tuple[Any, Any], bool, bool, bool]:
        """For an input distributed as ``dist``: the weight's splits (:meth:`weight_splits`),
        whether each rank holds whole groups, whether the parameters are replicated (every
        axis of their splits of one rank) and whether the input is gathered along C."""
        a_f, a_c = self.weight_splits(dist)
        replicated = math.prod(dist.grid_shape[a] for a in (*a_f, *a_c)) == 1
        # grouped, each rank's whole groups: its channels are all its kernels need
        whole_groups = self.groups > 1 and bool(dist.dim_axes[1])
        gather = not whole_groups and bool(dist.dim_axes[1]) and not a_c
        return (a_f, a_c), whole_groups, replicated, gather

    def _kernel_input(self, x: DistArray) -> DistArray:
        """Shard the parameters for ``x``'s split; gather ``x`` along C if filter-parallel."""
        self._splits, self._whole_groups, replicated, gather = self._input_route(x.dist)
        w, b = self.weight, self.bias
        if not replicated or w.dist is not None or b is not None and b.dist is not None:
            shard_parameters(w, b, x, *self._splits)
        return gather_channels(x, self._splits[1]) if gather else x

    def _finish_output(self, y: DistArray) -> DistArray:
        """Channel-parallel: sum the partial outputs over the channel group, then add the bias."""
        sum_partial_outputs(y, self._splits[1], self.bias)
        return y

    def _input_grad(self, dx: DistArray, x: DistArray) -> DistArray:
        """Sum the partial input gradients over the filter group (reduce-scatter if gathered);
        nothing to sum when each rank holds whole groups."""
        return dx if self._whole_groups else sum_input_grad(dx, x, self._splits[0])

    # ------------------------------------------------------------ kernels
    @derived
    def _kernels_for(self, dtype: Any, xp: Any) -> tuple[np.dtype, Any]:
        """The dtype the kernels compute ``dtype`` blocks of module ``xp`` in
        (:func:`~disttensor_nn.precision.kernel_dtype`), and the kernel module."""
        like = xp.empty((0,), dtype=dtype)
        return kernel_dtype(self, like), kernels_for(like, self.kernel_backend)

    def _kernel_forward(self, xwin: Any) -> Any:
        # 16-bit blocks: the kernels run in kernel_dtype (16 bits where the backend has the
        # kernel, else float32 on converted blocks) with the weights cast to it
        rd, kernels = self._kernels_for(xwin.dtype, array_namespace(xwin))
        b = self.bias.data if self.bias is not None and not self._splits[1] else None
        w = self.weight.data
        if w.dtype is not rd:  # (an identical dtype skips to_dtype, which compares others)
            w, b = to_dtype(w, rd), to_dtype(b, rd)
        elif b is not None and b.dtype is not rd:
            b = to_dtype(b, rd)
        s = self.spec
        if w.size == 0:  # an empty filter or channel slice
            pads = self._kernel_pads()
            out = kernels.out_shape(tuple(n + 2 * p for n, p in zip(xwin.shape[2:], pads)),
                                    s.kernel, s.stride, s.dilation)
            y = array_namespace(xwin).zeros((xwin.shape[0], w.shape[0], *out), dtype=xwin.dtype)
            if b is not None:
                y += to_dtype(b, xwin.dtype).reshape((-1,) + (1,) * self.nd)
            return y
        groups = self.groups if self.groups == 1 else self._local_groups(xwin.shape[1])
        kw = {} if self._pads is None else {"padding": self._pads}
        y = kernels.conv_forward(xwin if xwin.dtype is rd else to_dtype(xwin, rd), w, b,
                                 s.stride, s.dilation, groups, **kw)
        return y if y.dtype is xwin.dtype else to_dtype(y, xwin.dtype)

    def _kernel_backward(self, dy: Any, xwin: Any) -> Any:
        w = self.weight.data
        if w.size == 0:
            return array_namespace(xwin).zeros(xwin.shape, dtype=dy.dtype)
        # the torch kernels give the weight gradient in the same call at little extra cost
        # (one convolution_backward, as torch's autograd makes); _param_backward takes it
        both = self.kernel_backend == "torch"
        rd, kernels = self._kernels_for(xwin.dtype, array_namespace(xwin))
        s = self.spec
        kw = {} if self._pads is None else {"padding": self._pads}
        dx, dw, db = kernels.conv_backward(
            dy if dy.dtype is rd else to_dtype(dy, rd),
            xwin if xwin.dtype is rd else to_dtype(xwin, rd),
            w if w.dtype is rd else to_dtype(w, rd), s.stride, s.dilation,
            self.groups if self.groups == 1 else self._local_groups(xwin.shape[1]),
            need_dx=True, need_dw=both, need_db=both and self.bias is not None, **kw)
        self._pending = (dw, db) if both else None
        return dx if dx.dtype is dy.dtype else to_dtype(dx, dy.dtype)

    @derived
    def _grad_comm(self, dist: Distribution) -> Any:
        """The ranks over which the parameters' gradients of an output gradient distributed
        as ``dist`` are summed: those that split its samples or space."""
        return split_axes_comm(dist, (0, *range(2, dist.ndim)))

    def _param_backward(self, dy: DistArray, xwin: Any | None) -> None:
        w = self.weight.data
        pending, self._pending = self._pending, None
        owned = False
        if xwin is None or w.size == 0:
            xp = dy.xp
            dw = xp.zeros_like(w)
            db = xp.sum(dy.local, axis=(0, *range(2, dy.ndim)),
                        dtype=namespace_dtype(xp, self.dtype)) if self.bias is not None else None
        else:
            if pending is not None:  # computed with the input gradient
                dw, db = pending
            else:
                rd, kernels = self._kernels_for(xwin.dtype, array_namespace(xwin))
                _, dw, db = kernels.conv_backward(
                    to_dtype(dy.local, rd), to_dtype(xwin, rd), to_dtype(w, rd),
                    self.spec.stride, self.spec.dilation, self._local_groups(xwin.shape[1]),
                    need_dx=False, need_dw=True, need_db=self.bias is not None,
                    **self._padding_kw())
            # the torch kernel's own new arrays: given to the parameters where no cast
            # copies them (nothing else holds them)
            owned = self.kernel_backend == "torch" and (
                dw.dtype is self.dtype or numpy_dtype(dw.dtype) == self.dtype)
        # The ranks that split N or space hold parts of the sums of the same shard; the
        # parameters' gradients in their own dtype (float32 under 16-bit activations).
        if dw.dtype is not self.dtype:
            dw = to_dtype(dw, self.dtype)
        if db is not None and db.dtype is not self.dtype:
            db = to_dtype(db, self.dtype)
        reduce_gradients_([(self.weight, dw), (self.bias, db)], self._grad_comm(dy.dist),
                          owned=owned)

    def __repr__(self) -> str:
        s = self.spec
        return (f"{type(self).__name__}({self.in_channels}, {self.out_channels}, "
                f"kernel_size={s.kernel}, stride={s.stride}, padding={s.padding}, "
                f"dilation={s.dilation}, groups={self.groups})")

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """As :meth:`WindowLayer.cost_spec`, with the convolution's FLOPs and workspace.

        The workspace is the larger of forward's (a tile of im2col columns,
        and an output block when the halo exchange overlaps, whose boxes are
        computed apart and copied in) and backward's (the extended block's
        gradient when there is a halo, and a tile of columns; two with a
        stride, whose input gradient is a col2im of its own columns); a tile
        holds the columns of at least 512 output positions, about 4 MiB, at
        most 64 MiB; a pointwise convolution needs none. On the torch kernels
        the workspace is oneDNN's copies of the blocks in its own layout
        (forward the larger of the extended input and the output, and the
        weights; backward two such blocks, the weights and the extended
        block's gradient), which PyTorch allocates outside the block cache.

        Channel and filter splits are described as the layer runs them for
        this input and its :attr:`filter_axes` (:meth:`weight_splits`): each
        rank runs a convolution of its slice of the channels into its slice
        of the filters (``twin``: the kernels are timed as that narrower
        convolution on the rank's block) and reduces ``F_slice / F * C_slice
        / C`` of the weight gradients over the ranks that split samples or
        space. Filter-parallel on a channel-split
        input gathers it along C (a redistribution forward, its adjoint, a
        reduce-scatter, backward; the gathered block kept for backward);
        channel-parallel sums the partial outputs (an allreduce forward over
        the channel axes); filter-parallel on whole channels, or channel x
        filter, sums the partial input gradients over the filter axes (an
        allreduce backward); a grouped convolution whose ranks hold whole
        groups sends nothing. A ``filter_axes`` that does not fit ``dist``
        (meant for another grid) counts as none.
        """
        a_c = tuple(a for a in dist.dim_axes[1] if dist.grid_shape[a] > 1)  # real splits
        try:
            a_f, a_w = self.weight_splits(dist)
        except ValueError:  # filter axes meant for another grid: whole filters
            a_f, a_w = (), dist.dim_axes[1]
        a_f = tuple(a for a in a_f if dist.grid_shape[a] > 1)
        a_w = tuple(a for a in a_w if dist.grid_shape[a] > 1)
        local = self.groups > 1 and bool(a_c)  # each rank's whole groups
        gathered_mode = bool(a_c) and not a_w and not local  # the input gathered along C
        whole = channel_split_axes(dist, None)  # the input with every channel
        kin = dist if a_w or local else whole  # the block the kernels run on
        pf = math.prod(dist.grid_shape[a] for a in a_f)
        f_loc = -(-self.out_channels // pf)  # the largest filter slice
        ext, out_block, _ = self._window_blocks(kin)
        c_loc = ext[1]  # the largest channel slice (every channel unless channel-parallel)
        out_block = (out_block[0], f_loc, *out_block[2:])
        g_loc = max(self._local_groups(c_loc), 1)
        ck = c_loc // g_loc * math.prod(self.spec.kernel)
        params = sum(math.prod(q.shape) for q in self.own_parameters())
        share = f_loc / self.out_channels * c_loc / self.in_channels  # of the weights
        positions = math.prod(out_block) // max(out_block[1], 1)
        tile = min(ck * positions * itemsize, 64 * 2**20, max(4 * 2**20, ck * 512 * itemsize))
        if all(k == 1 for k in self.spec.kernel) and all(t == 1 for t in self.spec.stride) \
                and math.prod(out_block[2:]) >= 512:
            tile = 0  # a pointwise convolution is one GEMM per sample: no columns
        if self.kernel_backend in (None, "numpy"):  # each of the pool's threads its own tile
            tile *= min(numpy_kernels.get_num_threads(), max(out_block[0], 1))
        _, _, widths = self._window_blocks(kin)
        # backward: the extended block's gradient (when there is a halo to sum back) and a tile
        grad_ext = math.prod(ext) * itemsize if any(lo or hi for lo, hi in widths) else 0
        out_bytes = math.prod(out_block) * itemsize
        base = super().cost_spec(kin, itemsize)
        kept = math.prod(largest_block(whole)) * itemsize if gathered_mode else 0
        # the parameters' gradients in their own dtype (float32 under 16-bit activations)
        sums = [Allreduce(params * self.dtype.itemsize * share, tuple(
            d for d in range(dist.ndim) if d != 1 or not a_c), gradient=True)]
        if a_w:  # channel-parallel: the partial outputs summed forward
            sums.append(Allreduce(out_bytes, (1,)))
        if a_f and not gathered_mode and not local and self.input_grad:  # dx's partial sums
            sums.append(Allreduce(math.prod(largest_block(dist)) * itemsize, (), axes=a_f))
        twin = base.twin
        if (c_loc, f_loc) != (self.in_channels, self.out_channels):
            s = self.spec
            twin = _sliced_twin(type(self), c_loc, f_loc, s.kernel, s.stride, s.dilation,
                                g_loc, self.bias is not None, self.dtype.str, self.input_grad,
                                self.activation_dtype, *self.twin_settings(kin))
        # 16-bit blocks on kernels without a 16-bit version: their float32 copies (forward
        # the input and output; backward the output gradient, the input and its gradient)
        act = io_dtype(self)
        run = compute_dtype(act, self.kernel_backend)
        cvt = run.itemsize if run != act else 0
        cvt_fwd = cvt * (math.prod(ext) + math.prod(out_block))
        cvt_bwd = cvt * (2 * math.prod(ext) + math.prod(out_block))
        if self.kernel_backend == "torch":
            # oneDNN's copies in its own blocked layout, outside the block cache (measured
            # with PyTorch 2.13's CPU convolutions: forward reorders the larger of the input
            # and the output, and the weights; backward two such blocks and the weights)
            reorder = max(math.prod(ext), math.prod(out_block)) * itemsize
            w_bytes = params * share * run.itemsize
            forward = reorder + w_bytes + (out_bytes if self.overlap else 0) + cvt_fwd
            # (no extended block's gradient where the kernels pad: no halo to sum back)
            own = self.kernel_padding_for(kin) is not None
            backward = (0 if own else grad_ext) + cvt_bwd + 2 * reorder + w_bytes
        else:
            # forward: a tile of columns (and with overlap, the boxes' outputs before they
            # are copied into the block); backward a tile, two with a stride
            forward = tile + (out_bytes if self.overlap else 0) + cvt_fwd
            backward = grad_ext + cvt_bwd + tile * (
                2 if any(t != 1 for t in self.spec.stride) else 1)
        return dataclasses.replace(
            base,
            flops=2.0 * math.prod(out_block) * ck,
            nbytes=(math.prod(ext) + math.prod(out_block)) * itemsize,
            allreduces=tuple(sums),
            redistributions=(whole,) if gathered_mode else (),
            saved=base.saved + kept, twin=twin,
            workspace=max(forward, backward),
            forward_workspace=forward)

    def kernel_signature(self) -> str:
        s = self.spec
        twin = self._twin_signature()
        return (f"conv{self.nd}:{self.in_channels}>{self.out_channels}:k{s.kernel}s{s.stride}"
                f"d{s.dilation}g{self.groups}b{self.bias is not None}" +
                (f":{twin}" if twin else ""))

    def local_twin(self) -> ConvNd:
        s = self.spec
        return self._as_twin(type(self)(
            self.in_channels, self.out_channels, s.kernel, s.stride, self._twin_padding(),
            s.dilation, self.groups, self.bias is not None, dtype=self.dtype))

    def _new_twin(self, pads: tuple[int, ...] | None, channels_last: bool) -> ConvNd:
        """As :meth:`WindowLayer._new_twin`, one per settings for the process (building
        one draws its weights, and the planner asks for each candidate layout)."""
        s = self.spec
        return _sliced_twin(type(self), self.in_channels, self.out_channels, s.kernel,
                            s.stride, s.dilation, self.groups, self.bias is not None,
                            self.dtype.str, self.input_grad, self.activation_dtype, pads,
                            channels_last)


@functools.lru_cache(maxsize=256)
def _sliced_twin(cls: type, c: int, f: int, kernel: tuple, stride: tuple, dilation: tuple,
                 groups: int, bias: bool, dtype: str, input_grad: bool,
                 activation_dtype: Any = None, pads: tuple[int, ...] | None = None,
                 channels_last: bool = True) -> ConvNd:
    """The convolution one rank runs on a slice of ``c`` channels into ``f`` filters (the
    timing settings ``pads`` and ``channels_last``: :meth:`WindowLayer.twin_settings`)."""
    twin = cls(c, f, kernel, stride, 0 if pads is None else pads, dilation, groups, bias,
               dtype=np.dtype(dtype))
    twin.input_grad = input_grad
    twin.activation_dtype = activation_dtype
    twin.twin_pads, twin.twin_channels_last = pads is not None, channels_last
    return twin


class Conv1d(ConvNd):
    """1-D convolution of (N, C, L) DistArrays; see :class:`ConvNd`."""

    nd = 1


class Conv2d(ConvNd):
    """2-D convolution of (N, C, H, W) DistArrays; see :class:`ConvNd`."""

    nd = 2


class Conv3d(ConvNd):
    """3-D convolution of (N, C, D, H, W) DistArrays; see :class:`ConvNd`."""

    nd = 3
