"""Local N-D convolution and pooling kernels for NumPy arrays (channel-first).

Every kernel works on an already padded ("valid") input of shape
``(N, C, *S)``; the distributed layers obtain that input from the halo
exchange, which also applies the padding at the global edges (max pooling
may pad on its own instead, where no halo is needed). This module is
the seam where other array backends plug in: a kernel module of the same
functions (e.g. for CuPy) can replace it.

Convolutions are im2col plus one GEMM per group and tile, in the input's
dtype (float32 stays float32). A tile is a set of output positions whose
column buffer is about ``TILE_BYTES`` (it is written and read back while in
cache): several whole samples when samples are small, otherwise a range of
rows of the first spatial dimension of one sample, never more than
``workspace_bytes``, so the workspace is bounded whatever the sample size.
A call takes all its scratch (columns, partial products, weight copies) from
its thread's arena, one buffer kept from call to call at the size of the
largest call's need, and gives it back whole when it ends.
GEMMs write straight into the output where its layout allows (one sample's
rows are a strided matrix), the bias and its gradient ride on a row of ones
in the column buffer, unit-stride 1x1 convolutions are plain GEMMs without
im2col, and the backward pass picks between col2im and a correlation of the
padded output gradient by a cost model (see :func:`conv_backward`).

Threads: with :func:`set_num_threads` above one, convolutions split the
batch into that many parts run by a pool of threads at once (NumPy's copies
and BLAS release the GIL; each thread has its own scratch arena, and the
weight-gradient parts are summed). Give BLAS one thread then
(``threadpoolctl`` or :func:`disttensor.limit_blas_threads`), or the two
pools compete for the cores.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numpy.lib.stride_tricks import as_strided

from disttensor.backend import empty, zeros

__all__ = [
    "out_shape",
    "windows",
    "conv_forward",
    "conv_backward",
    "pool_forward",
    "pool_backward",
    "release_workspace",
    "set_num_threads",
    "get_num_threads",
    "run_split",
    "WORKSPACE_BYTES",
    "ACC_CHUNK_BYTES",
]

WORKSPACE_BYTES = 64 * 2**20
"""Upper bound on one im2col buffer (bytes); a tile shrinks to fit it."""
TILE_BYTES = 4 * 2**20
"""Preferred im2col tile size (bytes): written and read back while in cache."""
MIN_TILE_COLS = 512
"""Fewest output positions per tile (short GEMMs are inefficient)."""
DW_DIRECT_FILTERS = 512
"""With fewer filters per group the weight-gradient GEMM runs transposed."""


_scratch = threading.local()
_ALIGN = 64  # bytes: every scratch array starts on a cache line


class _Arena:
    """One thread's scratch memory: a byte buffer that a kernel call takes its arrays from
    in turn (a bump allocator), given back as a whole when the call ends.

    The buffer grows to the most one call has taken (what a call takes beyond it
    comes from NumPy for that call alone, and the next call finds the buffer
    grown), so it holds the largest call's scratch, not the sum of every
    kind of buffer's largest size over all calls.
    """

    __slots__ = ("buf", "used", "need")

    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)
        self.used = 0
        self.need = 0

    def begin(self) -> int:
        """Start a call: every earlier array is free; grow the buffer to the largest need."""
        if self.need > self.buf.size:
            self.buf = np.empty(self.need, np.uint8)
        self.used = 0
        return 0

    def take(self, size: int, dtype: np.dtype) -> np.ndarray:
        start = -(-self.used // _ALIGN) * _ALIGN
        stop = start + size * dtype.itemsize
        self.used = stop
        self.need = max(self.need, stop)
        if stop > self.buf.size and start == 0:  # nothing taken yet: grow the buffer now
            self.buf = np.empty(stop, np.uint8)
        if stop <= self.buf.size:
            return self.buf[start:stop].view(dtype)
        return np.empty(size, dtype)


def _arena() -> _Arena:
    arena = getattr(_scratch, "arena", None)
    if arena is None:
        arena = _scratch.arena = _Arena()
    return arena


def _buffer(name: str, shape: int | tuple[int, ...], dtype) -> np.ndarray:
    """Scratch array of ``shape`` (``name`` says what for) from this thread's arena, valid
    until the kernel call ends (the next :meth:`_Arena.begin`); contents undefined.

    Fresh large arrays cost page faults on first touch (about as much as filling
    them here), and the im2col and GEMM buffers are needed on every call, so the
    arena's memory is kept from call to call.
    """
    size = math.prod(shape) if isinstance(shape, tuple) else shape
    return _arena().take(size, np.dtype(dtype)).reshape(shape)


ACC_CHUNK_BYTES = 2**20
"""Bytes of a weight gradient's partial GEMM result at once: a weight-sized gradient sums
its tiles' products through a temporary of this size, not of the weight's."""


def _matmul_add(acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """``acc += a @ b`` in pieces of ``a``'s rows, through a scratch of at most
    :data:`ACC_CHUNK_BYTES` (at least 64 rows, for efficient GEMMs)."""
    rows = max(64, ACC_CHUNK_BYTES // max(acc.strides[0], 1))
    arena = _arena()
    mark = arena.used
    tmp = _buffer("acc_tmp", (min(rows, acc.shape[0]), acc.shape[1]), acc.dtype)
    for i in range(0, acc.shape[0], rows):
        j = min(acc.shape[0], i + rows)
        acc[i:j] += np.matmul(a[i:j], b, out=tmp[:j - i])
    arena.used = mark  # free again for the next tile's


def _empty(shape: tuple[int, ...], dtype: object) -> np.ndarray:
    """An output or gradient block (from the active block cache where there is one)."""
    return empty(np, shape, dtype)


def _zeros(shape: tuple[int, ...], dtype: object) -> np.ndarray:
    """As :func:`_empty`, zeroed."""
    return zeros(np, shape, dtype)

_threads = {"n": 1, "pool": None}


def set_num_threads(n: int) -> None:
    """Run each convolution on ``n`` threads (parts of the batch); 1 (the default): serial.

    Raises
    ------
    ValueError
        If ``n`` is not a positive integer.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of threads must be a positive integer, got {n!r}")
    pool = _threads["pool"]
    if pool is not None and n != _threads["n"]:
        pool.shutdown(wait=True)
        pool = None
    if pool is None and n > 1:
        pool = ThreadPoolExecutor(n, thread_name_prefix="disttensor-kernel")
    _threads["n"], _threads["pool"] = n, pool


