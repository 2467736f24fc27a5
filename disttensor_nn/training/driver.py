"""The training driver: plan, load data in the planned layout, train, checkpoint, report."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from mpi4py import MPI
from tqdm import tqdm

from disttensor import node_share, use_device
from disttensor.backend import is_numpy, nbytes, numpy_dtype
from disttensor.blockcache import active_block_cache, block_cache

from ..container import Sequential
from ..kernels import limit_threads, synchronize
from ..memory import (
    MemoryProfile,
    available_bytes,
    keep_heap_top,
    map_large_allocations,
    release_free_memory,
    resident_bytes,
)
from ..module import GradientBuckets, Layer, Layout, RemovableHandle, no_sync
from ..optim import clip_grad_norm_
from ..optim.lr_scheduler import LRScheduler
from ..plan import Plan, apply_plan, kernel_choice, make_plan
from ..plan.calibrate import calibrate, stale_calibration
from ..plan.machine import MachineProfile, this_machine_path
from ..plan.timer import warm_up
from ..plan.tracing import leaf_nodes, trace
from ..precision import (
    GradScaler,
    activation_dtype,
    precision_dtype,
    precision_of,
    set_precision,
)
from ..recompute import recompute_segments
from .checkpoint import CheckpointError, checkpoint_manifest, load_checkpoint, save_checkpoint
from .data import Loader, Prefetcher, open_dataset
from .recipe import (
    make_optimizer,
    make_scheduler,
    recipe_problem,
    resume_problem,
    state_slots,
)
from .registry import build_model, check_size, model_spec

__all__ = ["TrainConfig", "train", "plan_mismatch", "prediction_warning", "prefetch_depth",
           "next_batch", "SetupError",
           "MemoryBudgetError"]

RECOMPUTE = {"auto": "auto", "always": True, "never": False}
"""``TrainConfig.recompute`` -> the planner's ``recompute`` option."""

HEAVY_LOAD = 0.5
"""Load average per core above which a calibration is flagged as measured under load."""


class SetupError(ValueError):
    """A configuration that cannot train, found by :func:`train` before its first step.

    Raised with the same message on every rank (the checks use only what
    every rank knows, or agreed results such as a checkpoint's verdict):
    a plan file for another model, batch or number of ranks, a memory budget
    no plan fits, a checkpoint that cannot be resumed or whose step is not
    below ``steps``, data of the wrong shape.
    """


class MemoryBudgetError(SetupError):
    """The training step would exceed the memory budget (raised on every rank before it runs).

    The message names the layer at which the predicted memory of the step,
    on top of what the ranks hold now, passes the budget, and by how much.
    """


@dataclass
class TrainConfig:
    """Everything ``disttensor-train`` can be told; defaults are the built-in demo."""

    model: str = "mesh-demo"
    layout: str = "auto"  # "auto" (run the planner) or a plan JSON file
    batch: int = 4
    steps: int = 100
    size: tuple[int, ...] | None = None
    lr: float | None = None
    optimizer: str = "sgd"  # "sgd", "adam" or "adamw" (recipe.OPTIMIZERS)
    momentum: float = 0.9  # SGD's
    weight_decay: float | None = None  # None: the optimizer's default (AdamW's is 0.01)
    schedule: str = "none"  # "none", "step", "cosine" or "linear" (recipe.SCHEDULES)
    warmup_steps: int = 0  # a linear warm-up over the first steps, before the schedule
    warmup_start_factor: float = 0.1  # the warm-up starts at this share of the rate
    step_size: int | None = None  # "step": steps between decays (None: a third of the rest)
    gamma: float = 0.1  # "step": the factor of each decay
    min_lr: float = 0.0  # "cosine", "linear": the rate at the last step
    schedule_steps: int | None = None  # the steps the schedule spans (None: steps)
    clip_grad_norm: float | None = None  # the largest norm of the whole model's gradient
    seed: int = 0
    samples: int = 64
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    metrics: str | None = "disttensor-metrics"
    machine: str = "this"
    memory_per_rank: float | None = None
    progress: bool = True
    data: str | None = None  # a data set file (open_dataset: HDF5, Zarr, .npy) instead of synthetic
    data_input: str = "input"  # names of the input and target arrays in that file
    data_target: str = "target"
    recalibrate: bool = False  # measure this machine again even if a calibration is cached
    profile_memory: bool = False  # peak memory by phase and layer, largest allocations
    block_cache: bool = True  # the step's large blocks reused from step to step
    recompute: str = "auto"  # "auto" (when no plan fits otherwise), "always" or "never"
    device: str = "cpu"  # "cpu" (NumPy) or "gpu" (CuPy, one GPU per rank of a node)
    accumulate: int = 1  # micro-batches of `batch` samples per step, one gradient reduction
    kernels: str = "auto"  # "numpy", "torch" or "auto" (each layer's faster; make_plan)
    threads: int | None = None  # kernel threads per rank (None: the cores / ranks per node)
    # batches prepared ahead by a thread while a step runs (0: none; None: 1 where each rank
    # of the node has a core for the thread beside its kernel threads, else 0)
    prefetch: int | None = None
    # "none", "optimizer", "gradients", "full" (optim.shard_state) or "auto" (the planner's
    # choice: the fastest stage whose plan fits the budget; make_plan)
    shard_state: str = "none"
    # "fp32", "bf16" or "fp16" (precision.PRECISIONS): activations, halos and messages in 16
    # bits, parameters and optimizer state in float32; fp16 with dynamic loss scaling
    precision: str = "fp32"


