"""Lay a model's layers out as a plan says: :func:`apply_plan`."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from disttensor import ProcessGrid

from ..kernels import check_backend
from ..module import Layer, Layout
from .costmodel import dist_for
from .result import Plan
from .tracing import leaf_nodes, trace

__all__ = ["apply_plan"]


def apply_plan(model: Layer, plan: Plan, batch_shape: tuple[int, ...], comm: Any = None) -> None:
    """Set every layer's ``layout`` from ``plan`` (grids built over ``comm``).

    Layers are matched in traversal order; their input shapes must match the
    plan's, so a plan is only applied to the model and batch shape it was made for.
    Each layer's ``kernel_backend`` is set to the plan's choice
    (:attr:`PlanEntry.kernels`), which raises ImportError, before any layer
    changes, for a plan that chose the torch kernels in a process without PyTorch.
    Under a grid over (N, C, S..) a layer's input has its channels split
    along the channel axis or whole (``PlanEntry.split_channels``), and a
    layer with ``filter_axes`` (a convolution) splits its filters over that
    axis in the modes that do ("gathered", "filter", "grouped"; :data:`MODES`); a plan
    without modes (an older plan file) splits them wherever it splits the
    channels.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_size() != plan.nprocs:
        raise ValueError(f"the plan is for {plan.nprocs} rank{'' if plan.nprocs == 1 else 's'}, "
                         f"the job has {comm.Get_size()}")
    nodes = leaf_nodes(trace(model, tuple(batch_shape)))
    if len(nodes) != len(plan.entries) or any(
        tuple(n.in_shape) != tuple(e.in_shape) for n, e in zip(nodes, plan.entries)
    ):
        raise ValueError("the plan does not match this model and batch shape")
    for entry in plan.entries:
        check_backend(entry.kernels or None)
    grids: dict[tuple[int, ...], ProcessGrid] = {}
    for node, entry in zip(nodes, plan.entries):
        g = tuple(entry.grid)
        dist = dist_for(tuple(node.in_shape), g, entry.split_channels, inner=plan.inner)
        if dist.grid_shape not in grids:
            grids[dist.grid_shape] = ProcessGrid(dist.grid_shape, comm)
        ndim = len(node.in_shape)
        node.layer.layout = Layout(grids[dist.grid_shape], dist.axes)
        if entry.kernels:  # a plan that chose the layer's kernels (older plans did not)
            node.layer.kernel_backend = entry.kernels
        if hasattr(node.layer, "filter_axes") and ndim > 2:
            split = entry.mode in ("gathered", "filter", "grouped") if entry.mode else \
                len(g) == ndim
            # the grid axis of the channel factor (second in the candidate, first with
            # the sample split laid out last)
            channel_axis = dist_for(tuple(node.in_shape), g, inner=plan.inner).dim_axes[1] \
                if len(g) == ndim else ()
            node.layer.filter_axes = channel_axis if split else ()
