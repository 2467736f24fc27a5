"""The planner for traced PyTorch models: ``parallelize(model, shape, layout="auto")``.

A traced, shape-propagated graph is described to the project's planner
(:mod:`disttensor_nn.plan`) as the planner's own kind of network: a
:class:`~disttensor_nn.Sequential` chain of layers, with a
:class:`~disttensor_nn.Residual` block for each merge of two paths (``+``
of a residual connection, ``torch.cat`` of skip connections or branches,
nested one path at a time; max unpooling of a path's values by the indices of
a max pooling before it, whose values are what the pooling's leaf lays out).
Each traced
operation is stood for by the built-in layer that does the same work, made
from the module's attributes (a convolution's kernel, stride, padding,
dilation and groups, a pool's window, a norm's features), so its cost spec,
kernel signature and twin are that layer's; an operation without one is a
:class:`TracedOp`, whose cost spec streams its block and prices the moves
the runtime makes for it. The planner chooses each layer's input
distribution; :func:`plan_layouts` turns the plan into a
:class:`~disttensor.Distribution` per layer on grids of the ranks, and
the compiler of :mod:`disttensor_nn.torch.parallel` redistributes where
consecutive layers' layouts differ.
"""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from disttensor import Distribution, ProcessGrid

from ..container import Residual, Sequential
from ..costspec import Allreduce, CostSpec, largest_block
from ..layers.conv import Conv1d, Conv2d, Conv3d
from ..layers.dense import Linear
from ..layers.dropout import Dropout
from ..layers.elementwise import LeakyReLU, ReLU, Sigmoid
from ..layers.groupnorm import GroupNorm
from ..layers.merge import Concat
from ..layers.norm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from ..layers.pool import (
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    GlobalAvgPool,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
)
from ..layers.transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from ..layers.upsample import Upsample
from ..module import Layer, Parameter
from ..plan import Plan, load_profile, make_plan
from ..plan.calibrate import calibrate_if_stale, calibration_path
from ..plan.costmodel import dist_for
from ..plan.make import kept_memory_format
from ..plan.tracing import leaf_nodes, trace
from ..window import WindowSpec
from .interpolation import INTERPOLATION_MODES
from .pricing import CONV_MODES, as_run, conversion_seconds, priced, whole_channels

__all__ = ["LAYOUT_KEY", "TracedOp", "is_plan_layout", "needs_grad", "plan_layouts", "relayout",
           "unbatched_error", "unbatched_node_error"]

#: The key of a relayout node's ``meta`` that holds the Distribution it moves its input to.
LAYOUT_KEY = "disttensor_layout"

# max unpooling: each module's function, and each function's module
_UNPOOL = {nn.MaxUnpool1d: F.max_unpool1d, nn.MaxUnpool2d: F.max_unpool2d,
           nn.MaxUnpool3d: F.max_unpool3d}
_UNPOOL_F = {f: m for m, f in _UNPOOL.items()}
_CONV = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d}
_CHANNEL_PARALLEL = (Conv1d, Conv2d, Conv3d)  # what the compiler runs on split channels
_CONV_T = {nn.ConvTranspose1d: ConvTranspose1d, nn.ConvTranspose2d: ConvTranspose2d,
           nn.ConvTranspose3d: ConvTranspose3d}
_POOL = {nn.MaxPool1d: MaxPool1d, nn.MaxPool2d: MaxPool2d, nn.MaxPool3d: MaxPool3d,
         nn.AvgPool1d: AvgPool1d, nn.AvgPool2d: AvgPool2d, nn.AvgPool3d: AvgPool3d}
_AVG = (AvgPool1d, AvgPool2d, AvgPool3d)
_ADAPTIVE = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_ADAPTIVE_F = (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)
# channel dropouts, by the spatial dimensions they take (the batched input has two more)
_FEATURE_DROPOUT_MODULES = {nn.Dropout1d: 1, nn.Dropout2d: 2, nn.Dropout3d: 3}
_FEATURE_DROPOUT_FUNCTIONS = {F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3}
_BATCHNORM = {nn.BatchNorm1d: BatchNorm1d, nn.BatchNorm2d: BatchNorm2d,
              nn.BatchNorm3d: BatchNorm3d}
_RESHAPES = frozenset(("view", "reshape", "flatten"))
_ALONG_DIM = frozenset(("cumsum", "cumprod", "logcumsumexp", "softmax", "log_softmax",
                        "softmin"))


def relayout(x: Any) -> Any:
    """The target of a node that moves its input to the layout in ``meta[LAYOUT_KEY]``.

    Never run: the compiler turns such a node into a redistribution, or
    nothing where the input is laid out so already.
    """
    return x


class TracedOp(Layer):
    """The planner's view of a traced operation that no built-in layer does.

    Its work is not timed: forward and backward each read and write the
    block once. Where the runtime makes dimensions of its input whole first
    (an operation along them, one it runs only on whole arrays), the cost
    spec has that redistribution; where it sums over split dimensions, that
    allreduce. The module's parameters count in the plan's memory.

    Parameters
    ----------
    name : str
        What the operation is (the plan table's layer column).
    out_shape : tuple of int
        Its output's global shape.
    whole : sequence of int
        Dimensions of the input the runtime makes whole first.
    reduced : sequence of int
        Dimensions of the input it sums over (an allreduce where they are split).
    params : sequence of tuple
        Shapes of the module's parameters.
    dtype : numpy dtype
        The parameters' dtype.
    """

    def __init__(self, name: str, out_shape: tuple[int, ...], whole: Sequence[int] = (),
                 reduced: Sequence[int] = (), params: Sequence[tuple[int, ...]] = (),
                 dtype: Any = np.float32):
        self.name = name
        self.out_shape = tuple(out_shape)
        self.whole = tuple(sorted(set(whole)))
        self.reduced = tuple(sorted(set(reduced)))
        for i, shape in enumerate(params):
            setattr(self, f"p{i}", Parameter(np.zeros(shape, dtype)))

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.out_shape

    def kernel_signature(self) -> str:
        return f"traced:{self.name}"

    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """Not timed: each pass streams the block; the moves and sums the runtime makes."""
        block = largest_block(dist)
        moves: tuple[Distribution, ...] = ()
        if any(dist.nblocks[d] > 1 for d in self.whole if d < dist.ndim):
            axes = [None if d in self.whole else a for d, a in enumerate(dist.axes)]
            target = Distribution(dist.global_shape, dist.grid_shape, axes)  # replicas
            moves = (target,)
            block = largest_block(target)
        sums = ()
        split = tuple(d for d in self.reduced if d < dist.ndim and dist.nblocks[d] > 1)
        if split:
            out = math.prod(b for d, b in enumerate(block) if d not in self.reduced)
            sums = (Allreduce(out * itemsize, split),)
        params = sum(math.prod(p.shape) for p in self.own_parameters())
        if params:
            sums += (Allreduce(params * 8, tuple(range(dist.ndim)), gradient=True),)
        return CostSpec(block, nbytes=2 * math.prod(block) * itemsize, timed=False,
                        redistributions=moves, allreduces=sums, keeps_input=True)

    def __repr__(self) -> str:
        return f"TracedOp({self.name})"


