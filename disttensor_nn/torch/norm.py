"""Batch normalization whose statistics span ranks, on PyTorch's kernels.

:func:`split_batch_norm` normalizes a block of ``(N, C, *S)`` whose batch or
spatial dimensions are split over the ranks of ``comm`` by the statistics of
the global array, as ``torch.nn.BatchNorm`` does on the whole of it. Each
pass over the block is one PyTorch kernel: the evaluation-mode batch-norm
kernel as a per-channel affine map (the deviations from the mean forward,
the input gradient backward), in-place products, and per-sample dot products
for the sums of squares and of ``dy * x`` (no temporary block). The ranks
share per-channel statistics, taken in float32 for 16-bit blocks (float64
for float64 ones): forward, one allgather of each rank's count, mean and
variance about its own mean, combined alike on every rank (Chan et al.: no
sum cancels); backward, one all-reduce of ``2 C`` values.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from disttensor.backend import contiguous
from disttensor.settings import validating
from disttensor.transport import allreduce

__all__ = ["split_batch_norm"]


def _sums_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _allreduce(t: torch.Tensor, comm: MPI.Intracomm) -> torch.Tensor:
    return allreduce(contiguous(t, copy=True), comm)


def _affine(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``x * scale + shift`` per channel, in one pass: the evaluation-mode batch-norm kernel
    with a mean of 0, a variance of 1 and no epsilon."""
    zero, one = torch.zeros_like(scale), torch.ones_like(scale)
    return torch.batch_norm(x, scale, shift, zero, one, False, 0.0, 0.0, False)


def _dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per channel, the sum of ``a * b`` over the samples and space of two ``(n, C, *s)``
    blocks: a dot product per sample, no temporary block."""
    a3, b3 = a.reshape(a.shape[0], a.shape[1], -1), b.reshape(b.shape[0], b.shape[1], -1)
    return sum(torch.linalg.vecdot(a3[i], b3[i]) for i in range(a.shape[0]))


def _combine(local: int, mean_l: torch.Tensor, var_l: torch.Tensor, comm: MPI.Intracomm,
             count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and biased variance per channel over every rank's block, from each rank's
    ``(values, mean, variance)``: one allgather of them (the forward pass's only message),
    then, alike on every rank, the sum of the means weighted by the values, and the
    squares about the global mean as each rank's about its own, moved (Chan et al.), in
    rank order."""
    c = mean_l.shape[0]
    mine = torch.cat([torch.full((1,), float(local), dtype=mean_l.dtype), mean_l.cpu(),
                      var_l.cpu()])
    rows = np.empty((comm.Get_size(), 2 * c + 1), dtype=mine.numpy().dtype)
    comm.Allgather(np.ascontiguousarray(mine.numpy()), rows)
    every = torch.from_numpy(rows).to(mean_l.device)
    n, means, variances = every[:, :1], every[:, 1:c + 1], every[:, c + 1:]
    whole = max(count, 1)
    mean = (n * means).sum(0) / whole
    var = (n * (variances + (means - mean) ** 2)).sum(0) / whole
    return mean, var


