"""Local convolution kernels (NumPy im2col + GEMM) vs torch.nn.functional.conv2d.

Run (one process; unset the OpenBLAS overrides for this command only):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_conv.py
        [--threads 1,2] [--reps 5] [--quick] [--layers NAME,...] [--no-memory]

Layers: ResNet-50 shapes at batch 8 (conv1 7x7/2, the 3x3 convolutions at
56/28/14/7 and a 1x1 256->64 at 56) and the mesh model's layers at batch 1
(16->16 3x3 at 1024x1024; its first layer, 18->128 5x5 stride 2 at 2048x2048);
narrow layers (16-128 channels at 128^2-1024^2, 3x3 and 5x5 stride 2); and,
through the layer classes on one rank, BatchNorm2d, ReLU and MaxPool2d
(3, stride 2) forward+backward against the torch modules.
``--quick`` shrinks the mesh and narrow layers 4x per side and the repetitions.
With several threads ours run in the kernels' pool (one-thread BLAS) unless
``--threads-in blas``.

Each kernel call gets the already padded input, as the distributed layers
give it; torch gets the same padded input with ``padding=0``, so both do
the same arithmetic. Measured for every BLAS/torch thread count, in the same
run (medians of ``--reps``):

* our ``conv_forward`` and ``conv_forward`` + ``conv_backward`` (dx, dw, db);
* ``torch.nn.functional.conv2d`` forward (no grad) and forward + backward
  (autograd, ``requires_grad`` on input, weight and bias), with
  ``torch.set_num_threads`` equal to the BLAS thread count;
* the machine's float32 GEMM rate: a 2048x2048 ``numpy.matmul``.

The four variants run in alternating blocks (``--rounds`` of them, each an
untimed call and then ``reps / rounds`` timed ones): with several threads the
idle workers of OpenBLAS and of torch's OpenMP pool keep spinning for a while
after a call and slow down whichever library runs next, so alternating call by
call would measure that interference rather than either library.

GFLOP/s counts ``2*N*F*C/g*prod(K)*prod(O)`` per direction (fwd+bwd = 3x fwd).
``ratio`` is torch's time over ours (above 1: we are faster); the summary
gives its geometric mean and minimum over the layers.

Memory: the peak resident memory above the inputs (``VmHWM`` after resetting
it once the inputs exist) of one forward + backward of the mesh 5x5 layer, in
a fresh subprocess each for ours and torch.

Thread counts are set with threadpoolctl (BLAS) and ``torch.set_num_threads``;
torch is optional (``pip install .[bench]``): without it only our figures
and the GEMM rate are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from _common import CONV_LAYERS, print_table, write_json
from mpi4py import MPI

import disttensor as dt
import disttensor_nn as nn
from disttensor_nn.kernels import numpy_kernels as K

try:
    import torch
except ImportError:  # torch is an optional benchmark extra
    torch = None

# narrow layers (mesh-like widths and sizes): name, N, C, H (= W), F, kernel, stride, padding
NARROW_LAYERS = [
    ("narrow16_3x3_1024", 1, 16, 1024, 16, 3, 1, 1),
    ("narrow32_3x3_512", 1, 32, 512, 32, 3, 1, 1),
    ("narrow64_3x3_256", 2, 64, 256, 64, 3, 1, 1),
    ("narrow128_3x3_128", 4, 128, 128, 128, 3, 1, 1),
    ("narrow16_5x5s2_1024", 1, 16, 1024, 32, 5, 2, 2),
    ("narrow64_5x5s2_256", 2, 64, 256, 128, 5, 2, 2),
]
# element-wise and pooling layers, fwd+bwd through the layer classes: name, (N, C, H, W)
OTHER_LAYERS = [
    ("BatchNorm2d", (2, 32, 256, 256)), ("ReLU", (2, 32, 256, 256)),
    ("MaxPool2d_3s2", (8, 64, 112, 112)), ("BatchNorm2d", (8, 64, 56, 56)),
    ("ReLU", (8, 64, 56, 56)),
]
MEMORY_LAYER = "mesh_5x5s2_2048"
QUICK_SCALE = 4  # --quick: mesh layers 4x smaller per side


def layer_list(quick: bool, names: list[str] | None):
    out = []
    for name, n, c, h, f, k, s, p in CONV_LAYERS + NARROW_LAYERS:
        if names and name not in names:
            continue
        if quick and name.startswith(("mesh", "narrow")):
            h //= QUICK_SCALE
        out.append((name, n, c, h, f, k, s, p))
    return out


def make_inputs(n, c, h, f, k, s, p, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h + 2 * p, h + 2 * p), dtype=np.float32)
    w = rng.standard_normal((f, c, k, k), dtype=np.float32) / math.sqrt(c * k * k)
    b = rng.standard_normal(f, dtype=np.float32)
    o = (h + 2 * p - k) // s + 1
    dy = rng.standard_normal((n, f, o, o), dtype=np.float32)
    return x, w, b, dy


def flops(n, c, h, f, k, s, p) -> float:
    o = (h + 2 * p - k) // s + 1
    return 2.0 * n * f * c * k * k * o * o


def ours_fns(x, w, b, dy, s):
    st, dl = (s, s), (1, 1)

    def fwd():
        return K.conv_forward(x, w, b, st, dl, 1)

    def fwd_bwd():
        y = K.conv_forward(x, w, b, st, dl, 1)
        return y, K.conv_backward(dy, x, w, st, dl, 1)

    return fwd, fwd_bwd


def torch_fns(x, w, b, dy, s):
    xt = torch.from_numpy(x).requires_grad_(True)
    wt = torch.from_numpy(w).requires_grad_(True)
    bt = torch.from_numpy(b).requires_grad_(True)
    dyt = torch.from_numpy(dy)
    conv = torch.nn.functional.conv2d

    def fwd():
        with torch.no_grad():
            return conv(xt, wt, bt, stride=s)

    def fwd_bwd():
        xt.grad = wt.grad = bt.grad = None
        y = conv(xt, wt, bt, stride=s)
        y.backward(dyt)
        return y

    return fwd, fwd_bwd


def layer_fns(name: str, shape: tuple[int, ...]) -> dict:
    """fwd+bwd of our layer (one rank) and of the torch module on the same data."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape, dtype=np.float32)
    ours = {"BatchNorm2d": lambda: nn.BatchNorm2d(shape[1]), "ReLU": nn.ReLU,
            "MaxPool2d_3s2": lambda: nn.MaxPool2d(3, 2, 1)}[name]()
    dist = dt.Distribution(shape, dt.ProcessGrid((1,), MPI.COMM_SELF), (0, None, None, None))
    xd = dt.DistArray.from_local(x, dist)
    dy = dt.DistArray.from_local(rng.standard_normal(ours.output_shape(shape),
                                                     dtype=np.float32),
                                 dt.Distribution(ours.output_shape(shape), dist.grid,
                                                 (0, None, None, None)))

    def fb():
        ours(xd)
        return ours.backward(dy)

    fns = {"fwd": lambda: ours(xd), "fwd_bwd": fb}
    if torch is not None:
        mod = {"BatchNorm2d": lambda: torch.nn.BatchNorm2d(shape[1]), "ReLU": torch.nn.ReLU,
               "MaxPool2d_3s2": lambda: torch.nn.MaxPool2d(3, 2, 1)}[name]()
        xt = torch.from_numpy(x).requires_grad_(True)
        dyt = torch.from_numpy(dy.local)

        def tfb():
            xt.grad = None
            mod(xt).backward(dyt)

        fns["torch_fwd"] = lambda: mod(xt)  # with autograd's graph, as in training
        fns["torch_fwd_bwd"] = tfb
    return fns


