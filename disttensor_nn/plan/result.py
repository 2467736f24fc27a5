"""The planner's result: a :class:`Plan` of per-layer :class:`PlanEntry` s, with its text
table and its JSON form.

:data:`MODES` names a convolution's modes under a grid over (N, C, S..), as
:attr:`PlanEntry.mode` records them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["Plan", "PlanEntry", "MODES"]

#: A convolution's modes under a grid over (N, C, S..) (``PlanEntry.mode``).
MODES = {
    "gathered": "filter-parallel on the input gathered along C",
    "channel": "channel-parallel, partial outputs allreduced",
    "filter": "filter-parallel, partial input gradients allreduced",
    "replicated": "the whole layer on each replica",
    "grouped": "grouped, each rank's whole groups, no message",
}
_MODE_LABEL = {"gathered": "C>F", "channel": "C>-", "filter": "->F", "replicated": "->-",
               "grouped": "C>F g"}


def _split_label(e: PlanEntry) -> str:
    """The C/F column of a plan's table."""
    if len(e.in_shape) != len(e.grid) or e.grid[1] == 1:
        return ""
    return _MODE_LABEL.get(e.mode, "C" if e.split_channels else "-")


@dataclass
class PlanEntry:
    """One layer of a plan."""

    name: str
    layer: str
    grid: tuple[int, ...]
    in_shape: tuple[int, ...]
    fwd: float
    bwd: float
    comm: float
    shuffle_in: float
    memory: float
    estimated: bool
    tiled: bool = False
    transient: float = 0.0
    recompute: int = -1  # recompute segment (activation checkpointing); -1: kept
    # under a grid over (N, C, S..): the input's channels split along the channel axis (or
    # whole, replicated along it), and a convolution's mode (MODES; "" for other layers)
    split_channels: bool = True
    mode: str = ""
    kernels: str = ""  # the kernel backend chosen ("" for a layer without a choice)
    # under 16-bit activations, the dtype the layer's kernels compute in when it is another
    # ("float32": on converted blocks, where the backend has no 16-bit kernel)
    kernel_dtype: str = ""
    # what the operation is, beyond its kind and input shape (a module's own description,
    # ``Conv2d(3, 8, kernel_size=(3, 3), ...)``; "" where the planner records none): a plan
    # is refused for a model whose operation differs
    signature: str = ""


