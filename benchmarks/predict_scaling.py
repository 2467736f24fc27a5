"""Predicted strong scaling to 1024 GPUs, and the cost model against published figures.

Runs in one process, no MPI job needed::

    python benchmarks/predict_scaling.py [--machine v100-nvlink-edr] [--out DIR]

1. Validation: ResNet-50 v1.5 fp32 on the ``v100-dgx1`` profile against
   NVIDIA's published DeepLearningExamples figures (1 and 8 V100 16 GB,
   batch 112 per GPU, training; one GPU's inference latency by batch).
2. Predictions: for ResNet-50 (N = 32, 64, 256) and the mesh FCN at 2048^2
   (N = 1, 4, 16, 64), on 1 .. 1024 ranks, the planner's plan, the
   sample-parallel plan and ideal scaling, each step split into compute,
   exposed and hidden communication, halo exchanges overlapped with interior
   kernels (``overlap=True``). Batch norm uses per-group statistics
   (``bn_stats="group"``: the ranks sharing a sample; what data-parallel
   trainers and LBANN do); ``--bn-stats global`` shows what global
   statistics cost.
3. With ``--channel-splits``: each case planned again with channel and
   filter splits (grids over (N, C, H, W), every convolution mode), printed
   beside the sample/spatial plan with the modes it uses
   (``DIR/scaling-<model>-<N>-cf.json``). ``--max-states K`` searches each
   layer over its K most promising states from ``--max-states-from`` ranks
   on (default 512): a valid plan, priced exactly, but not proven the
   cheapest.

Writes ``DIR/validation.json``, ``DIR/scaling-<model>-<N>.json`` and a PNG per
case (``disttensor-plot``'s scaling plot), and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from disttensor_nn.models import mesh_fcn, resnet50
from disttensor_nn.plan import CostModel, Planner, builtin_profiles, predict_scaling
from disttensor_nn.training.plot import plot_scaling

RANKS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]

# NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5, DGX-1 16GB (pytorch-21.03 container)
# https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets/resnet50v1.5
PUBLISHED_TRAIN = {1: 367.0, 8: 2855.0}  # img/s, FP32, batch 112 per GPU
PUBLISHED_INFER = {8: 11.5, 16: 16.07, 32: 29.37, 64: 55.4, 128: 109.26, 256: 214.48}  # ms


def validation() -> list[dict]:
    rows = []
    model = resnet50(bn_stats="group")  # data-parallel PyTorch: each GPU's own statistics
    prof = builtin_profiles()["v100-dgx1"]
    for p, pub in PUBLISHED_TRAIN.items():
        n = 112 * p
        plan = Planner(model, (n, 3, 224, 224), CostModel(prof, p)).uniform_plan((p, 1, 1))
        pred = n / plan.time
        rows.append({"case": f"ResNet-50 training, {p} V100, batch {n}", "unit": "img/s",
                     "published": pub, "predicted": pred, "error": pred / pub - 1})
    for n, pub in PUBLISHED_INFER.items():
        plan = Planner(model, (n, 3, 224, 224), CostModel(prof, 1)).uniform_plan((1, 1, 1))
        pred = 1e3 * sum(e.fwd for e in plan.entries)  # forward kernels only
        rows.append({"case": f"ResNet-50 inference latency, 1 V100, batch {n}", "unit": "ms",
                     "published": pub, "predicted": pred, "error": pred / pub - 1})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--machine", default="v100-nvlink-edr")
    parser.add_argument("--out", default="benchmarks/results/scaling")
    parser.add_argument("--bn-stats", default="group", choices=["group", "global"])
    parser.add_argument("--cases", default="resnet50:32,resnet50:64,resnet50:256,mesh:1,"
                        "mesh:4,mesh:16,mesh:64")
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--skip-validation", action="store_true")
    parser.add_argument("--channel-splits", action="store_true",
                        help="also plan with channel and filter splits")
    parser.add_argument("--max-states", type=int, default=None,
                        help="with --channel-splits from this many ranks on (see "
                        "--max-states-from), search each layer over at most this many states "
                        "(faster, not exact)")
    parser.add_argument("--max-states-from", type=int, default=512)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ranks = [int(r) for r in args.ranks.split(",")]
    if not args.skip_validation:
        rows = validation()
        print("cost model (v100-dgx1) against NVIDIA's published ResNet-50 v1.5 fp32 figures")
        for r in rows:
            print(f"  {r['case']:<46} published {r['published']:8.2f} {r['unit']:<5} "
                  f"predicted {r['predicted']:8.2f}  {100 * r['error']:+6.1f}%")
        with open(os.path.join(args.out, "validation.json"), "w") as f:
            json.dump(rows, f, indent=1)
    for case in args.cases.split(","):
        name, n = case.split(":")
        n = int(n)
        if name == "resnet50":
            model, shape = resnet50(bn_stats=args.bn_stats, overlap=True), (n, 3, 224, 224)
        else:
            model, shape = mesh_fcn(bn_stats=args.bn_stats, overlap=True), (n, 18, 2048, 2048)
        t0 = time.perf_counter()
        rows = predict_scaling(model, shape, ranks, args.machine, measure=False)
        print(f"\n{name} N={n} on {args.machine} (bn_stats={args.bn_stats}), "
              f"planned in {time.perf_counter() - t0:.0f} s; ms per step")
        print(f"{'ranks':>6} {'planned':>9} {'compute':>9} {'exposed':>9} {'hidden':>9} "
              f"{'sample-par':>10} {'(exposed)':>9} {'ideal':>9} {'gain':>6}  grids")
        base = next((r["time_ms"] * r["ranks"] for r in rows if r["time_ms"]), None)
        for r in rows:
            if r["time_ms"] is None:
                print(f"{r['ranks']:>6} {'-':>9}  {r['note'][:90]}")
                continue
            sp = r["sample_parallel_ms"]
            spx = r["sample_parallel_split"][1] if sp else None
            gain = f"{sp / r['time_ms']:.2f}" if sp else "-"
            print(f"{r['ranks']:>6} {r['time_ms']:9.2f} {r['compute_ms']:9.2f} "
                  f"{r['exposed_ms']:9.2f} {r['hidden_ms']:9.2f} "
                  f"{(f'{sp:.2f}' if sp else '-'):>10} {(f'{spx:.2f}' if sp else '-'):>9} "
                  f"{base / r['ranks']:9.2f} {gain:>6}  {r['grids']}")
        tag = f"{name}-{n}" + ("" if args.bn_stats == "group" else "-global")
        with open(os.path.join(args.out, f"scaling-{tag}.json"), "w") as f:
            json.dump({"model": name, "batch_shape": shape, "machine": args.machine,
                       "bn_stats": args.bn_stats, "rows": rows}, f, indent=1)
        if args.channel_splits:
            t0 = time.perf_counter()
            cf = []
            for p in ranks:
                limit = args.max_states if p >= args.max_states_from else None
                cf += predict_scaling(model, shape, [p], args.machine, measure=False,
                                      channels=True, max_states=limit)
                cf[-1]["max_states"] = limit
            print(f"with channel/filter splits, planned in {time.perf_counter() - t0:.0f} s; "
                  "ms per step: time = compute + exposed communication (hidden: overlapped)")
            print(f"{'ranks':>6} | {'N/S only':>8} {'compute':>8} {'exposed':>8} {'hidden':>8} | "
                  f"{'with C/F':>8} {'compute':>8} {'exposed':>8} {'hidden':>8} | "
                  f"{'gain':>5} {'plan s':>6}  convolution modes")
            for r, c in zip(rows, cf):
                if r["time_ms"] is None or c["time_ms"] is None:
                    print(f"{r['ranks']:>6} -")
                    continue
                print(f"{r['ranks']:>6} | {r['time_ms']:8.2f} {r['compute_ms']:8.2f} "
                      f"{r['exposed_ms']:8.2f} {r['hidden_ms']:8.2f} | {c['time_ms']:8.2f} "
                      f"{c['compute_ms']:8.2f} {c['exposed_ms']:8.2f} {c['hidden_ms']:8.2f} | "
                      f"{r['time_ms'] / c['time_ms']:5.3f} {c['plan_s']:6.0f}  {c['modes']}"
                      + (f" (searched {c['max_states']} states per layer)"
                         if c["max_states"] else ""))
            with open(os.path.join(args.out, f"scaling-{tag}-cf.json"), "w") as f:
                json.dump({"model": name, "batch_shape": shape, "machine": args.machine,
                           "bn_stats": args.bn_stats, "rows": cf}, f, indent=1)
        if any(r["time_ms"] for r in rows):
            plot_scaling(rows, os.path.join(args.out, f"scaling-{tag}.png"),
                         f"{name} {shape} on {args.machine}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