def _timed(nodes: list) -> tuple[list[list[float]], list[RemovableHandle]]:
    """Accumulate each layer's forward+backward wall time (to compare with the plan).

    Returns one clock (``[seconds]``) per node, kept by forward and backward
    hooks on the node's layer, and the hooks' handles (``remove()`` them to stop).
    """
    clocks, handles = [], []
    for node in nodes:
        clock, start = [0.0], [0.0]

        def begin(layer: Layer, *args: Any, start: list[float] = start) -> None:
            start[0] = time.perf_counter()

        def end(layer: Layer, *args: Any, clock: list[float] = clock,
                start: list[float] = start) -> None:
            clock[0] += time.perf_counter() - start[0]

        layer = node.layer
        handles += [layer.register_forward_pre_hook(begin), layer.register_forward_hook(end),
                    layer.register_full_backward_pre_hook(begin),
                    layer.register_full_backward_hook(end)]
        clocks.append(clock)
    return clocks, handles


def plan_mismatch(plan: Plan, model: Layer, shape: tuple[int, ...], nprocs: int) -> str | None:
    """What makes ``plan`` unfit for ``model`` on a batch of ``shape`` over ``nprocs`` ranks.

    Returns None when the plan fits (:func:`~disttensor_nn.plan.apply_plan`
    accepts it), otherwise a sentence naming the first difference: the
    number of ranks, the batch shape, the first layer whose kind or input
    shape differs (a plan made for another model), or the activations'
    precision.
    """
    if plan.nprocs != nprocs:
        return f"the plan is for {_plural(plan.nprocs, 'rank')}, this job has {nprocs}"
    if tuple(plan.batch_shape) != tuple(shape):
        return (f"the plan is for batches of shape {tuple(plan.batch_shape)}, this run's are "
                f"{tuple(shape)} (--batch and --size)")
    nodes = leaf_nodes(trace(model, tuple(shape)))
    for i, (node, entry) in enumerate(zip(nodes, plan.entries)):
        kind = type(node.layer).__name__
        if entry.layer != kind or tuple(entry.in_shape) != tuple(node.in_shape):
            return (f"layer {i} of the plan is {entry.layer} on {tuple(entry.in_shape)}, the "
                    f"model's is {kind} on {tuple(node.in_shape)}: the plan was made for "
                    "another model")
    if len(nodes) != len(plan.entries):
        return (f"the plan has {len(plan.entries)} layers, the model {len(nodes)}: it was made "
                "for another model")
    mine = precision_of(activation_dtype(model))
    if plan.precision != mine:
        return (f"the plan is for {plan.precision} activations, this run's are {mine} "
                "(--precision): its memory and times count other block sizes")
    return None


def _replicated(model: Layer, nprocs: int) -> bool:
    """Whether some parameter of ``model`` (as a plan split it over ``nprocs`` ranks) is held
    alike by several ranks: what :func:`~disttensor_nn.optim.shard_state` shards."""
    return nprocs > 1 and any(p.dist is None or p.dist.nreplicas > 1
                              for p in model.parameters())


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _say(comm: MPI.Comm, text: str) -> None:
    """Print on rank 0 (progress messages of the long phases)."""
    if comm.Get_rank() == 0:
        print(text, flush=True)


def _machine(cfg: TrainConfig, comm: MPI.Comm, memory: MemoryProfile) -> str:
    """The machine profile to plan on; this machine is calibrated first when it has no
    calibration taken with this job's ranks per node (or when asked to)."""
    machine = cfg.machine
    if cfg.layout != "auto":
        return machine  # the plan is read, not made
    device = "gpu" if cfg.device == "gpu" else "cpu"
    if machine == "this" and device == "gpu":
        machine = "this-gpu"  # the profile calibrated with the ranks on their GPUs
    if machine in ("this", "this-gpu"):
        path = this_machine_path(device=device)
        if comm.Get_size() == 1 and os.path.exists(path):
            # one rank communicates nothing: the calibration's compute rates serve the
            # layers not timed, and every kernel is timed here, on this rank alone
            _say(comm, f"1 rank: kernels timed here, on the cached calibration {path} "
                       "(its communication figures are not needed)")
        elif comm.Get_size() == 1:
            machine = "v100-nvlink-edr"  # nothing to calibrate communication with
            _say(comm, "1 rank: nothing to calibrate communication with and no calibration "
                       f"cached (run once on 2 or more ranks); planning for the built-in "
                       f"profile {machine}")
        elif cfg.recalibrate or (why := stale_calibration(comm, device)):
            if not cfg.recalibrate:
                _say(comm, f"{why}: calibrating again")
            _say(comm, f"calibrating this machine's communication and compute on "
                       f"{_plural(comm.Get_size(), 'rank')} (kept in {path} for later runs)...")
            with memory.phase("calibration"):
                calibrate(comm, device=device)
        else:
            profile = MachineProfile.load(path)
            _say(comm, f"using the cached calibration {path} ({profile.notes}); "
                       "--recalibrate measures again")
            if (profile.load_per_core or 0) > HEAVY_LOAD:
                _say(comm, f"warning: that calibration was taken under a load of "
                           f"{profile.load_per_core:.1f} per core; its predictions will be "
                           "too slow if the machine is quieter now (use --recalibrate)")
    return machine


