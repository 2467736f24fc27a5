"""Local kernels through PyTorch: oneDNN/ATen on CPUs, cuDNN on GPUs, on the layers' own blocks.

The functions have the signatures of :mod:`disttensor_nn.kernels.numpy_kernels`
and take and return the layers' local arrays (NumPy, or CuPy on a GPU). The
arrays are shared with PyTorch without a copy: ``torch.from_numpy`` views a
NumPy block (strided views of a halo-extended buffer included), DLPack a CuPy
block, and the results come back the same way, so a layer sees the array
module it gave. The kernels are ATen's: ``aten.convolution`` and
``aten.convolution_backward`` (oneDNN's direct convolutions on a CPU with it,
cuDNN's on a GPU), ``max_pool*_with_indices`` and their backward, the
average pools, ``relu``, ``sigmoid``, and batch normalisation's per-channel
moments (a sum, then ``native_batch_norm_backward``'s fused reduction over
the deviations from it) and per-channel affine passes (the evaluation-mode
batch-norm kernel), ``addmm``/``mm`` for the fully connected layer, and the
in-place element-wise kernels of ``torch.optim.SGD``'s update
(:func:`sgd_update_`, for :class:`~disttensor_nn.optim.SGD` with
``kernel_backend = "torch"``).

PyTorch is optional (the ``torch`` extra: ``pip install "disttensor[torch]"``);
this module imports it on first use, so importing :mod:`disttensor_nn` never
needs it. :func:`available` tells whether it can be used, :func:`require`
raises the ImportError that names the extra.

Threads: PyTorch's intra-op thread pool is set by
:func:`disttensor_nn.kernels.set_num_threads` (one thread per rank by default
under the command-line tools, ranks x threads at most the cores).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import time
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from disttensor.backend import array_namespace, dense_order, empty_in_order, is_numpy
from disttensor.blockcache import active_block_cache

from .numpy_kernels import out_shape  # the same geometry for every backend
from .numpy_kernels import pool_backward as _numpy_pool_backward
from .numpy_kernels import pool_forward as _numpy_pool_forward

__all__ = [
    "available",
    "require",
    "supports",
    "set_num_threads",
    "out_shape",
    "conv_forward",
    "conv_backward",
    "one_window",
    "window_reach",
    "pool_forward",
    "pool_backward",
    "relu_forward",
    "relu_backward",
    "sigmoid_forward",
    "sigmoid_backward",
    "channel_moments",
    "scale_shift",
    "grad_moments",
    "affine_grad",
    "affine",
    "batch_norm_train",
    "batch_norm_backward",
    "linear_forward",
    "linear_backward",
    "sgd_update_",
    "num_threads",
    "loaded",
    "copy_",
    "release_workspace",
    "INSTALL_HINT",
    "MAX_POOL_CHANNELS_LAST_MIN",
    "CONV_CHANNELS_LAST",
    "CONV_TUNE_MAX_ELEMENTS",
]

INSTALL_HINT = 'the torch kernels need PyTorch: pip install "disttensor[torch]"'
"""What the ImportError raised without PyTorch says."""

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""Dtypes the kernels run on a CPU besides bfloat16 (float16 convolutions are GPU kernels)."""

MAX_POOL_CHANNELS_LAST_MIN = 4
"""Channels from which a 2-D max pool of an ``(N, C, H, W)`` block on a CPU runs on a
channels-last copy of it (:func:`pool_forward`).

ATen's CPU max pool with indices vectorises over the channels of a channels-last
input and runs each plane's windows in scalar code otherwise: with PyTorch 2.13
on one thread, ResNet's 3 x 3 / 2 pool of ``(8, 64, 56, 56)`` took 12.1 ms on the
block as it is and 3.2 ms with the copy into channels-last and the copies of the
output and indices back included; ``(4, 16, 256, 256)``, 2 x 2 / 2: 21.5 ms against
12.2; with 4 channels 6.1 against 3.4, but with 2 channels 3.0 against 5.7.
The values and indices are the same either way (the same first maximum of each
window, NaN propagated alike). Not for 3-D pools: there a window of nothing but -inf
gets index 0 on channels-last input (PyTorch 2.13), not its first element.
"""

_state: dict[str, Any] = {"torch": None, "threads": None}


def available() -> bool:
    """Whether PyTorch is installed (without importing it)."""
    if _state["torch"] is not None:
        return True
    if "torch" in sys.modules:  # imported, or blocked (None)
        return sys.modules["torch"] is not None
    return importlib.util.find_spec("torch") is not None


def require() -> ModuleType:
    """The ``torch`` module, imported on first use.

    Raises
    ------
    ImportError
        Without PyTorch, naming the extra that installs it.
    """
    torch = _state["torch"]
    if torch is None:
        if not available():
            raise ImportError(INSTALL_HINT)
        try:
            torch = importlib.import_module("torch")
        except ImportError as exc:  # installed but broken
            raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
        _state["torch"] = torch
        if _state["threads"] is not None:
            torch.set_num_threads(_state["threads"])
    return torch


def supports(dtype: Any, device: str = "cpu") -> bool:
    """Whether the kernels run arrays of ``dtype`` on ``device`` (``"cpu"`` or ``"gpu"``)."""
    dtype = np.dtype(dtype)
    return (dtype in SUPPORTED_DTYPES or dtype.name == "bfloat16"
            or (device == "gpu" and dtype == np.float16))


