"""What :func:`~disttensor_nn.torch.parallelize`'s compiler knows of each node's value, and
what every rule shares: errors raised alike on every rank, the ranks that sum each
parameter's gradient, and the generic rule that runs an operation on whole blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from disttensor import Distribution, ProcessGrid

from .layouts import _axes_key, _split
from .runtime import Step, _GroupRunningStats, _ParamView

# operations that work along the dimensions one argument names, by name: that argument's
# position after the tensor's (and its keyword) and its default (None: every dimension).
# Where no rank splits those dimensions each block is their whole extent: the operation runs
# on each block as it is, its outputs (any number) cut as its input along the others
_ALONG = {
    **{n: (1, "dim", None) for n in (
        "max", "min", "argmax", "argmin", "std", "var", "std_mean", "var_mean", "logsumexp",
        "prod", "median", "nanmedian", "any", "all", "nansum", "nanmean", "count_nonzero",
        "cummax", "cummin", "cumsum", "cumprod", "logcumsumexp", "softmax", "log_softmax",
        "softmin")},
    **{n: (1, "dim", -1) for n in ("mode", "sort", "argsort", "glu")},
    "unbind": (1, "dim", 0),
    "flip": (1, "dims", None),
    "split": (2, "dim", 0), "chunk": (2, "dim", 0), "tensor_split": (2, "dim", 0),
    "topk": (2, "dim", -1), "kthvalue": (2, "dim", -1),
    "roll": (2, "dims", None), "norm": (2, "dim", None),
}


def _along_dims(node: Node, name: str, ndim: int) -> list[int] | None:
    """The dimensions an operation of :data:`_ALONG` works along (None: every one, or not
    such an operation)."""
    if name not in _ALONG:
        return None
    index, key, default = _ALONG[name]
    dim = _arg(node, index, key, default)
    if name == "flip" and key not in node.kwargs and len(node.args) > index + 1:
        dim = node.args[index:]  # x.flip(2, 3): the dimensions as separate arguments
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if dim is None or not dims or not all(isinstance(d, int) and not isinstance(d, bool)
                                          for d in dims):
        return None  # every dimension (dim=() reduces all), or a form without one
    return sorted({d % ndim for d in dims})


def _along_outputs(node: Node, dist: Distribution, along: list[int]) -> Any:
    """The distributions of the outputs of an operation along the dimensions ``along`` of
    its input ``dist`` (one, or a tuple of them, as its value holds tensors): each output of
    as many dimensions cut as the input (the lengths along ``along`` changed), each of one
    fewer per dimension in ``along`` cut as the input without them; None for other
    outputs."""
    def one(meta: Any) -> Distribution | None:
        shape = tuple(meta.shape)
        if len(shape) == dist.ndim:  # cut as the input, but where a length changed
            if any(n != dist.global_shape[d] for d, n in enumerate(shape) if d not in along):
                return None
            return Distribution(shape, dist.grid_arg, dist.axes,
                                [None if n != dist.global_shape[d] else c
                                 for d, (n, c) in enumerate(zip(shape, dist.splits))])
        if len(shape) == dist.ndim - len(along):
            keep = [d for d in range(dist.ndim) if d not in along]
            return Distribution(shape, dist.grid_arg, [dist.axes[d] for d in keep],
                                [dist.splits[d] for d in keep])
        return None

    meta = node.meta.get("tensor_meta")
    if hasattr(meta, "shape"):
        return one(meta)
    if isinstance(meta, (tuple, list)) and meta and all(hasattr(m, "shape") for m in meta):
        outs = tuple(one(m) for m in meta)
        return outs if all(o is not None for o in outs) else None
    return None


def _describe(node: Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", repr(node.target))
    return f"node '{node.name}' ({node.op} {target})"


def _arg(node: Node, index: int, name: str, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def _flat_nodes(node: Node) -> list[Node]:
    out: list[Node] = []
    map_aggregate((node.args, node.kwargs),
                  lambda a: out.append(a) if isinstance(a, Node) else None)
    return out


def _shape_of(node: Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _float_tensor(node: Node) -> bool:
    """Whether ``node``'s value is a floating tensor (one that carries a gradient)."""
    meta = node.meta.get("tensor_meta")
    return meta is not None and getattr(getattr(meta, "dtype", None), "is_floating_point",
                                        False)


def _dims(dim: Any, ndim: int) -> list[int]:
    """A reduction's ``dim`` argument as sorted dimensions (``()``, ``[]`` or None: all)."""
    if dim is None or (isinstance(dim, (tuple, list)) and not dim):
        return list(range(ndim))
    return sorted({int(d) % ndim for d in (dim if isinstance(dim, (tuple, list)) else [dim])})


def _method(name: str) -> Callable[..., Any]:
    return lambda self, *a, **kw: getattr(self, name)(*a, **kw)


def _empty_like_output(ext: torch.Tensor, shape: tuple[int, ...],
                       params: Any) -> torch.Tensor:
    """An empty block that keeps the autograd graph of every rank alike (the parameters'
    gradient hooks run on every rank)."""
    zero = 0 * ext.sum()
    for p in params:
        if p is not None:
            zero = zero + 0 * p.sum()
    kind = ext.device.type  # under autocast, the dtype the other ranks' convolutions give
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else zero.dtype
    return (ext.new_zeros(shape) + zero).to(dtype)


