"""Local compute kernels, one module per array backend, chosen by the array's module.

A kernel module provides ``conv_forward``, ``conv_backward``,
``pool_forward`` and ``pool_backward`` with the signatures of
:mod:`disttensor_nn.kernels.numpy_kernels`; layers call
:func:`kernels_for` on their local arrays, so a GPU module plugs in here
without changes to the layers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from disttensor.backend import array_namespace, is_numpy

__all__ = ["kernels_for"]


def kernels_for(array: Any) -> ModuleType:
    """The kernel module for ``array``'s array library.

    Raises
    ------
    NotImplementedError
        For array libraries without kernels yet.
    """
    xp = array_namespace(array)
    if is_numpy(xp):
        from . import numpy_kernels

        return numpy_kernels
    raise NotImplementedError(f"no local kernels for arrays of {xp.__name__} yet")