def set_num_threads(n: int) -> None:
    """PyTorch's intra-op threads (applied now if torch is imported, else on first use)."""
    _state["threads"] = int(n)
    if _state["torch"] is not None:
        _state["torch"].set_num_threads(int(n))


def in_use() -> bool:
    """Whether these kernels have imported PyTorch (a layer or the kernel timer ran them
    in this process): its threads are then the ones :func:`set_num_threads` gave."""
    return _state["torch"] is not None


def loaded() -> bool:
    """Whether PyTorch is imported already (by these kernels or by anything else in the
    process): a caller that only may use it asks this, to not import it."""
    return _state["torch"] is not None or "torch" in sys.modules and \
        sys.modules["torch"] is not None


def num_threads() -> int:
    """PyTorch's intra-op threads now (as set by :func:`set_num_threads`; 1 before
    PyTorch is imported and none was set)."""
    torch = _state["torch"]
    if torch is not None:
        return int(torch.get_num_threads())
    return int(_state["threads"] or 1)


def release_workspace() -> None:
    """Give back the memory PyTorch's allocator keeps (a GPU's cache; nothing on a CPU)."""
    torch = _state["torch"]
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _t(a: Any) -> Any:
    """``a`` as a tensor sharing its memory (NumPy: ``from_numpy``; others: DLPack)."""
    torch = _state["torch"] or require()
    if type(a) is np.ndarray and a.flags.writeable and a.dtype.kind != "V":
        return torch.from_numpy(a)  # the common case first: one call per kernel argument
    if isinstance(a, np.ndarray):
        if a.dtype.kind == "V" and a.dtype.name == "bfloat16":  # ml_dtypes': same bits
            return _t(a.view(np.int16)).view(torch.bfloat16)
        if not a.flags.writeable:  # read-only views (broadcasts) are only read here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a)
        return torch.from_numpy(a)
    if isinstance(a, torch.Tensor):
        return a
    return torch.from_dlpack(a)


def _back(t: Any, like: Any) -> Any:
    """The tensor ``t`` as an array of ``like``'s module, sharing its memory."""
    if type(like) is np.ndarray and t.dtype is not _state["torch"].bfloat16:
        return t.numpy()  # the common case first
    if isinstance(like, np.ndarray) or is_numpy(array_namespace(like)):
        if t.dtype == _state["torch"].bfloat16:  # as ml_dtypes' bfloat16, the same bits
            return t.view(_state["torch"].int16).numpy().view(_bfloat16())
        return t.numpy()
    xp = array_namespace(like)
    if type(like) is type(t):
        return t
    return xp.from_dlpack(t)


def _bfloat16() -> np.dtype:
    """NumPy's bfloat16 (the ``ml_dtypes`` package, which a bfloat16 block came with)."""
    return np.dtype(sys.modules["ml_dtypes"].bfloat16)


def _out(like: Any, t: Any) -> dict[str, Any]:
    """``out=`` for an element-wise result of ``t``'s shape and dtype next to the NumPy
    array ``like``: a block of the active block cache where the cache keeps blocks of its
    size (none otherwise: ATen allocates, as the C heap serves small arrays without page
    faults, and ATen's kernels that are not structured compute an ``out=`` result apart
    and copy it in)."""
    cache = active_block_cache()
    if cache is None or not isinstance(like, np.ndarray) or \
            t.numel() * like.dtype.itemsize < cache.min_bytes:
        return {}
    order = None if like.flags.c_contiguous or tuple(like.shape) != tuple(t.shape) else \
        dense_order(like)  # a channels-last block's result channels-last
    return {"out": _t(empty_in_order(np, tuple(t.shape), like.dtype, order))}


def _planes(t: Any) -> Any:
    """An ``(N, C, M)`` tensor as ATen's batch-norm kernels run it fastest: as ``(N, C, 1,
    M)`` where it lies channels-last (a 3-D view of a channels-last block, whose kernels ATen
    keeps for 4-D and 5-D tensors; unchanged otherwise: squeeze dimension 2 of the results
    only where ``.ndim`` grew)."""
    if t.ndim == 3 and t.shape[1] > 1 and t.stride(1) == 1 and not t.is_contiguous():
        return t.unsqueeze(2)
    return t


def _as(t: Any, dtype: Any) -> Any:
    """``t`` in ``dtype`` (itself when it has it: no call into ATen)."""
    return t if t.dtype == dtype else t.to(dtype)


def _unplanes(r: Any, t: Any) -> Any:
    """A result of a tensor that :func:`_planes` made 4-D, back to ``t``'s three dimensions."""
    return r.squeeze(2) if r.ndim == 4 and t.ndim == 3 else r


def _planes_out(out: dict[str, Any], t4: Any) -> Any | None:
    """:func:`_out`'s block as :func:`_planes` made ``t4`` (None where there is none, or it
    lies otherwise: ATen allocates then)."""
    if not out:
        return None
    o = _planes(out["out"])
    return o if o.ndim == t4.ndim else None


def _pads(padding: Sequence[int] | None, nd: int) -> list[int]:
    return [0] * nd if padding is None else [int(p) for p in padding]


