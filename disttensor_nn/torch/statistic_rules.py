"""The compiler's rules for operations that combine values along split dimensions: sums and
means, extremes, and batch, group and layer norms (each a local pass and collectives over
the ranks that split what it reduces).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from disttensor import Distribution
from disttensor_nn.reduction import split_axes_comm

from .functional import _split_extreme, all_reduce, broadcast
from .layouts import _split
from .norm import split_batch_norm
from .rules import _arg, _describe, _empty_like_output, _Rules, _shape_of
from .runtime import Step


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 where it is 16-bit: normalization statistics accumulate in float32."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


class _StatisticRules(_Rules):
    """Reductions and normalizations over split dimensions."""

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
        the first maximum (the last NaN), as PyTorch's pooling does; the others share it
        among ties."""
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
