"""Learning-rate schedules, as ``torch.optim.lr_scheduler``'s: names, formulas and state.

A scheduler changes ``optimizer.param_groups[0]["lr"]`` (``optimizer.lr``):
construct it after the optimizer (that sets ``initial_lr`` and takes the
first value), and call :meth:`LRScheduler.step` after each
``optimizer.step()``. ``last_epoch`` counts the steps taken;
:meth:`~LRScheduler.state_dict` and :meth:`~LRScheduler.load_state_dict`
save and restore it with everything else the schedule depends on, so that a
resumed run continues the schedule exactly (create the scheduler, then load
the optimizer's and the scheduler's states). Every value is computed from
numbers every rank has, so all ranks follow the same schedule without
communicating.
"""

from __future__ import annotations

import contextlib
import math
import types
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .optimizer import Optimizer, check_number

__all__ = ["LRScheduler", "LambdaLR", "StepLR", "LinearLR", "CosineAnnealingLR", "SequentialLR"]


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


class LRScheduler:
    """The base of the schedulers, as ``torch.optim.lr_scheduler.LRScheduler``.

    Parameters
    ----------
    optimizer : Optimizer
    last_epoch : int
        -1 (the default) starts the schedule: ``initial_lr`` is set to the
        optimizer's learning rate where it is not set yet, and the first
        value is taken. Another value resumes at that step, from the
        ``initial_lr`` an earlier scheduler set.

    Raises
    ------
    TypeError
        When ``optimizer`` is not an :class:`~disttensor_nn.optim.Optimizer`.
    KeyError
        When resuming (``last_epoch >= 0``) an optimizer without ``initial_lr``.
    """

    _is_initial = False
    _transient = ("optimizer", "_is_initial")

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
        _check_int(f"{type(self).__name__}: last_epoch", last_epoch, -1)
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] "
                                   "when resuming a scheduler with last_epoch >= 0")
        self.base_lrs: list[float] = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self) -> None:
        """Reset the step count and take the first value."""
        self._step_count = 0
        with self._initial_mode():
            self.step()

    @contextlib.contextmanager
    def _initial_mode(self) -> Iterator[None]:
        self._is_initial = True
        try:
            yield
        finally:
            self._is_initial = False

    def get_lr(self) -> list[float]:
        """The learning rates of the step ``last_epoch`` (from the current ones)."""
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        """The learning rates the last :meth:`step` set, one per parameter group."""
        return list(self._last_lr)

    def step(self) -> None:
        """Advance the schedule by one step (call it after ``optimizer.step()``)."""
        self._step_count += 1
        self._update_lr()

    def _update_lr(self, epoch: int | None = None) -> None:
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            closed = getattr(self, "_get_closed_form_lr", None)
            values = closed() if closed is not None else self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Everything the schedule depends on except the optimizer (``last_epoch``,
        ``base_lrs``, its arguments), as numbers, strings and lists."""
        return {k: list(v) if isinstance(v, list) else v
                for k, v in self.__dict__.items() if k not in self._transient}

    def check_state_dict(self, state: Any) -> None:
        """Raise ValueError (nothing changed) when ``state`` is not a :meth:`state_dict` of
        this kind of scheduler."""
        name = type(self).__name__
        if not isinstance(state, Mapping):
            raise ValueError(f"{name}.load_state_dict: not a state dictionary")
        mine = set(self.state_dict())
        if set(state) != mine:
            raise ValueError(f"{name}.load_state_dict: the state has the entries "
                             f"{sorted(state)}, a {name} has {sorted(mine)} (it was saved by "
                             "another scheduler)")
        _check_int(f"{name}.load_state_dict: last_epoch", state["last_epoch"], -1)
        if "base_lrs" in mine and len(state["base_lrs"]) != len(self.base_lrs):
            raise ValueError(f"{name}.load_state_dict: the state is for "
                             f"{len(state['base_lrs'])} parameter groups, not "
                             f"{len(self.base_lrs)}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (checked first: nothing changes when it does
        not fit)."""
        self.check_state_dict(state)
        self.__dict__.update({k: list(v) if isinstance(v, (list, tuple)) else v
                              for k, v in state.items()})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(last_epoch={self.last_epoch}, lr={self.get_last_lr()})"


