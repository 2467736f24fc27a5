"""SGD with momentum, weight decay and Nesterov, identical on every rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from disttensor.backend import array_namespace, astype

from ..kernels import torch_kernels
from ..parameter import Parameter
from .optimizer import CHUNK, Optimizer, _like, _scaled, add_scaled_, by_chunks, check_number

__all__ = ["SGD"]


class SGD(Optimizer):
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
        Learning rate, > 0.
    momentum, dampening, weight_decay : float
        Each >= 0.
    nesterov : bool

    Notes
    -----
    With :attr:`~Optimizer.kernel_backend` ``"torch"`` a NumPy parameter of
    float32 or float64 and more than :data:`~disttensor_nn.optim.optimizer.CHUNK`
    elements is updated by ATen's in-place element-wise kernels over
    PyTorch's threads (``torch.optim.SGD``'s arithmetic); otherwise by the
    array module in one sweep over cache-sized pieces shared out over the
    NumPy kernels' threads (a small one in one piece, where NumPy's calls
    cost less than ATen's).

    Raises
    ------
    ValueError
        For a learning rate that is not positive, a negative momentum,
        dampening or weight decay, or Nesterov momentum without momentum or
        with dampening.
    """

    _saved = ("lr", "momentum")

    def __init__(self, params: Iterable[Parameter], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        check_number("SGD: lr", lr, strict=True)
        momentum = check_number("SGD: momentum", momentum)
        dampening = check_number("SGD: dampening", dampening)
        weight_decay = check_number("SGD: weight_decay", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0")
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": bool(nesterov)})

    def _check_hyper(self, hyper: dict[str, Any]) -> None:
        check_number("SGD: lr", hyper["lr"])  # a schedule may have brought it to 0
        check_number("SGD: momentum", hyper["momentum"])

    def _update(self, i: int, p: Parameter) -> None:
        g = p.grad
        hyper = self.param_groups[0]
        lr, momentum, dampening, decay, nesterov = hyper["lr"], hyper["momentum"], \
            hyper["dampening"], hyper["weight_decay"], hyper["nesterov"]
        buf, fresh = None, False
        if momentum:
            buf = self.state[i]
            if buf is not None and type(buf) is not type(g) and \
                    array_namespace(buf) is not array_namespace(g):
                buf = self.state[i] = _like(g, buf)  # the gradient moved
            elif buf is None:
                buf = self.state[i] = array_namespace(g).empty_like(g)
                fresh = True
        if self.kernel_backend == "torch" and g.dtype == p.data.dtype and g.size > CHUNK \
                and isinstance(p.data, np.ndarray) and torch_kernels.supports(g.dtype):
            torch_kernels.sgd_update_(p.data, g, buf, lr, momentum, dampening, decay,
                                      nesterov, fresh)
            return
        if not nesterov and g.dtype == p.data.dtype:
            # d = g + decay * p; buf = momentum * buf + (1 - dampening) * d; p -= lr * buf,
            # in one sweep over cache-sized pieces (no temporary of the parameter's size)
            def step(data: Any, grad: Any, *rest: Any) -> None:
                *state, scratch = rest
                d = grad
                if decay:
                    d = _scaled(scratch, data, decay)
                    d += grad
                if state:
                    (buf,) = state
                    if fresh:
                        buf[...] = d
                    else:
                        buf *= momentum
                        buf += d if dampening == 0 else (1 - dampening) * d
                    d = buf
                data -= _scaled(scratch, d, lr)

            by_chunks(step, p.data, g, *(() if buf is None else (buf,)))
            return
        if decay:
            g = add_scaled_(g + 0, p.data, decay)
        if momentum:
            if fresh:
                buf[...] = g
            else:
                buf *= momentum
                add_scaled_(buf, g, 1 - dampening)
            g = add_scaled_(g + 0, buf, momentum) if nesterov else buf
        if g.dtype != p.data.dtype:
            p.data -= astype(lr * g, p.data.dtype)
        else:
            add_scaled_(p.data, g, -lr)
