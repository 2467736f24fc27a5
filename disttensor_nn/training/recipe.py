"""The optimizer, learning-rate schedule and gradient clipping of a training run.

:func:`recipe_problem` checks a :class:`~disttensor_nn.training.TrainConfig`'s
choices (``optimizer``, ``schedule``, ``warmup_steps`` and the rest) before
any work; :func:`make_optimizer` and :func:`make_scheduler` build what they
name; :func:`resume_problem` compares them with what a checkpoint was saved
with. Every function uses only the configuration (and a manifest every rank
has), so every rank reaches the same verdict.

The schedules run over ``schedule_steps`` steps (by default ``steps``, the
whole run, the resumed steps included):

========= =================================================================
none      the learning rate stays ``lr``
step      ``lr`` times ``gamma`` every ``step_size`` steps (``StepLR``)
cosine    cosine from ``lr`` to ``min_lr`` over the steps after the warm-up
          (``CosineAnnealingLR``)
linear    linear from ``lr`` to ``min_lr`` over the steps after the warm-up
          (``LinearLR``)
========= =================================================================

``warmup_steps`` K > 0 puts a linear warm-up from ``warmup_start_factor *
lr`` to ``lr`` over the first K steps before any of them (``LinearLR`` then
the schedule in a ``SequentialLR`` with the milestone K).

A run resumed from a checkpoint continues the saved optimizer and schedule
exactly; :func:`resume_problem` refuses a checkpoint saved with another
optimizer, another schedule or other schedule settings (to train a schedule
in parts, give every part the whole schedule's ``schedule_steps``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..optim import SGD, Adam, AdamW, Optimizer, check_stage, shard_state
from ..optim.lr_scheduler import (
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    SequentialLR,
    StepLR,
)
from ..parameter import Parameter

__all__ = ["OPTIMIZERS", "SCHEDULES", "recipe_problem", "make_optimizer", "make_scheduler",
           "scheduler_class", "resume_problem", "state_slots"]

OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
"""``TrainConfig.optimizer`` (``--optimizer``) -> the optimizer class."""

SCHEDULES: tuple[str, ...] = ("none", "step", "cosine", "linear")
"""The names ``TrainConfig.schedule`` (``--schedule``) takes."""

_MAIN: dict[str, type[LRScheduler] | None] = {"none": None, "step": StepLR,
                                              "cosine": CosineAnnealingLR, "linear": LinearLR}


def _choices(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + f" or {names[-1]}"


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def recipe_problem(cfg: Any, lr: float | None = None) -> str | None:
    """What is wrong with ``cfg``'s optimizer, schedule and clipping, or None.

    Parameters
    ----------
    cfg : TrainConfig
        Its ``optimizer``, ``lr``, ``momentum``, ``weight_decay``,
        ``schedule``, ``warmup_steps``, ``warmup_start_factor``,
        ``step_size``, ``gamma``, ``min_lr``, ``clip_grad_norm``,
        ``schedule_steps`` and ``steps``.
    lr : float, optional
        The learning rate the run uses (the model's default when ``cfg.lr``
        is None); ``cfg.lr`` when not given, and the checks that need a
        learning rate are skipped when both are None.

    Returns
    -------
    str or None
        One sentence naming the option (as ``disttensor-train`` spells it)
        and the value: an unknown optimizer or schedule, a negative (or, for
        SGD, zero) learning rate, a negative momentum, weight decay or
        ``--min-lr``, a clip norm that is not positive, a warm-up not
        shorter than the schedule (``--schedule-steps``, by default
        ``--steps``), a ``--min-lr`` above the learning rate.
    """
    lr = cfg.lr if lr is None else lr
    if cfg.optimizer not in OPTIMIZERS:
        return f"unknown --optimizer {cfg.optimizer!r}: choose {_choices(OPTIMIZERS)}"
    if cfg.schedule not in SCHEDULES:
        return f"unknown --schedule {cfg.schedule!r}: choose {_choices(SCHEDULES)}"
    stage = getattr(cfg, "shard_state", "none")
    try:
        if stage != "auto":  # the planner's choice, made later
            check_stage(stage)
    except ValueError as exc:
        return "--" + str(exc).replace("_", "-", 1) + ", or auto"
    if lr is not None and (not _real(lr) or lr < 0 or (cfg.optimizer == "sgd" and lr == 0)):
        return f"--lr must be {'> 0' if cfg.optimizer == 'sgd' else '>= 0'}, got {lr!r}"
    for flag, value in (("--momentum", cfg.momentum), ("--weight-decay", cfg.weight_decay),
                        ("--min-lr", cfg.min_lr), ("--gamma", cfg.gamma)):
        if value is not None and (not _real(value) or value < 0):
            return f"{flag} must be >= 0, got {value!r}"
    clip = cfg.clip_grad_norm
    if clip is not None and (not _real(clip) or clip <= 0):
        return f"--clip-grad-norm must be > 0, got {clip!r}"
    if cfg.schedule_steps is not None and (not _int(cfg.schedule_steps) or
                                           cfg.schedule_steps < 1):
        return f"--schedule-steps must be an integer >= 1, got {cfg.schedule_steps!r}"
    steps, warmup = _span(cfg), cfg.warmup_steps
    if not _int(warmup) or warmup < 0:
        return f"--warmup-steps must be an integer >= 0, got {warmup!r}"
    if warmup and warmup >= steps:
        flag = "--steps" if cfg.schedule_steps is None else "--schedule-steps"
        return (f"a warm-up of {warmup} steps (--warmup-steps) does not fit in the schedule's "
                f"{steps} steps ({flag}): it must be shorter, so that the schedule has steps "
                "of its own")
    factor = cfg.warmup_start_factor
    if not _real(factor) or not 0 < factor <= 1:
        return f"--warmup-start-factor must be in (0, 1], got {factor!r}"
    if cfg.schedule == "step" and cfg.step_size is not None and (
            not _int(cfg.step_size) or cfg.step_size < 1):
        return f"--step-size must be an integer >= 1, got {cfg.step_size!r}"
    if cfg.schedule in ("cosine", "linear") and lr is not None and cfg.min_lr > lr:
        return (f"--min-lr {cfg.min_lr:g} is above the learning rate {lr:g}: the "
                f"{cfg.schedule} schedule decays from the learning rate to --min-lr")
    return None


def make_optimizer(cfg: Any, params: Iterable[Parameter], lr: float) -> Optimizer:
    """The optimizer ``cfg.optimizer`` names, with learning rate ``lr``, its state
    sharded as ``cfg.shard_state`` says (:func:`~disttensor_nn.optim.shard_state`).

    ``cfg.momentum`` applies to SGD; ``cfg.weight_decay`` to all three
    (None: the optimizer's default, 0 for SGD and Adam, 0.01 for AdamW).
    """
    cls = OPTIMIZERS[cfg.optimizer]
    kw: dict[str, Any] = {} if cfg.weight_decay is None else {"weight_decay": cfg.weight_decay}
    if cls is SGD:
        opt: Optimizer = SGD(params, lr=lr, momentum=cfg.momentum, **kw)
    else:
        opt = cls(params, lr=lr, **kw)
    stage = getattr(cfg, "shard_state", "none")  # "auto": the driver passes the plan's
    return opt if stage == "none" else shard_state(opt, stage)


def state_slots(cfg: Any) -> int:
    """Arrays of optimizer state per parameter that ``cfg``'s optimizer keeps (for the
    memory model: SGD's momentum, Adam's two moments)."""
    if cfg.optimizer == "sgd":
        return 1 if cfg.momentum else 0
    return 2


def _span(cfg: Any) -> int:
    """The steps the schedule runs over."""
    return cfg.steps if cfg.schedule_steps is None else cfg.schedule_steps


def _step_size(cfg: Any) -> int:
    return cfg.step_size or max(1, (_span(cfg) - cfg.warmup_steps) // 3)


def make_scheduler(cfg: Any, optimizer: Optimizer) -> LRScheduler | None:
    """The schedule ``cfg`` asks for, over ``cfg.schedule_steps`` steps (by default
    ``cfg.steps``; None for a constant rate).

    It sets the optimizer's learning rate for step 0; call its ``step()``
    after each ``optimizer.step()``. The ``step`` schedule's ``step_size``
    defaults to a third of the steps after the warm-up.
    """
    main_cls = _MAIN[cfg.schedule]
    warmup = cfg.warmup_steps
    lr = optimizer.lr
    warm = None
    if warmup:
        warm = LinearLR(optimizer, start_factor=cfg.warmup_start_factor, end_factor=1.0,
                        total_iters=warmup)
    rest = _span(cfg) - warmup
    main: LRScheduler | None = None
    if main_cls is StepLR:
        main = StepLR(optimizer, step_size=_step_size(cfg), gamma=cfg.gamma)
    elif main_cls is CosineAnnealingLR:
        main = CosineAnnealingLR(optimizer, T_max=rest, eta_min=cfg.min_lr)
    elif main_cls is LinearLR:
        main = LinearLR(optimizer, start_factor=1.0,
                        end_factor=cfg.min_lr / lr if lr else 1.0, total_iters=rest)
    if warm is not None and main is not None:
        return SequentialLR(optimizer, [warm, main], milestones=[warmup])
    return warm if warm is not None else main


def scheduler_class(cfg: Any) -> str | None:
    """The class name of :func:`make_scheduler`'s scheduler for ``cfg`` (None for none)."""
    main = _MAIN[cfg.schedule]
    if cfg.warmup_steps:
        return "LinearLR" if main is None else "SequentialLR"
    return None if main is None else main.__name__


