"""Halo exchange vs a raw mpi4py Sendrecv of the same bytes between the same ranks.

Run: mpiexec -n 4 python benchmarks/bench_halo.py [--reps 30]

A (32, 64, 56, 56) float32 array is split 2x2 over H and W; the halo of
width w (H and W only) is exchanged by ``DistArray.exchange_halo``. Two
baselines, measured in the same run:

* ``raw``: ``Sendrecv`` of contiguous, preallocated buffers holding the same
  faces, H first then W (whose faces include the H halo, as ours do): the
  same bytes between the same pairs of ranks, but no gathering of the
  strided faces out of, or into, the array.
* ``raw+pack``: the same, plus a NumPy copy of each face out of the array
  before sending and into it after receiving: the least work that actually
  fills a halo of an NCHW array split over H and W.
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import interleaved, print_table, write_json
from mpi4py import MPI

import disttensor as dt


def raw_exchange(comm, grid, w, bufs, ext=None):
    """Sendrecv of contiguous faces, dimension by dimension (the baseline).

    With ``ext`` (the extended block) faces are also copied out of and into it.
    """
    for axis in (0, 1):
        for direction in (-1, +1):
            dst = grid.neighbor(axis, direction)
            src = grid.neighbor(axis, -direction)
            send, recv = bufs[axis]
            if ext is not None and dst is not None:
                send[...] = _face(ext, axis, w, direction, inner=True)
            comm.Sendrecv(
                send if dst is not None else None,
                dest=dst if dst is not None else MPI.PROC_NULL,
                recvbuf=recv if src is not None else None,
                source=src if src is not None else MPI.PROC_NULL,
            )
            if ext is not None and src is not None:
                _face(ext, axis, w, -direction, inner=False)[...] = recv


def _face(ext, axis, w, side, inner):
    """Face of width ``w`` on ``side`` of grid ``axis`` (array dim 2 + axis) of ``ext``.

    H faces span the owned W extent, W faces the extended H extent.
    """
    d = 2 + axis
    n = ext.shape[d] - 2 * w
    if inner:
        sl = slice(w, 2 * w) if side < 0 else slice(n, n + w)
    else:
        sl = slice(0, w) if side < 0 else slice(n + w, n + 2 * w)
    idx = [slice(None)] * 4
    idx[d] = sl
    if axis == 0:
        idx[3] = slice(w, ext.shape[3] - w)
    return ext[tuple(idx)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--shape", default="32,64,56,56")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.size != 4:
        raise SystemExit("run with mpiexec -n 4")
    shape = tuple(int(s) for s in args.shape.split(","))
    grid = dt.ProcessGrid((2, 2))
    dist = dt.Distribution(shape, grid, axes=(None, None, 0, 1))
    x = dt.random.default_rng(0).random(dist, np.float32)
    n, c, h, wd = x.local_shape
    assert h >= 3 and wd >= 3, 'the baseline assumes every block is at least 3 wide'
    rows = []
    for w in (1, 3):
        widths = ((0, 0), (0, 0), (w, w), (w, w))
        x.reserve_halo(widths)
        plan = dt.halo_plan(dist, widths, "constant")
        # Same bytes as ours: H faces span the owned W extent, W faces the extended H extent.
        bufs = {
            0: (np.ones((n, c, w, wd), np.float32), np.empty((n, c, w, wd), np.float32)),
            1: (np.ones((n, c, h + 2 * w, w), np.float32),
                np.empty((n, c, h + 2 * w, w), np.float32)),
        }
        nbytes = 0
        for axis, (send, _) in bufs.items():
            nbytes += send.nbytes * sum(
                grid.neighbor(axis, s) is not None for s in (-1, 1))
        ext = plan.exchange(x)
        t = interleaved({
            "disttensor": lambda plan=plan: plan.exchange(x),
            "raw": lambda w=w, bufs=bufs: raw_exchange(comm, grid, w, bufs),
            "raw_pack": lambda w=w, bufs=bufs, ext=ext: raw_exchange(comm, grid, w, bufs, ext),
        }, comm, args.reps)
        rows.append({
            "width": w, "bytes_sent_per_rank": nbytes,
            "disttensor_ms": 1e3 * t["disttensor"], "raw_ms": 1e3 * t["raw"],
            "raw_pack_ms": 1e3 * t["raw_pack"],
            "ratio_vs_raw": t["disttensor"] / t["raw"],
            "ratio_vs_raw_pack": t["disttensor"] / t["raw_pack"],
        })
    if comm.rank == 0:
        print(f"halo exchange of {shape} float32 on a 2x2 grid (H x W), median of {args.reps}")
        print_table(rows, list(rows[0]))
        print("wrote", write_json("halo", rows, shape=shape, reps=args.reps))


if __name__ == "__main__":
    main()
