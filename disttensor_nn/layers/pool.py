"""Distributed max and average pooling (1-D, 2-D, 3-D) and global average pooling."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution, backend
from disttensor.backend import array_namespace

from ..costspec import Allreduce, CostSpec, largest_block
from ..kernels import kernels_for, numpy_kernels, torch_kernels
from ..module import Layer, allreduce_, check_input, derived, split_axes_comm
from ..window import WindowSpec
from .window_layer import WindowLayer

__all__ = ["MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
           "GlobalAvgPool"]


class _Pool(WindowLayer):
    """Pooling over windows; see :class:`MaxPool2d` and :class:`AvgPool2d`."""

    saved_for_backward = ("_saved", "_arg")

    nd = 0
    op = "max"
    kernel_backends = ("numpy", "torch")

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0,
                 dilation: Any = 1, *, overlap: bool = False):
        stride = kernel_size if stride is None else stride
        self.spec = WindowSpec.make(self.nd, kernel_size, stride, padding, dilation)
        if any(2 * p > k for (p, _), k in zip(self.spec.padding, self.spec.kernel)):
            raise ValueError(
                f"padding {self.spec.padding} must be at most half the kernel {self.spec.kernel}"
            )
        self.overlap = overlap

    def _pad_value(self) -> float:
        return -np.inf if self.op == "max" else 0.0

    def kernel_padding(self, x: DistArray) -> tuple[int, ...] | None:
        """As :meth:`WindowLayer.kernel_padding`; never for a dilated average pool (ATen's
        average pools have no dilation, so the NumPy kernel runs it on a halo); the NumPy
        kernels pad max pooling too (its gradient then needs no extended block)."""
        if self.op == "max" and self.kernel_backend != "torch" and \
                kernels_for(x.local, self.kernel_backend) is numpy_kernels:
            return self._padding_without_halo(x.dist)
        return super().kernel_padding(x)

    @derived
    def kernel_padding_for(self, dist: Distribution) -> tuple[int, ...] | None:
        """As :meth:`WindowLayer.kernel_padding_for`; never for a dilated average pool."""
        if self.op == "avg" and any(d != 1 for d in self.spec.dilation):
            return None
        return super().kernel_padding_for(dist)

    def takes_channels_last(self, dist: Distribution) -> bool:
        """As :meth:`WindowLayer.takes_channels_last`; not a dilated average pool (the NumPy
        kernel runs it)."""
        return super().takes_channels_last(dist) and not (
            self.op == "avg" and any(d != 1 for d in self.spec.dilation))

    def _pool_forward(self, xwin: Any) -> tuple[Any, Any | None]:
        s = self.spec
        kernels = kernels_for(xwin, self.kernel_backend)
        if xwin.size == 0:  # an empty sample block: nothing to pool (and no argmax to reshape)
            xp = array_namespace(xwin)
            pads = self._kernel_pads()
            padded = tuple(n + 2 * p for n, p in zip(xwin.shape[2:], pads))
            o = tuple(xwin.shape[:2]) + kernels.out_shape(padded, s.kernel, s.stride,
                                                          s.dilation)
            return xp.zeros(o, dtype=xwin.dtype), backend.empty(xp, o, np.intp)
        return kernels.pool_forward(xwin, s.kernel, s.stride, s.dilation, self.op,
                                    **self._padding_kw())

    def _kernel_forward(self, xwin: Any) -> Any:
        y, self._arg = self._pool_forward(xwin)
        return y

    def _kernel_backward(self, dy: Any, xwin: Any) -> Any:
        # the argmax of the forward's last kernel call, unless that call covered only part
        # of the output (with overlap), when it is recomputed
        arg = getattr(self, "_arg", None)
        if arg is None or tuple(arg.shape) != tuple(dy.shape):
            _, arg = self._pool_forward(xwin)
        self._arg = None
        s = self.spec
        return kernels_for(xwin, self.kernel_backend).pool_backward(
            dy, xwin.shape, s.kernel, s.stride, s.dilation, self.op, arg, **self._padding_kw())

    def __repr__(self) -> str:
        s = self.spec
        return f"{type(self).__name__}(kernel_size={s.kernel}, stride={s.stride}, " \
               f"padding={s.padding})"

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """As :meth:`WindowLayer.cost_spec`; max pooling also keeps the flat input index of
        each output's maximum (eight bytes per output, as ATen keeps its indices). Its
        scratch: with the NumPy kernels the forward's running offsets and mask (three
        bytes per output for windows of up to 256 elements, seventeen above) and the
        temporaries of a chunk of indices; with the torch kernels a one-byte mask and a
        masked gradient per output in backward, and in the forward of a 2-D pool of
        enough channels (:data:`~disttensor_nn.kernels.torch_kernels.MAX_POOL_CHANNELS_LAST_MIN`)
        a channels-last copy of the extended block, with the output and the indices in
        that layout. Where the NumPy kernels pad it themselves (no spatial split), the
        padded copy is the forward's scratch, not kept."""
        spec = super().cost_spec(dist, itemsize)
        if self.op != "max":
            return spec
        ext, out_block, _ = self._window_blocks(dist)
        n = math.prod(out_block)
        saved = spec.saved
        if self.kernel_backend == "torch":
            scratch = n * (1 + itemsize)
            if self.nd == 2 and out_block[1] >= torch_kernels.MAX_POOL_CHANNELS_LAST_MIN:
                scratch = max(scratch, math.prod(ext) * itemsize + n * (itemsize + 8))
        else:
            # the chunk of indices, with np.take's own copies (three chunks)
            scratch = n * (3 if math.prod(self.spec.kernel) <= 256 else 17) + \
                3 * min(8 * n, numpy_kernels.INDEX_CHUNK_BYTES)
            if self._padding_without_halo(dist) is not None:
                saved = 0
        return dataclasses.replace(spec, saved=saved + n * 8,
                                   workspace=spec.workspace + scratch)

    def kernel_signature(self) -> str:
        s = self.spec
        twin = self._twin_signature()
        return f"{type(self).__name__}:k{s.kernel}s{s.stride}d{s.dilation}" + \
            (f":{twin}" if twin else "")

    def local_twin(self) -> _Pool:
        s = self.spec
        return self._as_twin(type(self)(s.kernel, s.stride, self._twin_padding(), s.dilation))