def _plan(cfg: TrainConfig, model: Any, shape: tuple[int, ...], comm: MPI.Comm,
          memory: MemoryProfile, baseline: float, machine: str) -> Plan:
    if cfg.layout != "auto":
        with open(cfg.layout) as f:
            plan = Plan.from_json(f.read())
        problem = plan_mismatch(plan, model, shape, comm.Get_size())
        if problem:
            raise ValueError(f"{cfg.layout}: {problem}")
        return plan
    _say(comm, f"planning {cfg.model} for {_plural(comm.Get_size(), 'rank')} (kernels not "
               "timed before are measured first)...")
    if cfg.recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {cfg.recompute!r}")
    plan, _ = make_plan(model, shape, comm.Get_size(), machine, cfg.memory_per_rank,
                        comm=comm, baseline=baseline, profile=memory,
                        recompute=RECOMPUTE[cfg.recompute], kernels=cfg.kernels,
                        shard_state=cfg.shard_state, state_slots=state_slots(cfg))
    return plan


def _applied_stage(cfg: TrainConfig, plan: Plan) -> str:
    """The sharding stage training runs: ``cfg.shard_state``, or under ``"auto"`` the
    stage the plan was made for (:attr:`Plan.shard_state`: the planner's choice, or what
    a plan read from a file records)."""
    return plan.shard_state if cfg.shard_state == "auto" else cfg.shard_state


def _check_config(cfg: TrainConfig) -> None:
    """Refuse, on every rank alike and before any work, options that cannot run.

    Raises
    ------
    SetupError
        For an unknown kernel backend, torch kernels without PyTorch (naming the
        extra), a thread count below one, a prefetch depth other than 0, 1 or 2, or an
        unknown precision (or bf16 without the ml_dtypes package).
    """
    try:
        kernel_choice(cfg.kernels)
    except (ValueError, ImportError) as exc:
        raise SetupError(f"--kernels {cfg.kernels}: {exc}") from exc
    if cfg.threads is not None and (isinstance(cfg.threads, bool) or
                                    not isinstance(cfg.threads, int) or cfg.threads < 1):
        raise SetupError(f"--threads must be a positive integer, got {cfg.threads!r}")
    if cfg.prefetch not in (None, 0, 1, 2):
        raise SetupError(f"prefetch must be 0, 1 or 2 batches or None, got {cfg.prefetch!r}")
    try:
        precision_dtype(cfg.precision)
    except (ValueError, ImportError) as exc:
        raise SetupError(f"--precision {cfg.precision}: {exc}") from exc


