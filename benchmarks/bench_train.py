"""What ``disttensor-train`` prints, measured: time per iteration, compute against the
plan's prediction, the wait for data, the batch norms, and the peak memory against its
prediction, for several commands, each with the block cache and without it (or, with
``--configs fp32,bf16``, in float32 and with 16-bit activations: then the final loss
and the training peak above the process baseline compare too).

Each case is a ``disttensor-train`` command line run under ``mpiexec -n P``; the
configurations of a case run in alternation, ``--rounds`` times each, so a change in the
machine's load falls on all of them alike. Each run writes its metrics file, from which
the table takes the medians (and ranges) over the rounds. The step's compute is its
median over the steps after the first; "bn" sums the batch-norm layers' forward and
backward clocks, measured and predicted.

Examples
--------
    python benchmarks/bench_train.py                       # the default cases, 3 rounds
    python benchmarks/bench_train.py --case "2:mesh-demo --steps 12" --rounds 2
    python benchmarks/bench_train.py --case "2:mesh --size 1024x1024 --batch 1 --steps 4"
    python benchmarks/bench_train.py --case "2:mesh-demo --steps 100" --configs fp32,bf16

On this machine, for timing only: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_CASES = [
    "4:--steps 20",
    "1:mesh-demo --steps 12",
    "2:mesh-demo --steps 12",
]
CONFIGS = {"cache": [], "no-cache": ["--no-block-cache"],
           # 16-bit activations against float32 (with the block cache, as "cache" runs)
           "fp32": ["--precision", "fp32"], "bf16": ["--precision", "bf16"],
           "fp16": ["--precision", "fp16"]}
DEFAULT_CONFIGS = ("cache", "no-cache")


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def _train() -> str:
    here = Path(sys.executable).parent / "disttensor-train"
    return str(here) if here.exists() else "disttensor-train"


def run_case(ranks: int, args: list[str], extra: list[str], workdir: Path) -> dict[str, Any]:
    """One ``disttensor-train`` run; its summary (from the metrics file)."""
    prefix = workdir / "metrics"
    cmd = [_mpiexec(), "-n", str(ranks), _train(), *args, *extra, "--no-progress",
           "--metrics", str(prefix)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(f"{prefix}.json") as f:
        return json.load(f)["summary"]


def _bn(summary: dict[str, Any]) -> tuple[float, float]:
    rows = [r for r in summary["layers"] if "BatchNorm" in r["layer"]]
    return sum(r["measured_s"] for r in rows), sum(r["predicted_s"] for r in rows)


def figures(summary: dict[str, Any]) -> dict[str, float]:
    """The figures of one run that the table shows."""
    bn_measured, bn_predicted = _bn(summary)
    bc = summary.get("block_cache") or {}
    return {
        "iteration_s": summary["time_per_iteration_s"],
        "compute_s": summary["compute_time_per_iteration_s"],
        "predicted_s": summary["predicted_time_per_iteration_s"],
        "data_s": summary["data_time_per_iteration_s"],
        "bn_s": bn_measured,
        "bn_predicted_s": bn_predicted,
        "peak_mib": summary["training_peak_memory_per_rank_bytes"] / 2**20,
        # as disttensor_nn.training.loop.predicted_training_peak (not imported: this process
        # starts the runs and stays out of MPI)
        "predicted_peak_mib": (summary["predicted_peak_memory_bytes"] + sum(
            summary.get(k) or 0 for k in ("predicted_cache_slack_bytes",
                                          "predicted_heap_slack_bytes",
                                          "predicted_kept_data_bytes"))) / 2**20,
        "mapped_after_first_step": float(bc.get("misses_after_first_step", float("nan"))),
        "final_loss": summary["final_loss"],
        # the step's peak above the process baseline the plan measured (the parameters'
        # state, the same in each precision, included)
        "above_baseline_mib": (summary["training_peak_memory_per_rank_bytes"]
                               - summary["predicted_baseline_memory_bytes"]) / 2**20,
    }


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", metavar="P:ARGS",
                   help="ranks and disttensor-train arguments (repeatable; default: "
                   + "; ".join(DEFAULT_CASES) + ")")
    p.add_argument("--rounds", type=int, default=3, help="runs of each configuration")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"configurations to compare, of {', '.join(CONFIGS)}")
    p.add_argument("--json", default="bench_train.json", help="where to write the results")
    a = p.parse_args(argv)
    configs = [c for c in a.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        p.error(f"--configs: unknown {bad}; choose of {', '.join(CONFIGS)}")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    cases = []
    for case in a.case or DEFAULT_CASES:
        ranks, sep, rest = case.partition(":")
        if not sep or not ranks.isdigit() or int(ranks) < 1:
            p.error(f"--case {case!r}: expected P:ARGS, e.g. '2:mesh-demo --steps 12'")
        cases.append((int(ranks), shlex.split(rest)))

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks, args in cases:
            runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
            for _ in range(a.rounds):
                for c in configs:
                    runs[c].append(figures(run_case(ranks, args, CONFIGS[c], Path(tmp))))
            for c in configs:
                keys = runs[c][0].keys()
                results.append({"ranks": ranks, "args": shlex.join(args), "config": c,
                                "runs": runs[c],
                                **{k: _stats([r[k] for r in runs[c]]) for k in keys}})

    head = (f"{'P':>2} {'command':<40} {'config':<9} {'iter ms':>16} {'compute ms':>11} "
            f"{'pred ms':>8} {'c/p':>5} {'data %':>6} {'bn ms':>7} {'bn pred':>7} "
            f"{'peak MiB':>9} {'pred MiB':>8} {'>base MiB':>9} {'mapped':>6} {'loss':>8}")
    print(head)
    print("-" * len(head))
    for r in results:
        it = r["iteration_s"]
        med = {k: v["median"] for k, v in r.items() if isinstance(v, dict) and "median" in v}
        print(f"{r['ranks']:>2} {r['args'][:40]:<40} {r['config']:<9} "
              f"{1e3 * it['median']:7.1f} ({1e3 * it['min']:.0f}-{1e3 * it['max']:.0f}) "
              f"{1e3 * med['compute_s']:11.1f} {1e3 * med['predicted_s']:8.1f} "
              f"{med['compute_s'] / med['predicted_s']:5.2f} "
              f"{100 * med['data_s'] / med['iteration_s']:6.1f} {1e3 * med['bn_s']:7.1f} "
              f"{1e3 * med['bn_predicted_s']:7.1f} {med['peak_mib']:9.0f} "
              f"{med['predicted_peak_mib']:8.0f} {med['above_baseline_mib']:9.0f} "
              f"{med['mapped_after_first_step']:6.0f} {med['final_loss']:8.4f}")
    with open(a.json, "w") as f:
        json.dump({"rounds": a.rounds, "results": results}, f, indent=1)
    print(f"\nwritten to {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