def get_num_threads() -> int:
    """The number of threads convolutions use (see :func:`set_num_threads`)."""
    return _threads["n"]


def _batch_parts(n: int) -> list[tuple[int, int]]:
    """Sample ranges of the parts the pool runs (one part when serial or N is 1)."""
    parts = min(n, _threads["n"])
    bounds = [n * i // parts for i in range(parts + 1)] if parts > 1 else [0, n]
    return list(zip(bounds, bounds[1:]))


def run_split(fn: Callable[[int, int], object], n: int, grain: int = 1) -> list:
    """``fn(a, b)`` over contiguous parts of ``range(n)``, one per thread of the kernels'
    pool (:func:`set_num_threads`), on the pool when there are several; results in order.

    Every part but the last is a multiple of ``grain`` long, and there are no
    more parts than grains. ``fn`` gains only where it releases the GIL most
    of the time (NumPy's element-wise functions on arrays of some 10^5
    elements do; on a few 10^4 the Python between calls serialises them).
    """
    grains = -(-int(n) // max(int(grain), 1))
    parts = max(min(_threads["n"], grains), 1)
    bounds = [min(int(n), grain * (grains * i // parts)) for i in range(parts + 1)]
    return _run_parts(fn, list(zip(bounds, bounds[1:])))


def _run_parts(fn: Callable[[int, int], object], parts: list[tuple[int, int]]) -> list:
    """``fn(a, b)`` for every part, on the pool when there are several; results in order."""
    if len(parts) == 1:
        return [fn(*parts[0])]
    futures = [_threads["pool"].submit(fn, a, b) for a, b in parts]
    return [f.result() for f in futures]


def release_workspace() -> None:
    """Free the scratch memory this thread's convolutions keep between calls."""
    _scratch.arena = None


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


def _matrix(a: np.ndarray) -> np.ndarray | None:
    """``a`` as a 2-D ``(a.shape[0], rest)`` view with unit stride along ``rest``, or None.

    The result is a valid BLAS operand (or output) without a copy: the leading
    dimension is ``a.strides[0]``.
    """
    expected = a.itemsize
    for n, s in zip(reversed(a.shape[1:]), reversed(a.strides[1:])):
        if n != 1 and s != expected:
            return None
        expected *= n
    return as_strided(a, (a.shape[0], math.prod(a.shape[1:])), (a.strides[0], a.itemsize))


def _plan(n: int, o: Sequence[int], rows: int, itemsize: int, workspace: int
          ) -> tuple[int, int]:
    """Tile of the output columns ``(n, *o)``: ``(samples, rows of o[0])`` per tile.

    A tile holds about ``TILE_BYTES`` of columns (cache resident), at least
    ``MIN_TILE_COLS`` columns (efficient GEMMs) and at most ``workspace`` bytes
    (unless one output row alone is larger). Small samples are batched whole;
    large ones are split along their first spatial dimension.
    """
    per_col = rows * itemsize
    cols = max(1, min(workspace // per_col, max(MIN_TILE_COLS, TILE_BYTES // per_col)))
    p, rest = math.prod(o), math.prod(o[1:])
    if p <= cols:
        return min(n, cols // p), o[0]
    return 1, max(1, min(o[0], cols // rest))


def _tiles(n: int, rows: int, nb: int, t: int):
    for n0 in range(0, n, nb):
        for r0 in range(0, rows, t):
            yield n0, min(n, n0 + nb), r0, min(rows, r0 + t)


def _im2col(win: np.ndarray, dst: np.ndarray) -> None:
    """Fill the contiguous ``dst`` of shape ``(C*prod(K), nb*prod(O))`` from the windows
    ``win`` of shape ``(nb, C, *O, *K)`` (see :func:`windows`); rows ordered ``(c, *k)``,
    columns ``(n, *o)``."""
    nd = (win.ndim - 2) // 2
    view = win.transpose(1, *range(2 + nd, 2 + 2 * nd), 0, *range(2, 2 + nd))
    np.copyto(dst.reshape(view.shape), view)


def _pointwise(kernel: Sequence[int], stride: Sequence[int], o: Sequence[int]) -> bool:
    """1x1 convolutions with unit stride on large enough samples run as plain GEMMs."""
    return all(k == 1 for k in kernel) and all(s == 1 for s in stride) \
        and math.prod(o) >= MIN_TILE_COLS


def _sample_matrix(a: np.ndarray) -> np.ndarray:
    m = _matrix(a)
    return m if m is not None else np.ascontiguousarray(a).reshape(a.shape[0], -1)


def conv_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                 stride: Sequence[int], dilation: Sequence[int], groups: int = 1,
                 workspace_bytes: int = WORKSPACE_BYTES) -> np.ndarray:
    """Valid N-D cross-correlation: ``y[n, f, o] = sum_{c,k} w[f, c, k] x[n, c, s*o + d*k] + b[f]``.

    im2col of one cache-sized tile of output positions at a time, then one GEMM
    ``(F/g, C/g*prod(K)+1) @ (C/g*prod(K)+1, tile)`` whose extra row of ones adds the
    bias; for a tile within one sample the GEMM writes straight into ``y``.

    Parameters
    ----------
    x : (N, C, *S) array
    w : (F, C // groups, *K) array
    b : (F,) array or None
    """
    n = x.shape[0]
    f = w.shape[0]
    kernel, stride, dilation = tuple(w.shape[2:]), tuple(stride), tuple(dilation)
    dtype = np.result_type(x, w)
    o = out_shape(x.shape[2:], kernel, stride, dilation)
    y = _empty((n, f) + o, dtype)
    if y.size == 0:
        return y
    _run_parts(lambda a, e: _conv_forward_into(x[a:e], w, b, stride, dilation, groups,
                                               workspace_bytes, y[a:e]), _batch_parts(n))
    return y


def _conv_forward_into(x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                       stride: Sequence[int], dilation: Sequence[int], groups: int,
                       workspace_bytes: int, y: np.ndarray) -> None:
    """:func:`conv_forward` of ``x`` written into ``y`` (in this thread)."""
    nd = w.ndim - 2
    n, c = x.shape[:2]
    f = w.shape[0]
    cg, fg = c // groups, f // groups
    kernel = tuple(w.shape[2:])
    dtype = y.dtype
    o = tuple(y.shape[2:])
    if _pointwise(kernel, stride, o):
        for g in range(groups):
            wm = w[g * fg:(g + 1) * fg].reshape(fg, cg).astype(dtype, copy=False)
            for i in range(n):
                xm = _sample_matrix(x[i, g * cg:(g + 1) * cg].astype(dtype, copy=False))
                np.matmul(wm, xm, out=_matrix(y[i, g * fg:(g + 1) * fg]))
        if b is not None:
            y += b.reshape((1, f) + (1,) * nd)
        return
    ck = cg * math.prod(kernel)
    rows = ck + (b is not None)
    rest = math.prod(o[1:])
    nb, t = _plan(n, o, rows, dtype.itemsize, workspace_bytes)
    _arena().begin()
    ws = _buffer("cols", rows * nb * t * rest, dtype)
    tmp = _buffer("out", fg * nb * t * rest, dtype) if nb > 1 else None
    wext = _buffer("wmat", (fg, rows), dtype) if b is not None else None
    for g in range(groups):
        if b is None:  # the weights themselves (a view), in the output's dtype
            wext = w[g * fg:(g + 1) * fg].reshape(fg, ck).astype(dtype, copy=False)
        else:  # with the bias as their last column (the columns' row of ones)
            wext[:, :ck] = w[g * fg:(g + 1) * fg].reshape(fg, ck)
            wext[:, ck] = b[g * fg:(g + 1) * fg]
        win = windows(x[:, g * cg:(g + 1) * cg], kernel, stride, dilation)
        for n0, n1, r0, r1 in _tiles(n, o[0], nb, t):
            m = (n1 - n0) * (r1 - r0) * rest
            cols = ws[:rows * m].reshape(rows, m)
            _im2col(win[n0:n1, :, r0:r1], cols[:ck])
            if b is not None:
                cols[ck] = 1
            if n1 - n0 == 1:
                np.matmul(wext, cols, out=_matrix(y[n0, g * fg:(g + 1) * fg, r0:r1]))
            else:
                res = np.matmul(wext, cols, out=tmp[:fg * m].reshape(fg, m))
                y[n0:n1, g * fg:(g + 1) * fg] = res.reshape((fg, n1 - n0) + o).swapaxes(0, 1)


def conv_backward(dy: np.ndarray, x: np.ndarray, w: np.ndarray, stride: Sequence[int],
                  dilation: Sequence[int], groups: int = 1, need_dx: bool = True,
                  need_dw: bool = True, workspace_bytes: int = WORKSPACE_BYTES,
                  need_db: bool | None = None
                  ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
    """Gradients of :func:`conv_forward`: ``(dx, dw, db)`` (dx over the whole input ``x``).

    ``db`` is always given, whatever ``need_db`` (the torch kernels' flag): it is a row
    of the weight gradient's GEMM, or one sum.

    ``dw`` and ``db``: per tile of output positions one GEMM of ``dy`` with the
    im2col of ``x`` and its row of ones. ``dx``: either ``w^T dy`` per tile, added
    into the windows of ``dx`` kernel offset by kernel offset (col2im; with
    strides through a phase-split buffer), or, for unit strides, the valid
    correlation of the zero-padded ``dy`` with the flipped, channel-transposed
    kernel (im2col of ``dy`` plus GEMM, written straight into ``dx``), whichever
    a cost model (GEMM flops plus copied or added elements) finds cheaper. In
    the second case the im2col of padded ``dy`` also gives ``dw`` (a GEMM with
    ``x`` itself over the input positions) when that is cheaper than an im2col
    of ``x``.
    """
    n = x.shape[0]
    dtype = np.result_type(dy, x, w)
    parts = _batch_parts(n)
    if len(parts) == 1:
        return _conv_backward_part(dy, x, w, stride, dilation, groups, need_dx, need_dw,
                                   workspace_bytes)
    dx = _empty(x.shape, dtype) if need_dx else None

    def part(a: int, e: int):
        return _conv_backward_part(dy[a:e], x[a:e], w, stride, dilation, groups, need_dx,
                                   need_dw, workspace_bytes, None if dx is None else dx[a:e])

    results = _run_parts(part, parts)
    db = results[0][2]
    dw = results[0][1]
    for _, dw_i, db_i in results[1:]:
        db += db_i
        if need_dw:
            dw += dw_i
    return dx, dw, db


def _conv_backward_part(dy: np.ndarray, x: np.ndarray, w: np.ndarray, stride: Sequence[int],
                        dilation: Sequence[int], groups: int, need_dx: bool, need_dw: bool,
                        workspace_bytes: int, dx_out: np.ndarray | None = None
                        ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
    """:func:`conv_backward` in this thread; ``dx`` written into ``dx_out`` when given."""
    nd = w.ndim - 2
    n, c = x.shape[:2]
    f = w.shape[0]
    cg, fg = c // groups, f // groups
    kernel, stride, dilation = tuple(w.shape[2:]), tuple(stride), tuple(dilation)
    dtype = np.result_type(dy, x, w)
    o = tuple(dy.shape[2:])
    transposed_conv = _dx_by_transposed_conv(x.shape[2:], o, cg, fg, stride)
    # with dx from the im2col of padded dy, that im2col may give dw too (GEMM with x over
    # the input positions, no im2col of x)
    dw_from_dy = need_dx and need_dw and transposed_conv and \
        _dw_from_dy(x.shape[2:], o, cg, fg) and not _pointwise(kernel, stride, o)
    dx = None
    if need_dx:
        if dx_out is None:
            dx = (_empty if transposed_conv and dy.size else _zeros)(x.shape, dtype)
        else:
            dx = dx_out
            if not (transposed_conv and dy.size):
                dx[...] = 0
    dw = np.zeros(w.shape, dtype=dtype) if need_dw else None
    db = np.zeros(f, dtype=dtype)
    if dy.size == 0:
        return dx, dw, db
    if not need_dw or dw_from_dy:
        db[:] = dy.sum(axis=(0, *range(2, 2 + nd)), dtype=dtype)
    if _pointwise(kernel, stride, o):
        for g in range(groups):
            gf, gc = slice(g * fg, (g + 1) * fg), slice(g * cg, (g + 1) * cg)
            wm = w[gf].reshape(fg, cg).astype(dtype, copy=False)
            acc = tmp = None
            if need_dw:
                acc = np.zeros((cg, fg), dtype)
                tmp = np.empty_like(acc)
            for i in range(n):
                dym = _sample_matrix(dy[i, gf].astype(dtype, copy=False))
                if need_dw:
                    xm = _sample_matrix(x[i, gc].astype(dtype, copy=False))
                    acc += np.matmul(xm, dym.T, out=tmp)
                if need_dx:
                    np.matmul(wm.T, dym, out=_matrix(dx[i, gc]))
            if need_dw:
                dw[gf] = acc.T.reshape(dw[gf].shape)
        if need_dw:
            db[:] = dy.sum(axis=(0, *range(2, 2 + nd)), dtype=dtype)
        return dx, dw, db
    ck = cg * math.prod(kernel)
    rest = math.prod(o[1:])
    arena = _arena()
    mark = arena.begin()
    if (need_dw and not dw_from_dy) or (need_dx and not transposed_conv):
        rows = ck + 1
        nb, t = _plan(n, o, rows, dtype.itemsize, workspace_bytes)
        m_max = nb * t * rest
        ws = _buffer("cols", rows * m_max, dtype) if need_dw else None
        dyt_buf = _buffer("dyt", fg * m_max, dtype) if nb > 1 else None
        dcol_buf = _buffer("dcol", ck * m_max, dtype) \
            if need_dx and not transposed_conv else None
        phase_ws = None
        if need_dx and not transposed_conv and any(v != 1 for v in stride):
            phase_ws = _buffer("phase", math.prod(
                _phase_shape(nb, cg, t, x.shape[2:], kernel, stride, dilation)), dtype)
        # dw and db (the last column): GEMMs with few filters run faster transposed,
        # (C/g*prod(K)+1, tile) @ (tile, F/g), and then dw^T needs a (blocked) transpose
        dw_t = fg < DW_DIRECT_FILTERS
        acc_shape = (rows, fg) if dw_t else (fg, rows)
        acc = _buffer("acc", acc_shape, dtype) if need_dw else None
        for g in range(groups):
            gf, gc = slice(g * fg, (g + 1) * fg), slice(g * cg, (g + 1) * cg)
            wmat = w[gf].reshape(fg, ck).astype(dtype, copy=False)
            win = windows(x[:, gc], kernel, stride, dilation)
            first = True
            for n0, n1, r0, r1 in _tiles(n, o[0], nb, t):
                m = (n1 - n0) * (r1 - r0) * rest
                if n1 - n0 == 1:
                    dyt = _sample_matrix(dy[n0, gf, r0:r1].astype(dtype, copy=False))
                else:
                    dyt = dyt_buf[:fg * m].reshape(fg, m)
                    dyt.reshape((fg, n1 - n0) + o)[...] = dy[n0:n1, gf].swapaxes(0, 1)
                if need_dw:
                    cols = ws[:rows * m].reshape(rows, m)
                    _im2col(win[n0:n1, :, r0:r1], cols[:ck])
                    cols[ck] = 1
                    a, bt = (cols, dyt.T) if dw_t else (dyt, cols.T)
                    if first:
                        np.matmul(a, bt, out=acc)
                    else:
                        _matmul_add(acc, a, bt)
                    first = False
                if need_dx and not transposed_conv:
                    dcol = np.matmul(wmat.T, dyt, out=dcol_buf[:ck * m].reshape(ck, m))
                    _col2im(dx[n0:n1, gc], dcol, r0, r1, kernel, stride, dilation, phase_ws)
            if need_dw:
                if dw_t:
                    _transpose_into(dw[gf].reshape(fg, ck), acc[:ck])
                    db[gf] = acc[ck]
                else:
                    dw[gf] = acc[:, :ck].reshape((fg, cg) + kernel)
                    db[gf] = acc[:, ck]
    if need_dx and transposed_conv:
        arena.used = mark  # the scratch above is free again
        _dx_transposed(dy, w, dx, groups, dilation, workspace_bytes,
                       x if dw_from_dy else None, dw)
    return dx, dw, db


def _transpose_into(out: np.ndarray, a: np.ndarray, block: int = 32) -> None:
    """``out[...] = a.T`` for 2-D arrays, in cache-sized blocks of ``a``'s rows."""
    for i in range(0, a.shape[0], block):
        out[:, i:i + block] = a[i:i + block].T


# Cost of copying / adding one element in an im2col / col2im pass, in GEMM flops
# (measured: about 20 and 64 with one OpenBLAS thread).
COPY_FLOPS = 20
ADD_FLOPS = 64


def _dx_by_transposed_conv(s: Sequence[int], o: Sequence[int], cg: int, fg: int,
                           stride: Sequence[int]) -> bool:
    """Whether dx is cheaper as a correlation of padded dy (GEMM over the input positions,
    im2col of dy) than as col2im (GEMM over the output positions, adding into dx)."""
    if any(v != 1 for v in stride):
        return False
    gemm = 2 * cg * fg
    return math.prod(s) * (gemm + COPY_FLOPS * fg) <= math.prod(o) * (gemm + ADD_FLOPS * cg)


def _dw_from_dy(s: Sequence[int], o: Sequence[int], cg: int, fg: int) -> bool:
    """Whether dw costs less as x @ im2col(padded dy)^T over the input positions than as
    dy @ im2col(x)^T over the output positions (which needs its own im2col)."""
    gemm = 2 * cg * fg
    return math.prod(s) * gemm <= math.prod(o) * (gemm + COPY_FLOPS * cg)


def _phase_shape(nb: int, c: int, rows: int, s_in: Sequence[int], kernel: Sequence[int],
                 stride: Sequence[int], dilation: Sequence[int]) -> tuple[int, ...]:
    """Shape of the phase buffer of :func:`_col2im` for ``rows`` output rows."""
    o = (rows,) + out_shape(s_in[1:], kernel[1:], stride[1:], dilation[1:])
    span = [(v - 1) * s + d * (k - 1) + 1 for v, k, s, d in zip(o, kernel, stride, dilation)]
    return (nb, c) + tuple(stride) + tuple(-(-n // s) for n, s in zip(span, stride))


def _col2im(dx: np.ndarray, dcol: np.ndarray, r0: int, r1: int, kernel: Sequence[int],
            stride: Sequence[int], dilation: Sequence[int],
            phase_ws: np.ndarray | None = None) -> None:
    """Add ``dcol`` (``(C*prod(K), nb*rows*prod(O[1:]))``, output rows ``r0:r1``) into the
    windows of ``dx`` of shape ``(nb, C, *S)``, one kernel offset at a time.

    With strides the windows of one offset are strided in ``dx``; the offsets are then
    summed into a phase-split buffer ``buf[n, c, *p, *q] = dx[n, c, s*q + p]`` (holding
    the ``dx`` rows of this tile), where each offset's window is a contiguous block,
    and the buffer is added into ``dx`` once per phase. ``phase_ws`` is a flat
    workspace of at least :func:`_phase_shape` elements.
    """
    nd = len(kernel)
    nb, c = dx.shape[:2]
    o = (r1 - r0,) + out_shape(dx.shape[3:], kernel[1:], stride[1:], dilation[1:])
    d5 = dcol.reshape((c, *kernel, nb) + o)
    if all(s == 1 for s in stride):
        for kk in itertools.product(*(range(k) for k in kernel)):
            idx = [slice(None), slice(None)]
            for i in range(nd):
                start = kk[i] * dilation[i] + (r0 if i == 0 else 0)
                idx.append(slice(start, start + o[i]))
            view = dx[tuple(idx)]
            np.add(view, d5[(slice(None), *kk)].swapaxes(0, 1), out=view)
        return
    shape = _phase_shape(nb, c, r1 - r0, dx.shape[2:], kernel, stride, dilation)
    if phase_ws is None:
        phase_ws = np.empty(math.prod(shape), dx.dtype)
    buf = phase_ws[:math.prod(shape)].reshape(shape)
    buf[...] = 0
    for kk in itertools.product(*(range(k) for k in kernel)):
        dk = [d * k for d, k in zip(dilation, kk)]
        idx = (slice(None), slice(None)) + tuple(v % s for v, s in zip(dk, stride)) + tuple(
            slice(v // s, v // s + n) for v, s, n in zip(dk, stride, o))
        view = buf[idx]
        np.add(view, d5[(slice(None), *kk)].swapaxes(0, 1), out=view)
    span = [(v - 1) * s + d * (k - 1) + 1 for v, k, s, d in zip(o, kernel, stride, dilation)]
    base = [r0 * stride[0]] + [0] * (nd - 1)
    for ph in itertools.product(*(range(s) for s in stride)):
        counts = [-(-(n - p) // s) for n, p, s in zip(span, ph, stride)]
        if min(counts) <= 0:
            continue
        dst = dx[(slice(None), slice(None)) + tuple(
            slice(b + p, b + n, s) for b, p, n, s in zip(base, ph, span, stride))]
        np.add(dst, buf[(slice(None), slice(None)) + ph + tuple(slice(0, n) for n in counts)],
               out=dst)


def _dx_transposed(dy: np.ndarray, w: np.ndarray, dx: np.ndarray, groups: int,
                   dilation: Sequence[int], workspace: int, x: np.ndarray | None = None,
                   dw: np.ndarray | None = None) -> None:
    """``dx`` for unit strides: valid correlation of ``dy`` zero-padded by ``d*(K-1)`` with
    the flipped kernel, channels transposed. Padding is applied per tile of ``dx`` rows
    in a small buffer, so no padded copy of all of ``dy`` is made.

    With ``x``, also ``dw``: the im2col of padded dy at input position i holds
    ``dy[i - d*k]`` in row ``(f, K-1-k)``, so ``dw[f, c, k] = sum_i x[c, i] dy[f, i - d*k]``
    is one GEMM with ``x`` per tile."""
    nd = w.ndim - 2
    n, f = dy.shape[:2]
    c = dx.shape[1]
    cg, fg = c // groups, f // groups
    kernel = tuple(w.shape[2:])
    ones = (1,) * nd
    s = dx.shape[2:]
    o = dy.shape[2:]
    dtype = dx.dtype
    halo = tuple(d * (k - 1) for k, d in zip(kernel, dilation))
    rows = fg * math.prod(kernel)
    rest = math.prod(s[1:])
    nb, t = _plan(n, s, rows, dtype.itemsize, workspace)
    # padded dy of one tile: dx rows a:b need dy rows a-h0 : b (zero outside 0:o0)
    pad = _buffer("pad", (nb, fg, t + halo[0]) + tuple(
        v + 2 * h for v, h in zip(o[1:], halo[1:])), dtype)
    pad[...] = 0
    pwin = windows(pad, kernel, ones, dilation)  # (nb, fg, t, *S[1:], *K)
    inner = tuple(slice(h, h + v) for v, h in zip(o[1:], halo[1:]))
    ws = _buffer("cols", rows * nb * t * rest, dtype)
    tmp = _buffer("out", cg * nb * t * rest, dtype) if nb > 1 else None
    if x is not None:
        acc = _buffer("acc", (rows, cg), dtype)
        xbuf = _buffer("xbuf", cg * nb * t * rest, dtype) if nb > 1 else None
    for g in range(groups):
        gf, gc = slice(g * fg, (g + 1) * fg), slice(g * cg, (g + 1) * cg)
        # w2[c, f, k] = w[f, c, K-1-k] (reversing the flat kernel index flips every axis)
        wflat = w[gf].reshape(fg, cg, -1)
        w2 = _buffer("wmat", (cg, fg, wflat.shape[2]), dtype)
        np.copyto(w2, wflat[:, :, ::-1].swapaxes(0, 1))
        w2 = w2.reshape(cg, rows)
        for n0, n1, a, b in _tiles(n, s[0], nb, t):
            nt = n1 - n0
            m = nt * (b - a) * rest
            hgt = b - a + halo[0]
            lo, hi = max(0, a - halo[0]), min(o[0], b)  # dy rows present in the tile
            p = pad[:nt, :, :hgt]
            p0 = lo - (a - halo[0])  # first buffer row holding dy data
            p1 = p0 + max(0, hi - lo)
            p[(slice(None), slice(None), slice(0, p0)) + inner] = 0
            p[(slice(None), slice(None), slice(p1, hgt)) + inner] = 0
            if hi > lo:
                p[(slice(None), slice(None), slice(p0, p1)) + inner] = dy[n0:n1, gf, lo:hi]
            cols = ws[:rows * m].reshape(rows, m)
            _im2col(pwin[:nt, :, :b - a], cols)
            if nt == 1:
                np.matmul(w2, cols, out=_matrix(dx[n0, gc, a:b]))
            else:
                res = np.matmul(w2, cols, out=tmp[:cg * m].reshape(cg, m))
                dx[n0:n1, gc] = res.reshape((cg, nt) + tuple(s)).swapaxes(0, 1)
            if x is not None:
                if nt == 1:
                    xm = _sample_matrix(x[n0, gc, a:b].astype(dtype, copy=False))
                else:
                    xm = xbuf[:cg * m].reshape(cg, m)
                    xm.reshape((cg, nt) + tuple(s))[...] = x[n0:n1, gc].swapaxes(0, 1)
                if n0 == 0 and a == 0:
                    np.matmul(cols, xm.T, out=acc)
                else:
                    _matmul_add(acc, cols, xm.T)
        if x is not None:
            # acc[(f, K-1-k), c] -> dw[f, c, k]
            kf = math.prod(kernel)
            dw[gf] = acc.reshape(fg, kf, cg)[:, ::-1].swapaxes(1, 2).reshape(dw[gf].shape)


def _offset_views(a: np.ndarray, kernel: Sequence[int], stride: Sequence[int],
                  dilation: Sequence[int], o: Sequence[int]):
    """``(flat offset, view of a)``: for each kernel offset, the elements it meets at every
    output position (a strided view of ``a`` of the output's shape)."""
    for flat_k, kk in enumerate(itertools.product(*(range(k) for k in kernel))):
        idx = [slice(None), slice(None)]
        for i in range(len(kernel)):
            start = kk[i] * dilation[i]
            idx.append(slice(start, start + stride[i] * (o[i] - 1) + 1, stride[i]))
        yield flat_k, a[tuple(idx)]


def _arg_dtype(kernel: Sequence[int]) -> np.dtype:
    return np.dtype(np.uint8) if math.prod(kernel) <= 256 else np.dtype(np.intp)


def pool_forward(x: np.ndarray, kernel: Sequence[int], stride: Sequence[int],
                 dilation: Sequence[int], op: str, padding: Sequence[int] | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """Max or average over every window; for max also where each window's maximum is.

    A running maximum (``np.maximum``) or sum over the kernel offsets, each a
    strided view of ``x``. For max, each offset whose element is strictly
    greater than the running maximum (the first maximum of a window wins, as
    in PyTorch) raises the window's offset, one byte when the window has at
    most 256 elements (offsets only grow along the scan, so the update is a
    maximum, not a masked copy); the offsets become flat indices into ``x``
    (``np.intp``, what :func:`pool_backward` takes), as PyTorch keeps its
    argmax. With :func:`set_num_threads` above one, parts of the batch run on
    the pool.

    Max pooling also takes ``padding`` (both sides of each spatial dimension,
    -inf): the windows then run on a padded copy, and the indices point into
    ``x`` itself, so that the gradient needs no padded block. A window whose
    maximum is -inf or NaN takes PyTorch's index (its last NaN, else its first
    element inside ``x``), never one in the padding.
    """
    pads = tuple(padding) if padding is not None else (0,) * len(kernel)
    if any(pads) and op != "max":
        raise ValueError("the NumPy kernels pad max pooling only (a halo pads the others)")
    xin = x
    if any(pads):  # a padded copy to run the windows on
        x = _empty(tuple(x.shape[:2]) + tuple(n + 2 * p for n, p in zip(x.shape[2:], pads)),
                   x.dtype)
        x.fill(-np.inf)
        x[(slice(None), slice(None)) + tuple(slice(p, p + n) for p, n in
                                             zip(pads, xin.shape[2:]))] = xin
    o = out_shape(x.shape[2:], kernel, stride, dilation)
    shape = tuple(x.shape[:2]) + o
    y = _empty(shape, x.dtype)
    idx = None if op == "avg" else _empty(shape, np.intp)
    if y.size == 0:
        return y, idx

    def part(a: int, e: int) -> None:
        xs, ys = x[a:e], y[a:e]
        views = _offset_views(xs, kernel, stride, dilation, o)
        np.copyto(ys, next(views)[1])
        if op == "avg":
            for _, view in views:
                np.add(ys, view, out=ys)
            ys *= x.dtype.type(1.0 / math.prod(kernel))
            return
        adt = _arg_dtype(kernel)
        arg, step = np.zeros(ys.shape, adt), np.empty(ys.shape, adt)
        gt = np.empty(ys.shape, bool)
        for flat_k, view in views:
            np.greater(view, ys, out=gt)
            np.maximum(ys, view, out=ys)
            np.multiply(gt, adt.type(flat_k), out=step)
            np.maximum(arg, step, out=arg)
        _argmax_index(xin.shape, kernel, stride, dilation, pads, arg, a, idx[a:e])
        np.greater(ys, -np.inf, out=gt)  # False where -inf or NaN (maybe in the padding)
        if not gt.all():
            _fix_argmax(xin, kernel, stride, dilation, pads, a, np.argwhere(~gt), idx[a:e])

    _run_parts(part, _batch_parts(x.shape[0]))
    return y, idx


def pool_backward(dy: np.ndarray, x_shape: Sequence[int], kernel: Sequence[int],
                  stride: Sequence[int], dilation: Sequence[int], op: str,
                  arg: np.ndarray | None = None, padding: Sequence[int] | None = None
                  ) -> np.ndarray:
    """Gradient of :func:`pool_forward` over its whole input ``x`` (of ``x_shape``).

    Max: the flat input index of each output's maximum (``arg``, as
    :func:`pool_forward` gives it) receives its ``dy`` in one scatter-add
    (``np.add.at``, which sums the outputs whose overlapping windows share a
    maximum), one pass over the outputs as PyTorch's kernel makes. Average:
    per kernel offset, ``dy`` divided by the window's size is added into that
    offset's strided view of ``dx``; parts of the batch run on the kernels'
    pool. ``padding`` is that of the forward call (max only: its indices
    already point into ``x``).
    """
    if padding is not None and any(padding) and op != "max":
        raise ValueError("the NumPy kernels pad max pooling only (a halo pads the others)")
    dx = _zeros(x_shape, dy.dtype)
    o = dy.shape[2:]
    if dy.size == 0:
        return dx
    if op == "max":
        np.add.at(dx.reshape(-1), arg.reshape(-1), dy.reshape(-1))
        return dx

    def part(a: int, e: int) -> None:
        dys, dxs = dy[a:e], dx[a:e]
        g = dys * dy.dtype.type(1.0 / math.prod(kernel))
        for _, view in _offset_views(dxs, kernel, stride, dilation, o):
            np.add(view, g, out=view)

    _run_parts(part, _batch_parts(dy.shape[0]))
    return dx


INDEX_CHUNK_BYTES = 2**18
"""Bytes of flat input indices that max pooling's forward makes at once (its only temporary
beyond the running offsets: the rest is written into the kept index array)."""


def _argmax_index(x_shape: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
                  dilation: Sequence[int], pads: Sequence[int], arg: np.ndarray, first: int,
                  out: np.ndarray) -> None:
    """Write into ``out`` the flat index into an input of ``x_shape`` (unpadded: windows
    start ``pads`` before it) of every output's maximum, from its flat offset within the
    window (``arg``, of samples ``first`` on), whole planes of ``INDEX_CHUNK_BYTES`` at a
    time."""
    nd = len(kernel)
    elems = [math.prod(x_shape[i + 1:]) for i in range(len(x_shape))]  # row-major strides
    table = np.zeros(math.prod(kernel), np.intp)  # window offset -> input index offset
    for flat_k, kk in enumerate(itertools.product(*(range(k) for k in kernel))):
        table[flat_k] = sum(kk[i] * dilation[i] * elems[2 + i] for i in range(nd))
    # each window's origin in its plane (an array of the output's spatial shape), and each
    # plane's (sample and channel) first element
    o = arg.shape[2:]
    plane = np.zeros(tuple(o), np.intp)
    for i in range(nd):
        shape = [1] * nd
        shape[i] = o[i]
        plane += ((np.arange(o[i], dtype=np.intp) * stride[i] - pads[i]) * elems[2 + i]
                  ).reshape(shape)
    plane = plane.reshape(-1)
    planes = arg.shape[0] * arg.shape[1]
    arg2, out2 = arg.reshape(planes, -1), out.reshape(planes, -1)
    step = max(1, INDEX_CHUNK_BYTES // max(8 * plane.size, 1))
    p0 = first * arg.shape[1]
    for r0 in range(0, planes, step):
        r1 = min(planes, r0 + step)
        t = np.take(table, arg2[r0:r1])
        t += plane
        np.add(t, (np.arange(p0 + r0, p0 + r1, dtype=np.intp) * elems[1])[:, None],
               out=out2[r0:r1])


def _fix_argmax(x: np.ndarray, kernel: Sequence[int], stride: Sequence[int],
                dilation: Sequence[int], pads: Sequence[int], first: int, where: np.ndarray,
                out: np.ndarray) -> None:
    """PyTorch's index for the windows at ``where`` (rows of ``(n, c, *o)``, samples from
    ``first``) whose maximum is -inf or NaN: the last NaN inside ``x``, else the first
    element inside ``x`` (the padding's -inf ties with an input's and may come first)."""
    spatial = x.shape[2:]
    for n, c, *o in where.tolist():
        best, best_val = None, -np.inf
        for kk in itertools.product(*(range(k) for k in kernel)):
            pos = tuple(oi * s - p + ki * d for oi, s, p, ki, d in
                        zip(o, stride, pads, kk, dilation))
            if not all(0 <= q < m for q, m in zip(pos, spatial)):
                continue
            val = x[(first + n, c) + pos]
            if best is None or val > best_val or np.isnan(val):
                best, best_val = pos, val
        if best is not None:  # (padding of at most half a window: always)
            out[(n, c, *o)] = np.ravel_multi_index((first + n, c) + best, x.shape)
