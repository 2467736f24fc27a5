"""SGD with momentum, weight decay and Nesterov, identical on every rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from disttensor.backend import array_namespace, astype, contiguous

from ..parameter import Parameter
from .optimizer import Optimizer, _like, check_number

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
        if self.weight_decay:
            g = g + self.weight_decay * p.data
        if self.momentum:
            buf = self.state[i]
            if buf is None:
                buf = self.state[i] = contiguous(g, copy=True)
            else:
                if array_namespace(buf) is not array_namespace(g):  # the gradient moved
                    buf = self.state[i] = _like(g, buf)
                buf *= self.momentum
                buf += (1 - self.dampening) * g
            g = g + self.momentum * buf if self.nesterov else buf
        update = self.lr * g
        if update.dtype != p.data.dtype:
            update = astype(update, p.data.dtype)
        p.data -= update