CONV_CHANNELS_LAST = "tuned"
"""When a 2-D float32 convolution on a CPU runs on channels-last copies of its blocks:
``"tuned"`` (where the first call of each shape found it faster, both ways timed),
``"never"`` or ``"always"``.

oneDNN's convolutions on ``(N, C, H, W)`` blocks are slower for some shapes than
on channels-last ones, even with the copies both ways, and faster for others
(PyTorch 2.13, one thread, forward and gradients: the mesh model's first
convolution, 18 -> 16 channels, 5 x 5 / 2, on ``(4, 18, 256, 256)``, 43.7 ms as
it is against 38.0 with the copies where the C heap keeps scratch warm, as the
training driver has it, and 70.3 against 37.1 where each call's scratch is mapped
afresh, oneDNN's reorders of the input faulting their pages in; ``(4, 16, 128,
128)``, 16 -> 16, 3 x 3: 12.5 against 14.7 ms). Which is which does not follow
from the shape, so each distinct call (forward; backward with its gradients
asked) is timed both ways once per process (the fastest of three calls each way,
alternated, after one), the copies included, and takes channels-last only where
that was faster by a tenth. The results agree to rounding (the two orders of the
sums); a process keeps its choice, so its steps repeat bit for bit. Each process
decides alone: two ranks that hold copies of one block (a grid axis that splits
nothing) may take different routes, and their copies then differ by rounding; set
``"never"`` (or ``"always"``) where such copies must stay bit for bit the same.
"""

CONV_TUNE_MAX_ELEMENTS = 2**24
"""Blocks above this many elements keep their layout under ``"tuned"`` (timing eight calls
of a convolution on them would cost more than it can save, and the copies more memory)."""

_conv_routes: dict[tuple[Any, ...], bool] = {}


def _channels_last_conv(key: tuple[Any, ...], xt: Any, plain: Any, copies: Any) -> bool:
    """Whether the convolution call ``key`` on ``xt`` runs channels-last
    (:data:`CONV_CHANNELS_LAST`); ``plain`` and ``copies`` run it each way (timed here,
    alternated, four calls each of which the last three count, on the first call of
    ``key``)."""
    mode = CONV_CHANNELS_LAST
    if mode == "never" or not xt.is_cpu or xt.ndim != 4 or \
            xt.dtype != _state["torch"].float32 or xt.stride(1) == 1 or xt.numel() == 0:
        return False
    if mode == "always":
        return True
    if xt.numel() > CONV_TUNE_MAX_ELEMENTS:
        return False
    key = (*key, num_threads())
    route = _conv_routes.get(key)
    if route is None:
        times = [math.inf, math.inf]
        for rep in range(4):  # alternated; the first call of each sets up oneDNN's primitive
            for i, run in enumerate((plain, copies)):
                start = time.perf_counter()
                run()
                if rep:
                    times[i] = min(times[i], time.perf_counter() - start)
        route = _conv_routes[key] = times[1] < 0.9 * times[0]
    return route


def _standard(t: Any, like: Any) -> Any:
    """The channels-last tensor ``t`` copied into an ``(N, C, ...)`` tensor beside the
    array ``like`` (a block of the active block cache where there is one)."""
    out = _out(like, t)
    return out["out"].copy_(t) if out else t.contiguous()


def _nchw(t: Any, like: Any) -> Any:
    """:func:`_standard` as an array of ``like``'s module."""
    return _back(_standard(t, like), like)


_conv_calls: dict[tuple[Any, ...], Any] = {}
"""How each distinct convolution call runs (its arguments for ATen and its route,
:data:`CONV_CHANNELS_LAST`), by its shapes, strides, dtype, settings (the routes' too) and
threads: found on its first call, so that later ones go straight to the kernel."""


def _conv_key(kind: str, xt: Any, wt: Any, *settings: Any) -> tuple[Any, ...]:
    """The key of a convolution call in :data:`_conv_calls`."""
    return (kind, tuple(xt.shape), xt.stride(), xt.dtype, xt.is_cpu, tuple(wt.shape),
            *settings, CONV_CHANNELS_LAST, CONV_TUNE_MAX_ELEMENTS,
            _state["torch"].get_num_threads())


def conv_forward(x: Any, w: Any, b: Any | None, stride: Sequence[int],
                 dilation: Sequence[int], groups: int = 1, workspace_bytes: int = 0,
                 padding: Sequence[int] | None = None) -> Any:
    """N-D cross-correlation of ``x`` (N, C, *S) with ``w`` (F, C/groups, *K), plus ``b``.

    ``aten.convolution`` on the arrays' memory: valid (the input is already
    padded by a halo) or, with ``padding``, zero-padded by that much on both
    sides of each spatial dimension inside the kernel. ``workspace_bytes``
    is accepted for the NumPy kernels' signature (the library sizes its own).
    """
    require()
    xt, wt = _t(x), _t(w)
    bt = None if b is None else _t(b)
    key = _conv_key("fwd", xt, wt, bt is None, tuple(stride), tuple(dilation), int(groups),
                    None if padding is None else tuple(padding))
    run = _conv_calls.get(key)
    if run is None:
        run = _conv_calls[key] = _forward_call(xt, wt, bt, stride, dilation, groups, padding)
    return run(xt, wt, bt, x)


