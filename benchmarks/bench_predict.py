"""Inference on one whole sample: disttensor's inference plan vs PyTorch CPU (no_grad).

Run (unset the OpenBLAS overrides for timing only):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_predict.py
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE mpiexec -n 2 python benchmarks/bench_predict.py

The mesh-demo network (mesh FCN, widths 16-24-32, 18 input channels) in
eval mode on one sample of ``--size`` (default 512x512), float32:

* ``ours``: the plan :func:`disttensor_nn.plan.make_plan` makes for an
  inference pass (``training=False``) on this job's ranks, every layer
  dropping what it saved for backward as its forward returns (what
  ``disttensor-predict`` runs);
* ``ours-keep``: the same forward without dropping (what a forward pass
  holds when backward may follow);
* ``torch``: the same network and weights in PyTorch under
  ``torch.no_grad()``, in one process (rank 0) with as many threads as the
  job has ranks (the same cores).

Times are medians and ranges over ``--reps`` interleaved runs (the slowest
rank's). Memory is the growth during one forward pass, peak minus before,
per rank (the parameters are allocated before): ours the peak of traced
allocations (``tracemalloc``, which sees NumPy's), torch's the growth of
the resident set, measured first in the process (its allocations are not
traced); ours next to the planner's prediction of it (the plan's peak
without the process baseline and the parameters). JSON goes to
``benchmarks/results/bench_predict_pN.json``.
"""

from __future__ import annotations

import argparse
import tracemalloc

import numpy as np
from _common import interleaved_stats, print_table, write_json
from bench_step import to_torch
from mpi4py import MPI

import disttensor as dt
from disttensor_nn.kernels import numpy_kernels
from disttensor_nn.memory import MemoryProfile, release_free_memory, resident_bytes
from disttensor_nn.models import mesh_fcn
from disttensor_nn.plan import apply_plan, make_plan
from disttensor_nn.plan.calibrate import calibrate_if_stale
from disttensor_nn.plan.planner import leaf_nodes, trace

try:
    import torch
except ImportError:  # torch is an optional benchmark extra
    torch = None


def rss_growth(fn, comm: MPI.Comm) -> list[float]:
    """Every rank's resident-set growth (bytes) during ``fn()``: peak minus before (run it
    before anything else, as freed memory kept by the allocator hides the growth)."""
    release_free_memory()
    comm.Barrier()
    before = resident_bytes()
    memory = MemoryProfile()
    with memory.phase("forward"):
        fn()
    return comm.allgather(memory.phases["forward"].peak - before)


def traced_growth(fn, comm: MPI.Comm) -> list[float]:
    """Every rank's peak of traced allocations (NumPy's included) during ``fn()`` above what
    was allocated before: exact, whatever the allocator keeps."""
    numpy_kernels.release_workspace()  # the convolutions' scratch, allocated again
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return comm.allgather(peak - before)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=512, help="H = W of the sample")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    dt.limit_blas_threads(comm=comm)
    if p > 1:
        calibrate_if_stale(comm)  # none yet, or taken with another number of ranks per node
    machine = "this" if p > 1 else "v100-nvlink-edr"
    shape = (1, 18, args.size, args.size)
    model = mesh_fcn(widths=(16, 24, 32), convs_per_stage=2)
    model.eval()
    model[0].input_grad = False
    params = sum(q.data.nbytes for q in model.parameters())
    tmodel = to_torch(model).eval() if torch is not None and rank == 0 else None
    plan, _ = make_plan(model, shape, p, machine, comm=comm, training=False)
    apply_plan(model, plan, shape, comm)
    first = leaf_nodes(trace(model, shape))[0].layer.layout
    x_all = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    dist = first.distribution(shape)
    x = dt.DistArray.from_local(np.ascontiguousarray(x_all[dist.local_slices()]), dist)
    handles = [layer.register_forward_hook(lambda layer, x, y: layer.release_saved())
               for _, layer in model.named_modules()]

    def ours():
        model(x)

    def keep():
        for h in handles:
            h.remove()
        try:
            model(x)
        finally:
            for _, layer in model.named_modules():
                layer.release_saved()
            handles[:] = [layer.register_forward_hook(lambda layer, x, y: layer.release_saved())
                          for _, layer in model.named_modules()]

    fns = {"ours": ours, "ours-keep": keep}
    growth = {}
    if torch is not None:
        torch.set_num_threads(p)
        tx = torch.from_numpy(x_all)

        def run_torch():
            if tmodel is not None:
                with torch.no_grad():
                    tmodel(tx)
        fns["torch"] = run_torch
        growth["torch"] = rss_growth(run_torch, comm)  # first: a fresh allocator
        if tmodel is not None:  # the same network: outputs agree
            with torch.no_grad():
                ref = tmodel(tx).numpy()
        got = model(x).to_global()
        if rank == 0:
            err = float(np.abs(got - ref).max())
            print(f"max |ours - torch| = {err:.2e}")
    stats = interleaved_stats(fns, comm, args.reps)
    growth.update({k: traced_growth(fns[k], comm) for k in ("ours", "ours-keep")})
    predicted = plan.peak_memory - params  # the plan's baseline is 0 here
    rows = []
    for k, s in stats.items():
        g = growth[k] if k != "torch" else growth[k][:1]
        rows.append({"variant": k, "ranks": p if k != "torch" else 1,
                     "threads": 1 if k != "torch" else p,
                     "ms": 1e3 * s["median"], "range_ms": f"{1e3 * s['min']:.4g}-"
                     f"{1e3 * s['max']:.4g}",
                     "growth_MiB_per_rank": "/".join(f"{v / 2**20:.1f}" for v in g),
                     "predicted_MiB": f"{predicted / 2**20:.1f}" if k == "ours" else "-"})
    if rank == 0:
        print(f"mesh-demo inference, sample {shape}, {p} rank(s), plan grids "
              f"{sorted({tuple(e.grid) for e in plan.entries})} ({machine})")
        print_table(rows, ["variant", "ranks", "threads", "ms", "range_ms",
                           "growth_MiB_per_rank", "predicted_MiB"])
        path = write_json(f"bench_predict_p{p}", rows, size=args.size, machine=machine,
                          plan=[list(e.grid) for e in plan.entries])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
