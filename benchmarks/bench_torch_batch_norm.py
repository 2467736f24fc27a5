"""Batch norm over a split batch (``disttensor_nn.torch.norm.split_batch_norm``), forward and
backward, against PyTorch's ``F.batch_norm`` on the same block and on the whole tensor.

Each case splits its tensor over the height on every rank of the job; three timings
alternate in one run (medians and ranges of the slowest rank):

* ``split``: ``split_batch_norm`` of this rank's block, the statistics of every block;
* ``block``: ``F.batch_norm`` of this rank's block alone (its own statistics: the same
  kernels' work with no message, what each rank of the strong-scaling ceiling runs);
* ``whole``: ``F.batch_norm`` of the whole tensor on every rank at once, as one process
  runs it.

The shapes are those a one-sample mesh-small step splits (8 and 16 channels at 128^2 and
64^2), smaller ones of its deeper layers, and a batch of ResNet-50's; each in C order and
channels-last::

    mpiexec -n 2 python benchmarks/bench_torch_batch_norm.py --reps 40
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from _common import interleaved_stats, print_table, timing_columns, write_json
from mpi4py import MPI

from disttensor_nn.torch.norm import split_batch_norm

SHAPES = [(1, 8, 128, 128), (1, 16, 64, 64), (1, 16, 32, 32), (1, 64, 16, 16),
          (4, 16, 128, 128), (8, 64, 56, 56)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    if args.reps < 1:
        if rank == 0:
            print("bench_torch_batch_norm: --reps must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    rows = []
    for shape in SHAPES:
        n, c, h, w = shape
        for layout in (torch.contiguous_format, torch.channels_last):
            torch.manual_seed(0)
            whole = (torch.randn(shape) * 2 + 1).contiguous(memory_format=layout)
            block = whole[:, :, h * rank // p:h * (rank + 1) // p].contiguous(
                memory_format=layout)
            xw, xb = whole.requires_grad_(), block.requires_grad_()
            gw, gb = torch.randn_like(xw), torch.randn_like(xb)
            weight = torch.rand(c).add_(0.5).requires_grad_()
            bias = torch.rand(c).requires_grad_()

            def split(xb: torch.Tensor = xb, gb: torch.Tensor = gb, count: int = n * h * w,
                      weight: torch.Tensor = weight, bias: torch.Tensor = bias) -> None:
                split_batch_norm(xb, weight, bias, comm, count)[0].backward(gb)

            def local(x: torch.Tensor, g: torch.Tensor,
                      weight: torch.Tensor = weight, bias: torch.Tensor = bias) -> None:
                F.batch_norm(x, None, None, weight, bias, True).backward(g)

            stats = interleaved_stats({"split": split,
                                       "block": lambda xb=xb, gb=gb: local(xb, gb),
                                       "whole": lambda xw=xw, gw=gw: local(xw, gw)},
                                      comm, args.reps)
            rows.append({"shape": "x".join(map(str, shape)),
                         "layout": "C" if layout == torch.contiguous_format else "CL",
                         "ranks": p, **timing_columns("split", stats["split"]),
                         **timing_columns("block", stats["block"]),
                         **timing_columns("whole", stats["whole"]),
                         "split_over_block": stats["split"]["median"]
                         / stats["block"]["median"],
                         "speedup": stats["whole"]["median"] / stats["split"]["median"]})
    if rank == 0:
        print_table(rows, ["shape", "layout", "ranks", "split_us", "split_range_us",
                           "block_us", "whole_us", "split_over_block", "speedup"])
        print("wrote", write_json(f"bench_torch_batch_norm_p{p}", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
