"""GPU convolution kernels (CuPy: cuDNN and im2col + cuBLAS) vs torch.nn.functional.conv2d.

Run on a machine with an NVIDIA GPU and CuPy (``benchmarks/gpu_check.sh`` does)::

    python benchmarks/bench_gpu.py [--reps 10] [--batch 32] [--layers NAME,...]
        [--dtype float32] [--out PATH]
    python benchmarks/bench_gpu.py --dry-run      # CPU only: tiny shapes, NumPy, 1 rep

Layers (as ``bench_conv.py``, ResNet-50 at ``--batch``): conv1 7x7/2, the
3x3 convolutions at 56/28/14/7 (64..512 channels), a 1x1 256->64 at 56, and
the mesh model's layers at batch 1: 16->16 3x3 at 1024x1024 and its first
layer, 18->128 5x5 stride 2 at 2048x2048. Every kernel gets the already
padded input, as the distributed layers give it; torch gets the same input
with ``padding=0``.

Per layer and variant the median over ``--reps`` of forward alone and of
forward + backward (dx, dw, db), timed with CUDA events around each call
after two untimed ones:

* ``cudnn``: :mod:`disttensor_nn.kernels.cupy_kernels` with cuDNN (only when
  the ``cudnn`` frontend is importable; the ``path`` column says whether
  cuDNN served the layer or it fell back to im2col);
* ``im2col``: the same module with cuDNN switched off (im2col + cuBLAS);
* ``torch``: ``torch.nn.functional.conv2d`` forward, and forward + autograd
  backward, on the same GPU, when torch with CUDA is importable.

``ratio_*`` is torch's time over ours (above 1: ours is faster). The JSON
(``--out``; by default ``$OUT/bench_gpu.json`` when ``$OUT`` is set, else
``benchmarks/results/bench_gpu.json``) is rewritten after every layer, so a
failure later on leaves the figures measured so far; a layer that fails
(e.g. out of memory) gets an ``error`` entry and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import CONV_LAYERS as LAYERS  # noqa: E402  (the benchmarks' folder)

DRY_SCALE = 8  # --dry-run: spatial sizes 8x smaller, batch 2, channels at most 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (median)")
    p.add_argument("--batch", type=int, default=32, help="batch size of the ResNet layers")
    p.add_argument("--layers", default="", help="comma-separated layer names (default: all)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16"])
    p.add_argument("--out", default="", help="JSON output path")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU only: tiny shapes through the generic kernels on NumPy, 1 rep")
    args = p.parse_args(argv)
    names = [n for n, *_ in LAYERS]
    args.layers = [s for s in args.layers.split(",") if s] or names
    unknown = [s for s in args.layers if s not in names]
    if unknown:
        p.error(f"unknown layers {unknown}; choose from {names}")
    if args.dry_run:
        args.reps = 1
    return args


def out_path(args: argparse.Namespace) -> str:
    if args.out:
        return args.out
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "bench_gpu.json")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_gpu.json")


def shapes(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for name, n, c, h, f, k, s, pad in LAYERS:
        if name not in args.layers:
            continue
        n = args.batch if name.startswith("resnet") else n  # --batch for the ResNet layers
        if args.dry_run:
            n, c, f, h = min(n, 2), min(c, 16), min(f, 16), max(k + 1, h // DRY_SCALE)
        o = (h + 2 * pad - k) // s + 1
        out.append(dict(layer=name, n=n, c=c, h=h, f=f, k=k, stride=s, pad=pad,
                        gflop_fwd=2 * n * f * c * k * k * o * o / 1e9))
    return out


def write(path: str, rows: list[dict[str, Any]], info: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"info": info, "rows": rows}, fh, indent=2)
    os.replace(tmp, path)


class Timer:
    """Median seconds of a callable: CUDA events on a GPU, the host clock on NumPy."""

    def __init__(self, xp: Any, reps: int):
        self.xp, self.reps = xp, reps
        self.gpu = xp.__name__ == "cupy"

    def __call__(self, fn: Callable[[], Any], events: Any = None) -> float:
        events = events or (self.xp.cuda.Event if self.gpu else None)
        for _ in range(2 if self.reps > 1 else 0):
            fn()
        times = []
        for _ in range(self.reps):
            if events is not None:
                start, end = events(), events()
                start.record()
                fn()
                end.record()
                end.synchronize()
                ms = (self.xp.cuda.get_elapsed_time(start, end) if self.gpu and
                      events is self.xp.cuda.Event else start.elapsed_time(end))
                times.append(ms / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def torch_calls(torch: Any, x: Any, w: Any, b: Any, dy: Any, stride: int
                ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """torch's conv2d forward (no grad) and forward + backward on the same device arrays."""
    tx = torch.as_tensor(x, device="cuda").requires_grad_(True)
    tw = torch.as_tensor(w, device="cuda").requires_grad_(True)
    tb = torch.as_tensor(b, device="cuda").requires_grad_(True)
    tdy = torch.as_tensor(dy, device="cuda")
    conv = torch.nn.functional.conv2d

    def fwd():
        with torch.no_grad():
            return conv(tx, tw, tb, stride=stride)

    def fwdbwd():
        tx.grad = tw.grad = tb.grad = None
        conv(tx, tw, tb, stride=stride).backward(tdy)

    return fwd, fwdbwd


