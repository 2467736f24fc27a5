"""SGD with momentum, weight decay and Nesterov, identical on every rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from disttensor.backend import array_namespace, as_module, astype, contiguous, device_of, to_numpy

from .module import Parameter, full_array, local_block

__all__ = ["SGD"]


def _like(ref: Any, buf: Any) -> Any:
    """A copy of ``buf`` in the array module and on the device of ``ref``."""
    moved = as_module(buf, array_namespace(ref), device_of(ref))
    return contiguous(moved, copy=True) if moved is buf else moved


class SGD:
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    Gradients of replicated parameters are already summed over ranks by the
    layers' backward passes, so every rank applies the same update and the
    parameters stay identical without further communication. The
    parameters' arrays may be of any array module (NumPy, CuPy, an array API
    namespace); the momentum buffers live beside them. A sharded parameter's
    (``Parameter.dist``) momentum buffer is sharded the same way, and
    follows the parameter when a layer re-splits it.

    Parameters
    ----------
    params : iterable of Parameter
    lr : float
    momentum, dampening, weight_decay : float
    nesterov : bool
    """

    def __init__(self, params: Iterable[Parameter], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        self.params = list(params)
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0")
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self.state: list[Any | None] = [None] * len(self.params)
        self._dists: list[Any] = [p.dist for p in self.params]  # the buffers' splits

    def step(self) -> None:
        """Update every parameter from its gradient.

        Raises
        ------
        RuntimeError
            When gradient parts kept back by :func:`~disttensor_nn.no_sync`
            have not been reduced by a backward pass outside it (the update
            would use gradients that differ from rank to rank). Nothing is
            updated then.
        """
        if any(p.unreduced is not None for p in self.params):
            raise RuntimeError("SGD.step: gradients accumulated under no_sync are not reduced "
                               "yet; run the last micro-batch's backward outside no_sync")
        for i, p in enumerate(self.params):
            g = p.grad
            if self.weight_decay:
                g = g + self.weight_decay * p.data
            if self.momentum:
                buf = self.state[i]
                if buf is not None and self._dists[i] != p.dist:  # the layer re-split p
                    buf = self.state[i] = local_block(full_array(buf, self._dists[i]), p.dist)
                self._dists[i] = p.dist
                if buf is None:
                    buf = self.state[i] = contiguous(g, copy=True)
                else:
                    if array_namespace(buf) is not array_namespace(g):  # the model moved
                        buf = self.state[i] = _like(g, buf)
                    buf *= self.momentum
                    buf += (1 - self.dampening) * g
                g = g + self.momentum * buf if self.nesterov else buf
            update = self.lr * g
            if update.dtype != p.data.dtype:
                update = astype(update, p.data.dtype)
            p.data -= update

    def zero_grad(self) -> None:
        """Zero every parameter's gradient."""
        for p in self.params:
            p.zero_grad()

    def state_dict(self) -> dict:
        """Momentum buffers (NumPy copies, by parameter order) and hyper-parameters.

        ``state[i]`` is the buffer of ``params[i]`` (None before its first
        step), copied to host memory whatever module the parameters use, so
        that checkpoints can store it. Buffers of sharded parameters are
        given whole (gathered: the call is then collective), so that they
        load under any other split.
        """
        return {"state": [None if b is None else
                          np.array(to_numpy(full_array(b, d)), copy=True)
                          for b, d in zip(self.state, self._dists)],
                "lr": self.lr, "momentum": self.momentum}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (buffers go to their parameters' array module).

        Whole buffers; a sharded parameter keeps its block of its buffer.
        """
        self.state = [None if b is None else
                      _like(p.data, b if p.dist is None else b[p.dist.local_slices()])
                      for p, b in zip(self.params, state["state"])]
        self._dists = [p.dist for p in self.params]
        self.lr, self.momentum = state["lr"], state["momentum"]
