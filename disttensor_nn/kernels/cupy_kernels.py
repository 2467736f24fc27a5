"""Local convolution and pooling kernels for CuPy arrays (one GPU per rank).

Convolutions go through cuDNN's graph API when the ``nvidia-cudnn-frontend``
package (``import cudnn``) is importable -- CuPy 14 no longer wraps cuDNN --
and otherwise through the generic im2col kernels of
:mod:`~disttensor_nn.kernels.xp_kernels`, whose GEMMs are cuBLAS calls via
``cupy.matmul``. A cuDNN graph is built once per problem (shapes, dtype,
strides, dilation) and kept; a problem cuDNN does not support (or a failure
while building its graph) falls back to im2col for good, with one warning.
Set :data:`use_cudnn` to False (or ``DISTTENSOR_CUDNN=0`` in the environment)
to always use im2col. :data:`calls` counts the convolution calls by path.

cuDNN gets contiguous NCHW (NCDHW) tensors, 1-D convolutions as 2-D ones of
height 1, and no padding: the distributed layers pass the halo-extended,
already padded input. The bias is added (and its gradient summed) by CuPy.
float32 convolutions may use TF32 tensor cores where cuDNN chooses them, as
PyTorch does by default.

Pooling, batch normalisation and the element-wise layers are CuPy array
expressions (CuPy kernels) in the generic code; nothing here touches the host.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from .xp_kernels import WORKSPACE_BYTES as _IM2COL_WORKSPACE_BYTES
from .xp_kernels import conv_backward as _im2col_conv_backward
from .xp_kernels import conv_forward as _im2col_conv_forward
from .xp_kernels import out_shape, pool_backward, pool_forward, windows  # noqa: F401

__all__ = [
    "conv_forward",
    "conv_backward",
    "cudnn_available",
    "use_cudnn",
    "calls",
    "release_workspace",
    "WORKSPACE_BYTES",
]

WORKSPACE_BYTES = _IM2COL_WORKSPACE_BYTES
"""Bound on the im2col buffer of one tile (bytes) on the im2col path."""

use_cudnn: bool = os.environ.get("DISTTENSOR_CUDNN", "1") != "0"
"""Whether convolutions try cuDNN first (when it is importable)."""

calls: Counter = Counter()
"""Convolution calls by path: ``'cudnn'`` and ``'im2col'`` (forward and backward counted apart)."""

_cudnn: Any = None
_cudnn_checked = False
_handles: dict[int, Any] = {}
_graphs: dict[tuple, Any] = {}


def _cupy() -> Any:
    import cupy  # imported on first use: this module loads (for its documentation) without CuPy

    return cupy


def release_workspace() -> None:
    """Return the device memory cached by CuPy's pool, and cuDNN's workspaces, to the GPU.

    Blocks still in use stay; the next kernels allocate afresh.
    """
    _graphs.clear()
    _cupy().get_default_memory_pool().free_all_blocks()


def cudnn_available() -> bool:
    """Whether the cuDNN frontend (``import cudnn``) is importable here."""
    global _cudnn, _cudnn_checked
    if not _cudnn_checked:
        _cudnn_checked = True
        try:
            import cudnn  # optional: imported where the frontend is installed

            _cudnn = cudnn
        except Exception:  # ImportError, or a library that fails to load
            _cudnn = None
    return _cudnn is not None


def _handle() -> Any:
    dev = _cupy().cuda.runtime.getDevice()
    h = _handles.get(dev)
    if h is None:
        h = _handles[dev] = _cudnn.create_handle()
    return h


def _packed(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return strides[::-1]


def _cudnn_types(dtype: np.dtype) -> tuple[Any, Any] | None:
    """(io, compute) cuDNN data types of ``dtype``, or None if cuDNN is not used for it."""
    dt = _cudnn.data_type
    return {np.dtype(np.float32): (dt.FLOAT, dt.FLOAT),
            np.dtype(np.float64): (dt.DOUBLE, dt.DOUBLE),
            np.dtype(np.float16): (dt.HALF, dt.FLOAT)}.get(np.dtype(dtype))


def _build(kind: str, xs: tuple, ws: tuple, ys: tuple, dtype: np.dtype,
           stride: tuple, dilation: tuple) -> Any:
    """A built cuDNN graph for one convolution direction, or None when cuDNN refuses it."""
    cudnn = _cudnn
    io, compute = _cudnn_types(dtype)
    handle = _handle()
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=compute,
                          compute_data_type=compute, handle=handle)
    pad = [0] * len(stride)
    conv = {"padding": pad, "stride": list(stride), "dilation": list(dilation),
            "compute_data_type": compute}

    def tensor(name, shape):
        return graph.tensor(name=name, dim=list(shape), stride=_packed(shape), data_type=io)

    if kind == "fprop":
        a, b = tensor("x", xs), tensor("w", ws)
        out = graph.conv_fprop(image=a, weight=b, **conv)
        shape = ys
    elif kind == "dgrad":
        a, b = tensor("dy", ys), tensor("w", ws)
        out = graph.conv_dgrad(loss=a, filter=b, **conv)
        shape = xs
    else:
        a, b = tensor("x", xs), tensor("dy", ys)
        out = graph.conv_wgrad(image=a, loss=b, **conv)
        shape = ws
    out.set_output(True).set_dim(list(shape)).set_stride(_packed(shape))
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, a, b, out, int(graph.get_workspace_size())


def _run(kind: str, first: Any, second: Any, xs: tuple, ws: tuple, ys: tuple,
         stride: tuple, dilation: tuple) -> Any | None:
    """Run one cuDNN convolution direction; None when cuDNN cannot do it (use im2col)."""
    if not (use_cudnn and cudnn_available()):
        return None
    cupy = _cupy()
    dtype = first.dtype
    if second.dtype != dtype or _cudnn_types(dtype) is None:
        return None
    if len(stride) == 1:  # cuDNN convolves 2-D and 3-D: a 1-D problem is 2-D of height 1
        xs, ws, ys = ((s[:2] + (1,) + s[2:]) for s in (xs, ws, ys))
        stride, dilation = (1,) + stride, (1,) + dilation
    key = (kind, xs, ws, ys, dtype.str, stride, dilation, cupy.cuda.runtime.getDevice())
    entry = _graphs.get(key, ...)
    if entry is ...:
        try:
            entry = _build(kind, xs, ws, ys, dtype, stride, dilation)
        except Exception as exc:  # not supported by this cuDNN / GPU: im2col from now on
            warnings.warn(f"cuDNN {kind} of x{xs} w{ws} {dtype} unavailable, using im2col: "
                          f"{exc}", RuntimeWarning, stacklevel=3)
            entry = None
        _graphs[key] = entry
    if entry is None:
        return None
    graph, ta, tb, tout, ws_bytes = entry
    shape = {"fprop": ys, "dgrad": xs, "wgrad": ws}[kind]
    out = cupy.empty(shape, dtype)
    workspace = cupy.empty(max(ws_bytes, 1), dtype=cupy.uint8)
    handle = _handle()
    _cudnn.set_stream(handle=handle, stream=cupy.cuda.get_current_stream().ptr)
    a = cupy.ascontiguousarray(first).reshape(
        {"fprop": xs, "dgrad": ys, "wgrad": xs}[kind])
    b = cupy.ascontiguousarray(second).reshape(
        {"fprop": ws, "dgrad": ws, "wgrad": ys}[kind])
    try:
        graph.execute({ta: a, tb: b, tout: out}, workspace, handle=handle)
    except Exception as exc:
        warnings.warn(f"cuDNN {kind} of x{xs} w{ws} {dtype} failed, using im2col: {exc}",
                      RuntimeWarning, stacklevel=3)
        _graphs[key] = None
        return None
    return out


def conv_forward(x: Any, w: Any, b: Any | None, stride: Sequence[int],
                 dilation: Sequence[int], groups: int = 1,
                 workspace_bytes: int = WORKSPACE_BYTES) -> Any:
    """Valid N-D cross-correlation (as :func:`disttensor_nn.kernels.numpy_kernels.conv_forward`).

    cuDNN when available for the problem, else im2col and cuBLAS.
    """
    kernel, stride, dilation = tuple(w.shape[2:]), tuple(stride), tuple(dilation)
    o = out_shape(x.shape[2:], kernel, stride, dilation)
    ys = (x.shape[0], w.shape[0]) + o
    y = None
    if math.prod(ys) and x.dtype == w.dtype:
        y = _run("fprop", x, w, tuple(x.shape), tuple(w.shape), ys, stride, dilation)
    if y is None:
        calls["im2col"] += 1
        return _im2col_conv_forward(x, w, b, stride, dilation, groups, workspace_bytes)
    calls["cudnn"] += 1
    y = y.reshape(ys)
    if b is not None:
        y += b.astype(y.dtype, copy=False).reshape((1, -1) + (1,) * len(kernel))
    return y


def conv_backward(dy: Any, x: Any, w: Any, stride: Sequence[int], dilation: Sequence[int],
                  groups: int = 1, need_dx: bool = True, need_dw: bool = True,
                  workspace_bytes: int = WORKSPACE_BYTES, need_db: bool | None = None
                  ) -> tuple[Any | None, Any | None, Any]:
    """Gradients ``(dx, dw, db)`` (as :func:`disttensor_nn.kernels.numpy_kernels.conv_backward`).

    ``db`` is always given, whatever ``need_db`` (the torch kernels' flag): one sum.

    cuDNN's data- and filter-gradient convolutions when available for the
    problem, else im2col and cuBLAS.
    """
    stride, dilation = tuple(stride), tuple(dilation)
    nd = w.ndim - 2
    dtype = np.result_type(dy.dtype, x.dtype, w.dtype)
    xs, ws, ys = tuple(x.shape), tuple(w.shape), tuple(dy.shape)
    usable = dy.size > 0 and x.size > 0 and dy.dtype == x.dtype == w.dtype
    dx = dw = None
    if usable and need_dx:
        dx = _run("dgrad", dy, w, xs, ws, ys, stride, dilation)
        usable = dx is not None
    if usable and need_dw:
        dw = _run("wgrad", x, dy, xs, ws, ys, stride, dilation)
        usable = dw is not None
    if not usable:
        calls["im2col"] += 1
        return _im2col_conv_backward(dy, x, w, stride, dilation, groups, need_dx, need_dw,
                                     workspace_bytes)
    calls["cudnn"] += 1
    db = dy.sum(axis=(0, *range(2, 2 + nd)), dtype=dtype)
    return (None if dx is None else dx.reshape(xs),
            None if dw is None else dw.reshape(ws), db)
