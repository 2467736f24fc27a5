"""Array modules and MPI buffers: the one place that knows NumPy from other array libraries."""

from __future__ import annotations

from functools import cache, lru_cache
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

__all__ = ["array_namespace", "is_numpy", "to_numpy", "view_datatype", "mpi_dtype"]


def array_namespace(x: Any) -> ModuleType:
    """The array module of ``x`` (``numpy`` for NumPy arrays and scalars)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return np
    ns = getattr(x, "__array_namespace__", None)
    if ns is not None:
        return ns()
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":  # pragma: no cover - GPU only
        import cupy

        return cupy
    return np


def is_numpy(xp: ModuleType) -> bool:
    """Whether ``xp`` is NumPy itself."""
    return xp is np or getattr(xp, "__name__", "") == "numpy"


def to_numpy(x: Any) -> np.ndarray:
    """Copy or view ``x`` as a NumPy array in host memory."""
    if isinstance(x, np.ndarray):
        return x
    get = getattr(x, "get", None)  # CuPy
    if get is not None and type(x).__module__.startswith("cupy"):  # pragma: no cover
        return get()
    return np.asarray(x)


@cache
def mpi_dtype(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype of a NumPy dtype."""
    return from_numpy_dtype(np.dtype(dtype))


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


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


def view_datatype(base: np.ndarray, view: np.ndarray) -> MPI.Datatype:
    """An MPI datatype that selects ``view`` out of the memory of ``base``.

    ``view`` must be a (possibly strided, possibly reversed) view into the
    memory of the C-contiguous array ``base``; a message ``[base, 1, type]``
    then sends or receives exactly the elements of ``view``, in its order,
    without a packing copy. Datatypes are committed once and cached by layout.
    """
    offset = _address(view) - _address(base)
    return _strided_type(view.dtype, view.shape, view.strides, offset)
