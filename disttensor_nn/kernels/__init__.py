"""Local compute kernels, one module per array backend, chosen by the array's module.

A kernel module provides ``conv_forward``, ``conv_backward``,
``pool_forward``, ``pool_backward`` and ``out_shape`` with the signatures of
:mod:`disttensor_nn.kernels.numpy_kernels`; layers call :func:`kernels_for`
on their local arrays:

* NumPy arrays: :mod:`~disttensor_nn.kernels.numpy_kernels` (tiled im2col and
  BLAS, tuned for CPUs);
* CuPy arrays: :mod:`~disttensor_nn.kernels.cupy_kernels` (cuDNN through the
  ``nvidia-cudnn-frontend`` package where it is importable, else im2col and
  cuBLAS);
* other array modules with the NumPy functions they use (``as_strided``
  views, ``out=``): the generic :mod:`~disttensor_nn.kernels.xp_kernels`;
* any other array API library: :mod:`~disttensor_nn.kernels.array_api_kernels`,
  which use only the standard (slower; it is how the suite runs the layers on
  ``array_api_strict``).

A layer may also name its kernels (``layer.kernel_backend``, set by a plan or
by :func:`use_kernels`): ``"torch"`` runs them through PyTorch
(:mod:`~disttensor_nn.kernels.torch_kernels`: oneDNN on CPUs, cuDNN on GPUs)
on the layer's own NumPy or CuPy blocks, without a copy; ``"numpy"`` or None
picks by the array's module as above. :data:`BACKENDS` lists the names,
:func:`available_backends` those this process can run.

Timers of GPU work call :func:`synchronize` before reading the clock.
:func:`set_num_threads` sets the threads each rank's kernels use: a pool for
the NumPy kernels (parts of the batch at once) and PyTorch's intra-op threads.
"""

from __future__ import annotations

import copy
import weakref
from types import ModuleType
from typing import Any

from disttensor import limit_blas_threads
from disttensor.backend import array_namespace, is_cupy, is_numpy
from disttensor.backend import synchronize as backend_synchronize

from . import array_api_kernels, cupy_kernels, numpy_kernels, torch_kernels, xp_kernels

__all__ = ["kernels_for", "synchronize", "set_num_threads", "get_num_threads", "BACKENDS",
           "available_backends", "check_backend", "with_backend", "use_kernels",
           "backend_supports", "layer_supports", "limit_threads", "threads_now",
           "optimizer_backend"]

BACKENDS = ("numpy", "torch")
"""Names of the kernel backends a layer may name (``layer.kernel_backend``)."""

get_num_threads = numpy_kernels.get_num_threads


def set_num_threads(n: int) -> None:
    """Run each rank's kernels on ``n`` threads: the NumPy kernels' pool and PyTorch's.

    Raises
    ------
    ValueError
        If ``n`` is not a positive integer.
    """
    numpy_kernels.set_num_threads(n)
    torch_kernels.set_num_threads(n)


def limit_threads(threads: int | None = None, comm: Any = None,
                  kernels: str | None = None) -> int:
    """Set this rank's kernel threads; returns the count.

    Collective over ``comm`` when ``threads`` is None: the default is the
    cores this process may use divided by the ranks of its node
    (:func:`disttensor.limit_blas_threads`), so ranks x threads stays within
    the cores. PyTorch's intra-op pool gets them. Where PyTorch's kernels
    may run (``kernels`` other than ``"numpy"``, PyTorch installed) the BLAS
    library keeps one thread and the NumPy kernels' own pool
    (:func:`set_num_threads`) takes the others: a multi-threaded BLAS's
    workers spin for a while after every call, on the cores PyTorch's
    threads then need (mesh-demo, 1 rank x 2 threads, NumPy and torch
    kernels mixed: 185 ms a step against 75 ms). With ``kernels="numpy"``,
    or without PyTorch, BLAS takes the threads and the pool keeps one (with
    BLAS threads it would oversubscribe the cores).
    """
    n = limit_blas_threads(threads, comm)
    pool = kernels != "numpy" and torch_kernels.available() and n > 1
    if pool:
        limit_blas_threads(1)
    numpy_kernels.set_num_threads(n if pool else 1)
    torch_kernels.set_num_threads(n)
    _limited[0] = 1 if pool else n
    return n


_limited = [0]  # the threads limit_threads gave BLAS and PyTorch (0: never called)


def threads_now() -> tuple[int, int]:
    """(the NumPy kernels' pool threads, BLAS's threads as :func:`limit_threads` last set
    them, 0 if it was never called): what a kernel time depends on besides its shape (the
    kernel timer keys its times by it; PyTorch's threads are the larger of the two)."""
    return get_num_threads(), _limited[0]


def available_backends() -> tuple[str, ...]:
    """The backends of :data:`BACKENDS` this process can run (``"torch"`` needs PyTorch)."""
    return tuple(b for b in BACKENDS if b != "torch" or torch_kernels.available())


