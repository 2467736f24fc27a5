"""Plan a model on a machine profile, alone or on all ranks of a job at once."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.device import use_device

from ..costspec import largest_block
from ..kernels import BACKENDS, available_backends, check_backend, torch_kernels
from ..layout import MEMORY_FORMATS, to_memory_format
from ..memory import MemoryProfile
from ..optim.optimizer import STAGES
from ..precision import activation_dtype, is_half
from .costmodel import CostModel, dist_for
from .machine import load_profile
from .planner import Planner
from .result import Plan
from .timer import KernelTimer, machine_id, seconds_on_every_rank

__all__ = ["make_plan", "predict_scaling", "wait_for_root", "kernel_choice",
           "CHANNELS_LAST_GAIN", "kept_memory_format"]

CHANNELS_LAST_GAIN = 0.03
"""How much faster a channels-last plan must be predicted than the C-order one for
``make_plan(memory_format="auto")`` to keep it. Within that the kernel timings' spread on
a shared machine decides, and a channels-last plan carries what its prediction holds
least well: the copies around the layers that take no such blocks, timed on tiles at the
largest sizes (mesh at 2048 x 2048 on 2 ranks: channels-last predicted 32.05 s against
32.32 for C order, 0.8% apart, and measured 39.1 s, 1.22 of its prediction and its peak
memory +14%, where C-order plans measured 32.8-33.8 s)."""


def kept_memory_format(contiguous_s: float, channels_last_s: float) -> str:
    """The memory format a planner keeps of a plan in C order predicted at
    ``contiguous_s`` seconds a step and one on channels-last blocks at ``channels_last_s``:
    ``"channels_last"`` where it is faster by more than :data:`CHANNELS_LAST_GAIN`, else
    ``"contiguous"`` (:func:`make_plan` and :func:`disttensor_nn.torch.parallelize`)."""
    return "channels_last" if channels_last_s < (1 - CHANNELS_LAST_GAIN) * contiguous_s \
        else "contiguous"


def make_plan(model: Any, batch_shape: tuple[int, ...], nprocs: int, machine: str = "this",
              memory: float | None = None, measure: bool = True, itemsize: int = 4,
              comm: MPI.Comm | None = None, baseline: float = 0.0,
              profile: MemoryProfile | None = None,
              recompute: bool | str = False, training: bool = True,
              channels: bool = False, max_states: int | None = None,
              kernels: str | None = None, shard_state: str = "none",
              state_slots: int = 1,
              runs_as: Callable[[Distribution], Distribution] | None = None,
              memory_format: str = "contiguous", modes: Sequence[str] | None = None
              ) -> tuple[Plan, Planner | None]:
    """Plan ``model`` for ``nprocs`` ranks on a machine profile; returns ``(plan, planner)``.

    ``memory`` (bytes per rank) defaults to the profile's memory per rank. On
    the calibrated profile of this machine, kernel times missing from the
    cache are first measured in network order (:meth:`Planner.calibrate`):
    with ``comm`` on all its ranks at once (a collective call: every rank of
    ``comm`` calls this, and ``comm`` should be the job's), then rank 0 plans
    while the others wait and every rank returns the same plan (and
    ``planner`` None off rank 0); without ``comm`` in this process alone.
    A profile calibrated with ``--device gpu`` times the kernels on this
    rank's GPU (chosen over ``comm``; without it, call
    :func:`disttensor.use_device` first on a node with several GPUs, or
    every process takes GPU 0).

    Parameters
    ----------
    model : Layer
        The network to plan.
    batch_shape : tuple of int
        Global shape of one input batch, (N, C, *S).
    nprocs : int
        Number of ranks to plan for.
    machine : str
        ``"this"``, ``"this-gpu"``, a builtin profile's name or a JSON profile
        (:func:`load_profile`).
    memory : float, optional
        Memory budget per rank in bytes.
    measure : bool
        Measure kernel times missing from the cache (else estimate them).
    itemsize : int
        Bytes per activation element, for a model without an activation dtype
        of its own; a model given one by :func:`disttensor_nn.set_precision`
        (16-bit activations) is planned in it: its blocks, halos and messages
        count 2 bytes and its kernels are timed in 16 bits.
    comm : mpi4py.MPI.Comm, optional
        Plan on all ranks of ``comm`` (collective); None plans in this process.
    baseline : float
        Resident bytes of a rank before it holds any of the model's data (the
        interpreter, NumPy, MPI), part of the predicted peak; 0 predicts the
        model's data alone.
    profile : MemoryProfile, optional
        Records the kernel measurement and the planning as phases; without one
        nothing is recorded (and the process's peak count is left as it is).
    recompute : bool or "auto"
        Recompute segments of layers in backward instead of keeping their
        activations (:mod:`disttensor_nn.recompute`): never, always, or
        ``"auto"`` when no plan keeping them fits the budget.
    training : bool
        Plan a training step (True) or an inference pass (False: forward
        alone, no activation kept for backward, parameters without gradients
        and momenta; see :class:`~disttensor_nn.plan.CostModel`). Inference
        never recomputes.
    channels : bool
        Consider channel and filter splits too (grids over (N, C, *S); see
        :class:`Planner`).
    modes : sequence of str, optional
        With ``channels``: the convolutions' modes to choose among (keys of
        :data:`~disttensor_nn.plan.result.MODES`, :class:`Planner`'s ``modes``; a runtime
        that runs some of them only). Default: all.
    max_states : int, optional
        Search each layer over at most this many states (:class:`Planner`:
        faster, no longer exact). Default: exact.
    kernels : {"numpy", "torch", "auto"}, optional
        The layers' kernel backend: every layer that has kernels in it runs
        them (``"torch"`` needs PyTorch), or ``"auto"``: each layer's kernels
        are timed in every backend this process has and the faster is
        chosen (on a measured profile; published profiles have no kernel
        times to choose by). The plan names each layer's choice
        (:attr:`PlanEntry.kernels`) and :func:`apply_plan` sets it. None:
        each layer's own ``kernel_backend``.
    shard_state : {"none", "optimizer", "gradients", "full", "auto"}
        The parameters' state sharded over the ranks that replicate them
        (:func:`disttensor_nn.optim.shard_state`), counted so in the plan's
        memory (:meth:`CostModel.params_memory`) and in its communication
        (:class:`CostModel`'s ``shard_state``). ``"auto"`` plans each stage
        and returns the fastest plan that fits the budget; among plans whose
        predicted times tie (within a relative 1e-9), the one with the least
        communication (exposed and hidden), then the earliest stage in
        :data:`~disttensor_nn.optim.STAGES` (``"none"`` first): on one rank,
        or wherever nothing is replicated, ``"none"``. The plan names the
        stage (:attr:`Plan.shard_state`) and notes each stage's time and peak.
    state_slots : int
        Arrays of optimizer state per parameter (1: SGD's momentum; 2: Adam's
        moments).
    runs_as : callable, optional
        The distribution the runtime holds for a candidate's, where it differs
        (:class:`CostModel`'s ``runs_as``).
    memory_format : {"contiguous", "channels_last", "auto"}
        How the activations' ``(N, C, H, W)`` blocks lie in memory
        (:data:`~disttensor_nn.layout.MEMORY_FORMATS`): the kernels are timed on
        blocks so (:class:`KernelTimer`), and a channels-last plan counts the
        conversion of each input block (timed on every rank). ``"auto"`` plans
        both where the kernels are timed, the input has two spatial dimensions
        and the torch kernels may run (the layers that take channels-last blocks
        are theirs: :meth:`~disttensor_nn.Layer.takes_channels_last`), and keeps
        channels-last where it is faster by more than :data:`CHANNELS_LAST_GAIN`,
        noting both; otherwise C order. The plan names it
        (:attr:`Plan.memory_format`); the training driver puts each input batch so.

    Returns
    -------
    plan : Plan
        The same on every rank.
    planner : Planner or None
        The planner that made it (None off rank 0 of ``comm``).

    Raises
    ------
    ValueError
        When nothing fits the memory budget (on every rank of ``comm``; with
        ``"auto"``, under no stage), or for an unknown ``kernels``,
        ``shard_state`` or ``memory_format``.
    ImportError
        For ``kernels="torch"`` without PyTorch (naming the extra).
    """
    backends = kernel_choice(kernels)
    if shard_state not in (*STAGES, "auto"):  # before any work, the same on every rank
        raise ValueError(f"unknown shard_state {shard_state!r}; the stages are "
                         f"{', '.join(STAGES)}, or auto")
    if memory_format not in (*MEMORY_FORMATS, "auto"):
        raise ValueError(f"memory_format must be one of {[*MEMORY_FORMATS, 'auto']}, got "
                         f"{memory_format!r}")
    machine_profile = load_profile(machine)
    memory = machine_profile.memory_per_rank if memory is None else memory
    dtype = activation_dtype(model) if is_half(activation_dtype(model)) else None
    timer = None
    if machine_profile.measured:  # kernels are timed where the ranks compute (CPU or GPU)
        xp = use_device(machine_profile.device, MPI.COMM_SELF if comm is None else comm)
        timer = KernelTimer(machine_id(machine_profile), measure=measure, xp=xp)
    if kernels == "auto" and timer is None:
        backends = None
    formats = [memory_format]
    if memory_format == "auto":
        torch_may_run = torch_kernels.available() and (backends is None or "torch" in backends)
        formats = ["contiguous", "channels_last"] if timer is not None and \
            len(batch_shape) == 4 and torch_may_run else ["contiguous"]
    made = []
    for fmt in formats:
        if timer is not None:
            timer.memory_format = fmt
        made.append(_plan_in(fmt, model, batch_shape, nprocs, machine_profile, timer, memory,
                             itemsize, comm, baseline, profile, recompute, training, channels,
                             max_states, backends, shard_state, state_slots, runs_as, dtype,
                             modes))
    if len(made) == 1:
        return made[0]
    # the same plans on every rank
    plan, planner = made[formats.index(kept_memory_format(made[0][0].time, made[1][0].time))]
    plan.notes.append("memory format chosen: " + ", ".join(
        f"{p.memory_format} {1e3 * p.time:.2f} ms" for p, _ in made) +
        f" predicted; {plan.memory_format} kept")
    return plan, planner


def _plan_in(memory_format: str, model: Any, batch_shape: tuple[int, ...], nprocs: int,
             machine_profile: Any, timer: KernelTimer | None, memory: float, itemsize: int,
             comm: MPI.Comm | None, baseline: float, profile: MemoryProfile | None,
             recompute: bool | str, training: bool, channels: bool, max_states: int | None,
             backends: tuple[str, ...] | None, shard_state: str, state_slots: int,
             runs_as: Callable[[Distribution], Distribution] | None, dtype: Any,
             modes: Sequence[str] | None = None) -> tuple[Plan, Planner | None]:
    """:func:`make_plan` in one memory format (the timer set to it)."""
    planners = [Planner(model, batch_shape,
                        CostModel(machine_profile, nprocs, timer, itemsize, training=training,
                                  backends=backends, shard_state=stage,
                                  state_slots=state_slots, dtype=dtype, runs_as=runs_as),
                        memory, baseline=baseline, recompute=recompute if training else False,
                        channels=channels, modes=modes, max_states=max_states)
                for stage in (STAGES if shard_state == "auto" else (shard_state,))]
    with _phase(profile, "kernel measurement"):
        for planner in planners:  # after the first, the kernels are mostly timed already
            planner.calibrate(comm, progress=True)
    if len(planners) > 1:  # what calibration did, under whichever stage's plan is chosen
        notes = [n for planner in planners for n in planner.notes]
        for planner in planners:
            planner.notes = list(notes)
    root = comm is None or comm.Get_rank() == 0
    result: Any = None
    with _phase(profile, "planning"):
        if root:
            try:
                result = _best_stage(planners) if shard_state == "auto" else planners[0].plan()
            except ValueError as exc:
                result = exc
            finally:
                if timer is not None:
                    timer.save()
        if comm is not None:
            wait_for_root(comm)  # rank 0 may still measure twins alone: the others sleep
            result = comm.bcast(result, root=0)
    if isinstance(result, Exception):
        raise result
    chosen = 0
    if shard_state == "auto":
        result, chosen = result
    if memory_format == "channels_last":
        result = _with_conversion(result, comm, timer, dtype or _FLOATS.get(itemsize,
                                                                             np.float32))
    return result, planners[chosen] if root else None


_FLOATS = {2: np.float16, 4: np.float32, 8: np.float64}


def _with_conversion(plan: Plan, comm: MPI.Comm | None, timer: KernelTimer | None,
                     dtype: Any) -> Plan:
    """``plan`` in channels-last format, with the conversion of each step's input block
    (:func:`~disttensor_nn.layout.to_memory_format`) timed on every rank and counted in
    its time and compute where the kernels are timed."""
    plan = replace(plan, memory_format="channels_last")
    if timer is None or len(plan.batch_shape) not in (4, 5):
        return plan
    comm = MPI.COMM_SELF if comm is None else comm
    grid = ProcessGrid((1,) * len(plan.batch_shape), MPI.COMM_SELF)
    block = largest_block(dist_for(plan.batch_shape, tuple(plan.entries[0].grid),
                                   plan.entries[0].split_channels, inner=plan.inner))
    x = DistArray.from_local(np.random.default_rng(0).random(block).astype(dtype),
                             Distribution(block, grid, tuple(range(len(block)))))
    t = seconds_on_every_rank(lambda: to_memory_format(x, "channels_last"), comm)
    return replace(plan, time=plan.time + t, compute=plan.compute + t, notes=[
        *plan.notes, f"input blocks put in channels-last layout: {1e3 * t:.2f} ms a step "
                     "(timed), in the time and the compute"])


def _best_stage(planners: Sequence[Planner]) -> tuple[Plan, int]:
    """The plan :func:`make_plan` chooses for ``shard_state="auto"`` among the planners of
    each stage (in :data:`STAGES` order), and its planner's index; the last stage's
    error (the least memory) when none fits."""
    plans: list[tuple[int, Plan]] = []
    error: ValueError | None = None
    for i, planner in enumerate(planners):
        try:
            plans.append((i, planner.plan()))
        except ValueError as exc:
            error = exc
    if not plans:
        assert error is not None
        raise ValueError(f"{error}, under every shard_state") from error
    fastest = min(p.time for _, p in plans)
    tied = [(i, p) for i, p in plans if p.time <= fastest * (1 + 1e-9)]
    i, plan = min(tied, key=lambda ip: (ip[1].exposed_comm + ip[1].hidden_comm, ip[0]))
    plan.notes.append("shard_state auto: the fastest stage that fits; " + ", ".join(
        f"{p.shard_state} {1e3 * p.time:.2f} ms {p.peak_memory / 2**20:.1f} MiB"
        for _, p in plans) + "".join(
            f", {planners[j].cost.shard_state} does not fit" for j in range(len(planners))
            if j not in {k for k, _ in plans}))
    return plan, i


def kernel_choice(kernels: str | None) -> tuple[str, ...] | None:
    """The backends a cost model chooses among for ``make_plan(kernels=...)``.

    Raises
    ------
    ValueError
        For a name other than None, ``"auto"`` and :data:`~disttensor_nn.kernels.BACKENDS`.
    ImportError
        For ``"torch"`` without PyTorch, naming the extra.
    """
    if kernels is None:
        return None
    if kernels == "auto":
        return available_backends()
    if kernels not in BACKENDS:
        raise ValueError(f"kernels must be one of {['auto', *BACKENDS]}, got {kernels!r}")
    check_backend(kernels)
    return (kernels,)


def _phase(profile: MemoryProfile | None, name: str) -> AbstractContextManager[Any]:
    """``profile``'s phase ``name``, or nothing without a profile (no peak restarts)."""
    return nullcontext() if profile is None else profile.phase(name)


def predict_scaling(model: Any, batch_shape: tuple[int, ...], ranks: Sequence[int],
                    machine: str = "this", memory: float | None = None,
                    measure: bool = True, channels: bool = False,
                    max_states: int | None = None) -> list[dict[str, Any]]:
    """Predicted strong scaling: a plan of ``model`` for each rank count, in this process.

    Parameters
    ----------
    model : Layer
        The network to plan.
    batch_shape : tuple of int
        Global shape of one input batch, (N, C, *S), the same for every rank count.
    ranks : sequence of int
        The rank counts.
    machine, memory, measure, channels, max_states
        As for :func:`make_plan`.

    Returns
    -------
    list of dict
        One row per rank count: ``ranks``, ``time_ms`` (predicted time per
        iteration, None when nothing fits, with the reason in ``note``),
        ``compute_ms``, ``exposed_ms`` and ``hidden_ms`` (its kernels, the
        communication on its critical path, and the communication overlapped
        with kernels), ``peak_MiB``, ``grids`` (the candidates the plan uses),
        ``inner`` (the grid axes it keeps inside a node: ``"space"`` or
        ``"sample"``, see ``Plan.inner``), ``modes`` (how many convolutions
        the plan runs in each channel/filter mode,
        :data:`~disttensor_nn.plan.result.MODES`) and
        ``sample_parallel_ms`` (the plan that splits only the samples,
        None when the batch cannot be split so) with ``sample_parallel_split``
        (its compute, exposed and hidden ms; with more ranks than samples
        some ranks hold none), and ``plan_s`` (seconds the planning took).
    """
    rows: list[dict[str, Any]] = []
    for p in ranks:
        start = time.perf_counter()
        try:
            plan, planner = make_plan(model, batch_shape, p, machine, memory, measure,
                                      channels=channels, max_states=max_states)
        except ValueError as exc:
            rows.append({"ranks": p, "time_ms": None, "note": str(exc)})
            continue
        grids = sorted({e.grid for e in plan.entries}, key=str)
        sample_parallel = (p,) + (1,) * (len(planner.cands[0]) - 1)
        uniform = _uniform(planner, sample_parallel)
        rows.append({"ranks": p, "time_ms": 1e3 * plan.time, "compute_ms": 1e3 * plan.compute,
                     "exposed_ms": 1e3 * plan.exposed_comm, "hidden_ms": 1e3 * plan.hidden_comm,
                     "peak_MiB": plan.peak_memory / 2**20,
                     "grids": [list(g) for g in grids], "inner": plan.inner,
                     "modes": dict(sorted(Counter(e.mode for e in plan.entries
                                                  if e.mode).items())),
                     "sample_parallel_ms": 1e3 * uniform.time if uniform else None,
                     "sample_parallel_split": [1e3 * uniform.compute, 1e3 * uniform.exposed_comm,
                                               1e3 * uniform.hidden_comm] if uniform else None,
                     "plan_s": time.perf_counter() - start})
    return rows


def _uniform(planner: Planner, cand: tuple[int, ...]) -> Plan | None:
    if tuple(cand) not in planner.cands:
        return None
    return planner.uniform_plan(cand)


def wait_for_root(comm: MPI.Comm, root: int = 0) -> None:
    """Non-root ranks wait for ``root`` without spinning a core (sleep-polled barrier).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Every rank of it calls this (collective).
    root : int
        The rank the others wait for.
    """
    req = comm.Ibarrier()
    if comm.Get_rank() == root:
        req.Wait()
        return
    while not req.Test():
        time.sleep(0.005)