def _forward_call(xt: Any, wt: Any, bt: Any | None, stride: Sequence[int],
                  dilation: Sequence[int], groups: int, padding: Sequence[int] | None) -> Any:
    """How :func:`conv_forward` runs a call like this one: ``run(xt, wt, bt, x)``."""
    torch = _state["torch"]
    # aten.convolution through its own binding: faster to call than torch.ops' boxed one
    convolution = torch.convolution
    nd = wt.ndim - 2
    pads, stride = _pads(padding, nd), list(stride)
    if one_window(xt.shape, wt.shape, stride, pads, dilation):
        # unstrided on what the one window reads (see one_window), its first column kept
        reach = window_reach(xt.shape, wt.shape, pads, dilation)
        args = (stride[:-1] + [1], pads, list(dilation), False, [0] * nd, int(groups))

        def one(xt: Any, wt: Any, bt: Any, x: Any) -> Any:
            return _back(convolution(xt[..., :reach], wt, bt, *args)[..., :1].contiguous(), x)

        return one
    args = (stride, pads, list(dilation), False, [0] * nd, int(groups))
    cl = torch.channels_last

    def plain(xt: Any, wt: Any, bt: Any, x: Any) -> Any:
        return _back(convolution(xt, wt, bt, *args), x)

    def on_copies(xt: Any, wt: Any, bt: Any, x: Any) -> Any:
        return _nchw(convolution(xt.contiguous(memory_format=cl), wt, bt, *args), x)

    key = ("fwd", tuple(xt.shape), tuple(wt.shape), bt is not None, *map(tuple, args[:3]),
           args[5])
    if _channels_last_conv(key, xt, lambda: convolution(xt, wt, bt, *args),
                           lambda: convolution(xt.contiguous(memory_format=cl), wt, bt,
                                               *args).contiguous()):
        return on_copies
    return plain


def one_window(x_shape: Sequence[int], w_shape: Sequence[int], stride: Sequence[int],
               padding: Sequence[int], dilation: Sequence[int]) -> bool:
    """Whether a convolution of 2 or more spatial dimensions has one output element along
    the last, with a stride above 1 there.

    oneDNN 3.12's bfloat16 convolutions on CPUs with AMX return wrong values
    (or garbage) for that shape (measured with PyTorch 2.13: 2-D and 3-D,
    forward only, ``F.conv2d`` on a plain tensor too). One window does not
    depend on the stride: such a convolution runs with a unit stride on the
    input cut to :func:`window_reach` columns, and its first output column
    is the result (the torch kernels and ``disttensor_nn.torch.parallelize``
    do so whatever the dtype).
    """
    extent = int(dilation[-1]) * (int(w_shape[-1]) - 1) + 1
    return len(w_shape) > 3 and int(stride[-1]) > 1 and \
        int(x_shape[-1]) + 2 * int(padding[-1]) - extent < int(stride[-1])


def window_reach(x_shape: Sequence[int], w_shape: Sequence[int], padding: Sequence[int],
                 dilation: Sequence[int]) -> int:
    """The input columns the first window along the last dimension reads (at least one)."""
    extent = int(dilation[-1]) * (int(w_shape[-1]) - 1) + 1
    return max(1, min(int(x_shape[-1]), extent - int(padding[-1])))


def conv_backward(dy: Any, x: Any, w: Any, stride: Sequence[int], dilation: Sequence[int],
                  groups: int = 1, need_dx: bool = True, need_dw: bool = True,
                  workspace_bytes: int = 0, padding: Sequence[int] | None = None,
                  need_db: bool | None = None
                  ) -> tuple[Any | None, Any | None, Any | None]:
    """Gradients ``(dx, dw, db)`` of :func:`conv_forward` (``aten.convolution_backward``).

    ``dx`` is over the whole input ``x`` (with ``padding``, the unpadded
    input); ``dx`` is computed when ``need_dx``, ``dw`` when ``need_dw``
    and ``db`` when ``need_db`` (by default when ``need_dw``), each None
    otherwise. A layer without a bias asks for no ``db``, as PyTorch's
    autograd does (on ResNet's shapes, one thread, the calls took 1% less).
    """
    require()
    dyt, xt, wt = _t(dy), _t(x), _t(w)
    need_db = need_dw if need_db is None else need_db
    key = _conv_key("bwd", xt, wt, dyt.stride(), tuple(stride), tuple(dilation), int(groups),
                    None if padding is None else tuple(padding), bool(need_dx), bool(need_dw),
                    bool(need_db))
    run = _conv_calls.get(key)
    if run is None:
        run = _conv_calls[key] = _backward_call(
            dyt, xt, wt, stride, dilation, groups, padding,
            [bool(need_dx), bool(need_dw), bool(need_db)])
    return run(dyt, xt, wt, x)


def _backward_call(dyt: Any, xt: Any, wt: Any, stride: Sequence[int], dilation: Sequence[int],
                   groups: int, padding: Sequence[int] | None, mask: list[bool]) -> Any:
    """How :func:`conv_backward` runs a call like this one: ``run(dyt, xt, wt, x)``."""
    torch = _state["torch"]
    backward = torch.ops.aten.convolution_backward.default
    nd = wt.ndim - 2
    args = ([wt.shape[0]] if mask[2] else None, list(stride), _pads(padding, nd),
            list(dilation), False, [0] * nd, int(groups), mask)
    cl = torch.channels_last

    def plain(dyt: Any, xt: Any, wt: Any, x: Any) -> tuple[Any, Any, Any]:
        dx, dw, db = backward(dyt, xt, wt, *args)
        # (on channels-last blocks ATen may give dw channels-last too)
        return (None if dx is None else _back(dx, x),
                None if dw is None else _back(dw.contiguous(), x),
                None if db is None else _back(db, x))

    def on_copies(dyt: Any, xt: Any, wt: Any, x: Any) -> tuple[Any, Any, Any]:
        dx, dw, db = backward(dyt.contiguous(memory_format=cl),
                              xt.contiguous(memory_format=cl), wt, *args)
        return (None if dx is None else _nchw(dx, x),
                None if dw is None else _back(dw.contiguous(), x),
                None if db is None else _back(db, x))

    def copies() -> tuple[Any, ...]:
        return tuple(None if g is None else g.contiguous() for g in backward(
            dyt.contiguous(memory_format=cl), xt.contiguous(memory_format=cl), wt, *args))

    key = ("bwd", tuple(xt.shape), tuple(wt.shape), *map(tuple, args[1:4]), *args[6:7],
           tuple(args[7]))
    if _channels_last_conv(key, xt, lambda: backward(dyt, xt, wt, *args), copies):
        return on_copies
    return plain


