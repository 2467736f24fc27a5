"""Moving a model's state between array modules (host NumPy arrays, CuPy arrays on a GPU)."""

from __future__ import annotations

from types import ModuleType

from disttensor.backend import as_module

from .module import Layer

__all__ = ["to_array_module"]

BUFFER_ATTRS = ("running_mean", "running_var")
"""Layer attributes that hold non-trainable state arrays (batch-norm running statistics)."""


def _layers(layer: Layer):
    yield layer
    for child in layer.children():
        yield from _layers(child)


def to_array_module(model: Layer, xp: ModuleType) -> Layer:
    """Move every parameter (data and gradient) and running statistic of ``model`` to ``xp``.

    Layers compute with their input's array module, and their parameters
    must live there too: call ``to_array_module(model, cupy)`` before feeding
    the model DistArrays whose blocks are CuPy arrays (``to_array_module(model,
    numpy)`` brings it back). Arrays already in ``xp`` are kept as they are.
    An optimiser's momentum buffers follow on its next step only if it has
    none yet, so move the model before creating the optimiser.

    Parameters
    ----------
    model : Layer
    xp : module
        The target array module (``numpy`` or ``cupy``).

    Returns
    -------
    Layer
        ``model`` itself.
    """
    seen: set[int] = set()
    for layer in _layers(model):
        for p in layer.own_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            p.data = as_module(p.data, xp)
            p.grad = as_module(p.grad, xp)
        for attr in BUFFER_ATTRS:
            value = getattr(layer, attr, None)
            if value is not None and hasattr(value, "shape"):
                setattr(layer, attr, as_module(value, xp))
    return model
