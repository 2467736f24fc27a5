"""Calibration: measure this machine's communication constants and compute rates.

Run under ``mpiexec`` with the number of ranks the job will use (at least 2)::

    mpiexec -n 4 disttensor-plan --calibrate               # CPU ranks
    mpiexec -n 4 disttensor-plan --calibrate --device gpu  # one GPU per rank

Point-to-point time is measured by the library's halo exchange (a face to
each neighbour along one split dimension), allreduce over communicators of
2 .. P ranks and all-to-all by the library's redistribution over all ranks,
each at several message sizes; ``alpha`` and ``beta`` of each model are fitted
by least squares. The float32 GEMM rate and the memory bandwidth of one rank
are measured while every rank runs the same benchmark (so contention between
ranks sharing cores is included). Messages travel the way the library sends
them: through the array module's transport (:mod:`disttensor.transport`:
device buffers straight to a CUDA-aware MPI, staged through pinned host
memory, or NCCL) and the library's own redistribution, and device work is
synchronised before every clock reading. On the host, the memory the MPI
library adds while non-blocking allreduces are in flight is measured too
(``reduce_scratch``, per byte reduced), for the planner's memory model.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.backend import is_numpy, synchronize
from disttensor.device import use_device
from disttensor.transport import iallreduce, transport_for

from ..memory import peak_resident_bytes, release_free_memory, reset_peak, resident_bytes
from .machine import MachineProfile, this_machine_path

__all__ = ["calibrate", "calibrate_compute", "calibrate_if_stale", "calibration_path",
           "stale_calibration", "ranks_per_node", "METHOD"]

SIZES = [2**k for k in range(3, 24, 3)]  # 8 B .. 2 MiB

METHOD = 2
"""The calibration's method, recorded in the profile (``calibration_method``); a cached
calibration of a lower one is taken again. 2: allreduces timed on buffers that left the
caches (a rotation larger than the last-level cache), as a training step's gradients
are: on 2 ranks of 2 cores a 2 MiB allreduce took 0.44 ms from the cache and 0.86 ms
from memory, and the fit on the cached buffers priced ResNet-18's 47 MB of gradients
at 9.6 ms where they took 21-33 ms."""

ROTATION_BYTES = 64 * 2**20
"""Bytes of the buffers an allreduce of one size is rotated over while it is timed."""


def _median_time(fn, comm: MPI.Comm, reps: int, xp: Any = np) -> float:
    fn()
    times = []
    for _ in range(reps):
        synchronize(xp)
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        synchronize(xp)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times)


def _fit(features: list[list[float]], times: list[float]) -> tuple[float, float]:
    a = np.asarray(features)
    t = np.asarray(times)
    w = 1.0 / np.maximum(t, 1e-7)  # relative error: small and large messages count alike
    coef, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    return float(max(coef[0], 1e-8)), float(max(coef[1], 1e-13))


def _p2p(comm: MPI.Comm, reps: int, xp: Any) -> tuple[float, float]:
    """Halo exchanges as the library runs them: one split dimension, a face to each side.

    That is what the cost model charges ``p2p(face bytes)`` for, per split
    dimension of a window layer, so its constants include the library's own
    work per exchange (plans, packing, requests), not only the wire's.
    """
    p = comm.Get_size()
    grid = ProcessGrid((p,), comm)
    feats, times = [], []
    for n in SIZES:
        cols = max(1, n // 4)
        x = DistArray.zeros(Distribution((4 * p, cols), grid, (0, None)), np.float32, xp=xp)
        t = _median_time(lambda x=x: x.exchange_halo(((1, 1), (0, 0))), comm, reps, xp)
        feats.append([1.0, cols * 4])
        times.append(t)
    return _fit(feats, times)


def _allreduce(comm: MPI.Comm, reps: int, xp: Any) -> tuple[float, float]:
    feats, times = [], []
    size = comm.Get_size()
    t = transport_for(xp)
    for p in sorted({2, size}):
        sub = comm.Split(0 if comm.Get_rank() < p else MPI.UNDEFINED, comm.Get_rank())
        for n in SIZES:
            # written (so mapped) beforehand; each call takes the next, which left the caches
            xs = [xp.ones(max(n // 8, 1), dtype=np.float64)
                  for _ in range(max(1, min(ROTATION_BYTES // n, 64)))]
            turn = itertools.cycle(xs)
            if sub != MPI.COMM_NULL:
                tp = _median_time(lambda s=sub, c=turn: t.allreduce(next(c), s), sub, reps, xp)
            else:
                tp = 0.0
            tp = comm.allreduce(tp, op=MPI.MAX)
            del xs, turn
            feats.append([2 * np.log2(p), 2 * (p - 1) / p * max(n // 8, 1) * 8])
            times.append(tp)
        if sub != MPI.COMM_NULL:
            sub.Free()
    return _fit(feats, times)


def _reduce_scratch(comm: MPI.Comm, xp: Any, nbytes: int = 32 * 2**20) -> float:
    """Resident bytes the MPI library adds per byte of non-blocking allreduces in flight.

    Four reductions of ``nbytes / 4`` are started at once and then waited
    for, as the gradient buckets do at the end of backward; the growth of
    the peak resident memory over their bytes, the largest over the ranks.
    0 where the operating system cannot restart the peak, or for device
    memory (not resident on the host).
    """
    if not is_numpy(xp):
        return 0.0
    arrays = [np.ones(nbytes // 16, np.float32) for _ in range(4)]
    release_free_memory()
    comm.Barrier()
    exact = reset_peak()
    before = resident_bytes()
    for request in [iallreduce(a, comm) for a in arrays]:
        request.wait()
    grown = max(peak_resident_bytes() - before, 0) / nbytes if exact else 0.0
    return float(comm.allreduce(grown, op=MPI.MAX))


def _alltoall(comm: MPI.Comm, reps: int, xp: Any) -> tuple[float, float]:
    """Shuffles as the library runs them: a redistribution from a row split to a column split."""
    p = comm.Get_size()
    grid = ProcessGrid((p,), comm)
    feats, times = [], []
    for n in SIZES:
        side = max(p, int(np.sqrt(max(n // 4, 1))))
        rows = Distribution((side, side), grid, (0, None))
        cols = Distribution((side, side), grid, (None, 0))
        x = DistArray.zeros(rows, np.float32, xp=xp)
        out = DistArray.empty(cols, np.float32, xp=xp)
        t = _median_time(lambda x=x, out=out, cols=cols: x.redistribute(cols, out), comm, reps,
                         xp)
        moved = max(math.prod(x.local_shape) * (p - 1) // p, 1) * 4
        feats.append([p - 1, moved])
        times.append(t)
    return _fit(feats, times)


def _compute(comm: MPI.Comm, xp: Any) -> tuple[float, float]:
    n = 1024 if xp is np else 4096
    a = xp.asarray(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
    t = _median_time(lambda: a @ a, comm, 5, xp)
    flops = 2 * n**3 / t
    big = xp.ones(2**24 if xp is np else 2**27, dtype=np.float32)
    out = xp.empty_like(big)
    t = _median_time(lambda: out.__setitem__(Ellipsis, big), comm, 5, xp)
    return flops, 2 * big.nbytes / t


def _device_memory(xp: Any, ranks_per_device: int) -> float:
    """Bytes of memory per rank: the host's, or the GPU's shared by the ranks using it."""
    if xp is np:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks_per_device
    return xp.cuda.Device().mem_info[1] / ranks_per_device  # pragma: no cover - GPU only


def ranks_per_node(comm: MPI.Comm) -> int:
    """The most ranks of ``comm`` that share one node; collective."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    here = node.Get_size()
    node.Free()
    return comm.allreduce(here, op=MPI.MAX)