def prefetch_depth(cfg: TrainConfig, comm: MPI.Comm) -> int:
    """The batches a thread prepares ahead: ``cfg.prefetch``, or by default 1 where every
    rank of the node has a core for the thread besides its kernel threads, else 0.

    Collective (the node's ranks are counted). Where the cores are all busy with
    kernels, the thread's synthesis and reading take the interpreter's lock from a
    step's many short passes and the cores from its kernels: on 2 cores a mesh-demo
    iteration measured 190.6 ms with the thread and 87.7 ms without it (2 ranks),
    141.7 against 231.2 ms on 4 ranks, 206 against 397 ms on 1 rank of 2 threads.
    """
    if cfg.prefetch is not None:
        return cfg.prefetch
    local, cores = node_share(comm)
    threads = cfg.threads if cfg.threads is not None else max(1, cores // local)
    return 1 if local * (threads + 1) <= cores else 0


def _threads(cfg: TrainConfig, comm: MPI.Comm) -> tuple[int, int, int]:
    """Set each rank's kernel threads (BLAS and PyTorch's); returns (threads, ranks on this
    node, cores). Collective. By default the cores divided by the ranks of the node."""
    local, cores = node_share(comm)
    threads = cfg.threads if cfg.threads is not None else max(1, cores // local)
    if threads * local > cores and cfg.threads is not None and threads > 1:
        _say(comm, f"warning: --threads {threads} on {_plural(local, 'rank')} of this node "
                   f"asks for more threads than its {_plural(cores, 'core')}; kernels compete")
    limit_threads(threads)
    return threads, local, cores


def _setup(cfg: TrainConfig, comm: MPI.Comm, memory: MemoryProfile, xp: Any) -> tuple:
    """Everything before the first step: model, plan, data, optimizer, resumed state.

    The model is built and planned on the host, then moved to ``xp`` (with
    its optimizer state, created there); batches follow it one at a time.
    """
    rank = comm.Get_rank()
    _check_config(cfg)
    lr = cfg.lr if cfg.lr is not None else model_spec(cfg.model).lr
    problem = recipe_problem(cfg, lr)
    if problem:
        raise SetupError(problem)
    if cfg.resume and cfg.checkpoint:  # the saved optimizer and schedule, before any work
        problem = resume_problem(cfg, checkpoint_manifest(cfg.checkpoint, comm=comm), lr)
        if problem:
            raise SetupError(f"--resume {cfg.checkpoint}: {problem}")
    threads, local, cores = _threads(cfg, comm)
    with memory.phase("data"):
        model, shape, spec, data = _model_and_data(cfg)
    # what a rank holds besides the parameters and their gradients (the interpreter,
    # NumPy, MPI, the data set, the code a step runs and the buffers of the libraries
    # under it, a calibration's included): the process baseline of the predicted peak
    warm_up([(n.layer, n.in_shape) for n in leaf_nodes(trace(model, shape))],
            backends=kernel_choice(cfg.kernels) or (None,), dtype=activation_dtype(model))
    machine = _machine(cfg, comm, memory)
    release_free_memory()
    params = sum(nbytes(p.data) for p in model.parameters())
    baseline = comm.allreduce(resident_bytes() - 2 * params, op=MPI.MAX)
    # the batches a prefetching thread holds ahead: a rank's share of each batch's input and
    # target (their split is the first layer's, known once planned: a share of the ranks)
    ahead = cfg.prefetch * (math.prod(shape) + math.prod((cfg.batch, *data.target_shape))) \
        * np.dtype(np.float32).itemsize / comm.Get_size()
    plan = _plan(cfg, model, shape, comm, memory, baseline + ahead, machine)
    apply_plan(model, plan, shape, comm)
    stage = _applied_stage(cfg, plan)
    if stage != "none" and not _replicated(model, comm.Get_size()):
        _say(comm, f"note: --shard-state {stage} does nothing here: no parameter of "
                   "this plan is replicated over several ranks, so there is no state to "
                   "shard (training goes on unsharded)")
    if not is_numpy(xp):
        model.to(xp)
    nodes = leaf_nodes(trace(model, shape))
    recompute_segments([n.layer for n in nodes], [e.recompute for e in plan.entries])
    plan.notes.append(
        f"kernels on {_plural(threads, 'thread')} per rank ({_plural(local, 'rank')} on "
        f"{_plural(cores, 'core')} of this node; --threads)" + (
            f"; batches prepared {cfg.prefetch} ahead by a thread while a step runs"
            if cfg.prefetch else ""))
    if rank == 0:
        print(f"{cfg.model}, batch {shape}, {_plural(comm.Get_size(), 'rank')}")
        print(plan.table(), flush=True)
    loss_fn = spec.loss()
    first: Layout = nodes[0].layer.layout
    target_layout = None
    if data.has_spatial_target:
        target_layout = Layout(first.grid, first.axes)
    loader = Loader(data, cfg.batch, first, shuffle=True, seed=cfg.seed,
                    target_layout=target_layout, xp=None if is_numpy(xp) else xp,
                    dtype=activation_dtype(model))
    lr = cfg.lr if cfg.lr is not None else spec.lr
    opt = make_optimizer(replace(cfg, shard_state=stage), model.parameters(), lr)
    sched = make_scheduler(cfg, opt)
    # float16 activations: the loss gradient scaled so that small gradients do not underflow
    scaler = GradScaler(enabled=cfg.precision == "fp16", comm=comm)
    step = 0
    history: list[dict[str, float]] = []
    if cfg.resume:
        if not cfg.checkpoint:
            raise ValueError("--resume needs --checkpoint DIR")
        state = load_checkpoint(cfg.checkpoint, model, opt, comm=comm, scheduler=sched)
        step = int(state["step"])
        if step >= cfg.steps:
            raise ValueError(f"the checkpoint {cfg.checkpoint} is at step {step}; --steps "
                             f"{cfg.steps} is not above it, so there is nothing to train (ask "
                             f"for more than {_plural(step, 'step')})")
        loader.load_state_dict(state["extra"]["loader"])
        history = [dict(h) for h in state["extra"].get("history", [])]
        if scaler.is_enabled() and state["extra"].get("grad_scaler"):
            scaler.load_state_dict(state["extra"]["grad_scaler"])
        _say(comm, f"resumed from step {step} ({cfg.checkpoint})")
    release_free_memory()  # what planning freed, before the step's peak is measured
    _check_budget(plan, model, comm, plan.shard_state)
    return model, shape, plan, nodes, loss_fn, loader, (opt, sched, scaler), step, history


CACHE_SLACK = 0.25
"""The block cache may hold this share more than the step's predicted blocks: its size
classes round each block up by up to an eighth, and buffers of one class wait free while
a step asks for another."""


def _planned_params(model: Layer, stage: str, nprocs: int) -> float:
    """Bytes of the weights and gradients as a plan made for ``stage`` counts them: the
    gradients (``"gradients"``), and the weights too (``"full"``), at 1/nprocs."""
    params = sum(p.local_size * numpy_dtype(p.dtype).itemsize for p in model.parameters())
    grads = params / nprocs if stage in ("gradients", "full") else params
    return grads + (params / nprocs if stage == "full" else params)


def _planned_blocks(plan: Plan, model: Layer, comm: MPI.Comm, stage: str) -> float:
    """Bytes the plan (made for the sharding ``stage``) predicts the step adds to the
    process besides its parameters and their gradients: the step's blocks."""
    return plan.peak_memory - plan.baseline_memory - _planned_params(model, stage,
                                                                     comm.Get_size())


def _cache_limit(plan: Plan, model: Layer, comm: MPI.Comm, stage: str = "none") -> int:
    """Bytes the step's block cache may hold: the step's blocks (:func:`_planned_blocks`)
    and :data:`CACHE_SLACK` more (within the budget, if there is one)."""
    extra = _planned_blocks(plan, model, comm, stage) * (1 + CACHE_SLACK)
    if plan.memory_budget:
        now = comm.allreduce(resident_bytes(), op=MPI.MAX)
        extra = min(extra, plan.memory_budget - now)
    return max(int(extra), 0)


def _cache_slack(plan: Plan, model: Layer, comm: MPI.Comm, stage: str,
                 limit: int | None) -> int:
    """Bytes a block cache of ``limit`` may hold beyond the blocks the plan predicts (free
    buffers of other size classes, the size classes' rounding): 0 without a cache."""
    if limit is None:
        return 0
    return max(int(limit - _planned_blocks(plan, model, comm, stage)), 0)


def _check_budget(plan: Plan, model: Layer, comm: MPI.Comm, stage: str = "none") -> None:
    """Refuse, on every rank, a step whose predicted memory (of a plan made for the
    sharding ``stage``) on top of what the ranks hold now passes the budget; warn when the
    node's free memory is short of it."""
    budget = plan.memory_budget
    now = comm.allreduce(resident_bytes(), op=MPI.MAX)
    # what the plan counts and the ranks already hold: the process, parameters, gradients
    held = plan.baseline_memory + _planned_params(model, stage, comm.Get_size())
    extra = max(0.0, plan.peak_memory - held)
    if budget and now + extra > budget:
        total, where = now, plan.entries[-1]
        for e in plan.entries:
            total += e.memory
            if total + e.transient > budget:
                where = e
                break
        raise MemoryBudgetError(
            f"the training step would need about {(now + extra) / 2**20:.0f} MiB per rank, "
            f"over the budget of {budget / 2**20:.0f} MiB by {(now + extra - budget) / 2**20:.0f}"
            f" MiB: the ranks hold {now / 2**20:.0f} MiB before it, and the budget is passed "
            f"at layer {where.name} ({where.layer}); raise --memory-per-rank or use more ranks")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    need = node.allreduce(extra)
    node.Free()
    avail = available_bytes()
    if avail is not None and need > avail:
        _say(comm, f"warning: the step needs about {need / 2**20:.0f} MiB more on this node, "
                   f"the operating system has {avail / 2**20:.0f} MiB available: the job may "
                   "be killed for lack of memory")


def _model_and_data(cfg: TrainConfig) -> tuple:
    """The model, the batch shape, the model's registry entry and the data set."""
    if isinstance(cfg.accumulate, bool) or not isinstance(cfg.accumulate, int) or \
            cfg.accumulate < 1:
        raise ValueError(f"accumulate must be a positive integer, got {cfg.accumulate!r}")
    spec = model_spec(cfg.model)
    size = cfg.size
    if cfg.data is not None:
        data = open_dataset(cfg.data, cfg.data_input, cfg.data_target)
        if data.sample_shape[0] != spec.in_channels or (
                size is not None and tuple(data.sample_shape[1:]) != tuple(size)):
            raise ValueError(f"the samples in {cfg.data} are {data.sample_shape}; model "
                             f"{cfg.model!r} takes {spec.in_channels} channels"
                             + (f" and --size {'x'.join(map(str, size))}" if size else ""))
        size = tuple(data.sample_shape[1:])
    if spec.sized:  # its builder refuses a size it cannot take: say which sizes work first
        check_size(cfg.model, size)
    model, shape = build_model(cfg.model, size, cfg.batch, seed=cfg.seed)
    check_size(cfg.model, size, model)
    set_precision(model, cfg.precision)  # before planning: 16-bit blocks are priced
    if isinstance(model, Sequential) and len(model):
        # it is fed data: no input gradient to compute (set before planning, so that the
        # kernels are timed and priced without it too)
        model[0].input_grad = False
    if cfg.data is None:
        data = spec.dataset(cfg.samples, tuple(shape[1:]), cfg.seed)
    return model, shape, spec, data


def train(cfg: TrainConfig, comm: MPI.Comm | None = None, *,
          xp: Any = None) -> dict[str, Any]:
    """Run the training loop; collective. Returns the summary (same on every rank).

    Parameters
    ----------
    cfg : TrainConfig
    comm : MPI.Comm, optional
        The job's ranks (``MPI.COMM_WORLD`` by default).
    xp : module, optional
        The array module that holds the model, its gradients and each batch,
        instead of the one ``cfg.device`` picks (NumPy for ``"cpu"``, CuPy on
        this rank's GPU for ``"gpu"``): any array API library whose arrays
        can be written by slices (the test suite trains on
        ``array_api_strict`` this way). Data are read on the host and moved
        to it once per batch; checkpoints go through the state protocol.

    Raises
    ------
    SetupError
        On every rank, before the first step, for a configuration that cannot
        train (see :class:`SetupError`), including ``device="gpu"`` where
        CuPy or a GPU is missing.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    # freed arrays leave the process, so the resident peak follows the live arrays (what
    # the plan predicts): under a budget every array from 1 MiB on is mapped on its own,
    # at the price of page faults on each new one; otherwise from 4 MiB on (fewer arrays,
    # so fewer faults)
    map_large_allocations(2**20 if cfg.memory_per_rank is not None else 2**22)
    keep_heap_top()  # scratch of a few MiB reused warm between the per-step trims
    memory = MemoryProfile(top=8 if cfg.profile_memory else 0)
    previous = _on_sigterm()
    try:
        if xp is None:
            try:
                xp = use_device(cfg.device, comm)
            except (ValueError, RuntimeError) as exc:  # the same on every rank of the job
                raise SetupError(f"--device {cfg.device}: {exc}") from exc
        return _train(cfg, comm, memory, xp)
    except SetupError:  # raised on every rank alike: one line from rank 0
        peak = comm.allreduce(_lifetime(memory), op=MPI.MAX)
        _say(comm, f"peak resident memory per rank {peak / 2**20:.0f} MiB "
                   f"(rank 0: {_phase_line(memory)})")
        raise
    except BaseException:
        # every exit says how much memory this rank held, whichever rank failed
        print(f"rank {comm.Get_rank()}: peak resident memory {_lifetime(memory) / 2**20:.0f} "
              f"MiB ({_phase_line(memory)})", flush=True)
        raise
    finally:
        memory.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_sigterm() -> Any:
    """Turn SIGTERM (how launchers stop the other ranks of a failed job) into SystemExit."""
    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)
    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        return None


def _lifetime(memory: MemoryProfile) -> int:
    """This process's peak resident bytes so far (the profile restarts the kernel's count)."""
    return memory.peak()


def _phase_line(memory: MemoryProfile) -> str:
    return ", ".join(f"{p.name} {p.peak / 2**20:.0f}" for p in memory.phases.values()) or \
        "before setup"


def _train(cfg: TrainConfig, comm: MPI.Comm, memory: MemoryProfile, xp: Any
           ) -> dict[str, Any]:
    rank = comm.Get_rank()
    if cfg.prefetch is None:
        cfg = replace(cfg, prefetch=prefetch_depth(cfg, comm))
    try:
        state = _setup(cfg, comm, memory, xp)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        if isinstance(exc, SetupError):
            raise
        raise SetupError(str(exc)) from exc
    model, shape, plan, nodes, loss_fn, loader, (opt, sched, scaler), step, history = state
    clocks, _ = _timed(nodes)
    if cfg.profile_memory:
        memory.watch([(f"{n.name} {type(n.layer).__name__}", n.layer) for n in nodes])
    bar = None
    if rank == 0 and cfg.progress:
        bar = tqdm(total=cfg.steps, initial=step,
                   desc=f"{cfg.model} on {_plural(comm.Get_size(), 'rank')}", unit="step")
    # the next batches are read or synthesised by a thread while the step runs
    it = Prefetcher(loader, cfg.prefetch) if cfg.prefetch else None
    plain = iter(loader) if it is None else None
    times, data_times = [], []
    warmup = [0.0] * len(clocks)
    cache_limit = _cache_limit(plan, model, comm, plan.shard_state) \
        if cfg.block_cache else None
    try:
        with (block_cache(cache_limit) if cfg.block_cache else contextlib.nullcontext()) \
                as cache:
            step, warmup, warm_misses = _loop(cfg, comm, memory, xp, model, loss_fn, opt,
                                              loader, it, plain, step, history, clocks, times,
                                              data_times, bar, sched, scaler)
            cached = None if cache is None else {
                **asdict(cache.stats),
                "misses_after_first_step": cache.stats.misses - warm_misses}
    finally:
        if it is not None:
            it.close()
    if bar is not None:
        bar.close()
    measured = np.array([c[0] for c in clocks])
    if len(times) > 1:
        measured -= warmup
    comm.Allreduce(MPI.IN_PLACE, measured, op=MPI.MAX)
    measured /= max(len(times) - (len(times) > 1), 1)
    peak = comm.allreduce(_lifetime(memory), op=MPI.MAX)

    def phase_peak(*names: str) -> int:
        return comm.allreduce(max((memory.phases[n].peak for n in names
                                   if n in memory.phases), default=0), op=MPI.MAX)
    summary = {
        "model": cfg.model, "batch_shape": list(shape), "ranks": comm.Get_size(),
        "steps": step, "shard_state": _applied_stage(cfg, plan),
        "precision": cfg.precision,
        "skipped_steps": scaler.skipped_steps if scaler.is_enabled() else 0,
        "loss_scale": scaler.get_scale() if scaler.is_enabled() else None,
        "final_loss": history[-1]["loss"] if history else None,
        "first_loss": history[0]["loss"] if history else None,
        "history": [h["loss"] for h in history],
        "time_per_iteration_s": float(np.median(np.add(times, data_times))) if times else None,
        "compute_time_per_iteration_s": float(np.median(times)) if times else None,
        "data_time_per_iteration_s": float(np.median(data_times)) if times else None,
        "samples_per_s": cfg.batch * cfg.accumulate /
        float(np.median(np.add(times, data_times)))
        if times else None,
        # the plan is for one micro-batch, its gradient reduction included: an upper bound
        "predicted_time_per_iteration_s": cfg.accumulate * plan.time,
        "peak_memory_per_rank_bytes": peak, "predicted_peak_memory_bytes": plan.peak_memory,
        # the cache holds free buffers besides the live ones, up to its limit: the part of
        # the limit above the blocks the plan counts comes on top of the plan's peak
        "predicted_cache_slack_bytes": _cache_slack(plan, model, comm, plan.shard_state,
                                                    cache_limit),
        "predicted_baseline_memory_bytes": plan.baseline_memory,
        "training_peak_memory_per_rank_bytes": phase_peak("forward", "backward", "optimizer"),
        "planning_peak_memory_per_rank_bytes": phase_peak("calibration", "kernel measurement",
                                                          "planning"),
        "memory_budget_bytes": plan.memory_budget,
        "block_cache": None if cached is None else {**cached, "limit_bytes": cache_limit},
        "memory_profile": _gather_profile(memory, comm) if cfg.profile_memory else None,
        "layers": [{"name": e.name, "layer": e.layer, "grid": list(e.grid),
                    "predicted_s": e.fwd + e.bwd + e.comm, "measured_s": float(m)}
                   for e, m in zip(plan.entries, measured)],
        "config": {k: v for k, v in asdict(cfg).items()},
    }
    if rank == 0:
        if cfg.profile_memory:
            _print_profile(summary["memory_profile"])
        _print_summary(summary)
        _write_metrics(cfg.metrics, history, summary)
    return summary


def next_batch(loader: Loader, it: Prefetcher | None, plain: Any) -> tuple[Any, Any, Any]:
    """The next ``(input, target)`` batch: from the prefetching thread ``it`` if there is
    one, else from the loader's iterator ``plain``, started again at the end of an epoch;
    returns the batch and the iterator to use next."""
    if it is not None:
        x, y = it.next()
        return x, y, plain
    try:
        x, y = next(plain)
    except StopIteration:
        plain = iter(loader)
        x, y = next(plain)
    return x, y, plain


def _loop(cfg: TrainConfig, comm: MPI.Comm, memory: MemoryProfile, xp: Any, model: Layer,
          loss_fn: Any, opt: Any, loader: Loader, it: Prefetcher | None, plain: Any,
          step: int, history: list[dict], clocks: list[list[float]], times: list[float],
          data_times: list[float], bar: Any, sched: LRScheduler | None = None,
          scaler: GradScaler | None = None) -> tuple[int, list[float], int]:
    """The training steps from ``step`` on; returns the last step, the layers' clocks
    after the first step and the active block cache's misses then (``times``,
    ``data_times`` and ``history`` grow in place).

    A step's time is its wall time; of it, ``data_s`` is the time it waited for its
    batches (with prefetching, only what the thread had not prepared yet). With an
    enabled ``scaler`` (float16), the loss gradient is scaled and a step whose gradients
    are not finite is skipped (``skipped`` in its history entry).
    """
    scaler = scaler if scaler is not None else GradScaler(enabled=False)
    warmup = [0.0] * len(clocks)
    warm_misses = 0
    while step < cfg.steps:
        comm.Barrier()
        t0 = time.perf_counter()
        dt_data, losses = 0.0, []
        opt.zero_grad()
        for micro in range(cfg.accumulate):
            t_data = time.perf_counter()
            x, y, plain = next_batch(loader, it, plain)
            # the loader's scratch and the last step's arrays, freed, leave the process
            # before this step's peak (the C allocator would keep them resident)
            release_free_memory()
            dt_data += time.perf_counter() - t_data
            with memory.phase("forward"):
                out = model(x)
                losses.append(loss_fn(out, y))
            # the gradient of the mean over the micro-batches; its sums over ranks fused and
            # overlapped, and sent once, with the last micro-batch's backward
            last = micro == cfg.accumulate - 1
            with memory.phase("backward"), GradientBuckets(), \
                    (contextlib.nullcontext() if last else no_sync()):
                # the gradient scaled (fp16: loss scaling) before it is rounded to the
                # activations' dtype
                model.call_backward(loss_fn.backward(scale=scaler.get_scale() / cfg.accumulate))
            # what forward kept for backward goes now, not when the next forward replaces
            # it: the optimizer and the next batch run without it, and the next step's
            # blocks reuse its buffers
            for layer in model.modules():
                layer.release_saved()
        loss = float(np.mean(losses))
        lr = opt.lr  # this step's learning rate
        with memory.phase("optimizer"):
            scaler.unscale_(opt)  # fp16: the true gradients, and whether all are finite
            if cfg.clip_grad_norm is not None:  # by the norm of the whole model's gradient
                clip_grad_norm_(opt.params, cfg.clip_grad_norm)
            took = scaler.step(opt)
            scaler.update()
            if sched is not None:
                sched.step()
        synchronize(xp)  # the step's device work, inside its clock
        clocks_now = np.array([time.perf_counter() - t0, dt_data])
        comm.Allreduce(MPI.IN_PLACE, clocks_now, op=MPI.MAX)
        wall, dt_data = clocks_now.tolist()
        dt_step = wall - dt_data
        step += 1
        times.append(dt_step)
        if len(times) == 1:  # the first step warms caches and allocator: not in the layer times
            warmup = [c[0] for c in clocks]
            cache = active_block_cache()
            warm_misses = cache.stats.misses if cache is not None else 0
        data_times.append(dt_data)
        total = wall
        history.append({"step": step, "loss": loss, "time_s": total, "compute_s": dt_step,
                        "data_s": dt_data, "samples_per_s": cfg.batch * cfg.accumulate / total,
                        "lr": lr, **({} if not scaler.is_enabled() else
                                     {"skipped": not took, "loss_scale": scaler.get_scale()})})
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", compute_ms=f"{1e3 * dt_step:.0f}",
                            data_ms=f"{1e3 * dt_data:.0f}")
            bar.update(1)
        if cfg.checkpoint and (step == cfg.steps or (cfg.checkpoint_every and
                                                     step % cfg.checkpoint_every == 0)):
            save_checkpoint(cfg.checkpoint, model, opt, step,
                            extra={"loader": (it or loader).state_dict(),
                                   "history": history, "grad_scaler": scaler.state_dict()},
                            comm=comm, scheduler=sched)
    return step, warmup, warm_misses


def _gather_profile(memory: MemoryProfile, comm: MPI.Comm) -> dict[str, Any]:
    """Every rank's phases and layers (peaks in MiB), with the largest allocations of rank 0."""
    mine = memory.summary()
    ranks = comm.allgather(mine)
    return {"exact": all(r["exact"] for r in ranks),
            "phases": [{"name": p["name"],
                        "peak_MiB_per_rank": [r["phases"][i]["peak_MiB"] for r in ranks],
                        **({"largest_allocations_rank0": p["largest_allocations"]}
                           if "largest_allocations" in p else {})}
                       for i, p in enumerate(mine["phases"])],
            "layers": [{"name": p["name"],
                        "peak_MiB_per_rank": [r["layers"][i]["peak_MiB"] for r in ranks],
                        "end_MiB_per_rank": [r["layers"][i]["end_MiB"] for r in ranks]}
                       for i, p in enumerate(mine["layers"])]}


