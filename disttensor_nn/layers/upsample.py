"""Distributed N-D upsampling (nearest, (bi/tri)linear) over sample and spatial splits."""

from __future__ import annotations

import math
import numbers
from functools import lru_cache
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution, halo_plan
from disttensor.backend import array_namespace, as_module, astype, contiguous, device_of

from ..costspec import CostSpec, largest_block
from ..module import Layer, check_input

__all__ = ["Upsample"]

_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}


@lru_cache(maxsize=256)
def _sources(mode: str, align_corners: bool, n_in: int, n_out: int, scale: float | None,
             nd: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output position: the two inputs it interpolates and the weight of the second.

    PyTorch's rule: ``scale`` is ``1 / scale_factor`` when a factor was given,
    else ``n_in / n_out``; with ``align_corners`` the corners of input and
    output coincide (``(n_in - 1) / (n_out - 1)``); the linear modes copy a
    dimension whose length is kept (a factor of 1.3 on 3 elements). Mode
    ``'nearest'`` finds its sources in float32, as PyTorch's kernels do, and on
    ``nd = 2`` spatial dimensions copies a kept length and halves a doubled
    one whatever the scale given, as PyTorch's 2-D kernel does.
    """
    o = np.arange(n_out, dtype=np.float64)
    ratio = scale if scale is not None else n_in / max(n_out, 1)
    if mode != "nearest" and n_out == n_in:  # PyTorch copies such a dimension, whatever
        i0 = np.arange(n_in)                 # scale was given
        return i0, i0, np.zeros(n_out)
    if mode == "nearest":
        if nd == 2 and n_out in (n_in, 2 * n_in):
            i0 = np.arange(n_out) // (n_out // n_in)
        else:
            scale32 = np.float32(scale) if scale is not None else \
                np.float32(n_in) / np.float32(max(n_out, 1))
            i0 = np.minimum(np.floor(o.astype(np.float32) * scale32).astype(np.int64),
                            n_in - 1)
        return i0, i0, np.zeros(n_out)
    if align_corners:
        src = o * ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
    else:
        src = np.maximum(ratio * (o + 0.5) - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    return i0, i1, src - i0


class Upsample(Layer):
    """Upsampling of (N, C, *S) DistArrays split over N and spatial dims, as ``torch.nn.Upsample``.

    Each spatial output position reads one input (``mode='nearest'``) or
    interpolates two neighbours per dimension (``'linear'``, ``'bilinear'``,
    ``'trilinear'`` for 1-, 2- and 3-D inputs), with PyTorch's source
    positions (``align_corners`` as there; default False). An output lives on
    the rank that owns its first source, so the output is cut where the
    input is (scaled); linear modes need a halo of one cell after each block.
    Forward and backward are per-dimension products with small interpolation
    matrices; backward sums the halo part back into its owners.

    Parameters
    ----------
    size : int or tuple of int, optional
        Output spatial size.
    scale_factor : float or tuple of float, optional
        Multiplier of the spatial size (exactly one of ``size`` and
        ``scale_factor``).
    mode : {'nearest', 'linear', 'bilinear', 'trilinear'}
    align_corners : bool, optional
        Only for the linear modes.
    """

    saved_for_backward = ("_saved",)

    def __init__(self, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                 align_corners: bool | None = None):
        if (size is None) == (scale_factor is None):
            raise ValueError("give exactly one of size and scale_factor")
        if mode != "nearest" and mode not in _LINEAR:
            raise ValueError(f"mode must be 'nearest', 'linear', 'bilinear' or 'trilinear', "
                             f"got {mode!r}")
        if mode == "nearest" and align_corners is not None:
            raise ValueError("align_corners applies to the linear modes only")
        self.size = _tuple_of(size, numbers.Integral, "size", 0)
        self.scale_factor = _tuple_of(scale_factor, numbers.Real, "scale_factor", 0)
        self.mode = mode
        self.align_corners = align_corners

    def _nd_args(self, in_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple]:
        """Output spatial size and the per-dim scale (None: from the sizes), validated."""
        nd = len(in_shape) - 2
        if nd < 1:
            raise ValueError(f"Upsample expects an (N, C, *S) input, got shape {in_shape}")
        if self.mode in _LINEAR and _LINEAR[self.mode] != nd:
            raise ValueError(f"mode {self.mode!r} needs a {_LINEAR[self.mode]}-D input, got "
                             f"{nd} spatial dimensions")
        given = self.size if self.size is not None else self.scale_factor
        if len(given) == 1:
            given = given * nd
        if len(given) != nd:
            raise ValueError(f"Upsample has {len(given)} sizes or factors for {nd} spatial "
                             f"dimensions")
        if self.size is not None:
            return tuple(int(v) for v in given), (None,) * nd
        out = tuple(int(math.floor(n * f)) for n, f in zip(in_shape[2:], given))
        if any(o < 1 for o in out):
            raise ValueError(f"Upsample: the output size {out} is empty")
        return out, tuple(1.0 / f for f in given)

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(in_shape[:2]) + self._nd_args(tuple(in_shape))[0]

    def _layout(self, dist: Distribution) -> tuple[Distribution, tuple, list]:
        """Output distribution, halo widths and the per-dim sources (pure)."""
        shape = dist.global_shape
        out, scales = self._nd_args(shape)
        splits: list = [dist.splits[0], None]
        widths: list = [(0, 0), (0, 0)]
        sources = []
        for i, (n_out, scale) in enumerate(zip(out, scales)):
            n_in = shape[2 + i]
            i0, i1, lam = _sources(self.mode, bool(self.align_corners), n_in, n_out, scale,
                                   len(out))
            sources.append((i0, i1, lam))
            ib = dist.boundaries[2 + i]
            ob = [0, *(int(np.searchsorted(i0, b, "left")) for b in ib[1:-1]), n_out]
            splits.append(ob[1:-1] if len(ob) > 2 else None)
            lo = hi = 0
            for blk in range(len(ib) - 1):
                o0, o1 = ob[blk], ob[blk + 1]
                if o1 > o0:
                    lo = max(lo, ib[blk] - int(i0[o0]))
                    hi = max(hi, int(i1[o0:o1].max()) + 1 - ib[blk + 1])
            widths.append((lo, hi))
        out_dist = dist.replace(global_shape=tuple(shape[:2]) + out, splits=splits)
        return out_dist, tuple(widths), sources

    def _matrices(self, dist: Distribution, out_dist: Distribution, widths, sources, dtype):
        """This rank's interpolation matrix per spatial dim: (local outputs, extended inputs)."""
        mats = []
        in_start, out_sl = dist.local_start(), out_dist.local_slices()
        ext_len = [n + lo + hi for n, (lo, hi) in zip(dist.local_shape(), widths)]
        for i, (i0, i1, lam) in enumerate(sources):
            o = np.arange(out_sl[2 + i].start, out_sl[2 + i].stop)
            origin = in_start[2 + i] - widths[2 + i][0]
            m = np.zeros((len(o), ext_len[2 + i]))
            r = np.arange(len(o))
            np.add.at(m, (r, i0[o] - origin), 1.0 - lam[o])
            np.add.at(m, (r, i1[o] - origin), lam[o])
            mats.append(m.astype(dtype))
        return mats

    def forward(self, x: DistArray) -> DistArray:
        if not isinstance(x, DistArray):
            raise TypeError(f"Upsample expects a DistArray, got {type(x).__name__}")
        check_input(x, x.ndim, "Upsample")
        out_dist, widths, sources = self._layout(x.dist)
        plan = halo_plan(x.dist, widths, "constant")
        ext = plan.exchange(x, 0.0)
        mats = self._matrices(x.dist, out_dist, widths, sources, x.dtype)
        y = ext
        for i, m in enumerate(mats):
            y = _along(as_module(m, x.xp, device_of(ext)), y, 2 + i)
        self._saved = (plan, mats, x.dtype)
        return DistArray(contiguous(y), out_dist)

    def backward(self, dy: DistArray) -> DistArray:
        plan, mats, dtype = self._saved
        g = dy.local
        for i, m in enumerate(mats):
            g = _along(as_module(np.ascontiguousarray(m.T), dy.xp, device_of(g)), g, 2 + i)
        return plan.accumulate(astype(g, dtype), overwrite_input=True)

    # ------------------------------------------------------------ planner protocol
    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """One product per spatial dimension with the interpolation matrix, on the extended block.

        Nothing is kept for backward but the halo margins grown into the input.
        """
        out_dist, widths, _ = self._layout(dist)
        block = largest_block(dist)
        ext = tuple(n + lo + hi for n, (lo, hi) in zip(block, widths))
        out = largest_block(out_dist)
        flops, cur = 0.0, list(ext)
        for i in range(len(ext) - 2):  # each product: 2 * (extended length) per output
            flops += 2.0 * math.prod(cur) * out[2 + i]
            cur[2 + i] = out[2 + i]
        return CostSpec(ext, flops=flops, nbytes=(math.prod(ext) + math.prod(out)) * itemsize,
                        halo=widths, saved=(math.prod(ext) - math.prod(block)) * itemsize,
                        workspace=2 * math.prod(out) * itemsize)

    def kernel_signature(self) -> str:
        return f"upsample:{self.mode}:{self.size}:{self.scale_factor}:{self.align_corners}"

    def __repr__(self) -> str:
        what = f"size={self.size}" if self.size is not None else \
            f"scale_factor={self.scale_factor}"
        return f"Upsample({what}, mode={self.mode!r}, align_corners={self.align_corners})"


def _tuple_of(value: Any, kind: type, name: str, low: float) -> tuple | None:
    """``value`` as a tuple of numbers of ``kind`` above ``low`` (None stays None)."""
    if value is None:
        return None
    vals = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not vals or not all(isinstance(v, kind) and not isinstance(v, bool) and v > low
                           for v in vals):
        raise ValueError(f"{name} must be a positive number or a tuple of them, got {value!r}")
    return vals


def _along(m: Any, a: Any, axis: int) -> Any:
    """The product of the matrix ``m`` with ``a`` along ``axis`` (``m @ a`` there)."""
    xp = array_namespace(a)
    return xp.moveaxis(xp.tensordot(m, a, axes=([1], [axis])), 0, axis)
