"""Local N-D convolution and pooling kernels that use only the Python array API standard.

The functions have the signatures of :mod:`disttensor_nn.kernels.numpy_kernels`
and work on an already padded ("valid") input of shape ``(N, C, *S)``. They
need nothing beyond the standard: strided slicing, ``stack``, ``reshape``,
``permute_dims``, ``matmul``, ``sum``, ``max``, ``argmax``, ``where`` and
``__setitem__`` with slices (no ``as_strided`` views, no ``out=``, no in-place
operations on views). So they run on any conforming array library, and on
``array_api_strict``, which is how the test suite checks that the layers make
no NumPy-only assumption without a GPU.

Convolution is im2col by slicing: for every kernel offset ``k`` the input
slice ``x[..., d*k : d*k + s*(O-1) + 1 : s]`` holds that offset's value for
every output position; the slices are stacked into the column matrix
``(C/g*prod(K), n*prod(O))`` (rows ``(c, *k)``, columns ``(n, *o)``) and one
GEMM per group and batch tile gives the output. The input gradient adds
``w^T @ dy`` back into the same slices, one offset at a time (col2im).
Pooling stacks the offsets on a last axis and reduces it. A batch tile holds
as many samples as keep its column matrix under ``workspace_bytes`` (at
least one), so the workspace is bounded by a sample's columns.

These kernels favour being obviously standard over speed; the tuned paths
are the NumPy and CuPy kernel modules.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

from disttensor.backend import array_namespace, numpy_dtype

from .numpy_kernels import out_shape  # the same geometry for every backend

__all__ = [
    "conv_forward",
    "conv_backward",
    "pool_forward",
    "pool_backward",
    "WORKSPACE_BYTES",
]

WORKSPACE_BYTES = 64 * 2**20
"""Preferred bound on one column matrix (bytes); a tile is never less than one sample."""


def _offset_slices(kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                   o: Sequence[int]) -> Iterator[tuple[slice, ...]]:
    """For every kernel offset (row-major), the slices of ``(N, C, *S)`` it reads for ``o``."""
    for kk in itertools.product(*(range(k) for k in kernel)):
        idx = [slice(None), slice(None)]
        for i, k in enumerate(kk):
            start = k * dilation[i]
            idx.append(slice(start, start + stride[i] * (o[i] - 1) + 1, stride[i]))
        yield tuple(idx)


def _columns(xp: Any, x: Any, kernel: Sequence[int], stride: Sequence[int],
             dilation: Sequence[int], o: Sequence[int]) -> Any:
    """The ``(C*prod(K), n*prod(O))`` column matrix of ``x`` of shape ``(n, C, *S)``."""
    n, c = x.shape[:2]
    nd = len(kernel)
    stacked = xp.stack([x[s] for s in _offset_slices(kernel, stride, dilation, o)],
                       axis=2)  # (n, C, K, *O)
    rows = xp.permute_dims(stacked, (1, 2, 0, *range(3, 3 + nd)))  # (C, K, n, *O)
    return xp.reshape(rows, (c * math.prod(kernel), n * math.prod(o)))


def _as_columns(xp: Any, a: Any) -> Any:
    """``a`` of shape ``(n, F, *O)`` as an ``(F, n*prod(O))`` matrix."""
    nd = a.ndim - 2
    moved = xp.permute_dims(a, (1, 0, *range(2, 2 + nd)))
    return xp.reshape(moved, (a.shape[1], -1))


def _from_columns(xp: Any, m: Any, n: int, o: Sequence[int]) -> Any:
    """Inverse of :func:`_as_columns`: ``(F, n*prod(O))`` to ``(n, F, *O)``."""
    f = m.shape[0]
    nd = len(o)
    return xp.permute_dims(xp.reshape(m, (f, n, *o)), (1, 0, *range(2, 2 + nd)))


def _batch_tiles(n: int, per_sample: int, workspace: int) -> Iterator[tuple[int, int]]:
    nb = max(1, min(n, workspace // max(per_sample, 1)))
    for n0 in range(0, n, nb):
        yield n0, min(n, n0 + nb)


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
        Preferred bound on the column matrix of one batch tile.

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
    dtype = xp.result_type(x.dtype, w.dtype)
    o = out_shape(x.shape[2:], kernel, stride, dilation)
    device = x.device
    if n * f * math.prod(o) == 0:
        return xp.zeros((n, f) + o, dtype=dtype, device=device)
    x, w = xp.astype(x, dtype, copy=False), xp.astype(w, dtype, copy=False)
    ck = cg * math.prod(kernel)
    per_sample = ck * math.prod(o) * numpy_dtype(dtype).itemsize
    parts = []
    for n0, n1 in _batch_tiles(n, per_sample, workspace_bytes):
        groups_out = []
        for g in range(groups):
            wm = xp.reshape(w[g * fg:(g + 1) * fg, ...], (fg, ck))
            cols = _columns(xp, x[n0:n1, g * cg:(g + 1) * cg, ...], kernel, stride, dilation, o)
            groups_out.append(_from_columns(xp, xp.matmul(wm, cols), n1 - n0, o))
        parts.append(groups_out[0] if groups == 1 else xp.concat(groups_out, axis=1))
    y = parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)
    if b is not None:
        y = y + xp.reshape(xp.astype(b, dtype, copy=False), (1, f) + (1,) * nd)
    return y


def conv_backward(dy: Any, x: Any, w: Any, stride: Sequence[int], dilation: Sequence[int],
                  groups: int = 1, need_dx: bool = True, need_dw: bool = True,
                  workspace_bytes: int = WORKSPACE_BYTES, need_db: bool | None = None
                  ) -> tuple[Any | None, Any | None, Any]:
    """Gradients of :func:`conv_forward`: ``(dx, dw, db)``, ``dx`` over the whole input ``x``.

    ``db`` is always given, whatever ``need_db`` (the torch kernels' flag): one sum.

    Per batch tile: ``dw += dy @ cols(x)^T`` and ``dx`` += col2im of ``w^T @ dy``.
    ``dx`` (``dw``) is None unless ``need_dx`` (``need_dw``).
    """
    xp = array_namespace(x)
    nd = w.ndim - 2
    n, c = x.shape[:2]
    f = w.shape[0]
    cg, fg = c // groups, f // groups
    kernel, stride, dilation = tuple(w.shape[2:]), tuple(stride), tuple(dilation)
    dtype = xp.result_type(dy.dtype, x.dtype, w.dtype)
    device = x.device
    o = tuple(dy.shape[2:])
    dx = xp.zeros(x.shape, dtype=dtype, device=device) if need_dx else None
    dw = xp.zeros(w.shape, dtype=dtype, device=device) if need_dw else None
    if n * f * math.prod(o) == 0:
        return dx, dw, xp.zeros(f, dtype=dtype, device=device)
    x, w, dy = (xp.astype(a, dtype, copy=False) for a in (x, w, dy))
    db = xp.sum(dy, axis=(0, *range(2, 2 + nd)))
    if not (need_dx or need_dw):
        return dx, dw, db
    ck = cg * math.prod(kernel)
    per_sample = ck * math.prod(o) * numpy_dtype(dtype).itemsize
    slices = list(_offset_slices(kernel, stride, dilation, o))
    for g in range(groups):
        gf, gc = slice(g * fg, (g + 1) * fg), slice(g * cg, (g + 1) * cg)
        wm = xp.reshape(w[gf, ...], (fg, ck))
        acc = None
        for n0, n1 in _batch_tiles(n, per_sample, workspace_bytes):
            dyt = _as_columns(xp, dy[n0:n1, gf, ...])  # (fg, tile)
            if need_dw:
                cols = _columns(xp, x[n0:n1, gc, ...], kernel, stride, dilation, o)
                part = xp.matmul(dyt, xp.matrix_transpose(cols))
                acc = part if acc is None else acc + part
            if need_dx:
                dcol = xp.reshape(xp.matmul(xp.matrix_transpose(wm), dyt),
                                  (cg, len(slices), n1 - n0) + o)
                for k, sl in enumerate(slices):
                    where = (slice(n0, n1), gc) + sl[2:]
                    dx[where] = dx[where] + xp.permute_dims(dcol[:, k, ...],
                                                            (1, 0, *range(2, 2 + nd)))
        if need_dw:
            dw[gf, ...] = xp.reshape(acc, (fg, cg) + kernel)
    return dx, dw, db


def _arg_dtype(xp: Any, kernel: Sequence[int]) -> Any:
    """One byte per argmax where every window offset fits in it."""
    return xp.uint8 if math.prod(kernel) <= 256 else xp.int64


def pool_forward(x: Any, kernel: Sequence[int], stride: Sequence[int],
                 dilation: Sequence[int], op: str) -> tuple[Any, Any | None]:
    """Max or average over every window; for max also the flat argmax within each window."""
    xp = array_namespace(x)
    o = out_shape(x.shape[2:], kernel, stride, dilation)
    shape = tuple(x.shape[:2]) + o
    if math.prod(shape) == 0:
        return xp.zeros(shape, dtype=x.dtype, device=x.device), \
            (None if op == "avg" else xp.zeros(shape, dtype=_arg_dtype(xp, kernel),
                                               device=x.device))
    stacked = xp.stack([x[s] for s in _offset_slices(kernel, stride, dilation, o)], axis=-1)
    if op == "avg":
        return xp.mean(stacked, axis=-1), None
    return xp.max(stacked, axis=-1), xp.astype(xp.argmax(stacked, axis=-1),
                                               _arg_dtype(xp, kernel))


def pool_backward(dy: Any, x_shape: Sequence[int], kernel: Sequence[int],
                  stride: Sequence[int], dilation: Sequence[int], op: str,
                  arg: Any | None = None) -> Any:
    """Gradient of :func:`pool_forward` over the whole (padded) input."""
    xp = array_namespace(dy)
    dx = xp.zeros(tuple(x_shape), dtype=dy.dtype, device=dy.device)
    o = tuple(dy.shape[2:])
    if math.prod(dy.shape) == 0:
        return dx
    part = dy / math.prod(kernel) if op == "avg" else None
    zero = xp.zeros((), dtype=dy.dtype, device=dy.device)
    for flat_k, sl in enumerate(_offset_slices(kernel, stride, dilation, o)):
        add = part if op == "avg" else xp.where(arg == flat_k, dy, zero)
        dx[sl] = dx[sl] + add
    return dx