def bench_layer(spec: dict[str, Any], xp: Any, K: Any, dtype: np.dtype, timer: Timer,
                torch: Any, variants: list[str]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    n, c, h, f, k, s, pad = (spec[key] for key in ("n", "c", "h", "f", "k", "stride", "pad"))
    hp = h + 2 * pad
    x = xp.asarray(rng.standard_normal((n, c, hp, hp), dtype=np.float32).astype(dtype))
    w = xp.asarray((rng.standard_normal((f, c, k, k), dtype=np.float32) / math.sqrt(c * k * k))
                   .astype(dtype))
    b = xp.asarray(rng.standard_normal(f, dtype=np.float32).astype(dtype))
    st, dil = (s, s), (1, 1)
    y = K.conv_forward(x, w, b, st, dil)
    dy = xp.asarray(rng.standard_normal(y.shape, dtype=np.float32).astype(dtype))
    row = dict(spec)
    for variant in variants:
        if variant in ("cudnn", "im2col"):
            if hasattr(K, "use_cudnn"):
                K.use_cudnn = variant == "cudnn"
            before = dict(getattr(K, "calls", {}))
            row[f"{variant}_fwd_ms"] = 1e3 * timer(lambda: K.conv_forward(x, w, b, st, dil))
            row[f"{variant}_fwdbwd_ms"] = 1e3 * timer(lambda: (
                K.conv_forward(x, w, b, st, dil), K.conv_backward(dy, x, w, st, dil)))
            after = dict(getattr(K, "calls", {}))
            used = [p for p in ("cudnn", "im2col") if after.get(p, 0) > before.get(p, 0)]
            row[f"{variant}_path"] = "+".join(used) or "numpy-generic"
        elif variant == "torch":
            fwd, fwdbwd = torch_calls(torch, x, w, b, dy, s)
            ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
            row["torch_fwd_ms"] = 1e3 * timer(fwd, ev)
            row["torch_fwdbwd_ms"] = 1e3 * timer(fwdbwd, ev)
    for variant in variants:
        if variant != "torch" and "torch_fwd_ms" in row:
            for d in ("fwd", "fwdbwd"):
                row[f"ratio_{variant}_{d}"] = row[f"torch_{d}_ms"] / row[f"{variant}_{d}_ms"]
        if f"{variant}_fwdbwd_ms" in row:
            row[f"{variant}_fwdbwd_gflops"] = 3 * spec["gflop_fwd"] / (
                row[f"{variant}_fwdbwd_ms"] / 1e3)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = out_path(args)
    info: dict[str, Any] = {"benchmark": "bench_gpu", "host": platform.node(),
                            "python": platform.python_version(), "dtype": args.dtype,
                            "reps": args.reps, "batch": args.batch, "dry_run": args.dry_run,
                            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    rows: list[dict[str, Any]] = []
    torch = None
    if args.dry_run:
        from disttensor_nn.kernels import xp_kernels as K

        xp = np
        variants = ["im2col"]
    else:
        try:
            import cupy as xp

            xp.cuda.runtime.getDeviceCount()
        except Exception as exc:
            info["error"] = f"CuPy with a GPU is needed (pip install cupy-cuda12x): {exc}"
            print(info["error"], file=sys.stderr)
            write(path, rows, info)
            return 2
        from disttensor_nn.kernels import cupy_kernels as K

        variants = (["cudnn"] if K.cudnn_available() else []) + ["im2col"]
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.runtime.getDevice())
        info.update(gpu=props["name"].decode() if isinstance(props["name"], bytes)
                    else str(props["name"]), cupy=xp.__version__,
                    cudnn_frontend=K.cudnn_available())
        if not args.no_torch:
            try:
                import torch

                if not torch.cuda.is_available():
                    raise RuntimeError("torch has no CUDA device")
                variants.append("torch")
                info.update(torch=torch.__version__,
                            torch_cudnn_allow_tf32=bool(torch.backends.cudnn.allow_tf32))
            except Exception as exc:
                torch = None
                info["torch"] = f"not used: {exc}"
    info["variants"] = variants
    timer = Timer(xp, args.reps)
    dtype = np.dtype(args.dtype)
    status = 0
    for spec in shapes(args):
        try:
            row = bench_layer(spec, xp, K, dtype, timer, torch, variants)
        except Exception as exc:  # out of memory, an unsupported shape: record it and go on
            traceback.print_exc()
            row = dict(spec, error=f"{type(exc).__name__}: {exc}")
            status = 1
        rows.append(row)
        write(path, rows, info)
        if not args.dry_run and hasattr(xp, "get_default_memory_pool"):
            xp.get_default_memory_pool().free_all_blocks()
    cols = ["layer", "n", "c", "h", "f", "k", "stride"]
    for v in variants:
        cols += [f"{v}_fwd_ms", f"{v}_fwdbwd_ms"]
    cols += [c for v in variants if v != "torch" and "torch" in variants
             for c in (f"ratio_{v}_fwdbwd",)]
    print_table(rows, cols)
    print(f"wrote {path}")
    return status


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))

    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(wd) for c, wd in zip(columns, widths)))
    print("  ".join("-" * wd for wd in widths))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(wd) for c, wd in zip(columns, widths)))


if __name__ == "__main__":
    sys.exit(main())
