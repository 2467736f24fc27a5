"""Array modules and MPI buffers: the one place that knows NumPy from other array libraries.

Everything that differs between NumPy, CuPy, PyTorch and other array API
namespaces (``array_api_strict`` in the tests) is answered here: an array's
module, dtype and device, allocation on that device, copies between it and
host memory, views of host memory as NumPy arrays (:func:`host_view`), stream
synchronisation, and MPI datatypes that select a strided view. The rest of
the library calls these helpers and never tests for a library.

PyTorch tensors are blocks like any other: their module is ``torch``
itself (found in ``sys.modules``, never imported here), and a tensor in host
memory is worked on, and sent, as the NumPy view of its memory, without a
copy.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Sequence
from functools import cache, lru_cache
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from .blockcache import active_block_cache

__all__ = [
    "array_namespace",
    "as_module",
    "astype",
    "bfloat16",
    "check_movable",
    "concat",
    "contiguous",
    "copy_from_host",
    "copy_view",
    "copy_to_host",
    "data_address",
    "device_kw",
    "dense_order",
    "device_of",
    "empty",
    "empty_in_order",
    "empty_like_layout",
    "is_channels_last",
    "zeros",
    "fill",
    "from_numpy",
    "host_empty",
    "host_view",
    "is_c_contiguous",
    "is_cupy",
    "is_numpy",
    "is_torch",
    "mpi_buffer",
    "mpi_dtype",
    "namespace_dtype",
    "nbytes",
    "numpy_dtype",
    "permute_dims",
    "reduces_in_mpi",
    "reshape",
    "synchronize",
    "to_numpy",
    "view_datatype",
    "writes_in_place",
]


_MODULE_OF_TYPE: dict[type, ModuleType] = {}
"""The module of array types without ``__array_namespace__`` (PyTorch's tensors), by type:
found from the type's module name once."""


def array_namespace(x: Any) -> ModuleType:
    """The array module of ``x`` (``numpy`` for NumPy arrays and scalars)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return np
    known = _MODULE_OF_TYPE.get(type(x))
    if known is not None:
        return known
    ns = getattr(x, "__array_namespace__", None)
    if ns is not None:
        return ns()
    found = _module_of_type(type(x))
    if found is not np:
        _MODULE_OF_TYPE[type(x)] = found
    return found


def _module_of_type(kind: type) -> ModuleType:
    """The array module of instances of ``kind``, from its module's name (NumPy if unknown)."""
    mod = kind.__module__.split(".")[0]
    if mod == "cupy":  # pragma: no cover - GPU only
        import cupy

        return cupy
    if mod == "torch" and "torch" in sys.modules:  # a tensor exists, so torch is imported
        return sys.modules["torch"]
    return np


def is_numpy(xp: ModuleType) -> bool:
    """Whether ``xp`` is NumPy itself."""
    return xp is np or getattr(xp, "__name__", "") == "numpy"


def is_cupy(xp: ModuleType) -> bool:
    """Whether ``xp`` is CuPy."""
    return getattr(xp, "__name__", "") == "cupy"


def is_torch(xp: ModuleType) -> bool:
    """Whether ``xp`` is PyTorch (``torch``, the module of its tensors)."""
    return getattr(xp, "__name__", "") == "torch"


def _takes_numpy_dtypes(xp: ModuleType) -> bool:
    return is_numpy(xp) or is_cupy(xp)


_FOREIGN_DTYPES: dict[tuple[type, Any], np.dtype] = {}
"""The NumPy dtypes of other libraries' dtype objects met so far (PyTorch's), by type and
object: NumPy refuses them, and finding their equal from the name, after the refusal,
takes some microseconds."""


def numpy_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype equal to ``dtype`` (a NumPy, CuPy or array API dtype object)."""
    if isinstance(dtype, np.dtype):
        return dtype
    # keyed with the type: dtypes of two libraries are never compared (array API dtypes
    # warn when compared with another library's)
    key = (type(dtype), dtype)
    try:
        known = _FOREIGN_DTYPES.get(key)
    except TypeError:  # not hashable: looked up afresh
        known = None
    if known is not None:
        return known
    try:
        return np.dtype(dtype)
    except TypeError:
        found = _foreign_dtype(dtype)
        with contextlib.suppress(TypeError):
            _FOREIGN_DTYPES[key] = found
        return found


def _foreign_dtype(dtype: Any) -> np.dtype:
    """:func:`numpy_dtype` of a dtype object NumPy refuses, from its name."""
    # array API dtypes of other libraries print as "<module>.<name>" (or just "<name>")
    name = str(dtype).rpartition(".")[2]
    try:
        found = np.dtype(name)
    except TypeError:
        found = None
    if str(dtype) == "torch.bfloat16":  # viewed as ml_dtypes' bfloat16 (see host_view)
        found = bfloat16()
        if found is None:
            raise TypeError("torch.bfloat16 blocks are worked on as the bfloat16 of the "
                            "ml_dtypes package, which is not imported: import ml_dtypes "
                            "(pip install ml_dtypes, or the 'torch' extra)") from None
        return found
    # a name that NumPy knows only through an extension (ml_dtypes' "bfloat16") is not
    # another library's dtype: their arrays do not share NumPy's view of it
    if found is None or found.kind == "V":
        raise TypeError(f"{dtype!r} is not a dtype that NumPy knows") from None
    return found


def bfloat16() -> np.dtype | None:
    """NumPy's bfloat16, where the ``ml_dtypes`` package that defines it is imported (else None).

    Found in ``sys.modules``, never imported here (``disttensor_nn`` imports it
    where it is installed). PyTorch's bfloat16 tensors are viewed with it.
    """
    mod = sys.modules.get("ml_dtypes")
    return None if mod is None else np.dtype(mod.bfloat16)


def reduces_in_mpi(dtype: Any) -> bool:
    """Whether MPI's reductions take ``dtype``'s elements (bfloat16's it does not take)."""
    return numpy_dtype(dtype).name != "bfloat16"


_NAMESPACE_DTYPES: dict[tuple[Any, type, Any], Any] = {}
""":func:`namespace_dtype`'s answers, by module, dtype type and dtype (a NumPy dtype's name
takes microseconds)."""


def namespace_dtype(xp: ModuleType, dtype: Any) -> Any:
    """The dtype object of the array module ``xp`` that equals ``dtype``."""
    key = (xp, type(dtype), dtype)
    try:
        found = _NAMESPACE_DTYPES.get(key)
    except TypeError:  # not hashable: found afresh
        found, key = None, None
    if found is not None:
        return found
    dt = numpy_dtype(dtype)
    if _takes_numpy_dtypes(xp):
        found = dt
    else:
        found = getattr(xp, "bool" if dt == np.bool_ else dt.name, None)
        if found is None:
            raise TypeError(f"the array module {xp.__name__} has no dtype {dt}")
    if key is not None:
        _NAMESPACE_DTYPES[key] = found
    return found


def device_of(x: Any) -> Any:
    """The device keyword that places new arrays next to ``x`` (None: the module's default).

    NumPy and CuPy place arrays on the current device (CuPy's is chosen by
    :func:`disttensor.use_device`); other array API libraries take the array's
    ``device`` attribute.
    """
    if isinstance(x, np.ndarray) or _takes_numpy_dtypes(array_namespace(x)):
        return None
    return getattr(x, "device", None)


def device_kw(x: Any) -> dict[str, Any]:
    """Keyword arguments that place new arrays of ``x``'s module next to ``x``."""
    device = device_of(x)
    return {} if device is None else {"device": device}


def empty(xp: ModuleType, shape: tuple[int, ...], dtype: Any, device: Any = None) -> Any:
    """An uninitialised C-contiguous array of ``xp`` (on ``device`` when given).

    A large NumPy block comes from the active :class:`~disttensor.blockcache.BlockCache`
    where one is (:func:`~disttensor.blockcache.block_cache`).
    """
    dt = namespace_dtype(xp, dtype)
    cache = active_block_cache()
    if cache is not None and xp is np and device in (None, "cpu"):
        return cache.empty(shape, dt)
    if device is None:
        return xp.empty(shape, dtype=dt)
    return xp.empty(shape, dtype=dt, device=device)


def dense_order(a: Any) -> tuple[int, ...] | None:
    """The order of ``a``'s axes in memory, outermost first, where ``a`` is dense in
    some order of its axes (C-contiguous: the identity; PyTorch's channels-last
    ``(N, C, H, W)``: ``(0, 2, 3, 1)``); None where it is not dense (a strided slice) or
    the module has no strides to read."""
    if callable(getattr(a, "stride", None)):  # PyTorch's tensors: in elements
        strides = tuple(a.stride())
    elif getattr(a, "strides", None) is not None:  # NumPy's and CuPy's: in bytes
        strides = tuple(s // max(a.itemsize, 1) for s in a.strides)
    else:
        return None
    shape = tuple(a.shape)
    order = tuple(sorted(range(len(shape)), key=lambda d: (-strides[d], d)))
    expected = 1
    for d in reversed(order):  # axes of one element may sit anywhere
        if shape[d] > 1 and strides[d] != expected:
            return None
        expected *= shape[d]
    return order


def is_channels_last(a: Any) -> bool:
    """Whether ``a`` is an ``(N, C, H, W)`` or ``(N, C, D, H, W)`` array that lies dense in
    channels-last order (``(N, H, W, C)`` in memory, PyTorch's ``channels_last``) and is not
    also C-contiguous (one channel, or one pixel). Axes of one element may have any stride."""
    nd = getattr(a, "ndim", 0)
    if nd not in (4, 5):
        return False
    strides = getattr(a, "strides", None)
    if strides is None:  # PyTorch's tensors (their strides are a method)
        if not is_torch(array_namespace(a)) or a.is_contiguous():
            return False
        xp = array_namespace(a)
        return bool(a.is_contiguous(memory_format=xp.channels_last if nd == 4 else
                                    xp.channels_last_3d))
    if a.flags.c_contiguous:  # NumPy's and CuPy's, read off directly (each layer asks)
        return False
    shape, expect = a.shape, a.itemsize
    for d in (1, *range(nd - 1, 1, -1), 0):  # innermost first: C, the last axis, ...
        if shape[d] > 1 and strides[d] != expect:
            return False
        expect *= shape[d]
    return True


def empty_like_layout(like: Any, shape: tuple[int, ...], dtype: Any = None) -> Any:
    """An uninitialised array of ``shape`` whose axes lie in memory in the order of
    ``like``'s (:func:`dense_order`; C order where ``like`` is C-contiguous or not dense),
    of ``like``'s module, dtype (unless given) and device: a block grown by a halo keeps
    a channels-last block's layout, which PyTorch's convolutions run faster on."""
    xp = array_namespace(like)
    dtype = like.dtype if dtype is None else dtype
    order = dense_order(like) if not is_c_contiguous(like) else None
    return empty_in_order(xp, tuple(shape), dtype, order, device_of(like))


def empty_in_order(xp: ModuleType, shape: tuple[int, ...], dtype: Any,
                   order: Sequence[int] | None, device: Any = None) -> Any:
    """As :func:`empty`, with the axes lying in memory in ``order`` (outermost first, as
    :func:`dense_order` gives it; None: C order): ``(0, 2, 3, 1)`` makes an ``(N, C, H, W)``
    array channels-last."""
    if order is None or tuple(order) == tuple(range(len(shape))):
        return empty(xp, tuple(shape), dtype, device)
    inner = empty(xp, tuple(shape[d] for d in order), dtype, device)
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return permute_dims(inner, tuple(inverse))


def zeros(xp: ModuleType, shape: tuple[int, ...], dtype: Any, device: Any = None) -> Any:
    """As :func:`empty`, filled with zeros."""
    dt = namespace_dtype(xp, dtype)
    cache = active_block_cache()
    if cache is not None and xp is np and device in (None, "cpu"):
        return cache.zeros(shape, dt)  # a newly mapped buffer is not written
    return xp.zeros(shape, dtype=dt) if device is None else xp.zeros(shape, dtype=dt, device=device)


def astype(x: Any, dtype: Any) -> Any:
    """``x`` cast to ``dtype`` (a new C-contiguous array of its module)."""
    xp = array_namespace(x)
    if _takes_numpy_dtypes(xp):
        return x.astype(numpy_dtype(dtype), order="C")
    if is_torch(xp):  # no astype function: the method, into C order
        return x.detach().to(namespace_dtype(xp, dtype), copy=True,
                             memory_format=xp.contiguous_format)
    return xp.astype(x, namespace_dtype(xp, dtype), copy=True)


def fill(x: Any, value: Any) -> None:
    """Set every element of ``x`` to the scalar ``value``, cast to ``x``'s dtype as NumPy casts."""
    if isinstance(x, np.ndarray):
        x[...] = value
    else:
        x[...] = np.asarray(value).astype(numpy_dtype(x.dtype)).item()


def as_module(x: Any, xp: ModuleType, device: Any = None) -> Any:
    """``x`` (any array or array_like) as an array of ``xp`` (on ``device``), copied if needed."""
    if array_namespace(x) is xp and device in (None, device_of(x)) and hasattr(x, "shape"):
        return x
    host = to_numpy(x) if hasattr(x, "shape") else np.asarray(x)
    if is_numpy(xp):
        return host
    if is_cupy(xp):  # pragma: no cover - GPU only
        return xp.asarray(host)
    return xp.asarray(host, **({} if device is None else {"device": device}))


def nbytes(a: Any) -> int:
    """Bytes of the elements of ``a`` (arrays of any module; the standard has no ``nbytes``)."""
    return math.prod(a.shape) * numpy_dtype(a.dtype).itemsize


def writes_in_place(xp: ModuleType) -> bool:
    """Whether ``xp``'s element-wise functions take ``out=`` and views can be written through.

    True for NumPy and CuPy, whose hot loops then write into existing
    buffers; other array API libraries get the same arithmetic as new arrays.
    """
    return _takes_numpy_dtypes(xp)


def concat(arrays: Sequence[Any], axis: int = 0) -> Any:
    """Join arrays of one module along an existing axis (``concatenate`` before NumPy 2)."""
    xp = array_namespace(arrays[0])
    join = xp.concatenate if _takes_numpy_dtypes(xp) else xp.concat
    return join(list(arrays), axis=axis)


def permute_dims(x: Any, axes: Sequence[int]) -> Any:
    """``x`` with its axes reordered (a view where the module makes one)."""
    xp = array_namespace(x)
    if _takes_numpy_dtypes(xp):
        return x.transpose(tuple(axes))
    if is_torch(xp):
        return xp.permute(x, tuple(axes))
    return xp.permute_dims(x, tuple(axes))


def reshape(x: Any, shape: tuple[int, ...]) -> Any:
    """``x`` reshaped (a view where the layout allows), with the module's function."""
    return array_namespace(x).reshape(x, shape)


def is_c_contiguous(a: Any) -> bool:
    """Whether MPI can read ``a`` as one contiguous run (False when the library cannot say)."""
    flags = getattr(a, "flags", None)
    if flags is None and is_torch(array_namespace(a)):
        return bool(a.is_contiguous())
    return bool(flags is not None and flags.c_contiguous)


def contiguous(x: Any, copy: bool = False, *, writeable: bool = False) -> Any:
    """``x`` as a C-contiguous array of its module, copied only when needed.

    The one contiguity helper of the project: MPI buffers, wrapped blocks and
    in-place reductions all go through it. 0-d arrays stay 0-d (unlike
    ``numpy.ascontiguousarray``).

    Parameters
    ----------
    x : array
        A NumPy, CuPy or other array API array.
    copy : bool
        Always return a new array.
    writeable : bool
        Also copy a read-only array (a broadcast view, say), so that the
        result can be written to.

    Returns
    -------
    array
        ``x`` itself when it already qualifies (PyTorch: detached from any
        autograd graph); array API namespaces without a notion of memory
        layout return ``x`` itself, or a copy.
    """
    xp = array_namespace(x)
    if is_numpy(xp):
        out = np.array(x, order="C") if copy else np.asarray(x, order="C")
        return out.copy() if writeable and not out.flags.writeable else out
    if is_cupy(xp):  # pragma: no cover - GPU only
        if copy or not x.flags.c_contiguous:
            return xp.array(x, order="C", copy=True)
        return x
    if is_torch(xp):  # a block's values, not a node of an autograd graph
        x = x.detach()
        return x.clone(memory_format=xp.contiguous_format) if copy else x.contiguous()
    return xp.asarray(x, copy=True) if copy else x


@lru_cache(maxsize=1024)
def _run_layout(shape: tuple[int, ...], dst_strides: tuple[int, ...],
                src_strides: tuple[int, ...], itemsize: int) -> tuple | None:
    """How to copy between two NumPy layouts of ``shape`` with the fewest inner-loop calls.

    Returns ``(wide_dtype, shape)``, where the innermost contiguous runs
    (``wide_dtype.itemsize`` bytes, contiguous in both arrays) become single
    elements of ``wide_dtype`` and the remaining dimensions are merged where
    both layouts allow; None when the plain element-wise copy is as good
    (long runs, or no run longer than one element).
    """
    if not shape or shape[-1] == 1 or 0 in shape:  # the run must be the last axis
        return None
    dims = [(n, a, b) for n, a, b in zip(shape, dst_strides, src_strides) if n != 1]
    n, a, b = dims[-1]
    run = n * itemsize
    if n == 1 or a != itemsize or b != itemsize or run > 64:
        return None
    wide = np.dtype(f"u{run}") if run in (2, 4, 8) else np.dtype((np.void, run))
    outer = [list(d) for d in dims[:-1]]
    merged: list[list[int]] = []
    for m, sa, sb in outer:
        if merged and merged[-1][1] == m * sa and merged[-1][2] == m * sb:
            merged[-1] = [merged[-1][0] * m, sa, sb]
        else:
            merged.append([m, sa, sb])
    return wide, tuple(m for m, _, _ in merged) + (1,)


def copy_view(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for two arrays of one shape and dtype, in one strided copy.

    The packing copy of halo faces and other strided slabs. For NumPy arrays
    whose innermost dimension is a short contiguous run (a face of width 1-3
    across the last dimension, say) the runs are copied as single wide
    elements, so the copy loops over runs, not elements; tensors in host
    memory (PyTorch's on the CPU) are copied as their NumPy views (NumPy's
    strided copy measured 25% faster than ``Tensor.copy_`` into the interior
    of a halo-extended block); other arrays and modules use their own
    assignment.
    """
    if type(dst) is not np.ndarray or type(src) is not np.ndarray:
        hd, hs = host_view(dst), host_view(src)
        if hd is not None and hs is not None and type(hd) is np.ndarray and \
                type(hs) is np.ndarray:
            dst, src = hd, hs
    if type(dst) is np.ndarray and type(src) is np.ndarray:
        layout = _run_layout(dst.shape, dst.strides, src.strides, dst.itemsize)
        if layout is not None and dst.dtype == src.dtype:
            wide, shape = layout
            try:  # the merge rule is NumPy's own condition for a reshape without a copy
                d, s = dst.view(wide).reshape(shape), src.view(wide).reshape(shape)
            except (TypeError, ValueError):  # a dtype NumPy will not view as bytes
                pass
            else:
                np.copyto(d, s)
                return
        np.copyto(dst, src)
        return
    dst[...] = src


def fill_view(dst: Any, value: Any) -> None:
    """``dst[...] = value`` (a scalar of its dtype) in one strided pass, as :func:`copy_view`."""
    if type(dst) is np.ndarray:
        layout = _run_layout(dst.shape, dst.strides, dst.strides, dst.itemsize)
        if layout is not None:
            wide, shape = layout
            run = np.full(wide.itemsize // dst.itemsize, value, dst.dtype)
            try:
                d = dst.view(wide).reshape(shape)
            except (TypeError, ValueError):  # a dtype NumPy will not view as bytes
                pass
            else:
                np.copyto(d, run.view(wide))
                return
    dst[...] = value


def to_numpy(x: Any) -> np.ndarray:
    """Copy or view ``x`` as a NumPy array in host memory."""
    if isinstance(x, np.ndarray):
        return x
    xp = array_namespace(x)
    if is_cupy(xp):  # pragma: no cover - GPU only
        return x.get()
    if is_torch(xp):  # a view on the CPU, a copy from a GPU
        t = x.detach().resolve_conj().resolve_neg().cpu()
        view = host_view(t)
        return t.numpy() if view is None else view
    try:
        return np.asarray(x)
    except (TypeError, RuntimeError, ValueError, BufferError):
        # arrays on an accelerator: DLPack copies them to the host (array API 2023.12)
        return np.from_dlpack(x, device="cpu", copy=True)


def from_numpy(host: np.ndarray, like: Any) -> Any:
    """A new array of ``like``'s module and device holding a copy of ``host``.

    The copy is complete when this returns, so ``host`` may be reused at once
    (CuPy would otherwise copy from pinned memory asynchronously).
    """
    xp = array_namespace(like)
    if is_numpy(xp):
        return np.array(host, copy=True)
    if is_cupy(xp):  # pragma: no cover - GPU only
        out = xp.empty(host.shape, dtype=host.dtype)
        # set() queues an asynchronous copy on the current stream: wait for it, or a
        # page-locked ``host`` could be overwritten (by MPI, say) before it is read
        out.set(np.ascontiguousarray(host))
        synchronize(xp)
        return out
    device = device_of(like)
    kw = {} if device is None else {"device": device}
    if is_torch(xp) and host.dtype.name == "bfloat16":  # the same bits, as torch's bfloat16
        bits = xp.from_numpy(np.array(host, copy=True).view(np.int16))
        return bits.view(xp.bfloat16).to(**kw)
    return xp.asarray(np.array(host, copy=True), **kw)


def copy_to_host(src: Any, out: np.ndarray) -> np.ndarray:
    """Write the values of ``src`` (any module, any layout) into the host array ``out``."""
    xp = array_namespace(src)
    if is_numpy(xp):
        out[...] = src
    elif is_cupy(xp):  # pragma: no cover - GPU only
        xp.ascontiguousarray(src).get(out=out)  # blocking: synchronises the current stream
    else:
        out[...] = to_numpy(src)
    return out


def copy_from_host(dst: Any, host: np.ndarray) -> None:
    """Write the values of the host array ``host`` into ``dst`` (any module, any layout)."""
    xp = array_namespace(dst)
    if is_numpy(xp):
        dst[...] = host
    elif is_cupy(xp) and is_c_contiguous(dst):  # pragma: no cover - GPU only
        dst.set(host)  # asynchronous on the current stream: wait before ``host`` is reused
        synchronize(xp)
    elif (view := host_view(dst)) is not None:
        view[...] = host
    else:
        dst[...] = from_numpy(host, dst)


def host_view(a: Any) -> np.ndarray | None:
    """A NumPy array sharing the memory of ``a``, where ``a`` lives in host memory (else None).

    NumPy arrays are returned as they are, PyTorch tensors on the CPU as the
    NumPy view of their memory (same strides, no copy; writes go through).
    Halo exchange, redistribution and the allreduce work on such views, so
    those tensors travel exactly as NumPy arrays do. None for device memory
    and for other modules, whose arrays are copied through
    :func:`copy_to_host` instead (``array_api_strict``'s devices stand in for
    accelerators that way, though their memory is the host's).

    Parameters
    ----------
    a : array
        An array of any module.

    Returns
    -------
    numpy.ndarray or None
        The view; None also for tensors NumPy cannot view (a dtype it lacks,
        a conjugate or negative bit set).
    """
    if isinstance(a, np.ndarray):
        return a
    if is_torch(xp := array_namespace(a)) and a.device.type == "cpu":
        t = a.detach()
        if t.dtype == xp.bfloat16:  # the same bits, as ml_dtypes' bfloat16 (where imported)
            bf = bfloat16()
            return None if bf is None else t.view(xp.int16).numpy().view(bf)
        try:
            return t.numpy()
        except (RuntimeError, TypeError):  # a lazy conjugate or negation
            return None
    return None


def host_empty(shape: tuple[int, ...], dtype: Any, xp: ModuleType) -> np.ndarray:
    """A host array to stage data of the module ``xp`` through (page-locked for CuPy)."""
    dt = numpy_dtype(dtype)
    if is_cupy(xp):  # pragma: no cover - GPU only
        import cupyx

        return cupyx.empty_pinned(shape, dtype=dt)
    return np.empty(shape, dtype=dt)


def synchronize(xp: ModuleType) -> None:
    """Wait until work queued on the current stream of ``xp`` is done (no-op on the host).

    Called before MPI reads or writes device memory: MPI does not order its
    accesses after kernels that are still queued.
    """
    if is_cupy(xp):  # pragma: no cover - GPU only
        xp.cuda.get_current_stream().synchronize()


# Kinds MPI has no element type for, moved as their raw bytes: fixed-width strings
# ('U', 'S'), structured and void records ('V'), datetimes and timedeltas ('M', 'm').
_BYTE_KINDS = "USVMm"


def check_movable(dtype: Any) -> np.dtype:
    """``dtype`` as a NumPy dtype, or a TypeError if a DistArray cannot hold it.

    Every dtype whose values are plain memory can travel between ranks:
    numbers and booleans as MPI element types, fixed-width unicode and bytes
    strings, structured records, datetimes and timedeltas as their bytes.
    Object dtypes (and records with object fields) hold pointers into one
    process's memory, which mean nothing on another rank, so they are
    refused. Pure: the same answer on every rank for the same dtype.

    Parameters
    ----------
    dtype : dtype-like
        The element type.

    Returns
    -------
    numpy.dtype

    Raises
    ------
    TypeError
        For an object dtype, a record with object fields, or a dtype NumPy
        does not know.
    """
    if type(dtype) in _MOVABLE_DTYPE_TYPES:  # a plain numeric NumPy dtype: nothing to check
        return dtype
    dt = numpy_dtype(dtype)
    if dt.hasobject:
        raise TypeError(
            f"a DistArray cannot hold dtype {dt}: object elements are pointers into one "
            "process's memory and cannot move between ranks; use a numeric, boolean, "
            "fixed-width string ('U', 'S') or structured dtype"
        )
    return dt


_MOVABLE_DTYPE_TYPES = frozenset(type(np.dtype(t)) for t in (
    np.float16, np.float32, np.float64, np.complex64, np.complex128, np.bool_, np.int8,
    np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))
"""NumPy's dtype classes of plain numbers (never holding objects): :func:`check_movable`
passes their instances as they are."""


@cache
def mpi_dtype(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype of a NumPy dtype (see :func:`check_movable` for those allowed).

    Strings, records, datetimes and timedeltas map to a contiguous run of
    ``itemsize`` bytes, so they move unchanged (records with their padding).

    Raises
    ------
    TypeError
        For a dtype :func:`check_movable` refuses.
    """
    dt = check_movable(dtype)
    if dt.kind in _BYTE_KINDS:
        t = MPI.BYTE.Create_contiguous(dt.itemsize)
        t.Commit()
        return t
    return from_numpy_dtype(dt)


def mpi_buffer(a: Any) -> Any:
    """``a`` as an mpi4py message: the array itself, or ``[a, datatype]`` for byte kinds.

    mpi4py reads the element type of a NumPy buffer from its format, which it
    cannot map for strings, records, datetimes and timedeltas; those are
    passed with their :func:`mpi_dtype` (a run of bytes).
    """
    dt = getattr(a, "dtype", None)
    if isinstance(dt, np.dtype) and dt.kind in _BYTE_KINDS:
        return [a, mpi_dtype(dt)]
    return a


def data_address(a: Any) -> int:
    """The address of the first element of a host (NumPy) or device (CuPy) array."""
    iface = getattr(a, "__array_interface__", None)
    if iface is None:  # device memory (CuPy): the same layout, a device pointer
        iface = a.__cuda_array_interface__
    return iface["data"][0]


@lru_cache(maxsize=4096)
def _strided_type(
    dtype: np.dtype, shape: tuple[int, ...], strides: tuple[int, ...], offset: int
) -> MPI.Datatype:
    # Merge dimensions that are contiguous with the next one, then nest hvectors.
    dims: list[list[int]] = []
    for n, s in zip(shape, strides):
        if n == 1:
            continue
        dims.append([n, s])
    merged: list[list[int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == n * s:
            merged[-1] = [merged[-1][0] * n, s]
        else:
            merged.append([n, s])
    base = mpi_dtype(dtype)
    t = base
    itemsize = dtype.itemsize
    owned: list[MPI.Datatype] = []
    for i, (n, s) in enumerate(reversed(merged)):
        if i == 0 and s == itemsize:
            t = t.Create_contiguous(n)
        else:
            t = t.Create_hvector(n, 1, s)
        owned.append(t)
    final = t.Create_struct([1], [offset], [t])
    final.Commit()
    for o in owned:
        o.Free()
    return final


def view_datatype(base: Any, view: Any) -> MPI.Datatype:
    """An MPI datatype that selects ``view`` out of the memory of ``base``.

    ``view`` must be a (possibly strided, possibly reversed) view into the
    memory of the C-contiguous array ``base``; a message ``[base, 1, type]``
    then sends or receives exactly the elements of ``view``, in its order,
    without a packing copy. Datatypes are committed once and cached by layout.
    ``base`` may live in device memory (CuPy) for an MPI library that reads
    it (see :func:`disttensor.gpu_aware_mpi`).
    """
    offset = data_address(view) - data_address(base)
    return _strided_type(numpy_dtype(view.dtype), tuple(view.shape), tuple(view.strides), offset)
