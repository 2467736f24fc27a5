"""Halo exchange vs a raw mpi4py Sendrecv of the same bytes between the same ranks.

Run: mpiexec -n P python benchmarks/bench_halo.py [--reps 40] [--quick]

float32 NCHW and NCDHW arrays are split over one dimension (N, D, H or W:
every kind of face, from contiguous (N) to the most strided (W)) on P ranks,
or over H and W on a 2-D grid when P is 4. The halo of width w (1-3) of the
split dimensions is exchanged by ``HaloPlan.exchange`` (mode 'constant').
Baselines, measured in the same run, interleaved with ours:

* ``raw``: ``Sendrecv`` of contiguous, preallocated buffers holding the same
  faces, dimension by dimension in the same order (later faces include the
  earlier halos, as ours do): the same bytes between the same pairs of ranks,
  with nothing gathered out of, or scattered into, the array. The target is
  disttensor <= 1.5x raw for every face.
* ``raw_pack``: the same plus a NumPy copy of each face out of the array
  before sending and into it after receiving: the least work that actually
  fills a halo from NumPy.

``--blocks`` also times the array-in, array-out form, ``HaloPlan.exchange_block`` of
the plain block (a new extended array each call), against ``raw_block``: a new array,
the block copied into its interior, and ``raw_pack``'s messages. Where PyTorch is
installed, ``--blocks`` also times ``disttensor_nn.torch.halo_exchange`` of a CPU tensor
forward and backward (``torch_fb``: the exchange and its adjoint) against ``F.pad`` of
the same block forward and backward (``pad_fb``: the same copies, no message).

Every column is a median over ``--reps`` samples (each the slowest rank's
time) with its min-max range; the JSON holds the same.
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import interleaved_stats, print_table, timing_columns, write_json
from mpi4py import MPI

import disttensor as dt

try:  # the bench extra: only for --blocks' torch columns
    import torch
    import torch.nn.functional as F

    from disttensor_nn.torch import halo_exchange
except ImportError:  # pragma: no cover - torch not installed
    torch = None

# name, global shape, split dimensions
ARRAYS = [
    ("nchw_small", (8, 16, 32, 32)),
    ("nchw_large", (8, 64, 128, 128)),
    ("ncdhw", (2, 16, 32, 32, 32)),
]
DIM_NAMES = {4: "NCHW", 5: "NCDHW"}


def _faces(ext_shape, local_shape, dims, w):
    """Per exchanged dimension, the shape of one face (earlier dims extended, later owned)."""
    out = []
    for k, d in enumerate(dims):
        shp = list(local_shape)
        for e in dims[:k]:
            shp[e] = ext_shape[e]
        shp[d] = w
        out.append(tuple(shp))
    return out


def _face_index(ndim, dims, k, w, n_ext, side, inner):
    """Index of the face of dims[k] on ``side`` inside the extended block."""
    d = dims[k]
    n = n_ext[d] - 2 * w
    if inner:
        sl = slice(w, 2 * w) if side < 0 else slice(n, n + w)
    else:
        sl = slice(0, w) if side < 0 else slice(n + w, n + 2 * w)
    idx = [slice(None)] * ndim
    idx[d] = sl
    for e in dims[k + 1:]:
        idx[e] = slice(w, n_ext[e] - w)
    return tuple(idx)


def raw_exchange(comm, peers, bufs, ext=None, index=None):
    """Sendrecv of contiguous faces, dimension by dimension (the baseline).

    With ``ext`` the faces are also copied out of and into the extended block.
    """
    for k, (send, recv) in enumerate(bufs):
        for direction in (-1, +1):
            dst, src = peers[k][direction], peers[k][-direction]
            if ext is not None and dst is not None:
                send[...] = ext[index[k][direction, True]]
            comm.Sendrecv(
                send if dst is not None else None,
                dest=dst if dst is not None else MPI.PROC_NULL,
                recvbuf=recv if src is not None else None,
                source=src if src is not None else MPI.PROC_NULL,
            )
            if ext is not None and src is not None:
                ext[index[k][-direction, False]][...] = recv


def _block_fns(comm, plan, x, ext_shape, widths, peers, bufs, index):
    """``--blocks``' timed functions: the array-in, array-out exchange and its baselines."""
    interior = tuple(slice(lo, lo + n) for n, (lo, _) in zip(x.local_shape, widths))
    block = np.ascontiguousarray(x.local)

    def raw_block():
        e = np.empty(ext_shape, np.float32)
        e[interior] = block
        raw_exchange(comm, peers, bufs, e, index)

    fns = {"block": lambda: plan.exchange_block(block), "raw_block": raw_block}
    if torch is not None:
        t = torch.from_numpy(block.copy()).requires_grad_()
        grad = torch.ones(ext_shape)
        pad = [w for lo_hi in reversed(widths) for w in lo_hi]
        fns["torch_fb"] = lambda: halo_exchange(t, plan.dist, widths).backward(grad)
        fns["pad_fb"] = lambda: F.pad(t, pad).backward(grad)
    return fns