def _print_profile(prof: dict[str, Any]) -> None:
    print("\nmemory profile: peak resident MiB per rank, by phase"
          + ("" if prof["exact"] else " (peaks since the start: the OS cannot reset them)"))
    for p in prof["phases"]:
        print(f"  {p['name']:<22} " + " ".join(f"{v:8.0f}" for v in p["peak_MiB_per_rank"]))
        for a in p.get("largest_allocations_rank0", [])[:5]:
            print(f"      {a['MiB']:8.1f} MiB alive at the peak, allocated at {a['where']}")
    print("by layer (peak during the pass, resident after it), rank 0:")
    for p in prof["layers"]:
        print(f"  {p['name'][:34]:<34} {p['peak_MiB_per_rank'][0]:8.0f} "
              f"{p['end_MiB_per_rank'][0]:8.0f}")


def _write_metrics(prefix: str | None, history: list[dict], summary: dict) -> None:
    if not prefix:
        return
    with open(f"{prefix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "loss", "time_s", "compute_s", "data_s",
                                          "samples_per_s"], extrasaction="ignore")
        w.writeheader()
        w.writerows(history)
    with open(f"{prefix}.json", "w") as f:
        json.dump({"history": history, "summary": summary}, f, indent=1)
    print(f"metrics written to {os.path.abspath(prefix)}.csv and .json (--metrics PREFIX; "
          "plot them with disttensor-plot)")


