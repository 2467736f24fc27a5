"""Argument checks that every rank passes or fails alike, before any communication: a
layer's input (:func:`check_input`, :func:`check_input_layout`), the gradient given to its backward
(:func:`check_grad`), integer options (:func:`check_int`) and whether its kernel backend
runs the input (:func:`check_kernels`)."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from disttensor import DistArray, Distribution, backend
from disttensor.backend import numpy_dtype

from .kernels import check_backend, layer_supports

__all__ = ["check_input", "check_input_layout", "check_grad", "check_int", "check_kernels",
           "check_kernels_on"]


def check_input(x: Any, ndim: int, name: str, channels: int | None = None,
                dtype: Any = None, *, split_channels: bool = False) -> None:
    """Validate a layer input identically on every rank (shape and dtype are global facts).

    The channel dimension may be split only where ``split_channels`` is True
    (layers that handle channel slices: convolution, pooling, batch norm).
    """
    if not isinstance(x, DistArray):
        raise TypeError(f"{name} expects a DistArray, got {type(x).__name__}")
    check_input_layout(x.dist, x.dtype, ndim, name, channels, dtype,
                       split_channels=split_channels)


def check_input_layout(dist: Distribution, dtype: Any, ndim: int, name: str,
                       channels: int | None = None, want: Any = None, *,
                       split_channels: bool = False) -> None:
    """:func:`check_input` of an input distributed as ``dist`` with elements of ``dtype``
    (``want`` the dtype the layer takes, None: any): what a layer may check once per
    distribution (:func:`disttensor_nn.module.derived`)."""
    shape = dist.global_shape
    if len(shape) != ndim:
        raise ValueError(f"{name} expects a {ndim}-D input (N, C, ...), got shape {shape}")
    if channels is not None and shape[1] != channels:
        raise ValueError(f"{name} expects {channels} channels, got {shape[1]}")
    if ndim >= 2 and dist.nblocks[1] > 1 and not split_channels:
        raise ValueError(f"{name}: the channel dimension must not be split, got {dist}")
    if want is not None and dtype != np.dtype(want):
        raise TypeError(f"{name} takes {np.dtype(want)} inputs but the input is {dtype}")


def check_grad(dy: Any, out: tuple[Distribution, Any] | None, name: str) -> DistArray:
    """Validate the gradient ``dy`` of an output made by ``forward`` (identically on every rank).

    The shape, dtype and grid are global facts, so every rank reaches the same
    verdict before any communication.

    Parameters
    ----------
    dy : DistArray
        The gradient given to ``backward``.
    out : (Distribution, dtype) or None
        The distribution and dtype of the forward output, None when there is
        no forward output to take the gradient of.
    name : str
        What is called, for the messages (``"Conv2d.backward"``).

    Returns
    -------
    DistArray
        ``dy`` itself, or ``dy`` redistributed to the output's distribution
        when it has the right shape and dtype in another distribution over
        the same processes (collective then).

    Raises
    ------
    RuntimeError
        When there is no forward output (``backward`` before ``forward``, or
        after a forward call that raised).
    TypeError
        When ``dy`` is not a DistArray or has another dtype than the output.
    ValueError
        When ``dy`` has another shape than the output, or lives on other
        processes.
    """
    if out is None:
        raise RuntimeError(f"{name} called before a successful forward call: there is no "
                           "output to take the gradient of")
    dist, dtype = out
    if not isinstance(dy, DistArray):
        raise TypeError(f"{name} expects the output gradient as a DistArray, got "
                        f"{type(dy).__name__}")
    if dy.shape != dist.global_shape:
        raise ValueError(f"{name}: the gradient has shape {dy.shape} but the output of forward "
                         f"has shape {dist.global_shape}")
    if numpy_dtype(dy.dtype) != numpy_dtype(dtype):
        raise TypeError(f"{name}: the gradient is {numpy_dtype(dy.dtype)} but the output of "
                        f"forward is {numpy_dtype(dtype)}")
    if dy.dist == dist:
        return dy
    if not dy.grid.same_processes(dist.grid.comm):
        raise ValueError(f"{name}: the gradient lives on other processes than the output "
                         f"of forward ({dy.grid} vs {dist.grid})")
    return dy.redistribute(dist)


def check_int(value: Any, name: str, low: int = 1) -> int:
    """``value`` as an int if it is an integer (not a bool) ``>= low``; otherwise a clear error.

    Raises
    ------
    TypeError
        For a bool, a float or anything else that is not an integer.
    ValueError
        For an integer below ``low``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


# layer: a Layer (typed Any: disttensor_nn.module imports this module, not the reverse)
def check_kernels(layer: Any, x: DistArray) -> None:
    """Refuse an input that ``layer``'s kernel backend cannot run (before any message).

    Raises
    ------
    TypeError
        Naming the layer, the backend, the dtype and the device, e.g. a
        float16 convolution with the torch kernels on a CPU.
    ImportError
        For a backend whose library is not installed, naming the extra.
    """
    check_kernels_on(layer, x.dtype, "cpu" if backend.is_numpy(x.xp) else "gpu")


def check_kernels_on(layer: Any, dtype: Any, device: str) -> None:
    """:func:`check_kernels` of an input of ``dtype`` on ``device`` (``"cpu"``: NumPy
    blocks; ``"gpu"``: others)."""
    name = check_backend(layer.kernel_backend)
    # 16-bit activations run in float32 on converted blocks where the kernels have no
    # 16-bit version (Layer.compute_dtype): the dtype the kernels see is checked
    if not layer_supports(layer, name, dtype, device):
        raise TypeError(f"{type(layer).__name__}: the {name} kernels do not run {dtype} "
                        f"arrays on the {device}; use kernel_backend='numpy' for this layer")
