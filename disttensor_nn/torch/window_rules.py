"""The compiler's rules for sliding-window operations over split dimensions: convolutions and
transposed convolutions, pooling and unpooling, adaptive pooling, interpolation and pixel
shuffles. Most run PyTorch's own kernel on this rank's block extended by a halo exchange;
a channel-parallel convolution sums partial outputs over the ranks that split its channels,
a global average pooling is a sum (:mod:`.statistic_rules`), and interpolation by other
than an integer scale, or a pixel shuffle across blocks, moves rows between ranks first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.fx import Node

from disttensor import Distribution
from disttensor_nn.kernels.torch_kernels import one_window, window_reach
from disttensor_nn.reduction import split_axes_comm
from disttensor_nn.window import WindowSpec, geometry, transposed_geometry

from .autoplan import _UNPOOL
from .channels import sum_partials
from .functional import redistribute
from .halo_conv import HALO_CONV_MIN_ELEMENTS, halo_conv_plan
from .interpolation import INTERPOLATION_MODES, source_taps, taps_reach
from .layouts import _extend, _split, _unsplit, _with_shape
from .rules import _arg, _describe, _empty_like_output, _shape_of
from .runtime import Step
from .statistic_rules import _StatisticRules

_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}

_CONV_T = {nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
           nn.ConvTranspose3d: F.conv_transpose3d}

_MAXPOOL = {nn.MaxPool1d: F.max_pool1d, nn.MaxPool2d: F.max_pool2d, nn.MaxPool3d: F.max_pool3d}

_AVGPOOL = {nn.AvgPool1d: F.avg_pool1d, nn.AvgPool2d: F.avg_pool2d, nn.AvgPool3d: F.avg_pool3d}

_ADAPTIVE_F = (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)

_PADDING_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge",
                  "circular": "wrap"}

# the rows of halo each side of a block that interpolation by an integer scale reads
_REACH = {"nearest": 0, "nearest-exact": 0, "linear": 1, "bilinear": 1, "trilinear": 1,
          "bicubic": 2}


class _WindowRules(_StatisticRules):
    """Window operations over split dimensions."""

    def conv(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        """A convolution on this rank's block: its halo exchanged where space is split; where
        the channels are split too (the planner's ``"channel"`` mode), each rank convolves
        its channels with their slice of the weight and the partial outputs are summed over
        the ranks that split the channels, whose output is then whole in its channels and
        the same on each of them (the bias added by the first)."""
        nd = dist.ndim - 2
        channels = _split(dist, 1)
        if channels and m.groups != 1:
            self.fail(node, f"{type(m).__name__} of {m.groups} groups: dimension 1 of its "
                            f"input is split over the grid (grid shape {dist.grid_shape}), "
                            "and only a convolution of one group sums partial outputs over "
                            "split channels")
        spec = WindowSpec.make(nd, m.kernel_size, m.stride, m.padding, m.dilation)
        mode = _PADDING_MODES[m.padding_mode]
        geo = geometry(spec, dist)
        shape = _shape_of(node)
        out = _with_shape(geo.out_dist, shape, {1: None} if channels else None)
        if channels:  # the sums over the channels' ranks: whole, alike on each of them
            out = _unsplit(out, [1])
        self._check_shape(node, out, shape)
        slices = list(geo.input_slices(geo.out_box))
        fn, widths = _CONV[type(m)], list(geo.widths)
        # an empty input block may still have outputs (a padding wider than the kernel's
        # reach): they come from the halo and the padding, so only an empty output is empty
        empty = any(b <= a for a, b in geo.out_box) or 0 in out.local_shape()
        self.set(node, out)
        self.use_params(node, node.target, dist)
        local_out = out.local_shape()
        # where no rank splits a spatial dimension, the halo is only zero padding: the kernel
        # pads itself (as PyTorch's own model does), and no extended copy of the block is
        # made. (With a split dimension the extended block is kept whole: padding the other
        # dimensions in the kernel measured slower there.)
        native = mode == "constant"
        for i in range(nd):
            lo, hi = spec.padding[i]
            n, k = dist.global_shape[2 + i], spec.dilation[i] * (spec.kernel[i] - 1) + 1
            native = native and not _split(dist, 2 + i) and lo == hi and \
                (n + 2 * lo - k) // spec.stride[i] + 1 == local_out[2 + i]
        pads: Any = 0
        if native:
            pads = tuple(lo for lo, _ in spec.padding)
            widths = [(0, 0)] * len(widths)
            slices = [slice(None)] * len(slices)
        slices = tuple(slices)

        view = self.view
        # one split dimension of large blocks: the kernel pads the block itself, its halo's
        # faces correct the edges (disttensor_nn.torch.halo_conv), and no extended copy of
        # the block is made (smaller blocks are copied: cheaper than the edges' convolutions)
        large = math.prod(dist.global_shape) >= HALO_CONV_MIN_ELEMENTS * max(dist.nblocks)
        halo = None if native or mode != "constant" or not large or channels else \
            halo_conv_plan(spec, dist, fn, tuple(m.weight.shape), m.groups)
        if halo is not None:
            return lambda args: halo(args[0][0], view(m.weight), view(m.bias))
        pad_list = list(pads) if isinstance(pads, tuple) else [0] * nd

        extend = _extend(dist, widths, mode)

        def run(xin: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
            if one_window(xin.shape, weight.shape, m.stride, pad_list, m.dilation):
                # one strided output column: unstrided on what its window reads (oneDNN's
                # bfloat16 kernels get the strided one wrong; torch_kernels.one_window)
                xin = xin[..., :window_reach(xin.shape, weight.shape, pad_list, m.dilation)]
                return fn(xin, weight, bias, (*m.stride[:-1], 1), pads, m.dilation,
                          m.groups)[..., :1]
            return fn(xin, weight, bias, m.stride, pads, m.dilation, m.groups)

        if channels:
            c0 = dist.local_start()[1]
            mine = slice(c0, c0 + dist.local_shape()[1])
            first = dist.block_index()[1] == 0
            between = split_axes_comm(dist, [1])
            empty = empty or mine.stop == mine.start
            summed = self.summed_format if (nd, self.summed_format) in (
                (2, torch.channels_last), (3, torch.channels_last_3d)) else \
                torch.contiguous_format

            def partial(args: Any) -> torch.Tensor:
                ext = extend(args[0][0])
                weight, bias = view(m.weight)[:, mine], view(m.bias)
                if bias is not None and not first:  # the first rank adds it, once; the
                    bias = bias * 0  # others' graphs stay alike
                if empty:
                    y = _empty_like_output(ext, local_out, [weight, bias])
                    if bias is not None:
                        y = y + bias.view((1, -1) + (1,) * nd).to(y.dtype)
                else:
                    y = run(ext[slices], weight, bias)
                # every rank's partial in one memory layout, as the sum adds the ranks'
                # memory (a convolution's output follows its input's layout, which a
                # block of one channel, or none, does not show)
                return sum_partials(y.contiguous(memory_format=summed), between)

            return partial

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            weight, bias = view(m.weight), view(m.bias)
            if empty:
                return _empty_like_output(ext, local_out, [weight, bias])
            return run(ext[slices], weight, bias)

        return step

    def conv_transpose(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        nd = dist.ndim - 2
        self.refuse_split(node, dist, [1], f"{type(m).__name__} mixes channels")
        if m.padding_mode != "zeros":
            self.fail(node, "a transposed convolution pads with zeros only")
        spec = WindowSpec.make(nd, m.kernel_size, m.stride, m.padding, m.dilation)
        geo = transposed_geometry(spec, tuple(m.output_padding), dist)
        shape = _shape_of(node)
        out = _with_shape(geo.out_dist, shape)
        self._check_shape(node, out, shape)
        block = dist.block_index()
        # this rank's output block [o0, o1) per spatial dimension, and where the kernel's
        # output on its extended input lies, [start, start + full): the overlap is cropped
        # out of the kernel's output and padded (with zeros) to the block; where nothing
        # overlaps (an extended input whose outputs all fall in the cropped padding, or an
        # empty one) the block is the bias alone
        crops: list[slice] = []
        pads: list[int] = []
        reached = True
        for i in range(nd):
            start = spec.stride[i] * geo.in_origin[i] - spec.padding[i][0]
            o0, o1 = (out.boundaries[2 + i][block[2 + i]],
                      out.boundaries[2 + i][block[2 + i] + 1])
            length = dist.local_shape()[2 + i] + sum(geo.in_widths[2 + i])
            full = spec.stride[i] * (length - 1) + spec.dilation[i] * (spec.kernel[i] - 1) + 1 \
                if length else 0
            lo, hi = max(start, o0), min(start + full, o1)
            reached = reached and hi > lo
            crops.append(slice(lo - start, max(hi, lo) - start))
            pads[:0] = [lo - o0, o1 - max(hi, lo)]  # F.pad's order: the last dimension first
        fn, widths = _CONV_T[type(m)], geo.in_widths
        local_out = out.local_shape()
        empty = 0 in local_out
        crop = (slice(None), slice(None), *crops)
        self.set(node, out)
        self.use_params(node, node.target, dist)

        view = self.view

        extend = _extend(dist, widths)

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            weight, bias = view(m.weight), view(m.bias)
            if empty or not reached:
                y = _empty_like_output(ext, local_out, [weight, bias])
                if empty or bias is None:
                    return y
                return (y + bias.view((1, -1) + (1,) * nd)).to(y.dtype)
            y = fn(ext, weight, None, m.stride, 0, 0, m.groups, m.dilation)
            y = F.pad(y[crop], pads)
            if bias is not None:  # added in float32 and rounded once, as autocast's kernel
                y = (y + bias.view((1, -1) + (1,) * nd)).to(y.dtype)
            return y

        return step

    def pool(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        nd = dist.ndim - 2
        is_max = type(m) in _MAXPOOL
        indices = is_max and m.return_indices
        stride = m.stride if m.stride is not None else m.kernel_size
        dilation = m.dilation if is_max else 1
        spec = WindowSpec.make(nd, m.kernel_size, stride, m.padding, dilation)
        shape = _shape_of(node) if not indices else \
            tuple(node.meta["tensor_meta"][0].shape)  # (y, indices): both of y's shape
        # ceil_mode: more padding after, so the floor of the rule gives PyTorch's length
        pads = list(spec.padding)
        for i in range(nd):
            extra = (shape[2 + i] - spec.out_length(i, dist.global_shape[2 + i])) * spec.stride[i]
            pads[i] = (pads[i][0], pads[i][1] + max(0, extra))
        spec = WindowSpec(spec.kernel, spec.stride, tuple(pads), spec.dilation)
        geo = geometry(spec, dist)
        out = _with_shape(geo.out_dist, shape)
        self._check_shape(node, out, shape)
        slices = geo.input_slices(geo.out_box)
        widths = geo.widths
        local_out = out.local_shape()
        empty = 0 in local_out
        self.set(node, (out, out) if indices else out)
        if indices:
            fn = _MAXPOOL[type(m)]
            fill = -math.inf
            # the global place of the window block's first element, and the input's sizes
            block = dist.block_index()
            origin = [dist.boundaries[d][block[d]] - widths[d][0] + (slices[d].start or 0)
                      for d in range(2, dist.ndim)]
            sizes = dist.global_shape[2:]

            def run(ext: torch.Tensor) -> Any:
                y, idx = fn(ext, spec.kernel, spec.stride, 0, spec.dilation,
                            return_indices=True)
                return y, _move_index(idx, ext.shape[2:], origin, sizes, clamp=True)
        elif is_max:
            fn = _MAXPOOL[type(m)]
            fill = -math.inf

            def run(ext: torch.Tensor) -> torch.Tensor:
                return fn(ext, spec.kernel, spec.stride, 0, spec.dilation)
        else:
            fn = _AVGPOOL[type(m)]
            fill = 0.0
            divisor = _avg_divisor(spec, m, dist.global_shape, geo.out_box,
                                   orig_pad=WindowSpec.make(nd, m.kernel_size, stride,
                                                            m.padding, 1).padding)
            scale = math.prod(spec.kernel)

            def run(ext: torch.Tensor) -> torch.Tensor:
                y = fn(ext, spec.kernel, spec.stride, 0)
                return y * (scale / divisor.to(dtype=y.dtype, device=y.device))

        extend = _extend(dist, widths, "constant", fill)

        def step(args: Any) -> Any:
            ext = extend(args[0][0])
            if empty:
                y = ext.new_zeros(local_out) + 0 * ext.sum()
                return (y, torch.zeros(local_out, dtype=torch.int64, device=y.device)) \
                    if indices else y
            return run(ext[slices])

        return step

    def unpool(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        """Max unpooling (``MaxUnpool1d/2d/3d``, ``F.max_unpool1d/2d/3d``) of values and the
        indices of the max pooling whose output they have the distribution of.

        A split spatial dimension is cut where the pooled one is, times the
        stride less the padding; its windows may not overlap (a stride of at
        least the kernel, as in SegNet's 2 x 2 pooling: which of two values
        meeting in one cell PyTorch keeps is the order of its loop), so each
        rank's windows lie in its own block and it scatters its values there.
        An index outside the windows of this rank's pooled elements raises a
        ValueError on every rank (one all-reduce of a flag): such indices are
        not those of the max pooling.
        """
        nd = dist.ndim - 2
        idx_dist = self.dist_of(_arg(node, 1, "indices", None))
        if not isinstance(idx_dist, Distribution) or idx_dist.global_shape != \
                dist.global_shape:
            self.fail(node, "the indices of an unpooling must be a distributed tensor of its "
                            "values' shape (the max pooling's)")
        # the indices are global (within each plane): moved to the values' blocks, they
        # keep their meaning
        move = None if idx_dist == dist else (idx_dist, dist)
        shape = _shape_of(node)
        split = [i for i in range(nd) if _split(dist, 2 + i)]
        fn = _UNPOOL[type(m)]
        spec = WindowSpec.make(nd, m.kernel_size, m.stride if m.stride is not None
                               else m.kernel_size, m.padding, 1)
        kernel, stride = spec.kernel, spec.stride
        pad = tuple(lo for lo, _ in spec.padding)
        sizes = tuple(shape[2:])
        def indices(args: Any) -> torch.Tensor:
            idx = args[0][1]
            return idx if move is None else redistribute(idx, *move)

        if not split:  # whole planes on every rank: PyTorch's own
            self.set(node, _with_shape(dist, shape))
            return lambda args: fn(args[0][0], indices(args), kernel, stride, pad, sizes)
        for i in split:
            if stride[i] < kernel[i]:
                self.fail(node, f"an unpooling whose windows overlap (kernel {kernel[i]}, "
                                f"stride {stride[i]}) on split dimension {2 + i}")
        cuts = {2 + i: [min(max(c * stride[i] - pad[i], 0), sizes[i])
                        for c in dist.boundaries[2 + i][1:-1]] for i in split}
        out = _with_shape(dist, shape, cuts)
        self._check_shape(node, out, shape)
        self.set(node, out)
        block = out.block_index()
        origin = [out.boundaries[2 + i][block[2 + i]] for i in range(nd)]
        local_out = out.local_shape()
        comm = split_axes_comm(dist, range(dist.ndim))  # every rank raises, or none

        def step(args: Any) -> torch.Tensor:
            y, idx = args[0][0], indices(args)
            n, c = local_out[:2]
            local = _move_index(idx, sizes, [-o for o in origin], local_out[2:],
                                clamp=False)
            if comm.allreduce(bool((local < 0).any()) if local.numel() else False,
                              op=MPI.LOR):
                raise ValueError(f"parallelize: {_describe(node)}: an index lies outside the "
                                 "windows of this rank's pooled elements (not the indices "
                                 "of the max pooling)")
            flat = y.new_zeros((n, c, math.prod(local_out[2:]))).scatter(
                2, local.reshape(n, c, -1), y.reshape(n, c, -1))
            return flat.reshape(local_out)

        return step

    def adaptive(self, node: Node, output_size: Any, dist: Distribution, nd: int) -> Step:
        shape = _shape_of(node)
        ins, outs = dist.global_shape[2:], shape[2:]
        split = [i for i in range(nd) if _split(dist, 2 + i)]
        if not split:
            fn = _ADAPTIVE_F[nd - 1]
            self.set(node, _with_shape(dist, shape, {2 + i: None for i in range(nd)}))
            return lambda args: fn(args[0][0], outs)
        if all(o == 1 for o in outs):  # a global mean: local sums and one all-reduce (as a
            # pool, one window over every rank's block would gather them onto one rank)
            return self.reduce_sum(node, dist, list(range(2, 2 + nd)), True, mean=True)
        if all(n % o == 0 for n, o in zip(ins, outs)):
            k = tuple(n // o for n, o in zip(ins, outs))
            pool = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)[nd - 1](k, k)
            return self.pool(node, pool, dist)
        return self.adaptive_windows(node, dist, shape, split)

    def adaptive_windows(self, node: Node, dist: Distribution, shape: tuple[int, ...],
                         split: list[int]) -> Step:
        """Adaptive average pooling (also interpolation mode ``'area'``) of any sizes over
        split dimensions.

        Output ``j`` of a dimension of ``n`` inputs and ``m`` outputs averages
        inputs ``floor(j n / m)`` to ``ceil((j + 1) n / m)`` (PyTorch's
        windows). A rank computes the outputs whose windows start in its block
        (its output cuts are ``ceil(b m / n)`` for each input cut ``b``), over
        its block and a halo after it as wide as the furthest window's reach;
        the split dimensions one at a time as a product with the local averaging
        matrix, then the others by PyTorch's adaptive pooling (the box mean is
        separable).
        """
        nd = dist.ndim - 2
        block = dist.block_index()
        cuts: dict[int, Any] = {}
        widths = [(0, 0)] * dist.ndim
        mats: list[tuple[int, int, int, int, int]] = []  # (dim, n, m, this rank's outputs)
        for i in split:
            d = 2 + i
            n, m = dist.global_shape[d], shape[d]
            bounds = dist.boundaries[d]
            outb = [0] + [-(-b * m // n) for b in bounds[1:-1]] + [m]
            cuts[d] = outb[1:-1]
            # each block's furthest window end beyond it (none for a block without outputs)
            reach = max([-(-(o1 * n) // m) - b1 for o0, o1, b1 in
                         zip(outb, outb[1:], bounds[1:]) if o1 > o0] + [0])
            widths[d] = (0, max(reach, 0))
            mats.append((d, n, m, outb[block[d]], outb[block[d] + 1]))
        out = _with_shape(dist, shape, {2 + i: cuts.get(2 + i) for i in range(nd)})
        self._check_shape(node, out, shape)
        self.set(node, out)
        local_out = out.local_shape()
        rest = tuple(None if i in split else shape[2 + i] for i in range(nd))
        pool = _ADAPTIVE_F[nd - 1] if any(r is not None and r != dist.global_shape[2 + i]
                                           for i, r in enumerate(rest)) else None
        # this rank's averaging matrices (transposed: extended block rows x its outputs)
        local = dist.local_shape()
        weights: list[tuple[int, np.ndarray]] = []
        for d, n, m, o0, o1 in mats:
            b0 = dist.boundaries[d][block[d]]
            a = np.zeros((local[d] + widths[d][1], o1 - o0))
            for j in range(o0, o1):
                lo, hi = j * n // m, -(-((j + 1) * n) // m)
                a[lo - b0:hi - b0, j - o0] = 1.0 / (hi - lo)
            weights.append((d, a))
        made: dict[Any, list[torch.Tensor]] = {}  # by dtype and device

        extend = _extend(dist, widths)

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            if 0 in local_out:
                return ext.new_zeros(local_out) + 0 * ext.sum()
            key = (ext.dtype, ext.device)
            if key not in made:
                made[key] = [torch.tensor(a, dtype=ext.dtype, device=ext.device)
                             for _, a in weights]
            y = ext
            for (d, _), a in zip(weights, made[key]):
                y = torch.matmul(y.movedim(d, -1), a).movedim(-1, d)
            return pool(y, rest) if pool is not None else y

        return step

    def interpolate(self, node: Node, dist: Distribution, mode: str, align_corners: Any,
                    antialias: bool, scale_factor: Any, recompute_scale_factor: Any,
                    local: Step) -> Step:
        """``F.interpolate`` (or ``nn.Upsample``) of any scale in any mode but ``'area'``
        (adaptive average pooling, :meth:`adaptive`); ``local`` is the call itself.

        Where no rank splits a spatial dimension, each rank makes the call on its block.
        Otherwise each split dimension's output cuts are its input cuts scaled (rounded
        up), so a rank's output rows read its own block and a few rows about it. Where
        those scales are integers (and any scale given is that integer) and corners are
        not aligned, each rank interpolates its block extended by the kernel's reach and
        crops; otherwise, each output row along a split dimension is the weighted sum of
        the input rows PyTorch reads for it
        (:func:`~disttensor_nn.torch.interpolation.source_taps`), from the block and a
        halo as wide as the farthest of those rows on any rank. The dimensions no rank
        splits are interpolated by ``F.interpolate`` itself, with the caller's scales.
        """
        nd = dist.ndim - 2
        shape = _shape_of(node)
        split = [i for i in range(nd) if _split(dist, 2 + i)]
        if not split:  # nothing to exchange: PyTorch's own call on the block
            out = _with_shape(dist, shape)
            self._check_shape(node, out, shape)
            self.set(node, out)
            return local
        if mode == "area":  # PyTorch's 'area' is adaptive average pooling
            return self.adaptive(node, None, dist, nd)
        where = f"on split dimension {2 + split[0]}"
        if mode not in INTERPOLATION_MODES:
            self.fail(node, f"interpolation mode '{mode}' {where}")
        given = scale_factor if isinstance(scale_factor, (tuple, list)) else [scale_factor]
        if any(isinstance(v, Node) for v in given):
            self.fail(node, f"a scale factor computed in forward {where} (give the size, "
                            "or a scale known when the model is traced)")
        ins = dist.global_shape
        scales = _interpolation_scales(scale_factor, recompute_scale_factor, nd)
        corners = bool(align_corners) and not mode.startswith("nearest")
        factors = {i: shape[2 + i] // ins[2 + i] for i in split
                   if ins[2 + i] and shape[2 + i] % ins[2 + i] == 0}
        aligned = not corners and len(factors) == len(split) and all(
            scales is None or scales[i] == factors[i] for i in split)
        if antialias and (mode == "bicubic" or not aligned):
            self.fail(node, f"antialias=True in mode '{mode}' with a scale of "
                            f"{ins[2 + split[0]]} -> {shape[2 + split[0]]} {where} (split only "
                            "for the linear modes and integer scales)")
        out = _with_shape(dist, shape, {2 + i: (
            [-(-c * shape[2 + i] // ins[2 + i]) for c in dist.boundaries[2 + i][1:-1]]
            if i in split else None) for i in range(nd)})
        self._check_shape(node, out, shape)
        self.set(node, out)
        kwargs = {} if mode.startswith("nearest") or mode == "area" else \
            {"align_corners": align_corners, "antialias": antialias}
        local_out = out.local_shape()
        if not aligned:
            return self._taps_step(dist, out, split, mode, corners, scales, kwargs)
        h = _REACH.get(mode, 0)
        widths = [(0, 0), (0, 0)] + [(h, h) if i in split else (0, 0) for i in range(nd)]
        halo = h > 0 and bool(split)
        size = tuple(local_out[2 + i] + (2 * h * factors[i] if i in split and h else 0)
                     for i in range(nd))
        crop = tuple(slice(h * factors[i], h * factors[i] + local_out[2 + i])
                     if i in split and h else slice(None) for i in range(nd))
        if scales is not None:  # PyTorch maps rows by the scales given, where they are
            kwargs.update(recompute_scale_factor=False, scale_factor=tuple(
                float(factors[i]) if i in split else scales[i] for i in range(nd)))
        else:
            kwargs["size"] = size
        extend = _extend(dist, widths if halo else [(0, 0)] * dist.ndim, "edge")

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            if 0 in local_out:
                return ext.new_zeros(local_out) + 0 * ext.sum()
            y = F.interpolate(ext, mode=mode, **kwargs)
            return y[(slice(None), slice(None)) + crop] if halo else y

        return step

    @staticmethod
    def _taps_step(dist: Distribution, out: Distribution, split: list[int], mode: str,
                   corners: bool, scales: tuple[float, ...] | None,
                   kwargs: dict[str, Any]) -> Step:
        """Interpolation along the ``split`` dimensions as weighted sums of input rows
        (:func:`~disttensor_nn.torch.interpolation.source_taps`): the rows each rank's
        output rows read, found for every rank, set the halo's widths (the reads are
        clamped inside the array, as PyTorch clamps them); the other dimensions by
        ``F.interpolate``."""
        nd = dist.ndim - 2
        local_out = out.local_shape()
        widths: list[tuple[int, int]] = [(0, 0)] * dist.ndim
        # per split dimension: its axis, lengths, scale, the extended block's first global
        # row, this rank's output rows, and which spatial dimension it is
        per_dim = []
        for i in split:
            d = 2 + i
            n, m = dist.global_shape[d], out.global_shape[d]
            cut_in, cut_out = dist.boundaries[d], out.boundaries[d]
            scale = None if scales is None else scales[i]
            before = after = 0
            for j in range(len(cut_in) - 1):  # every rank's reads along d, either precision
                for double in (True, False):
                    reach = taps_reach(source_taps(mode, n, m, range(cut_out[j], cut_out[j + 1]),
                                                   corners, scale, double, nd, i))
                    if reach is not None:
                        before = max(before, cut_in[j] - reach[0])
                        after = max(after, reach[1] - cut_in[j + 1] + 1)
            widths[d] = (before, after)
            first, o = dist.local_slices()[d].start, out.local_slices()[d]
            per_dim.append((d, n, m, scale, first - before, range(o.start, o.stop), i))
        shape_now = list(dist.local_shape())
        for d, *_ in per_dim:
            shape_now[d] = local_out[d]
        rest = {}  # the dimensions no rank splits, interpolated as PyTorch would
        moved = [i for i in range(nd) if i not in split and (
            shape_now[2 + i] != local_out[2 + i] or scales is not None and scales[i] != 1.0)]
        if moved and all(shape_now[2 + i] == local_out[2 + i] for i in moved):
            # a call that keeps every size but moves rows (a scale whose output rounds to
            # the input's length): PyTorch's backward of it is not its adjoint (it copies
            # the gradient, as if nothing moved), so these dimensions take weighted rows too
            for i in moved:
                n = dist.global_shape[2 + i]
                per_dim.append((2 + i, n, n, None if scales is None else scales[i], 0,
                                range(n), i))
        elif moved:
            if scales is not None:
                rest = dict(kwargs, recompute_scale_factor=False, scale_factor=tuple(
                    1.0 if i in split else scales[i] for i in range(nd)))
            else:
                rest = dict(kwargs, size=tuple(local_out[2:]))
        extend = _extend(dist, widths, "edge")
        cached: dict[bool, list] = {}

        def taps(is_double: bool) -> list:
            if is_double not in cached:  # the nearest modes' rows depend on the precision
                cached[is_double] = [
                    (d, [(torch.from_numpy(idx - offset),
                          torch.from_numpy(w).view((-1,) + (1,) * (dist.ndim - 1 - d)))
                         for idx, w in source_taps(mode, n, m, rows, corners, scale,
                                                   is_double, nd, axis)])
                    for d, n, m, scale, offset, rows, axis in per_dim]
            return cached[is_double]

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            if 0 in local_out:
                return ext.new_zeros(local_out) + 0 * ext.sum()
            # 16-bit blocks summed in float32 and rounded once, as PyTorch's kernels do
            y = ext.float() if ext.dtype in (torch.bfloat16, torch.float16) else ext
            for d, pairs in taps(ext.dtype == torch.float64):
                if len(pairs) == 1:  # the nearest modes: one row, weight 1
                    y = y.index_select(d, pairs[0][0].to(y.device))
                    continue
                acc = None
                for idx, w in pairs:
                    term = y.index_select(d, idx.to(y.device)) * w.to(y.dtype).to(y.device)
                    acc = term if acc is None else acc + term
                y = acc
            if rest:
                y = F.interpolate(y, mode=mode, **rest)
            return y.to(ext.dtype)

        return step

    def pixel_shuffle(self, node: Node, dist: Distribution, r: int,
                      fn: Callable[..., torch.Tensor]) -> Step:
        """``pixel_shuffle`` (channels into space, r x r) or ``pixel_unshuffle`` (space into
        channels) of each rank's block: local, the last two dimensions' cuts scaled by
        ``r`` (unshuffle: divided; an input whose cuts are not multiples of ``r`` is first
        redistributed to the nearest cuts that are)."""
        unshuffle = fn is F.pixel_unshuffle
        c = dist.ndim - 3
        self.refuse_split(node, dist, [c], "pixel_shuffle moves channels to and from space")
        shape = _shape_of(node)
        src, cuts = dist, {}
        for d in (dist.ndim - 2, dist.ndim - 1):
            if not _split(dist, d):
                continue
            inner = list(dist.boundaries[d][1:-1])
            if unshuffle:
                inner = [min(round(b / r) * r, dist.global_shape[d]) for b in inner]
                cuts[d] = [b // r for b in inner]
                src = _with_shape(src, src.global_shape, {d: inner})
            else:
                cuts[d] = [b * r for b in inner]
        out = _with_shape(src, shape, cuts)
        self._check_shape(node, out, shape)
        move = src != dist
        local_out = out.local_shape()
        self.set(node, out)

        def step(args: Any) -> torch.Tensor:
            x = args[0][0]
            if move:
                x = redistribute(x, dist, src)
            if 0 in local_out:  # torch returns an empty block as it is, of the wrong shape
                return x.new_zeros(local_out) + 0 * x.sum()
            return fn(x, r)

        return step


def _move_index(idx: torch.Tensor, src: Sequence[int], offset: Sequence[int],
                dst: Sequence[int], clamp: bool) -> torch.Tensor:
    """Flat indices into planes of shape ``src`` made flat indices into planes of shape
    ``dst`` whose first element lies at ``-offset`` of ``src``'s: each coordinate moved by
    ``offset``, then held inside ``dst`` (``clamp``) or the index made -1 where one falls
    outside it.

    Max pooling's indices into its window block become indices into the whole input
    (clamped: a maximum in the padding, a window of -inf, moves to the nearest element
    inside, PyTorch's choice there); unpooling's go the other way, into a rank's block."""
    flat = torch.zeros_like(idx)
    rest = idx
    outside = None if clamp else torch.zeros_like(idx, dtype=torch.bool)
    for i in reversed(range(len(src))):
        coord = rest % src[i] + offset[i]
        rest = rest // src[i]
        if clamp:
            coord = coord.clamp(0, dst[i] - 1)
        else:
            outside |= (coord < 0) | (coord >= dst[i])
        flat += coord * math.prod(dst[i + 1:])
    return flat if outside is None else flat.masked_fill(outside, -1)


def _interpolation_scales(scale_factor: Any, recompute: Any, nd: int
                          ) -> tuple[float, ...] | None:
    """The scales ``F.interpolate`` maps rows by, per spatial dimension (None: the
    sizes' ratios, as where a size was given or ``recompute_scale_factor`` set)."""
    if scale_factor is None or recompute:
        return None
    if isinstance(scale_factor, (tuple, list)):
        return tuple(float(v) for v in scale_factor)
    return (float(scale_factor),) * nd


def _avg_divisor(spec: WindowSpec, m: nn.Module, shape: Sequence[int],
                 box: Sequence[tuple[int, int]], orig_pad: Sequence[tuple[int, int]]
                 ) -> torch.Tensor:
    """PyTorch's divisor of each of this rank's average-pool outputs."""
    nd = len(spec.kernel)
    if getattr(m, "divisor_override", None):
        sizes = [max(0, b - a) for a, b in box]
        return torch.full(sizes, float(m.divisor_override), dtype=torch.float64).view(
            (1, 1) + tuple(sizes))
    out = torch.ones((), dtype=torch.float64)
    for i in range(nd):
        n, k, s, p = shape[2 + i], spec.kernel[i], spec.stride[i], orig_pad[i][0]
        j = torch.arange(box[i][0], box[i][1], dtype=torch.float64)
        start = j * s - p
        end = torch.clamp(start + k, max=n + p)
        if m.count_include_pad:
            size = end - start
        else:
            size = torch.clamp(end, max=n) - torch.clamp(start, min=0)
        out = out.unsqueeze(-1) * size
    return out.view((1, 1) + tuple(max(0, b - a) for a, b in box))
