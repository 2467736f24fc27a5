"""Interpolation split over the height by ``disttensor_nn.torch.parallelize``, against
PyTorch's ``F.interpolate`` of the whole tensor in one process, forward and backward.

Integer scales run ``F.interpolate`` on each rank's block extended by a halo; other
scales (and ``align_corners=True``) as weighted sums of the rows PyTorch reads
(``disttensor_nn.torch.interpolation``). Each case's two timings alternate in one run
(medians and ranges of the slowest rank; the whole tensor's interpolation on every rank
at once, as one process would run it)::

    mpiexec -n 2 python benchmarks/bench_torch_interpolate.py --reps 15
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from _common import interleaved_stats, print_table, timing_columns, write_json
from mpi4py import MPI
from torch import nn

import disttensor as dt
from disttensor_nn.torch import parallelize

CASES = [  # (input shape, mode, scale factors, align_corners)
    ((1, 32, 256, 256), "bilinear", (2.0, 2.0), None),
    ((1, 32, 256, 256), "bilinear", (1.5, 1.5), None),
    ((1, 32, 256, 256), "bilinear", (2.0, 2.0), True),
    ((1, 32, 256, 256), "nearest", (1.5, 1.5), None),
    ((1, 16, 512, 512), "bilinear", (0.6, 0.6), None),
    ((1, 32, 128, 128), "bicubic", (1.5, 1.5), None),
    ((1, 8, 64, 64, 64), "trilinear", (1.5, 1.5, 1.5), None),
]


class Interp(nn.Module):
    def __init__(self, mode: str, scale: tuple[float, ...], corners: bool | None):
        super().__init__()
        self.mode, self.scale, self.corners = mode, scale, corners

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kw = {} if self.corners is None else {"align_corners": self.corners}
        return F.interpolate(x, scale_factor=self.scale, mode=self.mode, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    if args.reps < 1:
        if comm.rank == 0:
            print("bench_torch_interpolate: --reps must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    rows = []
    for shape, mode, scale, corners in CASES:
        model = Interp(mode, scale, corners)
        grid = (1, 1, p) + (1,) * (len(shape) - 3)
        pm = parallelize(model, shape, grid)
        torch.manual_seed(0)
        whole = torch.randn(shape)
        block = dt.DistArray.from_global(whole, pm.input_dist, xp=torch).local.clone()
        xb = block.requires_grad_()
        xw = whole.clone().requires_grad_()

        def ours(pm: nn.Module = pm, xb: torch.Tensor = xb) -> None:
            out = pm(xb)
            out.local.backward(torch.ones_like(out.local))

        def plain(model: nn.Module = model, xw: torch.Tensor = xw) -> None:
            y = model(xw)
            y.backward(torch.ones_like(y))

        stats = interleaved_stats({"split": ours, "one_process": plain}, comm, args.reps)
        rows.append({"shape": "x".join(map(str, shape)), "mode": mode,
                     "scale": "x".join(f"{s:g}" for s in scale),
                     "corners": bool(corners), "ranks": p,
                     **timing_columns("split", stats["split"]),
                     **timing_columns("one_process", stats["one_process"]),
                     "speedup": stats["one_process"]["median"] / stats["split"]["median"]})
    if comm.rank == 0:
        print_table(rows, ["shape", "mode", "scale", "corners", "ranks", "split_us",
                           "split_range_us", "one_process_us", "one_process_range_us",
                           "speedup"])
        print("wrote", write_json(f"bench_torch_interpolate_p{p}", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
