"""Local N-D convolution and pooling kernels for NumPy arrays (channel-first, no padding).

Every kernel works on an already padded ("valid") input of shape
``(N, C, *S)``; the distributed layers obtain that input from the halo
exchange, which also applies the padding at the global edges. Convolutions
are im2col plus one GEMM per group and tile; tiles run along the first
spatial output dimension so that the column buffer stays within
``workspace_bytes`` whatever the sample size.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

__all__ = [
    "out_shape",
    "windows",
    "conv_forward",
    "conv_backward",
    "pool_forward",
    "pool_backward",
    "WORKSPACE_BYTES",
]

WORKSPACE_BYTES = 64 * 2**20


def out_shape(in_shape: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
              dilation: Sequence[int]) -> tuple[int, ...]:
    """Spatial output shape of a valid (unpadded) window operation."""
    return tuple(
        max(0, (n - d * (k - 1) - 1) // s + 1) if n >= d * (k - 1) + 1 else 0
        for n, k, s, d in zip(in_shape, kernel, stride, dilation)
    )


def windows(x: np.ndarray, kernel: Sequence[int], stride: Sequence[int],
            dilation: Sequence[int]) -> np.ndarray:
    """Read-only view of shape ``(N, C, *O, *K)``: every window of every output position."""
    nd = len(kernel)
    o = out_shape(x.shape[2:], kernel, stride, dilation)
    st = x.strides
    strides = (
        st[:2]
        + tuple(st[2 + i] * stride[i] for i in range(nd))
        + tuple(st[2 + i] * dilation[i] for i in range(nd))
    )
    return as_strided(x, x.shape[:2] + o + tuple(kernel), strides, writeable=False)


def _tile_rows(rows: int, bytes_per_row: int, workspace: int) -> int:
    return max(1, min(rows, workspace // max(1, bytes_per_row)))


def _columns(win: np.ndarray, r0: int, r1: int, nd: int) -> np.ndarray:
    """im2col of output rows ``r0:r1``: shape ``(C*prod(K), N*rows*prod(O[1:]))``."""
    part = win[:, :, r0:r1]
    n, c = part.shape[:2]
    # (N, C, *O, *K) -> (C, *K, N, *O)
    order = (1, *range(2 + nd, 2 + 2 * nd), 0, *range(2, 2 + nd))
    cols = np.ascontiguousarray(part.transpose(order))
    return cols.reshape(c * math.prod(part.shape[2 + nd:]), -1)


def conv_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                 stride: Sequence[int], dilation: Sequence[int], groups: int = 1,
                 workspace_bytes: int = WORKSPACE_BYTES) -> np.ndarray:
    """Valid N-D cross-correlation: ``y[n, f, o] = sum_{c,k} w[f, c, k] x[n, c, s*o + d*k] + b[f]``.

    Parameters
    ----------
    x : (N, C, *S) array
    w : (F, C // groups, *K) array
    b : (F,) array or None
    """
    nd = w.ndim - 2
    n, c = x.shape[:2]
    f = w.shape[0]
    cg, fg = c // groups, f // groups
    kernel = w.shape[2:]
    win = windows(x, kernel, stride, dilation)
    o = win.shape[2:2 + nd]
    y = np.empty((n, f) + o, dtype=np.result_type(x, w))
    if y.size == 0:
        return y
    rest = math.prod(o[1:])
    ck = cg * math.prod(kernel)
    t = _tile_rows(o[0], ck * n * rest * x.itemsize, workspace_bytes)
    for g in range(groups):
        wmat = w[g * fg:(g + 1) * fg].reshape(fg, ck)
        wg = win[:, g * cg:(g + 1) * cg]
        for r0 in range(0, o[0], t):
            r1 = min(o[0], r0 + t)
            res = wmat @ _columns(wg, r0, r1, nd)  # (Fg, N * rows * rest)
            res = res.reshape((fg, n, r1 - r0) + o[1:])
            y[:, g * fg:(g + 1) * fg, r0:r1] = res.transpose(1, 0, *range(2, 2 + nd))
    if b is not None:
        y += b.reshape((1, f) + (1,) * nd)
    return y


def conv_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, stride: Sequence[int],
                  dilation: Sequence[int], groups: int = 1, need_dx: bool = True,
                  need_dw: bool = True, workspace_bytes: int = WORKSPACE_BYTES
                  ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
    """Gradients of :func:`conv_forward`: ``(dx, dw, db)`` (dx over the whole input ``x``).

    ``dx`` is the transposed convolution of ``dy`` (col2im of ``w^T dy``);
    ``dw`` is one GEMM per group and tile of ``dy`` with the im2col of ``x``.
    """
    nd = w.ndim - 2
    n, c = x.shape[:2]
    f = w.shape[0]
    cg, fg = c // groups, f // groups
    kernel = w.shape[2:]
    o = dy.shape[2:]
    db = dy.sum(axis=(0, *range(2, 2 + nd)))
    dx = np.zeros(x.shape, dtype=np.result_type(dy, w)) if need_dx else None
    dw = np.zeros(w.shape, dtype=np.result_type(dy, x)) if need_dw else None
    if dy.size == 0:
        return dx, dw, db
    win = windows(x, kernel, stride, dilation)
    rest = math.prod(o[1:])
    ck = cg * math.prod(kernel)
    t = _tile_rows(o[0], ck * n * rest * x.itemsize * (1 + need_dx), workspace_bytes)
    for g in range(groups):
        wmat = w[g * fg:(g + 1) * fg].reshape(fg, ck)
        wg = win[:, g * cg:(g + 1) * cg]
        for r0 in range(0, o[0], t):
            r1 = min(o[0], r0 + t)
            # dy tile as (Fg, N * rows * rest)
            dyt = np.ascontiguousarray(
                dy[:, g * fg:(g + 1) * fg, r0:r1].transpose(1, 0, *range(2, 2 + nd))
            ).reshape(fg, -1)
            if need_dw:
                dw[g * fg:(g + 1) * fg] += (dyt @ _columns(wg, r0, r1, nd).T).reshape(
                    (fg, cg) + tuple(kernel))
            if need_dx:
                dcol = (wmat.T @ dyt).reshape((cg, *kernel, n, r1 - r0) + o[1:])
                _col2im(dx[:, g * cg:(g + 1) * cg], dcol, r0, stride, dilation)
    return dx, dw, db


def _col2im(dx: np.ndarray, dcol: np.ndarray, r0: int, stride: Sequence[int],
            dilation: Sequence[int]) -> None:
    """Add ``dcol`` of shape ``(C, *K, N, rows, *O[1:])`` into the windows of ``dx``."""
    nd = len(stride)
    kernel = dcol.shape[1:1 + nd]
    o = dcol.shape[2 + nd:]
    for kk in itertools.product(*(range(k) for k in kernel)):
        idx = [slice(None), slice(None)]
        for i in range(nd):
            start = kk[i] * dilation[i] + (r0 * stride[i] if i == 0 else 0)
            idx.append(slice(start, start + stride[i] * (o[i] - 1) + 1, stride[i]))
        # dcol[:, kk] is (C, N, *O) -> (N, C, *O)
        dx[tuple(idx)] += np.moveaxis(dcol[(slice(None), *kk)], 1, 0)


def pool_forward(x: np.ndarray, kernel: Sequence[int], stride: Sequence[int],
                 dilation: Sequence[int], op: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Max or average over every window; for max also the flat argmax within each window."""
    nd = len(kernel)
    win = windows(x, kernel, stride, dilation)
    axes = tuple(range(2 + nd, 2 + 2 * nd))
    if op == "avg":
        return win.mean(axis=axes), None
    flat = win.reshape(win.shape[:2 + nd] + (-1,))
    if flat.size == 0:
        return np.empty(win.shape[:2 + nd], x.dtype), np.empty(win.shape[:2 + nd], np.intp)
    arg = flat.argmax(axis=-1)
    return np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0], arg


def pool_backward(dy: np.ndarray, x_shape: Sequence[int], kernel: Sequence[int],
                  stride: Sequence[int], dilation: Sequence[int], op: str,
                  arg: np.ndarray | None = None) -> np.ndarray:
    """Gradient of :func:`pool_forward` over the whole (padded) input."""
    nd = len(kernel)
    dx = np.zeros(x_shape, dtype=dy.dtype)
    o = dy.shape[2:]
    scale = 1.0 / math.prod(kernel)
    for flat_k, kk in enumerate(itertools.product(*(range(k) for k in kernel))):
        idx = [slice(None), slice(None)]
        for i in range(nd):
            start = kk[i] * dilation[i]
            idx.append(slice(start, start + stride[i] * (o[i] - 1) + 1, stride[i]))
        if op == "avg":
            dx[tuple(idx)] += dy * scale
        else:
            dx[tuple(idx)] += np.where(arg == flat_k, dy, 0)
    return dx
