"""``disttensor-plot``: turn a training metrics file into PNG plots.

Reads ``PREFIX.json`` written by ``disttensor-train`` and writes
``PREFIX-loss.png`` (loss per step) and ``PREFIX-layers.png`` (each layer's
forward + backward time: the planner's prediction next to the measurement).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["plot_metrics", "plot_main", "plot_scaling"]


def plot_metrics(path: str, out_prefix: str | None = None) -> list[str]:
    """Write the loss and per-layer plots of a metrics JSON file; return their paths."""
    import matplotlib  # optional (the test extra): only plotting needs it, so imported here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    prefix = out_prefix or (path[:-5] if path.endswith(".json") else path)
    hist, summary = data["history"], data["summary"]
    written = []
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in hist], [h["loss"] for h in hist])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{summary['model']} {tuple(summary['batch_shape'])} on {summary['ranks']} "
                 f"rank{'' if summary['ranks'] == 1 else 's'}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(f"{prefix}-loss.png", dpi=110)
    plt.close(fig)
    written.append(f"{prefix}-loss.png")
    layers = summary.get("layers") or []
    if layers:
        fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(layers)), 4))
        xs = range(len(layers))
        ax.bar([x - 0.2 for x in xs], [1e3 * layer["predicted_s"] for layer in layers], 0.4,
               label="predicted")
        ax.bar([x + 0.2 for x in xs], [1e3 * layer["measured_s"] for layer in layers], 0.4,
               label="measured")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{layer['name']} {layer['layer']}" for layer in layers],
                           rotation=90, fontsize=7)
        ax.set_ylabel("forward + backward per iteration (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{prefix}-layers.png", dpi=110)
        plt.close(fig)
        written.append(f"{prefix}-layers.png")
    return written


def plot_scaling(rows: list[dict], path: str, title: str) -> None:
    """Draw predicted strong scaling (rows of :func:`disttensor_nn.plan.predict_scaling`) as a PNG.

    Parameters
    ----------
    rows : list of dict
        The predictions; rows without a time (nothing fitted) are left out.
    path : str
        The PNG file to write.
    title : str
        The plot's title.
    """
    import matplotlib  # optional (the test extra): only plotting needs it, so imported here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["time_ms"]]
    split = all("compute_ms" in r for r in ok)
    fig, axes = plt.subplots(1, 2 if split else 1, figsize=(11 if split else 6, 4),
                             squeeze=False)
    ax = axes[0][0]
    ax.loglog([r["ranks"] for r in ok], [r["time_ms"] for r in ok], "o-", label="planned")
    sp = [r for r in ok if r.get("sample_parallel_ms")]
    if sp:
        ax.loglog([r["ranks"] for r in sp], [r["sample_parallel_ms"] for r in sp], "s--",
                  label="sample parallel only")
    ideal = ok[0]["time_ms"] * ok[0]["ranks"]
    ax.loglog([r["ranks"] for r in ok], [ideal / r["ranks"] for r in ok], ":", label="ideal")
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted time per iteration (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    if split:  # where the planned step's time goes
        ax = axes[0][1]
        xs = range(len(ok))
        compute = [r["compute_ms"] for r in ok]
        exposed = [r["exposed_ms"] for r in ok]
        ax.bar(xs, compute, label="compute")
        ax.bar(xs, exposed, bottom=compute, label="exposed communication")
        ax.bar([x + 0.3 for x in xs], [r["hidden_ms"] for r in ok], 0.3,
               label="hidden communication")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([str(r["ranks"]) for r in ok])
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("planned step (ms)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="disttensor-plot",
        description="Turn a training metrics file into PNG plots: PREFIX-loss.png (loss per "
                    "step) and PREFIX-layers.png (each layer's forward + backward time, "
                    "predicted next to measured).")
    parser.add_argument("metrics", help="PREFIX.json written by disttensor-train --metrics "
                        "PREFIX")
    parser.add_argument("--out", help="prefix of the PNG files (default: the metrics prefix)")
    args = parser.parse_args(argv)
    for path in plot_metrics(args.metrics, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(plot_main())