def _schedule_words(cls: str | None) -> str:
    return "no schedule" if cls is None else f"the schedule {cls}"


_PROGRESS = frozenset({"last_epoch", "_step_count", "_last_lr", "_schedulers"})
"""Entries of a scheduler's state that change as it steps (the rest are its settings)."""


def _settings_differ(saved: Any, mine: Mapping[str, Any], where: str) -> str | None:
    """The first setting of the scheduler state ``mine`` that ``saved`` has otherwise."""
    if not isinstance(saved, Mapping):
        return f"{where}: no state"
    for key in sorted(set(mine) - _PROGRESS):
        if key not in saved or saved[key] != mine[key] and not (
                isinstance(mine[key], list) and list(saved[key]) == mine[key]):
            return (f"{where}{key} {saved.get(key)!r}, this run's {mine[key]!r}")
    subs, saved_subs = mine.get("_schedulers"), saved.get("_schedulers")
    if subs is not None:
        if not isinstance(saved_subs, list) or len(saved_subs) != len(subs):
            return f"{where}schedulers {saved_subs!r}"
        for k, (a, b) in enumerate(zip(saved_subs, subs)):
            found = _settings_differ(a, b, f"{where}part {k}: ")
            if found:
                return found
    return None


def resume_problem(cfg: Any, manifest: dict[str, Any], lr: float) -> str | None:
    """Why the checkpoint of ``manifest`` cannot continue ``cfg``'s run, or None.

    The checkpoint must have been saved with the optimizer ``cfg.optimizer``
    names and with the schedule ``cfg`` builds: the same scheduler class (or
    none for both) with the same settings (its length, warm-up, factors and
    initial learning rate ``lr``). The saved state then
    continues: the learning rate, the moments and the schedule's position.

    Parameters
    ----------
    cfg : TrainConfig
    manifest : dict
        :func:`~disttensor_nn.training.checkpoint.checkpoint_manifest`'s.
    lr : float
        The run's initial learning rate (``cfg.lr`` or the model's).
    """
    saved = (manifest.get("optimizer") or {}).get("class")
    want = OPTIMIZERS[cfg.optimizer].__name__
    if saved != want:
        names = {c.__name__: n for n, c in OPTIMIZERS.items()}
        was = "no optimizer" if saved is None else (
            f"--optimizer {names[saved]} ({saved})" if saved in names else f"the optimizer {saved}")
        return (f"the checkpoint was saved with {was}, this run asks for --optimizer "
                f"{cfg.optimizer} ({want}): resume with the optimizer it was saved with")
    saved_sched = (manifest.get("scheduler") or {}).get("class")
    want_sched = scheduler_class(cfg)
    if saved_sched != want_sched:
        return (f"the checkpoint was saved with {_schedule_words(saved_sched)}, this run's "
                f"--schedule {cfg.schedule} --warmup-steps {cfg.warmup_steps} makes "
                f"{_schedule_words(want_sched)}: resume with the schedule it was saved with")
    if want_sched is not None:
        probe = Adam([Parameter(np.zeros(1))], lr=lr)  # what the schedule does to a rate
        mine = make_scheduler(cfg, probe).state_dict()  # type: ignore[union-attr]
        found = _settings_differ((manifest.get("scheduler") or {}).get("state"), mine, "")
        if found:
            return (f"the checkpoint's schedule {saved_sched} was saved with other settings "
                    f"({found}; from --schedule, --warmup-steps, --warmup-start-factor, "
                    "--step-size, --gamma, --min-lr, --schedule-steps or --steps and --lr): "
                    "resume with the settings it was saved with")
    return None