class _Unpooled:
    """The planner's merge of max unpooling: the values of one path scattered by the
    indices of a max pooling before it (its shape is the unpooled output's; the scatter
    is not priced, as a residual '+' is not)."""

    def __init__(self, out_shape: tuple[int, ...]):
        self.out_shape = tuple(out_shape)

    def output_shape(self, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
        return self.out_shape


class _Broadcast(_Unpooled):
    """The planner's merge of an element-wise operation whose second operand broadcasts
    against the first (its shape is the first's). The operation is not priced, as a
    residual '+' is not; the block prices the small operand's move to the first's layout
    (the runtime moves it to where it broadcasts, and sums its gradient over the ranks
    that split what it meets: both of the small tensor, not priced)."""


def _broadcasts(small: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether ``small`` broadcasts against ``shape`` (right-aligned, as in PyTorch)."""
    lead = len(shape) - len(small)
    return lead >= 0 and all(n in (1, shape[lead + i]) for i, n in enumerate(small))


class _GlobalMean(GlobalAvgPool):
    """:class:`GlobalAvgPool` whose output keeps the spatial dimensions (of length 1)."""

    def __init__(self, out_shape: tuple[int, ...]):
        self.out_shape = tuple(out_shape)

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.out_shape


@dataclass
class _Leaf:
    """One planned operation: its node, the node of its input, the layer standing for it,
    and the dimensions of its input the runtime needs whole."""

    node: Node
    source: Node
    layer: Layer
    whole: tuple[int, ...]
    name: str
    kind: str
    signature: str = ""


_WINDOW_MODULES = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd,
                   nn.modules.pooling._AvgPoolNd, nn.modules.pooling._MaxUnpoolNd,
                   nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd,
                   nn.modules.instancenorm._InstanceNorm)


def unbatched_error(m: nn.Module, shape: Sequence[int]) -> str:
    """Why a window module (convolution, pooling, unpooling, instance norm) cannot take an
    input of ``shape`` here, or "": it must be a batch ``(N, C, *S)`` of the module's
    spatial dimensions (PyTorch also takes them unbatched, ``(C, *S)``).

    Parameters
    ----------
    m : torch.nn.Module
        The module.
    shape : sequence of int
        Its input's shape.

    Returns
    -------
    str
        The reason, "" where ``m`` takes ``shape`` or is no window module.
    """
    if not isinstance(m, _WINDOW_MODULES):
        return ""
    # the spatial dimensions are the digit of PyTorch's own class ("Conv2d") in the MRO
    nd = next((int(c.__name__[-2]) for c in type(m).__mro__
               if c.__module__.startswith("torch.nn") and re.search(r"[123]d$", c.__name__)),
              None)
    return _batch_error(type(m).__name__, nd, shape)


def unbatched_node_error(gm: GraphModule, node: Node, shape: Sequence[int]) -> str:
    """:func:`unbatched_error` of a traced node: a window module's call, or a call of
    ``F.max_poolNd``, ``F.avg_poolNd`` or ``F.adaptive_avg_poolNd``.

    Parameters
    ----------
    gm : torch.fx.GraphModule
        The traced model.
    node : torch.fx.Node
        The node.
    shape : sequence of int
        Its input's shape.

    Returns
    -------
    str
        The reason, "" where the node takes ``shape`` or is no window operation.
    """
    if node.op == "call_module":
        return unbatched_error(gm.get_submodule(node.target), shape)
    pool = pool_module(node)
    if pool is not None:
        return unbatched_error(pool, shape)
    if node.op == "call_function" and node.target in _ADAPTIVE_F:
        return _batch_error(node.target.__name__, _ADAPTIVE_F.index(node.target) + 1, shape)
    return ""


def _batch_error(name: str, nd: int | None, shape: Sequence[int]) -> str:
    if nd is None or len(shape) == nd + 2:
        return ""
    return (f"{name} takes a batch (N, C) of {nd}-D samples here, {nd + 2} dimensions, "
            f"and its input has shape {tuple(shape)} (give an unbatched input a batch "
            "dimension of 1)")


# ------------------------------------------------------------------ the graph
def _fail(node: Node | None, why: str) -> None:
    where = f"node '{node.name}': " if node is not None else ""
    raise NotImplementedError(f"parallelize(layout='auto'): {where}{why}; give a grid shape "
                              "as the layout instead")


# the key of a max pooling node's meta (one with return_indices) that holds its values'
# metadata: the planner lays out the values (the indices follow them)
_VALUES_KEY = "disttensor_pooled_values"


def _shape(node: Node) -> tuple[int, ...] | None:
    meta = node.meta.get(_VALUES_KEY, node.meta.get("tensor_meta"))
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _pooled_with_indices(gm: GraphModule, node: Node) -> bool:
    """Whether ``node`` is max pooling that returns ``(values, indices)``."""
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        return type(m) in _POOL and bool(getattr(m, "return_indices", False))
    pool = pool_module(node)
    return pool is not None and bool(getattr(pool, "return_indices", False))


def _is_unpool(gm: GraphModule, node: Node) -> bool:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)) in _UNPOOL
    return node.op == "call_function" and node.target in _UNPOOL_F


def _inputs(node: Node) -> list[Node]:
    out: list[Node] = []
    map_aggregate((node.args, node.kwargs),
                  lambda a: out.append(a) if isinstance(a, Node) and a not in out else None)
    return out


def needs_grad(gm: GraphModule) -> dict[Node, bool]:
    """Whether each node's value needs a gradient in training.

    A value needs one where it depends on a parameter that requires a gradient
    (a module's, or one the graph reads as an attribute); the model's input
    needs none, as PyTorch takes a tensor fed to a model, so the operations
    before the first parameter compute no input gradient.

    Parameters
    ----------
    gm : GraphModule
        The traced model.

    Returns
    -------
    dict
        Node to whether its value needs a gradient.
    """
    out: dict[Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            out[n] = False
        elif n.op == "get_attr":
            value: Any = gm
            for part in str(n.target).split("."):
                value = getattr(value, part)
            out[n] = isinstance(value, torch.Tensor) and value.requires_grad
        else:
            own = n.op == "call_module" and any(
                p.requires_grad for p in gm.get_submodule(n.target).parameters())
            out[n] = own or any(out.get(a, False) for a in _inputs(n))
    return out


class _Graph:
    """The tensors that depend on the input, their producers and the immediate dominators."""

    def __init__(self, gm: GraphModule):
        nodes = list(gm.graph.nodes)
        places = [n for n in nodes if n.op == "placeholder"]
        self.source = places[0]
        self.data: dict[Node, list[Node]] = {self.source: []}
        # the values and the indices of max pooling that returns both: no operation
        self.alias: set[Node] = set()
        pooled: set[Node] = set()
        for n in nodes:
            if n.op in ("placeholder", "output"):
                continue
            preds = [a for a in _inputs(n) if a in self.data]
            meta = n.meta.get("tensor_meta")
            if preds and isinstance(meta, (tuple, list)) and not hasattr(meta, "shape"):
                if not (_pooled_with_indices(gm, n) and len(meta) == 2):
                    _fail(n, "the planner plans operations of one output, and max pooling "
                             "with return_indices (this one returns several)")
                n.meta[_VALUES_KEY] = meta[0]
                pooled.add(n)
            if preds and n.op == "call_function" and n.target is operator.getitem and \
                    preds[0] in pooled:
                if not isinstance(n.args[1], int) or n.args[1] not in (0, 1, -1, -2):
                    _fail(n, "it takes other than the values or the indices of max pooling")
                self.alias.add(n)
            if preds and _shape(n) is not None:
                self.data[n] = preds
        out = [n for n in nodes if n.op == "output"][0]
        results = [a for a in _inputs(out) if a in self.data]
        if len(results) != 1 or _shape(results[0]) is None or \
                not isinstance(out.args[0], Node):
            _fail(None, "the planner plans models that return one tensor")
        self.result = results[0]
        self.order = {n: i for i, n in enumerate(nodes)}
        self.idom: dict[Node, Node | None] = {self.source: None}
        self.depth = {self.source: 0}
        for n, preds in self.data.items():
            if n is self.source:
                continue
            d = preds[0]
            for p in preds[1:]:
                d = self._common(d, p)
            self.idom[n] = d
            self.depth[n] = self.depth[d] + 1

    def _common(self, a: Node, b: Node) -> Node:
        while a is not b:
            if self.depth[a] >= self.depth[b]:
                a = self.idom[a]
            else:
                b = self.idom[b]
        return a


# ------------------------------------------------------------------ layers
def _np_dtype(dtype: torch.dtype) -> Any:
    return {torch.float64: np.float64, torch.float16: np.float16}.get(dtype, np.float32)


def _index_dims(index: Any, ndim: int) -> list[int] | None:
    """The dimensions ``x[index]`` narrows (None: not slices and ints alone)."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > ndim or not all(isinstance(i, (slice, int)) and not isinstance(i, bool)
                                    for i in index):
        return None
    return [d for d, i in enumerate(index) if i != slice(None)]


def _arg(node: Node, index: int, name: str, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


# the functional poolings, as the module each one is, and its arguments after the input
_MAX_ARGS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG_ARGS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
             "divisor_override")
_POOL_FUNCTIONS = {F.max_pool1d: (nn.MaxPool1d, _MAX_ARGS),
                   F.max_pool2d: (nn.MaxPool2d, _MAX_ARGS),
                   F.max_pool3d: (nn.MaxPool3d, _MAX_ARGS),
                   # what F.max_poolNd(..., return_indices=True) traces to
                   F.max_pool1d_with_indices: (nn.MaxPool1d, _MAX_ARGS),
                   F.max_pool2d_with_indices: (nn.MaxPool2d, _MAX_ARGS),
                   F.max_pool3d_with_indices: (nn.MaxPool3d, _MAX_ARGS),
                   F.avg_pool1d: (nn.AvgPool1d, _AVG_ARGS[:-1]),
                   F.avg_pool2d: (nn.AvgPool2d, _AVG_ARGS),
                   F.avg_pool3d: (nn.AvgPool3d, _AVG_ARGS)}


def pool_module(node: Node) -> nn.Module | None:
    """The ``nn.MaxPoolNd`` or ``nn.AvgPoolNd`` a call of ``F.max_poolNd`` or
    ``F.avg_poolNd`` is (None for another node, or one whose arguments are computed)."""
    if node.op != "call_function":
        return None
    try:
        entry = _POOL_FUNCTIONS.get(node.target)
    except TypeError:  # an unhashable target
        return None
    if entry is None:
        return None
    cls, names = entry
    kwargs = {name: _arg(node, 1 + i, name, None) for i, name in enumerate(names)}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if any(isinstance(v, Node) for v in kwargs.values()) or "kernel_size" not in kwargs:
        return None
    if kwargs.get("stride") in ([], ()):  # PyTorch's "the kernel size"
        del kwargs["stride"]
    if "with_indices" in getattr(node.target, "__name__", ""):
        kwargs["return_indices"] = True
    return cls(**kwargs)


def _dims(dim: Any, ndim: int) -> list[int]:
    if dim is None:
        return list(range(ndim))
    return sorted({int(d) % ndim for d in (dim if isinstance(dim, (tuple, list)) else [dim])})


class _Mirror:
    """Builds the planner's network for a traced graph (see the module's notes)."""

    def __init__(self, gm: GraphModule, dtype: torch.dtype,
                 elementwise: Callable[[Node], bool], batch_norm_stats: str = "global",
                 channels_last: bool = False, channel_splits: bool = False):
        self.gm = gm
        self.batch_norm_stats = batch_norm_stats
        self.channels_last = channels_last
        self.channel_splits = channel_splits
        self.graph = _Graph(gm)
        self.dtype = _np_dtype(dtype)
        self.elementwise = elementwise
        self.leaves: list[_Leaf] = []
        self.grads = needs_grad(gm)
        self.names: set[str] = set()

    # ------------------------------------------------------------ structure
    def chain(self, start: Node, end: Node) -> list[Any]:
        """The items from ``start``'s value (excluded) to ``end``'s (included)."""
        items: list[Any] = []
        cur = end
        while cur is not start:
            preds = self.graph.data[cur]
            if cur is self.graph.source:  # pragma: no cover - start dominates end
                _fail(end, "the graph is not a chain of blocks")
            if cur in self.graph.alias:  # a pooling's values or indices: no operation
                cur = preds[0]
                continue
            if len(preds) == 1:
                items.append(cur)
                cur = preds[0]
                continue
            fork = self.graph.idom[cur]
            items.append(("merge", cur, fork))
            cur = fork
        return items[::-1]

    def build(self, start: Node, end: Node) -> Sequential:
        layers: list[Layer] = []
        for item in self.chain(start, end):
            if isinstance(item, tuple):
                layers.append(self.merge(item[1], item[2]))
            else:
                layers.append(self.leaf(item))
        return Sequential(*layers)

    def merge(self, node: Node, fork: Node) -> Residual:
        """Two paths from ``fork`` merged (``+``, or ``torch.cat`` along the channels: of
        several paths, as nested blocks, each joining one more)."""
        shape = _shape(node)
        preds = self.graph.data[node]
        if _is_unpool(self.gm, node):  # values and the indices of a max pooling before
            values, indices = _arg(node, 0, "input", None), _arg(node, 1, "indices", None)
            if values not in preds or indices not in preds or values is indices:
                _fail(node, "max unpooling of other than a path's values and the indices "
                            "of a max pooling")
            side = self.build(fork, indices)
            return Residual(self.build(fork, values), side if len(side) else None,
                            merge=_Unpooled(shape))
        if node.op == "call_function" and node.target in (torch.cat, torch.concat):
            operands = list(node.args[0])
            if _arg(node, 1, "dim", 0) % len(shape) != 1:
                _fail(node, "torch.cat joins skip connections along the channels only")
            if len(set(operands)) != len(operands) or any(a not in preds for a in operands):
                _fail(node, "torch.cat joins tensors other than distinct paths of the input")
            block: Layer = self.build(fork, operands[0])
            for a in operands[1:]:
                block = Residual(block, self.build(fork, a) if a is not fork else None,
                                 merge=Concat(1))
            return block
        if len(preds) != 2:
            _fail(node, f"it joins {len(preds)} tensors; the planner plans merges of two "
                        "(a residual '+') or a torch.cat along the channels")
        first, second = [a for a in _inputs(node) if a in preds]
        if self.elementwise(node) and _shape(first) != _shape(second) \
                and shape in (_shape(first), _shape(second)):
            # one operand broadcasts against the other (a squeeze-and-excitation gate, an
            # attention map): the merge takes the whole one's layout, the other moved to
            # where it broadcasts against its blocks (priced as a move of the small one)
            full, side = (first, second) if _shape(first) == shape else (second, first)
            if side is fork or not _broadcasts(_shape(side), shape):
                _fail(node, f"it broadcasts a tensor of shape {_shape(side)} against one of "
                            f"shape {shape} that it does not lead to")
            return Residual(self.build(fork, full), self.build(fork, side),
                            merge=_Broadcast(shape))
        if not self.elementwise(node) or _shape(first) != shape or _shape(second) != shape:
            _fail(node, "it joins two tensors other than element-wise, shape for shape")
        return Residual(self.build(fork, first), self.build(fork, second)
                        if second is not fork else None)

    # ------------------------------------------------------------ leaves
    def leaf(self, node: Node) -> Layer:
        source = self.graph.data[node][0]
        in_shape, out = _shape(source), _shape(node)
        ndim = len(_shape(self.graph.source))
        for s in (in_shape, out):
            if len(s) not in (2, ndim):
                _fail(node, f"a tensor of shape {s}: the planner lays out tensors of the "
                            f"input's {ndim} dimensions or of 2 (samples, features)")
        why = unbatched_node_error(self.gm, node, in_shape)
        if why:
            raise ValueError(f"parallelize: node '{node.name}': {why}")
        layer, whole, kind = self.layer_for(node, in_shape, out)
        try:
            ok = tuple(layer.output_shape(in_shape)) == out
            layer.cost_spec(dist_for(in_shape, (1,) * max(len(in_shape) - 1, 1)), 8)
        except (ValueError, TypeError):
            ok = False
        if not ok:  # the built-in layer does not take it as PyTorch does: a traced op
            layer = TracedOp(kind, out, whole, params=self.params(node), dtype=self.dtype)
        if node.op == "call_module" and ok and len(node.args) == 1 and not node.kwargs:
            # timed as the module itself where it runs as itself (pricing.priced)
            layer = priced(layer, self.gm.get_submodule(node.target), self.channels_last)
        if self.channel_splits and not isinstance(layer, _CHANNEL_PARALLEL):
            layer = whole_channels(layer)  # the compiler splits channels for convolutions
            # alone (pricing.CONV_MODES)
        layer.input_grad = self.grads[source]  # none before the first parameter
        # a module called again is named by its node ('pool_1'), as torch.fx names it
        name = node.target if node.op == "call_module" and node.target not in self.names \
            else node.name
        self.names.add(str(name))
        self.leaves.append(_Leaf(node, source, layer, tuple(whole), str(name), kind,
                                 _signature(self.gm, node)))
        return layer

    def params(self, node: Node) -> list[tuple[int, ...]]:
        shapes = []
        if node.op == "call_module":
            shapes += [tuple(p.shape) for p in self.gm.get_submodule(node.target).parameters()]
        for a in _inputs(node):
            if a.op == "get_attr" and _shape(a) is not None:
                shapes.append(_shape(a))
        return shapes

    def traced(self, kind: str, out: tuple[int, ...], node: Node, whole: Sequence[int] = (),
               reduced: Sequence[int] = ()) -> tuple[Layer, list[int], str]:
        return TracedOp(kind, out, whole, reduced, self.params(node), self.dtype), \
            list(whole), kind

    def layer_for(self, node: Node, shape: tuple[int, ...], out: tuple[int, ...]
                  ) -> tuple[Layer, list[int], str]:
        """The layer standing for ``node``, the dimensions its input needs whole, its name."""
        nd = len(shape) - 2
        dt = self.dtype
        if node.op == "call_module":
            m = self.gm.get_submodule(node.target)
            kind = type(m).__name__
            if type(m) in _CONV:
                return _CONV[type(m)](m.in_channels, m.out_channels, m.kernel_size, m.stride,
                                      m.padding, m.dilation, m.groups, m.bias is not None,
                                      m.padding_mode, dtype=dt), [], kind
            if type(m) in _CONV_T:
                return _CONV_T[type(m)](m.in_channels, m.out_channels, m.kernel_size,
                                        m.stride, m.padding, m.output_padding, m.groups,
                                        m.bias is not None, m.dilation, dtype=dt), [], kind
            if type(m) in _POOL:
                return self.pool(_POOL[type(m)], m, shape, out), [], kind
            if isinstance(m, _ADAPTIVE):
                return self.adaptive(node, shape, out, kind)
            if type(m) in _BATCHNORM:
                return _BATCHNORM[type(m)](m.num_features, m.eps, m.momentum or 0.1,
                                           m.affine, m.track_running_stats,
                                           stats=self.batch_norm_stats, dtype=dt), [], kind
            if isinstance(m, nn.GroupNorm):
                return GroupNorm(m.num_groups, m.num_channels, m.eps, m.affine,
                                 dtype=dt), [], kind
            if isinstance(m, nn.LayerNorm):  # its sums all-reduced where it is split
                return self.traced(kind, out, node, reduced=range(
                    nd + 2 - len(m.normalized_shape), nd + 2))
            if isinstance(m, nn.Upsample):
                return self.upsample(node, shape, out, m.mode, m.align_corners, kind, False,
                                     m.scale_factor, m.recompute_scale_factor)
            if (type(m) is nn.Dropout or len(shape) == _FEATURE_DROPOUT_MODULES.get(
                    type(m), -3) + 2) and 0 <= m.p < 1:  # priced as element-wise dropout
                return Dropout(m.p), [], kind
            if isinstance(m, nn.Flatten):
                return self.traced(kind, out, node, range(m.start_dim % len(shape), len(shape)))
            if isinstance(m, nn.Linear) and len(shape) == 2:
                return Linear(m.in_features, m.out_features, m.bias is not None,
                              dtype=dt), [], kind
            if isinstance(m, nn.Linear):
                return self.traced(kind, out, node, [len(shape) - 1])
            if isinstance(m, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
                return self.traced(kind, out, node, [(m.dim if m.dim is not None else 1)
                                                     % len(shape)])
            if type(m) is nn.ReLU:
                return ReLU(), [], kind
            if type(m) is nn.LeakyReLU:
                return LeakyReLU(m.negative_slope), [], kind
            if type(m) is nn.Sigmoid:
                return Sigmoid(), [], kind
            if isinstance(m, nn.PReLU) and m.num_parameters > 1:
                return self.traced(kind, out, node, [1])
            if self.elementwise(node):
                return self.traced(kind, out, node)
            return self.traced(kind, out, node, range(len(shape)))
        fn = node.target
        kind = fn if isinstance(fn, str) else getattr(fn, "__name__", str(fn))
        if fn in (F.relu, torch.relu):
            return ReLU(), [], kind
        if fn in (torch.sigmoid, F.sigmoid):
            return Sigmoid(), [], kind
        if fn is F.interpolate:
            return self.upsample(node, shape, out, _arg(node, 3, "mode", "nearest"),
                                 _arg(node, 4, "align_corners", None), kind,
                                 bool(_arg(node, 6, "antialias", False)),
                                 _arg(node, 2, "scale_factor", None),
                                 _arg(node, 5, "recompute_scale_factor", None))
        if fn is F.dropout or len(shape) == _FEATURE_DROPOUT_FUNCTIONS.get(fn, -3) + 2:
            p = _arg(node, 1, "p", 0.5)
            if isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p < 1:
                return Dropout(p), [], kind
        if fn in _ADAPTIVE_F:
            return self.adaptive(node, shape, out, kind)
        pool = pool_module(node)
        if pool is not None:  # priced by its values (with return_indices too)
            return self.pool(_POOL[type(pool)], pool, shape, out), [], kind
        if fn is F.layer_norm:  # its sums all-reduced where it is split (parameters or none)
            norm = _arg(node, 1, "normalized_shape", None)
            norm = (norm,) if isinstance(norm, int) else norm
            if isinstance(norm, (tuple, list)) and 0 < len(norm) <= len(shape) and all(
                    a is None or (isinstance(a, Node) and a.op == "get_attr")
                    for a in (_arg(node, 2, "weight", None), _arg(node, 3, "bias", None))):
                return self.traced(kind, out, node,
                                   reduced=range(len(shape) - len(norm), len(shape)))
        if fn is torch.flatten or (node.op == "call_method" and fn in _RESHAPES):
            p = 0
            while p < min(len(out), len(shape)) and out[p] == shape[p]:
                p += 1
            return self.traced(kind, out, node, range(p, len(shape)))
        if fn in (torch.mean, torch.sum) or (node.op == "call_method" and fn in ("mean", "sum")):
            dims = _dims(_arg(node, 1, "dim", None), len(shape))
            if kind == "mean" and dims == list(range(2, len(shape))) and len(shape) > 2:
                return (_GlobalMean(out) if len(out) == len(shape) else GlobalAvgPool()), \
                    [], kind
            return self.traced(kind, out, node, reduced=dims)
        if fn is operator.getitem:
            dims = _index_dims(node.args[1], len(shape))
            return self.traced(kind, out, node, range(len(shape)) if dims is None else dims)
        if (node.op == "call_method" and fn == "permute") or self.elementwise(node):
            return self.traced(kind, out, node)
        if fn in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax) or \
                kind in _ALONG_DIM:
            dim = _arg(node, 1, "dim", None)
            if isinstance(dim, int) and out == shape:
                return self.traced(kind, out, node, [dim % len(shape)])
        return self.traced(kind, out, node, range(len(shape)))

    def pool(self, cls: type, m: nn.Module, shape: tuple[int, ...], out: tuple[int, ...]
             ) -> Layer:
        """The built-in pool, with the extra padding after that ``ceil_mode`` means."""
        nd = len(shape) - 2
        stride = m.stride if m.stride is not None else m.kernel_size
        dilation = getattr(m, "dilation", 1)
        spec = WindowSpec.make(nd, m.kernel_size, stride, m.padding, dilation)
        pads = list(spec.padding)
        for i in range(nd):
            extra = (out[2 + i] - spec.out_length(i, shape[2 + i])) * spec.stride[i]
            pads[i] = (pads[i][0], pads[i][1] + max(0, extra))
        if cls in _AVG:
            return cls(spec.kernel, spec.stride, tuple(pads))
        return cls(spec.kernel, spec.stride, tuple(pads), spec.dilation)

    def adaptive(self, node: Node, shape: tuple[int, ...], out: tuple[int, ...], kind: str
                 ) -> tuple[Layer, list[int], str]:
        nd = len(shape) - 2
        ins, outs = shape[2:], out[2:]
        if all(o == 1 for o in outs):
            return _GlobalMean(out), [], kind
        if all(o and n % o == 0 for n, o in zip(ins, outs)):
            k = tuple(n // o for n, o in zip(ins, outs))
            return (AvgPool1d, AvgPool2d, AvgPool3d)[nd - 1](k, k), [], kind
        return self.traced(kind, out, node)  # windows of any sizes, over a halo

    def upsample(self, node: Node, shape: tuple[int, ...], out: tuple[int, ...], mode: str,
                 align_corners: Any, kind: str, antialias: bool, scale_factor: Any,
                 recompute_scale_factor: Any) -> tuple[Layer, list[int], str]:
        """The interpolation's layer, and the dimensions the runtime needs whole for it
        (as ``parallelize`` compiles it: a scale computed in forward, or antialiasing
        other than by an integer scale in a linear mode, splits nothing)."""
        nd = len(shape) - 2
        uneven = [2 + i for i in range(nd) if out[2 + i] % shape[2 + i]]
        if mode == "area":  # adaptive average pooling
            return self.adaptive(node, shape, out, kind)
        given = scale_factor if isinstance(scale_factor, (tuple, list)) else \
            (scale_factor,) * nd
        if mode not in INTERPOLATION_MODES or any(isinstance(v, Node) for v in given):
            return self.traced(kind, out, node, range(2, 2 + nd))
        exact = scale_factor is None or bool(recompute_scale_factor) or all(
            float(v) * shape[2 + i] == out[2 + i] for i, v in enumerate(given))
        if antialias and (mode == "bicubic" or uneven or align_corners or not exact):
            return self.traced(kind, out, node, range(2, 2 + nd))
        if uneven:  # rows read about each block, priced as a traced operation
            return self.traced(kind, out, node)
        try:
            return Upsample(size=tuple(out[2:]), mode=mode), [], kind
        except ValueError:  # a mode the built-in layer has not: its halo, untimed
            return self.traced(kind, out, node)


# ------------------------------------------------------------------ the plan
def _same_entries(plan: Plan, leaves: list[_Leaf], shape: tuple[int, ...], nprocs: int
                  ) -> str | None:
    """Why ``plan`` is not a plan of this model (None where it is)."""
    if tuple(plan.batch_shape) != tuple(shape):
        return f"it is for the input shape {tuple(plan.batch_shape)}, not {tuple(shape)}"
    if plan.nprocs != nprocs:
        return f"it is for {plan.nprocs} ranks, not {nprocs}"
    if len(plan.entries) != len(leaves):
        return f"it has {len(plan.entries)} layers, the model {len(leaves)}"
    for e, leaf in zip(plan.entries, leaves):
        if (e.name, e.layer, tuple(e.in_shape)) != (leaf.name, leaf.kind,
                                                    tuple(_shape(leaf.source))):
            return (f"its layer '{e.name}' ({e.layer}, input {tuple(e.in_shape)}) is the "
                    f"model's '{leaf.name}' ({leaf.kind}, input {_shape(leaf.source)})")
        if e.signature and e.signature != leaf.signature:  # older plans record none
            return f"its layer '{e.name}' is {e.signature}, the model's {leaf.signature}"
    return None


def _signature(gm: GraphModule, node: Node) -> str:
    """What a planned operation is, beyond its kind and input shape: a module's own
    description (its kernel, stride, channels, ...), or a function's or method's name and
    arguments, tensors given by their shapes."""
    if node.op == "call_module":
        text = repr(gm.get_submodule(node.target))
    else:
        target = node.target if isinstance(node.target, str) else getattr(
            node.target, "__name__", type(node.target).__name__)
        args = map_aggregate((node.args, node.kwargs),
                             lambda a: _shape(a) if isinstance(a, Node) else a)
        text = f"{target}{args!r}"
    return _ADDRESS.sub("", text)  # an object's place in memory differs from run to run


# " at 0x7f...": what a default repr says of an object's address
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _given_plan(layout: Any) -> Plan | None:
    """The plan ``layout`` names (a Plan, or the path of its JSON), or None for 'auto'."""
    if isinstance(layout, Plan):
        return layout
    if isinstance(layout, str) and layout == "auto":
        return None
    path = Path(layout)
    if not path.is_file():
        raise ValueError(f"parallelize: layout must be 'auto', a Plan, a plan's JSON file or "
                         f"a grid shape; there is no file {str(layout)!r}")
    try:
        return Plan.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"parallelize: {str(layout)!r} is not a plan's JSON ({err})") from None


def is_plan_layout(layout: Any) -> bool:
    """Whether ``layout`` asks for a plan: 'auto', a Plan, or a path (not a grid shape)."""
    return isinstance(layout, (str, os.PathLike, Plan))


MEMORY_FORMATS = ("contiguous", "channels_last", "auto")
"""What :func:`plan_layouts` plans the blocks' memory layout as: ``(N, C, *S)``,
channels-last, or whichever of the two the plan predicts faster."""


def plan_layouts(gm: GraphModule, shape: tuple[int, ...], dtype: torch.dtype, layout: Any,
                 memory_per_rank: float | None, machine: Any, comm: MPI.Intracomm,
                 elementwise: Callable[[Node], bool], baseline: float = 0.0,
                 batch_norm_stats: str = "global", memory_format: str = "contiguous",
                 channel_splits: bool = False) -> tuple[Plan, Distribution]:
    """Plan the traced model (or check a given plan) and mark its graph with the layouts.

    Before each planned operation a :func:`relayout` node is inserted on its
    input, holding in ``meta[LAYOUT_KEY]`` the Distribution the plan gives
    that input (the dimensions the operation needs whole left whole).
    Everything is decided on every rank alike before the first message
    (the grids' communicators are made last); on a measured machine profile
    the kernels are timed on all ranks at once first (:func:`make_plan`).

    Parameters
    ----------
    gm : GraphModule
        The traced model, its shapes propagated (``meta['tensor_meta']``).
    shape : tuple of int
        The global input shape.
    dtype : torch.dtype
        The parameters' dtype (the activations' bytes per element).
    layout : 'auto', Plan or path
        Plan it, or the plan (or its JSON file) to apply.
    memory_per_rank : float, optional
        Bytes per rank the plan must fit (default: the profile's).
    machine : str or None
        A machine profile's name or JSON file (:func:`disttensor_nn.plan.load_profile`);
        None: ``'this'``, this machine's calibrated profile (calibrated first, on
        ``comm``, where the cached calibration was taken with another number of ranks
        per node and none taken with this job's is kept:
        :func:`~disttensor_nn.plan.calibrate.stale_calibration`).
    comm : MPI.Intracomm
        The ranks.
    elementwise : callable
        Whether the compiler runs a node on blocks of any split.
    baseline : float
        Resident bytes of a rank besides the model's data, part of the
        predicted peak (:func:`~disttensor_nn.plan.make_plan`'s).
    batch_norm_stats : {'global', 'group'}
        The batch norms' statistics (:func:`~disttensor_nn.torch.parallelize`'s), priced
        as :class:`~disttensor_nn.BatchNorm2d`'s ``stats`` prices them.
    memory_format : {'contiguous', 'channels_last', 'auto'}
        How the blocks lie in memory: the modules that run as themselves are
        timed on blocks so (:class:`~disttensor_nn.torch.pricing.ModuleTwin`).
        ``'auto'``: on a measured machine profile, with 4-D or 5-D inputs, the
        model is planned both ways and channels-last kept where predicted faster by
        more than :data:`~disttensor_nn.plan.make.CHANNELS_LAST_GAIN`;
        otherwise ``'contiguous'`` (nothing would tell the two apart). Ignored
        for a given plan (its own ``memory_format`` holds).
    channel_splits : bool
        Also consider grids over ``(N, C, *S)``: convolutions whose input channels
        are split (their partial outputs summed over those ranks) or that run whole
        on each replica of the channel axis (:data:`~.pricing.CONV_MODES`); every
        other operation takes its channels whole there.

    Returns
    -------
    plan : Plan
        Its entries named by the model's modules (or nodes), one per operation;
        its ``memory_format`` the blocks' (``'contiguous'`` or ``'channels_last'``).
    input_dist : Distribution
        The distribution of the model's input.

    Raises
    ------
    NotImplementedError
        For a graph the planner cannot describe (naming the node): paths
        that share a layer and merge elsewhere, an element-wise merge of
        more than two tensors, a cat along other than the channels, an
        operation of several outputs (but max pooling with its indices).
    ValueError
        When no plan fits the memory budget, or for a plan of another model,
        input shape or rank count.
    """
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"parallelize: memory_format must be one of {MEMORY_FORMATS}, got "
                         f"{memory_format!r}")
    given = _given_plan(layout)
    name = "this" if machine is None else machine
    # the graph described (or refused) before anything is measured: (N, C, *S) blocks
    described = {"contiguous": _mirrored(gm, shape, dtype, elementwise, batch_norm_stats,
                                         False, channel_splits)}
    if given is None and name in ("this", "this-gpu") and comm.Get_size() > 1:
        # a calibration taken with another number of ranks per node prices every message
        # wrongly (4 ranks on 2 cores: a point-to-point latency 4x that of 2 ranks): the
        # one for this job's, by its own file, whatever another job caches meanwhile
        device = "gpu" if name == "this-gpu" else "cpu"
        calibrate_if_stale(comm, device)
        name = calibration_path(comm, device)
    if given is not None:
        options = [given.memory_format]
    elif memory_format == "auto":  # both where kernels are timed; else nothing tells
        measured = load_profile(name).measured and len(shape) in (4, 5)
        options = ["contiguous", "channels_last"] if measured else ["contiguous"]
    else:
        options = [memory_format]
    made: list[tuple[Plan, _Mirror, list[_Leaf]]] = []
    times = []
    for fmt in options:
        mirror, network, leaves = described.get(fmt) or _mirrored(
            gm, shape, dtype, elementwise, batch_norm_stats, fmt == "channels_last",
            channel_splits)
        plan = given if given is not None else _make(
            network, leaves, shape, dtype, name, memory_per_rank, comm, baseline, fmt,
            channel_splits)
        times.append(plan.time)
        made.append((plan, mirror, leaves))
    plan, mirror, leaves = made[0] if len(made) == 1 else \
        made[options.index(kept_memory_format(*times))]
    if len(options) > 1:
        plan.notes.append("memory format chosen: " + ", ".join(
            f"{fmt} {1e3 * t:.2f} ms" for fmt, t in zip(options, times)) +
            f" predicted; {plan.memory_format} kept")
    if given is not None:
        # decided alike: the first reason any rank finds (a module's description may name
        # what differs between ranks, a device say)
        why = next((w for w in comm.allgather(_same_entries(plan, leaves, shape,
                                                             comm.Get_size())) if w), None)
        if why is not None:
            raise ValueError(f"parallelize: the plan was made for another model: {why}")
    return plan, _relayouts(gm, plan, mirror, leaves, shape, comm)


def _mirrored(gm: GraphModule, shape: tuple[int, ...], dtype: torch.dtype,
              elementwise: Callable[[Node], bool], batch_norm_stats: str,
              channels_last: bool, channel_splits: bool = False
              ) -> tuple[_Mirror, Any, list[_Leaf]]:
    """The planner's network for the traced graph, and its leaves in the planner's order
    (refused where the graph is not a chain of layers with residual and skip
    connections)."""
    mirror = _Mirror(gm, dtype, elementwise, batch_norm_stats, channels_last, channel_splits)
    network = mirror.build(mirror.graph.source, mirror.graph.result)
    leaves = mirror.leaves
    if not leaves:
        _fail(None, "the model has no operation to plan")
    nodes = leaf_nodes(trace(network, tuple(shape)))
    order = {id(leaf.layer): leaf for leaf in leaves}
    leaves = [order[id(n.layer)] for n in nodes]  # the planner's order
    seen: set[Node] = set()
    for leaf in leaves:
        if leaf.node in seen:  # on two paths that merge elsewhere: not series-parallel
            _fail(leaf.node, "its output feeds paths that the planner cannot nest as residual "
                             "or skip connections of one block")
        seen.add(leaf.node)
    if len(leaves) != sum(1 for n in mirror.graph.data if n is not mirror.graph.source
                          and n not in mirror.graph.alias and not _is_merge(mirror.graph, n)
                          and _reaches(mirror.graph, n)):
        _fail(None, "its graph is not a chain of layers with residual and skip connections")
    return mirror, network, leaves


def _make(network: Any, leaves: list[_Leaf], shape: tuple[int, ...], dtype: torch.dtype,
          name: str, memory_per_rank: float | None, comm: MPI.Intracomm, baseline: float,
          memory_format: str, channel_splits: bool = False) -> Plan:
    """The planner's plan of ``network`` (its entries named by the model's modules)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    profile = load_profile(name)
    try:
        plan, _ = make_plan(network, tuple(shape), comm.Get_size(), name, memory_per_rank,
                            itemsize=itemsize, comm=comm if profile.measured else None,
                            kernels="torch", baseline=baseline, runs_as=as_run,
                            channels=channel_splits and len(shape) > 2, modes=CONV_MODES)
    except ValueError as err:
        raise ValueError(f"parallelize: {err}") from None
    plan = replace(plan, memory_format=memory_format,
                   entries=[replace(e, name=leaf.name, layer=leaf.kind,
                                    signature=leaf.signature)
                            for e, leaf in zip(plan.entries, leaves)])
    if memory_format == "channels_last" and profile.measured:
        # the parallel model puts each input block it is given as (N, C, *S) in this layout
        block = largest_block(dist_for(tuple(shape), tuple(plan.entries[0].grid),
                                       inner=plan.inner))
        t = conversion_seconds(block, dtype, comm)
        plan = replace(plan, time=plan.time + t, compute=plan.compute + t,
                       notes=[*plan.notes, f"input blocks put in channels-last layout: "
                              f"{1e3 * t:.2f} ms a step (timed), in the time and the compute"])
    return plan


def _relayouts(gm: GraphModule, plan: Plan, mirror: _Mirror, leaves: list[_Leaf],
               shape: tuple[int, ...], comm: MPI.Intracomm) -> Distribution:
    """Insert a :func:`relayout` node before each planned operation (its input's
    Distribution in ``meta[LAYOUT_KEY]``); the model input's distribution."""
    nprocs = comm.Get_size()
    pures = []
    for leaf, entry in zip(leaves, plan.entries):  # all checked before the grids are made
        try:
            pure = dist_for(_shape(leaf.source), tuple(entry.grid), entry.split_channels,
                            inner=plan.inner)
        except ValueError as err:
            raise ValueError(f"parallelize: the plan's layer '{entry.name}': {err}") from None
        if math.prod(pure.grid_shape) != nprocs:
            raise ValueError(f"parallelize: the plan's layer '{entry.name}' has the grid "
                             f"{tuple(entry.grid)}, which does not hold the {nprocs} ranks")
        pures.append(pure)
    grids: dict[tuple[int, ...], ProcessGrid] = {}
    input_dist = None
    for leaf, pure in zip(leaves, pures):
        in_shape = _shape(leaf.source)
        axes = [None if d in leaf.whole or in_shape[d] <= 1 else a
                for d, a in enumerate(pure.axes)]
        if pure.grid_shape not in grids:
            grids[pure.grid_shape] = ProcessGrid(pure.grid_shape, comm)
        dist = Distribution(in_shape, grids[pure.grid_shape], axes)
        with gm.graph.inserting_before(leaf.node):
            move = gm.graph.call_function(relayout, (leaf.source,))
        move.meta = {**leaf.source.meta, LAYOUT_KEY: dist}
        leaf.node.replace_input_with(leaf.source, move)
        if input_dist is None and leaf.source is mirror.graph.source:
            input_dist = dist
    if input_dist is None:  # the input goes to a merge first: the first layer's grid
        grid = grids[dist_for(shape, tuple(plan.entries[0].grid), inner=plan.inner).grid_shape]
        input_dist = Distribution(tuple(shape), grid, (None,) * len(shape))
    return input_dist


def _is_merge(graph: _Graph, node: Node) -> bool:
    return len(graph.data[node]) > 1


def _reaches(graph: _Graph, node: Node) -> bool:
    """Whether the model's result depends on ``node``."""
    seen, todo = set(), [graph.result]
    while todo:
        n = todo.pop()
        if n is node:
            return True
        if n not in seen:
            seen.add(n)
            todo += graph.data.get(n, [])
    return False
