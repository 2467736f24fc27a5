"""The compiler of :func:`~disttensor_nn.torch.parallelize`: each node of a traced,
shape-propagated model becomes a step on this rank's block (the rules are
listed in :mod:`disttensor_nn.torch.parallel`); every decision is metadata,
made alike on every rank before any message. This module dispatches each node to its
rule and holds the rules for element-wise operations, shapes, indexing, concatenation,
dropout and linear heads; :mod:`.window_rules` and :mod:`.statistic_rules` hold the
others.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate

from disttensor import DistArray, Distribution
from disttensor_nn.reduction import split_axes_comm

from .autoplan import (
    _FEATURE_DROPOUT_FUNCTIONS,
    _FEATURE_DROPOUT_MODULES,
    _UNPOOL,
    _UNPOOL_F,
    LAYOUT_KEY,
    pool_module,
    relayout,
    unbatched_error,
    unbatched_node_error,
)
from .channels import take_channels
from .functional import redistribute
from .layouts import (
    _broadcast_to,
    _move_then_share,
    _split,
    _takes_channels,
    _unsplit,
    _with_shape,
)
from .rules import (
    _arg,
    _dims,
    _empty_like_output,
    _flat_nodes,
    _float_tensor,
    _method,
    _shape_of,
    _Value,
)
from .runtime import Step
from .window_rules import _ADAPTIVE_F, _AVGPOOL, _CONV, _CONV_T, _MAXPOOL, _WindowRules

_ADAPTIVE = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)

# modules over each sample's (and channel's) whole space
_PER_SAMPLE = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.AdaptiveMaxPool1d,
               nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)

_ADAPTIVE_MAX = (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)

_ADAPTIVE_MAX_F = (F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d)

_EXTREMES = {torch.amax: True, torch.amin: False}  # largest

_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

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
    "xlogy logit sgn signbit heaviside bool int long fmax fmin masked_fill".split()
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

# a tensor of the input's shape, filled with constants: each block of it is its own
_FILLED_LIKE = frozenset((torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like))
# ... with random values: every rank draws the whole tensor (alike, as one process draws it
# for the same seed) and keeps its block
_RANDOM_LIKE = frozenset((torch.rand_like, torch.randn_like, torch.randint_like))

_ELEMENTWISE_F = (F.relu, F.relu6, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish, F.leaky_relu,
                  F.hardtanh, F.hardswish, F.hardsigmoid, F.sigmoid, F.tanh, F.softplus,
                  F.logsigmoid, F.threshold)


def _global_window(output_size: Any) -> bool:
    """Whether an adaptive pooling's output size is 1 in every dimension (one window)."""
    sizes = output_size if isinstance(output_size, (tuple, list)) else (output_size,)
    return all(s == 1 for s in sizes)


