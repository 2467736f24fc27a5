"""Unchanged PyTorch models on distributed blocks: :func:`parallelize`.

The model is traced by :mod:`torch.fx`, its shapes propagated on the example
input shape (:class:`torch.fx.passes.shape_prop.ShapeProp` on fake tensors,
which hold no memory), and every node
compiled, once and on every rank alike, into a step that runs on this rank's
block:

- window modules (convolutions, transposed convolutions, pooling) exchange
  the halo that :mod:`disttensor_nn.window` computes (:func:`geometry`,
  :func:`transposed_geometry`: output boundaries and widths for any kernel,
  stride, padding, dilation and uneven blocks) with :func:`halo_exchange`,
  then run the module's own functional operation with padding 0; a
  zero-padded convolution of large blocks split along one dimension runs on
  the block as it is instead, its edges corrected from the halo's faces
  (:mod:`disttensor_nn.torch.halo_conv`);
- batch norms take their statistics over the split dimensions by
  :func:`~disttensor_nn.torch.split_batch_norm`, group and layer norms with
  ``broadcast(all_reduce(.))``;
- element-wise operations run on the blocks unchanged, after the operands of
  a binary one are brought to one distribution (:func:`redistribute`);
- heads (flatten, view, Linear, means and sums over split dimensions) move
  what they need whole (:func:`redistribute`, :func:`all_reduce`);
- anything else runs as it is where none of its inputs is split, and is
  refused, naming the node and the dimension, where one is.

Every decision is metadata (the library's first principle), so an error is
raised on every rank alike before any message. The compiler is
:mod:`disttensor_nn.torch.compiler`; the module it returns, and the way the
parameters' gradients are summed over ranks, :mod:`disttensor_nn.torch.runtime`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from mpi4py import MPI
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Node, symbolic_trace
from torch.fx.passes.shape_prop import ShapeProp
from torch.optim.optimizer import register_optimizer_step_pre_hook

from disttensor import Distribution, ProcessGrid
from disttensor_nn.layers.norm import BATCH_NORM_STATS
from disttensor_nn.reduction import split_axes_comm

from .autoplan import is_plan_layout, plan_layouts
from .compiler import _Compiler, _runs_on_blocks
from .runtime import ParallelModule, Step

__all__ = ["ParallelModule", "parallelize"]

# parameters that a ParallelModule replaced: an optimizer over them is refused at its step
_RETIRED: dict[int, weakref.ref] = {}  # id -> the parameter (tensors compare by value)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            old = _RETIRED.get(id(p))
            if old is not None and old() is p:
                raise RuntimeError(
                    "this optimizer holds the parameters the model had before parallelize, "
                    "which the parallel model no longer uses; build it on the parallel "
                    "model's parameters (ParallelModule.parameters())")


_OPTIMIZER_CHECK: list[Any] = []  # the global step pre-hook, registered once


def _watch_optimizers() -> None:
    if not _OPTIMIZER_CHECK:
        _OPTIMIZER_CHECK.append(register_optimizer_step_pre_hook(_check_optimizer))



# ------------------------------------------------------------------ parallelize
def _input_distribution(shape: tuple[int, ...], layout: Any, comm: MPI.Intracomm
                        ) -> Distribution:
    if not isinstance(layout, Sequence) or not all(
            isinstance(g, int) and not isinstance(g, bool) for g in layout):
        raise TypeError(f"parallelize: layout must be 'auto', a Plan, a plan's JSON file or "
                        f"a grid shape (a tuple of ints, one per input dimension), got "
                        f"{layout!r}")
    layout = tuple(layout)
    if len(layout) != len(shape):
        raise ValueError(f"parallelize: the grid shape {layout} has {len(layout)} entries, "
                         f"the input shape {shape} {len(shape)} dimensions")
    if any(g < 1 for g in layout) or math.prod(layout) != comm.Get_size():
        raise ValueError(f"parallelize: the grid shape {layout} must be positive and hold "
                         f"the {comm.Get_size()} ranks")
    return Distribution(shape, ProcessGrid(layout, comm), tuple(range(len(shape))))


def parallelize(model: nn.Module, example_input_shape: Sequence[int], layout: Any = "auto",
                *, memory_per_rank: int | None = None, machine: Any = None,
                comm: MPI.Intracomm | None = None, baseline: float = 0.0,
                batch_norm_stats: str = "global",
                memory_format: torch.memory_format | str | None = "auto",
                channel_splits: bool = False) -> ParallelModule:
    """An unchanged PyTorch model, run on this rank's blocks of a distributed input.

    The model is traced by :mod:`torch.fx` and each node compiled into a step
    on blocks (see the module's notes). Collective: every rank calls it alike,
    with the same model (the same architecture; the weights may differ, see
    below). The model's modules become the returned module's
    (its parameters are replaced by new :class:`torch.nn.Parameter` objects
    on the same data; an optimizer built before on the old ones is refused
    at its first step), and every rank's parameters and buffers are set to
    rank 0's, in place, as ``DistributedDataParallel`` does (a model
    initialised or loaded on rank 0 alone trains as that one); nothing is
    changed where an error is raised.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its forward takes one tensor of ``example_input_shape``.
    example_input_shape : sequence of int
        The global input shape, ``(N, C, *spatial)``, the parallel model runs on.
    layout : 'auto', Plan, path or sequence of int
        ``'auto'``: the planner (:mod:`disttensor_nn.plan`) chooses each
        layer's input distribution for ``machine`` within
        ``memory_per_rank`` (see :mod:`disttensor_nn.torch.autoplan`), and
        the input is redistributed between layers whose layouts differ; the
        plan is :attr:`ParallelModule.plan`. A :class:`~disttensor_nn.plan.Plan`
        (or the path of its JSON, ``Plan.to_json``) made so for this model,
        input shape and rank count: applied as it is. A grid shape over the
        input's dimensions (``(1, 1, 2, 1)`` splits H of (N, C, H, W) in
        two): dimension ``d`` split by grid axis ``d``, each layer following
        where its input lies.
    memory_per_rank : int, optional
        The memory budget of one rank, in bytes, for ``layout='auto'``
        (default: the machine profile's memory per rank).
    machine : str, optional
        The machine profile for ``layout='auto'``: a built-in profile's name
        (:func:`disttensor_nn.plan.builtin_profiles`, no kernel timed) or a
        profile's JSON file; default ``'this'``, this machine's calibrated
        profile, on which the layers' kernels are timed with the torch
        kernels on all ranks at once. That profile must have been taken with
        as many ranks per node as ``comm`` has: where the cached one was not
        (and none kept for this number is), the machine is calibrated again
        first, on ``comm``, as ``disttensor-train`` does (after the graph is
        checked: one the planner cannot describe is refused before anything
        is measured).
    comm : MPI.Intracomm, optional
        The ranks (``MPI.COMM_WORLD`` by default).
    baseline : float
        For ``layout='auto'``: the resident bytes of a rank besides the
        model's parameters, gradients and activations (the interpreter,
        PyTorch, MPI, data held), part of the peak the plan predicts and of
        what ``memory_per_rank`` must hold (as ``disttensor-train`` counts
        its process); 0, the default, plans the model's data alone.
    batch_norm_stats : {'global', 'group'}
        Over which samples the batch norms take their statistics in
        training. ``'global'`` (the default): the whole batch, as one
        process on all of it, with a sum over the ranks in each batch
        norm's forward and backward. ``'group'``: each group of ranks that
        holds the same samples (one rank where only the samples are split)
        normalizes over its own samples alone, as PyTorch's batch norms do
        under ``DistributedDataParallel``; a split of the spatial
        dimensions is still summed over. The running statistics are then
        the average of the groups' (a group with no sample is left out), so
        every rank keeps the same ones: a training forward pass starts one
        non-blocking all-reduce of them per communicator after its last
        step, which completes when the backward pass ends, at the next
        forward pass, or when a batch norm's state is saved or loaded
        (``state_dict``, ``load_state_dict``; read the buffers directly
        only after one of these). Where the samples are not split the two
        are the same.
    memory_format : torch.memory_format, 'auto' or None
        The layout each forward pass puts its input block in:
        ``torch.channels_last`` (4-D inputs) or ``torch.channels_last_3d``
        (5-D), on which PyTorch's CPU convolutions run oneDNN's channels-last
        kernels (measured here 1.3-2.7x faster than on ``(N, C, H, W)`` blocks
        for 8-128 channels at batch 4-8, no faster or slower on small
        one-sample blocks; see the docs), or ``torch.contiguous_format``.
        None keeps the block as it comes. ``'auto'`` (the default): with
        ``layout='auto'`` on a measured machine profile, the planner plans
        the model both ways (the modules it times as themselves timed on
        blocks of each layout) and keeps channels-last where it is predicted
        faster by more than 3% (``plan.make.kept_memory_format``; its plan's
        ``memory_format``; channels-last blocks then, else as they come);
        with a given plan, the plan's; otherwise as they come. Either way a
        block's layout is kept through the halo exchanges, as PyTorch's
        operations keep it; the values are the same in every layout.
    channel_splits : bool
        With ``layout='auto'``: let the planner also split the channels of a
        convolution's input (grids over ``(N, C, *S)``): each rank convolves
        its channels with their slice of the weight, and the partial outputs
        are summed over those ranks, which then hold the whole output alike
        (the plan table's ``C>-``); the operations between convolutions run on
        whole channels. Off by default: the planner does not price the time two
        ranks wait for each other at each such sum and gather, and on the
        2-core machine of the docs such a plan measured 12-20% faster than the
        default in two runs of seven, within 3% in four and 10% slower in one,
        against 14% faster predicted (``docs/torch.md``). A grid shape that splits the channels
        (``(1, 2, 1, 1)``) runs a convolution so either way; with any layout
        but ``'auto'``, ``channel_splits`` raises.

    Returns
    -------
    ParallelModule
        With ``input_dist``; its forward takes a DistArray of torch tensors
        in ``input_dist`` (or this rank's block) and returns a DistArray whose
        ``to_global()`` is the model's output; after ``backward`` each
        parameter's gradient is that of one process on the whole batch.

    Raises
    ------
    TypeError
        For a model that is not a torch.nn.Module or cannot be traced by
        torch.fx, a layout of the wrong type, or a ``channel_splits`` that is
        not a bool.
    ValueError
        For a negative or non-numeric ``baseline``, ``channel_splits`` with a
        layout other than 'auto', a ``batch_norm_stats`` other than 'global'
        and 'group', a ``memory_format`` that is not a torch.memory_format,
        'auto' or None, or does not suit the input's rank, an input shape the
        model does not accept, a grid that does not hold the ranks, an
        operation on a split dimension that parallelize
        cannot split (naming the node and the dimension), a parameter
        shared by layers whose inputs are split differently, a memory
        budget no plan fits, a plan made for another model, input shape
        or rank count, or ranks whose models' parameters or buffers differ
        in shape or dtype.
    NotImplementedError
        With ``layout='auto'``, for a graph the planner cannot describe
        (naming the node): paths that share a layer and merge elsewhere, a
        ``torch.cat`` along other than the channels, an operation of several
        outputs (but max pooling with its indices).

    All are raised on every rank alike, before any message (on a measured
    machine profile, after the kernels are timed on all ranks together).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be a torch.nn.Module, "
                        f"got {type(model).__name__}")
    if isinstance(model, ParallelModule):
        raise TypeError("parallelize: the model is parallel already")
    try:
        shape = tuple(int(s) for s in example_input_shape)
    except (TypeError, ValueError):
        raise TypeError(f"parallelize: example_input_shape must be a sequence of ints, "
                        f"got {example_input_shape!r}") from None
    if isinstance(baseline, bool) or not isinstance(baseline, (int, float)) \
            or not 0 <= baseline < math.inf:
        raise ValueError(f"parallelize: baseline must be a finite number of bytes >= 0, "
                         f"got {baseline!r}")
    if batch_norm_stats not in BATCH_NORM_STATS:
        raise ValueError(f"parallelize: batch_norm_stats must be 'global' or 'group', "
                         f"got {batch_norm_stats!r}")
    if not isinstance(channel_splits, bool):
        raise TypeError(f"parallelize: channel_splits must be True or False, got "
                        f"{channel_splits!r}")
    if channel_splits and not (isinstance(layout, str) and layout == "auto"):
        raise ValueError("parallelize: channel_splits=True is for layout='auto' (a grid "
                         "shape or a plan says itself where channels are split)")
    auto = isinstance(memory_format, str) and memory_format == "auto"
    memory_format = None if auto else _memory_format(memory_format, len(shape))
    planned = "auto" if auto else "channels_last" if memory_format in (
        torch.channels_last, torch.channels_last_3d) else "contiguous"
    try:
        gm = symbolic_trace(model)
    except Exception as err:  # noqa: BLE001 - whatever torch.fx refuses
        raise TypeError(f"parallelize: {type(model).__name__} cannot be traced by torch.fx "
                        f"({type(err).__name__}: {err})") from None
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else torch.get_default_dtype()
    devices = sorted({str(t.device) for t in [*model.parameters(), *model.buffers()]
                      if t.device.type != "cpu"})
    if devices:
        raise NotImplementedError(f"parallelize: the model is on {', '.join(devices)}; "
                                  "parallel models run on CPU tensors only, so far")
    modes = {m: m.training for m in gm.modules()}
    try:
        gm.eval()  # shapes only: no batch statistics or dropout masks drawn
        fake = FakeTensorMode(allow_non_fake_inputs=True)  # no memory, no arithmetic
        with fake:
            example = torch.empty(shape, dtype=dtype)
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # its traceback
            ShapeProp(gm, fake_mode=fake).propagate(example)
    except Exception as err:  # noqa: BLE001 - whatever the model refuses
        cause = err.__cause__ or err  # ShapeProp's own error names the node only
        # the first node ShapeProp did not run (it records each result's type; a size or
        # a number has no tensor metadata)
        where = [n.name for n in gm.graph.nodes if "type" not in n.meta
                 and "tensor_meta" not in n.meta and n.op != "output"][:1]
        at = f" at node '{where[0]}'" if where else ""
        raise ValueError(f"parallelize: {type(model).__name__} does not accept an input of "
                         f"shape {shape}{at} ({type(cause).__name__}: {cause})") from None
    finally:
        for m, training in modes.items():
            m.training = training
    plan = None
    if is_plan_layout(layout):  # the planner's layouts, a relayout node before each layer
        plan, input_dist = plan_layouts(gm, shape, dtype, layout, memory_per_rank, machine,
                                        comm, _runs_on_blocks(gm), baseline=baseline,
                                        batch_norm_stats=batch_norm_stats,
                                        memory_format=planned,
                                        channel_splits=channel_splits)
        if plan.memory_format == "channels_last" and memory_format is None:
            memory_format = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    else:
        input_dist = _input_distribution(shape, layout, comm)
    compiler = _Compiler(gm, model, input_dist.grid, batch_norm_stats, memory_format)
    steps: list[tuple[Node, Step]] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if steps:
                raise TypeError("parallelize: the model's forward must take one input")
            compiler.set(node, input_dist)
            steps.append((node, lambda args: None))
            continue
        steps.append((node, compiler.compile(node)))
    # rank 0's weights on every rank (models that differ in shape refused first, alike),
    # then new Parameters on the same data: nothing fails after this
    _broadcast_state(model, comm)
    _watch_optimizers()
    fresh: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in fresh:
                fresh[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
                _RETIRED[id(p)] = weakref.ref(p)
            module._parameters[name] = fresh[id(p)]
    # the parameters some other rank uses too, and the ranks that sum their gradients; one
    # no other rank uses (every one on one rank) keeps autograd's own gradient, as unwrapped
    # (one communicator per group of ranks, so that their sums share buckets: the
    # layers' distributions may reach the same ranks through different communicators)
    groups: list[MPI.Intracomm] = []
    comms = {}
    for i, (_, dist, _) in compiler.param_keys.items():
        c = split_axes_comm(dist)
        if c.Get_size() > 1:
            same = next((g for g in groups if MPI.Comm.Compare(g, c) in (
                MPI.IDENT, MPI.CONGRUENT)), None)
            if same is None:
                groups.append(c)
            comms[id(fresh[i])] = c if same is None else same
    pm = ParallelModule(model, gm, steps, input_dist, compiler.output_dist, comms,
                        compiler.view, compiler.running, batch_norm_stats, memory_format)
    pm.plan = plan
    return pm


def _memory_format(memory_format: Any, ndim: int) -> torch.memory_format | None:
    """The layout to put input blocks in (None: as they come, ``torch.preserve_format``'s
    meaning); ValueError, alike on every rank, for a ``memory_format`` that is not one or
    does not suit an input of ``ndim`` dimensions."""
    if memory_format is None or memory_format is torch.preserve_format:
        return None
    if memory_format is torch.contiguous_format:
        return memory_format
    wants = None if isinstance(memory_format, str) else \
        {torch.channels_last: 4, torch.channels_last_3d: 5}.get(memory_format)
    if wants is None:
        raise ValueError(f"parallelize: memory_format must be a torch.memory_format "
                         f"(torch.channels_last, torch.channels_last_3d, "
                         f"torch.contiguous_format), 'auto' or None, got {memory_format!r}")
    if wants != ndim:
        raise ValueError(f"parallelize: memory_format {memory_format} is for inputs of "
                         f"{wants} dimensions, the model's has {ndim}")
    return memory_format


def _broadcast_state(model: nn.Module, comm: MPI.Intracomm) -> None:
    """Make every rank's parameters and buffers rank 0's, in place (as
    ``DistributedDataParallel`` does when it wraps a module): a model initialised or
    loaded differently on some rank would otherwise train on mixed weights, silently.
    One broadcast of each tensor's bytes (any dtype), after a check that every rank's
    tensors have the same shapes and dtypes (ValueError on every rank, nothing changed)."""
    if comm.Get_size() == 1:
        return
    state = [*model.parameters(), *model.buffers()]
    layout = hashlib.sha256(repr([(tuple(t.shape), str(t.dtype)) for t in state]).encode())
    if len(set(comm.allgather(layout.hexdigest()))) > 1:
        raise ValueError("parallelize: the ranks' models differ in the shapes or dtypes of "
                         "their parameters or buffers; every rank must pass the same model")
    for t in state:
        if t.numel() == 0:
            continue
        data = t.detach()
        buf = data if data.is_contiguous() else data.contiguous()
        comm.Bcast(buf.reshape(-1).view(torch.uint8).numpy(), root=0)
        if buf is not data and comm.Get_rank() != 0:
            data.copy_(buf)