def optimizer_backend(backends: Any) -> str | None:
    """The kernels an optimizer's update runs (:attr:`disttensor_nn.optim.Optimizer.
    kernel_backend`) where layers choose among ``backends``: ``"torch"`` when it is one
    of them (PyTorch's element-wise kernels spread an update over its intra-op threads),
    else None (the array module's). The training driver sets its optimizer's, and the
    cost model times the update, by this one rule."""
    return "torch" if backends and "torch" in backends else None


def check_backend(name: str | None) -> str | None:
    """Validate a backend name (None: by the array's module); returns it.

    Raises
    ------
    ValueError
        For a name not in :data:`BACKENDS`.
    ImportError
        For ``"torch"`` without PyTorch, naming the extra that installs it.
    """
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {list(BACKENDS)}")
    if name == "torch":
        torch_kernels.require()
    return name


def backend_supports(name: str | None, dtype: Any, device: str = "cpu") -> bool:
    """Whether backend ``name`` runs arrays of ``dtype`` on ``device`` (``"cpu"``/``"gpu"``)."""
    return name != "torch" or torch_kernels.supports(dtype, device)


def layer_supports(layer: Any, name: str | None, dtype: Any, device: str = "cpu") -> bool:
    """Whether ``layer``'s kernels in backend ``name`` run its blocks of ``dtype``.

    Under 16-bit activations (``layer.activation_dtype``) the kernels see
    the dtype the layer computes in (``Layer.compute_dtype``: float32 on
    converted blocks where the backend has no 16-bit kernel), else ``dtype``.
    """
    if getattr(layer, "activation_dtype", None) is not None:
        dtype = layer.compute_dtype(dtype, name, device)
    return backend_supports(name, dtype, device)


_variants: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def with_backend(layer: Any, name: str | None) -> Any:
    """``layer`` itself if it names ``name`` already, else a shallow copy that does.

    The copy shares the layer's parameters and state and is meant for the
    planner's questions (its cost spec, its kernels' times), not for
    training; it is kept while ``layer`` lives, so that asking again returns
    the same copy.
    """
    if getattr(layer, "kernel_backend", None) == name:
        return layer
    per = _variants.setdefault(layer, {})
    if name not in per:
        twin = copy.copy(layer)
        object.__setattr__(twin, "kernel_backend", name)
        per[name] = twin
    return per[name]


def use_kernels(model: Any, name: str | None) -> None:
    """Name backend ``name`` on every layer of ``model`` whose kernels it can run.

    Layers list the backends they have kernels in (``kernel_backends``);
    the others keep theirs. None goes back to the array module's kernels.

    Raises
    ------
    ValueError, ImportError
        As :func:`check_backend`, before any layer changes.
    """
    check_backend(name)
    for _, layer in model.named_modules():
        if name is None or name in getattr(layer, "kernel_backends", ()):
            layer.kernel_backend = name

# what the generic kernels need of an array module (besides array methods)
_GENERIC_NEEDS = ("empty", "zeros", "matmul", "ascontiguousarray", "take_along_axis", "where")
# what the standard-only kernels need of an array module
_STANDARD_NEEDS = ("zeros", "stack", "concat", "reshape", "permute_dims", "matrix_transpose",
                   "matmul", "sum", "mean", "max", "argmax", "where", "astype", "result_type")


def kernels_for(array: Any, backend: str | None = None) -> ModuleType:
    """The kernel module for ``array``'s array library, or of the named ``backend``.

    Raises
    ------
    NotImplementedError
        For an array library that is not an array API namespace (it lacks
        ``stack``, ``matmul``, ``permute_dims``, ...).
    ImportError
        For ``backend="torch"`` without PyTorch, naming the extra.
    """
    if backend == "torch":
        torch_kernels.require()
        return torch_kernels
    xp = array_namespace(array)
    if is_numpy(xp):
        return numpy_kernels
    if is_cupy(xp):
        return cupy_kernels
    strided = getattr(getattr(getattr(xp, "lib", None), "stride_tricks", None), "as_strided", None)
    if strided is not None and all(hasattr(xp, name) for name in _GENERIC_NEEDS):
        return xp_kernels
    missing = [name for name in _STANDARD_NEEDS if not hasattr(xp, name)]
    if not missing:
        return array_api_kernels
    raise NotImplementedError(
        f"no local kernels for arrays of {getattr(xp, '__name__', xp)}: its array module lacks "
        f"{', '.join(missing)} (the array API standard's functions the kernels use)")


def synchronize(xp: Any = None) -> None:
    """Wait until the kernels queued on ``xp`` (an array module or an array) have finished.

    A no-op for NumPy (and for None); for CuPy it synchronises the current
    stream (:func:`disttensor.backend.synchronize`), so that a host timer
    around a kernel call measures the kernel.
    """
    if xp is None:
        return
    if not isinstance(xp, ModuleType):
        xp = array_namespace(xp)
    backend_synchronize(xp)
