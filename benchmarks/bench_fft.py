"""Distributed 3-D FFT (``disttensor.ops.fft.fftn``) vs NumPy on one rank and raw MPI.

Run: mpiexec -n P python benchmarks/bench_fft.py [--n 256] [--reps 5]

complex128 arrays of ``n^3`` elements (and an uneven shape near it) are
transformed slab-split (dimension 0 over P ranks) and pencil-split
(dimensions 0 and 1 over the balanced 2-D grid ``sorted(MPI.Compute_dims(P,
2))``: (1, 2) at 2 ranks, which is a slab along dimension 1; (2, 2) at 4).
Measured in the same run, interleaved:

* ``fftn`` with the default output layout (the input's) and with
  ``out_dist="transposed"`` (no final move, as mpi4py-fft leaves a forward
  transform);
* its parts: the plan's redistributions alone (``moves``), each stage's
  local ``numpy.fft`` calls alone (``local_fft``), and a raw MPI
  ``Alltoallv`` of exactly the bytes each redistribution exchanges between
  each pair of ranks, from contiguous preallocated buffers (``raw_a2a``);
* ``numpy.fft.fftn`` of the whole array on rank 0 while the other ranks
  sleep (``numpy_1rank``).

mpi4py-fft (the peer) is timed on the same decomposition when importable;
otherwise the table says "mpi4py-fft: not importable". Times are medians
of ``--reps`` samples (each the slowest rank's) with min-max ranges, in
milliseconds; JSON goes to ``benchmarks/results/bench_fft_P.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from _common import interleaved_stats, print_table, write_json
from mpi4py import MPI

import disttensor as dt
from disttensor.ops.fft import Transform, fft_plan, fftn
from disttensor.redistribute import redistribution_plan

try:
    from mpi4py_fft import PFFT, newDistArray
except ImportError:  # the optional peer
    PFFT = None


def _sleep_wait(comm: MPI.Comm) -> None:
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def numpy_one_rank(a_shape: tuple[int, ...], comm: MPI.Comm, reps: int) -> dict[str, float]:
    """numpy.fft.fftn of the whole array on rank 0, the others sleeping (not spinning)."""
    times = []
    if comm.rank == 0:
        a = np.random.default_rng(0).standard_normal(a_shape) + 0j
        np.fft.fftn(a)
        for _ in range(reps):
            t0 = time.perf_counter()
            np.fft.fftn(a)
            times.append(time.perf_counter() - t0)
        del a
    _sleep_wait(comm)
    times = comm.bcast(times, root=0)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def _raw_alltoallv(src: dt.Distribution, dst: dt.Distribution, comm: MPI.Comm):
    """A raw Alltoallv of the bytes each pair exchanges in src -> dst (self excluded)."""
    me, p = comm.rank, comm.size
    size = [0] * p
    rsize = [0] * p
    for r in range(p):
        if r != me:
            s = src.intersection(dst, me, r)
            size[r] = 0 if s is None else int(np.prod([x.stop - x.start for x in s]))
            s = dst.intersection(src, me, r)
            rsize[r] = 0 if s is None else int(np.prod([x.stop - x.start for x in s]))
    sbuf = np.ones(max(1, sum(size)), np.complex128)
    rbuf = np.empty(max(1, sum(rsize)), np.complex128)
    sd = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(int).tolist()
    rd = np.concatenate([[0], np.cumsum(rsize)[:-1]]).astype(int).tolist()

    def run() -> None:
        comm.Alltoallv([sbuf, (size, sd), MPI.C_DOUBLE_COMPLEX],
                       [rbuf, (rsize, rd), MPI.C_DOUBLE_COMPLEX])
    return run, 16 * sum(size)


def case(name: str, dist: dt.Distribution, comm: MPI.Comm, reps: int) -> dict:
    x = dt.random.default_rng(1).random(dist, np.float64).astype(np.complex128)
    plan = fft_plan(dist, tuple(fftn_transforms(dist.global_shape)), None)
    tplan = fft_plan(dist, tuple(fftn_transforms(dist.global_shape)), "transposed")
    # the parts of the default plan: its redistributions and its local transforms
    moves, raws, locals_ = [], [], []
    cur = dist
    sent = 0
    for s in plan.stages:
        if s.before != cur:
            moves.append((redistribution_plan(cur, s.before),
                          dt.DistArray.empty(cur, np.complex128)))
            run, nbytes = _raw_alltoallv(cur, s.before, comm)
            raws.append(run)
            sent += nbytes
        locals_.append((s.transforms, np.ones(s.before.local_shape(), np.complex128)))
        cur = s.after
    if plan.out_dist != cur:
        moves.append((redistribution_plan(cur, plan.out_dist),
                      dt.DistArray.empty(cur, np.complex128)))
        run, nbytes = _raw_alltoallv(cur, plan.out_dist, comm)
        raws.append(run)
        sent += nbytes

    def run_moves() -> None:
        for p, a in moves:
            p(a)

    def run_raw() -> None:
        for r in raws:
            r()

    def run_local() -> None:
        for ts, a in locals_:
            for t in ts:
                a = np.fft.fft(a, n=t.n, axis=t.axis)

    fns = {
        "fftn": lambda: fftn(x),
        "fftn_transposed": lambda: fftn(x, out_dist="transposed"),
        "moves": run_moves,
        "raw_a2a": run_raw,
        "local_fft": run_local,
    }
    if PFFT is not None and dist.ndim == 3:
        peer = _peer(dist, comm)
        if peer is not None:
            fns["mpi4py_fft"] = peer
    stats = interleaved_stats(fns, comm, reps, warmup=1)
    ok = _check(x, comm)
    row = {"case": name, "shape": "x".join(map(str, dist.global_shape)), "ranks": comm.size,
           "grid": "x".join(map(str, dist.grid_shape)), "axes": str(dist.axes),
           "moves": len(moves), "moves_transposed": tplan.redistributions,
           "max_bytes_sent_per_rank": comm.allreduce(sent, op=MPI.MAX), "correct": ok}
    for k, v in stats.items():
        row[f"{k}_ms"] = 1e3 * v["median"]
        row[f"{k}_range_ms"] = f"{1e3 * v['min']:.4g}-{1e3 * v['max']:.4g}"
    return row


def fftn_transforms(shape: tuple[int, ...]) -> list[Transform]:
    """The 1-D transforms of ``fftn`` in NumPy's order (the last axis first)."""
    return [Transform(a, "fft", shape[a]) for a in reversed(range(len(shape)))]


