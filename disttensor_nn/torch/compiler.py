"""The compiler of :func:`~disttensor_nn.torch.parallelize`: each node of a traced,
shape-propagated model becomes a step on this rank's block (the rules are
listed in :mod:`disttensor_nn.torch.parallel`); every decision is metadata,
made alike on every rank before any message.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from disttensor import DistArray, Distribution, ProcessGrid, halo_plan
from disttensor_nn.kernels.torch_kernels import one_window, window_reach
from disttensor_nn.reduction import split_axes_comm
from disttensor_nn.window import WindowSpec, geometry, transposed_geometry

from .autoplan import (
    _FEATURE_DROPOUT_FUNCTIONS,
    _FEATURE_DROPOUT_MODULES,
    _UNPOOL,
    _UNPOOL_F,
    LAYOUT_KEY,
    pool_module,
    relayout,
)
from .channels import sum_partials, take_channels
from .functional import _exchange_planned, _split_extreme, all_reduce, broadcast, redistribute
from .halo_conv import HALO_CONV_MIN_ELEMENTS, halo_conv_plan
from .interpolation import INTERPOLATION_MODES, source_taps, taps_reach
from .norm import split_batch_norm
from .runtime import Step, _GroupRunningStats, _ParamView

_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_CONV_T = {nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
           nn.ConvTranspose3d: F.conv_transpose3d}
_MAXPOOL = {nn.MaxPool1d: F.max_pool1d, nn.MaxPool2d: F.max_pool2d, nn.MaxPool3d: F.max_pool3d}
_AVGPOOL = {nn.AvgPool1d: F.avg_pool1d, nn.AvgPool2d: F.avg_pool2d, nn.AvgPool3d: F.avg_pool3d}
_ADAPTIVE = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
# modules over each sample's (and channel's) whole space
_PER_SAMPLE = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.AdaptiveMaxPool1d,
               nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_ADAPTIVE_F = (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)
_ADAPTIVE_MAX = (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_ADAPTIVE_MAX_F = (F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d)
_EXTREMES = {torch.amax: True, torch.amin: False}  # largest
_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_PADDING_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge",
                  "circular": "wrap"}
_NOT_ELEMENTWISE = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU,
                    nn.MultiheadAttention)
_ELEMENTWISE_MODULES = tuple(
    cls for cls in vars(nn.modules.activation).values()
    if isinstance(cls, type) and issubclass(cls, nn.Module) and cls is not nn.Module
    and not issubclass(cls, _NOT_ELEMENTWISE)
) + (nn.Identity,)
_ELEMENTWISE_NAMES = frozenset(
    "abs absolute acos asin atan ceil clamp clamp_min clamp_max clip cos cosh elu exp expm1 "
    "floor gelu hardsigmoid hardswish hardtanh leaky_relu log log1p log_sigmoid mish neg "
    "negative pow reciprocal relu relu6 round rsqrt selu celu sigmoid sign silu sin sinh "
    "softplus softsign sqrt square tanh tanhshrink threshold trunc add sub subtract mul "
    "multiply div divide true_divide maximum minimum where lerp hardshrink softshrink prelu "
    "rrelu glu_none contiguous float double half clone detach to type_as "
    # comparisons, logic and the rest of PyTorch's point-wise functions
    "gt lt ge le eq ne greater less greater_equal less_equal not_equal logical_and "
    "logical_or logical_not logical_xor isnan isinf isfinite nan_to_num fmod remainder "
    "atan2 arctan2 hypot copysign erf erfc erfinv exp2 log2 log10 sinc frac float_power "
    "xlogy logit sgn signbit heaviside bool int long fmax fmin".split()
)
_BINARY_OPERATORS = frozenset((operator.add, operator.sub, operator.mul, operator.truediv,
                               operator.neg, operator.pow, operator.iadd, operator.imul,
                               operator.isub, operator.itruediv, operator.floordiv,
                               operator.gt, operator.lt, operator.ge, operator.le,
                               operator.eq, operator.ne, operator.mod, operator.abs,
                               operator.pos, operator.invert, operator.and_, operator.or_,
                               operator.xor, operator.ipow, operator.imod))
# tensor attributes every block has as the whole array has them
_BLOCK_ALIKE = frozenset(("dtype", "device", "ndim", "layout", "is_cuda", "is_quantized"))
# shape-keeping operations along one dimension (their first argument after the tensor)
_ALONG_DIM = frozenset(("cumsum", "cumprod", "logcumsumexp", "softmax", "log_softmax",
                        "softmin"))
_ELEMENTWISE_F = (F.relu, F.relu6, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish, F.leaky_relu,
                  F.hardtanh, F.hardswish, F.hardsigmoid, F.sigmoid, F.tanh, F.softplus,
                  F.logsigmoid, F.threshold)
# the rows of halo each side of a block that interpolation by an integer scale reads
_REACH = {"nearest": 0, "nearest-exact": 0, "linear": 1, "bilinear": 1, "trilinear": 1,
          "bicubic": 2}


# ------------------------------------------------------------------ helpers
def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 where it is 16-bit: normalization statistics accumulate in float32."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _split(dist: Distribution, dim: int) -> bool:
    """Whether ``dim`` of ``dist`` has more than one block."""
    return math.prod(dist.grid_shape[a] for a in dist.dim_axes[dim]) > 1


def _split_dims(dist: Distribution) -> list[int]:
    return [d for d in range(dist.ndim) if _split(dist, d)]


def _axes_key(dist: Distribution, dims: Sequence[int] | None = None) -> frozenset:
    """The grid axes (of more than one rank) that split ``dims`` of ``dist``."""
    dims = range(dist.ndim) if dims is None else dims
    return frozenset(a for d in dims for a in dist.dim_axes[d] if dist.grid_shape[a] > 1)


def _takes_channels(src: Distribution, dst: Distribution) -> bool:
    """Whether ``dst`` is ``src`` but for its channels, which ``src`` holds whole on every
    rank of one grid axis and ``dst`` splits along that axis: each rank's block of ``dst``
    is then its channels of its block of ``src``."""
    if src.ndim <= 2 or src.grid != dst.grid or src.dim_axes[1] or \
            len(dst.dim_axes[1]) != 1:
        return False
    axis = dst.dim_axes[1][0]
    return all(axis not in a for a in src.dim_axes) and all(
        src.dim_axes[d] == dst.dim_axes[d] and src.boundaries[d] == dst.boundaries[d]
        for d in range(src.ndim) if d != 1)


def _unsplit(dist: Distribution, dims: Sequence[int]) -> Distribution:
    """``dist`` with ``dims`` whole (their grid axes hold replicas)."""
    axes = [None if d in dims else a for d, a in enumerate(dist.axes)]
    splits = [None if d in dims else s for d, s in enumerate(dist.splits)]
    return Distribution(dist.global_shape, dist.grid_arg, axes, splits)


def _with_shape(dist: Distribution, shape: Sequence[int],
                splits: dict[int, Any] | None = None) -> Distribution:
    """``dist``'s axes and cuts on a new shape of as many dimensions; ``splits`` overrides."""
    cuts = list(dist.splits)
    for d, s in (splits or {}).items():
        cuts[d] = s
    return Distribution(tuple(shape), dist.grid_arg, dist.axes, cuts)


def _broadcast_to(dist: Distribution, target: Distribution) -> Distribution | None:
    """Where an operand of ``dist``'s shape must lie to broadcast against blocks of
    ``target`` on each rank as it does against the whole: its dimensions of the output's
    length cut as the output's, those of length 1 (against more) whole, their grid axes
    holding replicas; None where the shapes do not broadcast so (right-aligned, as in
    PyTorch)."""
    src, out = tuple(dist.global_shape), tuple(target.global_shape)
    lead = len(out) - len(src)
    if lead < 0:
        return None
    axes: list[Any] = []
    splits: list[Any] = []
    for i, n in enumerate(src):
        if n == out[lead + i]:
            axes.append(target.axes[lead + i])
            splits.append(target.splits[lead + i])
        elif n == 1:
            axes.append(None)
            splits.append(None)
        else:
            return None
    return Distribution(src, target.grid_arg, axes, splits)


