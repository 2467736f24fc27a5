"""Distributed inference: a trained model run on whole samples, each block written by its owner.

:func:`predict` builds the model from the registry, loads a checkpoint's
weights, plans the layers' distributions for an inference pass (the
planner's memory model with ``training=False``: no activation is kept for a
backward pass, so a spatial split is chosen only when a sample does not fit
a rank otherwise, or when it is faster), and runs the samples of a data set
one at a time in eval mode. Every layer drops what it saved for backward as
soon as its forward returns (:meth:`~disttensor_nn.Layer.release_saved`), so
a rank holds one layer's input and output blocks at a time. Every rank reads
only its block of each input (:meth:`Dataset.inputs
<disttensor_nn.training.data.Dataset.inputs>`) and writes only its block of
each output into one Zarr store or ``.npy`` file (:func:`disttensor.to_zarr`
/ :func:`disttensor.to_npy` with ``region=``), so no sample is ever whole
on one rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI
from tqdm import tqdm

from disttensor import DistArray, to_npy, to_zarr, use_device
from disttensor.backend import as_module, is_numpy, to_numpy
from disttensor.io import optional_module

from ..container import Sequential
from ..kernels import kernels_for, synchronize
from ..layout import to_memory_format
from ..memory import MemoryProfile, map_large_allocations, release_free_memory, resident_bytes
from ..plan import Plan, apply_plan, make_plan
from ..plan.calibrate import calibrate_if_stale, calibration_path
from ..plan.tracing import leaf_nodes, trace
from .checkpoint import load_checkpoint
from .data import open_dataset
from .registry import build_model, model_spec

__all__ = ["PredictConfig", "predict", "predict_summary"]

UNCALIBRATED = "v100-nvlink-edr"  # planning profile of a 1-rank job (nothing to calibrate)


@dataclass
class PredictConfig:
    """Everything ``disttensor-predict`` can be told."""

    model: str = "mesh-demo"
    checkpoint: str = ""  # a checkpoint directory written by disttensor-train
    data: str = ""  # a data set (open_dataset: HDF5, Zarr, .npy)
    out: str = ""  # the output: a Zarr store (*.zarr) or one .npy file (*.npy)
    data_input: str = "input"  # name of the input array in the data file
    machine: str = "this"
    memory_per_rank: float | None = None
    chunks: tuple[int, ...] | None = None  # Zarr output: chunk extent per spatial dimension
    seed: int = 0  # of the initial weights, all overwritten by the checkpoint's
    progress: bool = True
    device: str = "cpu"  # "cpu" (NumPy) or "gpu" (CuPy, one GPU per rank of a node)
    kernels: str = "auto"  # "numpy", "torch" or "auto" (each layer's faster; make_plan)
    # the blocks' layout: "contiguous", "channels_last" or "auto" (make_plan's memory_format)
    memory_format: str = "auto"


def predict_machine(cfg: PredictConfig, comm: MPI.Comm) -> str:
    """The machine profile to plan on; calibrates this machine first when it has no
    calibration taken with this job's ranks per node (with the ranks on their GPUs for
    ``device="gpu"``: the profile ``this-gpu``), and names the file kept for that number
    (:func:`~disttensor_nn.plan.calibrate.calibration_path`)."""
    if cfg.machine != "this":
        return cfg.machine
    if comm.Get_size() == 1:
        return UNCALIBRATED
    device = "gpu" if cfg.device == "gpu" else "cpu"
    calibrate_if_stale(comm, device)
    # the file kept for this job's ranks per node: the cached one may be rewritten
    # meanwhile by a job of another size
    return calibration_path(comm, device)


def create_output(cfg: PredictConfig, shape: tuple[int, ...], dtype: np.dtype,
                   comm: MPI.Comm) -> None:
    """Rank 0 creates the output array (N, C, *S); every rank learns whether it could."""
    error = None
    if comm.Get_rank() == 0:
        try:
            if cfg.out.lower().endswith(".npy"):
                np.lib.format.open_memmap(cfg.out, mode="w+", dtype=dtype, shape=shape).flush()
            else:
                tile = cfg.chunks or (64,) * (len(shape) - 2)
                chunks = (1, shape[1], *(min(t, n) for t, n in zip(tile, shape[2:])))
                optional_module("zarr").create_array(store=cfg.out, shape=shape, dtype=dtype,
                                                     chunks=chunks, overwrite=True)
        except Exception as exc:  # shared with the other ranks, raised on all
            error = f"cannot create {cfg.out}: {type(exc).__name__}: {exc}"
    error = comm.bcast(error, root=0)
    if error:
        raise OSError(error)


def predict(cfg: PredictConfig, comm: MPI.Comm | None = None, *,
            xp: Any = None) -> dict[str, Any]:
    """Run a trained model on every sample of a data set; collective.

    Parameters
    ----------
    cfg : PredictConfig
    comm : mpi4py.MPI.Comm, optional
        ``MPI.COMM_WORLD`` by default.
    xp : module, optional
        The array module the model computes with, instead of the one
        ``cfg.device`` picks (NumPy, or CuPy on this rank's GPU): any array
        API library (as :func:`~disttensor_nn.training.train`). Inputs are
        read on the host and moved to it; outputs come back to the host to
        be written.

    Returns
    -------
    dict
        The same on every rank: ``samples``, ``out``, ``output_shape``
        (``[N, C, *S]``), ``plan`` (its table), ``predicted_peak_memory_bytes`` (per rank,
        the process included), ``peak_memory_per_rank_bytes`` (measured: the
        resident peak of each rank while the samples ran),
        ``time_per_sample_s`` (median, the slowest rank's),
        ``io_time_per_sample_s`` (of which reading the input and writing the
        output) and ``predicted_time_per_sample_s`` (the plan's, compute and
        communication).

    Raises
    ------
    ValueError, FileNotFoundError, OSError
        On every rank alike, before any sample is run: data that does not fit
        the model, no plan that fits the memory budget, a checkpoint that does
        not fit the model, an output that cannot be created, ``device="gpu"``
        without CuPy or a GPU.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if xp is None:
        try:
            xp = use_device(cfg.device, comm)
        except RuntimeError as exc:  # the same on every rank of the job
            raise ValueError(f"--device {cfg.device}: {exc}") from exc
    if cfg.memory_per_rank is not None:  # a budget to honour: freed arrays leave the process
        map_large_allocations()  # (at the price of page faults on every new large array)
    memory = MemoryProfile()
    spec = model_spec(cfg.model)
    data = open_dataset(cfg.data, cfg.data_input, None)
    if data.sample_shape[0] != spec.in_channels:
        raise ValueError(f"the samples in {cfg.data} are {data.sample_shape}; model "
                         f"{cfg.model!r} takes {spec.in_channels} channels")
    model, shape = build_model(cfg.model, tuple(data.sample_shape[1:]), 1, seed=cfg.seed)
    out_shape = tuple(model.output_shape(shape))  # raises for a size the network cannot take
    if isinstance(model, Sequential) and len(model):
        model[0].input_grad = False
    model.eval()
    load_checkpoint(cfg.checkpoint, model, None, comm=comm)
    n = len(data)
    stack = (n, *out_shape[1:])
    # the output store is created (and its library loaded) before the process baseline
    create_output(cfg, stack, np.dtype(np.float32), comm)
    machine = predict_machine(cfg, comm)  # a calibration first, if one is due: in the baseline
    params = sum(p.data.nbytes for p in model.parameters())
    baseline = comm.allreduce(resident_bytes() - params, op=MPI.MAX)
    plan: Plan
    plan, _ = make_plan(model, shape, comm.Get_size(), machine, cfg.memory_per_rank,
                        comm=comm, baseline=baseline, profile=memory, training=False,
                        kernels=cfg.kernels, memory_format=cfg.memory_format)
    apply_plan(model, plan, shape, comm)
    if not is_numpy(xp):
        model.to(xp)
    nodes = leaf_nodes(trace(model, shape))
    release_workspace = getattr(kernels_for(xp.zeros(1)), "release_workspace", None)

    def drop(layer: Any, x: Any, y: Any) -> None:
        # nothing kept for a backward pass, and no kernel scratch kept from layer to layer
        # (the memory model counts a layer's scratch in its own pass alone)
        layer.release_saved()
        if release_workspace is not None:
            release_workspace()

    for _, layer in model.named_modules():
        layer.register_forward_hook(drop)
    first = nodes[0].layer.layout
    write = to_npy if cfg.out.lower().endswith(".npy") else to_zarr
    release_free_memory()
    times, io_times = [], []
    bar = None
    if comm.Get_rank() == 0 and cfg.progress:
        bar = tqdm(total=n, desc=f"{cfg.model} on {comm.Get_size()} ranks", unit="sample")
    with memory.phase("inference"):
        for i in range(n):
            t0 = time.perf_counter()
            x = data.inputs([i], first.distribution(shape))
            if not is_numpy(xp):
                x = DistArray(as_module(x.local, xp), x.dist)
            t1 = time.perf_counter()
            x = to_memory_format(x, plan.memory_format)  # the C-order block let go
            y = model(x)
            del x
            synchronize(xp)
            t2 = time.perf_counter()
            if not is_numpy(xp):
                y = DistArray(to_numpy(y.local), y.dist)
            write(y.astype(np.float32, copy=False), cfg.out, region=(slice(i, i + 1),))
            del y
            t3 = time.perf_counter()
            times.append(t3 - t0)
            io_times.append(t1 - t0 + t3 - t2)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return predict_summary(cfg, stack, plan, memory, comm, times, io_times, plan.time)


def predict_summary(cfg: Any, stack: tuple[int, ...], plan: Plan, memory: MemoryProfile,
                    comm: MPI.Comm, times: list[float], io_times: list[float],
                    predicted_s: float) -> dict[str, Any]:
    """What a prediction run returns (collective): the samples and where they went, the
    plan, the peaks of every rank, and the slowest rank's median time per sample (and of
    it the time reading and writing) beside ``predicted_s``."""
    def slowest(ts: list[float]) -> float:
        return comm.allreduce(float(np.median(ts)) if ts else 0.0, op=MPI.MAX)

    return {"samples": stack[0], "out": cfg.out, "output_shape": list(stack),
            "plan": plan.table(), "predicted_peak_memory_bytes": plan.peak_memory,
            "peak_memory_per_rank_bytes": comm.allgather(memory.phases["inference"].peak),
            "time_per_sample_s": slowest(times), "io_time_per_sample_s": slowest(io_times),
            "predicted_time_per_sample_s": predicted_s}
