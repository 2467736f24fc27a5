"""What runs a model that :func:`~disttensor_nn.torch.parallelize` compiled:
:class:`ParallelModule`, and the way its parameters' gradients reach their sums.

The module runs the compiled steps in the graph's order on this rank's block.
Parameter gradients are summed over the ranks that split each parameter's
input by the library's one mechanism for it,
:func:`disttensor_nn.reduction.reduce_gradients_`, inside a
:class:`~disttensor_nn.reduction.GradientBuckets` context that a backward pass
opens when it reaches the output and closes when it ends (fused,
non-blocking allreduces overlapped with the rest of backward). A forward
pass uses each parameter through one autograd function whose backward hands
the gradient of the model's use to them, so a term that every rank computes
alike outside the model (a regularizer) keeps its own gradient. Batch norms
whose statistics are each sample group's own average their running
statistics over the groups after the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.func import functional_call
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from disttensor import DistArray, Distribution
from disttensor.settings import validating
from disttensor_nn.reduction import GradientBuckets, reduce_gradients_

__all__ = ["ParallelModule"]

Step = Callable[[list], Any]
"""A compiled node: its arguments (values in place of nodes) to its value."""


class _GradTarget:
    """What :func:`reduce_gradients_` adds a parameter's sum to (:meth:`add_grad_`): the
    torch parameter's ``grad``."""

    reduce_scatter = False  # torch parameters keep whole gradients (no sharded state)

    def __init__(self, param: nn.Parameter):
        self.param = param
        self.unreduced: Any = None
        self.grad_comm: Any = None

    def add_grad_(self, g: Any, owned: bool = False) -> None:
        """``grad += g`` (``g`` a NumPy array of the parameter's size, cast to its dtype);
        where the parameter has no gradient yet, ``g`` becomes it (PyTorch's rule for a
        first gradient: no zeros are written first), a copy unless ``owned`` (the
        caller gives ``g`` away) and of the parameter's dtype."""
        if self.param.grad is None:
            dtype = self.param.detach().numpy().dtype
            g = np.asarray(g)
            keep = owned and g.dtype == dtype and g.flags.c_contiguous
            self.param.grad = torch.from_numpy(
                (g if keep else np.array(g, dtype=dtype, copy=True)).reshape(
                    tuple(self.param.shape)))
            return
        grad = self.param.grad.numpy()
        grad += np.asarray(g).reshape(grad.shape).astype(grad.dtype, copy=False)


