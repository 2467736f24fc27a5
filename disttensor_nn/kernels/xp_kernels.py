"""Local N-D convolution and pooling kernels written against the NumPy API, for any array module.

The functions have the signatures of :mod:`disttensor_nn.kernels.numpy_kernels`
and work on an already padded ("valid") input of shape ``(N, C, *S)``, but
they only use what NumPy and CuPy both provide (``as_strided`` views, copies,
``matmul``, sums, ``argmax``), taking the array module from their inputs. They
are the CuPy kernels' fallback when cuDNN is not importable (``matmul`` is
cuBLAS there) and run on NumPy arrays too, which is how they are tested
without a GPU; the NumPy path of the layers stays the tuned
:mod:`~disttensor_nn.kernels.numpy_kernels`.

Convolution is im2col plus one GEMM per group and tile: a tile is several
whole samples, or a range of rows of the first spatial dimension of one
sample, whose column buffer fits in ``workspace_bytes``. The column matrix is
``(C/g*prod(K), tile)``, rows ordered ``(c, *k)`` and columns ``(n, *o)``;
the forward GEMM is ``w @ cols``, the weight gradient ``dy @ cols^T`` (one
GEMM whose inner dimension is the whole tile), and the input gradient
``w^T @ dy`` scattered back into the windows one kernel offset at a time
(col2im; with strides each offset's windows are a strided view, so the adds
never overlap).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from disttensor.backend import array_namespace, astype

from .numpy_kernels import out_shape  # the same geometry for every backend

__all__ = [
    "windows",
    "conv_forward",
    "conv_backward",
    "pool_forward",
    "pool_backward",
    "WORKSPACE_BYTES",
]

WORKSPACE_BYTES = 256 * 2**20
"""Upper bound on one im2col buffer (bytes) unless one output row alone is larger."""


def windows(x: Any, kernel: Sequence[int], stride: Sequence[int],
            dilation: Sequence[int]) -> Any:
    """View of shape ``(N, C, *O, *K)``: every window of every output position (do not write)."""
    xp = array_namespace(x)
    nd = len(kernel)
    o = out_shape(x.shape[2:], kernel, stride, dilation)
    st = x.strides
    strides = (
        tuple(st[:2])
        + tuple(st[2 + i] * stride[i] for i in range(nd))
        + tuple(st[2 + i] * dilation[i] for i in range(nd))
    )
    return xp.lib.stride_tricks.as_strided(x, shape=tuple(x.shape[:2]) + o + tuple(kernel),
                                           strides=strides)


def _plan(n: int, o: Sequence[int], rows: int, itemsize: int, workspace: int
          ) -> tuple[int, int]:
    """Tile of the output columns ``(n, *o)``: ``(samples, rows of o[0])`` per tile."""
    cols = max(1, workspace // (rows * itemsize))
    p, rest = math.prod(o), math.prod(o[1:])
    if p <= cols:
        return max(1, min(n, cols // p)), o[0]
    return 1, max(1, min(o[0], cols // max(rest, 1)))


def _tiles(n: int, rows: int, nb: int, t: int):
    for n0 in range(0, n, nb):
        for r0 in range(0, rows, t):
            yield n0, min(n, n0 + nb), r0, min(rows, r0 + t)


def _im2col(xp: ModuleType, win: Any) -> Any:
    """Contiguous ``(C*prod(K), nb*prod(O))`` columns of the windows ``(nb, C, *O, *K)``."""
    nd = (win.ndim - 2) // 2
    view = win.transpose(1, *range(2 + nd, 2 + 2 * nd), 0, *range(2, 2 + nd))
    cols = xp.ascontiguousarray(view)
    return cols.reshape(math.prod(view.shape[:1 + nd]), -1)


def _columns_of(xp: ModuleType, a: Any) -> Any:
    """``a`` of shape ``(nb, F, *O)`` as a ``(F, nb*prod(O))`` matrix (a copy unless nb == 1)."""
    if a.shape[0] == 1:
        return xp.ascontiguousarray(a[0]).reshape(a.shape[1], -1)
    return xp.ascontiguousarray(a.swapaxes(0, 1)).reshape(a.shape[1], -1)


def conv_forward(x: Any, w: Any, b: Any | None, stride: Sequence[int],
                 dilation: Sequence[int], groups: int = 1,
                 workspace_bytes: int = WORKSPACE_BYTES) -> Any:
    """Valid N-D cross-correlation: ``y[n, f, o] = sum_{c,k} w[f, c, k] x[n, c, s*o + d*k] + b[f]``.

    Parameters
    ----------
    x : (N, C, *S) array
    w : (F, C // groups, *K) array
    b : (F,) array or None
    stride, dilation : sequence of int
    groups : int
    workspace_bytes : int
        Bound on the im2col buffer of one tile.

    Returns
    -------
    (N, F, *O) array in ``result_type(x, w)``, of ``x``'s array module.
    """
    xp = array_namespace(x)
    nd = w.ndim - 2
    n, c = x.shape[:2]
    f = w.shape[0]
    cg, fg = c // groups, f // groups
    kernel, stride, dilation = tuple(w.shape[2:]), tuple(stride), tuple(dilation)
    dtype = np.result_type(x.dtype, w.dtype)
    o = out_shape(x.shape[2:], kernel, stride, dilation)
    y = xp.empty((n, f) + o, dtype=dtype)
    if y.size == 0:
        return y
    x, w = x.astype(dtype, copy=False), w.astype(dtype, copy=False)
    ck = cg * math.prod(kernel)
    nb, t = _plan(n, o, ck, dtype.itemsize, workspace_bytes)
    for g in range(groups):
        gf, gc = slice(g * fg, (g + 1) * fg), slice(g * cg, (g + 1) * cg)
        wm = w[gf].reshape(fg, ck)
        win = windows(x[:, gc], kernel, stride, dilation)
        for n0, n1, r0, r1 in _tiles(n, o[0], nb, t):
            cols = _im2col(xp, win[n0:n1, :, r0:r1])
            dst = y[n0, gf, r0:r1]
            if n1 - n0 == 1 and dst.flags.c_contiguous:
                xp.matmul(wm, cols, out=dst.reshape(fg, -1))
                continue
            res = xp.matmul(wm, cols).reshape((fg, n1 - n0, r1 - r0) + o[1:])
            y[n0:n1, gf, r0:r1] = res.swapaxes(0, 1)
    if b is not None:
        y += b.astype(dtype, copy=False).reshape((1, f) + (1,) * nd)
    return y


def conv_backward(dy: Any, x: Any, w: Any, stride: Sequence[int], dilation: Sequence[int],
                  groups: int = 1, need_dx: bool = True, need_dw: bool = True,
                  workspace_bytes: int = WORKSPACE_BYTES, need_db: bool | None = None
                  ) -> tuple[Any | None, Any | None, Any]:
    """Gradients of :func:`conv_forward`: ``(dx, dw, db)``, ``dx`` over the whole input ``x``.

    ``db`` is always given, whatever ``need_db`` (the torch kernels' flag): one sum.

    Per tile: ``dw += dy @ im2col(x)^T`` and ``dx`` += col2im of ``w^T @ dy``.
    ``dx`` (``dw``) is None unless ``need_dx`` (``need_dw``).
    """
    xp = array_namespace(x)
    nd = w.ndim - 2
    n, c = x.shape[:2]
    f = w.shape[0]
    cg, fg = c // groups, f // groups
    kernel, stride, dilation = tuple(w.shape[2:]), tuple(stride), tuple(dilation)
    dtype = np.result_type(dy.dtype, x.dtype, w.dtype)
    o = tuple(dy.shape[2:])
    dx = xp.zeros(x.shape, dtype=dtype) if need_dx else None
    dw = xp.zeros(w.shape, dtype=dtype) if need_dw else None
    if dy.size == 0:
        return dx, dw, xp.zeros(f, dtype=dtype)
    db = dy.sum(axis=(0, *range(2, 2 + nd)), dtype=dtype)
    if not (need_dx or need_dw):
        return dx, dw, db
    x, w, dy = (a.astype(dtype, copy=False) for a in (x, w, dy))
    ck = cg * math.prod(kernel)
    nb, t = _plan(n, o, ck, dtype.itemsize, workspace_bytes)
    for g in range(groups):
        gf, gc = slice(g * fg, (g + 1) * fg), slice(g * cg, (g + 1) * cg)
        wm = w[gf].reshape(fg, ck)
        win = windows(x[:, gc], kernel, stride, dilation)
        acc = None
        for n0, n1, r0, r1 in _tiles(n, o[0], nb, t):
            dyt = _columns_of(xp, dy[n0:n1, gf, r0:r1])  # (fg, tile)
            if need_dw:
                part = xp.matmul(dyt, _im2col(xp, win[n0:n1, :, r0:r1]).T)
                acc = part if acc is None else acc + part
            if need_dx:
                _col2im(dx[n0:n1, gc], xp.matmul(wm.T, dyt), r0, r1, kernel, stride, dilation)
        if need_dw:
            dw[gf] = acc.reshape((fg, cg) + kernel)
    return dx, dw, db


def _col2im(dx: Any, dcol: Any, r0: int, r1: int, kernel: Sequence[int],
            stride: Sequence[int], dilation: Sequence[int]) -> None:
    """Add ``dcol`` (``(C*prod(K), nb*rows*prod(O[1:]))``, output rows ``r0:r1``) into the
    windows of ``dx`` of shape ``(nb, C, *S)``, one kernel offset at a time."""
    nd = len(kernel)
    nb, c = dx.shape[:2]
    o = (r1 - r0,) + out_shape(dx.shape[3:], kernel[1:], stride[1:], dilation[1:])
    d5 = dcol.reshape((c, *kernel, nb) + o)
    for kk in itertools.product(*(range(k) for k in kernel)):
        idx = [slice(None), slice(None)]
        for i in range(nd):
            start = kk[i] * dilation[i] + (r0 * stride[0] if i == 0 else 0)
            idx.append(slice(start, start + stride[i] * (o[i] - 1) + 1, stride[i]))
        view = dx[tuple(idx)]
        view += d5[(slice(None), *kk)].swapaxes(0, 1)


def pool_forward(x: Any, kernel: Sequence[int], stride: Sequence[int],
                 dilation: Sequence[int], op: str) -> tuple[Any, Any | None]:
    """Max or average over every window; for max also the flat argmax within each window."""
    xp = array_namespace(x)
    nd = len(kernel)
    win = windows(x, kernel, stride, dilation)
    if op == "avg":
        return win.mean(axis=tuple(range(2 + nd, 2 + 2 * nd))), None
    small = math.prod(kernel) <= 256  # the argmax kept for backward: one byte, as NumPy's
    if win.size == 0:
        return xp.empty(win.shape[:2 + nd], x.dtype), \
            xp.empty(win.shape[:2 + nd], np.uint8 if small else np.intp)
    flat = win.reshape(win.shape[:2 + nd] + (-1,))
    arg = flat.argmax(axis=-1)
    y = xp.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
    return y, astype(arg, np.uint8) if small else arg


def pool_backward(dy: Any, x_shape: Sequence[int], kernel: Sequence[int],
                  stride: Sequence[int], dilation: Sequence[int], op: str,
                  arg: Any | None = None) -> Any:
    """Gradient of :func:`pool_forward` over the whole (padded) input."""
    xp = array_namespace(dy)
    nd = len(kernel)
    dx = xp.zeros(tuple(x_shape), dtype=dy.dtype)
    o = dy.shape[2:]
    if dy.size == 0:
        return dx
    scaled = dy * dy.dtype.type(1.0 / math.prod(kernel)) if op == "avg" else None
    for flat_k, kk in enumerate(itertools.product(*(range(k) for k in kernel))):
        idx = [slice(None), slice(None)]
        for i in range(nd):
            start = kk[i] * dilation[i]
            idx.append(slice(start, start + stride[i] * (o[i] - 1) + 1, stride[i]))
        view = dx[tuple(idx)]
        view += scaled if op == "avg" else xp.where(arg == flat_k, dy, dy.dtype.type(0))
    return dx
