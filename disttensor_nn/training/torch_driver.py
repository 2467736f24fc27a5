"""A user's own PyTorch model on the command line: ``--model-file PATH.py:FUNCTION``.

``disttensor-train --model-file model.py:build`` (and ``disttensor-plan``)
import ``model.py``, call ``build()`` and take the ``torch.nn.Module`` it
returns, unchanged, through :func:`disttensor_nn.torch.parallelize` with the
planner's layout (``--ranks-layout auto``) or a plan file. Training runs
the step loop every driver shares (:func:`~disttensor_nn.training.loop.run_steps`)
with a step of its own (torch autograd and ``torch.optim``), and reuses the
driver's other parts: the data sets and the :class:`~disttensor_nn.training.Loader`
(synthetic :class:`~disttensor_nn.training.data.NoiseDataset` data, or the
HDF5, Zarr and ``.npy`` readers, every rank reading only its block),
prefetching, the progress bar, the metrics files, the summary (predicted and
measured time and peak memory) and checkpoints with ``--resume``. The
optimizer is ``torch.optim``'s SGD, Adam or AdamW, the schedules
``torch.optim.lr_scheduler``'s, the loss the mean squared error of the
model's output against the targets (of the output's shape).
``disttensor-predict --model-file`` runs such a run's checkpoint on every
sample of a data set, as :func:`~disttensor_nn.training.predict` runs the
built-in models.

This module imports PyTorch; the command lines import it only for
``--model-file``, so the rest of the package needs none.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

try:
    import torch  # the one place that says what is missing
except ImportError as err:
    raise ImportError('disttensor_nn.training.torch_driver needs PyTorch: '
                      'pip install "disttensor[torch]"') from err

import numpy as np
from mpi4py import MPI
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from tqdm import tqdm

from disttensor import DistArray, Distribution, to_npy, to_zarr

from ..layout import Layout
from ..memory import (
    HEAP_TOP_KEPT,
    MemoryProfile,
    keep_heap_top,
    map_large_allocations,
    release_free_memory,
)
from ..plan import Plan
from ..reduction import no_sync, split_axes_comm
from ..torch import ParallelModule, all_reduce, parallelize
from .checkpoint import CheckpointError, checkpoint_manifest, load_checkpoint
from .data import Dataset, Loader, NoiseDataset, Prefetcher, open_dataset
from .driver import SetupError, TrainConfig
from .inference import PredictConfig, create_output, predict_machine, predict_summary
from .loop import (
    Batches,
    StepResult,
    check_resume_step,
    keep_data,
    machine_profile,
    make_kept,
    memory_summary,
    metrics_problem,
    plural,
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
from .recipe import recipe_problem, resume_problem

__all__ = ["DEFAULT_LR", "ModelFileConfig", "load_model_file", "mse_loss", "plan_model_file",
           "predict_model_file", "train_model_file"]

DEFAULT_LR = 0.01
"""The learning rate of a ``--model-file`` run without ``--lr``."""


@dataclass
class ModelFileConfig(TrainConfig):
    """A :class:`~disttensor_nn.training.TrainConfig` for a model in a Python file.

    ``model`` is only the run's name in the output (the CLI puts the
    ``--model-file`` argument there); ``size`` and ``in_channels`` give the
    input ``(batch, in_channels, *size)`` (both taken from ``data`` where
    that is given); ``lr`` None means :data:`DEFAULT_LR`.
    """

    model_file: str = ""  # PATH.py:FUNCTION, FUNCTION() returns a torch.nn.Module
    in_channels: int | None = None


# ------------------------------------------------------------------ the model file
def _parse(spec: str) -> tuple[str, str]:
    path, sep, name = str(spec).rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise ValueError(f"--model-file takes PATH.py:FUNCTION (a file and the function in it "
                         f"that returns the model), got {spec!r}")
    return path, name


def load_model_file(spec: str) -> nn.Module:
    """The model ``FUNCTION()`` returns, for ``spec`` = ``"PATH.py:FUNCTION"`` (on this rank).

    The file is imported as a module of its own (not put in
    ``sys.modules``), then the function is called without arguments.

    Raises
    ------
    ValueError
        For a malformed ``spec``, a missing file, a file that raises on
        import, a missing or uncallable function, a function that raises, or
        a result that is not a ``torch.nn.Module``; the message names which.
    """
    path, name = _parse(spec)
    if not os.path.isfile(path):
        raise ValueError(f"--model-file {spec}: {path} is not a file")
    where = importlib.util.spec_from_file_location(
        f"disttensor_model_file_{abs(hash(os.path.abspath(path)))}", path)
    if where is None or where.loader is None:
        raise ValueError(f"--model-file {spec}: {path} cannot be imported as a Python module "
                         "(name a .py file)")
    module = importlib.util.module_from_spec(where)
    try:
        where.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the user's file raises
        raise ValueError(f"--model-file {spec}: importing {path} raised "
                         f"{type(exc).__name__}: {exc}") from None
    build = getattr(module, name, None)
    if build is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and
                       getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"--model-file {spec}: {path} defines no {name!r} (its functions and "
                         f"classes: {', '.join(found) or 'none'})")
    if not callable(build):
        raise ValueError(f"--model-file {spec}: {name} in {path} is not a function (its "
                         f"type is {type(build).__name__})")
    try:
        model = build()
    except Exception as exc:  # noqa: BLE001 - whatever the user's function raises
        raise ValueError(f"--model-file {spec}: {name}() raised "
                         f"{type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model-file {spec}: {name}() returned a {type(model).__name__}, "
                         "not a torch.nn.Module")
    return model


def _agreed(comm: MPI.Comm, work: Any) -> Any:
    """``work()`` on every rank; an error it raises on any rank (a ValueError, or a data set
    that cannot be opened) is a SetupError on all, with the lowest such rank's message."""
    result, error = None, None
    try:
        result = work()
    except (ValueError, OSError, ImportError) as exc:
        error = str(exc)
    errors = [e for e in comm.allgather(error) if e is not None]
    if errors:
        raise SetupError(errors[0])
    return result