class LambdaLR(LRScheduler):
    """The initial learning rate times ``lr_lambda(last_epoch)``, as torch's ``LambdaLR``.

    Parameters
    ----------
    optimizer : Optimizer
    lr_lambda : callable or list of callables
        Step -> factor (one per parameter group, or one for all). Plain
        functions are not saved by :meth:`state_dict`; the attributes of
        callable objects are.
    last_epoch : int
    """

    def __init__(self, optimizer: Optimizer,
                 lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
                 last_epoch: int = -1):
        self.optimizer = optimizer
        if not isinstance(lr_lambda, (list, tuple)):
            self.lr_lambdas = [lr_lambda] * len(optimizer.param_groups)
        else:
            if len(lr_lambda) != len(optimizer.param_groups):
                raise ValueError(f"Expected {len(optimizer.param_groups)} lr_lambdas, but got "
                                 f"{len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        for f in self.lr_lambdas:
            if not callable(f):
                raise TypeError(f"LambdaLR: lr_lambda must be callable, got {f!r}")
        super().__init__(optimizer, last_epoch)

    def state_dict(self) -> dict[str, Any]:
        """As the base's, with the attributes of callable objects among the lambdas (None
        for plain functions)."""
        state = {k: v for k, v in super().state_dict().items() if k != "lr_lambdas"}
        state["lr_lambdas"] = [None if isinstance(f, types.FunctionType) else dict(f.__dict__)
                               for f in self.lr_lambdas]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """As the base's; the attributes of callable objects are restored."""
        self.check_state_dict(state)
        lambdas = state["lr_lambdas"]
        self.__dict__.update({k: list(v) if isinstance(v, (list, tuple)) else v
                              for k, v in state.items() if k != "lr_lambdas"})
        for f, saved in zip(self.lr_lambdas, lambdas):
            if saved is not None:
                f.__dict__.update(saved)

    def get_lr(self) -> list[float]:
        return [base_lr * f(self.last_epoch) for f, base_lr in zip(self.lr_lambdas,
                                                                     self.base_lrs)]


class StepLR(LRScheduler):
    """The learning rate times ``gamma`` every ``step_size`` steps, as torch's ``StepLR``.

    Parameters
    ----------
    optimizer : Optimizer
    step_size : int
        >= 1.
    gamma : float
        >= 0.
    last_epoch : int
    """

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1,
                 last_epoch: int = -1):
        self.step_size = _check_int("StepLR: step_size", step_size, 1)
        self.gamma = check_number("StepLR: gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return [group["lr"] for group in self.optimizer.param_groups]
        return [group["lr"] * self.gamma for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self) -> list[float]:
        return [base_lr * self.gamma ** (self.last_epoch // self.step_size)
                for base_lr in self.base_lrs]


class LinearLR(LRScheduler):
    """A factor of the learning rate going linearly from ``start_factor`` to ``end_factor``
    over ``total_iters`` steps, then kept, as torch's ``LinearLR`` (a warm-up with the
    default end factor 1).

    Parameters
    ----------
    optimizer : Optimizer
    start_factor : float
        In (0, 1].
    end_factor : float
        In [0, 1].
    total_iters : int
        >= 1.
    last_epoch : int
    """

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3,
                 end_factor: float = 1.0, total_iters: int = 5, last_epoch: int = -1):
        if not 0 < check_number("LinearLR: start_factor", start_factor, high=1.0,
                                high_strict=False):
            raise ValueError("Starting multiplicative factor expected to be greater than 0 "
                             "and less or equal to 1.")
        self.start_factor = float(start_factor)
        self.end_factor = check_number("LinearLR: end_factor", end_factor, high=1.0,
                                       high_strict=False)
        self.total_iters = _check_int("LinearLR: total_iters", total_iters, 1)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0:
            return [group["lr"] * self.start_factor for group in self.optimizer.param_groups]
        if self._is_initial or self.last_epoch > self.total_iters:
            return [group["lr"] for group in self.optimizer.param_groups]
        return [group["lr"] * (1.0 + (self.end_factor - self.start_factor)
                               / (self.total_iters * self.start_factor
                                  + (self.last_epoch - 1) * (self.end_factor
                                                             - self.start_factor)))
                for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self) -> list[float]:
        return [base_lr * (self.start_factor + (self.end_factor - self.start_factor)
                           * min(self.total_iters, self.last_epoch) / self.total_iters)
                for base_lr in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """Cosine annealing from the initial learning rate to ``eta_min`` over ``T_max`` steps,
    as torch's ``CosineAnnealingLR`` (its recursive form, so its values exactly).

    Parameters
    ----------
    optimizer : Optimizer
    T_max : int
        >= 1: the steps of half a period.
    eta_min : float
        >= 0: the smallest learning rate.
    last_epoch : int
    """

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0,
                 last_epoch: int = -1):
        self.T_max = _check_int("CosineAnnealingLR: T_max", T_max, 1)
        self.eta_min = check_number("CosineAnnealingLR: eta_min", eta_min)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        groups = self.optimizer.param_groups
        if self._is_initial:
            return [group["lr"] for group in groups]
        if self._step_count == 1 and self.last_epoch > 0:
            return [self.eta_min + (base_lr - self.eta_min)
                    * (1 + math.cos(self.last_epoch * math.pi / self.T_max)) / 2
                    for base_lr in self.base_lrs]
        if (self.last_epoch - 1 - self.T_max) % (2 * self.T_max) == 0:
            return [group["lr"] + (base_lr - self.eta_min)
                    * (1 - math.cos(math.pi / self.T_max)) / 2
                    for base_lr, group in zip(self.base_lrs, groups)]
        return [(1 + math.cos(math.pi * self.last_epoch / self.T_max))
                / (1 + math.cos(math.pi * (self.last_epoch - 1) / self.T_max))
                * (group["lr"] - self.eta_min) + self.eta_min for group in groups]

    def _get_closed_form_lr(self) -> list[float]:
        return [self.eta_min + (base_lr - self.eta_min)
                * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base_lr in self.base_lrs]


class SequentialLR(LRScheduler):
    """Schedulers one after another, switching at ``milestones``, as torch's ``SequentialLR``
    (a :class:`LinearLR` warm-up before a decay, for instance).

    At each milestone the next scheduler starts from its own beginning (its
    step 0, from the initial learning rate).

    Parameters
    ----------
    optimizer : Optimizer
    schedulers : list of LRScheduler
        Of ``optimizer``, at least one.
    milestones : list of int
        One fewer than the schedulers, increasing, each >= 1.
    last_epoch : int
    """

    _transient = ("optimizer", "_is_initial", "_schedulers")

    def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler],
                 milestones: Sequence[int], last_epoch: int = -1):
        name = type(self).__name__
        schedulers = list(schedulers)
        if len(schedulers) < 1:
            raise ValueError(f"{name} expects at least one scheduler, but got no scheduler.")
        for i, s in enumerate(schedulers):
            if not isinstance(s, LRScheduler):
                raise TypeError(f"{name}: the scheduler at index {i} is a {type(s).__name__}")
            if s.optimizer is not optimizer:
                raise ValueError(f"{name} expects all schedulers to belong to the same "
                                 f"optimizer, but the scheduler {type(s).__name__} at index {i} "
                                 "has another one")
        milestones = [_check_int(f"{name}: milestones", m, 1) for m in milestones]
        if len(milestones) != len(schedulers) - 1:
            raise ValueError("Sequential Schedulers expects number of schedulers provided to be "
                             "one more than the number of milestone points, but got number of "
                             f"schedulers {len(schedulers)} and the number of milestones to be "
                             f"equal to {len(milestones)}")
        if any(b <= a for a, b in zip(milestones, milestones[1:])):
            raise ValueError(f"{name}: milestones must increase, got {milestones}")
        _check_int(f"{name}: last_epoch", last_epoch, -1)
        self._schedulers = schedulers
        self._milestones = milestones
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for group in optimizer.param_groups:  # back to the initial values
            group["lr"] = group["initial_lr"]
        self._recursive_undo()  # the first step every scheduler took
        idx = bisect_right(self._milestones, 0)
        self._schedulers[idx]._initial_step()
        self._last_lr = schedulers[idx].get_last_lr()

    def _recursive_undo(self, sched: Any = None) -> None:
        scheds = self if sched is None else sched
        if hasattr(scheds, "_schedulers"):
            for s in scheds._schedulers:
                self._recursive_undo(s)
        elif hasattr(scheds, "last_epoch"):
            scheds.last_epoch -= 1

    def step(self) -> None:
        """Advance the schedule by one step: the scheduler whose part this step is takes it."""
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """Its own state with ``_schedulers``, the list of the schedulers' states."""
        state = super().state_dict()
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def check_state_dict(self, state: Any) -> None:
        super().check_state_dict(state)
        saved = state["_schedulers"]
        if len(saved) != len(self._schedulers):
            raise ValueError(f"SequentialLR.load_state_dict: the state holds {len(saved)} "
                             f"schedulers, this one {len(self._schedulers)}")
        for s, st in zip(self._schedulers, saved):
            s.check_state_dict(st)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore its own state and each scheduler's (all checked first)."""
        self.check_state_dict(state)
        self.__dict__.update({k: list(v) if isinstance(v, (list, tuple)) else v
                              for k, v in state.items() if k != "_schedulers"})
        for s, st in zip(self._schedulers, state["_schedulers"]):
            s.load_state_dict(st)