def prediction_warning(summary: dict, tolerance: float = 0.25, top: int = 3) -> str | None:
    """A warning when a run's measured step differs from the plan's prediction by more than
    ``tolerance`` (a share of the prediction), naming the layers that account for most of
    the difference; None otherwise.

    ``summary`` is what :func:`train` returns: its ``compute_time_per_iteration_s`` and
    ``predicted_time_per_iteration_s``, and per layer ``predicted_s`` and ``measured_s``
    (the driver's forward and backward clocks, communication included).
    """
    measured = summary.get("compute_time_per_iteration_s")
    predicted = summary.get("predicted_time_per_iteration_s")
    if not measured or not predicted or abs(measured - predicted) <= tolerance * predicted:
        return None
    layers = summary.get("layers") or []
    worst = sorted(layers, key=lambda e: -abs(e["measured_s"] - e["predicted_s"]))[:top]
    named = ", ".join(f"{e['name']} {e['layer']} {1e3 * e['measured_s']:.1f} ms measured / "
                      f"{1e3 * e['predicted_s']:.1f} ms predicted" for e in worst)
    return (f"warning: the step took {measured / predicted:.2f}x its predicted time"
            + (f"; most of the difference is in {named}" if named else ""))


def _print_summary(s: dict) -> None:
    k = s["config"].get("accumulate", 1)
    auto = s["config"].get("shard_state") == "auto"
    micro = f" x {k} micro-batches" if k > 1 else ""
    print(f"\n{s['model']} {tuple(s['batch_shape'])}{micro} on {_plural(s['ranks'], 'rank')}: "
          f"{_plural(s['steps'], 'step')}"
          + (f"; parameter state sharded: {s['shard_state']}"
             if s.get("shard_state", "none") != "none" else
             "; parameter state not sharded" if auto else "")
          + (" (chosen by --shard-state auto: the fastest plan that fits)" if auto else ""))
    if s["first_loss"] is not None:
        print(f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}"
              + (f"; activations in {s['precision']}" if s.get("precision", "fp32") != "fp32"
                 else "")
              + (f"; {_plural(s['skipped_steps'], 'step')} skipped for non-finite gradients "
                 f"(loss scale now {s['loss_scale']:g})" if s.get("loss_scale") else ""))
    if s["time_per_iteration_s"]:
        print(f"time per iteration {1e3 * s['time_per_iteration_s']:.1f} ms: compute "
              f"{1e3 * s['compute_time_per_iteration_s']:.1f} ms (predicted "
              f"{1e3 * s['predicted_time_per_iteration_s']:.1f} ms), data loading "
              f"{1e3 * s['data_time_per_iteration_s']:.1f} ms; "
              f"{s['samples_per_s']:.1f} samples/s")
    warning = prediction_warning(s)
    if warning:
        print(warning)
    budget = s.get("memory_budget_bytes")
    slack = s.get("predicted_cache_slack_bytes") or 0
    print(f"peak memory per rank (resident): training step "
          f"{s['training_peak_memory_per_rank_bytes'] / 2**20:.0f} MiB (predicted "
          f"{(s['predicted_peak_memory_bytes'] + slack) / 2**20:.0f} MiB"
          + (f", the block cache's slack of {slack / 2**20:.0f} MiB included" if slack else "")
          + "), planning "
          f"{s['planning_peak_memory_per_rank_bytes'] / 2**20:.0f} MiB, whole run "
          f"{s['peak_memory_per_rank_bytes'] / 2**20:.0f} MiB"
          + (f"; budget {budget / 2**20:.0f} MiB" if budget else ""))
    bc = s.get("block_cache")
    if bc:
        print(f"block cache: {bc['held_bytes'] / 2**20:.0f} MiB held (limit "
              f"{bc['limit_bytes'] / 2**20:.0f} MiB), {bc['hits']} blocks reused, "
              f"{bc['misses']} mapped, {bc['misses_after_first_step']} of them after the "
              f"first step; {bc['overflows']} outside the cache")