def _shapes(cfg: ModelFileConfig) -> tuple[tuple[int, ...], Dataset | None]:
    """The input batch shape and, with ``cfg.data``, the opened data set."""
    data = None
    size, channels = cfg.size, cfg.in_channels
    if cfg.data is not None:
        data = open_dataset(cfg.data, cfg.data_input, cfg.data_target)
        sample = tuple(data.sample_shape)
        if (channels is not None and sample[0] != channels) or (
                size is not None and sample[1:] != tuple(size)):
            asked = [f"--in-channels {channels}"] if channels is not None else []
            asked += [f"--size {'x'.join(map(str, size))}"] if size is not None else []
            raise ValueError(f"the samples in {cfg.data} are {sample}, this run asks for "
                             f"{' and '.join(asked)}")
        channels, size = sample[0], sample[1:]
    if channels is None or size is None:
        raise ValueError("--model-file needs the input's shape: --in-channels C and --size "
                         "HxW (or DxHxW), or --data")
    return (cfg.batch, int(channels), *size), data


def _check(cfg: ModelFileConfig) -> None:
    """Refuse the options a model file cannot take (the same on every rank)."""
    if cfg.device != "cpu":
        raise ValueError("--device gpu: a --model-file model runs on CPU tensors only, so far")
    if cfg.shard_state != "none":
        raise ValueError(f"--shard-state {cfg.shard_state} is for the built-in models; a "
                         "--model-file model keeps its parameters whole on every rank")
    if cfg.recompute == "always":
        raise ValueError("--recompute always is for the built-in models; a --model-file "
                         "model keeps its activations")
    if cfg.precision not in _AUTOCAST:
        raise ValueError(f"unknown precision {cfg.precision!r}: use one of "
                         f"{', '.join(_AUTOCAST)}")
    if cfg.profile_memory:
        raise ValueError("--profile-memory is for the built-in models")
    if cfg.kernels not in ("auto", "torch"):
        raise ValueError(f"--kernels {cfg.kernels}: a --model-file model runs PyTorch's own "
                         "kernels")
    if cfg.prefetch not in (None, 0, 1, 2):
        raise ValueError(f"prefetch must be 0, 1 or 2 batches or None, got {cfg.prefetch!r}")
    if isinstance(cfg.accumulate, bool) or not isinstance(cfg.accumulate, int) or \
            cfg.accumulate < 1:
        raise ValueError(f"accumulate must be a positive integer, got {cfg.accumulate!r}")
    problem = recipe_problem(cfg, _lr(cfg))
    if problem:
        raise ValueError(problem)


#: ``--precision``: the dtype the forward runs in under ``torch.autocast`` (None: the model's
#: own). Parameters, their gradients and the optimizer's state stay float32; autocast runs
#: convolutions and matrix products in 16 bits, whose blocks (halos, redistributions) then
#: move 2 bytes an element, and normalizations take their statistics in float32.
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _lr(cfg: TrainConfig) -> float:
    return cfg.lr if cfg.lr is not None else DEFAULT_LR