def _pool_args(kernel: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """The pooling's dimension for ATen (1-D runs as 2-D) and the leading unit kernel."""
    nd = len(kernel)
    return (2, (1,)) if nd == 1 else (nd, ())


def pool_forward(x: Any, kernel: Sequence[int], stride: Sequence[int],
                 dilation: Sequence[int], op: str, padding: Sequence[int] | None = None
                 ) -> tuple[Any, Any | None]:
    """Max (with ATen's flat input indices) or average over every window of ``x``.

    1-D pooling runs as 2-D over a unit height. With ``padding`` the kernel
    pads both sides (-inf for max; zeros counted in the average, as a halo
    fill does). Average pooling with a dilation, which ATen lacks, runs the
    NumPy kernel (its ``arg`` is None either way), without ``padding``. A 2-D
    max pool of :data:`MAX_POOL_CHANNELS_LAST_MIN` or more channels on a CPU
    runs on a channels-last copy of ``x`` (several times faster there); its
    output and indices come back in ``x``'s layout.
    """
    if op == "avg" and any(d != 1 for d in dilation):
        if padding is not None and any(padding):
            raise ValueError("a dilated average pool is padded by a halo, not the kernel")
        return _numpy_pool_forward(x, kernel, stride, dilation, op)
    torch = require()
    nd, lead = _pool_args(kernel)
    xt = _t(x)
    if lead:
        xt = xt.unsqueeze(2)
    k, s, d = lead + tuple(kernel), lead + tuple(stride), lead + tuple(dilation)
    p = lead and [0] + _pads(padding, 1) or _pads(padding, nd)
    if op == "max":
        fn = torch.ops.aten.max_pool2d_with_indices if nd == 2 else \
            torch.ops.aten.max_pool3d_with_indices
        if _channels_last_pool(xt, lead):
            y, idx = fn(xt.contiguous(memory_format=torch.channels_last), list(k), list(s), p,
                        list(d), False)
            y, idx = _standard(y, x), idx.contiguous()  # in the layout the layers use
        else:
            y, idx = fn(xt, list(k), list(s), p, list(d), False)
    else:
        fn = torch.ops.aten.avg_pool2d if nd == 2 else torch.ops.aten.avg_pool3d
        y, idx = fn(xt, list(k), list(s), p, False, True, None), None
    if lead:
        y = y.squeeze(2)
        idx = None if idx is None else idx.squeeze(2)
    return _back(y, x), idx


def _channels_last_pool(xt: Any, lead: tuple[int, ...]) -> bool:
    """Whether a max pool of the tensor ``xt`` runs on a channels-last copy of it
    (:data:`MAX_POOL_CHANNELS_LAST_MIN`): a 2-D pool on the CPU, not already
    channels-last, of enough channels."""
    return not lead and xt.is_cpu and xt.ndim == 4 and \
        xt.shape[1] >= MAX_POOL_CHANNELS_LAST_MIN and xt.numel() > 0 and \
        xt.stride(1) != 1


def pool_backward(dy: Any, x_shape: Sequence[int], kernel: Sequence[int],
                  stride: Sequence[int], dilation: Sequence[int], op: str,
                  arg: Any | None = None, padding: Sequence[int] | None = None) -> Any:
    """Gradient of :func:`pool_forward` over the whole input of ``x_shape`` (unpadded).

    ``arg`` is what :func:`pool_forward` returned for max pooling (ATen's
    indices); ``padding`` that of the forward call.
    """
    if op == "avg" and any(d != 1 for d in dilation):
        return _numpy_pool_backward(dy, x_shape, kernel, stride, dilation, op, arg)
    torch = require()
    nd, lead = _pool_args(kernel)
    gt = _t(dy)
    shape = tuple(x_shape)
    if lead:
        gt = gt.unsqueeze(2)
        shape = shape[:2] + (1,) + shape[2:]
    # ATen reads only the input's sizes, dtype and layout: a broadcast scalar stands in for
    # it, or an unwritten channels-last tensor where the gradient lies channels-last
    like = torch.zeros((), dtype=gt.dtype, device=gt.device).expand(shape) \
        if gt.ndim != 4 or gt.is_contiguous() or not gt.is_contiguous(
            memory_format=torch.channels_last) else \
        torch.empty(shape, dtype=gt.dtype, device=gt.device, memory_format=torch.channels_last)
    k, s, d = lead + tuple(kernel), lead + tuple(stride), lead + tuple(dilation)
    p = lead and [0] + _pads(padding, 1) or _pads(padding, nd)
    if op == "max":
        idx = _t(arg)
        if lead:
            idx = idx.unsqueeze(2)
        fn = torch.ops.aten.max_pool2d_with_indices_backward if nd == 2 else \
            torch.ops.aten.max_pool3d_with_indices_backward
        dx = fn(gt, like, list(k), list(s), p, list(d), False, idx)
    else:
        fn = torch.ops.aten.avg_pool2d_backward if nd == 2 else \
            torch.ops.aten.avg_pool3d_backward
        dx = fn(gt, like, list(k), list(s), p, False, True, None)
    if lead:
        dx = dx.squeeze(2)
    return _back(dx if dx.is_contiguous(memory_format=torch.channels_last) and dx.ndim == 4
                 else dx.contiguous(), dy)


def relu_forward(x: Any, negative_slope: float = 0.0) -> tuple[Any, Any]:
    """``(y, saved)``: the (leaky) rectifier of ``x`` and what its backward reads.

    With ``negative_slope >= 0`` the output itself, whose sign is the
    input's (it is the next layer's input, usually kept anyway); with a
    negative slope the one-byte mask ``x > 0``.
    """
    torch = require()
    xt = _t(x)
    y = torch.clamp_min(xt, 0, **_out(x, xt)) if negative_slope == 0 else \
        torch.nn.functional.leaky_relu(xt, negative_slope)
    saved = y if negative_slope >= 0 else torch.gt(xt, 0)
    return _back(y, x), _back(saved, x)


def relu_backward(dy: Any, saved: Any, negative_slope: float = 0.0) -> Any:
    """Gradient of :func:`relu_forward` from what it saved (one pass)."""
    torch = require()
    gt, st = _t(dy), _t(saved)
    if negative_slope == 0:
        out = _out(dy, gt)
        dx = torch.ops.aten.threshold_backward.grad_input(gt, st, 0, grad_input=out["out"]) \
            if out else torch.ops.aten.threshold_backward(gt, st, 0)
    elif negative_slope > 0:
        dx = torch.ops.aten.leaky_relu_backward(gt, st, negative_slope, True)
    else:
        dx = torch.where(st, gt, gt * negative_slope)
    return _back(dx, dy)


def sigmoid_forward(x: Any) -> Any:
    """The logistic function of ``x`` (what its backward keeps: the output)."""
    torch = require()
    xt = _t(x)
    return _back(torch.sigmoid(xt, **_out(x, xt)), x)


def sigmoid_backward(dy: Any, y: Any) -> Any:
    """Gradient of :func:`sigmoid_forward` from its output ``y``: ``dy * y * (1 - y)``."""
    torch = require()
    gt, yt = _t(dy), _t(y)
    out = _out(dy, gt)
    dx = torch.ops.aten.sigmoid_backward.grad_input(gt, yt, grad_input=out["out"]) if out \
        else torch.ops.aten.sigmoid_backward(gt, yt)
    return _back(dx, dy)


def channel_moments(x3: Any) -> tuple[Any, Any, Any, Any]:
    """``(centre, sum_d, sum_d2, d)`` per channel of an ``(N, C, M)`` array.

    ``centre`` is the channels' mean in the array's dtype (a sum and a
    division, rounded); ``d = x - centre`` is a new array (a block of the
    active block cache, where there is one); ``sum_d`` and ``sum_d2`` are
    the sums of ``d`` and of ``d**2`` in float64, so that sums over several
    ranks combine without cancellation (batch normalisation's statistics)
    and ``sum_d`` keeps what rounding the centre lost. Three passes: the
    sum, the subtraction, and one fused reduction over ``d`` (ATen's
    batch-norm backward reduction, ``d`` as both the gradient and the input
    about a zero mean), where ATen's one-pass statistics (Welford's) cost
    more than the three together.
    """
    torch = require()
    t = _t(x3)
    c = t.shape[1]
    m = t.shape[0] * t.shape[2]
    if m == 0:
        zero = torch.zeros(c, dtype=torch.float64, device=t.device)
        return _back(zero.to(t.dtype), x3), _back(zero, x3), _back(zero.clone(), x3), x3
    centre = torch.sum(t, dim=(0, 2)).div_(m)
    d = torch.sub(t, centre[:, None], **_out(x3, t))
    sum_d, sum_d2 = _sums(torch, d, d, None)
    return _back(centre, x3), _back(sum_d, x3), _back(sum_d2, x3), _back(d, x3)


SUMS_CHUNK = 2**18
"""Elements per piece in which :func:`_sums` reduces channels-last blocks (a piece's product
stays in a core's cache: ``(4, 64, 56, 56)``, one thread, 0.33 ms against 0.48 in pieces
of 2**16 and 0.32 of 2**19)."""


def _rows(t: Any) -> Any | None:
    """A channels-last ``(N, C, M)`` tensor as its ``(N * M, C)`` rows (a view); None for
    any other."""
    if t.ndim != 3 or t.shape[1] < 2 or t.stride(1) != 1 or t.is_contiguous():
        return None
    rows = t.transpose(1, 2)
    return rows.reshape(-1, t.shape[1]) if rows.is_contiguous() else None


def _sums(torch: ModuleType, g: Any, x: Any, centre: Any | None) -> tuple[Any, Any]:
    """``(sum(g), sum(g * (x - centre)))`` per channel of ``(N, C, M)`` tensors, in float64
    (``centre`` None: zero), in one pass: ATen's batch-norm backward reduction with the
    centre as the mean and a unit inverse deviation; on channels-last blocks ATen's column
    sums of pieces of their rows, added in float64 (ATen's channels-last batch-norm
    reduction adds the rows one after another in float32: relative errors of 1e-6 to 1e-5
    on ResNet's and the mesh model's blocks against 1e-7, which the sums over the ranks
    then carry into every input gradient)."""
    c = g.shape[1]
    if g.numel() == 0:
        zero = torch.zeros(c, dtype=torch.float64, device=g.device)
        return zero, zero.clone()
    one = torch.ones(c, dtype=g.dtype, device=g.device)
    mean = torch.zeros(c, dtype=g.dtype, device=g.device) if centre is None else \
        _t(centre).to(g.dtype)
    g2, x2 = _rows(g), _rows(x)
    if g2 is not None and x2 is not None:
        step = max(1, SUMS_CHUNK // c)
        sum_g = torch.zeros(c, dtype=torch.float64, device=g.device)
        sum_gd = torch.zeros(c, dtype=torch.float64, device=g.device)
        scratch = torch.empty(min(step, g2.shape[0]), c, dtype=g.dtype, device=g.device)
        for r in range(0, g2.shape[0], step):
            gp = g2[r:r + step]
            prod = torch.sub(x2[r:r + step], mean, out=scratch[:gp.shape[0]]).mul_(gp)
            sum_g += gp.sum(0)
            sum_gd += prod.sum(0)
        return sum_g, sum_gd
    _, sum_gd, sum_g = torch.ops.aten.native_batch_norm_backward(
        g, x, one, None, None, mean, one, True, 0.0, [False, True, True])
    return sum_g.to(torch.float64), sum_gd.to(torch.float64)


def _per_channel(v: Any, like: Any) -> Any:
    """A per-channel vector as a ``(C, 1)`` tensor of ``like``'s dtype."""
    return _t(v).to(like.dtype)[:, None]


def affine(x3: Any, scale: Any, shift: Any) -> Any:
    """``x3 * scale + shift`` per channel of an ``(N, C, M)`` array, in one pass.

    The evaluation-mode batch-norm kernel with a zero mean, a unit variance
    and no epsilon, written into a block of the active block cache where
    there is one. Batch normalisation applies it to the deviations from the
    centre (:func:`channel_moments`' ``d``), so that nothing large cancels.
    """
    torch = require()
    t = _t(x3)
    c = t.shape[1]
    w, b = _t(scale).to(t.dtype), _t(shift).to(t.dtype)
    zero = torch.zeros(c, dtype=t.dtype, device=t.device)
    one = torch.ones(c, dtype=t.dtype, device=t.device)
    t4 = _planes(t)
    out = _planes_out(_out(x3, t), t4)
    if out is None or t.numel() == 0:
        y = torch.batch_norm(t4, w, b, zero, one, False, 0.0, 0.0, False)
        return _back(_unplanes(y, t), x3)
    nothing = torch.empty(0, dtype=t.dtype, device=t.device)
    torch.ops.aten.native_batch_norm.out(t4, w, b, zero, one, False, 0.0, 0.0, out=out,
                                         save_mean=nothing, save_invstd=nothing.clone())
    return _back(_unplanes(out, t), x3)


def scale_shift(x3: Any, centre: Any, scale: Any, shift: Any) -> Any:
    """``(x3 - centre) * scale + shift`` per channel of an ``(N, C, M)`` array.

    The centre is subtracted first, so that channels far from zero keep
    their accuracy; one new array, updated in place.
    """
    torch = require()
    t = _t(x3)
    y = torch.sub(t, _per_channel(centre, t), **_out(x3, t))
    y.mul_(_per_channel(scale, t)).add_(_per_channel(shift, t))
    return _back(y, x3)


def grad_moments(g3: Any, x3: Any, centre: Any) -> tuple[Any, Any]:
    """``(sum(g), sum(g * (x - centre)))`` per channel of ``(N, C, M)`` arrays, in float64.

    One fused pass: ATen's batch-norm backward reduction with the centre as
    the mean and a unit inverse deviation.
    """
    torch = require()
    sum_g, sum_gd = _sums(torch, _t(g3), _t(x3), centre)
    return _back(sum_g, g3), _back(sum_gd, g3)


def batch_norm_train(x3: Any, weight: Any | None, bias: Any | None, eps: float,
                     running: tuple[Any, Any] | None, momentum: float
                     ) -> tuple[Any, Any, Any, tuple[Any, Any] | None]:
    """Batch normalisation of an ``(N, C, M)`` block by its own statistics, in one call.

    ATen's training-mode kernel (one pass of Welford's statistics, one of the
    normalisation), as ``torch.nn.BatchNorm`` runs in one process: for a
    block whose statistics no other rank shares. ``running`` is the pair of
    running statistics (any float dtype; they are not written) or None;
    ATen updates copies of them in the block's dtype with ``momentum`` and
    the unbiased variance (so a float32 block's are rounded to float32 once
    a step, as PyTorch's own buffers are float32).

    Returns
    -------
    y, mean, invstd, running
        The output (a block of the active block cache where there is one),
        the batch mean and ``1 / sqrt(var + eps)`` per channel in the block's
        dtype, and the updated running statistics in float64 (None without).
    """
    torch = require()
    t = _t(x3)
    c = t.shape[1]
    kw = {"dtype": t.dtype, "device": t.device}
    w = None if weight is None else _as(_t(weight), t.dtype)
    b = None if bias is None else _as(_t(bias), t.dtype)
    rm = rv = None
    if running is not None:  # copies: ATen writes into them
        rm, rv = _t(running[0]).to(**kw, copy=True), _t(running[1]).to(**kw, copy=True)
    t4 = _planes(t)
    out = _planes_out(_out(x3, t), t4)
    if out is not None:
        y, mean, invstd = torch.ops.aten.native_batch_norm.out(
            t4, w, b, rm, rv, True, float(momentum), float(eps), out=out,
            save_mean=torch.empty(c, **kw), save_invstd=torch.empty(c, **kw))
    else:
        y, mean, invstd = torch.native_batch_norm(t4, w, b, rm, rv, True, float(momentum),
                                                  float(eps))
    new = None if running is None else (_back(rm.to(torch.float64), x3),
                                        _back(rv.to(torch.float64), x3))
    return _back(_unplanes(y, t), x3), _back(mean, x3), _back(invstd, x3), new


def batch_norm_backward(g3: Any, x3: Any, weight: Any | None, mean: Any, invstd: Any
                        ) -> tuple[Any, Any, Any]:
    """``(dx, sum(g), sum(g * xhat))`` of batch normalisation whose statistics are those
    of this ``(N, C, M)`` block alone, ``xhat = (x3 - mean) * invstd``.

    ATen's batch-norm backward in training mode, one call (it subtracts the
    mean itself), ``weight`` the scale (None: ones); the sums in the block's dtype, as
    ATen gives them (the parameters' gradients take them so).
    """
    torch = require()
    g, x = _t(g3), _t(x3)
    if g.stride() != x.stride():  # the input in the gradient's layout (a layer above that
        # takes no channels-last blocks gives a C-order gradient): ATen's planes need both
        # alike, and the input gradient follows the output gradient's
        x = torch.empty_like(g).copy_(x)
    c = g.shape[1]
    kw = {"dtype": g.dtype, "device": g.device}
    w = torch.ones(c, **kw) if weight is None else _as(_t(weight), g.dtype)
    args = (_planes(g), _planes(x), w, None, None, _as(_t(mean), g.dtype),
            _as(_t(invstd), g.dtype), True, 0.0, [True, True, True])
    # no out=: this op has no out kernel of its own (ATen's generated one computes apart
    # and copies in: ResNet-50's batch norms took 84 ms of backward a step against 59)
    dx, dw, db = torch.ops.aten.native_batch_norm_backward.default(*args)
    # ATen's weight gradient is sum(g * xhat) (the scale does not enter it)
    return _back(_unplanes(dx, g), g3), _back(db, g3), _back(dw, g3)


def affine_grad(g3: Any, x3: Any, centre: Any, a: Any, b: Any, c: Any) -> Any:
    """``g3 * a + (x3 - centre) * b + c`` per channel of ``(N, C, M)`` arrays (batch
    normalisation's input gradient); one new array, updated in place, the centre
    subtracted first (so that channels far from zero keep their accuracy)."""
    torch = require()
    g, x = _t(g3), _t(x3)
    dx = torch.sub(x, _per_channel(centre, x), **_out(g3, g))
    dx.mul_(_per_channel(b, g)).add_(_per_channel(c, g)).addcmul_(g, _per_channel(a, g))
    return _back(dx, g3)


def linear_forward(x: Any, w: Any, b: Any | None) -> Any:
    """``x @ w.T + b`` of an ``(N, in)`` block and an ``(out, in)`` weight (ATen's
    ``addmm``, with PyTorch's intra-op threads)."""
    torch = require()
    xt, wt = _t(x), _t(w)
    y = torch.mm(xt, wt.t()) if b is None else torch.addmm(_t(b), xt, wt.t())
    return _back(y, x)


def linear_backward(g: Any, x: Any, w: Any, need_dx: bool = True, need_db: bool = True
                    ) -> tuple[Any | None, Any, Any | None]:
    """``(dx, dw, db)`` of :func:`linear_forward` for the output gradient ``g``:
    ``g @ w``, ``g.T @ x`` and ``g.sum(0)``, in ``g``'s dtype (None where not asked)."""
    torch = require()
    gt, xt = _t(g), _t(x)
    dw = torch.mm(gt.t(), xt)
    dx = torch.mm(gt, _t(w)) if need_dx else None
    db = gt.sum(0) if need_db else None
    return (None if dx is None else _back(dx, g)), _back(dw, g), \
        (None if db is None else _back(db, g))


def sgd_update_(data: Any, grad: Any, buf: Any | None, lr: float, momentum: float = 0.0,
                dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                fresh: bool = False) -> None:
    """One SGD step in place, as ``torch.optim.SGD``'s: ``d = grad + weight_decay *
    data``; with a momentum buffer ``buf``, ``buf = d`` (``fresh``) or ``buf = momentum *
    buf + (1 - dampening) * d``, then ``d = buf`` (Nesterov: ``d + momentum * buf``);
    ``data -= lr * d``.

    ATen's element-wise kernels on the arrays' own memory (shared zero-copy),
    over PyTorch's intra-op threads; ``grad`` is not written.
    """
    require()
    p, d = _t(data), _t(grad)
    if weight_decay:
        d = d.add(p, alpha=weight_decay)
    if buf is not None:
        b = _t(buf)
        if fresh:
            b.copy_(d)
        else:
            b.mul_(momentum).add_(d, alpha=1 - dampening)
        d = d.add(b, alpha=momentum) if nesterov else b
    p.add_(d, alpha=-lr)


def add(a: Any, b: Any) -> Any:
    """``a + b`` of two arrays of one shape and dtype, a new array of ``a``'s module,
    over PyTorch's threads (the same sums as the array module's: one addition per
    element)."""
    torch = require()
    return _back(torch.add(_t(a), _t(b)), a)


def copy_(dst: Any, src: Any) -> Any:
    """``dst[...] = src`` over PyTorch's threads (arrays of one shape; ``src`` cast to
    ``dst``'s dtype); returns ``dst``."""
    require()
    _t(dst).copy_(_t(src))
    return dst
