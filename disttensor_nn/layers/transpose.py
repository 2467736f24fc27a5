"""Distributed N-D transposed convolution (ConvTranspose1d/2d/3d) over sample and spatial splits."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution, halo_plan
from disttensor.backend import device_kw, namespace_dtype

from ..costspec import Allreduce, CostSpec, largest_block
from ..kernels import kernels_for
from ..module import Layer, Parameter, check_input, check_int, reduce_gradients_, split_axes_comm
from ..precision import compute_dtype, io_dtype, kernel_dtype, to_dtype
from ..window import WindowSpec, normalize_tuple, transposed_geometry, transposed_layout

__all__ = ["ConvTransposeNd", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]


def _overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[slice, slice] | None:
    """Slices into ranges starting at ``a0`` and ``b0`` of their common part, or None."""
    lo, hi = max(a0, b0), min(a1, b1)
    if hi <= lo:
        return None
    return slice(lo - a0, hi - a0), slice(lo - b0, hi - b0)


class ConvTransposeNd(Layer):
    """N-D transposed convolution of a DistArray split over N and spatial dims.

    Arguments and semantics follow ``torch.nn.ConvTransposeNd``: the weight has
    shape ``(in_channels, out_channels // groups, *kernel_size)`` and the output
    length is ``(n - 1) * stride - 2 * padding + dilation * (kernel_size - 1) +
    output_padding + 1``. The layer is the adjoint of the convolution with the
    same weight, stride, padding and dilation, so it runs on the convolution's
    kernels: forward is the convolution's input gradient, backward its forward.

    Distribution: output ``o`` lives on the rank that owns input
    ``(o + padding - dilation * (kernel_size - 1) // 2) // stride``, so a
    stride-``s`` layer cuts its output at ``s`` times its input's cuts (a
    ``kernel_size=2, stride=2`` layer needs no halo at all). Forward exchanges
    the halo of the input that spreads into this rank's outputs; backward
    exchanges the halo of the output gradient that this rank's inputs spread
    into. Neither pass sums anything back, so no halo adjoint runs.

    Parameters
    ----------
    in_channels, out_channels : int
    kernel_size, stride, padding, output_padding, dilation : int or tuple
        ``output_padding`` must be smaller than ``stride`` or ``dilation``
        (as in PyTorch).
    groups : int
    bias : bool
    dtype : dtype
        Parameter dtype; inputs must match it.
    seed : int
        Seed of the weight initialisation (PyTorch's default uniform bounds,
        fan-in ``out_channels // groups * prod(kernel_size)``).
    """

    saved_for_backward = ("_saved",)
    nd = 0
    kernel_backends = ("numpy", "torch")

    def compute_dtype(self, dtype: Any, backend: str | None = None,
                      device: str = "cpu") -> np.dtype:
        """16-bit blocks in 16 bits where ``backend`` has such kernels, else in float32
        (:func:`disttensor_nn.precision.compute_dtype`)."""
        return compute_dtype(dtype, backend, device)

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, output_padding: Any = 0, groups: int = 1, bias: bool = True,
                 dilation: Any = 1, *, dtype: Any = np.float32, seed: int = 0):
        in_channels = check_int(in_channels, "in_channels")
        out_channels = check_int(out_channels, "out_channels")
        groups = check_int(groups, "groups")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"in_channels ({in_channels}) and out_channels ({out_channels}) "
                             f"must be divisible by groups ({groups})")
        if isinstance(padding, str):
            raise ValueError(f"{type(self).__name__} takes int paddings, got {padding!r}")
        self.spec = WindowSpec.make(self.nd, kernel_size, stride, padding, dilation)
        self.output_padding = normalize_tuple(output_padding, self.nd, "output_padding")
        for op, s, d in zip(self.output_padding, self.spec.stride, self.spec.dilation):
            if op < 0 or op >= max(s, d):
                raise ValueError(f"output_padding must be >= 0 and smaller than stride or "
                                 f"dilation, got {self.output_padding}")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.dtype = np.dtype(dtype)
        fan_in = out_channels // groups * math.prod(self.spec.kernel)
        bound = 1.0 / math.sqrt(fan_in)
        rng = np.random.default_rng(seed)
        shape = (in_channels, out_channels // groups, *self.spec.kernel)
        self.weight = Parameter(rng.uniform(-bound, bound, shape).astype(self.dtype))
        self.bias = Parameter(rng.uniform(-bound, bound, out_channels).astype(self.dtype)) \
            if bias else None

    # ------------------------------------------------------------ shapes
    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Global output shape; ValueError when it would be empty (as PyTorch)."""
        d = Distribution(tuple(in_shape), (1,) * len(in_shape))
        shape = list(transposed_layout(self.spec, self.output_padding, d)[0].global_shape)
        if any(n < 1 for n in shape[2:]):
            raise ValueError(f"{type(self).__name__}: the output size {tuple(shape[2:])} for the "
                             f"input {tuple(in_shape[2:])} is empty")
        shape[1] = self.out_channels
        return tuple(shape)

    def output_distribution(self, in_dist: Distribution) -> Distribution:
        """Distribution of the output for an input distributed as ``in_dist``."""
        d = transposed_layout(self.spec, self.output_padding, in_dist)[0]
        shape = list(d.global_shape)
        shape[1] = self.out_channels
        return d.replace(global_shape=shape, splits=d.splits)

    # ------------------------------------------------------------ passes
    def forward(self, x: DistArray) -> DistArray:
        check_input(x, self.nd + 2, type(self).__name__, self.in_channels, io_dtype(self))
        self.output_shape(x.shape)
        geo = transposed_geometry(self.spec, self.output_padding, x.dist)
        ext = halo_plan(x.dist, geo.in_widths, "constant").exchange(x, 0.0)
        out = DistArray.empty(self.output_distribution(x.dist), x.dtype, xp=x.xp)
        y = out.local
        y[...] = 0
        if y.size and ext.size:
            wshape = ext.shape[:1] + (self.out_channels,) + tuple(
                geo.spread_length(i, n) for i, n in enumerate(ext.shape[2:]))
            # 16-bit blocks: the kernels in kernel_dtype (float32 on converted blocks where
            # the backend has no 16-bit kernel)
            rd = kernel_dtype(self, ext)
            like = x.xp.broadcast_to(x.xp.zeros((), dtype=namespace_dtype(x.xp, rd),
                                                **device_kw(ext)), wshape)
            win, _, _ = kernels_for(ext, self.kernel_backend).conv_backward(
                to_dtype(ext, rd), like, to_dtype(self.weight.data, rd), self.spec.stride,
                self.spec.dilation, self.groups, need_dx=True, need_dw=False)
            dst, src = [slice(None)] * 2, [slice(None)] * 2
            start = out.dist.local_start()
            for i in range(self.nd):
                w0 = geo.spread_start(i, geo.in_origin[i])
                o0 = start[2 + i]
                both = _overlap(o0, o0 + y.shape[2 + i], w0, w0 + wshape[2 + i])
                if both is None:
                    break
                dst.append(both[0])
                src.append(both[1])
            else:
                y[tuple(dst)] = win[tuple(src)]
        if self.bias is not None and y.size:
            y += x.xp.reshape(to_dtype(self.bias.data, y.dtype), (1, -1) + (1,) * self.nd)
        self._saved = (x, geo)
        return out

    def backward(self, dy: DistArray) -> DistArray:
        x, geo = self._saved
        dext = halo_plan(dy.dist, geo.out_widths, "constant").exchange(dy, 0.0)
        xl = x.local
        dx = None
        window = None
        if xl.size and dext.size:
            sl = [slice(None), slice(None)]
            start = x.dist.local_start()
            for i in range(self.nd):
                a = geo.spread_start(i, start[2 + i]) - geo.out_origin[i]
                sl.append(slice(a, a + geo.spread_length(i, xl.shape[2 + i])))
            window = dext[tuple(sl)]
        k = kernels_for(xl, self.kernel_backend)
        rd = kernel_dtype(self, xl)
        w = to_dtype(self.weight.data, rd)
        if window is not None:
            window = to_dtype(window, rd)
        if self.input_grad:
            if window is not None:
                dx = to_dtype(k.conv_forward(window, w, None, self.spec.stride,
                                             self.spec.dilation, self.groups), xl.dtype)
            else:
                dx = x.xp.zeros(xl.shape, dtype=xl.dtype, **device_kw(xl))
        if window is not None:
            _, dw, _ = k.conv_backward(to_dtype(xl, rd), window, w, self.spec.stride,
                                       self.spec.dilation, self.groups, need_dx=False,
                                       need_dw=True, need_db=False)
            dw = to_dtype(dw, self.dtype)
        else:
            dw = x.xp.zeros_like(self.weight.data)
        db = dy.xp.sum(dy.local, axis=(0, *range(2, 2 + self.nd)),
                       dtype=namespace_dtype(dy.xp, self.dtype)) if self.bias is not None else None
        reduce_gradients_([(self.weight, dw), (self.bias, db)], split_axes_comm(x.dist))
        return None if dx is None else DistArray(dx, x.dist)

    # ------------------------------------------------------------ planner protocol
    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """Work of the convolution's input gradient on the halo-extended input block.

        FLOPs: ``2 * in_channels * out_channels / groups * prod(kernel_size)``
        per input position. Forward keeps the input with its halo margins;
        backward exchanges the output gradient's halo and builds its window
        (``workspace``: the larger of forward's output window and backward's).
        """
        out_dist, in_w, out_w = transposed_layout(self.spec, self.output_padding, dist)
        block = largest_block(dist)
        ext = tuple(n + lo + hi for n, (lo, hi) in zip(block, in_w))
        out_block = list(largest_block(out_dist))
        out_block[1] = self.out_channels
        oext = tuple(n + lo + hi for n, (lo, hi) in zip(out_block, out_w))
        win = [ext[0], self.out_channels] + [
            self.spec.stride[i] * (ext[2 + i] - 1) + self.spec.dilation[i] *
            (self.spec.kernel[i] - 1) + 1 for i in range(self.nd)]
        params = sum(q.data.size for q in self.own_parameters())
        flops = 2.0 * math.prod(ext) * self.out_channels // self.groups * \
            math.prod(self.spec.kernel)
        return CostSpec(ext, flops=flops,
                        nbytes=(math.prod(ext) + math.prod(out_block)) * itemsize, halo=in_w,
                        allreduces=(Allreduce(params * self.dtype.itemsize, tuple(range(dist.ndim)),
                                              gradient=True),),
                        saved=(math.prod(ext) - math.prod(block)) * itemsize,
                        workspace=max(math.prod(win), math.prod(oext)) * itemsize,
                        keeps_input=True)

    def kernel_signature(self) -> str:
        s = self.spec
        return (f"convT{self.nd}:{self.in_channels}>{self.out_channels}:k{s.kernel}s{s.stride}"
                f"d{s.dilation}g{self.groups}b{self.bias is not None}")

    def local_twin(self) -> ConvTransposeNd:
        s = self.spec
        return type(self)(self.in_channels, self.out_channels, s.kernel, s.stride, 0, 0,
                          self.groups, self.bias is not None, s.dilation, dtype=self.dtype)

    def __repr__(self) -> str:
        s = self.spec
        return (f"{type(self).__name__}({self.in_channels}, {self.out_channels}, "
                f"kernel_size={s.kernel}, stride={s.stride}, padding={s.padding}, "
                f"output_padding={self.output_padding}, dilation={s.dilation}, "
                f"groups={self.groups})")


class ConvTranspose1d(ConvTransposeNd):
    """1-D transposed convolution of (N, C, L) DistArrays; see :class:`ConvTransposeNd`."""

    nd = 1


class ConvTranspose2d(ConvTransposeNd):
    """2-D transposed convolution of (N, C, H, W) DistArrays; see :class:`ConvTransposeNd`."""

    nd = 2


class ConvTranspose3d(ConvTransposeNd):
    """3-D transposed convolution of (N, C, D, H, W) DistArrays; see :class:`ConvTransposeNd`."""

    nd = 3
