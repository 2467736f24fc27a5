"""Moving a model's state between array modules (host NumPy arrays, CuPy arrays on a GPU)."""

from __future__ import annotations

from types import ModuleType

from .module import Layer

__all__ = ["to_array_module"]


def to_array_module(model: Layer, xp: ModuleType) -> Layer:
    """Move every parameter (data and gradient) and buffer of ``model`` to ``xp``: ``model.to(xp)``.

    Layers compute with their input's array module, and their parameters
    must live there too: call ``to_array_module(model, cupy)`` before feeding
    the model DistArrays whose blocks are CuPy arrays (``to_array_module(model,
    numpy)`` brings it back). See :meth:`Layer.to <disttensor_nn.Layer.to>`.

    Parameters
    ----------
    model : Layer
    xp : module
        The target array module (``numpy``, ``cupy`` or another array API namespace).

    Returns
    -------
    Layer
        ``model`` itself.
    """
    return model.to(xp)
