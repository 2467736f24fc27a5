"""Calibration: measure this machine's communication constants and compute rates.

Run under ``mpiexec`` with the number of ranks the job will use (at least 2)::

    mpiexec -n 4 disttensor-plan --calibrate

Point-to-point time is measured by ping-pong between ranks 0 and 1,
allreduce over communicators of 2 .. P ranks and all-to-all over all ranks,
each at several message sizes; ``alpha`` and ``beta`` of each model are fitted
by least squares. The float32 GEMM rate and the memory bandwidth of one rank
are measured while every rank runs the same benchmark (so contention between
ranks sharing cores is included).
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time

import numpy as np
from mpi4py import MPI

from .machine import MachineProfile, this_machine_path

__all__ = ["calibrate"]

SIZES = [2**k for k in range(3, 24, 3)]  # 8 B .. 8 MiB


def _median_time(fn, comm: MPI.Comm, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times)


def _fit(features: list[list[float]], times: list[float]) -> tuple[float, float]:
    a = np.asarray(features)
    t = np.asarray(times)
    w = 1.0 / np.maximum(t, 1e-7)  # relative error: small and large messages count alike
    coef, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    return float(max(coef[0], 1e-8)), float(max(coef[1], 1e-13))


def _p2p(comm: MPI.Comm, reps: int) -> tuple[float, float]:
    rank = comm.Get_rank()
    feats, times = [], []
    for n in SIZES:
        buf = np.zeros(n, np.uint8)

        def ping(buf: np.ndarray = buf) -> None:
            for _ in range(4):
                if rank == 0:
                    comm.Send(buf, 1)
                    comm.Recv(buf, 1)
                elif rank == 1:
                    comm.Recv(buf, 0)
                    comm.Send(buf, 0)

        t = _median_time(ping, comm, reps) / 8
        feats.append([1.0, n])
        times.append(t)
    return _fit(feats, times)


def _allreduce(comm: MPI.Comm, reps: int) -> tuple[float, float]:
    feats, times = [], []
    size = comm.Get_size()
    for p in sorted({2, size}):
        sub = comm.Split(0 if comm.Get_rank() < p else MPI.UNDEFINED, comm.Get_rank())
        for n in SIZES:
            x = np.zeros(max(n // 8, 1))
            if sub != MPI.COMM_NULL:
                t = _median_time(lambda s=sub, x=x: s.Allreduce(MPI.IN_PLACE, x), sub, reps)
            else:
                t = 0.0
            t = comm.allreduce(t, op=MPI.MAX)
            feats.append([2 * np.log2(p), 2 * (p - 1) / p * x.nbytes])
            times.append(t)
        if sub != MPI.COMM_NULL:
            sub.Free()
    return _fit(feats, times)


def _alltoall(comm: MPI.Comm, reps: int) -> tuple[float, float]:
    """Shuffles as the library runs them: a redistribution from a row split to a column split."""
    from disttensor import DistArray, Distribution, ProcessGrid

    p = comm.Get_size()
    grid = ProcessGrid((p,), comm)
    feats, times = [], []
    for n in SIZES:
        side = max(p, int(np.sqrt(max(n // 4, 1))))
        rows = Distribution((side, side), grid, (0, None))
        cols = Distribution((side, side), grid, (None, 0))
        x = DistArray.zeros(rows, np.float32)
        out = DistArray.empty(cols, np.float32)
        t = _median_time(lambda x=x, out=out, cols=cols: x.redistribute(cols, out), comm, reps)
        moved = max(math.prod(x.local_shape) * (p - 1) // p, 1) * 4
        feats.append([p - 1, moved])
        times.append(t)
    return _fit(feats, times)


def _compute(comm: MPI.Comm) -> tuple[float, float]:
    a = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    t = _median_time(lambda: a @ a, comm, 5)
    flops = 2 * 1024**3 / t
    big = np.ones(2**24, np.float32)
    out = np.empty_like(big)
    t = _median_time(lambda: np.copyto(out, big), comm, 5)
    return flops, 2 * big.nbytes / t


def calibrate(comm: MPI.Comm | None = None, reps: int = 5, save: bool = True,
              cache_dir: str | None = None) -> MachineProfile:
    """Measure and (on rank 0) save the profile of this machine; collective.

    Returns the same :class:`MachineProfile` on every rank.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_size() < 2:
        raise ValueError("calibration needs at least 2 ranks (run it under mpiexec -n P)")
    p2p = _p2p(comm, reps)
    ar = _allreduce(comm, reps)
    a2a = _alltoall(comm, reps)
    flops, bw = _compute(comm)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / comm.Get_size()
    profile = MachineProfile(
        name=f"this:{socket.gethostname()}",
        p2p_alpha=p2p[0], p2p_beta=p2p[1], allreduce_alpha=ar[0], allreduce_beta=ar[1],
        alltoall_alpha=a2a[0], alltoall_beta=a2a[1], peak_flops=flops, efficiency=1.0,
        mem_bandwidth=bw, memory_per_rank=mem, cores_per_node=os.cpu_count() or 1,
        measured=True,
        notes=f"calibrated with {comm.Get_size()} ranks on {time.strftime('%Y-%m-%d %H:%M')}",
    )
    if save and comm.Get_rank() == 0:
        profile.save(this_machine_path(cache_dir))
    return comm.bcast(profile, root=0)