def gemm_gflops(reps: int, size: int = 2048) -> float:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)
    times = []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(times) / 1e9


def alternating_blocks(fns: dict, reps: int, rounds: int) -> dict[str, float]:
    """Median times: ``rounds`` rounds over ``fns``, each an untimed call then
    ``ceil(reps / rounds)`` timed calls of one function."""
    per = -(-reps // rounds)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            fn()
            for _ in range(per):
                t0 = time.perf_counter()
                fn()
                samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


# ------------------------------------------------------------------ memory
def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(impl: str, spec: tuple) -> None:
    """Print the peak RSS above the inputs of one fwd+bwd (runs in a fresh process)."""
    name, n, c, h, f, k, s, p = spec
    x, w, b, dy = make_inputs(n, c, h, f, k, s, p)
    fb = (ours_fns if impl == "ours" else torch_fns)(x, w, b, dy, s)[1]
    base = _vm("VmRSS")
    try:  # reset the high-water mark to the current RSS
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        reset = True
    except OSError:
        reset = False
    t0 = time.perf_counter()
    out = fb()
    dt = time.perf_counter() - t0
    peak = _vm("VmHWM")
    del out
    print(json.dumps({"impl": impl, "peak_above_inputs": peak - base, "hwm_reset": reset,
                      "inputs_bytes": x.nbytes + w.nbytes + b.nbytes + dy.nbytes,
                      "seconds": dt}))


def measure_memory(spec: tuple, threads: int) -> dict[str, dict]:
    res = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    impls = ["ours"] + (["torch"] if torch is not None else [])
    for impl in impls:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--memory-child", impl,
             "--memory-spec", json.dumps(spec)],
            capture_output=True, text=True, env=env, check=True)
        res[impl] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", default="")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--threads-in", choices=("kernels", "blas"), default="kernels")
    parser.add_argument("--memory-child", choices=["ours", "torch"])
    parser.add_argument("--memory-spec")
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, tuple(json.loads(args.memory_spec)))
        return

    from threadpoolctl import threadpool_info, threadpool_limits

    overrides = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
                 if k in os.environ}
    if overrides:
        print(f"warning: {overrides} set; OpenBLAS may use slower kernels "
              "(run under env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE)")
    blas = [(i.get("internal_api"), i.get("architecture"), i.get("version"))
            for i in threadpool_info() if i.get("user_api") == "blas"]
    names = [s for s in args.layers.split(",") if s]
    layers = layer_list(args.quick, names)
    reps = args.reps if not args.quick else min(args.reps, 3)
    rows, summary = [], {}
    loads = {}
    for nt in (int(t) for t in args.threads.split(",")):
        load0 = os.getloadavg()[0]
        # our threads: the kernels' pool with one-thread BLAS (or BLAS alone)
        pool = nt if args.threads_in == "kernels" else 1
        K.set_num_threads(pool)
        with threadpool_limits(limits=nt // pool, user_api="blas"):
            if torch is not None:
                torch.set_num_threads(nt)
            gemm = gemm_gflops(reps)
            ratios = []
            for spec in layers:
                name, n, c, h, f, k, s, p = spec
                x, w, b, dy = make_inputs(n, c, h, f, k, s, p)
                fl = flops(n, c, h, f, k, s, p)
                fns = dict(zip(("fwd", "fwd_bwd"), ours_fns(x, w, b, dy, s)))
                if torch is not None:
                    fns.update(zip(("torch_fwd", "torch_fwd_bwd"), torch_fns(x, w, b, dy, s)))
                big = fl > 20e9
                if big:
                    t = alternating_blocks(fns, min(reps, 3), 1)
                else:
                    t = alternating_blocks(fns, reps, args.rounds)
                o = (h + 2 * p - k) // s + 1
                row = {
                    "threads": nt, "layer": name,
                    "shape": f"{n}x{c}x{h}x{h}>{f} k{k}s{s}p{p}",
                    "out": f"{o}x{o}",
                    "fwd_ms": 1e3 * t["fwd"], "fwd_gflops": fl / t["fwd"] / 1e9,
                    "fb_ms": 1e3 * t["fwd_bwd"], "fb_gflops": 3 * fl / t["fwd_bwd"] / 1e9,
                    "fb_vs_gemm": 3 * fl / t["fwd_bwd"] / 1e9 / gemm,
                }
                if torch is not None:
                    row.update({
                        "torch_fwd_ms": 1e3 * t["torch_fwd"],
                        "torch_fb_ms": 1e3 * t["torch_fwd_bwd"],
                        "fwd_ratio": t["torch_fwd"] / t["fwd"],
                        "fb_ratio": t["torch_fwd_bwd"] / t["fwd_bwd"],
                    })
                    ratios.append(row["fb_ratio"])
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
            for lname, shape in [ls for ls in OTHER_LAYERS if not names or ls[0] in names]:
                if args.quick:
                    shape = shape[:2] + tuple(v // QUICK_SCALE for v in shape[2:])
                t = alternating_blocks(layer_fns(lname, shape), reps, args.rounds)
                # backward: the medians of fwd+bwd less those of fwd
                row = {"threads": nt, "layer": lname, "shape": "x".join(map(str, shape)),
                       "out": "", "fwd_ms": 1e3 * t["fwd"], "fb_ms": 1e3 * t["fwd_bwd"],
                       "bwd_ms": 1e3 * (t["fwd_bwd"] - t["fwd"])}
                if torch is not None:
                    tb = t["torch_fwd_bwd"] - t["torch_fwd"]
                    row.update({"torch_fwd_ms": 1e3 * t["torch_fwd"],
                                "torch_fb_ms": 1e3 * t["torch_fwd_bwd"],
                                "torch_bwd_ms": 1e3 * tb,
                                "fwd_ratio": t["torch_fwd"] / t["fwd"],
                                "fb_ratio": t["torch_fwd_bwd"] / t["fwd_bwd"],
                                "bwd_ratio": tb / (t["fwd_bwd"] - t["fwd"])})
                    ratios.append(row["fb_ratio"])
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
            loads[nt] = (load0, os.getloadavg()[0])
            summary[nt] = {"gemm_gflops": gemm, "loadavg_1min_before_after": loads[nt]}
            if ratios:
                summary[nt].update({
                    "fb_ratio_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
                    "fb_ratio_min": min(ratios),
                })
    memory = None
    mem_spec = next((sp for sp in layer_list(args.quick, None) if sp[0] == MEMORY_LAYER), None)
    if not args.no_memory and mem_spec is not None:
        memory = measure_memory(mem_spec, 1)

    samples = args.rounds * -(-reps // args.rounds)
    print(f"\nlocal conv kernels, float32, padded input; medians of {samples} in "
          f"{args.rounds} alternating blocks (3 in 1 for the mesh 5x5 layer); BLAS {blas}")
    cols = ["threads", "layer", "shape", "fwd_ms", "fwd_gflops", "fb_ms", "fb_gflops"]
    if torch is not None:
        cols += ["torch_fwd_ms", "torch_fb_ms", "fwd_ratio", "fb_ratio"]
    for r in rows:
        for c in cols:
            r.setdefault(c, "")
    conv_rows = [r for r in rows if r["out"] != ""]
    if conv_rows:  # none when --layers names only element-wise or pooling layers
        print_table(conv_rows, cols)
    other = [r for r in rows if r["out"] == ""]
    if other:  # element-wise and pooling layers through the layer classes
        ocols = ["threads", "layer", "shape", "fwd_ms", "bwd_ms", "fb_ms"]
        if torch is not None:
            ocols += ["torch_fwd_ms", "torch_bwd_ms", "torch_fb_ms", "fwd_ratio", "bwd_ratio",
                      "fb_ratio"]
        print("\nelement-wise and pooling layers (ratios: torch's time over ours; backward: "
              "the medians of fwd+bwd less those of fwd)")
        print_table(other, ocols)
    print()
    for nt, sm in summary.items():
        line = (f"threads={nt}: float32 GEMM 2048^2 {sm['gemm_gflops']:.1f} GFLOP/s; "
                f"load average {loads[nt][0]:.2f} -> {loads[nt][1]:.2f}")
        if "fb_ratio_geomean" in sm:
            line += (f"; fwd+bwd speed vs torch: geomean {sm['fb_ratio_geomean']:.3f}, "
                     f"min {sm['fb_ratio_min']:.3f}")
        print(line)
    if memory:
        gib = 2.0**30
        line = (f"memory, {mem_spec[0]} ({'quick-scaled ' if args.quick else ''}"
                f"{mem_spec[1]}x{mem_spec[2]}x{mem_spec[3]}^2) fwd+bwd peak above inputs: "
                f"ours {memory['ours']['peak_above_inputs'] / gib:.3f} GiB")
        if "torch" in memory:
            ours, theirs = (memory[k]["peak_above_inputs"] for k in ("ours", "torch"))
            line += f", torch {theirs / gib:.3f} GiB, ratio {ours / theirs:.2f}"
        print(line)
    name = "conv_quick" if args.quick else "conv"
    print("wrote", write_json(
        name, rows, summary={str(k): v for k, v in summary.items()}, memory=memory,
        blas=blas, openblas_overrides=overrides, reps=reps, rounds=args.rounds, quick=args.quick,
        torch=None if torch is None else torch.__version__,
        workspace_bytes=K.WORKSPACE_BYTES, tile_bytes=K.TILE_BYTES))


if __name__ == "__main__":
    main()
