"""Adam and AdamW (decoupled weight decay), as ``torch.optim``'s, identical on every rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from disttensor.backend import array_namespace, astype

from ..parameter import Parameter
from .optimizer import Optimizer, check_number

__all__ = ["Adam", "AdamW"]

_KEYS = ("exp_avg", "exp_avg_sq")


def _betas(name: str, betas: Any) -> tuple[float, float]:
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
        raise TypeError(f"{name}: betas must be a pair of numbers, got {betas!r}")
    return (check_number(f"{name}: betas[0]", betas[0], high=1.0),
            check_number(f"{name}: betas[1]", betas[1], high=1.0))


def _lerp_(a: Any, b: Any, weight: float) -> None:
    """``a`` moved towards ``b`` by ``weight``, in place, as ``torch.lerp``'s two branches."""
    if abs(weight) < 0.5:
        a += weight * (b - a)
    else:
        a[...] = b - (b - a) * (1 - weight)


class Adam(Optimizer):
    """Adam, as ``torch.optim.Adam`` (its formulas, defaults and state).

    ``state[i]`` holds ``step`` (the number of updates), ``exp_avg`` and
    ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``), arrays in the
    parameter's array module and of its local shape: a sharded parameter's
    moments are sharded as it is, and follow it when a layer re-splits it.
    Gradients of replicated parameters are already summed over ranks, so
    every rank applies the same update.

    Parameters
    ----------
    params : iterable of Parameter
    lr : float
        Learning rate, >= 0.
    betas : (float, float)
        Decay rates of the first and second moments, each in [0, 1).
    eps : float
        Added to the denominator, >= 0.
    weight_decay : float
        >= 0: L2 penalty added to the gradient (:class:`AdamW`: decoupled,
        ``p *= 1 - lr * weight_decay`` before the update).
    amsgrad : bool
        Normalise by the largest second moment so far (AMSGrad).

    Raises
    ------
    ValueError
        For a negative learning rate, eps or weight decay, or a beta outside
        [0, 1) (the same on every rank, before anything is kept).
    """

    _saved = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    _decoupled = False

    def __init__(self, params: Iterable[Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False):
        hyper = self._checked({"lr": lr, "betas": betas, "eps": eps,
                               "weight_decay": weight_decay, "amsgrad": amsgrad})
        super().__init__(params, hyper)

    def _checked(self, hyper: Mapping[str, Any]) -> dict[str, Any]:
        name = type(self).__name__
        if not isinstance(hyper["amsgrad"], bool):
            raise TypeError(f"{name}: amsgrad must be a bool, got {hyper['amsgrad']!r}")
        return {"lr": check_number(f"{name}: lr", hyper["lr"]),
                "betas": _betas(name, hyper["betas"]),
                "eps": check_number(f"{name}: eps", hyper["eps"]),
                "weight_decay": check_number(f"{name}: weight_decay", hyper["weight_decay"]),
                "amsgrad": hyper["amsgrad"]}

    def _check_hyper(self, hyper: dict[str, Any]) -> None:
        self._checked(hyper)

    def _check_entry(self, i: int, entry: Any, p: Parameter, state: Mapping[str, Any]) -> None:
        name = type(self).__name__
        if entry is None:
            return
        amsgrad = state["amsgrad"]
        want = {"step", *_KEYS} | ({"max_exp_avg_sq"} if amsgrad else set())
        if not isinstance(entry, Mapping) or set(entry) != want:
            have = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
            raise ValueError(f"{name}.load_state_dict: state {i} holds {have}; the state "
                             f"of {name} with amsgrad={amsgrad} holds {sorted(want)} (it was "
                             "saved by another optimizer, or with other settings)")
        step = entry["step"]
        if isinstance(step, bool) or not float(step).is_integer() or step < 1:
            raise ValueError(f"{name}.load_state_dict: state {i} has step {step!r}")
        super()._check_entry(i, entry, p, state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: moments, step counts and hyper-parameters.

        Whole arrays; a sharded parameter keeps its block. Checked first: a
        state of another optimizer, for other parameters or saved with the
        other ``amsgrad`` raises ValueError and changes nothing.
        """
        super().load_state_dict(state)
        self.state = [None if e is None else {**e, "step": int(e["step"])} for e in self.state]

    def _update(self, i: int, p: Parameter) -> None:
        xp = array_namespace(p.data)
        beta1, beta2 = self.betas
        lr, eps, wd = self.lr, self.eps, self.weight_decay
        g = p.grad
        if g.dtype != p.data.dtype:
            g = astype(g, p.data.dtype)
        st = self.state[i]
        if st is None:
            st = self.state[i] = {"step": 0, "exp_avg": xp.zeros_like(p.data),
                                  "exp_avg_sq": xp.zeros_like(p.data)}
            if self.amsgrad:
                st["max_exp_avg_sq"] = xp.zeros_like(p.data)
        st["step"] += 1
        step = st["step"]
        if wd != 0:
            if self._decoupled:
                p.data *= 1 - lr * wd
            else:
                g = g + wd * p.data
        m, v = st["exp_avg"], st["exp_avg_sq"]
        _lerp_(m, g, 1 - beta1)
        v *= beta2
        v += (1 - beta2) * (g * g)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        if self.amsgrad:
            vmax = st["max_exp_avg_sq"]
            vmax[...] = xp.maximum(vmax, v)
            v = vmax
        denom = xp.sqrt(v) / bias_correction2_sqrt
        denom += eps
        p.data -= step_size * (m / denom)


class AdamW(Adam):
    """AdamW, as ``torch.optim.AdamW``: Adam with decoupled weight decay.

    Before each update every parameter is scaled by ``1 - lr *
    weight_decay``; the decay does not enter the moments. The arguments,
    state and checks are :class:`Adam`'s, except that ``weight_decay``
    defaults to 0.01.
    """

    _decoupled = True

    def __init__(self, params: Iterable[Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)
