"""Arrays read and written by block (disttensor.io) against raw MPI-IO and whole-array I/O.

Run (unset the OpenBLAS overrides for timing only)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE mpiexec -n 2 python benchmarks/bench_io.py \
        [--shape 4096x4096] [--reps 7] [--dir /tmp]

A float32 array of ``--shape``, split by rows and by columns over the job's
ranks; per case the median and range (the slowest rank's) of:

* ``to_npy``: :func:`disttensor.to_npy` (MPI-IO, one collective write through
  a subarray view), against ``raw``: ``MPI_File_write_at_all`` of the same
  number of contiguous bytes per rank (what the file system gives at best),
  and ``gather+save``: ``to_global`` on rank 0 and :func:`numpy.save`;
* ``from_npy`` / ``from_hdf5`` / ``from_zarr``: the reader, against ``raw``
  (``MPI_File_read_at_all`` of the rank's number of contiguous bytes) and
  ``whole``: every rank reading the whole array with the format's own
  library and slicing its block;
* ``to_zarr``: :meth:`DistArray.to_zarr` (chunks = the blocks; uncompressed)
  against ``gather+save``: rank 0 writing the gathered array with zarr.

Files live in ``--dir`` (page cache: this measures the software path, not
a disk). JSON goes to ``benchmarks/results/bench_io_pN.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile

import h5py
import numpy as np
import zarr
from _common import interleaved_stats, print_table, write_json
from mpi4py import MPI

import disttensor as dt


def raw_write(comm: MPI.Comm, path: str, nbytes: int) -> None:
    buf = np.ones(nbytes, np.uint8)
    f = MPI.File.Open(comm, path, MPI.MODE_WRONLY | MPI.MODE_CREATE)
    f.Write_at_all(comm.Get_rank() * nbytes, buf)
    f.Close()


def raw_read(comm: MPI.Comm, path: str, nbytes: int) -> None:
    buf = np.empty(nbytes, np.uint8)
    f = MPI.File.Open(comm, path, MPI.MODE_RDONLY)
    f.Read_at_all(comm.Get_rank() * nbytes, buf)
    f.Close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    shape = tuple(int(v) for v in args.shape.split("x"))
    base = comm.bcast(tempfile.mkdtemp(dir=args.dir) if rank == 0 else None)
    grid = dt.ProcessGrid((p,))
    a = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    npy, h5, zr = (os.path.join(base, n) for n in ("a.npy", "a.h5", "a.zarr"))
    raw = os.path.join(base, "raw.bin")
    if rank == 0:
        np.save(npy, a)
        with h5py.File(h5, "w") as f:
            f["a"] = a
        zarr.create_array(store=zr, data=a, chunks=tuple(min(n, 512) for n in shape),
                          compressors=None)
        with open(raw, "wb") as f:
            f.write(a.tobytes())
    comm.Barrier()
    rows = []
    for split, axes in (("rows", (0, None)), ("columns", (None, 0))):
        x = dt.asarray(a, grid=grid, axes=axes)
        dist = x.dist
        nbytes = math.prod(dist.local_shape()) * 4
        blk = dist.local_slices()
        out_npy, out_zarr = os.path.join(base, f"o{split}.npy"), os.path.join(base, "o.zarr")
        chunks = tuple(max(b[i + 1] - b[i] for i in range(len(b) - 1)) for b in dist.boundaries)

        def gather_save_npy(x=x, out=out_npy):
            g = x.to_global(root=0)
            if rank == 0:
                np.save(out, g)

        def gather_save_zarr(x=x, chunks=chunks, out_zarr=out_zarr):
            g = x.to_global(root=0)
            if rank == 0:
                zarr.create_array(store=out_zarr + "g", data=g, chunks=chunks,
                                  compressors=None, overwrite=True)

        def whole_h5(blk=blk):
            with h5py.File(h5, "r") as f:
                f["a"][...][blk].copy()

        cases = {
            "to_npy": {"ours": lambda x=x, out=out_npy: x.to_npy(out),
                       "raw": lambda n=nbytes: raw_write(comm, raw + "w", n),
                       "gather+save": gather_save_npy},
            "from_npy": {"ours": lambda axes=axes: dt.from_npy(npy, grid=grid, axes=axes),
                         "raw": lambda n=nbytes: raw_read(comm, raw, n),
                         "whole": lambda blk=blk: np.load(npy)[blk].copy()},
            "from_hdf5": {"ours": lambda axes=axes: dt.from_hdf5(h5, "a", grid=grid, axes=axes),
                          "raw": lambda n=nbytes: raw_read(comm, raw, n),
                          "whole": whole_h5},
            "from_zarr": {"ours": lambda axes=axes: dt.from_zarr(zr, grid=grid, axes=axes),
                          "raw": lambda n=nbytes: raw_read(comm, raw, n),
                          "whole": lambda blk=blk: zarr.open_array(zr, mode="r")[...][blk]},
            "to_zarr": {"ours": lambda x=x, c=chunks, o=out_zarr: x.to_zarr(o, chunks=c),
                        "gather+save": gather_save_zarr},
        }
        for case, fns in cases.items():
            stats = interleaved_stats(fns, comm, args.reps)
            row = {"case": case, "split": split, "MiB_per_rank": nbytes / 2**20}
            for k in ("ours", "raw", "whole", "gather+save"):
                s = stats.get(k)
                row[f"{k}_ms"] = f"{1e3 * s['median']:.2f}" if s else "-"
                row[f"{k}_range_ms"] = f"{1e3 * s['min']:.3g}-{1e3 * s['max']:.3g}" if s \
                    else "-"
            base_k = "raw" if "raw" in stats else "gather+save"
            row["ours/" + base_k] = stats["ours"]["median"] / stats[base_k]["median"]
            rows.append(row)
    if rank == 0:
        cols = ["case", "split", "MiB_per_rank", "ours_ms", "ours_range_ms", "raw_ms",
                "raw_range_ms", "whole_ms", "gather+save_ms"]
        for r in rows:
            r["ratio"] = r.pop("ours/raw", None) or r.pop("ours/gather+save")
        print(f"{shape} float32 on {p} ranks, files in {base}")
        print_table(rows, [*cols, "ratio"])
        print("ratio: ours / raw (ours / gather+save for to_zarr)")
        print(f"wrote {write_json(f'bench_io_p{p}', rows, shape=list(shape))}")
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
