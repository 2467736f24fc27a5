"""A short training run on the GPU against the same run on the CPU (``gpu_check.sh`` runs it).

Run under ``mpiexec -n P`` on a machine with an NVIDIA GPU and CuPy (the ranks
of a node share its GPUs, one each in turn)::

    mpiexec -n 2 python benchmarks/gpu_train_check.py [--model mesh-demo] [--steps 20]
        [--batch 4] [--size 64x64] [--out PATH]
    python benchmarks/gpu_train_check.py --dry-run    # CPU only: array_api_strict stands in

It trains the same model twice from the same seed and the same plan (the
plan of the built-in ``v100-nvlink-edr`` profile, so that both runs split the
layers alike): first with NumPy on the CPU cores, then with CuPy
(``disttensor.use_device("gpu")``), and compares the loss after every step.
Both are float32; the losses must agree within ``--rtol`` (default 1e-3,
relative, after 20 steps of SGD). The JSON (``--out``; by default
``$OUT/gpu_train_<P>ranks.json`` when ``$OUT`` is set) holds both loss
curves, the largest relative difference, and the median time per step of
each run (the GPU one after its first, warm-up step). Exit status 0 when the
losses agree, 1 when they do not, 2 for a setup problem (no CuPy, no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np
from mpi4py import MPI

from disttensor import use_device
from disttensor_nn.training.driver import SetupError, TrainConfig, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mesh-demo")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--size", default="64x64", help="input spatial size, e.g. 64x64")
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--out", help="JSON file (default: $OUT/gpu_train_<P>ranks.json)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: train the second run on array_api_strict instead of CuPy")
    a = p.parse_args(argv)
    if a.steps < 2 or a.batch < 1:
        p.error("--steps must be at least 2 and --batch at least 1")
    try:
        a.size = tuple(int(v) for v in a.size.lower().split("x"))
    except ValueError:
        p.error(f"--size {a.size!r}: expected e.g. 64x64")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    comm = MPI.COMM_WORLD
    root = comm.Get_rank() == 0
    if a.dry_run:
        import array_api_strict as device_xp  # the CPU stand-in for a GPU library
    else:
        try:
            device_xp = use_device("gpu", comm)
        except RuntimeError as exc:  # raised alike on every rank
            if root:
                print(f"gpu_train_check: {exc}", file=sys.stderr)
            return 2
    runs = {}
    for name, xp in (("cpu", None), ("gpu", device_xp)):
        cfg = TrainConfig(model=a.model, batch=a.batch, steps=a.steps, size=a.size,
                          samples=4 * a.batch, metrics=None, progress=False,
                          machine="v100-nvlink-edr")
        try:
            runs[name] = train(cfg, comm, xp=xp)
        except SetupError as exc:
            if root:
                print(f"gpu_train_check: {name} run: {exc}", file=sys.stderr)
            return 2
    cpu, gpu = (np.asarray(runs[k]["history"]) for k in ("cpu", "gpu"))
    rel = float(np.max(np.abs(gpu - cpu) / np.maximum(np.abs(cpu), 1e-12)))
    ok = rel <= a.rtol
    result = {
        "host": platform.node(), "ranks": comm.Get_size(), "model": a.model,
        "batch": a.batch, "size": list(a.size), "steps": a.steps,
        "device_module": getattr(device_xp, "__name__", str(device_xp)), "dry_run": a.dry_run,
        "loss_cpu": cpu.tolist(), "loss_gpu": gpu.tolist(),
        "max_relative_difference": rel, "rtol": a.rtol, "losses_agree": ok,
        "ms_per_step_cpu": 1e3 * runs["cpu"]["compute_time_per_iteration_s"],
        "ms_per_step_gpu": 1e3 * runs["gpu"]["compute_time_per_iteration_s"],
    }
    if root:
        out = a.out or os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                    f"gpu_train_{comm.Get_size()}ranks.json")
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{a.model} {a.size} batch {a.batch}, {comm.Get_size()} rank(s), {a.steps} steps: "
              f"loss {cpu[0]:.5f} -> {cpu[-1]:.5f} (CPU), {gpu[0]:.5f} -> {gpu[-1]:.5f} "
              f"({result['device_module']}); largest relative difference {rel:.2e} "
              f"({'within' if ok else 'OVER'} {a.rtol:g}); ms per step CPU "
              f"{result['ms_per_step_cpu']:.1f}, device {result['ms_per_step_gpu']:.1f}; "
              f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