class _Compiler(_WindowRules):
    """Turns each node of a traced, shape-propagated graph into a step on blocks."""

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
            # each distributed tensor of the output a DistArray, in containers of any depth
            if isinstance(dist, Distribution):
                return DistArray(block, dist)
            # (torch.fx hands the output's dicts and lists over as its immutable ones)
            if isinstance(block, dict) and isinstance(dist, dict):
                return {k: wrap(v, dist[k]) for k, v in block.items()}
            if isinstance(block, (tuple, list)) and isinstance(dist, (tuple, list)):
                items = [wrap(o, d) for o, d in zip(block, dist)]
                if hasattr(block, "_fields"):  # a named tuple
                    return type(block)(*items)
                if isinstance(block, list):
                    return items
                # a tuple, or PyTorch's own of values and indices (torch.return_types.max)
                return tuple(items) if type(block) is tuple else type(block)(items)
            return block

        def step(args: Any) -> Any:
            return wrap(args[0][0], dists)

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
                # a tensor every rank holds whole (a parameter, a buffer, made of them)
                cut = self.cut_to_block(node, a, target)
                if cut is not None:
                    moves[a] = lambda t, cut=cut: t[cut]
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

    def cut_to_block(self, node: Node, attr: Node, dist: Distribution) -> tuple | None:
        """How to index a tensor that every rank holds whole (``attr``: a parameter, a buffer,
        a value made of them) for this rank's block of an element-wise operation's output
        ``dist``: along each split dimension where it has the output's length (a position
        embedding, a per-row weight), this rank's part (its gradient there, zeros elsewhere,
        summed over the ranks with the parameter's); None where it broadcasts along every
        split dimension (length 1) and is used whole."""
        shape = _shape_of(attr)
        if shape is None:
            return None
        index: list[Any] = [slice(None)] * len(shape)
        for k in range(1, len(shape) + 1):
            d = dist.ndim - k
            if d < 0 or shape[-k] == 1 or not _split(dist, d):
                continue
            if shape[-k] != dist.global_shape[d]:  # pragma: no cover - PyTorch refuses it
                what = attr.target if attr.op == "get_attr" else attr.name
                self.fail(node, f"broadcasts '{what}' of shape {shape} against length "
                                f"{dist.global_shape[d]} along dimension {d}")
            index[-k] = dist.local_slices()[d]
        return tuple(index) if any(i != slice(None) for i in index) else None

    def call_module(self, node: Node) -> Step:
        m = self.gm.get_submodule(node.target)
        x = node.args[0] if node.args else None
        dist = self.dist_of(x)
        if dist is None:
            return self.local(node, self.module_call(m))
        why = unbatched_error(m, dist.global_shape)
        if why:
            self.fail(node, why)
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
        pair = not hasattr(meta, "shape")  # max pooling's values and indices, alike
        out = _with_shape(dist, tuple(meta[0].shape) if pair else _shape_of(node))
        self.set(node, (out, out) if pair else out)
        self.use_params(node, node.target, dist)
        view = self.view
        if 0 not in dist.local_shape():
            return lambda args: view.call(m, args[0], args[1])
        # a rank without samples (more ranks split the batch than it has): PyTorch's
        # modules refuse an empty batch (instance norm), so its empty block is made here,
        # on the parameters' graph as every rank's
        shape = out.local_shape()
        params = list(m.parameters())

        def empty(args: Any) -> Any:
            x = args[0][0]  # in the input's dtype, as the module gives (no autocast's)
            y = _empty_like_output(x, shape, [view(p) for p in params]).to(x.dtype)
            return (y, torch.zeros(shape, dtype=torch.int64, device=y.device)) if pair else y

        return empty

    def same(self, node: Node, m: nn.Module, dist: Distribution) -> Step:
        """A module that maps this rank's block to its block of the same distribution."""
        self.set(node, dist)
        self.use_params(node, node.target, dist)
        view = self.view
        return lambda args: view.call(m, args[0], args[1])

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

    def call_function(self, node: Node) -> Step:
        fn = node.target
        x = node.args[0] if node.args else None
        dist = self.dist_of(x)
        if fn in (torch.cat, torch.concat) and isinstance(x, (list, tuple)):
            return self.cat(node)
        if isinstance(fn, type) and issubclass(fn, tuple) and hasattr(fn, "_fields") \
                and not node.kwargs:  # a named tuple of values: each keeps its layout
            self.set(node, tuple(map_aggregate(node.args, self.dist_of)))
            return lambda args: fn(*args[0])
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
        if fn is getattr and isinstance(dist, tuple) and node.args[1] in ("values", "indices"):
            # a value of torch.max, sort, topk... along a dimension, by its name
            name = node.args[1]
            self.set(node, dist[0 if name == "values" else 1])
            return lambda args: getattr(args[0][0], name)
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
        why = unbatched_node_error(self.gm, node, dist.global_shape)
        if why:
            self.fail(node, why)
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
        if fn in _FILLED_LIKE or fn in _RANDOM_LIKE:
            return self.like(node, dist, fn)
        if fn is torch.numel:
            return self.global_attr(node, math.prod(dist.global_shape), scalar=True)
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
        if name in ("numel", "nelement"):
            return self.global_attr(node, math.prod(dist.global_shape), scalar=True)
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

    def like(self, node: Node, dist: Distribution, fn: Callable[..., Any]) -> Step:
        """A tensor of the input's shape (``torch.zeros_like`` and the like): each rank
        makes its block; random values are drawn whole on every rank and cut, so that the
        blocks make the tensor one process draws for the same seed."""
        self.set(node, dist)
        if fn not in _RANDOM_LIKE:
            return lambda args: fn(*args[0], **args[1])
        shape, slices = tuple(dist.global_shape), dist.local_slices()

        def step(args: Any) -> torch.Tensor:
            (x, *rest), kw = args
            whole = x.new_empty(shape)
            return fn(whole, *rest, **kw)[slices]

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