def cases(p: int):
    """(array name, shape, split dims, grid shape) for ``p`` ranks."""
    for name, shape in ARRAYS:
        ndim = len(shape)
        spatial = list(range(2, ndim))
        for d in [0] + spatial:
            yield name, shape, (d,), (p,)
        if p == 4:
            yield name, shape, tuple(spatial[-2:]), (2, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--widths", default="1,2,3")
    parser.add_argument("--quick", action="store_true", help="only nchw_large, widths 1 and 3")
    parser.add_argument("--blocks", action="store_true",
                        help="also exchange_block, and halo_exchange of torch tensors")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p = comm.size
    widths_list = [int(s) for s in args.widths.split(",")]
    if args.quick:
        widths_list = [1, 3]
    rows = []
    for name, shape, dims, gshape in cases(p):
        if args.quick and name != "nchw_large":
            continue
        ndim = len(shape)
        grid = dt.ProcessGrid(gshape)
        axes = [None] * ndim
        for a, d in enumerate(dims):
            axes[d] = a
        dist = dt.Distribution(shape, grid, axes=tuple(axes))
        x = dt.random.default_rng(0).random(dist, np.float32)
        local = x.local_shape
        peers = [{s: grid.neighbor(a, s) for s in (-1, 1)} for a in range(len(dims))]
        letters = DIM_NAMES[ndim]
        for w in widths_list:
            if min(local[d] for d in dims) < w:
                continue
            widths = tuple((w, w) if d in dims else (0, 0) for d in range(ndim))
            x.reserve_halo(widths)
            plan = dt.halo_plan(dist, widths, "constant")
            ext = plan.exchange(x)
            faces = _faces(ext.shape, local, dims, w)
            bufs = [(np.ones(f, np.float32), np.empty(f, np.float32)) for f in faces]
            index = [{(s, inner): _face_index(ndim, dims, k, w, ext.shape, s, inner)
                      for s in (-1, 1) for inner in (True, False)} for k in range(len(dims))]
            sent = sum(b[0].nbytes * sum(peers[k][s] is not None for s in (-1, 1))
                       for k, b in enumerate(bufs))
            sent = comm.allreduce(sent, op=MPI.MAX)
            fns = {
                "disttensor": lambda plan=plan, x=x: plan.exchange(x),
                "raw": lambda bufs=bufs, peers=peers: raw_exchange(comm, peers, bufs),
                "raw_pack": lambda bufs=bufs, ext=ext, index=index, peers=peers:
                    raw_exchange(comm, peers, bufs, ext, index),
            }
            if args.blocks:
                fns.update(_block_fns(comm, plan, x, ext.shape, widths, peers, bufs, index))
            t = interleaved_stats(fns, comm, args.reps)
            row = {"array": name, "shape": "x".join(map(str, shape)), "layout": letters,
                   "split": "".join(letters[d] for d in dims), "width": w,
                   "max_bytes_sent_per_rank": sent}
            for k in t:
                row.update(timing_columns(k, t[k]))
            row["ratio_vs_raw"] = t["disttensor"]["median"] / t["raw"]["median"]
            row["ratio_vs_raw_pack"] = t["disttensor"]["median"] / t["raw_pack"]["median"]
            rows.append(row)
    if comm.rank == 0:
        print(f"halo exchange, float32, mode 'constant', {p} ranks, median of {args.reps} "
              "(range min-max), microseconds")
        cols = ["array", "split", "width", "max_bytes_sent_per_rank", "disttensor_us",
                "disttensor_range_us", "raw_us", "raw_range_us", "raw_pack_us",
                "ratio_vs_raw", "ratio_vs_raw_pack"]
        print_table(rows, cols)
        if args.blocks:
            print("\nthe same arrays, array in and array out (microseconds)")
            block_cols = ["array", "split", "width", "block_us", "raw_block_us"]
            if torch is not None:
                block_cols += ["torch_fb_us", "pad_fb_us"]
            print_table(rows, block_cols)
        worst = max(rows, key=lambda r: r["ratio_vs_raw"])
        print(f"worst ratio vs raw: {worst['ratio_vs_raw']:.3g} "
              f"({worst['array']} split {worst['split']} width {worst['width']})")
        print("wrote", write_json(f"halo_p{p}", rows, reps=args.reps))


if __name__ == "__main__":
    main()