def _check(x: dt.DistArray, comm: MPI.Comm) -> bool:
    """fftn against numpy.fft.fftn on the gathered array (on rank 0), for this very input."""
    y = fftn(x)
    g_in, g_out = x.to_global(root=0), y.to_global(root=0)
    ok = True
    if comm.rank == 0:
        ok = bool(np.allclose(g_out, np.fft.fftn(g_in), rtol=1e-9, atol=1e-6))
    return bool(comm.bcast(ok, root=0))


def _peer(dist: dt.Distribution, comm: MPI.Comm):  # pragma: no cover - needs mpi4py-fft
    split = [d for d in range(3) if dist.nblocks[d] > 1]
    if dist.splits != (None,) * 3 or not split:
        return None  # mpi4py-fft takes balanced blocks only
    fft_obj = PFFT(comm, dist.global_shape, axes=(0, 1, 2), dtype=np.complex128,
                   grid=[dist.nblocks[d] if d in split else 1 for d in range(3)][:len(split) + 1]
                   if len(split) > 1 else None, slab=len(split) == 1)
    u = newDistArray(fft_obj, False)
    u[:] = 1.0
    return lambda: fft_obj.forward(u)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p, n = comm.size, args.n
    g1 = dt.ProcessGrid((p,))
    g2 = dt.ProcessGrid(sorted(MPI.Compute_dims(p, 2)))
    un = (n - 3, n, n + 2)
    cuts0 = [un[0] * (i + 1) // g2.shape[0] - 5 for i in range(g2.shape[0] - 1)]
    cuts1 = [un[1] * (i + 1) // g2.shape[1] + 7 for i in range(g2.shape[1] - 1)]
    cases = [
        ("slab", dt.Distribution((n, n, n), g1, (0, None, None))),
        ("pencil", dt.Distribution((n, n, n), g2, (0, 1, None))),
        ("uneven pencil", dt.Distribution(un, g2, (0, 1, None), [cuts0, cuts1, None])),
    ]
    rows = []
    for name, dist in cases:
        rows.append(case(name, dist, comm, args.reps))
        rows[-1].update({f"numpy_1rank_{k}": v for k, v in
                         numpy_one_rank(dist.global_shape, comm, args.reps).items()})
        r = rows[-1]
        r["numpy_1rank_ms"] = 1e3 * r.pop("numpy_1rank_median")
        r["numpy_1rank_range_ms"] = (f"{1e3 * r.pop('numpy_1rank_min'):.4g}-"
                                     f"{1e3 * r.pop('numpy_1rank_max'):.4g}")
        r["speedup_vs_numpy"] = r["numpy_1rank_ms"] / r["fftn_ms"]
        r["speedup_transposed_vs_numpy"] = r["numpy_1rank_ms"] / r["fftn_transposed_ms"]
        r["moves_over_raw"] = r["moves_ms"] / r["raw_a2a_ms"] if r["raw_a2a_ms"] else 0.0
    if comm.rank == 0:
        print(f"3-D FFT, complex128, {p} ranks"
              + (" (oversubscribed: more ranks than cores)" if p > (
                  len(os.sched_getaffinity(0))) else ""))
        print("mpi4py-fft:", "importable" if PFFT is not None else "not importable")
        print_table(rows, ["case", "shape", "grid", "moves", "fftn_ms", "fftn_range_ms",
                           "fftn_transposed_ms", "numpy_1rank_ms", "speedup_vs_numpy",
                           "speedup_transposed_vs_numpy", "moves_ms", "raw_a2a_ms",
                           "moves_over_raw", "local_fft_ms", "correct"]
                   + (["mpi4py_fft_ms"] if "mpi4py_fft_ms" in rows[0] else []))
        path = write_json(f"bench_fft_{p}", rows, n=n, reps=args.reps,
                          mpi4py_fft="importable" if PFFT is not None else "not importable")
        print("wrote", path)


if __name__ == "__main__":
    main()