def _move_then_share(src: Distribution, dst: Distribution, along: Sequence[int]
                     ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A block of ``src`` moved to ``dst``, then shared by the ranks along the grid axes
    ``along`` (forward: as it is; backward: their gradients summed, :func:`broadcast`)."""
    grid, axes = dst.grid, tuple(along)

    def move(t: torch.Tensor) -> torch.Tensor:
        if src != dst:
            t = redistribute(t, src, dst)
        return broadcast(t, grid, axes=axes) if axes else t

    return move


def _float_tensor(node: Node) -> bool:
    """Whether ``node``'s value is a floating tensor (one that carries a gradient)."""
    meta = node.meta.get("tensor_meta")
    return meta is not None and getattr(getattr(meta, "dtype", None), "is_floating_point",
                                        False)


def _global_window(output_size: Any) -> bool:
    """Whether an adaptive pooling's output size is 1 in every dimension (one window)."""
    sizes = output_size if isinstance(output_size, (tuple, list)) else (output_size,)
    return all(s == 1 for s in sizes)


def _dims(dim: Any, ndim: int) -> list[int]:
    """A reduction's ``dim`` argument as sorted dimensions (``()``, ``[]`` or None: all)."""
    if dim is None or (isinstance(dim, (tuple, list)) and not dim):
        return list(range(ndim))
    return sorted({int(d) % ndim for d in (dim if isinstance(dim, (tuple, list)) else [dim])})


def _cuts(bounds: Sequence[int]) -> list[int] | None:
    return list(bounds[1:-1]) if len(bounds) > 2 else None


def _shape_of(node: Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _move_index(idx: torch.Tensor, src: Sequence[int], offset: Sequence[int],
                dst: Sequence[int], clamp: bool) -> torch.Tensor:
    """Flat indices into planes of shape ``src`` made flat indices into planes of shape
    ``dst`` whose first element lies at ``-offset`` of ``src``'s: each coordinate moved by
    ``offset``, then held inside ``dst`` (``clamp``) or the index made -1 where one falls
    outside it.

    Max pooling's indices into its window block become indices into the whole input
    (clamped: a maximum in the padding, a window of -inf, moves to the nearest element
    inside, PyTorch's choice there); unpooling's go the other way, into a rank's block."""
    flat = torch.zeros_like(idx)
    rest = idx
    outside = None if clamp else torch.zeros_like(idx, dtype=torch.bool)
    for i in reversed(range(len(src))):
        coord = rest % src[i] + offset[i]
        rest = rest // src[i]
        if clamp:
            coord = coord.clamp(0, dst[i] - 1)
        else:
            outside |= (coord < 0) | (coord >= dst[i])
        flat += coord * math.prod(dst[i + 1:])
    return flat if outside is None else flat.masked_fill(outside, -1)


def _extend(dist: Distribution, widths: Any, mode: str = "constant", fill: Any = 0.0
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A step's halo exchange of its input block: the plan made (and checked) once, when the
    step is compiled; the identity where every width is 0."""
    if not any(any(w) for w in widths):
        return lambda x: x
    plan = halo_plan(dist, widths, mode)
    return lambda x: _exchange_planned(x, plan, fill)


def _describe(node: Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", repr(node.target))
    return f"node '{node.name}' ({node.op} {target})"



@dataclass
class _Value:
    """What the compiler knows of a node's value: a distributed tensor's Distribution or
    None (a value every rank holds alike: a number, a size, a parameter), and for the
    latter the parameters it is made of (``self.w[:, None]``, ``self.w.view(...)``): where
    it meets a distributed block, each rank's part of their gradients is summed."""

    dist: Distribution | None
    params: frozenset[str] = frozenset()



# ------------------------------------------------------------------ the compiler
class _Compiler:
    """Turns each node of a traced, shape-propagated graph into a step on blocks."""

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

    # --------------------------------------------------------------- dispatch
    def compile(self, node: Node) -> Step:
        """The step of ``node``; the parameters a value every rank holds alike is made of
        (a parameter, an operation on one, a module called on such values) followed to
        where it meets distributed blocks, whose ranks then sum each one's gradient over
        the axes that split the result (as a module's parameters' are), unless the node's
        rule did. Only floating tensors carry them (not a parameter's dtype or size)."""
        known = set(self.param_keys)
        step = self._compile(node)
        value = self.values.get(node)
        if value is None:
            return step
        inputs = [self.values[a] for a in _flat_nodes(node)
                  if a in self.values and _float_tensor(a)]
        made_of = frozenset().union(*(v.params for v in inputs if v.dist is None))
        if value.dist is None:
            if _float_tensor(node):
                if node.op == "call_module":  # the module's own parameters too
                    made_of |= {f"{node.target}.{name}" for name, _ in
                                self.gm.get_submodule(node.target).named_parameters()}
                value.params = value.params | made_of
            return step
        dist = value.dist if isinstance(value.dist, Distribution) else next(
            (v.dist for v in inputs if isinstance(v.dist, Distribution)), None)
        if dist is not None:
            for name in sorted(made_of):
                param = self.model.get_parameter(name)
                if id(param) not in self.param_keys or id(param) in known:
                    self.use_param(node, name, dist)
        return step

    def _compile(self, node: Node) -> Step:
        if node.op == "placeholder":
            raise AssertionError  # handled by the caller
        if node.op == "get_attr":
            return self.get_attr(node)
        if node.op == "output":
            return self.output(node)
        if node.op == "call_module":
            return self.call_module(node)
        if node.op == "call_function" and node.target is relayout:
            return self.relayout(node)
        if node.op == "call_function":
            return self.call_function(node)
        if node.op == "call_method":
            return self.call_method(node)
        self.fail(node, "is not a kind of node parallelize knows")
        raise AssertionError

    def relayout(self, node: Node) -> Step:
        """A planned layer's input moved to the plan's layout (nothing where it is so)."""
        src, dst = self.dist_of(node.args[0]), node.meta[LAYOUT_KEY]
        if src is None or (src.grid == dst.grid and src.axes == dst.axes):
            self.set(node, src)  # laid out as planned: its own cuts are kept
            return lambda args: args[0][0]
        self.set(node, dst)
        if _takes_channels(src, dst):  # a convolution's channels of a block held alike
            between = split_axes_comm(dst, [1])
            bounds = tuple(dst.boundaries[1])
            return lambda args: take_channels(args[0][0], between, bounds)
        return lambda args: redistribute(args[0][0], src, dst)

    def output(self, node: Node) -> Step:
        dists = map_aggregate(node.args[0], lambda a: self.dist_of(a))

        def wrap(block: Any, dist: Any) -> Any:
            return DistArray(block, dist) if isinstance(dist, Distribution) else block

        def step(args: Any) -> Any:
            out = args[0][0]
            if isinstance(dists, Distribution):
                return wrap(out, dists)
            if isinstance(out, (tuple, list)):
                return type(out)(wrap(o, d) for o, d in zip(out, dists))
            return out

        self.output_dist = dists
        return step

    def get_attr(self, node: Node) -> Step:
        target = node.target
        try:
            self.model.get_parameter(target)
            self.values[node] = _Value(None, frozenset((target,)))
        except AttributeError:  # a buffer or a plain tensor attribute
            self.set(node, None)
        model, view = self.model, self.view

        def step(args: Any) -> Any:
            return view(getattr_path(model, target))

        return step

    def set(self, node: Node, dist: Distribution | None) -> None:
        self.values[node] = _Value(dist)

    # --------------------------------------------------------------- generic rules
    def local(self, node: Node, fn: Callable[..., Any]) -> Step:
        """Run ``fn`` as it is: every distributed input must be whole on every rank."""
        name = node.target if isinstance(node.target, str) else getattr(
            node.target, "__name__", "")
        dist = self.dist_of(node.args[0]) if node.args else None
        if name in _ALONG_DIM and dist is not None and _shape_of(node) == dist.global_shape:
            dim = _arg(node, 1, "dim", None)
            if isinstance(dim, int):
                self.refuse_split(node, dist, [dim % dist.ndim], f"{name} runs along one dimension")
                self.set(node, dist)
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

    def elementwise(self, node: Node, fn: Callable[..., Any]) -> Step:
        """An element-wise operation on blocks of one distribution: the operands of the
        output's shape moved to it, those that broadcast against it (a squeeze-and-excitation
        gate, a mean over the channels) to where they broadcast against each block alike."""
        shape = _shape_of(node)
        tensors = [a for a in _flat_nodes(node) if self.dist_of(a) is not None]
        if not tensors or shape is None:
            return self.local(node, fn)
        target = next((self.dist_of(a) for a in tensors
                       if self.dist_of(a).global_shape == shape), None)
        if target is None:
            return self.local(node, fn)
        moves: dict[Node, Callable[[torch.Tensor], torch.Tensor]] = {}
        for a in tensors:
            d = self.dist_of(a)
            want = target if d.global_shape == shape else _broadcast_to(d, target)
            if want is None:
                self.fail(node, f"broadcasts a distributed operand of shape {d.global_shape} "
                                f"against shape {shape}")
            # a broadcast operand meets each rank's part of the dimensions it broadcasts
            # along: the ranks along the axes that split those hold it alike, and each
            # one's gradient is its part's, summed over them (the adjoint of the copies)
            lead = len(shape) - len(want.global_shape)
            along = sorted({ax for j in range(len(shape))
                            if j < lead or want.global_shape[j - lead] != shape[j]
                            for ax in target.dim_axes[j] if target.grid_shape[ax] > 1})
            if d != want or along:
                moves[a] = _move_then_share(d, want, along)
        for a in _flat_nodes(node):
            if self.dist_of(a) is None and _shape_of(a) is not None:
                self.check_broadcast(node, a, target)  # a parameter, or made of them
            if a.op == "get_attr":
                self.use_param(node, a.target, target)
        self.set(node, target)
        positions = _node_positions(node, moves)

        def step(args: Any) -> Any:
            a, kw = args
            for path, move in positions:
                a, kw = _replace_at((a, kw), path, move)
            return fn(*a, **kw)

        return step

    def check_broadcast(self, node: Node, attr: Node, dist: Distribution) -> None:
        shape = _shape_of(attr)
        if shape is None:
            return
        for k in range(1, len(shape) + 1):
            d = dist.ndim - k
            if d >= 0 and shape[-k] != 1 and _split(dist, d):
                what = attr.target if attr.op == "get_attr" else attr.name
                self.fail(node, f"broadcasts '{what}' of shape {shape} along "
                                f"dimension {d}, which is split over the grid")

    # --------------------------------------------------------------- call_module
    def call_module(self, node: Node) -> Step:
        m = self.gm.get_submodule(node.target)
        x = node.args[0] if node.args else None
        dist = self.dist_of(x)
        if dist is None:
            return self.local(node, self.module_call(m))
        if type(m) in _UNPOOL:
            return self.unpool(node, m, dist)
        if len(node.args) != 1 or node.kwargs:
            if isinstance(m, tuple(_CONV) + tuple(_CONV_T) + tuple(_MAXPOOL)):
                self.fail(node, "is called with more than its input")
        if type(m) in _CONV:
            return self.conv(node, m, dist)
        if type(m) in _CONV_T:
            return self.conv_transpose(node, m, dist)
        if type(m) in _MAXPOOL or type(m) in _AVGPOOL:
            return self.pool(node, m, dist)
        if isinstance(m, _ADAPTIVE):
            return self.adaptive(node, m.output_size, dist, len(dist.global_shape) - 2)
        if isinstance(m, _BATCHNORM):
            return self.batchnorm(node, m, dist)
        if isinstance(m, nn.GroupNorm):
            return self.groupnorm(node, m, dist)
        if isinstance(m, _ADAPTIVE_MAX) and _global_window(m.output_size) \
                and not m.return_indices:  # a global max pooling head (its last nd dims)
            nd = next(i + 1 for i, c in enumerate(_ADAPTIVE_MAX) if isinstance(m, c))
            return self.extreme(node, dist, list(range(dist.ndim - nd, dist.ndim)), True,
                                True, pooling=self.module_call(m))
        if isinstance(m, _PER_SAMPLE):
            return self.per_sample(node, m, dist)
        if isinstance(m, nn.LayerNorm):
            d0 = dist.ndim - len(m.normalized_shape)
            if any(_split(dist, d) for d in range(d0, dist.ndim)):
                self.use_params(node, node.target, dist)
                view = self.view
                return self.layernorm(
                    node, dist, d0, m.eps,
                    lambda args: None if m.weight is None else view(m.weight),
                    lambda args: None if m.bias is None else view(m.bias))
            return self.same(node, m, dist)
        if isinstance(m, nn.Upsample):
            return self.interpolate(node, dist, m.mode, m.align_corners, False,
                                    m.scale_factor, m.recompute_scale_factor,
                                    lambda args: m(*args[0], **args[1]))
        if isinstance(m, nn.PixelShuffle):
            return self.pixel_shuffle(node, dist, m.upscale_factor, F.pixel_shuffle)
        if isinstance(m, nn.PixelUnshuffle):
            return self.pixel_shuffle(node, dist, m.downscale_factor, F.pixel_unshuffle)
        if type(m) is nn.Dropout:
            return self.dropout(node, dist, lambda args: (m.p, m.training))
        if type(m) in _FEATURE_DROPOUT_MODULES:
            return self.feature_dropout(node, dist, _FEATURE_DROPOUT_MODULES[type(m)],
                                        lambda args: (m.p, m.training), self.module_call(m))
        if isinstance(m, nn.Flatten):
            return self.reshape(node, dist)
        if isinstance(m, nn.Linear):
            return self.linear(node, m, dist)
        if isinstance(m, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
            dim = m.dim if m.dim is not None else 1
            self.refuse_split(node, dist, [dim % dist.ndim], f"{type(m).__name__} reduces")
            return self.same(node, m, dist)
        if isinstance(m, _ELEMENTWISE_MODULES):
            if isinstance(m, nn.PReLU) and m.num_parameters > 1:
                self.refuse_split(node, dist, [1], "PReLU's per-channel weight")
            return self.same(node, m, dist)
        step = self.local(node, self.module_call(m))
        self.use_params(node, node.target, self.values[node].dist)
        return step

    def per_sample(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        """A module that works on each sample's channels over the whole of space (instance
        norm, adaptive max pooling): its own call on each block, where no rank splits
        space (and, for running statistics averaged over the batch, the samples)."""
        what = f"{type(m).__name__} works over the whole of each sample's space"
        self.refuse_split(node, dist, range(2, dist.ndim), what)
        if getattr(m, "track_running_stats", False):
            self.refuse_split(node, dist, [0], f"{type(m).__name__}'s running statistics "
                              "average the batch")
        meta = node.meta.get("tensor_meta")
        if not hasattr(meta, "shape"):  # max pooling's values and indices, alike
            out = _with_shape(dist, tuple(meta[0].shape))
            self.set(node, (out, out))
        else:
            self.set(node, _with_shape(dist, _shape_of(node)))
        self.use_params(node, node.target, dist)
        view = self.view
        return lambda args: view.call(m, args[0], args[1])

    def same(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        """A module that maps this rank's block to its block of the same distribution."""
        self.set(node, dist)
        self.use_params(node, node.target, dist)
        view = self.view
        return lambda args: view.call(m, args[0], args[1])

    def module_call(self, m: nn.Module) -> Callable[..., Any]:
        view = self.view
        return lambda *a, **kw: view.call(m, a, kw)

    def conv(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        """A convolution on this rank's block: its halo exchanged where space is split; where
        the channels are split too (the planner's ``"channel"`` mode), each rank convolves
        its channels with their slice of the weight and the partial outputs are summed over
        the ranks that split the channels, whose output is then whole in its channels and
        the same on each of them (the bias added by the first)."""
        nd = dist.ndim - 2
        channels = _split(dist, 1)
        if channels and m.groups != 1:
            self.fail(node, f"{type(m).__name__} of {m.groups} groups: dimension 1 of its "
                            f"input is split over the grid (grid shape {dist.grid_shape}), "
                            "and only a convolution of one group sums partial outputs over "
                            "split channels")
        spec = WindowSpec.make(nd, m.kernel_size, m.stride, m.padding, m.dilation)
        mode = _PADDING_MODES[m.padding_mode]
        geo = geometry(spec, dist)
        shape = _shape_of(node)
        out = _with_shape(geo.out_dist, shape, {1: None} if channels else None)
        if channels:  # the sums over the channels' ranks: whole, alike on each of them
            out = _unsplit(out, [1])
        self._check_shape(node, out, shape)
        slices = list(geo.input_slices(geo.out_box))
        fn, widths = _CONV[type(m)], list(geo.widths)
        # an empty input block may still have outputs (a padding wider than the kernel's
        # reach): they come from the halo and the padding, so only an empty output is empty
        empty = any(b <= a for a, b in geo.out_box) or 0 in out.local_shape()
        self.set(node, out)
        self.use_params(node, node.target, dist)
        local_out = out.local_shape()
        # where no rank splits a spatial dimension, the halo is only zero padding: the kernel
        # pads itself (as PyTorch's own model does), and no extended copy of the block is
        # made. (With a split dimension the extended block is kept whole: padding the other
        # dimensions in the kernel measured slower there.)
        native = mode == "constant"
        for i in range(nd):
            lo, hi = spec.padding[i]
            n, k = dist.global_shape[2 + i], spec.dilation[i] * (spec.kernel[i] - 1) + 1
            native = native and not _split(dist, 2 + i) and lo == hi and \
                (n + 2 * lo - k) // spec.stride[i] + 1 == local_out[2 + i]
        pads: Any = 0
        if native:
            pads = tuple(lo for lo, _ in spec.padding)
            widths = [(0, 0)] * len(widths)
            slices = [slice(None)] * len(slices)
        slices = tuple(slices)

        view = self.view
        # one split dimension of large blocks: the kernel pads the block itself, its halo's
        # faces correct the edges (disttensor_nn.torch.halo_conv), and no extended copy of
        # the block is made (smaller blocks are copied: cheaper than the edges' convolutions)
        large = math.prod(dist.global_shape) >= HALO_CONV_MIN_ELEMENTS * max(dist.nblocks)
        halo = None if native or mode != "constant" or not large or channels else \
            halo_conv_plan(spec, dist, fn, tuple(m.weight.shape), m.groups)
        if halo is not None:
            return lambda args: halo(args[0][0], view(m.weight), view(m.bias))
        pad_list = list(pads) if isinstance(pads, tuple) else [0] * nd

        extend = _extend(dist, widths, mode)

        def run(xin: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
            if one_window(xin.shape, weight.shape, m.stride, pad_list, m.dilation):
                # one strided output column: unstrided on what its window reads (oneDNN's
                # bfloat16 kernels get the strided one wrong; torch_kernels.one_window)
                xin = xin[..., :window_reach(xin.shape, weight.shape, pad_list, m.dilation)]
                return fn(xin, weight, bias, (*m.stride[:-1], 1), pads, m.dilation,
                          m.groups)[..., :1]
            return fn(xin, weight, bias, m.stride, pads, m.dilation, m.groups)

        if channels:
            c0 = dist.local_start()[1]
            mine = slice(c0, c0 + dist.local_shape()[1])
            first = dist.block_index()[1] == 0
            between = split_axes_comm(dist, [1])
            empty = empty or mine.stop == mine.start
            summed = self.summed_format if (nd, self.summed_format) in (
                (2, torch.channels_last), (3, torch.channels_last_3d)) else \
                torch.contiguous_format

            def partial(args: Any) -> torch.Tensor:
                ext = extend(args[0][0])
                weight, bias = view(m.weight)[:, mine], view(m.bias)
                if bias is not None and not first:  # the first rank adds it, once; the
                    bias = bias * 0  # others' graphs stay alike
                if empty:
                    y = _empty_like_output(ext, local_out, [weight, bias])
                    if bias is not None:
                        y = y + bias.view((1, -1) + (1,) * nd).to(y.dtype)
                else:
                    y = run(ext[slices], weight, bias)
                # every rank's partial in one memory layout, as the sum adds the ranks'
                # memory (a convolution's output follows its input's layout, which a
                # block of one channel, or none, does not show)
                return sum_partials(y.contiguous(memory_format=summed), between)

            return partial

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            weight, bias = view(m.weight), view(m.bias)
            if empty:
                return _empty_like_output(ext, local_out, [weight, bias])
            return run(ext[slices], weight, bias)

        return step

    def conv_transpose(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        nd = dist.ndim - 2
        self.refuse_split(node, dist, [1], f"{type(m).__name__} mixes channels")
        if m.padding_mode != "zeros":
            self.fail(node, "a transposed convolution pads with zeros only")
        spec = WindowSpec.make(nd, m.kernel_size, m.stride, m.padding, m.dilation)
        geo = transposed_geometry(spec, tuple(m.output_padding), dist)
        shape = _shape_of(node)
        out = _with_shape(geo.out_dist, shape)
        self._check_shape(node, out, shape)
        block = dist.block_index()
        # this rank's output block [o0, o1) per spatial dimension, and where the kernel's
        # output on its extended input lies, [start, start + full): the overlap is cropped
        # out of the kernel's output and padded (with zeros) to the block; where nothing
        # overlaps (an extended input whose outputs all fall in the cropped padding, or an
        # empty one) the block is the bias alone
        crops: list[slice] = []
        pads: list[int] = []
        reached = True
        for i in range(nd):
            start = spec.stride[i] * geo.in_origin[i] - spec.padding[i][0]
            o0, o1 = (out.boundaries[2 + i][block[2 + i]],
                      out.boundaries[2 + i][block[2 + i] + 1])
            length = dist.local_shape()[2 + i] + sum(geo.in_widths[2 + i])
            full = spec.stride[i] * (length - 1) + spec.dilation[i] * (spec.kernel[i] - 1) + 1 \
                if length else 0
            lo, hi = max(start, o0), min(start + full, o1)
            reached = reached and hi > lo
            crops.append(slice(lo - start, max(hi, lo) - start))
            pads[:0] = [lo - o0, o1 - max(hi, lo)]  # F.pad's order: the last dimension first
        fn, widths = _CONV_T[type(m)], geo.in_widths
        local_out = out.local_shape()
        empty = 0 in local_out
        crop = (slice(None), slice(None), *crops)
        self.set(node, out)
        self.use_params(node, node.target, dist)

        view = self.view

        extend = _extend(dist, widths)

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            weight, bias = view(m.weight), view(m.bias)
            if empty or not reached:
                y = _empty_like_output(ext, local_out, [weight, bias])
                if empty or bias is None:
                    return y
                return (y + bias.view((1, -1) + (1,) * nd)).to(y.dtype)
            y = fn(ext, weight, None, m.stride, 0, 0, m.groups, m.dilation)
            y = F.pad(y[crop], pads)
            if bias is not None:  # added in float32 and rounded once, as autocast's kernel
                y = (y + bias.view((1, -1) + (1,) * nd)).to(y.dtype)
            return y

        return step

    def pool(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        nd = dist.ndim - 2
        is_max = type(m) in _MAXPOOL
        indices = is_max and m.return_indices
        stride = m.stride if m.stride is not None else m.kernel_size
        dilation = m.dilation if is_max else 1
        spec = WindowSpec.make(nd, m.kernel_size, stride, m.padding, dilation)
        shape = _shape_of(node) if not indices else \
            tuple(node.meta["tensor_meta"][0].shape)  # (y, indices): both of y's shape
        # ceil_mode: more padding after, so the floor of the rule gives PyTorch's length
        pads = list(spec.padding)
        for i in range(nd):
            extra = (shape[2 + i] - spec.out_length(i, dist.global_shape[2 + i])) * spec.stride[i]
            pads[i] = (pads[i][0], pads[i][1] + max(0, extra))
        spec = WindowSpec(spec.kernel, spec.stride, tuple(pads), spec.dilation)
        geo = geometry(spec, dist)
        out = _with_shape(geo.out_dist, shape)
        self._check_shape(node, out, shape)
        slices = geo.input_slices(geo.out_box)
        widths = geo.widths
        local_out = out.local_shape()
        empty = 0 in local_out
        self.set(node, (out, out) if indices else out)
        if indices:
            fn = _MAXPOOL[type(m)]
            fill = -math.inf
            # the global place of the window block's first element, and the input's sizes
            block = dist.block_index()
            origin = [dist.boundaries[d][block[d]] - widths[d][0] + (slices[d].start or 0)
                      for d in range(2, dist.ndim)]
            sizes = dist.global_shape[2:]

            def run(ext: torch.Tensor) -> Any:
                y, idx = fn(ext, spec.kernel, spec.stride, 0, spec.dilation,
                            return_indices=True)
                return y, _move_index(idx, ext.shape[2:], origin, sizes, clamp=True)
        elif is_max:
            fn = _MAXPOOL[type(m)]
            fill = -math.inf

            def run(ext: torch.Tensor) -> torch.Tensor:
                return fn(ext, spec.kernel, spec.stride, 0, spec.dilation)
        else:
            fn = _AVGPOOL[type(m)]
            fill = 0.0
            divisor = _avg_divisor(spec, m, dist.global_shape, geo.out_box,
                                   orig_pad=WindowSpec.make(nd, m.kernel_size, stride,
                                                            m.padding, 1).padding)
            scale = math.prod(spec.kernel)

            def run(ext: torch.Tensor) -> torch.Tensor:
                y = fn(ext, spec.kernel, spec.stride, 0)
                return y * (scale / divisor.to(dtype=y.dtype, device=y.device))

        extend = _extend(dist, widths, "constant", fill)

        def step(args: Any) -> Any:
            ext = extend(args[0][0])
            if empty:
                y = ext.new_zeros(local_out) + 0 * ext.sum()
                return (y, torch.zeros(local_out, dtype=torch.int64, device=y.device)) \
                    if indices else y
            return run(ext[slices])

        return step

    def unpool(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        """Max unpooling (``MaxUnpool1d/2d/3d``, ``F.max_unpool1d/2d/3d``) of values and the
        indices of the max pooling whose output they have the distribution of.

        A split spatial dimension is cut where the pooled one is, times the
        stride less the padding; its windows may not overlap (a stride of at
        least the kernel, as in SegNet's 2 x 2 pooling: which of two values
        meeting in one cell PyTorch keeps is the order of its loop), so each
        rank's windows lie in its own block and it scatters its values there.
        An index outside the windows of this rank's pooled elements raises a
        ValueError on every rank (one all-reduce of a flag): such indices are
        not those of the max pooling.
        """
        nd = dist.ndim - 2
        idx_dist = self.dist_of(_arg(node, 1, "indices", None))
        if not isinstance(idx_dist, Distribution) or idx_dist.global_shape != \
                dist.global_shape:
            self.fail(node, "the indices of an unpooling must be a distributed tensor of its "
                            "values' shape (the max pooling's)")
        # the indices are global (within each plane): moved to the values' blocks, they
        # keep their meaning
        move = None if idx_dist == dist else (idx_dist, dist)
        shape = _shape_of(node)
        split = [i for i in range(nd) if _split(dist, 2 + i)]
        fn = _UNPOOL[type(m)]
        spec = WindowSpec.make(nd, m.kernel_size, m.stride if m.stride is not None
                               else m.kernel_size, m.padding, 1)
        kernel, stride = spec.kernel, spec.stride
        pad = tuple(lo for lo, _ in spec.padding)
        sizes = tuple(shape[2:])
        def indices(args: Any) -> torch.Tensor:
            idx = args[0][1]
            return idx if move is None else redistribute(idx, *move)

        if not split:  # whole planes on every rank: PyTorch's own
            self.set(node, _with_shape(dist, shape))
            return lambda args: fn(args[0][0], indices(args), kernel, stride, pad, sizes)
        for i in split:
            if stride[i] < kernel[i]:
                self.fail(node, f"an unpooling whose windows overlap (kernel {kernel[i]}, "
                                f"stride {stride[i]}) on split dimension {2 + i}")
        cuts = {2 + i: [min(max(c * stride[i] - pad[i], 0), sizes[i])
                        for c in dist.boundaries[2 + i][1:-1]] for i in split}
        out = _with_shape(dist, shape, cuts)
        self._check_shape(node, out, shape)
        self.set(node, out)
        block = out.block_index()
        origin = [out.boundaries[2 + i][block[2 + i]] for i in range(nd)]
        local_out = out.local_shape()
        comm = split_axes_comm(dist, range(dist.ndim))  # every rank raises, or none

        def step(args: Any) -> torch.Tensor:
            y, idx = args[0][0], indices(args)
            n, c = local_out[:2]
            local = _move_index(idx, sizes, [-o for o in origin], local_out[2:],
                                clamp=False)
            if comm.allreduce(bool((local < 0).any()) if local.numel() else False,
                              op=MPI.LOR):
                raise ValueError(f"parallelize: {_describe(node)}: an index lies outside the "
                                 "windows of this rank's pooled elements (not the indices "
                                 "of the max pooling)")
            flat = y.new_zeros((n, c, math.prod(local_out[2:]))).scatter(
                2, local.reshape(n, c, -1), y.reshape(n, c, -1))
            return flat.reshape(local_out)

        return step

    def same_shape_local(self, node: Node, m: Callable[..., Any]) -> Step:
        return self.local(node, m)

    def adaptive(self, node: Node, output_size: Any, dist: Distribution, nd: int) -> Step:
        shape = _shape_of(node)
        ins, outs = dist.global_shape[2:], shape[2:]
        split = [i for i in range(nd) if _split(dist, 2 + i)]
        if not split:
            fn = _ADAPTIVE_F[nd - 1]
            self.set(node, _with_shape(dist, shape, {2 + i: None for i in range(nd)}))
            return lambda args: fn(args[0][0], outs)
        if all(o == 1 for o in outs):  # a global mean: local sums and one all-reduce (as a
            # pool, one window over every rank's block would gather them onto one rank)
            return self.reduce_sum(node, dist, list(range(2, 2 + nd)), True, mean=True)
        if all(n % o == 0 for n, o in zip(ins, outs)):
            k = tuple(n // o for n, o in zip(ins, outs))
            pool = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)[nd - 1](k, k)
            return self.pool(node, pool, dist)
        return self.adaptive_windows(node, dist, shape, split)

    def adaptive_windows(self, node: Node, dist: Distribution, shape: tuple[int, ...],
                         split: list[int]) -> Step:
        """Adaptive average pooling (also interpolation mode ``'area'``) of any sizes over
        split dimensions.

        Output ``j`` of a dimension of ``n`` inputs and ``m`` outputs averages
        inputs ``floor(j n / m)`` to ``ceil((j + 1) n / m)`` (PyTorch's
        windows). A rank computes the outputs whose windows start in its block
        (its output cuts are ``ceil(b m / n)`` for each input cut ``b``), over
        its block and a halo after it as wide as the furthest window's reach;
        the split dimensions one at a time as a product with the local averaging
        matrix, then the others by PyTorch's adaptive pooling (the box mean is
        separable).
        """
        nd = dist.ndim - 2
        block = dist.block_index()
        cuts: dict[int, Any] = {}
        widths = [(0, 0)] * dist.ndim
        mats: list[tuple[int, int, int, int, int]] = []  # (dim, n, m, this rank's outputs)
        for i in split:
            d = 2 + i
            n, m = dist.global_shape[d], shape[d]
            bounds = dist.boundaries[d]
            outb = [0] + [-(-b * m // n) for b in bounds[1:-1]] + [m]
            cuts[d] = outb[1:-1]
            # each block's furthest window end beyond it (none for a block without outputs)
            reach = max([-(-(o1 * n) // m) - b1 for o0, o1, b1 in
                         zip(outb, outb[1:], bounds[1:]) if o1 > o0] + [0])
            widths[d] = (0, max(reach, 0))
            mats.append((d, n, m, outb[block[d]], outb[block[d] + 1]))
        out = _with_shape(dist, shape, {2 + i: cuts.get(2 + i) for i in range(nd)})
        self._check_shape(node, out, shape)
        self.set(node, out)
        local_out = out.local_shape()
        rest = tuple(None if i in split else shape[2 + i] for i in range(nd))
        pool = _ADAPTIVE_F[nd - 1] if any(r is not None and r != dist.global_shape[2 + i]
                                           for i, r in enumerate(rest)) else None
        # this rank's averaging matrices (transposed: extended block rows x its outputs)
        local = dist.local_shape()
        weights: list[tuple[int, np.ndarray]] = []
        for d, n, m, o0, o1 in mats:
            b0 = dist.boundaries[d][block[d]]
            a = np.zeros((local[d] + widths[d][1], o1 - o0))
            for j in range(o0, o1):
                lo, hi = j * n // m, -(-((j + 1) * n) // m)
                a[lo - b0:hi - b0, j - o0] = 1.0 / (hi - lo)
            weights.append((d, a))
        made: dict[Any, list[torch.Tensor]] = {}  # by dtype and device

        extend = _extend(dist, widths)

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            if 0 in local_out:
                return ext.new_zeros(local_out) + 0 * ext.sum()
            key = (ext.dtype, ext.device)
            if key not in made:
                made[key] = [torch.tensor(a, dtype=ext.dtype, device=ext.device)
                             for _, a in weights]
            y = ext
            for (d, _), a in zip(weights, made[key]):
                y = torch.matmul(y.movedim(d, -1), a).movedim(-1, d)
            return pool(y, rest) if pool is not None else y

        return step

    def reduce_sum(self, node: Node, dist: Distribution, dims: list[int], keepdim: bool,
                   mean: bool) -> Step:
        shape = _shape_of(node)
        comm = split_axes_comm(dist, dims)
        count = math.prod(dist.global_shape[d] for d in dims)
        keep = [d for d in range(dist.ndim) if d not in dims]
        if keepdim:
            axes = [None if d in dims else a for d, a in enumerate(dist.axes)]
            splits = [None if d in dims else s for d, s in enumerate(dist.splits)]
        else:
            axes = [dist.axes[d] for d in keep]
            splits = [dist.splits[d] for d in keep]
        self.set(node, Distribution(shape, dist.grid_arg, axes, splits))
        any_split = any(_split(dist, d) for d in dims)

        def step(args: Any) -> torch.Tensor:
            x = args[0][0]
            s = x.sum(dim=dims, keepdim=keepdim)
            if any_split:
                s = all_reduce(s, comm)
            return s / count if mean else s

        return step

    def extreme(self, node: Node, dist: Distribution, dims: list[int], keepdim: bool,
                largest: bool, pooling: Callable[..., Any] | None = None) -> Step:
        """The largest (smallest) value over ``dims`` (``amax``, ``amin``, ``max()``, a
        global max pooling head): each block's, then the ranks that split ``dims``
        compare theirs; the result held alike by them, laid out as a sum's. A pooling
        (``pooling``, its own call where no rank splits ``dims``) gives the gradient to
        the first maximum, as PyTorch's pooling does; the others share it among ties."""
        shape = _shape_of(node)
        if keepdim:
            axes = [None if d in dims else a for d, a in enumerate(dist.axes)]
            splits = [None if d in dims else s for d, s in enumerate(dist.splits)]
        else:
            axes = [dist.axes[d] for d in range(dist.ndim) if d not in dims]
            splits = [dist.splits[d] for d in range(dist.ndim) if d not in dims]
        self.set(node, Distribution(shape, dist.grid_arg, axes, splits))
        if not any(_split(dist, d) for d in dims):
            if pooling is not None:
                return lambda args: pooling(*args[0], **args[1])
            local = torch.amax if largest else torch.amin
            return lambda args: local(args[0][0], dims, keepdim=keepdim)
        comm = split_axes_comm(dist, dims)
        here = dist.local_slices()
        starts = [here[d].start for d in dims]
        sizes = [dist.global_shape[d] for d in dims]
        first = pooling is not None
        return lambda args: _split_extreme(args[0][0], dims, keepdim, comm, largest, first,
                                           starts, sizes)

    def batchnorm(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        self.refuse_split(node, dist, [1], f"{type(m).__name__} normalizes per channel")
        space = list(range(2, dist.ndim))
        spatial = math.prod(dist.global_shape[d] for d in space)
        # "group": each group of ranks that holds the same samples normalizes over them
        # alone (PyTorch's batch norm under DistributedDataParallel, where the samples
        # alone are split); the groups' running statistics are averaged after the pass
        between = split_axes_comm(dist, [0]) if self.batch_norm_stats == "group" else None
        grouped = between is not None and between.Get_size() > 1
        dims = space if grouped else [0, *space]
        comm = split_axes_comm(dist, dims)
        alone = comm.Get_size() == 1
        local_n = dist.local_shape()[0]
        count = local_n * spatial if grouped else dist.global_shape[0] * spatial
        # the fewest values per channel of a group that has samples (F.batch_norm's check)
        smallest = min((hi - lo for lo, hi in zip(dist.boundaries[0], dist.boundaries[0][1:])
                        if hi > lo), default=0) * spatial
        self.set(node, dist)
        self.use_params(node, node.target, dist)
        if grouped:
            self.running.hook(m)

        params, running = self.view, self.running

        def step(args: Any) -> torch.Tensor:
            x = args[0][0]
            training = m.training or (m.running_mean is None and m.running_var is None)
            track = m.training and m.track_running_stats and m.running_mean is not None
            f = 0.0
            if track and m.num_batches_tracked is not None:
                m.num_batches_tracked.add_(1)
                f = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
            if grouped and training:
                if smallest == 1:  # as F.batch_norm refuses it, on every rank alike
                    raise ValueError(f"parallelize: {_describe(node)}: expected more than 1 "
                                     "value per channel when training, got a sample group "
                                     "of 1 (batch_norm_stats='group')")
                # this group's batch mean and unbiased variance, then the groups' average
                mean = torch.zeros_like(m.running_mean) if track else None
                var = torch.zeros_like(m.running_var) if track else None
                if local_n == 0:
                    y = _empty_like_output(x, tuple(x.shape), [params(m.weight),
                                                               params(m.bias)])
                elif alone:
                    y = F.batch_norm(x, mean, var, params(m.weight), params(m.bias), True,
                                     1.0, m.eps)
                else:
                    y = split_batch_norm(x, params(m.weight), params(m.bias), comm, count,
                                         m.eps, running_mean=mean, running_var=var,
                                         momentum=1.0)[0]
                if track:
                    running.add(m, between, mean, var, f, float(local_n > 0))
                return y
            if alone or not training:  # statistics of this block alone, or the running ones
                keep = not m.training or m.track_running_stats
                return F.batch_norm(x, m.running_mean if keep else None,
                                    m.running_var if keep else None, params(m.weight),
                                    params(m.bias), training, f, m.eps)
            return split_batch_norm(x, params(m.weight), params(m.bias), comm, count, m.eps,
                                    running_mean=m.running_mean if track else None,
                                    running_var=m.running_var if track else None,
                                    momentum=f)[0]

        return step

    def groupnorm(self, node: Node, m: nn.GroupNorm, dist: Distribution) -> Step:
        self.refuse_split(node, dist, [1], "GroupNorm normalizes groups of channels")
        dims = list(range(2, dist.ndim))
        comm = split_axes_comm(dist, dims)
        g = m.num_groups
        count = (dist.global_shape[1] // g) * math.prod(dist.global_shape[d] for d in dims)
        view = (1, -1) + (1,) * (dist.ndim - 2)
        self.set(node, dist)
        self.use_params(node, node.target, dist)

        params = self.view

        def step(args: Any) -> torch.Tensor:
            x0 = args[0][0]
            x = _wide(x0)
            xs = x.reshape(x.shape[0], g, x[0].numel() // g if x.shape[0] else 0)
            mean = broadcast(all_reduce(xs.sum(-1), comm), comm) / count
            xc = xs - mean.unsqueeze(-1)
            var = broadcast(all_reduce((xc * xc).sum(-1), comm), comm) / count
            y = (xc * torch.rsqrt(var + m.eps).unsqueeze(-1)).reshape(x.shape)
            if m.affine:
                y = y * params(m.weight).view(view) + params(m.bias).view(view)
            return y.to(x0.dtype)

        return step

    def layernorm(self, node: Node, dist: Distribution, d0: int, eps: float,
                  weight: Callable[[Any], Any], bias: Callable[[Any], Any]) -> Step:
        """Layer norm over dimensions ``d0:`` of which some are split: the mean, then the
        variance about it, summed over the ranks that split them (each a sum over this
        rank's part, then one all-reduce), and this rank's slice of the elementwise
        ``weight`` and ``bias`` (functions of the step's arguments giving the whole
        parameter or None; their gradients, zero outside the slice on each rank, are
        summed over the ranks that split the input, as any parameter's)."""
        dims = list(range(d0, dist.ndim))
        comm = split_axes_comm(dist, dims)
        count = math.prod(dist.global_shape[d] for d in dims)
        part = dist.local_slices()[d0:]
        self.set(node, dist)

        def step(args: Any) -> torch.Tensor:
            x0 = args[0][0]
            x = _wide(x0)
            mean = broadcast(all_reduce(x.sum(dims, keepdim=True), comm), comm) / count
            xc = x - mean
            var = broadcast(all_reduce((xc * xc).sum(dims, keepdim=True), comm), comm) / count
            y = xc * torch.rsqrt(var + eps)
            w, b = weight(args), bias(args)
            if w is not None:
                y = y * w[part]
            if b is not None:
                y = y + b[part]
            return y.to(x0.dtype)

        return step

    def layer_norm_function(self, node: Node, dist: Distribution) -> Step | None:
        """``F.layer_norm`` whose weight and bias are None or the model's parameters: split
        as the module is (:meth:`layernorm`) where its dimensions are split, else run on
        the block as it is; None for other arguments (the generic rules apply)."""
        shape = _arg(node, 1, "normalized_shape", None)
        eps = _arg(node, 4, "eps", 1e-5)
        affine = [_arg(node, i, name, None) for i, name in ((2, "weight"), (3, "bias"))]
        shape = (shape,) if isinstance(shape, int) else shape
        if not (isinstance(shape, (tuple, list)) and all(isinstance(v, int) for v in shape)
                and isinstance(eps, (int, float)) and 0 < len(shape) <= dist.ndim
                and all(a is None or (isinstance(a, Node) and a.op == "get_attr")
                        for a in affine)):
            return None
        for a in affine:
            if a is not None:
                self.use_param(node, a.target, dist)
        d0 = dist.ndim - len(shape)
        if any(_split(dist, d) for d in range(d0, dist.ndim)):
            def value(i: int, name: str) -> Callable[[Any], Any]:
                def get(args: Any) -> Any:
                    a, kw = args
                    return kw[name] if name in kw else (a[i] if len(a) > i else None)
                return get
            return self.layernorm(node, dist, d0, float(eps), value(2, "weight"),
                                  value(3, "bias"))
        self.set(node, dist)
        return lambda args: F.layer_norm(*args[0], **args[1])

    def interpolate(self, node: Node, dist: Distribution, mode: str, align_corners: Any,
                    antialias: bool, scale_factor: Any, recompute_scale_factor: Any,
                    local: Step) -> Step:
        """``F.interpolate`` (or ``nn.Upsample``) of any scale in any mode but ``'area'``
        (adaptive average pooling, :meth:`adaptive`); ``local`` is the call itself.

        Where no rank splits a spatial dimension, each rank makes the call on its block.
        Otherwise each split dimension's output cuts are its input cuts scaled (rounded
        up), so a rank's output rows read its own block and a few rows about it. Where
        those scales are integers (and any scale given is that integer) and corners are
        not aligned, each rank interpolates its block extended by the kernel's reach and
        crops; otherwise, each output row along a split dimension is the weighted sum of
        the input rows PyTorch reads for it
        (:func:`~disttensor_nn.torch.interpolation.source_taps`), from the block and a
        halo as wide as the farthest of those rows on any rank. The dimensions no rank
        splits are interpolated by ``F.interpolate`` itself, with the caller's scales.
        """
        nd = dist.ndim - 2
        shape = _shape_of(node)
        split = [i for i in range(nd) if _split(dist, 2 + i)]
        if not split:  # nothing to exchange: PyTorch's own call on the block
            out = _with_shape(dist, shape)
            self._check_shape(node, out, shape)
            self.set(node, out)
            return local
        if mode == "area":  # PyTorch's 'area' is adaptive average pooling
            return self.adaptive(node, None, dist, nd)
        where = f"on split dimension {2 + split[0]}"
        if mode not in INTERPOLATION_MODES:
            self.fail(node, f"interpolation mode '{mode}' {where}")
        given = scale_factor if isinstance(scale_factor, (tuple, list)) else [scale_factor]
        if any(isinstance(v, Node) for v in given):
            self.fail(node, f"a scale factor computed in forward {where} (give the size, "
                            "or a scale known when the model is traced)")
        ins = dist.global_shape
        scales = _interpolation_scales(scale_factor, recompute_scale_factor, nd)
        corners = bool(align_corners) and not mode.startswith("nearest")
        factors = {i: shape[2 + i] // ins[2 + i] for i in split
                   if ins[2 + i] and shape[2 + i] % ins[2 + i] == 0}
        aligned = not corners and len(factors) == len(split) and all(
            scales is None or scales[i] == factors[i] for i in split)
        if antialias and (mode == "bicubic" or not aligned):
            self.fail(node, f"antialias=True in mode '{mode}' with a scale of "
                            f"{ins[2 + split[0]]} -> {shape[2 + split[0]]} {where} (split only "
                            "for the linear modes and integer scales)")
        out = _with_shape(dist, shape, {2 + i: (
            [-(-c * shape[2 + i] // ins[2 + i]) for c in dist.boundaries[2 + i][1:-1]]
            if i in split else None) for i in range(nd)})
        self._check_shape(node, out, shape)
        self.set(node, out)
        kwargs = {} if mode.startswith("nearest") or mode == "area" else \
            {"align_corners": align_corners, "antialias": antialias}
        local_out = out.local_shape()
        if not aligned:
            return self._taps_step(dist, out, split, mode, corners, scales, kwargs)
        h = _REACH.get(mode, 0)
        widths = [(0, 0), (0, 0)] + [(h, h) if i in split else (0, 0) for i in range(nd)]
        halo = h > 0 and bool(split)
        size = tuple(local_out[2 + i] + (2 * h * factors[i] if i in split and h else 0)
                     for i in range(nd))
        crop = tuple(slice(h * factors[i], h * factors[i] + local_out[2 + i])
                     if i in split and h else slice(None) for i in range(nd))
        if scales is not None:  # PyTorch maps rows by the scales given, where they are
            kwargs.update(recompute_scale_factor=False, scale_factor=tuple(
                float(factors[i]) if i in split else scales[i] for i in range(nd)))
        else:
            kwargs["size"] = size
        extend = _extend(dist, widths if halo else [(0, 0)] * dist.ndim, "edge")

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            if 0 in local_out:
                return ext.new_zeros(local_out) + 0 * ext.sum()
            y = F.interpolate(ext, mode=mode, **kwargs)
            return y[(slice(None), slice(None)) + crop] if halo else y

        return step

    @staticmethod
    def _taps_step(dist: Distribution, out: Distribution, split: list[int], mode: str,
                   corners: bool, scales: tuple[float, ...] | None,
                   kwargs: dict[str, Any]) -> Step:
        """Interpolation along the ``split`` dimensions as weighted sums of input rows
        (:func:`~disttensor_nn.torch.interpolation.source_taps`): the rows each rank's
        output rows read, found for every rank, set the halo's widths (the reads are
        clamped inside the array, as PyTorch clamps them); the other dimensions by
        ``F.interpolate``."""
        nd = dist.ndim - 2
        local_out = out.local_shape()
        widths: list[tuple[int, int]] = [(0, 0)] * dist.ndim
        # per split dimension: its axis, lengths, scale, the extended block's first global
        # row, this rank's output rows, and which spatial dimension it is
        per_dim = []
        for i in split:
            d = 2 + i
            n, m = dist.global_shape[d], out.global_shape[d]
            cut_in, cut_out = dist.boundaries[d], out.boundaries[d]
            scale = None if scales is None else scales[i]
            before = after = 0
            for j in range(len(cut_in) - 1):  # every rank's reads along d, either precision
                for double in (True, False):
                    reach = taps_reach(source_taps(mode, n, m, range(cut_out[j], cut_out[j + 1]),
                                                   corners, scale, double, nd, i))
                    if reach is not None:
                        before = max(before, cut_in[j] - reach[0])
                        after = max(after, reach[1] - cut_in[j + 1] + 1)
            widths[d] = (before, after)
            first, o = dist.local_slices()[d].start, out.local_slices()[d]
            per_dim.append((d, n, m, scale, first - before, range(o.start, o.stop), i))
        shape_now = list(dist.local_shape())
        for d, *_ in per_dim:
            shape_now[d] = local_out[d]
        rest = {}  # the dimensions no rank splits, interpolated as PyTorch would
        moved = [i for i in range(nd) if i not in split and (
            shape_now[2 + i] != local_out[2 + i] or scales is not None and scales[i] != 1.0)]
        if moved and all(shape_now[2 + i] == local_out[2 + i] for i in moved):
            # a call that keeps every size but moves rows (a scale whose output rounds to
            # the input's length): PyTorch's backward of it is not its adjoint (it copies
            # the gradient, as if nothing moved), so these dimensions take weighted rows too
            for i in moved:
                n = dist.global_shape[2 + i]
                per_dim.append((2 + i, n, n, None if scales is None else scales[i], 0,
                                range(n), i))
        elif moved:
            if scales is not None:
                rest = dict(kwargs, recompute_scale_factor=False, scale_factor=tuple(
                    1.0 if i in split else scales[i] for i in range(nd)))
            else:
                rest = dict(kwargs, size=tuple(local_out[2:]))
        extend = _extend(dist, widths, "edge")
        cached: dict[bool, list] = {}

        def taps(is_double: bool) -> list:
            if is_double not in cached:  # the nearest modes' rows depend on the precision
                cached[is_double] = [
                    (d, [(torch.from_numpy(idx - offset),
                          torch.from_numpy(w).view((-1,) + (1,) * (dist.ndim - 1 - d)))
                         for idx, w in source_taps(mode, n, m, rows, corners, scale,
                                                   is_double, nd, axis)])
                    for d, n, m, scale, offset, rows, axis in per_dim]
            return cached[is_double]

        def step(args: Any) -> torch.Tensor:
            ext = extend(args[0][0])
            if 0 in local_out:
                return ext.new_zeros(local_out) + 0 * ext.sum()
            # 16-bit blocks summed in float32 and rounded once, as PyTorch's kernels do
            y = ext.float() if ext.dtype in (torch.bfloat16, torch.float16) else ext
            for d, pairs in taps(ext.dtype == torch.float64):
                if len(pairs) == 1:  # the nearest modes: one row, weight 1
                    y = y.index_select(d, pairs[0][0].to(y.device))
                    continue
                acc = None
                for idx, w in pairs:
                    term = y.index_select(d, idx.to(y.device)) * w.to(y.dtype).to(y.device)
                    acc = term if acc is None else acc + term
                y = acc
            if rest:
                y = F.interpolate(y, mode=mode, **rest)
            return y.to(ext.dtype)

        return step

    def pixel_shuffle(self, node: Node, dist: Distribution, r: int,
                      fn: Callable[..., torch.Tensor]) -> Step:
        """``pixel_shuffle`` (channels into space, r x r) or ``pixel_unshuffle`` (space into
        channels) of each rank's block: local, the last two dimensions' cuts scaled by
        ``r`` (unshuffle: divided; an input whose cuts are not multiples of ``r`` is first
        redistributed to the nearest cuts that are)."""
        unshuffle = fn is F.pixel_unshuffle
        c = dist.ndim - 3
        self.refuse_split(node, dist, [c], "pixel_shuffle moves channels to and from space")
        shape = _shape_of(node)
        src, cuts = dist, {}
        for d in (dist.ndim - 2, dist.ndim - 1):
            if not _split(dist, d):
                continue
            inner = list(dist.boundaries[d][1:-1])
            if unshuffle:
                inner = [min(round(b / r) * r, dist.global_shape[d]) for b in inner]
                cuts[d] = [b // r for b in inner]
                src = _with_shape(src, src.global_shape, {d: inner})
            else:
                cuts[d] = [b * r for b in inner]
        out = _with_shape(src, shape, cuts)
        self._check_shape(node, out, shape)
        move = src != dist
        local_out = out.local_shape()
        self.set(node, out)

        def step(args: Any) -> torch.Tensor:
            x = args[0][0]
            if move:
                x = redistribute(x, dist, src)
            if 0 in local_out:  # torch returns an empty block as it is, of the wrong shape
                return x.new_zeros(local_out) + 0 * x.sum()
            return fn(x, r)

        return step

    def dropout(self, node: Node, dist: Distribution,
                settings: Callable[[Any], tuple[float, bool]], channels: bool = False) -> Step:
        """Dropout with the mask one process draws for the same seed (every rank draws it
        alike): of the global shape, or with ``channels`` (``Dropout1d/2d/3d``) one draw per
        sample and channel, ``(N, C, 1, ...)``, which ranks that split space share; each
        rank multiplies its block by its part of the mask."""
        self.set(node, dist)
        shape = dist.global_shape
        slices = dist.local_slices()
        if channels:
            shape = tuple(shape[:2]) + (1,) * (dist.ndim - 2)
            slices = slices[:2]

        def step(args: Any) -> torch.Tensor:
            x = args[0][0]
            p, training = settings(args)
            if not training or p == 0:
                return x
            if p == 1:
                return x * torch.zeros_like(x)
            noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
            noise.div_(1 - p)
            return x * noise[slices]

        return step

    def feature_dropout(self, node: Node, dist: Distribution, nd: int,
                        settings: Callable[[Any], tuple[float, bool]],
                        whole: Callable[..., Any]) -> Step:
        """Dropout of whole channels of an ``nd``-D batch (:meth:`dropout`); an input without
        a batch dimension runs ``whole`` (the call as it is), which no rank may split."""
        if dist.ndim != nd + 2:
            return self.local(node, whole)
        return self.dropout(node, dist, settings, channels=True)

    def reshape(self, node: Node, dist: Distribution) -> Step:
        shape = _shape_of(node)
        src = dist.global_shape
        p = 0
        while p < min(len(shape), len(src)) and shape[p] == src[p]:
            p += 1
        if p == len(src) == len(shape):
            self.set(node, dist)
            return lambda args: args[0][0]
        rest = list(range(p, len(src)))
        whole = _unsplit(dist, rest) if any(_split(dist, d) for d in rest) else dist
        axes = list(whole.axes[:p]) + [None] * (len(shape) - p)
        splits = list(whole.splits[:p]) + [None] * (len(shape) - p)
        out = Distribution(shape, dist.grid_arg, axes, splits)
        local = out.local_shape()
        self.set(node, out)
        move = whole != dist

        def step(args: Any) -> torch.Tensor:
            x = args[0][0]
            if move:
                x = redistribute(x, dist, whole)
            return x.reshape(local)

        return step

    def linear(self, node: Node, m: nn.Linear, dist: Distribution) -> Step:
        last = dist.ndim - 1
        whole = _unsplit(dist, [last]) if _split(dist, last) else dist
        shape = _shape_of(node)
        self.set(node, _with_shape(whole, shape, {last: None}))
        self.use_params(node, node.target, whole)
        move = whole != dist

        view = self.view

        def step(args: Any) -> torch.Tensor:
            x = args[0][0]
            if move:
                x = redistribute(x, dist, whole)
            return F.linear(x, view(m.weight), view(m.bias))

        return step

    def _check_shape(self, node: Node, out: Distribution, shape: Sequence[int]) -> None:
        if tuple(out.global_shape) != tuple(shape):  # pragma: no cover - a geometry bug
            self.fail(node, f"the window geometry gives shape {out.global_shape}, PyTorch "
                            f"{tuple(shape)}")

    # --------------------------------------------------------------- call_function / method
    def call_function(self, node: Node) -> Step:
        fn = node.target
        x = node.args[0] if node.args else None
        dist = self.dist_of(x)
        if fn in (torch.cat, torch.concat) and isinstance(x, (list, tuple)):
            return self.cat(node)
        if dist is None:
            if any(self.dist_of(a) is not None for a in _flat_nodes(node)):
                return self.elementwise(node, fn)
            return self.local(node, fn)
        if fn is getattr and node.args[1] == "shape":
            return self.global_attr(node, dist.global_shape)
        if fn is getattr and node.args[1] in _BLOCK_ALIKE:  # every block's is the array's
            name = node.args[1]
            self.set(node, None)
            return lambda args: getattr(args[0][0], name)
        if fn is operator.getitem and isinstance(dist, tuple):  # one of a tuple's values
            i = node.args[1]
            self.set(node, dist[i])
            return lambda args: args[0][0][i]
        if fn is operator.getitem:
            return self.getitem(node, dist)
        if fn in _UNPOOL_F:
            k, s_, p_ = (_arg(node, i, n, d) for i, n, d in
                         ((2, "kernel_size", None), (3, "stride", None), (4, "padding", 0)))
            if any(isinstance(v, Node) for v in (k, s_, p_)):
                self.fail(node, "an unpooling whose kernel, stride or padding is computed")
            return self.unpool(node, _UNPOOL_F[fn](k, s_, p_), dist)
        if fn is F.layer_norm:
            step = self.layer_norm_function(node, dist)
            if step is not None:
                return step
        if fn is F.interpolate:
            mode = _arg(node, 3, "mode", "nearest")
            return self.interpolate(node, dist, mode, _arg(node, 4, "align_corners", None),
                                    bool(_arg(node, 6, "antialias", False)),
                                    _arg(node, 2, "scale_factor", None),
                                    _arg(node, 5, "recompute_scale_factor", None),
                                    lambda args: F.interpolate(*args[0], **args[1]))
        if fn in (F.pixel_shuffle, F.pixel_unshuffle, torch.pixel_shuffle,
                  torch.pixel_unshuffle):
            unshuffle = fn in (F.pixel_unshuffle, torch.pixel_unshuffle)
            r = _arg(node, 1, "downscale_factor" if unshuffle else "upscale_factor", None)
            return self.pixel_shuffle(node, dist, int(r),
                                      F.pixel_unshuffle if unshuffle else F.pixel_shuffle)
        if fn is torch.flatten:
            return self.reshape(node, dist)
        if fn is F.dropout or fn in _FEATURE_DROPOUT_FUNCTIONS:
            def settings(args: Any) -> tuple[float, bool]:
                a, kw = args
                p = kw.get("p", a[1] if len(a) > 1 else 0.5)
                return p, kw.get("training", a[2] if len(a) > 2 else True)
            if fn is F.dropout:
                return self.dropout(node, dist, settings)
            return self.feature_dropout(node, dist, _FEATURE_DROPOUT_FUNCTIONS[fn], settings, fn)
        if fn in _ADAPTIVE_F:
            return self.adaptive(node, None, dist, dist.ndim - 2)
        if fn in _ADAPTIVE_MAX_F and _global_window(_arg(node, 1, "output_size", None)) \
                and not _arg(node, 2, "return_indices", False):
            nd = _ADAPTIVE_MAX_F.index(fn) + 1
            return self.extreme(node, dist, list(range(dist.ndim - nd, dist.ndim)), True,
                                True, pooling=lambda *a, **kw: fn(*a, **kw))
        if fn in _EXTREMES:
            return self.extreme(node, dist, _dims(_arg(node, 1, "dim", ()), dist.ndim),
                                bool(_arg(node, 2, "keepdim", False)), _EXTREMES[fn])
        if fn in (torch.max, torch.min) and len(node.args) == 1 and not node.kwargs:
            return self.extreme(node, dist, list(range(dist.ndim)), False, fn is torch.max)
        pool = pool_module(node)
        if pool is not None:  # F.max_poolNd, F.avg_poolNd: as the module
            return self.pool(node, pool, dist)
        if fn in (torch.mean, torch.sum):
            return self.reduction(node, dist, fn.__name__)
        if _elementwise_function(fn):
            return self.elementwise(node, fn)
        if fn in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax):
            dim = _arg(node, 1, "dim", None)
            self.refuse_split(node, dist, [(dim if dim is not None else 1) % dist.ndim],
                              "softmax reduces")
            self.set(node, dist)
            return lambda args: fn(*args[0], **args[1])
        return self.local(node, fn)

    def call_method(self, node: Node) -> Step:
        name = node.target
        x = node.args[0]
        dist = self.dist_of(x)
        if dist is None:
            return self.local(node, _method(name))
        if name == "size":
            return self.global_attr(node, dist.global_shape, sized=True)
        if name == "dim":
            return self.global_attr(node, dist.ndim, scalar=True)
        if name in ("view", "reshape", "flatten"):
            return self.reshape(node, dist)
        if name == "permute":
            return self.permute(node, dist)
        if name in ("mean", "sum"):
            return self.reduction(node, dist, name)
        if name in ("amax", "amin"):
            return self.extreme(node, dist, _dims(_arg(node, 1, "dim", ()), dist.ndim),
                                bool(_arg(node, 2, "keepdim", False)), name == "amax")
        if name in ("max", "min") and len(node.args) == 1 and not node.kwargs:
            return self.extreme(node, dist, list(range(dist.ndim)), False, name == "max")
        if name in _ELEMENTWISE_NAMES or name.rstrip("_") in _ELEMENTWISE_NAMES:
            return self.elementwise(node, _method(name))
        return self.local(node, _method(name))

    def global_attr(self, node: Node, value: Any, sized: bool = False,
                    scalar: bool = False) -> Step:
        """Sizes as the global array has them (every rank alike)."""
        self.set(node, None)
        if scalar:
            return lambda args: value
        whole = torch.Size(value)
        if not sized:
            return lambda args: whole

        def step(args: Any) -> Any:
            a, kw = args
            dim = kw.get("dim", a[1] if len(a) > 1 else None)
            return whole if dim is None else whole[dim]

        return step

    def getitem(self, node: Node, dist: Distribution) -> Step:
        """Indexing with slices, ints, ``None`` and ``...``: locally, where it keeps the split
        dimensions whole (a new dimension of length 1 is whole on every rank)."""
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if not all(i is None or i is Ellipsis or isinstance(i, (slice, int))
                   and not isinstance(i, bool) for i in index) \
                or sum(i is Ellipsis for i in index) > 1 \
                or sum(i is not None and i is not Ellipsis for i in index) > dist.ndim:
            return self.local(node, operator.getitem)
        if Ellipsis in index:
            k = index.index(Ellipsis)
            rest = dist.ndim - sum(i is not None for i in index) + 1
            index = index[:k] + (slice(None),) * rest + index[k + 1:]
        axes, splits = [], []
        d = 0
        for i in (*index, *[slice(None)] * (dist.ndim - sum(i is not None for i in index))):
            if i is None:  # a new dimension of length 1
                axes.append(None)
                splits.append(None)
                continue
            if i != slice(None):
                self.refuse_split(node, dist, [d], "indexing selects")
            if not isinstance(i, int):
                axes.append(dist.axes[d])
                splits.append(dist.splits[d] if i == slice(None) else None)
            d += 1
        self.set(node, Distribution(_shape_of(node), dist.grid_arg, axes, splits))
        return lambda args: args[0][0][index]

    def permute(self, node: Node, dist: Distribution) -> Step:
        order = node.args[1:] if not isinstance(node.args[1], (tuple, list)) else node.args[1]
        order = [int(o) % dist.ndim for o in order]
        out = Distribution([dist.global_shape[o] for o in order], dist.grid_arg,
                           [dist.axes[o] for o in order], [dist.splits[o] for o in order])
        self.set(node, out)
        return lambda args: args[0][0].permute(order)

    def reduction(self, node: Node, dist: Distribution, name: str) -> Step:
        dim = _arg(node, 1, "dim", None)
        keepdim = bool(_arg(node, 2, "keepdim", False))
        if _arg(node, 3, "dtype", None) is not None:
            return self.local(node, _method(name))
        dims = list(range(dist.ndim)) if dim is None else sorted(
            {int(d) % dist.ndim for d in (dim if isinstance(dim, (tuple, list)) else [dim])})
        return self.reduce_sum(node, dist, dims, keepdim, mean=name == "mean")

    def cat(self, node: Node) -> Step:
        tensors = list(node.args[0])
        dim = _arg(node, 1, "dim", 0)
        dists = [self.dist_of(t) for t in tensors]
        if any(d is None for d in dists):
            return self.local(node, torch.cat)
        first = dists[0]
        dim %= first.ndim
        self.refuse_split(node, first, [dim], "torch.cat joins along one dimension")
        shape = _shape_of(node)
        targets = [_with_shape(first, d.global_shape, {dim: None}) for d in dists]
        out = _with_shape(first, shape, {dim: None})
        self.set(node, out)
        moves = [(d, t) if d != t else None for d, t in zip(dists, targets)]

        def step(args: Any) -> torch.Tensor:
            a, _ = args
            blocks = [b if mv is None else redistribute(b, *mv) for b, mv in zip(a[0], moves)]
            return torch.cat(blocks, dim)

        return step



# ------------------------------------------------------------------ small helpers
def _elementwise_function(fn: Any) -> bool:
    """Whether the function or method name ``fn`` is an element-wise operation."""
    if isinstance(fn, str):
        return fn in _ELEMENTWISE_NAMES or fn.rstrip("_") in _ELEMENTWISE_NAMES
    return fn in _ELEMENTWISE_F or fn in _BINARY_OPERATORS or (
        getattr(fn, "__module__", None) in ("torch", None)
        and getattr(fn, "__name__", "").rstrip("_") in _ELEMENTWISE_NAMES)  # relu_ too


def _runs_on_blocks(gm: GraphModule) -> Callable[[Node], bool]:
    """Whether the compiler runs a node of ``gm`` on blocks of any split, as it is."""
    def test(node: Node) -> bool:
        if node.op == "call_module":
            m = gm.get_submodule(node.target)
            return isinstance(m, _ELEMENTWISE_MODULES) and not (
                isinstance(m, nn.PReLU) and m.num_parameters > 1)
        if node.op in ("call_function", "call_method"):
            return _elementwise_function(node.target)
        return False

    return test


def getattr_path(obj: Any, target: str) -> Any:
    """``obj.a.b.c`` for ``target`` 'a.b.c'."""
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _method(name: str) -> Callable[..., Any]:
    return lambda self, *a, **kw: getattr(self, name)(*a, **kw)


def _interpolation_scales(scale_factor: Any, recompute: Any, nd: int
                          ) -> tuple[float, ...] | None:
    """The scales ``F.interpolate`` maps rows by, per spatial dimension (None: the
    sizes' ratios, as where a size was given or ``recompute_scale_factor`` set)."""
    if scale_factor is None or recompute:
        return None
    if isinstance(scale_factor, (tuple, list)):
        return tuple(float(v) for v in scale_factor)
    return (float(scale_factor),) * nd


def _arg(node: Node, index: int, name: str, default: Any) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def _flat_nodes(node: Node) -> list[Node]:
    out: list[Node] = []
    map_aggregate((node.args, node.kwargs),
                  lambda a: out.append(a) if isinstance(a, Node) else None)
    return out


def _node_positions(node: Node, moves: dict[Node, Any]) -> list[tuple[tuple, Any]]:
    """Where in ``(args, kwargs)`` each moved node sits (a path of indices and keys), with
    what ``moves`` holds for it."""
    found: list = []

    def walk(value: Any, path: tuple) -> None:
        if isinstance(value, Node):
            if value in moves:
                found.append((path, moves[value]))
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(v, path + (i,))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, path + (k,))

    walk((node.args, node.kwargs), ())
    return found


def _replace_at(value: Any, path: tuple, fn: Callable[[Any], Any]) -> Any:
    if not path:
        return fn(value)
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace_at(value[head], rest, fn)}
    items = list(value)
    items[head] = _replace_at(items[head], rest, fn)
    return type(value)(items) if isinstance(value, tuple) else items


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


def _avg_divisor(spec: WindowSpec, m: nn.Module, shape: Sequence[int],
                 box: Sequence[tuple[int, int]], orig_pad: Sequence[tuple[int, int]]
                 ) -> torch.Tensor:
    """PyTorch's divisor of each of this rank's average-pool outputs."""
    nd = len(spec.kernel)
    if getattr(m, "divisor_override", None):
        sizes = [max(0, b - a) for a, b in box]
        return torch.full(sizes, float(m.divisor_override), dtype=torch.float64).view(
            (1, 1) + tuple(sizes))
    out = torch.ones((), dtype=torch.float64)
    for i in range(nd):
        n, k, s, p = shape[2 + i], spec.kernel[i], spec.stride[i], orig_pad[i][0]
        j = torch.arange(box[i][0], box[i][1], dtype=torch.float64)
        start = j * s - p
        end = torch.clamp(start + k, max=n + p)
        if m.count_include_pad:
            size = end - start
        else:
            size = torch.clamp(end, max=n) - torch.clamp(start, min=0)
        out = out.unsqueeze(-1) * size
    return out.view((1, 1) + tuple(max(0, b - a) for a, b in box))
