"""The parts of a training run every driver shares.

The built-in driver (:func:`~disttensor_nn.training.train`) and the
``--model-file`` driver (:func:`~disttensor_nn.training.torch_driver.train_model_file`)
differ in how a step computes its gradients and updates the parameters;
everything around that is here, once: kernel threads and prefetching depth,
the machine profile to plan on (calibrated when needed), the progress bar, the
batches a step takes (timed, from a prefetching thread or the loader), the
step loop (clocks agreed over the ranks, history, progress, checkpoint
cadence, see :func:`run_steps`), the timing and memory parts of the summary,
its printing and the metrics files.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI
from tqdm import tqdm

from disttensor import node_share

from ..kernels import limit_threads
from ..memory import (
    HEAP_TOP_KEPT,
    MALLOPT_MAX,
    MemoryProfile,
    free_heap_bytes,
    release_free_memory,
    resident_bytes,
)
from ..plan import Plan
from ..plan.calibrate import calibrate, calibrate_compute, calibration_path, stale_calibration
from ..plan.machine import MachineProfile, this_machine_path
from .checkpoint import save_checkpoint
from .data import Loader, Prefetcher

__all__ = ["HEAVY_LOAD", "plural", "say", "metrics_problem", "prefetch_depth", "set_threads",
           "threads_note", "machine_profile", "progress_bar", "next_batch", "Batches", "StepResult",
           "run_steps", "check_resume_step", "peak_memory", "phase_line", "say_peak_memory",
           "timing_summary", "memory_summary", "prediction_warning", "print_summary",
           "write_metrics", "mapping_threshold", "keep_data", "make_kept", "KEEP_SHARE",
           "predicted_training_peak", "process_baseline"]

HEAVY_LOAD = 0.5
"""Load average per core above which a calibration is flagged as measured under load."""


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1 (``"2 ranks"``, ``"1 step"``)."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def say(comm: MPI.Comm, text: str) -> None:
    """Print ``text`` on rank 0 (progress messages of the long phases)."""
    if comm.Get_rank() == 0:
        print(text, flush=True)


# ------------------------------------------------------------------ setup
def mapping_threshold(block_cache: bool, memory_per_rank: float | None,
                      scratch: float = 0) -> int:
    """Bytes from which the C allocator maps an allocation on its own during training.

    Mapped allocations leave the process when freed, so the resident peak
    follows the live arrays (what the plan predicts), at the price of page
    faults on each new one. With the block cache, the step's blocks come
    from the cache's own mappings; what the heap serves is the kernels'
    scratch (oneDNN's reordered inputs and weights, workspaces), which would
    otherwise be faulted in at every call. Up to ``scratch`` (the plan's
    largest pass: the driver passes the largest of its entries' transient
    bytes) and at least :data:`~disttensor_nn.memory.HEAP_TOP_KEPT`, it is
    carved from the heap, whose top the driver keeps as large between steps,
    so it is reused warm (mesh-demo, one rank, the torch kernels: 37
    thousand faults and 80 ms a step with 4 MiB, 5 thousand and 53 ms with
    64 MiB; mesh at 2048 x 2048 on 2 ranks: the convolutions' gigabyte
    reorders faulted in every step before). Without the cache every array
    from 1 MiB on is mapped under a memory budget, from 4 MiB on otherwise
    (fewer arrays, so fewer faults).
    """
    if block_cache:
        return int(min(max(HEAP_TOP_KEPT, math.ceil(scratch)), MALLOPT_MAX))
    return 2**20 if memory_per_rank is not None else 2**22


KEEP_SHARE = 0.25
"""Share of the memory a plan leaves free that a synthetic data set's kept blocks may take."""


def keep_data(cfg: Any, loader: Loader, plan: Plan, comm: MPI.Comm) -> int:
    """Let a generated data set keep its blocks (:meth:`Dataset.keep`) where every rank's
    blocks of every sample fit :data:`KEEP_SHARE` of the memory the plan leaves free; the
    same decision on every rank. Returns the most bytes a rank keeps (0: none)."""
    data = loader.dataset
    need = comm.allreduce(loader.keep_bytes(), op=MPI.MAX)
    room = (plan.memory_budget or 0) - plan.peak_memory
    if not (cfg.keep_data and data.generated and 0 < need <= KEEP_SHARE * room):
        return 0
    data.keep(loader.keep_bytes())
    return need


def make_kept(cfg: Any, loader: Loader, step: int, comm: MPI.Comm) -> None:
    """Make, before the first step, the kept blocks of the samples the run's remaining steps
    take on this rank (:meth:`Loader.make_kept`), and say how long it took; collective."""
    t0 = time.perf_counter()
    made = loader.make_kept(loader.upcoming((cfg.steps - step) * cfg.accumulate))
    took = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    made = comm.allreduce(made, op=MPI.MAX)
    if made:
        say(comm, f"synthetic data: the blocks of the {plural(made, 'sample')} a rank takes "
                  f"in this run made ahead and kept ({took:.2f} s; --no-keep-data makes them "
                  "in each step instead)")


def process_baseline(comm: MPI.Comm, held: float, prefetch: int, shape: Sequence[int],
                     target_shape: Sequence[int]) -> float:
    """The process baseline of a plan's predicted peak (collective, the largest rank's).

    What a rank holds now besides ``held`` bytes that the planner counts
    itself (the parameters, and their gradients where they exist): the
    interpreter, the array libraries, MPI, the data set, and what the
    kernels run so far left resident. Plus the batches a prefetching thread
    holds ahead: ``prefetch`` times a rank's share of a batch's input
    ``shape`` and target ``target_shape``, in float32 (their split is the
    first layer's, known once planned: a share of the ranks). Free memory is
    given back first, so that it does not count.
    """
    release_free_memory()
    here = max(resident_bytes() - held, 0)
    ahead = (prefetch or 0) * (math.prod(shape) + math.prod(target_shape)) \
        * np.dtype(np.float32).itemsize / comm.Get_size()
    return comm.allreduce(here, op=MPI.MAX) + ahead


def prefetch_depth(cfg: Any, comm: MPI.Comm) -> int:
    """The batches a thread prepares ahead: ``cfg.prefetch``, or by default 1 where every
    rank of the node has a core for the thread besides its kernel threads, else 0.

    Collective (the node's ranks are counted). Where the cores are all busy with
    kernels, the thread's synthesis and reading take the interpreter's lock from a
    step's many short passes and the cores from its kernels: on 2 cores a mesh-demo
    iteration measured 190.6 ms with the thread and 87.7 ms without it (2 ranks),
    141.7 against 231.2 ms on 4 ranks, 206 against 397 ms on 1 rank of 2 threads.

    Parameters
    ----------
    cfg : TrainConfig
        Its ``prefetch`` and ``threads``.
    comm : MPI.Comm
        The job's ranks.
    """
    if cfg.prefetch is not None:
        return cfg.prefetch
    local, cores = node_share(comm)
    threads = cfg.threads if cfg.threads is not None else max(1, cores // local)
    return 1 if local * (threads + 1) <= cores else 0


def set_threads(cfg: Any, comm: MPI.Comm) -> tuple[int, int, int]:
    """Set each rank's kernel threads (:func:`~disttensor_nn.kernels.limit_threads` for
    ``cfg.kernels``); collective.

    By default (``cfg.threads`` None) the cores divided by the ranks of the
    node; a ``cfg.threads`` that oversubscribes the node's cores is warned about.

    Returns
    -------
    tuple of int
        The threads per rank, the ranks on this node and its cores.
    """
    local, cores = node_share(comm)
    threads = cfg.threads if cfg.threads is not None else max(1, cores // local)
    if threads * local > cores and cfg.threads is not None and threads > 1:
        say(comm, f"warning: --threads {threads} on {plural(local, 'rank')} of this node "
                  f"asks for more threads than its {plural(cores, 'core')}; kernels compete")
    limit_threads(threads, kernels=getattr(cfg, "kernels", None))
    return threads, local, cores


def threads_note(cfg: Any, threads: int, local: int, cores: int,
                 kernels: str = "kernels") -> str:
    """The plan's note on the kernel threads (what :func:`set_threads` returned) and the
    prefetching depth ``cfg.prefetch``; it begins with ``kernels``."""
    return (f"{kernels} on {plural(threads, 'thread')} per rank ({plural(local, 'rank')} on "
            f"{plural(cores, 'core')} of this node; --threads)" + (
                f"; batches prepared {cfg.prefetch} ahead by a thread while a step runs"
                if cfg.prefetch else ""))


def machine_profile(cfg: Any, comm: MPI.Comm, memory: MemoryProfile) -> str:
    """The machine profile to plan on (collective).

    ``cfg.machine``, except that ``"this"`` on ``cfg.device='gpu'`` is the
    GPU calibration's, and that this machine is calibrated first when it has
    no calibration taken with this job's ranks per node (or when
    ``cfg.recalibrate`` asks for it). Several ranks then plan on the file
    kept for their number per node
    (:func:`~disttensor_nn.plan.calibrate.calibration_path`), not on the
    cached one that a job of another size may rewrite meanwhile. One rank,
    which communicates nothing, plans on the cached calibration where there
    is one, else on its own
    compute rates (:func:`~disttensor_nn.plan.calibrate.calibrate_compute`,
    measured once and kept; the path of that profile is returned), its
    kernels timed either way. Nothing is measured for a plan read from a
    file (``cfg.layout`` not ``"auto"``).
    """
    machine = cfg.machine
    if cfg.layout != "auto":
        return machine  # the plan is read, not made
    device = "gpu" if cfg.device == "gpu" else "cpu"
    if machine == "this" and device == "gpu":
        machine = "this-gpu"  # the profile calibrated with the ranks on their GPUs
    if machine in ("this", "this-gpu"):
        path = this_machine_path(device=device)
        alone = this_machine_path(device=device, one_rank=True)
        if comm.Get_size() == 1 and os.path.exists(path) and not cfg.recalibrate:
            # one rank communicates nothing: the calibration's compute rates serve the
            # layers not timed, and every kernel is timed here, on this rank alone
            say(comm, f"1 rank: kernels timed here, on the cached calibration {path} "
                      "(its communication figures are not needed)")
        elif comm.Get_size() == 1:
            machine = alone
            if os.path.exists(alone) and not cfg.recalibrate:
                say(comm, f"1 rank: kernels timed here, on this rank's cached compute rates "
                          f"{alone}")
            else:
                say(comm, "1 rank: measuring this rank's compute rates (one rank sends no "
                          f"message; kept in {alone} for later runs), kernels timed here...")
                with memory.phase("calibration"):
                    calibrate_compute(device=device)
        elif cfg.recalibrate or (why := stale_calibration(comm, device)):
            if not cfg.recalibrate:
                say(comm, f"{why}: calibrating again")
            say(comm, f"calibrating this machine's communication and compute on "
                      f"{plural(comm.Get_size(), 'rank')} (kept in {path} for later runs)...")
            with memory.phase("calibration"):
                calibrate(comm, device=device)
            machine = calibration_path(comm, device)
        else:
            machine = calibration_path(comm, device)
            profile = MachineProfile.load(machine)
            say(comm, f"using the cached calibration {machine} ({profile.notes}); "
                      "--recalibrate measures again")
            if (profile.load_per_core or 0) > HEAVY_LOAD:
                say(comm, f"warning: that calibration was taken under a load of "
                          f"{profile.load_per_core:.1f} per core; its predictions will be "
                          "too slow if the machine is quieter now (use --recalibrate)")
    return machine


def check_resume_step(cfg: Any, step: int) -> None:
    """Refuse to resume at ``step`` (a checkpoint's) a run of ``cfg.steps`` not above it.

    Raises
    ------
    ValueError
        When there is nothing left to train.
    """
    if step >= cfg.steps:
        raise ValueError(f"the checkpoint {cfg.checkpoint} is at step {step}; --steps "
                         f"{cfg.steps} is not above it, so there is nothing to train (ask "
                         f"for more than {plural(step, 'step')})")


def metrics_problem(prefix: str | None, comm: MPI.Comm) -> str | None:
    """Why the metrics files ``PREFIX.csv`` and ``PREFIX.json`` could not be written at the
    end of the run (None: they can; the folder is made where missing); the same answer on
    every rank (rank 0 checks; collective), so that a run never trains for nothing."""
    if not prefix:
        return None
    problem = None
    if comm.Get_rank() == 0:
        folder = os.path.dirname(os.path.abspath(prefix))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            problem = f"--metrics {prefix}: cannot make the folder {folder} ({exc.strerror})"
        else:
            if not os.access(folder, os.W_OK):
                problem = f"--metrics {prefix}: the folder {folder} is not writable"
    return comm.bcast(problem, root=0)


def progress_bar(cfg: Any, comm: MPI.Comm, step: int, name: str) -> Any:
    """The progress bar of the steps from ``step`` to ``cfg.steps`` on rank 0 (``name`` on
    this job's ranks); None on the other ranks or without ``cfg.progress``."""
    if comm.Get_rank() != 0 or not cfg.progress:
        return None
    return tqdm(total=cfg.steps, initial=step,
                desc=f"{name} on {plural(comm.Get_size(), 'rank')}", unit="step")


# ------------------------------------------------------------------ the steps
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


class Batches:
    """The batches a training step takes, timed: from the prefetching thread ``it`` if
    there is one, else from ``loader`` (epoch after epoch).

    :attr:`wait_s` adds up the time :meth:`next` waited (with prefetching, only
    what the thread had not prepared yet); :func:`run_steps` sets it to 0 at
    the start of each step.
    """

    def __init__(self, loader: Loader, it: Prefetcher | None = None, keep: int = 0):
        self.loader, self.it, self.keep = loader, it, keep
        self.plain = iter(loader) if it is None else None
        self.wait_s = 0.0
        self._free_kept: int | None = None  # the allocator's free bytes after the last trim

    def _release(self) -> None:
        """Give back what the allocator holds free beyond :attr:`keep` at the heap's top, where
        its free bytes grew by more than ``keep`` since the last give-back (the first call
        always gives back).

        The free bytes the allocator counts include the pages a trim already gave back
        (their chunks stay free in the heap): measured against the last trim, what a step
        freed and the next takes again does not trim every step, each time faulting the same
        pages in anew (one rank of unet3d on two did: 3,700 page faults a step, the other
        rank waiting for it at every halo and sum).
        """
        bound = None if self._free_kept is None else self._free_kept + self.keep
        if release_free_memory(self.keep, if_above=bound):
            self._free_kept = free_heap_bytes()

    def next(self) -> tuple[Any, Any]:
        """The next ``(input, target)`` batch; what the process freed is released first
        where it grew by more than ``keep`` bytes since the last release.

        The loader's scratch and the last step's arrays, freed, leave the
        process before this step's peak (the C allocator would keep them
        resident), but for ``keep`` bytes at the heap's top (see
        :func:`mapping_threshold`); while the allocator's free bytes stay
        within ``keep`` of what they were after the last release, nothing is
        given back: the step takes the same scratch again, without faulting
        its pages in anew.
        """
        t_data = time.perf_counter()
        x, y, self.plain = next_batch(self.loader, self.it, self.plain)
        self._release()  # the heap's top stays warm for kernels' scratch
        self.wait_s += time.perf_counter() - t_data
        return x, y

    def state_dict(self) -> dict[str, Any]:
        """Where the batches stand (the prefetcher's or loader's state), for a checkpoint."""
        return (self.it or self.loader).state_dict()


@dataclass
class StepResult:
    """What one training step reports to :func:`run_steps`.

    Attributes
    ----------
    loss : float
        The step's loss (the mean over its micro-batches).
    lr : float
        The learning rate the step used.
    extra : dict
        Entries added to the step's history entry (the loss scaler's
        ``skipped`` and ``loss_scale``, for one).
    """

    loss: float
    lr: float
    extra: dict[str, Any] = field(default_factory=dict)


def run_steps(cfg: Any, comm: MPI.Comm, batches: Batches,
              step_fn: Callable[[Batches], StepResult], step: int, history: list[dict],
              times: list[float], data_times: list[float], bar: Any, *,
              model: Any, optimizer: Any, scheduler: Any = None,
              checkpoint_extra: Callable[[], dict[str, Any]] | None = None,
              after_first_step: Callable[[], None] | None = None) -> int:
    """The training steps from ``step`` to ``cfg.steps`` (collective); returns the last step.

    Each step starts at a barrier; ``step_fn(batches)`` runs it (its device
    work finished) and the step's wall time and the time it waited for its
    batches are taken as the slowest rank's. ``times`` (compute: the wall
    time less the wait), ``data_times`` and ``history`` (one entry per step:
    ``step``, ``loss``, ``time_s``, ``compute_s``, ``data_s``,
    ``samples_per_s``, ``lr`` and the step's :attr:`StepResult.extra`) grow
    in place; the progress bar ``bar`` (or None) advances.

    Parameters
    ----------
    cfg : TrainConfig
        ``steps``, ``batch``, ``accumulate``, ``checkpoint`` and ``checkpoint_every``.
    step_fn : callable
        One step: gradients of ``cfg.accumulate`` micro-batches from
        ``batches.next()`` and the optimizer's update. What differs between
        drivers is here.
    model, optimizer, scheduler
        What :func:`~disttensor_nn.training.save_checkpoint` saves every
        ``cfg.checkpoint_every`` steps and at the last one (with ``cfg.checkpoint``).
    checkpoint_extra : callable, optional
        More entries for the checkpoint's ``extra``, after ``loader`` (the
        batches' state) and ``history``.
    after_first_step : callable, optional
        Called once the first step of this run is timed (the layers' clocks
        after it warmed caches and the allocator).
    """
    while step < cfg.steps:
        comm.Barrier()
        t0 = time.perf_counter()
        batches.wait_s = 0.0
        result = step_fn(batches)
        clocks = np.array([time.perf_counter() - t0, batches.wait_s])
        comm.Allreduce(MPI.IN_PLACE, clocks, op=MPI.MAX)
        wall, dt_data = clocks.tolist()
        dt_step = wall - dt_data
        step += 1
        times.append(dt_step)
        if len(times) == 1 and after_first_step is not None:
            after_first_step()
        data_times.append(dt_data)
        history.append({"step": step, "loss": result.loss, "time_s": wall,
                        "compute_s": dt_step, "data_s": dt_data,
                        "samples_per_s": cfg.batch * cfg.accumulate / wall,
                        "lr": result.lr, **result.extra})
        if bar is not None:
            bar.set_postfix(loss=f"{result.loss:.4f}", compute_ms=f"{1e3 * dt_step:.0f}",
                            data_ms=f"{1e3 * dt_data:.0f}")
            bar.update(1)
        if cfg.checkpoint and (step == cfg.steps or (cfg.checkpoint_every and
                                                     step % cfg.checkpoint_every == 0)):
            save_checkpoint(cfg.checkpoint, model, optimizer, step,
                            extra={"loader": batches.state_dict(), "history": history,
                                   **(checkpoint_extra() if checkpoint_extra else {})},
                            comm=comm, scheduler=scheduler)
    return step


# ------------------------------------------------------------------ memory
def peak_memory(memory: MemoryProfile) -> int:
    """This process's peak resident bytes so far (the profile restarts the kernel's count)."""
    return memory.peak()


def phase_line(memory: MemoryProfile) -> str:
    """Each phase's peak in MiB, on one line (``"before setup"`` before the first)."""
    return ", ".join(f"{p.name} {p.peak / 2**20:.0f}" for p in memory.phases.values()) or \
        "before setup"


def say_peak_memory(comm: MPI.Comm, memory: MemoryProfile) -> None:
    """Print on rank 0 the ranks' peak resident memory and rank 0's phases (collective):
    the line a run refused before its first step ends with."""
    peak = comm.allreduce(peak_memory(memory), op=MPI.MAX)
    say(comm, f"peak resident memory per rank {peak / 2**20:.0f} MiB "
              f"(rank 0: {phase_line(memory)})")


# ------------------------------------------------------------------ the summary
def predicted_training_peak(summary: dict[str, Any]) -> float:
    """The resident peak a training step is predicted to reach, in bytes, from a run's
    summary: the plan's peak (the process baseline included) and what the run holds
    besides the plan's blocks: the block cache's free blocks up to its limit
    (``predicted_cache_slack_bytes``), the free memory the C heap keeps at its top
    (``predicted_heap_slack_bytes``) and a synthetic data set's kept blocks
    (``predicted_kept_data_bytes``)."""
    return summary["predicted_peak_memory_bytes"] + sum(
        summary.get(k) or 0 for k in ("predicted_cache_slack_bytes",
                                      "predicted_heap_slack_bytes",
                                      "predicted_kept_data_bytes"))


def timing_summary(cfg: Any, history: list[dict], times: list[float],
                   data_times: list[float]) -> dict[str, Any]:
    """The summary's losses and step times: ``final_loss``, ``first_loss``, ``history``
    (the losses), and the medians ``time_per_iteration_s``, ``compute_time_per_iteration_s``,
    ``data_time_per_iteration_s`` and ``samples_per_s`` (None without a step)."""
    step_s = float(np.median(np.add(times, data_times))) if times else None
    return {
        "final_loss": history[-1]["loss"] if history else None,
        "first_loss": history[0]["loss"] if history else None,
        "history": [h["loss"] for h in history],
        "time_per_iteration_s": step_s,
        "compute_time_per_iteration_s": float(np.median(times)) if times else None,
        "data_time_per_iteration_s": float(np.median(data_times)) if times else None,
        "samples_per_s": cfg.batch * cfg.accumulate / step_s if times else None,
    }


def memory_summary(comm: MPI.Comm, memory: MemoryProfile) -> dict[str, int]:
    """The summary's measured peaks, the largest rank's (collective):
    ``peak_memory_per_rank_bytes`` (the whole run), ``training_peak_memory_per_rank_bytes``
    (forward, backward, optimizer) and ``planning_peak_memory_per_rank_bytes``
    (calibration, kernel measurement, planning)."""
    peak = comm.allreduce(peak_memory(memory), op=MPI.MAX)

    def phase_peak(*names: str) -> int:
        return comm.allreduce(max((memory.phases[n].peak for n in names
                                   if n in memory.phases), default=0), op=MPI.MAX)
    return {"peak_memory_per_rank_bytes": peak,
            "training_peak_memory_per_rank_bytes": phase_peak("forward", "backward",
                                                              "optimizer"),
            "planning_peak_memory_per_rank_bytes": phase_peak("calibration",
                                                              "kernel measurement", "planning")}


def prediction_warning(summary: dict, tolerance: float = 0.25, top: int = 3) -> str | None:
    """A warning when a run's measured step differs from the plan's prediction by more than
    ``tolerance`` (a share of the prediction), naming the layers that account for most of
    the difference; None otherwise.

    ``summary`` is what :func:`~disttensor_nn.training.train` returns: its
    ``compute_time_per_iteration_s`` and ``predicted_time_per_iteration_s``,
    and per layer ``predicted_s`` and ``measured_s`` (what the layer's forward and
    backward add to the step, communication included:
    :meth:`~disttensor_nn.training.clocks.LayerClocks.spans`).
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


def print_summary(s: dict) -> None:
    """Print a run's summary ``s`` (what :func:`~disttensor_nn.training.train` returns): the
    model, batch and ranks, the losses, the measured and predicted step time and memory,
    the block cache's use."""
    k = s["config"].get("accumulate", 1)
    auto = s["config"].get("shard_state") == "auto"
    micro = f" x {k} micro-batches" if k > 1 else ""
    print(f"\n{s['model']} {tuple(s['batch_shape'])}{micro} on {plural(s['ranks'], 'rank')}: "
          f"{plural(s['steps'], 'step')}"
          + (f"; parameter state sharded: {s['shard_state']}"
             if s.get("shard_state", "none") != "none" else
             "; parameter state not sharded" if auto else "")
          + (" (chosen by --shard-state auto: the fastest plan that fits)" if auto else ""))
    if s["first_loss"] is not None:
        print(f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}"
              + (f"; activations in {s['precision']}" if s.get("precision", "fp32") != "fp32"
                 else "")
              + (f"; {plural(s['skipped_steps'], 'step')} skipped for non-finite gradients "
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
    heap = s.get("predicted_heap_slack_bytes") or 0
    kept = s.get("predicted_kept_data_bytes") or 0
    print(f"peak memory per rank (resident): training step "
          f"{s['training_peak_memory_per_rank_bytes'] / 2**20:.0f} MiB (predicted "
          f"{predicted_training_peak(s) / 2**20:.0f} MiB"
          + (f", the block cache's slack of {slack / 2**20:.0f} MiB included" if slack else "")
          + (f", the C heap's kept free top of {heap / 2**20:.0f} MiB included" if heap else "")
          + (f", the synthetic data's kept blocks of {kept / 2**20:.0f} MiB included"
             if kept else "")
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


def write_metrics(prefix: str | None, history: list[dict], summary: dict) -> None:
    """Write ``PREFIX.csv`` (one row per step: ``step``, ``loss``, ``time_s``,
    ``compute_s``, ``data_s``, ``samples_per_s``) and ``PREFIX.json`` (``history`` and
    ``summary``); nothing without a ``prefix``."""
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