class _SplitBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, comm: MPI.Intracomm, count: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the sums in their own dtype: autocast would run the dot products in 16 bits
        with torch.autocast(x.device.type, enabled=False):
            return _SplitBatchNorm._forward(ctx, x, weight, bias, comm, count, eps)

    @staticmethod
    def _forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, comm: MPI.Intracomm, count: int,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = _sums_dtype(x)
        c = x.shape[1]
        local = x.numel() // max(c, 1)
        dims = [0, *range(2, x.ndim)]
        kw = {"dtype": acc, "device": x.device}
        w = torch.ones(c, **kw) if weight is None else weight.to(acc)
        b = torch.zeros(c, **kw) if bias is None else bias.to(acc)
        if local:  # the deviations from this block's mean, and their squares
            xs = x.to(acc)
            mean_l = xs.sum(dims) / local
            d = _affine(xs, torch.ones_like(mean_l), -mean_l)
            var_l = _dots(d, d) / local
        else:
            var_l = mean_l = torch.zeros(c, **kw)
        mean, var = _combine(local, mean_l, var_l, comm, count)
        invstd = torch.rsqrt(var + eps)
        if local:  # y = (x - mean) * scale + bias = d * scale + shift, over d's memory
            scale = w * invstd
            shift = b + (mean_l - mean) * scale
            view = (1, -1) + (1,) * (x.ndim - 2)
            y = d.mul_(scale.view(view)).add_(shift.view(view)).to(x.dtype)
        else:
            y = torch.empty_like(x)
        ctx.save_for_backward(x, w, mean, invstd)
        ctx.comm, ctx.count = comm, count
        ctx.dtypes = (None if weight is None else weight.dtype,
                      None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _dmean: Any, _dvar: Any) -> tuple[Any, ...]:
        x, w, mean, invstd = ctx.saved_tensors
        count, c = max(ctx.count, 1), x.shape[1]
        acc = mean.dtype
        if x.numel():
            # this rank's sum(dy) and sum(dy * xhat) = invstd (sum(dy x) - mean sum(dy))
            g, xs = dy.to(acc), x.to(acc)
            db = g.sum([0, *range(2, x.ndim)])
            dw = invstd * (_dots(g, xs) - mean * db)
        else:
            db = dw = torch.zeros(c, dtype=acc, device=x.device)
        sums = _allreduce(torch.cat([db, dw]), ctx.comm)
        sum_dy, sum_dy_xhat = sums[:c], sums[c:]
        if x.numel():
            # dx = w invstd (dy - (sum(dy) + xhat sum(dy xhat)) / M) = s dy + a x + b
            s = w * invstd
            a = -s * invstd * sum_dy_xhat / count
            b = -s * sum_dy / count - a * mean
            # in the sums' dtype (the terms cancel: a 16-bit sum of them would not hold it)
            dx = _affine(xs, a, b)
            dx = dx.addcmul_(g, s.view((1, -1) + (1,) * (x.ndim - 2))).to(x.dtype)
        else:
            dx = torch.empty_like(x)
        wt, bt = ctx.dtypes
        return (dx, None if wt is None else dw.to(wt), None if bt is None else db.to(bt),
                None, None, None)


def split_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     comm: MPI.Intracomm, count: int, eps: float = 1e-5
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch-normalize this rank's block by the statistics of every rank's blocks.

    Collective over ``comm`` (the ranks that split the batch and spatial
    dimensions), in both passes.

    Parameters
    ----------
    x : torch.Tensor
        This rank's block ``(n, C, *s)`` (possibly empty).
    weight, bias : torch.Tensor or None
        The affine parameters ``(C,)``; their gradients are this rank's
        parts (summed over the ranks by whoever owns the parameters).
    comm : MPI.Intracomm
        The ranks whose blocks make up the statistics.
    count : int
        The number of values per channel over all of them.
    eps : float
        As ``torch.nn.BatchNorm2d``'s.

    Returns
    -------
    y, mean, var : torch.Tensor
        The normalized block (``x``'s dtype) and the biased batch statistics
        (float32, float64 for float64 blocks; not differentiable).

    Raises
    ------
    TypeError, ValueError
        Before any message, alike on every rank (what is checked is the same
        there): ``x`` not a floating tensor of at least 2 dimensions, a
        weight or bias not of shape ``(C,)``, ``comm`` not an intracommunicator,
        ``count`` not a non-negative integer, ``eps`` negative.
    """
    name = "split_batch_norm"
    arguments = {"count": count, "eps": eps, "ndim": getattr(x, "ndim", None),
                 "channels": x.shape[1] if getattr(x, "ndim", 0) >= 2 else None}
    with validating(name, arguments, comm if isinstance(comm, MPI.Intracomm) else None):
        if not isinstance(x, torch.Tensor) or x.ndim < 2 or not x.dtype.is_floating_point:
            raise TypeError(f"{name}: x must be a floating torch.Tensor (N, C, ...), got "
                            f"{type(x).__name__}")
        for what, p in (("weight", weight), ("bias", bias)):
            if p is not None and (not isinstance(p, torch.Tensor)
                                  or tuple(p.shape) != (x.shape[1],)):
                raise ValueError(f"{name}: {what} must be a tensor of shape ({x.shape[1]},), "
                                 f"got {getattr(p, 'shape', type(p).__name__)}")
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"{name}: comm must be an MPI.Intracomm, got {type(comm).__name__}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{name}: count must be a non-negative integer, got {count!r}")
        if not eps >= 0:
            raise ValueError(f"{name}: eps must be >= 0, got {eps!r}")
    return _SplitBatchNorm.apply(x, weight, bias, comm, count, eps)
