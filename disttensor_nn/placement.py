"""Moving a model's state between array modules (host NumPy arrays, CuPy arrays on a GPU)."""

from __future__ import annotations

from types import ModuleType

from disttensor.backend import as_module

from .module import BUFFER_ATTRS, Layer

__all__ = ["to_array_module"]


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
    for p in model.parameters():  # a shared parameter is already in xp the second time
        p.data = as_module(p.data, xp)
        p.grad = as_module(p.grad, xp)
    for layer in model.layers():
        for attr in BUFFER_ATTRS:
            value = getattr(layer, attr, None)
            if value is not None and hasattr(value, "shape"):
                setattr(layer, attr, as_module(value, xp))
    return model
