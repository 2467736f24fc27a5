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

Timers of GPU work call :func:`synchronize` before reading the clock.
:func:`set_num_threads` gives the NumPy kernels a pool of threads (parts of
the batch at once).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from disttensor.backend import array_namespace, is_cupy, is_numpy
from disttensor.backend import synchronize as backend_synchronize

from . import array_api_kernels, cupy_kernels, numpy_kernels, xp_kernels

__all__ = ["kernels_for", "synchronize", "set_num_threads", "get_num_threads"]

set_num_threads = numpy_kernels.set_num_threads
get_num_threads = numpy_kernels.get_num_threads

# what the generic kernels need of an array module (besides array methods)
_GENERIC_NEEDS = ("empty", "zeros", "matmul", "ascontiguousarray", "take_along_axis", "where")
# what the standard-only kernels need of an array module
_STANDARD_NEEDS = ("zeros", "stack", "concat", "reshape", "permute_dims", "matrix_transpose",
                   "matmul", "sum", "mean", "max", "argmax", "where", "astype", "result_type")


def kernels_for(array: Any) -> ModuleType:
    """The kernel module for ``array``'s array library.

    Raises
    ------
    NotImplementedError
        For an array library that is not an array API namespace (it lacks
        ``stack``, ``matmul``, ``permute_dims``, ...).
    """
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