class MaxPool1d(_Pool):
    """Max pooling of (N, C, L); arguments as ``torch.nn.MaxPool1d`` (padding is -inf)."""

    nd, op = 1, "max"


class MaxPool2d(_Pool):
    """Max pooling of (N, C, H, W); arguments as ``torch.nn.MaxPool2d`` (padding is -inf).

    The gradient goes to the first maximum of each window; halo cells'
    gradients are summed back into their owners.
    """

    nd, op = 2, "max"


class MaxPool3d(_Pool):
    """Max pooling of (N, C, D, H, W); arguments as ``torch.nn.MaxPool3d``."""

    nd, op = 3, "max"


class AvgPool1d(_Pool):
    """Average pooling of (N, C, L); zero padding counts (``count_include_pad=True``)."""

    nd, op = 1, "avg"


class AvgPool2d(_Pool):
    """Average pooling of (N, C, H, W); zero padding counts (``count_include_pad=True``)."""

    nd, op = 2, "avg"


class AvgPool3d(_Pool):
    """Average pooling of (N, C, D, H, W); zero padding counts (``count_include_pad=True``)."""

    nd, op = 3, "avg"


class GlobalAvgPool(Layer):
    """Mean over all spatial dimensions: (N, C, *S) -> (N, C).

    Partial sums are reduced along the grid axes that split the spatial
    dimensions; the output keeps the input's sample and channel splits and
    those grid axes hold replicas of it.
    """

    saved_for_backward = ("_in",)

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(in_shape[:2])

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray) or x.ndim < 3:
            raise ValueError("GlobalAvgPool expects an (N, C, *S) DistArray")
        check_input(x, x.ndim, "GlobalAvgPool", split_channels=True)
        spatial = tuple(range(2, x.ndim))
        count = int(np.prod(x.shape[2:]))
        sums = backend.contiguous(x.xp.sum(x.local, axis=spatial,
                                           dtype=backend.namespace_dtype(x.xp, np.float64)))
        allreduce_(sums, split_axes_comm(x.dist, spatial))
        out_dist = x.dist.replace(global_shape=x.shape[:2], axes=x.dist.axes[:2],
                                  splits=x.dist.splits[:2])
        order = backend.dense_order(x.local) if backend.is_channels_last(x.local) else None
        self._in = (x.dist, x.local_shape, count, order)
        return DistArray.from_local(backend.astype(sums / count, x.dtype), out_dist)

    def takes_channels_last(self, dist: Distribution) -> bool:
        """True: the sums read any layout, and the gradient is made in the input's."""
        return True

    def backward(self, dy: DistArray) -> DistArray:
        dist, shape, count, order = self._in
        xp = dy.xp
        grad = xp.broadcast_to((dy.local / count)[(...,) + (None,) * (len(shape) - 2)], shape)
        if order is None:
            return DistArray.from_local(backend.contiguous(grad, writeable=True), dist)
        dx = backend.empty_in_order(xp, tuple(shape), dy.local.dtype, order,
                                    backend.device_of(dy.local))
        dx[...] = grad
        return DistArray(dx, dist)

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """Forward and backward each stream the block once, timed on the twin (priced at
        the memory bandwidth, ResNet-18's head measured 0.5 ms a step against 0.02 ms).

        The (N, C) sums (float64) are reduced over the ranks that split space.
        """
        block = largest_block(dist)
        sums = Allreduce(block[0] * block[1] * 8, tuple(range(2, dist.ndim)))
        return CostSpec(block, flops=float(math.prod(block)),
                        nbytes=math.prod(block) * itemsize, allreduces=(sums,))