def _output_shape(model: nn.Module, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of ``model``'s output on an input of ``shape``, from a forward on fake
    tensors (no memory, no arithmetic; in eval mode, so no statistic moves); the input's
    shape where the model refuses it (``parallelize`` then says why)."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        param = next(model.parameters(), None)
        dtype = torch.get_default_dtype() if param is None else param.dtype
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            out = model(torch.empty(shape, dtype=dtype))
        return tuple(out.shape) if isinstance(out, torch.Tensor) else shape
    except Exception:  # noqa: BLE001 - whatever the model refuses
        return shape
    finally:
        for m, training in modes.items():
            m.training = training


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


_TORCH_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
"""``--memory-format`` as ``parallelize`` takes it (``"auto"`` as it is)."""


def _parallel(cfg: ModelFileConfig, model: nn.Module, shape: tuple[int, ...],
              comm: MPI.Comm, machine: str, baseline: float = 0.0,
              channel_splits: bool = False) -> ParallelModule:
    """The model on this job's ranks, planned (or by the plan file ``cfg.layout``) with
    ``baseline`` resident bytes besides the model's data (:func:`.loop.process_baseline`),
    channel-parallel convolutions among the planner's choices with ``channel_splits``."""
    layout = "auto" if cfg.layout == "auto" else cfg.layout
    try:
        pm = parallelize(model, shape, layout, memory_per_rank=cfg.memory_per_rank,
                         machine=machine, comm=comm, baseline=baseline,
                         batch_norm_stats=cfg.bn_stats,
                         memory_format=_TORCH_FORMATS.get(cfg.memory_format, "auto"),
                         channel_splits=channel_splits)
    except (TypeError, NotImplementedError, FileNotFoundError) as exc:
        raise ValueError(str(exc)) from exc
    if not isinstance(pm.output_dist, Distribution):
        raise ValueError(f"{cfg.model}: the model returns several outputs; --model-file "
                         "trains a model of one output")
    return pm


# ------------------------------------------------------------------ data
def _heap_top(cfg: ModelFileConfig) -> int:
    """Bytes PyTorch's arrays may take from the C heap, and the heap keeps at its top across
    the per-step trim: none under a memory budget (freed arrays leave the process)."""
    return 0 if cfg.memory_per_rank is not None else HEAP_TOP_KEPT


class _ModelLoader(Loader):
    """The batches of a :class:`Loader`, inputs in the parallel model's input distribution,
    targets in its output's (the loss compares the blocks without moving them)."""

    def __init__(self, dataset: Dataset, batch: int, dist_x: Distribution,
                 dist_y: Distribution, seed: int):
        super().__init__(dataset, batch, Layout.of(dist_x), shuffle=True, seed=seed,
                         target_layout=Layout.of(dist_y))
        self.dist_x, self.dist_y = dist_x, dist_y

    @property
    def keeps_exactly(self) -> bool:
        """Whether the layouts give the blocks :meth:`load` asks for (kept blocks are found
        by their place; a distribution with explicit splits, such as a strided layer's
        output, is not its layout's); the same on every rank."""
        return all(Layout.of(d).distribution(d.global_shape) == d
                   for d in (self.dist_x, self.dist_y))

    def load(self, indices: np.ndarray) -> tuple[DistArray, DistArray | np.ndarray]:
        return self.dataset.batch(indices, self.dist_x, self.dist_y)


def _dataset(cfg: ModelFileConfig, data: Dataset | None, shape: tuple[int, ...],
             out_shape: tuple[int, ...]) -> Dataset:
    if data is None:
        return NoiseDataset(cfg.samples, shape[1:], out_shape[1:], seed=cfg.seed)
    if not data.has_spatial_target:
        raise ValueError(f"{cfg.data} holds labels; a --model-file model is trained with the "
                         "mean squared error against targets of its output's shape "
                         f"{out_shape[1:]}")
    if tuple(data.target_shape) != tuple(out_shape[1:]):
        raise ValueError(f"the targets in {cfg.data} are {tuple(data.target_shape)}, the "
                         f"model's output per sample is {tuple(out_shape[1:])}")
    return data


# ------------------------------------------------------------------ checkpoints
class _Whole:
    """A torch parameter as the checkpoint sees one: its shape, dtype and whole value."""

    def __init__(self, p: torch.Tensor):
        self.p = p
        self.shape = tuple(p.shape)
        self.dtype = p.detach().numpy().dtype

    def full(self) -> np.ndarray:
        return self.p.detach().numpy().copy()


class _ModelState:
    """A torch module as :func:`save_checkpoint` and :func:`load_checkpoint` see a model:
    parameters and buffers by their ``state_dict`` names, loaded in place."""

    def __init__(self, module: nn.Module):
        self.module = module

    def named_parameters(self) -> list[tuple[str, _Whole]]:
        return [(n, _Whole(p)) for n, p in self.module.named_parameters()]

    def named_modules(self) -> Any:
        return self.module.named_modules()

    def load_state_dict(self, state: dict[str, Any], strict: bool = False) -> None:
        own = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        with torch.no_grad():
            for name, value in state.items():
                own[name].copy_(torch.from_numpy(np.array(value)))


def _to_numpy(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().numpy().copy()
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_numpy(v) for v in tree)
    return tree


def _to_torch(tree: Any) -> Any:
    if isinstance(tree, (np.ndarray, np.generic)):
        return torch.from_numpy(np.array(tree))
    if isinstance(tree, dict):
        return {k: _to_torch(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_torch(v) for v in tree)
    return tree


class _OptimizerState:
    """A torch optimizer's state as NumPy trees, for the checkpoint (recorded under the
    optimizer's class name, as the built-in optimizers are)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> Any:
        return _to_numpy(self.optimizer.state_dict())

    def load_state_dict(self, state: Any) -> None:
        self.optimizer.load_state_dict(_to_torch(state))


_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
_STATES = {name: type(cls.__name__, (_OptimizerState,), {"__doc__": _OptimizerState.__doc__})
           for name, cls in _OPTIMIZERS.items()}


def _optimizer(cfg: TrainConfig, params: Any) -> torch.optim.Optimizer:
    """``torch.optim``'s optimizer ``cfg.optimizer`` (SGD with ``cfg.momentum``)."""
    kw: dict[str, Any] = {} if cfg.weight_decay is None else {"weight_decay": cfg.weight_decay}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=_lr(cfg), momentum=cfg.momentum, **kw)
    return _OPTIMIZERS[cfg.optimizer](params, lr=_lr(cfg), **kw)


def _scheduler(cfg: TrainConfig, opt: torch.optim.Optimizer) -> Any:
    """``torch.optim.lr_scheduler``'s schedule for ``cfg`` (as :func:`make_scheduler`
    builds the built-in ones), or None."""
    sched = torch.optim.lr_scheduler
    warmup, lr = cfg.warmup_steps, _lr(cfg)
    span = cfg.steps if cfg.schedule_steps is None else cfg.schedule_steps
    rest = span - warmup
    warm = sched.LinearLR(opt, start_factor=cfg.warmup_start_factor, end_factor=1.0,
                          total_iters=warmup) if warmup else None
    main = None
    if cfg.schedule == "step":
        main = sched.StepLR(opt, step_size=cfg.step_size or max(1, rest // 3),
                            gamma=cfg.gamma)
    elif cfg.schedule == "cosine":
        main = sched.CosineAnnealingLR(opt, T_max=rest, eta_min=cfg.min_lr)
    elif cfg.schedule == "linear":
        main = sched.LinearLR(opt, start_factor=1.0, end_factor=cfg.min_lr / lr,
                              total_iters=rest)
    if warm is not None and main is not None:
        return sched.SequentialLR(opt, [warm, main], milestones=[warmup])
    return warm if warm is not None else main


def _settings(state: Any) -> Any:
    """The settings in a torch scheduler's state (not its progress), lists for tuples."""
    if isinstance(state, dict):
        out = {k: _settings(v) for k, v in state.items() if k in _SETTINGS}
        if "_schedulers" in state:
            out["_schedulers"] = [_settings(s) for s in state["_schedulers"]]
        return out
    if isinstance(state, (list, tuple, np.ndarray)):
        return [_settings(v) for v in state]
    return state


_SETTINGS = ("base_lrs", "step_size", "gamma", "T_max", "eta_min", "start_factor",
             "end_factor", "total_iters", "_milestones")
"""Entries of a torch scheduler's state that are its settings (not its progress)."""


def _resume_problem(cfg: TrainConfig, manifest: dict[str, Any]) -> str | None:
    """Why the checkpoint of ``manifest`` cannot continue ``cfg``'s run, or None: another
    optimizer (as :func:`resume_problem` says), another schedule or other settings."""
    lr = _lr(cfg)
    problem = resume_problem(replace(cfg, schedule="none", warmup_steps=0),
                             {**manifest, "scheduler": None}, lr)
    if problem:
        return problem
    saved = manifest.get("scheduler") or {}
    mine = _scheduler(cfg, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr))
    have, want = saved.get("class"), None if mine is None else type(mine).__name__
    if have != want:
        def words(name: str | None) -> str:
            return "no schedule" if name is None else f"the schedule {name}"
        return (f"the checkpoint was saved with {words(have)}, this run's --schedule "
                f"{cfg.schedule} --warmup-steps {cfg.warmup_steps} makes {words(want)}: "
                "resume with the schedule it was saved with")
    if mine is not None and _settings(saved.get("state")) != _settings(mine.state_dict()):
        return (f"the checkpoint's schedule {want} was saved with other settings (from "
                "--schedule, --warmup-steps, --warmup-start-factor, --step-size, --gamma, "
                "--min-lr, --schedule-steps or --steps and --lr): resume with the settings "
                "it was saved with")
    return None


# ------------------------------------------------------------------ setup
def _setup(cfg: ModelFileConfig, comm: MPI.Comm, memory: MemoryProfile) -> tuple:
    """Everything before the first step; every refusal a ValueError on every rank alike."""
    _check(cfg)
    problem = metrics_problem(cfg.metrics, comm)
    if problem:
        raise SetupError(problem)
    if cfg.resume and cfg.checkpoint:  # the saved optimizer and schedule, before any work
        problem = _resume_problem(cfg, checkpoint_manifest(cfg.checkpoint, comm=comm))
        if problem:
            raise SetupError(f"--resume {cfg.checkpoint}: {problem}")
    torch.manual_seed(cfg.seed)  # the weights FUNCTION draws: the same on every rank
    model = _agreed(comm, lambda: load_model_file(cfg.model_file))
    shape, data = _agreed(comm, lambda: _shapes(cfg))
    threads, local, cores = set_threads(cfg, comm)
    machine = machine_profile(cfg, comm, memory)
    # the process besides the parameters (their gradients do not exist yet), and the batches
    # a prefetching thread holds: the data set's targets, or synthetic ones of the output's
    target = (cfg.batch, *data.target_shape) if data is not None else _output_shape(model, shape)
    baseline = process_baseline(comm, _param_bytes(model), cfg.prefetch, shape, target)
    say(comm, f"planning {cfg.model} for {plural(comm.Get_size(), 'rank')}...")
    with memory.phase("planning"):
        pm = _parallel(cfg, model, shape, comm, machine, baseline)
    out_shape = tuple(pm.output_dist.global_shape)
    dataset = _dataset(cfg, data, shape, out_shape)
    if len(dataset) < cfg.batch:
        raise ValueError(f"the data set has {len(dataset)} samples, fewer than --batch "
                         f"{cfg.batch}")
    plan: Plan = pm.plan
    plan.notes.append(threads_note(cfg, threads, local, cores, kernels="kernels: PyTorch's,"))
    if _AUTOCAST[cfg.precision] is not None:
        plan.notes.append(
            f"precision {cfg.precision}: the forward under torch.autocast (convolutions and "
            f"matrix products in {str(_AUTOCAST[cfg.precision])[6:]}, their blocks moving 2 "
            "bytes an element; weights, gradients and optimizer state float32"
            + ("; the loss scaled, steps with non-finite gradients skipped"
               if cfg.precision == "fp16" else "")
            + "); the plan's times and memory are float32's, an upper bound")
    if comm.Get_rank() == 0:
        print(f"{cfg.model}, batch {shape} -> output {out_shape}, "
              f"{plural(comm.Get_size(), 'rank')}")
        print(plan.table(), flush=True)
    loader = _ModelLoader(dataset, cfg.batch, pm.input_dist, pm.output_dist, cfg.seed)
    if loader.keeps_exactly:  # synthetic blocks made once, as the built-in models'
        keep_data(cfg, loader, plan, comm)
    opt = _optimizer(cfg, pm.parameters())
    sched = _scheduler(cfg, opt)
    scaler = torch.amp.GradScaler("cpu", enabled=cfg.precision == "fp16")
    step, history = 0, []
    if cfg.resume:
        if not cfg.checkpoint:
            raise ValueError("--resume needs --checkpoint DIR")
        state = load_checkpoint(cfg.checkpoint, _ModelState(pm),
                                _STATES[cfg.optimizer](opt), comm=comm, scheduler=sched)
        step = int(state["step"])
        check_resume_step(cfg, step)
        loader.load_state_dict(state["extra"]["loader"])
        if scaler.is_enabled() and state["extra"].get("grad_scaler"):
            scaler.load_state_dict(state["extra"]["grad_scaler"])
        history = [dict(h) for h in state["extra"].get("history", [])]
        say(comm, f"resumed from step {step} ({cfg.checkpoint})")
    make_kept(cfg, loader, step, comm)
    release_free_memory()
    return pm, shape, plan, loader, opt, sched, scaler, step, history


def _tensor(block: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(block)).to(dtype)


def mse_loss(output: DistArray, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error of a parallel model's output against this rank's block of the
    target (in the output's distribution): the same value on every rank, differentiable on
    every rank (its gradient reaches each rank's block whole).

    Parameters
    ----------
    output : DistArray
        The parallel model's output (its ``local`` carries the autograd graph).
    target : torch.Tensor
        This rank's block of the target, ``output.dist.local_shape()``.
    """
    wide = torch.promote_types(output.local.dtype, torch.float32)  # 16-bit outputs: in float32
    partial = ((output.local.to(wide) - target.to(wide)) ** 2).sum()
    return all_reduce(partial, split_axes_comm(output.dist)) / math.prod(output.dist.global_shape)


def _autocast(cfg: TrainConfig) -> Any:
    """The forward's context: ``torch.autocast`` in ``cfg.precision``'s 16 bits, or none."""
    dtype = _AUTOCAST[cfg.precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def _torch_step(cfg: ModelFileConfig, memory: MemoryProfile, pm: ParallelModule,
                opt: torch.optim.Optimizer, sched: Any, scaler: Any) -> Any:
    """One training step of a parallel torch model, for :func:`~.loop.run_steps`: torch
    autograd over ``cfg.accumulate`` micro-batches (:func:`mse_loss`), then ``opt``.

    The forward runs under ``torch.autocast`` for ``--precision bf16|fp16``. With an enabled
    ``scaler`` (``torch.amp.GradScaler``, fp16) the loss is scaled before its backward and a
    step whose gradients are not finite is skipped (``skipped`` in its history entry): the
    gradients are whole and alike on every rank when backward returns, so every rank skips
    the same steps.
    """
    dtype = next(pm.parameters()).dtype if any(True for _ in pm.parameters()) \
        else torch.get_default_dtype()

    def step(batches: Batches) -> StepResult:
        losses = []
        opt.zero_grad()
        for micro in range(cfg.accumulate):
            x, y = batches.next()
            with memory.phase("forward"), _autocast(cfg):
                loss = mse_loss(pm(_tensor(x.local, dtype)), _tensor(y.local, dtype))
            last = micro == cfg.accumulate - 1
            with memory.phase("backward"), (contextlib.nullcontext() if last else no_sync()):
                scaler.scale(loss if cfg.accumulate == 1 else loss / cfg.accumulate).backward()
            losses.append(float(loss.detach()))
        lr = opt.param_groups[0]["lr"]
        with memory.phase("optimizer"):
            scaler.unscale_(opt)  # fp16: the true gradients, and whether all are finite
            if cfg.clip_grad_norm is not None:  # the gradients are whole on every rank
                torch.nn.utils.clip_grad_norm_(pm.parameters(), cfg.clip_grad_norm)
            before = scaler.get_scale() if scaler.is_enabled() else None
            scaler.step(opt)
            scaler.update()
            # torch's scaler lowers its scale exactly when it skipped the step
            skipped = scaler.is_enabled() and scaler.get_scale() < before
            if sched is not None:
                sched.step()
        return StepResult(float(np.mean(losses)), lr, {} if not scaler.is_enabled() else
                          {"skipped": bool(skipped), "loss_scale": scaler.get_scale()})
    return step


def _train(cfg: ModelFileConfig, comm: MPI.Comm, memory: MemoryProfile) -> dict[str, Any]:
    try:
        pm, shape, plan, loader, opt, sched, scaler, step, history = _setup(cfg, comm, memory)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        if isinstance(exc, SetupError):
            raise
        raise SetupError(str(exc)) from exc
    bar = progress_bar(cfg, comm, step, os.path.basename(cfg.model))
    it = Prefetcher(loader, cfg.prefetch) if cfg.prefetch else None
    times: list[float] = []
    data_times: list[float] = []
    try:
        pm.train()
        step = run_steps(cfg, comm, Batches(loader, it, _heap_top(cfg)),
                         _torch_step(cfg, memory, pm, opt, sched, scaler),
                         step, history, times, data_times, bar, model=_ModelState(pm),
                         optimizer=_STATES[cfg.optimizer](opt), scheduler=sched,
                         checkpoint_extra=lambda: {"grad_scaler": scaler.state_dict()})
    finally:
        if it is not None:
            it.close()
    if bar is not None:
        bar.close()
    peaks = memory_summary(comm, memory)
    summary = {
        "model": cfg.model, "batch_shape": list(shape), "ranks": comm.Get_size(),
        "steps": step, "shard_state": "none", "precision": cfg.precision,
        "skipped_steps": sum(bool(h.get("skipped")) for h in history),
        "loss_scale": scaler.get_scale() if scaler.is_enabled() else None,
        "output_shape": list(pm.output_dist.global_shape),
        **timing_summary(cfg, history, times, data_times),
        "predicted_time_per_iteration_s": cfg.accumulate * plan.time,
        "peak_memory_per_rank_bytes": peaks["peak_memory_per_rank_bytes"],
        "predicted_peak_memory_bytes": plan.peak_memory,
        "predicted_baseline_memory_bytes": plan.baseline_memory,
        # a synthetic data set's blocks, made and kept before the first step
        "predicted_kept_data_bytes": comm.allreduce(loader.dataset.kept_bytes, op=MPI.MAX),
        # PyTorch's arrays below _heap_top come from the C heap, which keeps up to as much
        # free at its top between trims: resident above the live arrays (the docs' U-Net
        # at 512^2, batch 2: 99 MiB above the plan on 1 rank, 80 on 2; under a budget,
        # where the arrays are mapped on their own, 38 and 19 MiB below)
        "predicted_heap_slack_bytes": _heap_top(cfg),
        "training_peak_memory_per_rank_bytes": peaks["training_peak_memory_per_rank_bytes"],
        "planning_peak_memory_per_rank_bytes": peaks["planning_peak_memory_per_rank_bytes"],
        "memory_budget_bytes": plan.memory_budget,
        "block_cache": None, "memory_profile": None,
        "layers": [],  # the layers of a traced model are not timed one by one
        "config": asdict(cfg),
    }
    if comm.Get_rank() == 0:
        print_summary(summary)
        write_metrics(cfg.metrics, history, summary)
    return summary


def train_model_file(cfg: ModelFileConfig, comm: MPI.Comm | None = None) -> dict[str, Any]:
    """Train the model of ``cfg.model_file`` (collective); returns the summary.

    The model is built after ``torch.manual_seed(cfg.seed)`` (``parallelize``
    gives every rank rank 0's weights, so every rank starts alike), parallelized on
    a batch of ``(cfg.batch, in_channels, *size)`` with the planner's layout
    (``cfg.layout='auto'``) or a plan file, and trained with ``torch.optim``
    on the mean squared error (:func:`mse_loss`) against the targets:
    :class:`~disttensor_nn.training.data.NoiseDataset` noise of the model's
    output shape, or the spatial targets of ``cfg.data``. Checkpoints hold
    the model's ``state_dict`` names, so ``torch.nn.Module.load_state_dict``
    of the unwrapped model takes their parameters.

    Raises
    ------
    SetupError
        On every rank, before the first step: a model file that does not
        load (see :func:`load_model_file`), an option the model file cannot
        take (``device='gpu'``, sharded state, ``recompute='always'``,
        memory profiles, NumPy kernels), a model ``parallelize`` refuses, a
        data set whose shapes do not fit the model, a checkpoint that does not
        resume this run.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    # PyTorch allocates the activations and the kernels' scratch from the C heap: under a
    # budget every array from 1 MiB on is mapped on its own, so that freed ones leave the
    # process; otherwise up to HEAP_TOP_KEPT they are carved from the heap and reused warm
    # (the mesh-demo FCN in plain torch, batch 4, one rank: 81-86 ms of compute a step and
    # 48-57 thousand page faults with 4 MiB, 62 ms and 7-9 thousand with 64 MiB; the peak
    # 3% higher)
    map_large_allocations(_heap_top(cfg) or 2**20)
    keep_heap_top()  # scratch of a few MiB reused warm between the per-step trims
    memory = MemoryProfile()
    if cfg.prefetch is None:
        cfg = replace(cfg, prefetch=prefetch_depth(cfg, comm))
    try:
        return _train(cfg, comm, memory)
    except SetupError:
        say_peak_memory(comm, memory)
        raise
    finally:
        memory.close()


def plan_model_file(spec: str, shape: Sequence[int], *, machine: str,
                    memory_per_rank: float | None = None, seed: int = 0,
                    comm: MPI.Comm | None = None, bn_stats: str = "global",
                    channel_splits: bool = False) -> ParallelModule:
    """The model of ``spec`` (``PATH.py:FUNCTION``) planned for a batch of ``shape`` on
    ``comm``'s ranks (collective), its batch norms' statistics ``bn_stats``
    (:func:`~disttensor_nn.torch.parallelize`'s ``batch_norm_stats``), channel-parallel
    convolutions among its choices with ``channel_splits`` (``parallelize``'s); its
    ``plan`` is what ``disttensor-plan`` prints.

    Raises
    ------
    SetupError
        On every rank alike, for a model file that does not load or a model
        ``parallelize`` refuses (no plan fits the budget, for one).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    torch.manual_seed(seed)
    model = _agreed(comm, lambda: load_model_file(spec))
    cfg = ModelFileConfig(model=spec, model_file=spec, memory_per_rank=memory_per_rank,
                          bn_stats=bn_stats)
    try:
        return _parallel(cfg, model, tuple(shape), comm, machine,
                         process_baseline(comm, _param_bytes(model), 0, (), ()),
                         channel_splits=channel_splits)
    except ValueError as exc:
        raise SetupError(str(exc)) from exc


def predict_model_file(cfg: PredictConfig, model_file: str,
                       comm: MPI.Comm | None = None) -> dict[str, Any]:
    """Run the model of ``model_file`` with a checkpoint's weights on every sample of
    ``cfg.data`` (collective), as :func:`~disttensor_nn.training.predict` does.

    The model is built (as for training), given the parameters and buffers
    of ``cfg.checkpoint`` (a ``--model-file`` run's, or any checkpoint with
    the model's ``state_dict`` names), put in eval mode (batch norm by its
    running statistics, no dropout) and parallelized for one sample by the
    planner (``cfg.machine``, ``cfg.memory_per_rank``; the plan is made for
    a training step's memory). Every rank reads its block of each input and
    writes its block of each output (float32) to ``cfg.out``.

    Returns
    -------
    dict
        The keys of :func:`~disttensor_nn.training.predict`'s result;
        ``predicted_time_per_sample_s`` is the plan's forward compute.

    Raises
    ------
    ValueError, FileNotFoundError, OSError, CheckpointError
        On every rank alike, before any sample runs: a model file that does
        not load (:class:`SetupError`), ``cfg.device='gpu'``, NumPy kernels,
        a model ``parallelize`` refuses for the samples' shape, a checkpoint
        of another model, an output that cannot be created.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if cfg.device != "cpu":
        raise SetupError("--device gpu: a --model-file model runs on CPU tensors only, so far")
    if cfg.kernels not in ("auto", "torch"):
        raise SetupError(f"--kernels {cfg.kernels}: a --model-file model runs PyTorch's own "
                         "kernels")
    if cfg.memory_per_rank is not None:
        map_large_allocations()
    memory = MemoryProfile()
    try:
        return _predict(cfg, model_file, comm, memory)
    finally:
        memory.close()


def _predict(cfg: PredictConfig, model_file: str, comm: MPI.Comm,
             memory: MemoryProfile) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    model = _agreed(comm, lambda: load_model_file(model_file))
    data = _agreed(comm, lambda: open_dataset(cfg.data, cfg.data_input, None))
    shape = (1, *data.sample_shape)
    load_checkpoint(cfg.checkpoint, _ModelState(model), None, comm=comm)
    model.eval()
    machine = predict_machine(cfg, comm)
    pm = _parallel(ModelFileConfig(model=model_file, model_file=model_file,
                                   memory_per_rank=cfg.memory_per_rank),
                   model, shape, comm, machine,
                   process_baseline(comm, _param_bytes(model), 0, (), ()))
    pm.eval()
    n = len(data)
    stack = (n, *pm.output_dist.global_shape[1:])
    create_output(cfg, stack, np.dtype(np.float32), comm)
    dtype = next(pm.parameters()).dtype if any(True for _ in pm.parameters()) \
        else torch.get_default_dtype()
    write = to_npy if cfg.out.lower().endswith(".npy") else to_zarr
    plan: Plan = pm.plan
    release_free_memory()
    times, io_times = [], []
    bar = None
    if comm.Get_rank() == 0 and cfg.progress:
        bar = tqdm(total=n, desc=f"{os.path.basename(model_file)} on "
                   f"{plural(comm.Get_size(), 'rank')}", unit="sample")
    with memory.phase("inference"), torch.no_grad():
        for i in range(n):
            t0 = time.perf_counter()
            x = data.inputs([i], pm.input_dist)
            t1 = time.perf_counter()
            y = pm(_tensor(x.local, dtype))
            del x
            t2 = time.perf_counter()
            out = DistArray(np.ascontiguousarray(y.local.numpy(), dtype=np.float32), y.dist)
            write(out, cfg.out, region=(slice(i, i + 1),))
            del y, out
            t3 = time.perf_counter()
            times.append(t3 - t0)
            io_times.append(t1 - t0 + t3 - t2)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return predict_summary(cfg, stack, plan, memory, comm, times, io_times,
                           sum(e.fwd for e in plan.entries))