@dataclass
class _Value:
    """What the compiler knows of a node's value: a distributed tensor's Distribution or
    None (a value every rank holds alike: a number, a size, a parameter), and for the
    latter the parameters it is made of (``self.w[:, None]``, ``self.w.view(...)``): where
    it meets a distributed block, each rank's part of their gradients is summed."""

    dist: Distribution | None
    params: frozenset[str] = frozenset()


class _Rules:
    """The state and checks the compiler's rules share (one compiler per traced graph)."""

    def __init__(self, gm: GraphModule, model: nn.Module, grid: ProcessGrid,
                 batch_norm_stats: str = "global",
                 memory_format: torch.memory_format | None = None):
        self.gm = gm
        self.model = model
        self.grid = grid
        self.batch_norm_stats = batch_norm_stats
        # the layout every rank's blocks are put in (None: as they come), and so that of
        # partial outputs summed over ranks (their memory is added element by element)
        self.summed_format = memory_format if memory_format in (
            torch.channels_last, torch.channels_last_3d) else torch.contiguous_format
        self.running = _GroupRunningStats()
        self.values: dict[Node, _Value] = {}
        self.output_dist: Any = None
        # id of each parameter used -> (the grid axes that sum its gradient, a
        # distribution of its input, the first node that uses it)
        self.param_keys: dict[int, tuple[frozenset, Distribution, str]] = {}
        self.view = _ParamView()

    # errors, each raised alike on every rank: all of it is metadata
    def fail(self, node: Node, why: str) -> None:
        raise ValueError(f"parallelize: {_describe(node)}: {why}")

    def refuse_split(self, node: Node, dist: Distribution, dims: Sequence[int],
                     what: str) -> None:
        for d in dims:
            if _split(dist, d):
                self.fail(node, f"{what}: dimension {d} of its input is split over the "
                                f"grid (grid shape {dist.grid_shape}), and this operation "
                                "runs only where that dimension is whole")

    def dist_of(self, arg: Any) -> Distribution | None:
        return self.values[arg].dist if isinstance(arg, Node) else None

    def set(self, node: Node, dist: Distribution | None) -> None:
        self.values[node] = _Value(dist)

    def use_params(self, node: Node, module_name: str, dist: Distribution) -> None:
        """Record the ranks that sum the gradients of a module's parameters."""
        if dist is None:
            return
        module = self.gm.get_submodule(module_name)
        prefix = f"{module_name}." if module_name else ""
        for name, _ in module.named_parameters():
            self.use_param(node, prefix + name, dist)

    def use_param(self, node: Node, name: str, dist: Distribution) -> None:
        try:
            param = self.model.get_parameter(name)
        except AttributeError:
            return  # a buffer
        key = _axes_key(dist)
        known = self.param_keys.get(id(param))
        if known is not None and known[0] != key:
            raise ValueError(
                f"parallelize: parameter '{name}' is shared by {known[2]} and "
                f"{_describe(node)}, whose inputs are split differently ({known[1]} and "
                f"{dist}): its gradient would be summed over different ranks")
        if known is None:
            self.param_keys[id(param)] = (key, dist, _describe(node))

    def module_call(self, m: nn.Module) -> Callable[..., Any]:
        view = self.view
        return lambda *a, **kw: view.call(m, a, kw)

    def _check_shape(self, node: Node, out: Distribution, shape: Sequence[int]) -> None:
        if tuple(out.global_shape) != tuple(shape):  # pragma: no cover - a geometry bug
            self.fail(node, f"the window geometry gives shape {out.global_shape}, PyTorch "
                            f"{tuple(shape)}")

    def local(self, node: Node, fn: Callable[..., Any]) -> Step:
        """Run ``fn`` as it is: every distributed input must be whole on every rank."""
        name = node.target if isinstance(node.target, str) else getattr(
            node.target, "__name__", "")
        dist = self.dist_of(node.args[0]) if node.args else None
        along = _along_dims(node, name, dist.ndim) if isinstance(dist, Distribution) \
            else None
        outs = _along_outputs(node, dist, along) if along is not None and all(
            self.dist_of(a) is None for a in _flat_nodes(node)[1:]) else None
        if outs is not None:
            self.refuse_split(node, dist, along, f"{name} runs along dimension(s) {along}")
            self.set(node, outs)
            return lambda args: fn(*args[0], **args[1])
        dists = [e for a in _flat_nodes(node) for e in (
            self.dist_of(a) if isinstance(self.dist_of(a), tuple) else (self.dist_of(a),))]
        for d in dists:
            if d is not None:
                self.refuse_split(node, d, range(d.ndim),
                                  "parallelize does not split this operation")
        shape = _shape_of(node)
        dist = Distribution(shape, self.grid, (None,) * len(shape)) if shape is not None \
            and any(d is not None for d in dists) else None
        self.set(node, dist)
        for a in _flat_nodes(node):
            if a.op == "get_attr" and dist is not None:
                self.use_param(node, a.target, dist)

        def step(args: Any) -> Any:
            a, kw = args
            return fn(*a, **kw)

        return step
