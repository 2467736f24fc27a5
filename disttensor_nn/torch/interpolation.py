"""Which input rows each output row of ``F.interpolate`` reads along one dimension, and
with what weights, as PyTorch's CPU kernels compute them.

Interpolation is separable: along each dimension, output row ``o`` is a weighted sum
of a few input rows (one for the nearest modes, two for the linear ones, four for
bicubic). :func:`source_taps` gives those rows and weights for any output rows, so a
rank that holds some output rows of a split dimension knows which input rows (its
block and a halo) it needs, whatever the scale, and computes its rows from them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["INTERPOLATION_MODES", "source_taps", "taps_reach"]

INTERPOLATION_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear",
                       "bicubic")
"""The modes :func:`source_taps` knows (``'area'`` is adaptive average pooling)."""

_CUBIC_A = -0.75  # PyTorch's bicubic convolution coefficient

Taps = list[tuple[np.ndarray, np.ndarray]]


def _linear_scale(n: int, m: int, align_corners: bool, scale_factor: float | None) -> float:
    """PyTorch's ``area_pixel_compute_scale``: input rows per output row."""
    if align_corners:
        return (n - 1) / (m - 1) if m > 1 else 0.0
    if scale_factor is not None and scale_factor > 0:
        return 1.0 / scale_factor
    return n / m


def source_taps(mode: str, n: int, m: int, rows: Sequence[int] | np.ndarray,
                align_corners: bool = False, scale_factor: float | None = None,
                double: bool = False, ndim: int = 1, axis: int = 0) -> Taps:
    """The input rows and weights of output ``rows`` along one dimension.

    Parameters
    ----------
    mode : str
        One of :data:`INTERPOLATION_MODES` (``'linear'``, ``'bilinear'`` and
        ``'trilinear'`` are the same along one dimension).
    n, m : int
        The dimension's input and output lengths (``m >= 1``).
    rows : sequence of int
        Output rows, each in ``[0, m)``.
    align_corners : bool
        As ``F.interpolate``'s (the linear modes and bicubic only).
    scale_factor : float, optional
        The scale the caller gave ``F.interpolate`` for this dimension, if any and
        ``recompute_scale_factor`` was not set: PyTorch then maps rows by
        ``1 / scale_factor``, not ``n / m`` (they differ where ``n * scale_factor``
        is not an integer).
    double : bool
        Whether the tensor is float64. The nearest modes' rows depend on the
        precision PyTorch finds them in (a row whose coordinate is an integer in
        exact arithmetic may fall either side of it), so they are PyTorch's own:
        the interpolation of the row numbers, in float64 or float32.
    ndim, axis : int
        The interpolated tensor's number of spatial dimensions and which of them
        this is. PyTorch's nearest kernels follow other rules for 2-D images than
        for 1-D and 3-D data (a length kept or doubled is copied or halved whatever
        the scale given; coordinates in float32 even for float64), so the row
        numbers are interpolated in a tensor of as many dimensions, along ``axis``.

    Returns
    -------
    list of (numpy.ndarray, numpy.ndarray)
        One ``(index, weight)`` pair per tap: for each output row, the input row
        read (int64, in ``[0, n)``; PyTorch clamps reads at the edges) and its weight
        (float64). Output row ``rows[j]`` is ``sum(w[j] * x[i[j]] for i, w in taps)``.
    """
    o = np.asarray(rows, dtype=np.int64)
    if mode not in INTERPOLATION_MODES:
        raise ValueError(f"interpolation mode {mode!r} is not one of {INTERPOLATION_MODES}")
    if mode.startswith("nearest"):
        rows_read = _nearest_rows(mode, n, m, scale_factor, double, int(ndim), int(axis))
        return [(rows_read[o], np.ones(o.shape))]
    if m == n and mode != "bicubic":  # the linear modes copy a dimension of equal lengths
        return [(o.copy(), np.ones(o.shape))]
    scale = _linear_scale(n, m, align_corners, scale_factor)
    src = scale * o if align_corners else scale * (o + 0.5) - 0.5
    if mode != "bicubic":
        src = np.maximum(src, 0.0)
        i0 = np.minimum(np.floor(src).astype(np.int64), n - 1)
        t = np.clip(src - i0, 0.0, 1.0)
        i1 = i0 + (i0 < n - 1)
        return [(i0, 1.0 - t), (i1, t)]
    i0 = np.floor(src).astype(np.int64)
    t = src - i0
    a = _CUBIC_A
    near = [((a + 2) * u - (a + 3)) * u * u + 1 for u in (t, 1 - t)]
    far = [((a * u - 5 * a) * u + 8 * a) * u - 4 * a for u in (t + 1, 2 - t)]
    weights = [far[0], near[0], near[1], far[1]]
    return [(np.clip(i0 + j - 1, 0, n - 1), w) for j, w in enumerate(weights)]


@functools.lru_cache(maxsize=256)
def _nearest_rows(mode: str, n: int, m: int, scale_factor: float | None, double: bool,
                  ndim: int, axis: int) -> np.ndarray:
    """The input row of each of the ``m`` output rows in a nearest mode: ``F.interpolate``
    of the row numbers (exact integers in float32 up to 2^24) along ``axis`` of a tensor
    of ``ndim`` spatial dimensions (the others of length 1, kept), with the same
    arguments."""
    if n > 1 << 24:
        raise ValueError(f"a split dimension of {n} rows interpolated in mode {mode!r}")
    if not 0 <= axis < ndim <= 3:
        raise ValueError(f"axis {axis} of {ndim} spatial dimensions")
    shape = [1] * ndim
    shape[axis] = n
    rows = torch.arange(n, dtype=torch.float64 if double else torch.float32).view(
        1, 1, *shape)
    if scale_factor:
        out = F.interpolate(rows, mode=mode, scale_factor=tuple(
            float(scale_factor) if k == axis else 1.0 for k in range(ndim)))
    else:
        out = F.interpolate(rows, mode=mode, size=tuple(
            m if k == axis else 1 for k in range(ndim)))
    if out.shape[2 + axis] != m:
        raise ValueError(f"a scale of {scale_factor} takes {n} rows to "
                         f"{out.shape[2 + axis]}, not {m}")
    return out.reshape(m).to(torch.int64).numpy()


def taps_reach(taps: Taps) -> tuple[int, int] | None:
    """The first and last input rows that ``taps`` read (None for no output rows)."""
    if not taps or taps[0][0].size == 0:
        return None
    return (int(min(i.min() for i, _ in taps)), int(max(i.max() for i, _ in taps)))
