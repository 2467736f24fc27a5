"""16-bit activations: the precision names, a model's activation dtype, and loss scaling.

A model trains in one of :data:`PRECISIONS`:

* ``"fp32"``: every array float32 (the parameters' dtype);
* ``"bf16"``: activations, saved tensors, halos and redistributed blocks in
  bfloat16 (NumPy's dtype from the ``ml_dtypes`` package), parameters,
  their gradients, optimizer state, batch-norm statistics and every
  reduction in float32;
* ``"fp16"``: the same in IEEE float16, with dynamic loss scaling
  (:class:`GradScaler`) so that small gradients do not underflow.

:func:`set_precision` sets the activation dtype of every layer of a model
(``Layer.activation_dtype``); a layer with parameters then takes inputs of
that dtype and gives outputs of it. Each layer's kernels run in the 16-bit
dtype where its backend has a 16-bit kernel for the device (PyTorch's
bfloat16 kernels on CPUs and GPUs, float16 on GPUs: :func:`compute_dtype`),
and otherwise in float32 on converted blocks, one layer at a time, which
keeps the memory and the bytes moved in 16 bits; the plan table says which.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor.backend import array_namespace, astype, empty, is_cupy, numpy_dtype, to_numpy

try:  # bfloat16 as a NumPy dtype: the ``ml_dtypes`` package (the torch and test extras)
    import ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None

__all__ = ["PRECISIONS", "BF16_HINT", "precision_dtype", "precision_of", "set_precision",
           "activation_dtype", "is_half", "compute_dtype", "io_dtype", "kernel_dtype", "to_dtype",
           "GradScaler"]

PRECISIONS = ("fp32", "bf16", "fp16")
"""The names :func:`set_precision` and ``--precision`` take."""

BF16_HINT = 'bfloat16 arrays need the ml_dtypes package: pip install "disttensor[torch]"'
"""What the ImportError for ``"bf16"`` without ``ml_dtypes`` says."""

_HALF_KINDS = {"bfloat16": "bf16", "float16": "fp16"}


def precision_dtype(precision: str) -> np.dtype:
    """The NumPy dtype of the activations in ``precision`` (one of :data:`PRECISIONS`).

    Raises
    ------
    ValueError
        For a name not in :data:`PRECISIONS`.
    ImportError
        For ``"bf16"`` without the ``ml_dtypes`` package (:data:`BF16_HINT`).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of "
                         f"{', '.join(PRECISIONS)}")
    if precision == "fp32":
        return np.dtype(np.float32)
    if precision == "fp16":
        return np.dtype(np.float16)
    if ml_dtypes is None:
        raise ImportError(BF16_HINT)
    return np.dtype(ml_dtypes.bfloat16)


def is_half(dtype: Any) -> bool:
    """Whether ``dtype`` is a 16-bit floating dtype (bfloat16 or float16)."""
    try:
        d = np.dtype(dtype)
    except TypeError:
        return str(dtype).rpartition(".")[2] in _HALF_KINDS
    # the kind first: a dtype's name is slow to make, and only these two kinds can match
    return d.itemsize == 2 and d.kind in "fV" and d.name in _HALF_KINDS


def precision_of(dtype: Any) -> str:
    """The precision name of an activation dtype (``"fp32"`` for float32 and float64)."""
    return _HALF_KINDS.get(numpy_dtype(dtype).name, "fp32")


def set_precision(model: Any, precision: str) -> Any:
    """Run ``model`` (every layer of it) with activations in ``precision``; returns it.

    The parameters stay in their own dtype (float32 master weights); layers
    with parameters take inputs of the new activation dtype, cast their
    weights to it for their kernels, and add their weight gradients to the
    parameters' in the parameters' dtype. ``"fp32"`` restores the parameters'
    dtype. Nothing is changed when the name is refused.

    Raises
    ------
    ValueError, ImportError
        As :func:`precision_dtype`.
    """
    dt = precision_dtype(precision)
    half = dt if is_half(dt) else None
    for layer in model.modules():
        layer.activation_dtype = half
    return model


def activation_dtype(model: Any, default: Any = np.float32) -> np.dtype:
    """The activation dtype :func:`set_precision` gave ``model`` (``default`` when none)."""
    for layer in model.modules():
        if layer.activation_dtype is not None:
            return np.dtype(layer.activation_dtype)
    params = list(model.parameters())
    return numpy_dtype(params[0].dtype) if params else np.dtype(default)


def compute_dtype(dtype: Any, backend: str | None, device: str = "cpu") -> np.dtype:
    """The dtype a layer's kernels compute blocks of ``dtype`` in, on ``backend``.

    16-bit blocks run in their own dtype where the backend has kernels for it
    (``"torch"``: bfloat16 on CPUs and GPUs, float16 on GPUs); otherwise
    (the NumPy kernels, and PyTorch's float16 on a CPU, which is a slow
    reference loop) in float32 on converted blocks. Other dtypes run as they are.
    """
    dt = numpy_dtype(dtype)
    if not is_half(dt):
        return dt
    if backend == "torch" and (dt.name == "bfloat16" or device == "gpu"):
        return dt
    return np.dtype(np.float32)


def io_dtype(layer: Any) -> np.dtype:
    """The dtype of ``layer``'s inputs and outputs: its activation dtype, else its parameters'."""
    act = layer.activation_dtype
    return numpy_dtype(layer.dtype if act is None else act)


