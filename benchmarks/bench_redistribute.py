"""Redistribution vs a raw MPI Alltoall(v) of the same bytes.

Run: mpiexec -n P python benchmarks/bench_redistribute.py [--reps 20]

float32 (N, C, H, W) arrays move between layouts whose contiguous runs are
large (N-split -> H-split: whole H-slabs of W) or small (H-split -> W-split:
runs of W/P elements, 256 bytes for W = 128 at 2 ranks), on blocks from
1 MiB to 64 MiB, with and without allocating the output. The baseline,
measured in the same run and interleaved with ours, is ``Alltoallv`` of
contiguous, preallocated buffers holding exactly the bytes each pair of ranks
exchanges (``Alltoall`` when they are equal): no gathering of the pieces out
of, or scattering into, the arrays. The target is disttensor <= 1.3x raw for
every layout. A second baseline, ``raw_pack``, is what a program written
directly with NumPy and mpi4py must do at the least: copy each piece out of
the array into the contiguous send buffer, the same ``Alltoallv``, copy each
received piece into the output, and copy the piece a rank keeps; its parts
(``pack``, ``unpack``, ``keep``: the copies alone) are timed too, so that a
miss shows where the time goes. Every time is the median of ``--reps``
samples (each the slowest rank's) with its min-max range.
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import interleaved_stats, print_table, timing_columns, write_json
from mpi4py import MPI

import disttensor as dt

# name, global shape, source split dim, target split dim
CASES = [
    ("N->H large runs", (16, 64, 128, 128), 0, 2),
    ("H->W 256B runs", (16, 64, 128, 128), 2, 3),
    ("N->H small", (4, 16, 64, 64), 0, 2),
    ("H->W small", (4, 16, 64, 64), 2, 3),
    ("C->H", (8, 64, 64, 64), 1, 2),
    ("W->N", (8, 32, 128, 128), 3, 0),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p = comm.size
    grid = dt.ProcessGrid((p,))
    rows = []
    for name, shape, sd, td in CASES:
        src_axes, dst_axes = [None] * 4, [None] * 4
        src_axes[sd], dst_axes[td] = 0, 0
        src = dt.Distribution(shape, grid, axes=tuple(src_axes))
        dst = dt.Distribution(shape, grid, axes=tuple(dst_axes))
        x = dt.random.default_rng(0).random(src, np.float32)
        plan = dt.redistribution_plan(src, dst)
        try:
            methods = {m: dt.redistribution_plan(src, dst, m) for m in ("pack", "datatype")}
        except TypeError:  # a version with one method (Alltoallw with datatypes)
            methods = {"pack": plan, "datatype": plan}
        out = dt.DistArray.empty(dst, np.float32)
        # the bytes each pair exchanges, from the plan-independent block intersections
        me = comm.rank
        scounts = [0 if r == me else _size(src.intersection(dst, me, r)) for r in range(p)]
        rcounts = [0 if r == me else _size(src.intersection(dst, r, me)) for r in range(p)]
        sbuf = np.ones(max(1, sum(scounts)), np.float32)
        rbuf = np.empty(max(1, sum(rcounts)), np.float32)
        sdis = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(int).tolist()
        rdis = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).astype(int).tolist()
        raw_pack = _RawPack(comm, src, dst, x.local, out.local, sbuf, rbuf,
                            (scounts, sdis), (rcounts, rdis))
        raw_pack()  # the baseline must move the same data as ours
        ok = np.array_equal(out.local, plan(x).local)
        if not comm.allreduce(ok, op=MPI.LAND):
            raise RuntimeError(f"{name}: the hand-written baseline moved the wrong data")
        m = max(sd, td)  # pieces are contiguous below the later split dimension
        run = 4 * int(np.prod(shape[m + 1:])) * (shape[m] // p)
        t = interleaved_stats({
            "disttensor_out": lambda plan=plan, x=x, out=out: plan(x, out),
            "disttensor_alloc": lambda plan=plan, x=x: plan(x),
            "pack_out": lambda plan=methods["pack"], x=x, out=out: plan(x, out),
            "datatype_out": lambda plan=methods["datatype"], x=x, out=out: plan(x, out),
            "raw_alltoallv": lambda s=(sbuf, scounts, sdis), r=(rbuf, rcounts, rdis):
                comm.Alltoallv([s[0], (s[1], s[2]), MPI.FLOAT], [r[0], (r[1], r[2]), MPI.FLOAT]),
            "raw_pack": raw_pack,
            "pack": raw_pack.pack,
            "unpack": raw_pack.unpack,
            "keep": raw_pack.keep,
        }, comm, args.reps)
        sent = comm.allreduce(4 * sum(scounts), op=MPI.MAX)
        row = {"layout": name, "shape": "x".join(map(str, shape)), "ranks": p,
               "run_bytes": run, "max_bytes_sent_per_rank": sent,
               "method": getattr(plan, "method", "datatype")}
        for k in ("disttensor_out", "disttensor_alloc", "pack_out", "datatype_out",
                  "raw_alltoallv", "raw_pack", "pack", "unpack", "keep"):
            row.update(timing_columns(k, t[k]))
        raw = t["raw_alltoallv"]["median"]
        row["ratio_out"] = t["disttensor_out"]["median"] / raw
        row["ratio_alloc"] = t["disttensor_alloc"]["median"] / raw
        row["ratio_pack"] = t["pack_out"]["median"] / raw
        row["ratio_datatype"] = t["datatype_out"]["median"] / raw
        row["ratio_vs_raw_pack"] = t["disttensor_out"]["median"] / t["raw_pack"]["median"]
        rows.append(row)
    if comm.rank == 0:
        print(f"redistribution, float32, {p} ranks, median of {args.reps} (range min-max), "
              "microseconds; out: into a preallocated output, alloc: allocating it")
        cols = ["layout", "shape", "run_bytes", "max_bytes_sent_per_rank", "method",
                "disttensor_out_us", "disttensor_out_range_us", "disttensor_alloc_us",
                "raw_alltoallv_us", "raw_alltoallv_range_us", "ratio_out", "ratio_alloc",
                "ratio_pack", "ratio_datatype"]
        print_table(rows, cols)
        print("\nwhere the time goes: a hand-written NumPy + mpi4py redistribution "
              "(raw_pack) and its copies alone, microseconds")
        print_table(rows, ["layout", "run_bytes", "pack_us", "raw_alltoallv_us", "unpack_us",
                           "keep_us", "raw_pack_us", "disttensor_out_us",
                           "ratio_vs_raw_pack"])
        print("wrote", write_json(f"redistribute_p{p}", rows, reps=args.reps))


class _RawPack:
    """A redistribution written directly with NumPy and mpi4py (a baseline).

    Calling it copies each piece this rank sends into ``sbuf`` (rank order),
    exchanges with ``Alltoallv``, copies each received piece from ``rbuf`` into
    ``out`` and copies the piece this rank keeps; ``pack``, ``unpack`` and
    ``keep`` run those copies alone.
    """

    def __init__(self, comm, src, dst, x, out, sbuf, rbuf, send, recv) -> None:
        me, p = comm.rank, comm.size
        self.comm, self.sbuf, self.rbuf, self.send, self.recv = comm, sbuf, rbuf, send, recv
        self.packs, self.unpacks, self.keeps = [], [], []
        for r in range(p):
            for mine, counts, disp, bufs, arr, src_side in (
                    (src, send[0], send[1], self.packs, x, True),
                    (dst, recv[0], recv[1], self.unpacks, out, False)):
                inter = src.intersection(dst, me, r) if src_side else src.intersection(dst, r, me)
                if inter is None or r == me:
                    continue
                view = arr[_local(inter, mine.local_start(me))]
                buf = (sbuf if src_side else rbuf)[disp[r]:disp[r] + counts[r]]
                bufs.append((view, buf.reshape(view.shape)))
        inter = src.intersection(dst, me, me)
        if inter is not None:
            self.keeps.append((out[_local(inter, dst.local_start(me))],
                               x[_local(inter, src.local_start(me))]))

    def pack(self) -> None:
        for view, buf in self.packs:
            np.copyto(buf, view)

    def unpack(self) -> None:
        for view, buf in self.unpacks:
            np.copyto(view, buf)

    def keep(self) -> None:
        for dst, src in self.keeps:
            np.copyto(dst, src)

    def __call__(self) -> None:
        self.pack()
        s, r = self.send, self.recv
        self.comm.Alltoallv([self.sbuf, (s[0], s[1]), MPI.FLOAT],
                            [self.rbuf, (r[0], r[1]), MPI.FLOAT])
        self.unpack()
        self.keep()


def _local(inter, start) -> tuple[slice, ...]:
    """Global slices ``inter`` made local to a block starting at ``start``."""
    return tuple(slice(s.start - o, s.stop - o) for s, o in zip(inter, start))


def _size(inter) -> int:
    if inter is None:
        return 0
    return int(np.prod([s.stop - s.start for s in inter]))


if __name__ == "__main__":
    main()