class _SumOverRanks(torch.autograd.Function):
    """Parameters as a layer uses them on this rank's part of the data: the backward pass
    hands the gradients of that use to the module's gradient sums
    (:func:`reduce_gradients_`), which add the sum over the ranks to each parameter's
    ``grad``; other uses of a parameter (a regularizer every rank computes alike) keep
    their own gradients. One call takes a module's parameters together (one kernel gives
    their gradients at once), so that they reach the sums in one hand-over."""

    @staticmethod
    def forward(ctx: Any, owner: ParallelModule, keys: tuple[int, ...],
                *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.owner, ctx.keys = owner, keys
        ctx.set_materialize_grads(False)  # a parameter this pass did not use: None
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.owner._ready([(k, g) for k, g in zip(ctx.keys, grads) if g is not None])
        return (None, None, *(None for _ in grads))


class _ParamView:
    """The parameters as this forward pass uses them (each through :class:`_SumOverRanks`
    once, so all its uses in the model meet before its one reduction; those of one module
    through one call)."""

    def __init__(self) -> None:
        self.owner: ParallelModule | None = None
        self.cache: dict[int, torch.Tensor] = {}

    def __call__(self, p: Any) -> Any:
        owner = self.owner
        if not isinstance(p, nn.Parameter) or owner is None or id(p) not in owner._comms \
                or not p.requires_grad or not torch.is_grad_enabled():
            return p
        used = self.cache.get(id(p))
        if used is None:
            group = [q for q in owner._siblings.get(id(p), (p,))
                     if q.requires_grad and id(q) not in self.cache]
            views = _SumOverRanks.apply(owner, tuple(id(q) for q in group), *group)
            for q, v in zip(group, views):
                self.cache[id(q)] = v
            used = self.cache[id(p)]
        return used

    def call(self, m: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """``m(*args, **kwargs)`` with its parameters as this pass uses them."""
        params = {name: self(p) for name, p in m.named_parameters()}
        if not params:
            return m(*args, **kwargs)
        return functional_call(m, params, tuple(args), kwargs)


class _GroupRunningStats:
    """The running statistics of batch norms whose statistics are each sample group's own
    (``batch_norm_stats="group"``): each group's batch mean and unbiased variance of a
    training forward pass, averaged over the groups and moved into the modules' buffers,
    so that every rank keeps the same ones. A group whose block of samples is empty has
    no estimate and is left out.

    The averages take one non-blocking all-reduce per communicator of samples, started
    after the pass's last step (:meth:`start`) and completed (:meth:`finish`) when the
    backward pass ends, at the next forward pass, or when a batch norm's state is saved
    or loaded (``state_dict`` and ``load_state_dict`` pre-hooks on each of them): no rank
    waits for another for it in between. The buffers move in the order the pass used the
    batch norms, as in one process. A pass that raises moves none of them (its batch
    norms' ``num_batches_tracked`` did count it)."""

    def __init__(self) -> None:
        self.pending: list[tuple[nn.Module, MPI.Intracomm, torch.Tensor, torch.Tensor,
                                 float, float]] = []
        # (requests, their buffers, (module, momentum, buffer index, offset, channels) in
        # the order the pass used the modules)
        self.inflight: list[tuple[list[MPI.Request], list[np.ndarray], list]] = []

    def add(self, m: nn.Module, comm: MPI.Intracomm, mean: torch.Tensor, var: torch.Tensor,
            momentum: float, has: float) -> None:
        """Queue this rank's group's estimates of a batch norm of this pass."""
        self.pending.append((m, comm, mean, var, momentum, has))

    def clear(self) -> None:
        """Drop what a pass that raised queued (nothing was sent for it)."""
        self.pending = []

    def start(self) -> None:
        """Start the groups' sums of what this pass queued."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        slots: dict[int, int] = {}  # a communicator's buffer
        parts: list[list[torch.Tensor]] = []
        comms: list[MPI.Intracomm] = []
        sizes: list[int] = []
        moves = []
        for m, comm, mean, var, f, has in pending:
            i = slots.setdefault(id(comm), len(parts))
            if i == len(parts):
                parts.append([])
                comms.append(comm)
                sizes.append(0)
            c = mean.numel()
            parts[i] += [mean.new_full((1,), has), mean * has, var * has]
            moves.append((m, f, i, sizes[i], c))
            sizes[i] += 1 + 2 * c
        bufs = [torch.cat(p).to(torch.float64).numpy() for p in parts]
        requests = [comm.Iallreduce(MPI.IN_PLACE, buf) for comm, buf in zip(comms, bufs)]
        self.inflight.append((requests, bufs, moves))

    def finish(self) -> None:
        """Wait for the sums; move the running buffers towards the groups' averages."""
        inflight, self.inflight = self.inflight, []
        for requests, bufs, moves in inflight:
            MPI.Request.Waitall(requests)
            with torch.no_grad():
                for m, f, i, at, c in moves:
                    total = torch.from_numpy(bufs[i][at + 1:at + 1 + 2 * c])
                    average = total / max(float(bufs[i][at]), 1.0)
                    for b, part in ((m.running_mean, average[:c]), (m.running_var, average[c:])):
                        b.mul_(1 - f).add_(part.to(b.dtype), alpha=f)

    def hook(self, m: nn.Module) -> None:
        """Complete the sums in flight before ``m``'s state is saved or loaded."""
        m.register_state_dict_pre_hook(lambda *_: self.finish())
        m.register_load_state_dict_pre_hook(lambda *_: self.finish())


# ------------------------------------------------------------------ the module
class ParallelModule(nn.Module):
    """A traced PyTorch model run on this rank's blocks (made by :func:`parallelize`).

    Its submodules, parameters and buffers are the model's own (the same
    modules; the parameters new :class:`torch.nn.Parameter` objects on the
    same data), under the same names, so :meth:`state_dict` keys and shapes
    are the model's and a state dictionary moves between the two both ways.

    Attributes
    ----------
    input_dist : Distribution
        The distribution the forward pass wants its input in.
    output_dist : Distribution or tuple of Distribution
        The distribution of the output (a tuple where the model returns one).
    plan : Plan or None
        The plan the layers run by (``layout='auto'`` or a plan; ``plan.table()``
        prints it as ``disttensor-plan`` does), None for a grid shape.
    batch_norm_stats : str
        ``'global'`` or ``'group'``: over which samples the batch norms take
        their statistics (see :func:`parallelize`).
    memory_format : torch.memory_format or None
        The layout a forward pass puts its input block in (None: as it comes).
    """

    def __init__(self, model: nn.Module, graph: GraphModule, steps: list[tuple[Node, Step]],
                 input_dist: Distribution, output_dist: Any,
                 param_comms: dict[int, MPI.Intracomm], view: _ParamView,
                 running: _GroupRunningStats | None = None, batch_norm_stats: str = "global",
                 memory_format: torch.memory_format | None = None):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in
                                 model._non_persistent_buffers_set)
        self.input_dist = input_dist
        self.output_dist = output_dist
        self.batch_norm_stats = batch_norm_stats
        self.memory_format = memory_format
        self.plan: Any = None
        self._running = _GroupRunningStats() if running is None else running
        self._graph = graph.graph
        self._steps = steps
        self._buckets: GradientBuckets | None = None
        self._targets: dict[int, _GradTarget] = {}
        self.training = model.training
        # the order every rank reduces in: the reverse of first use in forward, the order
        # backward usually reaches them, so a prefix that is ready starts at once
        by_id = {id(p): p for p in self.parameters()}
        self._order = [(by_id[i], c) for i, c in reversed(list(param_comms.items()))
                       if i in by_id and by_id[i].requires_grad]
        self._comms = {id(p): c for p, c in self._order}
        self._pending: dict[int, torch.Tensor] = {}
        self._next = 0
        self._view = view
        for p, _ in self._order:
            self._targets[id(p)] = _GradTarget(p)
        # each summed parameter's module's own summed parameters (itself included)
        self._siblings: dict[int, tuple[nn.Parameter, ...]] = {}
        for module in self.modules():
            own = tuple(p for p in module.parameters(recurse=False) if id(p) in self._comms)
            for p in own:
                self._siblings.setdefault(id(p), own)

    # -------------------------------------------------------------- gradients
    def _begin(self) -> None:
        """Open the buckets of this backward pass; its end reduces what is left."""
        if self._buckets is None:
            self._buckets = GradientBuckets().__enter__()
            self._pending.clear()
            self._next = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _ready(self, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """This rank's part of parameters' gradients, ``(key, gradient)``, from their use in
        this pass."""
        self._begin()
        for key, grad in grads:
            p = self._targets[key].param
            g = grad.detach()
            if g.dtype != p.dtype:
                g = g.to(p.dtype)
            self._pending[key] = g.clone(memory_format=torch.contiguous_format)
        self._reduce_ready()

    def _reduce(self, p: nn.Parameter, comm: MPI.Intracomm, local: torch.Tensor) -> None:
        # local is this pass's own copy (made in _ready, or zeros): given away
        reduce_gradients_([(self._targets[id(p)], local.numpy())], comm, owned=True)

    def _reduce_ready(self) -> None:
        """Hand the buckets the gradients that are ready, one at a time in the order of
        every rank (a rank's backward may reach them in another order: its graph differs
        where its block is empty), so that every rank's buckets fill alike."""
        while self._next < len(self._order) and id(self._order[self._next][0]) in \
                self._pending:
            p, comm = self._order[self._next]
            self._reduce(p, comm, self._pending.pop(id(p)))
            self._next += 1

    def _watch_output(self, value: Any) -> None:
        block = value.local if isinstance(value, DistArray) else value
        if isinstance(block, torch.Tensor) and block.requires_grad and (
                self._order or self._running.pending):  # the end of backward completes them
            block.register_hook(lambda grad: self._begin())

    def _finish(self) -> None:
        buckets, self._buckets = self._buckets, None
        if buckets is None:
            return
        for p, comm in self._order[self._next:]:  # zeros for those this rank's pass missed
            local = self._pending.pop(id(p), None)
            self._reduce(p, comm, torch.zeros_like(p) if local is None else local.detach())
        self._next = len(self._order)
        buckets.__exit__(None, None, None)
        self._running.finish()

    # -------------------------------------------------------------- forward
    def _block(self, x: DistArray | torch.Tensor) -> torch.Tensor:
        """This rank's block of the input, checked."""
        dist = self.input_dist
        if isinstance(x, DistArray):
            if x.dist != dist:
                raise ValueError(f"ParallelModule: the input is distributed as {x.dist}, "
                                 f"but this model wants {dist}")
            x = x.local
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ParallelModule: the input must be a DistArray or a "
                            f"torch.Tensor, got {type(x).__name__}")
        if x.device.type != "cpu":
            raise NotImplementedError(f"ParallelModule: the input is on {x.device}; parallel "
                                      "models run on CPU tensors only, so far")
        shape = tuple(x.shape)
        if shape != dist.local_shape():
            if shape == tuple(dist.global_shape):  # the same message on every rank
                raise ValueError(f"ParallelModule: the input has the whole input's shape "
                                 f"{shape}; the model takes this rank's block of it, "
                                 "DistArray.from_global(x, model.input_dist, xp=torch) (or "
                                 "its .local)")
            raise ValueError(f"ParallelModule: this rank's block has shape {shape}, but its "
                             f"block of {dist} has shape {dist.local_shape()}")
        return x

    def forward(self, x: DistArray | torch.Tensor) -> Any:
        """The model on this rank's block of ``x``.

        Parameters
        ----------
        x : DistArray or torch.Tensor
            A DistArray of torch tensors distributed as :attr:`input_dist`,
            or this rank's block of it.

        Returns
        -------
        DistArray
            The output, distributed as :attr:`output_dist` (a tuple of them
            where the model returns one); its ``local`` carries the autograd
            graph.
        """
        # checked on each rank; in check mode (disttensor.set_options) agreed by every rank
        # first, so that one rank's wrong block raises on all of them
        with validating("ParallelModule", {}, self.input_dist.grid.comm):
            x = self._block(x)
        if self.memory_format is not None:  # a copy only where the layout differs
            x = x.contiguous(memory_format=self.memory_format)
        env: dict[Node, Any] = {}
        result = None
        self._view.owner, self._view.cache = self, {}
        self._running.finish()  # the pass before's running statistics
        self._running.clear()  # what a pass that raised left
        for node, step in self._steps:
            if node.op == "placeholder":
                env[node] = x
                continue
            args = map_aggregate((node.args, node.kwargs),
                                 lambda a: env[a] if isinstance(a, Node) else a)
            value = step(args)
            if node.op == "output":
                result = value
                map_aggregate(value, self._watch_output)
            else:
                env[node] = value
        self._running.start()
        self._view.cache = {}
        return result