def kernel_dtype(layer: Any, like: Any) -> np.dtype:
    """The dtype ``layer`` computes the array ``like`` in (``Layer.compute_dtype``)."""
    return layer.compute_dtype(numpy_dtype(like.dtype), layer.kernel_backend,
                               "gpu" if is_cupy(array_namespace(like)) else "cpu")


def to_dtype(a: Any, dtype: Any) -> Any:
    """``a`` in ``dtype``: ``a`` itself when it has it, else a converted copy.

    A NumPy copy is a block of the active block cache (:func:`disttensor.backend.empty`),
    so that a layer converting large blocks each step reuses their memory (a fresh
    allocation would fault in its pages every time).
    """
    if a is None or numpy_dtype(a.dtype) == numpy_dtype(dtype):
        return a
    if isinstance(a, np.ndarray):
        out = empty(np, a.shape, numpy_dtype(dtype))
        np.copyto(out, a, casting="unsafe")
        return out
    return astype(a, dtype)


def _nonfinite(g: Any) -> bool:
    if g is None or g.size == 0:
        return False
    xp = array_namespace(g)
    return not bool(to_numpy(xp.all(xp.isfinite(g))))


class GradScaler:
    """Dynamic loss scaling for float16 activations, as ``torch.amp.GradScaler``.

    The loss gradient is multiplied by the scale before backward (pass
    ``scale=scaler.get_scale()`` to a loss's ``backward``, or multiply a
    gradient by :meth:`scale`), so that small gradients stay representable in
    float16. :meth:`step` unscales the gradients (unless :meth:`unscale_` did
    already) and skips the optimizer's step when any gradient on any rank is
    infinite or NaN; :meth:`update` then halves the scale after a skipped step
    and doubles it after ``growth_interval`` steps without one. Every rank
    takes the same decision (one allreduce over ``comm``).

    Parameters
    ----------
    init_scale : float
        The first scale (torch's default, 2**16).
    growth_factor, backoff_factor : float
        The factors after ``growth_interval`` good steps and after a skipped one.
    growth_interval : int
        Good steps between growths.
    enabled : bool
        When False, every method does nothing (the scale is 1).
    comm : MPI communicator
        The ranks of the model (default ``COMM_WORLD``).

    Attributes
    ----------
    skipped_steps : int
        Steps skipped so far for non-finite gradients.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, comm: Any = None):
        for name, v, low in (("init_scale", init_scale, 0.0),
                             ("growth_factor", growth_factor, 1.0)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > low):
                raise ValueError(f"GradScaler: {name} must be a finite number > {low}, got {v!r}")
        if not (isinstance(backoff_factor, (int, float)) and 0.0 < backoff_factor < 1.0):
            raise ValueError(f"GradScaler: backoff_factor must be in (0, 1), got "
                             f"{backoff_factor!r}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"GradScaler: growth_interval must be a positive integer, got "
                             f"{growth_interval!r}")
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = growth_interval
        self.enabled = bool(enabled)
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.skipped_steps = 0
        self._good = 0
        self._unscaled: set[int] = set()
        self._found_inf: bool | None = None

    def is_enabled(self) -> bool:
        """Whether the scaler scales."""
        return self.enabled

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale(self, value: Any) -> Any:
        """``value`` (a number, an array or a DistArray) times the current scale."""
        return value * self._scale if self.enabled else value

    def _params(self, optimizer: Any) -> list[Any]:
        return list(optimizer.params)

    def unscale_(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale, and find non-finite ones (collective).

        Call it before clipping the gradients; at most once per step.

        Raises
        ------
        RuntimeError
            When called twice for one optimizer before :meth:`update`.
        """
        if not self.enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("GradScaler.unscale_ was already called for this optimizer "
                               "since the last update()")
        params = self._params(optimizer)
        inv = 1.0 / self._scale
        for p in params:
            if p.grad is not None:
                p.grad *= inv
        bad = any(_nonfinite(p.grad) for p in params)
        self._found_inf = bool(self.comm.allreduce(int(bad), op=MPI.MAX))
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: Any) -> bool:
        """Unscale if not done, then run ``optimizer.step()`` unless a gradient was not finite.

        Returns
        -------
        bool
            Whether the step was taken (the same on every rank).
        """
        if not self.enabled:
            optimizer.step()
            return True
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self._found_inf:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self, new_scale: float | None = None) -> None:
        """Adjust the scale after a step (see the class); ``new_scale`` sets it instead."""
        if not self.enabled:
            return
        if new_scale is not None:
            if not (isinstance(new_scale, (int, float)) and math.isfinite(new_scale)
                    and new_scale > 0):
                raise ValueError(f"GradScaler.update: new_scale must be a positive number, "
                                 f"got {new_scale!r}")
            self._scale = float(new_scale)
        elif self._found_inf:
            self._scale *= self.backoff_factor
            self._good = 0
        elif self._found_inf is not None:
            self._good += 1
            if self._good >= self.growth_interval:
                self._scale *= self.growth_factor
                self._good = 0
        self._found_inf = None
        self._unscaled.clear()

    def state_dict(self) -> dict[str, Any]:
        """The scale and its counters (torch's keys), for checkpoints."""
        if not self.enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._good, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values.

        Raises
        ------
        RuntimeError
            For an empty state loaded into an enabled scaler.
        """
        if not state:
            if self.enabled:
                raise RuntimeError("GradScaler.load_state_dict: the state is empty (saved "
                                   "from a disabled scaler)")
            return
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._good = int(state["_growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