@dataclass
class Plan:
    """Per-layer distributions with predicted times (seconds) and memory (bytes per rank)."""

    nprocs: int
    batch_shape: tuple[int, ...]
    machine: str
    entries: list[PlanEntry]
    time: float
    peak_memory: float
    memory_budget: float | None = None
    notes: list[str] = field(default_factory=list)
    baseline_memory: float = 0.0
    compute: float = 0.0  # of time: kernels
    exposed_comm: float = 0.0  # of time: communication on the critical path
    hidden_comm: float = 0.0  # communication overlapped with kernels (not in time)
    training: bool = True  # a training step (False: an inference pass, nothing kept)
    inner: str = "space"  # grid axes inside a node: the spatial splits, or "sample" (dist_for)
    # the parameters' state sharded over the ranks that replicate them (optim.shard_state),
    # as the plan's time and memory count it
    shard_state: str = "none"
    # the activations' dtype the plan is for (precision.PRECISIONS): 16-bit blocks count 2
    # bytes in its memory and communication
    precision: str = "fp32"
    # how the activations' blocks lie in memory, as the plan's kernels were timed
    # (make_plan's and disttensor_nn.torch.parallelize's memory_format): "contiguous" or
    # "channels_last"
    memory_format: str = "contiguous"

    def table(self) -> str:
        """The plan as a readable text table."""
        dims = "(N,C,S..)" if any(len(e.grid) == len(self.batch_shape) for e in self.entries) \
            else "(N,S..)"
        cf = dims == "(N,C,S..)"
        kern = len({e.kernels for e in self.entries} - {""}) > 1 or \
            any(e.kernels not in ("", "numpy") for e in self.entries) or \
            any(e.kernel_dtype for e in self.entries)
        kw = 9 if any(e.kernel_dtype for e in self.entries) else 8  # "numpy/f32"
        head = f"{'layer':<28} {'grid ' + dims:<16} " + (f"{'C/F':<8} " if cf else "") + \
            (f"{'kernels':<{kw}} " if kern else "") + \
            f"{'fwd ms':>8} {'bwd ms':>8} {'comm ms':>8} {'shuffle ms':>10} {'mem MiB':>8}"
        lines = [head, "-" * len(head)]
        for e in self.entries:
            mark = ("*" if e.estimated else "~" if e.tiled else " ") + \
                ("R" if e.recompute >= 0 else "")
            lines.append(
                f"{(e.name + ' ' + e.layer)[:28]:<28} {str(e.grid):<16} "
                + (f"{_split_label(e):<8} " if cf else "")
                + (f"{(e.kernels or '-') + ('/f32' if e.kernel_dtype else ''):<{kw}} "
                   if kern else "") + f"{1e3 * e.fwd:8.2f} "
                f"{1e3 * e.bwd:8.2f} {1e3 * e.comm:8.2f} {1e3 * e.shuffle_in:10.2f} "
                f"{e.memory / 2**20:7.1f}{mark}")
        lines.append("-" * len(head))
        what = "iteration" if self.training else "inference pass (nothing kept for backward)"
        lines.append(f"predicted time per {what}: {1e3 * self.time:.2f} ms on "
                     f"{self.nprocs} rank{'' if self.nprocs == 1 else 's'} ({self.machine}); "
                     "peak memory per rank "
                     f"{self.peak_memory / 2**20:.1f} MiB"
                     + (f" of {self.memory_budget / 2**20:.0f} MiB" if self.memory_budget
                        else "")
                     + (f" (process baseline {self.baseline_memory / 2**20:.0f} MiB)"
                        if self.baseline_memory else ""))
        if self.compute:
            lines.append(f"of which compute {1e3 * self.compute:.2f} ms, exposed communication "
                         f"{1e3 * self.exposed_comm:.2f} ms; hidden communication "
                         f"{1e3 * self.hidden_comm:.2f} ms")
        if any(e.estimated for e in self.entries):
            lines.append("* compute estimated from a rate model, not measured")
        if any(e.tiled for e in self.entries):
            lines.append("~ compute measured on a tile of the local block, scaled by FLOPs")
        if cf:
            lines.append("C/F: the input's channels split over the grid's C axis (C) or whole "
                         "(-), and a convolution's output after '>': " + "; ".join(
                             f"{_MODE_LABEL[k]} {v}" for k, v in MODES.items()))
        if any(e.recompute >= 0 for e in self.entries):
            lines.append(f"R recomputed in backward from its segment's input "
                         f"({len({e.recompute for e in self.entries} - {-1})} segments): "
                         "memory kept only at each segment's start, forward run twice")
        if self.precision != "fp32":
            lines.append(f"activations, halos and messages in {self.precision} (2 bytes), "
                         "parameters and optimizer state in float32"
                         + ("; kernels marked /f32 run in float32 on converted blocks (no "
                            "16-bit kernel in that backend)"
                            if any(e.kernel_dtype for e in self.entries) else ""))
        if self.shard_state != "none":
            lines.append(f"parameter state sharded over the ranks that replicate it: "
                         f"{self.shard_state} (optim.shard_state; time and peak count it)")
        if self.memory_format != "contiguous":
            lines.append(f"blocks in {self.memory_format} memory format (the kernels timed "
                         "so; each step's input block put so, counted)")
        if self.inner != "space":
            lines.append("ranks placed so that the sample split stays inside a node and the "
                         "spatial splits span nodes (grids laid out (C.., S.., N))")
        lines += self.notes
        return "\n".join(lines)

    def to_json(self) -> str:
        """Serialise (the training driver loads it with :meth:`from_json`)."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of :meth:`to_json`."""
        d = json.loads(text)
        d["entries"] = [PlanEntry(**{**e, "grid": tuple(e["grid"]),
                                     "in_shape": tuple(e["in_shape"])}) for e in d["entries"]]
        d["batch_shape"] = tuple(d["batch_shape"])
        return cls(**d)
