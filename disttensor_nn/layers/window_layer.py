"""Shared machinery of convolution and pooling: halo in, local kernel, halo adjoint out."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution, halo_plan
from disttensor.backend import device_of, is_c_contiguous, is_channels_last, zeros

from ..checks import check_input, check_input_layout
from ..costspec import CostSpec, largest_block
from ..module import Layer, derived
from ..window import WindowGeometry, WindowSpec, geometry, output_layout

__all__ = ["WindowLayer", "PADDING_MODES"]

# PyTorch's padding_mode names -> numpy.pad / halo exchange modes
PADDING_MODES = {"zeros": "constant", "reflect": "reflect", "circular": "wrap",
                 "replicate": "edge"}


class WindowLayer(Layer):
    """A layer that applies a local kernel to every window of a spatially split input.

    Forward: exchange the halo (its widths derived from the output side),
    then run the local kernel on this rank's output box; with ``overlap`` the
    exchange runs while the kernel computes the outputs that need no halo,
    and the boundary slabs follow. Backward: the local backward kernel gives
    the gradient over the extended block, and the halo adjoint sums its halo
    cells back into their owners (both skipped when ``input_grad`` is False:
    backward then returns None).

    Subclasses define ``_kernel_forward(xwin) -> y`` and
    ``_kernel_backward(dy, xwin) -> dxwin`` on local arrays, ``_channels_out``
    and ``_pad_value``; where :meth:`kernel_padding` says the kernels pad
    (the torch kernels on whole spatial dimensions), they pass
    ``_kernel_pads()`` to them and receive the unextended block.
    """

    saved_for_backward = ("_saved",)

    nd: int
    spec: WindowSpec
    mode: str = "constant"
    overlap: bool = False
    _pads: tuple[int, ...] | None = None  # this pass's kernel padding (kernel_padding)
    twin_pads: bool = False
    """Set on the twins the kernel timer runs for a layer whose kernels pad (no spatial
    split, :meth:`kernel_padding_for`): the twin keeps the layer's padding and runs on the
    unpadded block, making the kernel calls the layer makes (its own :meth:`local_twin`
    keeps it; see :meth:`timing_twin`)."""
    twin_channels_last: bool = True
    """False on the twins the kernel timer runs for a layer that takes no channels-last
    blocks where its twin would (a halo extends its blocks, or its weights are split): the
    twin takes none either, so that the calling protocol's copies are timed with it."""

    def _kernel_pads(self) -> tuple[int, ...]:
        """The padding of this pass for the kernel calls (zeros when a halo padded)."""
        return self._pads if self._pads is not None else (0,) * self.nd

    def _padding_kw(self) -> dict[str, Any]:
        """``padding=`` for the kernels where they pad (the NumPy kernels never do)."""
        return {} if self._pads is None else {"padding": self._pads}

    def _pad_value(self) -> float:
        return 0.0

    def _channels_out(self, c_in: int) -> int:
        return c_in

    def _check(self, x: DistArray) -> None:
        """Validate the input (its distribution and dtype once: :meth:`_check_layout`)."""
        if not isinstance(x, DistArray):
            check_input(x, self.nd + 2, type(self).__name__)  # raises its TypeError
        self._check_layout(x.dist, x.dtype)

    @derived
    def _check_layout(self, dist: Distribution, dtype: np.dtype) -> bool:
        """The checks of an input distributed as ``dist`` with elements of ``dtype``
        (raising as :func:`check_input` does); kept once passed."""
        check_input_layout(dist, dtype, self.nd + 2, type(self).__name__, split_channels=True)
        self._check_window(dist.global_shape)
        return True

    def _check_window(self, in_shape: tuple[int, ...]) -> None:
        """Refuse an input whose padded size is below the (dilated) kernel, as PyTorch does."""
        s = self.spec
        padded = tuple(n + lo + hi for n, (lo, hi) in zip(in_shape[2:], s.padding))
        spans = tuple(d * (k - 1) + 1 for k, d in zip(s.kernel, s.dilation))
        if any(p < k for p, k in zip(padded, spans)):
            raise ValueError(f"{type(self).__name__}: the padded input size {padded} (input "
                             f"{tuple(in_shape[2:])}, padding {s.padding}) is smaller than "
                             f"the kernel {spans}; the output would be empty")

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Global output shape; raises ValueError when the kernel exceeds the padded input."""
        self._check_window(tuple(in_shape))
        shape = list(self.spec.out_shape(in_shape))
        shape[1] = self._channels_out(shape[1])
        return tuple(shape)

    @derived
    def output_distribution(self, in_dist):
        """Distribution of the output for an input distributed as ``in_dist``."""
        geo = geometry(self.spec, in_dist)
        shape = list(geo.out_dist.global_shape)
        shape[1] = self._channels_out(shape[1])
        d = geo.out_dist
        return d.replace(global_shape=shape, splits=d.splits)

    # ------------------------------------------------------------ forward
    def kernel_padding(self, x: DistArray) -> tuple[int, ...] | None:
        """The padding the kernels apply themselves for input ``x``, or None (a halo pads).

        The torch kernels pad inside the kernel (as ``torch.nn.Conv2d`` does)
        when this rank's block spans every spatial dimension whole and the
        padding is symmetric zeros (or -inf for max pooling): no halo, no
        extended copy of the input, and no halo adjoint in backward.
        Otherwise None.
        """
        return self.kernel_padding_for(x.dist)

    @derived
    def kernel_padding_for(self, dist: Distribution) -> tuple[int, ...] | None:
        """:meth:`kernel_padding` for an input distributed as ``dist``."""
        if self.kernel_backend != "torch":
            return None
        return self._padding_without_halo(dist)

    @derived
    def takes_channels_last(self, dist: Distribution) -> bool:
        """With the torch kernels, a 2-D window whose padding the kernel applies itself (no
        spatial split: :meth:`kernel_padding`); its output and input gradient keep the
        layout (a halo's extended block would not)."""
        return self.kernel_backend == "torch" and self.nd == 2 and \
            self.twin_channels_last and self._padding_without_halo(dist) is not None

    # ------------------------------------------------------------ timing twins
    def _twin_padding(self) -> Any:
        """The padding :meth:`local_twin` builds a twin with: this layer's where it is a twin
        that keeps it (:attr:`twin_pads`), else none (the twin's input comes padded)."""
        return tuple(lo for lo, _ in self.spec.padding) if self.twin_pads else 0

    def _as_twin(self, twin: WindowLayer) -> WindowLayer:
        """``twin`` (a new layer built by :meth:`local_twin`) with this layer's timing
        settings (:attr:`twin_pads`, :attr:`twin_channels_last`)."""
        twin.twin_pads, twin.twin_channels_last = self.twin_pads, self.twin_channels_last
        return twin

    def _twin_signature(self) -> str:
        """What the timing settings add to :meth:`kernel_signature` (nothing by default)."""
        return (f"p{self._twin_padding()}" if self.twin_pads else "") + \
            ("" if self.twin_channels_last else "nocl")

    def twin_settings(self, dist: Distribution) -> tuple[tuple[int, ...] | None, bool]:
        """How the twin the kernel timer runs for an input distributed as ``dist`` must
        differ from :meth:`local_twin`'s so that it makes this layer's kernel calls:
        ``(padding, channels_last)``.

        ``padding`` is the padding the kernels apply themselves (no spatial split:
        :meth:`kernel_padding_for`), None where a halo pads or there is none: a twin
        on the padded block calls the kernels on other shapes (oneDNN's padded
        convolution on ResNet-18's (8, 64, 28, 28) blocks, two threads, took 7.8 ms
        forward and backward against 8.5 on the block padded beforehand).
        ``channels_last`` is False where this layer takes no channels-last blocks
        (:meth:`takes_channels_last`) though a one-process twin would.
        """
        pads = self.kernel_padding_for(dist)
        pads = pads if pads is not None and any(pads) else None
        twin_would = self.kernel_backend == "torch" and self.nd == 2 and \
            self.twin_channels_last
        return pads, not twin_would or self.takes_channels_last(dist)

    def timing_twin(self, dist: Distribution) -> WindowLayer | None:
        """The twin the kernel timer runs for an input distributed as ``dist``
        (:meth:`twin_settings`), None where :meth:`local_twin`'s makes this layer's kernel
        calls already. Its blocks are the unpadded ones where it pads (the cost spec's
        ``local_shape``)."""
        pads, channels_last = self.twin_settings(dist)
        if pads is None and channels_last:
            return None
        return self._new_twin(pads, channels_last)

    def _new_twin(self, pads: tuple[int, ...] | None, channels_last: bool) -> WindowLayer:
        """A twin with padding ``pads`` (None: none) and :attr:`twin_channels_last`."""
        twin = self.local_twin()
        if pads is not None:
            twin.spec = dataclasses.replace(twin.spec, padding=self.spec.padding)
            twin.twin_pads = True
        twin.twin_channels_last = channels_last
        return twin

    def _padding_without_halo(self, dist: Distribution) -> tuple[int, ...] | None:
        """The padding per spatial dimension where a kernel may apply it itself for an input
        distributed as ``dist`` (no spatial split, symmetric constant padding), else None."""
        # decided from what every rank knows alike (a rank's empty block pads the same way)
        if self.mode != "constant":
            return None
        if any(dist.nblocks[d] > 1 for d in range(2, dist.ndim)):
            return None
        if any(lo != hi for lo, hi in self.spec.padding):
            return None
        return tuple(lo for lo, _ in self.spec.padding)

    def forward(self, x: DistArray) -> DistArray:
        self._check(x)
        xin = x
        x = self._kernel_input(xin)
        self._pads = self.kernel_padding(x)
        if self._pads is not None:  # the kernels pad: no halo
            out_dist = self.output_distribution(x.dist)
            local = self._kernel_forward(x.local)
            out = DistArray(local, out_dist) if is_c_contiguous(local) or \
                is_channels_last(local) else \
                DistArray.from_local(x.xp.ascontiguousarray(local), out_dist)
            self._saved = (xin, x, None, None, None)
            return self._finish_output(out)
        geo = geometry(self.spec, x.dist)
        plan = halo_plan(x.dist, geo.widths, self.mode)
        out_dist = self.output_distribution(x.dist)
        out = None
        boxes = [geo.out_box]
        if self.overlap:
            out = DistArray.empty(out_dist, self._out_dtype(x), xp=x.xp)
            request = plan.start(x, self._pad_value())
            inner = geo.interior_box()
            if all(b > a for a, b in inner):
                self._run_box(request.ext, geo, inner, out.local)
            ext = request.finish()
            boxes = geo.boundary_boxes()
        else:
            ext = plan.exchange(x, self._pad_value())
            local = self._kernel_forward(ext[geo.input_slices(geo.out_box)]) \
                if all(b > a for a, b in geo.out_box) else None
            if local is not None and tuple(local.shape) == out_dist.local_shape() and \
                    is_c_contiguous(local):
                out = DistArray(local, out_dist)  # the kernel's output is the block: no copy
                boxes = []
            del local
        if out is None:  # the output block is written box by box
            out = DistArray.empty(out_dist, self._out_dtype(x), xp=x.xp)
        for box in boxes:
            self._run_box(ext, geo, box, out.local)
        self._saved = (xin, x, geo, plan, x.halo_token)
        return self._finish_output(out)

    def _kernel_input(self, x: DistArray) -> DistArray:
        """The array the kernel windows run on (``x``; a layer may gather its channels)."""
        return x

    def _finish_output(self, y: DistArray) -> DistArray:
        """The layer's output from the kernel's (``y``; a layer may sum partial outputs)."""
        return y

    def _input_grad(self, dx: DistArray, x: DistArray) -> DistArray:
        """The gradient of the input ``x`` from that of the kernel's input ``dx``.

        The adjoint of :meth:`_kernel_input` (``dx`` itself by default).
        """
        return dx

    def _out_dtype(self, x: DistArray) -> np.dtype:
        return x.dtype

    def _run_box(self, ext: Any, geo: WindowGeometry, box, y: Any) -> None:
        if not all(b > a for a, b in box):
            return
        local = tuple(slice(a - o0, b - o0) for (a, b), (o0, _) in zip(box, geo.out_box))
        y[(slice(None), slice(None)) + local] = self._kernel_forward(ext[geo.input_slices(box)])

    # ------------------------------------------------------------ backward
    def _extended_input(self) -> tuple[DistArray, WindowGeometry, Any, Any]:
        _, x, geo, plan, key = self._saved
        if x.halo_token is not key or key is None:  # the halo was overwritten since forward
            plan.exchange(x, self._pad_value())
        return x, geo, plan, x.extended(geo.widths)

    def backward(self, dy: DistArray) -> DistArray | None:
        xin = self._saved[0]
        if self._saved[2] is None:  # the kernels padded: the gradient has the block's shape
            x = self._saved[1]
            if not self.input_grad:
                self._param_backward(dy, x.local)
                return None
            dx = self._kernel_backward(dy.local, x.local)
            self._param_backward(dy, x.local)
            return self._input_grad(DistArray(dx, x.dist), xin)
        x, geo, plan, ext = self._extended_input()
        sl = geo.input_slices(geo.out_box)
        nonempty = all(b > a for a, b in geo.out_box)
        if not self.input_grad:  # only the parameters' gradients are wanted
            self._param_backward(dy, ext[sl] if nonempty else None)
            return None
        dxwin = self._kernel_backward(dy.local, ext[sl]) if nonempty else None
        if dxwin is not None and dxwin.shape == ext.shape:  # the window is the whole block
            dext = dxwin
        else:
            dext = zeros(x.xp, ext.shape, dy.local.dtype, device_of(dy.local))
            if dxwin is not None:
                dext[sl] = dxwin
        # The halo cells travel back to their owners while the parameter
        # gradients are computed (with overlap) or after them.
        request = plan.start_accumulate(dext, overwrite_input=True) if self.overlap else None
        self._param_backward(dy, ext[sl] if nonempty else None)
        dx = plan.accumulate(dext, overwrite_input=True) if request is None else request.finish()
        return self._input_grad(dx, xin)

    def _param_backward(self, dy: DistArray, xwin: Any | None) -> None:
        """Gradients of the layer's parameters (``xwin`` is None on an empty block)."""

    # ------------------------------------------------------------ cost model
    def _window_blocks(self, dist: Distribution) -> tuple[tuple[int, ...], list[int], Any]:
        """Largest extended input block, largest output block and the halo widths."""
        out_dist, widths = output_layout(self.spec, dist)
        ext = tuple(n + lo + hi for n, (lo, hi) in zip(largest_block(dist), widths))
        out_block = list(largest_block(out_dist))
        out_block[1] = self.output_shape(dist.global_shape)[1]
        return ext, out_block, widths

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """The kernel runs on the halo-extended block: one FLOP per window element and output.

        The halo widths are those of :func:`~disttensor_nn.window.output_layout`.
        The input is kept for backward, its buffer grown by the halo margins
        (``saved``); backward builds the gradient of the extended block
        (``workspace``) before the halo is summed back into the input's gradient.
        """
        ext, out_block, widths = self._window_blocks(dist)
        block = largest_block(dist)
        twin = self.timing_twin(dist)  # where it pads as the kernels do: the block itself
        return CostSpec(block if twin is not None and twin.twin_pads else ext, twin=twin,
                        flops=float(math.prod(out_block) * math.prod(self.spec.kernel)),
                        nbytes=(math.prod(ext) + math.prod(out_block)) * itemsize, halo=widths,
                        saved=(math.prod(ext) - math.prod(block)) * itemsize,
                        workspace=math.prod(ext) * itemsize, keeps_input=True)