def stale_calibration(comm: MPI.Comm, device: str = "cpu",
                      cache_dir: str | None = None) -> str | None:
    """Why this machine's cached calibration does not hold for a job on ``comm``; collective.

    A calibration holds for jobs with as many ranks per node as it was taken
    with: ranks that share a node's cores share its compute rate, its memory
    and the time the MPI library takes to progress a message (on a node with
    more ranks than cores, a message waits for its receiver to be scheduled).
    Where the cached profile (the one ``"this"`` names) does not hold but an
    earlier calibration with this job's ranks per node was kept beside it
    (:func:`calibrate` keeps one per number of ranks per node), that one is
    put back as the cached profile, so that jobs of 2 and of 4 ranks taking
    turns do not calibrate each time.
    Returns None when the cached profile holds (or was put back), otherwise a
    sentence saying why not (none cached yet, taken by an earlier method
    (:data:`METHOD`), or with another number of ranks per node), the same on
    every rank.
    """
    per_node = ranks_per_node(comm)
    return _on_rank0(comm, lambda: _put_back(cache_dir, device, per_node),
                     "stale_calibration: the calibration cache could not be written")


def _on_rank0(comm: MPI.Comm, fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` on rank 0 alone (the cache's reads and writes), its result on every rank;
    an ``OSError`` there is raised on every rank (``what``, then why), none left waiting.
    Collective."""
    out = error = None
    if comm.Get_rank() == 0:
        try:
            out = fn()
        except OSError as exc:
            error = f"{what} ({exc})"
    out, error = comm.bcast((out, error), root=0)
    if error is not None:
        raise OSError(error)
    return out


def calibration_path(comm: MPI.Comm, device: str = "cpu", cache_dir: str | None = None
                     ) -> str:
    """The path of the calibration kept for ``comm``'s number of ranks per node
    (:func:`this_machine_path` with ``per_node``; rank 0's, the same on every rank);
    collective.

    After :func:`calibrate_if_stale`, a plan made on this path (a machine profile's JSON
    file) is made on a calibration taken with as many ranks per node as ``comm`` has,
    whatever another job writes to the cached profile ``"this"`` meanwhile.
    """
    per_node = ranks_per_node(comm)
    return comm.bcast(this_machine_path(cache_dir, device, per_node=per_node)
                      if comm.Get_rank() == 0 else None, root=0)


def _put_back(cache_dir: str | None, device: str, per_node: int) -> str | None:
    """:func:`stale_calibration`'s answer, on rank 0: why the cached profile does not
    hold for ``per_node`` ranks per node, after the one kept for that many is put back
    where it holds (and the cached one kept for its own number where none was)."""
    path = this_machine_path(cache_dir, device)
    kept = this_machine_path(cache_dir, device, per_node=per_node)
    why = _why_not(path, per_node)
    if why is None:
        if not os.path.exists(kept):  # taken before calibrations were kept
            _copy(path, kept)
    elif _why_not(kept, per_node) is None:
        _copy(kept, path)
        why = None
    return why


def _copy(src: str, dst: str) -> None:
    """``src``'s bytes into ``dst``, replaced at once (fields of another version kept)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(dst)),
                               prefix=os.path.basename(dst) + ".", suffix=".tmp")
    os.close(fd)
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _why_not(path: str, per_node: int) -> str | None:
    """Why the profile at ``path`` does not hold for a job of ``per_node`` ranks per node
    (None where it does)."""
    if not os.path.exists(path):
        return f"this machine has no calibration yet ({path})"
    try:  # rank 0 reads it alone: a file cut short or edited is a reason, not an error
        cached = MachineProfile.load(path)
        method, taken = int(cached.calibration_method), int(cached.calibrated_ranks_per_node)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"the cached calibration {path} could not be read ({exc})"
    if method < METHOD:
        return (f"the cached calibration {path} was taken by an earlier method "
                f"({method}; this version's is {METHOD})")
    if taken != per_node:
        ranks = (f"{taken} rank{'' if taken == 1 else 's'}" if taken
                 else "an unrecorded number of ranks")
        return (f"the cached calibration {path} was taken with {ranks} per node and "
                f"this job has {per_node}")
    return None


def _units(xp: Any, device: str) -> int:
    """Compute units per node: the host's cores, or its GPUs."""
    if device == "gpu":  # pragma: no cover - GPU only
        return int(xp.cuda.runtime.getDeviceCount())
    return os.cpu_count() or 1


def _measured(device: str, units: int, load: float, flops: float, bw: float, mem: float,
              per_node: int, taken: str, remark: str = "", **comm: float) -> MachineProfile:
    """This machine's profile from what was measured (``comm``: the communication fits),
    its notes saying when (``taken``) and under what load it was."""
    cores = os.cpu_count() or 1
    suffix = "" if device == "cpu" else f"-{device}"
    return MachineProfile(
        name=f"this{suffix}:{socket.gethostname()}", peak_flops=flops, efficiency=1.0,
        mem_bandwidth=bw, memory_per_rank=mem, cores_per_node=units, measured=True,
        device=device, notes=f"{taken} under a load average of {load:.1f} on {cores} cores"
        f"{remark}", load_per_core=load / cores, calibrated_ranks_per_node=per_node,
        calibration_method=METHOD, **comm)


def calibrate(comm: MPI.Comm | None = None, reps: int = 5, save: bool = True,
              cache_dir: str | None = None, device: str = "cpu") -> MachineProfile:
    """Measure and (on rank 0) save the profile of this machine; collective.

    With ``device="gpu"`` every rank drives a GPU (:func:`disttensor.use_device`),
    buffers live there and the profile is saved as ``this-gpu``
    (``load_profile("this-gpu")``); its compute units per node are the GPUs.
    A copy is kept for the job's number of ranks per node
    (``this_machine_path(..., per_node=k)``), which :func:`stale_calibration` puts
    back for a later job of as many.
    Returns the same :class:`MachineProfile` on every rank.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_size() < 2:
        raise ValueError("calibration needs at least 2 ranks (run it under mpiexec -n P)")
    xp = use_device(device, comm)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = node.Get_size()
    node.Free()
    units = _units(xp, device)
    load = os.getloadavg()[0]  # before our own measurements add to it
    p2p = _p2p(comm, reps, xp)
    ar = _allreduce(comm, reps, xp)
    a2a = _alltoall(comm, reps, xp)
    scratch = _reduce_scratch(comm, xp)
    flops, bw = _compute(comm, xp)
    mem = _device_memory(xp, max(1, per_node // units) if device == "gpu" else per_node)
    profile = _measured(
        device, units, load, flops, bw, mem, ranks_per_node(comm),
        f"calibrated with {comm.Get_size()} ranks on {time.strftime('%Y-%m-%d %H:%M')}",
        p2p_alpha=p2p[0], p2p_beta=p2p[1], allreduce_alpha=ar[0], allreduce_beta=ar[1],
        alltoall_alpha=a2a[0], alltoall_beta=a2a[1], reduce_scratch=scratch)

    def keep() -> MachineProfile:  # the cached one, and the one kept for its ranks
        if save:
            profile.save(this_machine_path(cache_dir, device))
            profile.save(this_machine_path(cache_dir, device,
                                           per_node=profile.calibrated_ranks_per_node))
        return profile

    return _on_rank0(comm, keep, "calibrate: the profile could not be saved")


def calibrate_compute(device: str = "cpu", cache_dir: str | None = None,
                      save: bool = True) -> MachineProfile:
    """Measure this process's compute rates alone: a profile for a job of one rank.

    One rank sends no message, so no communication is measured (its figures
    are zero); the float32 GEMM rate, the memory bandwidth and the memory
    are measured as :func:`calibrate` measures them, on this process alone.
    The profile is saved (with ``save``) at ``this_machine_path(cache_dir,
    device, one_rank=True)``, apart from the calibration ``"this"`` names, so
    that a plan for several ranks never reads it; load it by that path.
    Not collective.
    """
    xp = use_device(device, MPI.COMM_SELF)
    load = os.getloadavg()[0]
    flops, bw = _compute(MPI.COMM_SELF, xp)
    profile = _measured(
        device, _units(xp, device), load, flops, bw, _device_memory(xp, 1), 1,
        f"one rank's compute, measured on {time.strftime('%Y-%m-%d %H:%M')}",
        " (no communication: one rank sends nothing)",
        p2p_alpha=0.0, p2p_beta=0.0, allreduce_alpha=0.0, allreduce_beta=0.0,
        alltoall_alpha=0.0, alltoall_beta=0.0)
    if save:
        profile.save(this_machine_path(cache_dir, device, one_rank=True))
    return profile


def calibrate_if_stale(comm: MPI.Comm, device: str = "cpu",
                       cache_dir: str | None = None) -> str | None:
    """Calibrate this machine unless its cached calibration holds for ``comm``; collective.

    Returns why it calibrated (:func:`stale_calibration`), or None when the
    cached profile was kept or the one kept for ``comm``'s ranks per node put back
    (then read by :func:`calibration_path` on every rank).
    """
    why = stale_calibration(comm, device, cache_dir)
    if why is not None:
        calibrate(comm, cache_dir=cache_dir, device=device)
    return why
