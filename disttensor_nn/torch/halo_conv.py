"""Convolution of a block split along one spatial dimension, without copying the block.

The block is convolved zero-padded by the kernel itself (the bulk of the
work, run while the halo's faces are in flight); the few output rows at each
edge whose windows reach into the halo are then convolved again from a thin
slab of the faces' and the block's rows, and written over (so each output is
one convolution of its true inputs, rounded as one process rounds it). A
convolution is linear in its input, so backward is the kernel's own backward
on the block plus that of the faces alone (zeros elsewhere), whose input
gradients go back to the ranks they came from while the block's is computed
(:meth:`disttensor.halo.HaloPlan.start_faces` and
:meth:`~disttensor.halo.HaloPlan.start_accumulate_faces`).

A rank whose rows do not line up with the kernel's own padding (a strided
convolution cut off its stride, an empty block) joins the same messages and
convolves its block extended by the faces instead.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from disttensor import Distribution, halo_plan
from disttensor.halo import HaloPlan
from disttensor_nn.kernels.torch_kernels import one_window
from disttensor_nn.window import WindowSpec, geometry

__all__ = ["HALO_CONV_MIN_ELEMENTS", "HaloConv", "halo_conv_plan"]

# Blocks (of the largest size a dimension's split gives) below which ``parallelize`` copies
# the block into its extended one instead: one edge convolution forward and one backward
# cost about 50-100 us a call here (oneDNN, one thread), more than the copy of a block
# smaller than 1 MiB in float32 (measured on 2 ranks: a 1 x 8 x 128 x 256 block, 5.1 ms
# forward and backward extended against 4.4 ms by faces; a 1 x 8 x 64 x 128 one, 1.9
# against 2.0 ms).
HALO_CONV_MIN_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class _Edge:
    """Output rows ``[out0, out0 + rows)`` along the split dimension, whose windows read the
    face ``face`` (0 before the block, 1 after): the convolution, unpadded there, of the rows
    ``[start, stop)`` (the block's coordinates: negative in the face before it)."""

    face: int
    start: int
    stop: int
    out0: int
    rows: int


@dataclass(frozen=True)
class HaloConv:
    """A convolution on this rank's block split along one dimension (see the module).

    Made once per layer and rank by :func:`halo_conv_plan`; run with :meth:`__call__`.
    """

    plan: HaloPlan  # the halo along the split dimension alone
    dim: int  # the split dimension of the (N, C, *S) block
    fn: Callable[..., torch.Tensor]  # F.conv1d, F.conv2d or F.conv3d
    stride: tuple[int, ...]
    padding: tuple[int, ...]  # the kernel's own, on the block (native: P on the split dim)
    dilation: tuple[int, ...]
    groups: int
    native: bool  # the block with the kernel's padding, and edge corrections
    edges: tuple[_Edge, ...]
    crop: slice  # fallback: the rows of the faces and block that the outputs read
    out_shape: tuple[int, ...]

    @property
    def slab_padding(self) -> tuple[int, ...]:
        """The kernel's padding with none along the split dimension."""
        pads = list(self.padding)
        pads[self.dim - 2] = 0
        return tuple(pads)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        return _HaloConvFn.apply(x, weight, bias, self)


def halo_conv_plan(spec: WindowSpec, dist: Distribution, fn: Callable[..., torch.Tensor],
                   weight_shape: Sequence[int], groups: int) -> HaloConv | None:
    """The :class:`HaloConv` of a zero-padded convolution ``spec`` on ``dist``, or None.

    None (the caller extends the whole block) where no single spatial
    dimension is split, where another spatial dimension's padding is not
    symmetric, or where the kernel's padding would give a single strided
    output column (:func:`one_window`).
    """
    nd = dist.ndim - 2
    split = [i for i in range(nd) if dist.nblocks[2 + i] > 1]
    if len(split) != 1:
        return None
    i = split[0]
    d = 2 + i
    if any(lo != hi for e, (lo, hi) in enumerate(spec.padding) if e != i):
        return None
    if 0 < i == nd - 1 and spec.stride[-1] > 1:
        return None  # slabs thin along the last dimension could be single strided columns
    geo = geometry(spec, dist)
    widths = [(0, 0)] * dist.ndim
    widths[d] = geo.widths[d]
    if not any(widths[d]):
        return None
    shape = dist.local_shape()
    start = dist.local_start()[d]
    n = shape[d]
    j0, j1 = geo.out_box[i]
    m = j1 - j0
    s, reach = spec.stride[i], spec.dilation[i] * (spec.kernel[i] - 1) + 1
    pads = [lo for lo, _ in spec.padding]
    out_shape = list(shape)
    out_shape[1] = weight_shape[0]
    for e in range(nd):
        out_shape[2 + e] = geo.out_box[e][1] - geo.out_box[e][0]
    first = s * j0 - spec.padding[i][0]  # the first output's first input row (global)
    p = start - first
    native = m > 0 and n > 0 and p >= 0 and n + 2 * p >= reach and \
        (n + 2 * p - reach) // s + 1 == m
    pads[i] = max(p, 0)
    if one_window(shape, weight_shape, spec.stride, pads, spec.dilation):
        return None
    edges = []
    if native:  # an edge whose face rows all lie beyond the array's ends reads zeros alone:
        # the kernel's own padding has it right already
        top = min(m, -(-p // s))
        end = (top - 1) * s - p + reach
        if top and start + min(0, end) > 0:
            edges.append(_Edge(0, -p, end, 0, top))
        o_b = max(0, -(-(n + p - reach + 1) // s))
        lo_row = o_b * s - p
        if o_b < m and start + max(lo_row, n) < dist.global_shape[d]:
            edges.append(_Edge(1, lo_row, (m - 1) * s - p + reach, o_b, m - o_b))
    sl = geo.input_slices(geo.out_box)[d]
    return HaloConv(halo_plan(dist, widths), d, fn, tuple(spec.stride), tuple(pads),
                    tuple(spec.dilation), groups, native, tuple(edges), sl, tuple(out_shape))


def _rows(d: int, parts: Sequence[torch.Tensor | None], like: torch.Tensor, start: int,
          stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` along ``d`` (the block's coordinates) of the face before, the
    block and the face after (``parts``; None reads as zeros). ``like`` is the block."""
    n = like.shape[d]
    pieces = []
    for k, (lo, hi) in enumerate(((start, min(0, stop)), (max(start, 0), min(stop, n)),
                                  (max(start, n), stop))):
        if hi <= lo:
            continue
        part = parts[k]
        if part is None:
            shape = list(like.shape)
            shape[d] = hi - lo
            pieces.append(like.new_zeros(shape))
        else:
            first = (-part.shape[d], 0, n)[k]  # the part's first row
            pieces.append(part.narrow(d, lo - first, hi - lo))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)


def _in_compute_dtype(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors in the dtype autocast runs a convolution in (as they are without it)."""
    kind = next(t for t in ts if t is not None).device.type
    if not torch.is_autocast_enabled(kind):
        return list(ts)
    dt = torch.get_autocast_dtype(kind)
    return [t.to(dt) if t is not None and t.is_floating_point() else t for t in ts]


class _HaloConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                hc: HaloConv) -> torch.Tensor:
        x, weight, bias = _in_compute_dtype(x, weight, bias)
        d = hc.dim
        with torch.autocast(x.device.type, enabled=False):
            request = hc.plan.start_faces(x.detach())
            if hc.native:
                out = hc.fn(x, weight, bias, hc.stride, hc.padding, hc.dilation, hc.groups)
                before, after = request.finish()
                for e in hc.edges:
                    slab = _rows(d, (before, x, after), x, e.start, e.stop)
                    out.narrow(d, e.out0, e.rows).copy_(hc.fn(
                        slab, weight, bias, hc.stride, hc.slab_padding, hc.dilation,
                        hc.groups))
            else:
                before, after = request.finish()
                if 0 in hc.out_shape:
                    out = x.new_zeros(hc.out_shape)
                else:
                    index = (slice(None),) * d + (hc.crop,)
                    ext = torch.cat([before, x, after], d)[index]
                    out = hc.fn(ext, weight, bias, hc.stride, hc.slab_padding, hc.dilation,
                                hc.groups)
        ctx.hc = hc
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, before, after)
        return out

    @staticmethod
    @once_differentiable  # the faces' messages are not differentiated again: refused, not wrong
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hc: HaloConv = ctx.hc
        x, weight, before, after = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        d, nd = hc.dim, x.ndim - 2
        grad = grad.to(x.dtype)

        def conv_backward(g: torch.Tensor, inp: torch.Tensor, padding: Sequence[int],
                          mask: list[bool]) -> tuple[Any, ...]:
            return torch.ops.aten.convolution_backward(
                g, inp, weight, [weight.shape[0]] if mask[2] else None, hc.stride, padding,
                hc.dilation, False, [0] * nd, hc.groups, mask)

        gx = gw = gb = None
        if hc.native:
            # the convolution is the block's, zero-padded, plus the faces' alone: the faces'
            # input gradients first, sent back ...
            dfaces = [torch.zeros_like(before), torch.zeros_like(after)] if need_x else []
            for e in hc.edges:
                parts = (before, None, None) if e.face == 0 else (None, None, after)
                slab = _rows(d, parts, x, e.start, e.stop)
                ds, dw, _ = conv_backward(grad.narrow(d, e.out0, e.rows), slab,
                                          hc.slab_padding, [need_x, need_w, False])
                if need_x:  # the face's rows of the slab
                    n = x.shape[d]
                    lo, hi = (e.start, min(0, e.stop)) if e.face == 0 else \
                        (max(e.start, n), e.stop)
                    first = -before.shape[d] if e.face == 0 else n
                    dfaces[e.face].narrow(d, lo - first, hi - lo).add_(
                        ds.narrow(d, lo - e.start, hi - lo))
                if need_w:
                    gw = dw if gw is None else gw + dw
            back = hc.plan.start_accumulate_faces(*dfaces) if need_x else None
            # ... while the block's own is computed
            gx, dw, gb = conv_backward(grad, x, hc.padding, [need_x, need_w, need_b])
            if need_w:
                gw = dw if gw is None else dw + gw
        else:
            dfaces = [torch.zeros_like(before), torch.zeros_like(after)] if need_x else []
            if 0 not in hc.out_shape:
                index = (slice(None),) * d + (hc.crop,)
                ext = torch.cat([before, x, after], d)
                dext, gw, gb = conv_backward(grad, ext[index], hc.slab_padding,
                                             [need_x, need_w, need_b])
                if need_x:
                    full = torch.zeros_like(ext)
                    full[index] = dext
                    lo, n = before.shape[d], x.shape[d]
                    dfaces = [full.narrow(d, 0, lo).contiguous(),
                              full.narrow(d, lo + n, after.shape[d]).contiguous()]
                    gx = full.narrow(d, lo, n).contiguous()
            else:  # no output here: zeros, so that every rank's parameters get a gradient
                gx = torch.zeros_like(x) if need_x else None
                gw = torch.zeros_like(weight) if need_w else None
                gb = weight.new_zeros(weight.shape[0]) if need_b else None
            back = hc.plan.start_accumulate_faces(*dfaces) if need_x else None
        if back is not None:
            back.finish(gx)
        return gx, gw, gb, None
