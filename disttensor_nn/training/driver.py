"""The training driver: plan, load data in the planned layout, train, checkpoint, report."""

from __future__ import annotations

import contextlib
import signal
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import use_device
from disttensor.backend import is_numpy, nbytes, numpy_dtype
from disttensor.blockcache import active_block_cache, block_cache

from ..container import Sequential
from ..kernels import optimizer_backend, synchronize
from ..layers.norm import BATCH_NORM_STATS, set_batch_norm_stats
from ..layout import to_memory_format
from ..memory import (
    HEAP_TOP_KEPT,
    MemoryProfile,
    available_bytes,
    keep_heap_top,
    map_large_allocations,
    release_free_memory,
    resident_bytes,
)
from ..module import GradientBuckets, Layer, Layout, no_sync
from ..optim import clip_grad_norm_
from ..optim.lr_scheduler import LRScheduler
from ..plan import Plan, apply_plan, kernel_choice, make_plan
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
from .checkpoint import CheckpointError, checkpoint_manifest, load_checkpoint
from .clocks import LayerClocks
from .data import Loader, Prefetcher, open_dataset
from .loop import (  # noqa: F401 - importable from here as before
    KEEP_SHARE,
    Batches,
    StepResult,
    check_resume_step,
    keep_data,
    machine_profile,
    make_kept,
    mapping_threshold,
    memory_summary,
    metrics_problem,
    next_batch,
    peak_memory,
    phase_line,
    plural,
    prediction_warning,
    prefetch_depth,
    print_summary,
    process_baseline,
    progress_bar,
    run_steps,
    say,
    say_peak_memory,
    set_threads,
    threads_note,
    timing_summary,
    write_metrics,
)
from .recipe import (
    make_optimizer,
    make_scheduler,
    recipe_problem,
    resume_problem,
    state_slots,
)
from .registry import build_model, check_size, model_spec

__all__ = ["TrainConfig", "train", "plan_mismatch", "SetupError", "MemoryBudgetError"]

RECOMPUTE = {"auto": "auto", "always": True, "never": False}
"""``TrainConfig.recompute`` -> the planner's ``recompute`` option."""

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
    # a synthetic data set's blocks made before the first step and kept, where all of them fit
    # a quarter of the memory the plan leaves free (the steps copy them)
    keep_data: bool = True
    recompute: str = "auto"  # "auto" (when no plan fits otherwise), "always" or "never"
    device: str = "cpu"  # "cpu" (NumPy) or "gpu" (CuPy, one GPU per rank of a node)
    accumulate: int = 1  # micro-batches of `batch` samples per step, one gradient reduction
    kernels: str = "auto"  # "numpy", "torch" or "auto" (each layer's faster; make_plan)
    # the activations' blocks in "contiguous" or "channels_last" layout, or "auto": both
    # planned where the torch kernels may run on 2-D samples, the faster kept (make_plan)
    memory_format: str = "auto"
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
    # the batch norms' statistics in training: "global" (the whole batch, as one process) or
    # "group" (each group of ranks holding the same samples its own, as PyTorch's batch
    # norms under DistributedDataParallel; BatchNormNd's stats, parallelize's
    # batch_norm_stats)
    bn_stats: str = "global"


def plan_mismatch(plan: Plan, model: Layer, shape: tuple[int, ...], nprocs: int) -> str | None:
    """What makes ``plan`` unfit for ``model`` on a batch of ``shape`` over ``nprocs`` ranks.

    Returns None when the plan fits (:func:`~disttensor_nn.plan.apply_plan`
    accepts it), otherwise a sentence naming the first difference: the
    number of ranks, the batch shape, the first layer whose kind or input
    shape differs (a plan made for another model), or the activations'
    precision.
    """
    if plan.nprocs != nprocs:
        return f"the plan is for {plural(plan.nprocs, 'rank')}, this job has {nprocs}"
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


def _plan(cfg: TrainConfig, model: Any, shape: tuple[int, ...], comm: MPI.Comm,
          memory: MemoryProfile, baseline: float, machine: str) -> Plan:
    if cfg.layout != "auto":
        with open(cfg.layout) as f:
            plan = Plan.from_json(f.read())
        problem = plan_mismatch(plan, model, shape, comm.Get_size())
        if problem:
            raise ValueError(f"{cfg.layout}: {problem}")
        return plan
    say(comm, f"planning {cfg.model} for {plural(comm.Get_size(), 'rank')} (kernels not "
               "timed before are measured first)...")
    if cfg.recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE)}, got {cfg.recompute!r}")
    plan, _ = make_plan(model, shape, comm.Get_size(), machine, cfg.memory_per_rank,
                        comm=comm, baseline=baseline, profile=memory,
                        recompute=RECOMPUTE[cfg.recompute], kernels=cfg.kernels,
                        shard_state=cfg.shard_state, state_slots=state_slots(cfg),
                        memory_format=cfg.memory_format)
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
        extra), a thread count below one, a prefetch depth other than 0, 1 or 2, an
        unknown precision (or bf16 without the ml_dtypes package), or batch-norm
        statistics other than 'global' and 'group'.
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
    if cfg.bn_stats not in BATCH_NORM_STATS:
        raise SetupError(f"--bn-stats must be global or group, got {cfg.bn_stats!r}")


def _setup(cfg: TrainConfig, comm: MPI.Comm, memory: MemoryProfile, xp: Any) -> tuple:
    """Everything before the first step: model, plan, data, optimizer, resumed state.

    The model is built and planned on the host, then moved to ``xp`` (with
    its optimizer state, created there); batches follow it one at a time.
    """
    rank = comm.Get_rank()
    _check_config(cfg)
    lr = cfg.lr if cfg.lr is not None else model_spec(cfg.model).lr
    problem = recipe_problem(cfg, lr) or metrics_problem(cfg.metrics, comm)
    if problem:
        raise SetupError(problem)
    if cfg.resume and cfg.checkpoint:  # the saved optimizer and schedule, before any work
        problem = resume_problem(cfg, checkpoint_manifest(cfg.checkpoint, comm=comm), lr)
        if problem:
            raise SetupError(f"--resume {cfg.checkpoint}: {problem}")
    threads, local, cores = set_threads(cfg, comm)
    with memory.phase("data"):
        model, shape, spec, data = _model_and_data(cfg)
    # what a rank holds besides the parameters and their gradients (the interpreter,
    # NumPy, MPI, the data set, the code a step runs and the buffers of the libraries
    # under it, a calibration's included): the process baseline of the predicted peak
    warm_up([(n.layer, n.in_shape) for n in leaf_nodes(trace(model, shape))],
            backends=kernel_choice(cfg.kernels) or (None,), dtype=activation_dtype(model))
    machine = machine_profile(cfg, comm, memory)
    params = sum(nbytes(p.data) for p in model.parameters())  # and as much of gradients
    baseline = process_baseline(comm, 2 * params, cfg.prefetch, shape,
                                (cfg.batch, *data.target_shape))
    plan = _plan(cfg, model, shape, comm, memory, baseline, machine)
    apply_plan(model, plan, shape, comm)
    stage = _applied_stage(cfg, plan)
    if stage != "none" and not _replicated(model, comm.Get_size()):
        say(comm, f"note: --shard-state {stage} does nothing here: no parameter of "
                   "this plan is replicated over several ranks, so there is no state to "
                   "shard (training goes on unsharded)")
    if not is_numpy(xp):
        model.to(xp)
    nodes = leaf_nodes(trace(model, shape))
    recompute_segments([n.layer for n in nodes], [e.recompute for e in plan.entries])
    plan.notes.append(threads_note(cfg, threads, local, cores))
    if rank == 0:
        print(f"{cfg.model}, batch {shape}, {plural(comm.Get_size(), 'rank')}")
        print(plan.table(), flush=True)
    loss_fn = spec.loss()
    first: Layout = nodes[0].layer.layout
    target_layout = None
    if data.has_spatial_target:
        target_layout = Layout(first.grid, first.axes)
    loader = Loader(data, cfg.batch, first, shuffle=True, seed=cfg.seed,
                    target_layout=target_layout, xp=None if is_numpy(xp) else xp,
                    dtype=activation_dtype(model))
    keep_data(cfg, loader, plan, comm)
    lr = cfg.lr if cfg.lr is not None else spec.lr
    opt = make_optimizer(replace(cfg, shard_state=stage), model.parameters(), lr)
    opt.kernel_backend = optimizer_backend(kernel_choice(cfg.kernels))  # as the plan timed
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
        check_resume_step(cfg, step)
        loader.load_state_dict(state["extra"]["loader"])
        history = [dict(h) for h in state["extra"].get("history", [])]
        if scaler.is_enabled() and state["extra"].get("grad_scaler"):
            scaler.load_state_dict(state["extra"]["grad_scaler"])
        say(comm, f"resumed from step {step} ({cfg.checkpoint})")
    make_kept(cfg, loader, step, comm)
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
        say(comm, f"warning: the step needs about {need / 2**20:.0f} MiB more on this node, "
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
    set_batch_norm_stats(model, cfg.bn_stats)  # before planning: it prices their sums
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
    map_large_allocations(mapping_threshold(cfg.block_cache, cfg.memory_per_rank))
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
        say_peak_memory(comm, memory)
        raise
    except BaseException:
        # every exit says how much memory this rank held, whichever rank failed
        print(f"rank {comm.Get_rank()}: peak resident memory {peak_memory(memory) / 2**20:.0f} "
              f"MiB ({phase_line(memory)})", flush=True)
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
    clocks = LayerClocks(nodes, passes=2 * cfg.accumulate)  # each micro-batch's two passes
    if cfg.profile_memory:
        memory.watch([(f"{n.name} {type(n.layer).__name__}", n.layer) for n in nodes])
    bar = progress_bar(cfg, comm, step, cfg.model)
    # the next batches are read or synthesised by a thread while the step runs
    it = Prefetcher(loader, cfg.prefetch) if cfg.prefetch else None
    times: list[float] = []
    data_times: list[float] = []
    warm_misses = [0]

    def first_step() -> None:
        cache = active_block_cache()
        warm_misses[0] = cache.stats.misses if cache is not None else 0
    cache_limit = _cache_limit(plan, model, comm, plan.shard_state) \
        if cfg.block_cache else None
    heap_top = 0 if cfg.memory_per_rank is not None else HEAP_TOP_KEPT
    if cfg.block_cache:  # the largest pass's scratch from the heap, kept warm (see there)
        scratch = max((e.transient for e in plan.entries), default=0)
        if plan.memory_budget:  # never more than the budget leaves above the plan's peak
            scratch = min(scratch, max(plan.memory_budget - plan.peak_memory, 0))
        heap_top = mapping_threshold(True, cfg.memory_per_rank, scratch)
        map_large_allocations(heap_top)
        keep_heap_top(heap_top)
    try:
        with (block_cache(cache_limit) if cfg.block_cache else contextlib.nullcontext()) \
                as cache:
            one_step = _layer_step(cfg, memory, xp, model, loss_fn, opt, sched, scaler,
                                   plan.memory_format)

            def clocked_step(batches: Batches) -> Any:
                if len(times) == 1 == clocks.steps:  # the first step warmed caches and
                    clocks.discard()  # allocator: not in the layer times where others follow
                clocks.start_step()  # run_steps starts each step at a barrier
                return one_step(batches)
            step = run_steps(cfg, comm, Batches(loader, it, heap_top), clocked_step,
                             step, history, times, data_times, bar, model=model,
                             optimizer=opt, scheduler=sched,
                             checkpoint_extra=lambda: {"grad_scaler": scaler.state_dict()},
                             after_first_step=first_step)
            cached = None if cache is None else {
                **asdict(cache.stats),
                "misses_after_first_step": cache.stats.misses - warm_misses[0]}
    finally:
        if it is not None:
            it.close()
    if bar is not None:
        bar.close()
    # each layer's time on the step's critical path (a wait for other ranks counted in
    # the layer that caused it), over the last steps after the first (LayerClocks)
    measured = clocks.spans(comm)
    clocks.remove()
    peaks = memory_summary(comm, memory)
    summary = {
        "model": cfg.model, "batch_shape": list(shape), "ranks": comm.Get_size(),
        "steps": step, "shard_state": _applied_stage(cfg, plan),
        "precision": cfg.precision,
        "skipped_steps": scaler.skipped_steps if scaler.is_enabled() else 0,
        "loss_scale": scaler.get_scale() if scaler.is_enabled() else None,
        **timing_summary(cfg, history, times, data_times),
        # the plan is for one micro-batch, its gradient reduction included: an upper bound
        "predicted_time_per_iteration_s": cfg.accumulate * plan.time,
        "peak_memory_per_rank_bytes": peaks["peak_memory_per_rank_bytes"],
        "predicted_peak_memory_bytes": plan.peak_memory,
        # the cache holds free buffers besides the live ones, up to its limit: the part of
        # the limit above the blocks the plan counts comes on top of the plan's peak
        "predicted_cache_slack_bytes": _cache_slack(plan, model, comm, plan.shard_state,
                                                    cache_limit),
        # a synthetic data set's blocks, made and kept before the first step (known then:
        # those of the samples the run's batches give each rank)
        "predicted_kept_data_bytes": comm.allreduce(
            loader.dataset.kept_bytes, op=MPI.MAX),
        "predicted_baseline_memory_bytes": plan.baseline_memory,
        "training_peak_memory_per_rank_bytes": peaks["training_peak_memory_per_rank_bytes"],
        "planning_peak_memory_per_rank_bytes": peaks["planning_peak_memory_per_rank_bytes"],
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
        print_summary(summary)
        write_metrics(cfg.metrics, history, summary)
    return summary


def _layer_step(cfg: TrainConfig, memory: MemoryProfile, xp: Any, model: Layer,
                loss_fn: Any, opt: Any, sched: LRScheduler | None,
                scaler: GradScaler, memory_format: str = "contiguous") -> Any:
    """One training step of a built-in model, for :func:`~.loop.run_steps`: the layers'
    backward over ``cfg.accumulate`` micro-batches, then the disttensor optimizer. Each
    input batch is put in the plan's ``memory_format`` first (a copy where it differs).

    With an enabled ``scaler`` (float16), the loss gradient is scaled and a step whose
    gradients are not finite is skipped (``skipped`` in its history entry).
    """
    def step(batches: Batches) -> StepResult:
        losses = []
        opt.zero_grad()
        for micro in range(cfg.accumulate):
            x, y = batches.next()
            with memory.phase("forward"):
                # the batch's own block is let go once converted: one input block at the peak
                x = to_memory_format(x, memory_format)
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
        return StepResult(loss, lr, {} if not scaler.is_enabled() else
                          {"skipped": not took, "loss_scale": scaler.get_scale()})
    return step


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
