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

from disttensor.backend import numpy_dtype
from disttensor.settings import validating

__all__ = ["split_batch_norm"]


def _sums_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _host(t: torch.Tensor) -> np.ndarray:
    """A small per-channel tensor as a NumPy array (a view for CPU tensors)."""
    return t.detach().cpu().numpy()


def _affine(x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor) -> torch.Tensor:
    """``x * scale + shift`` per channel, in one pass: the evaluation-mode batch-norm kernel
    with a mean of 0, a variance of 1 and no epsilon (``scale`` None: 1)."""
    c = x.shape[1]
    zero = torch.zeros(c, dtype=shift.dtype, device=shift.device)
    one = torch.ones(c, dtype=shift.dtype, device=shift.device)
    return torch.batch_norm(x, scale, shift, zero, one, False, 0.0, 0.0, False)


def _squares(d: torch.Tensor) -> torch.Tensor:
    """Per channel, the sum of ``d * d`` over the samples and space of an ``(n, C, *s)``
    block: a dot product per sample, no temporary block."""
    d3 = d.reshape(d.shape[0], d.shape[1], -1)
    out = torch.linalg.vecdot(d3[0], d3[0])
    for i in range(1, d.shape[0]):
        out += torch.linalg.vecdot(d3[i], d3[i])
    return out


def _combine(rows: np.ndarray, c: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The mean and biased variance per channel over every rank's block, from each rank's
    row ``(values, mean, variance)``: the sum of the means weighted by the values, and the
    squares about the global mean as each rank's about its own, moved (Chan et al.), in
    rank order (alike on every rank)."""
    n, means, variances = rows[:, :1], rows[:, 1:c + 1], rows[:, c + 1:]
    whole = max(count, 1)
    mean = (n * means).sum(0) / whole
    var = (n * (variances + (means - mean) ** 2)).sum(0) / whole
    return mean, var


class _SplitBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, comm: MPI.Intracomm, count: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the sums in their own dtype: autocast would run the dot products in 16 bits; an
        # infinite or NaN statistic passes silently, as in PyTorch's own batch norm
        with torch.autocast(x.device.type, enabled=False), np.errstate(all="ignore"):
            return _SplitBatchNorm._forward(ctx, x, weight, bias, comm, count, eps)

    @staticmethod
    def _forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, comm: MPI.Intracomm, count: int,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = _sums_dtype(x)
        c = x.shape[1]
        local = x.numel() // max(c, 1)
        kw = {"dtype": acc, "device": x.device}
        row = np.zeros(2 * c + 1, dtype=numpy_dtype(acc))
        row[0] = local
        xs = x.to(acc)
        if local:  # the deviations from this block's mean, and their squares
            mean_l = _host(xs.sum([0, *range(2, x.ndim)])) / local
            row[1:c + 1] = mean_l
            d = _affine(xs, None, torch.from_numpy(-mean_l).to(x.device))
            row[c + 1:] = _host(_squares(d)) / local
        rows = np.empty((comm.Get_size(), row.size), dtype=row.dtype)
        comm.Allgather(row, rows)
        mean, var = _combine(rows, c, count)
        invstd = 1.0 / np.sqrt(var + eps)
        w = np.ones(c, row.dtype) if weight is None else _host(weight).astype(row.dtype)
        b = np.zeros(c, row.dtype) if bias is None else _host(bias).astype(row.dtype)
        scale = w * invstd
        if local:  # y = (x - mean) * scale + bias = d * scale + shift, in d's memory
            shift = b + (row[1:c + 1] - mean) * scale
            view = (1, -1) + (1,) * (x.ndim - 2)
            y = d.mul_(torch.from_numpy(scale).to(x.device).view(view)).add_(
                torch.from_numpy(shift).to(x.device).view(view)).to(x.dtype)
        else:
            y = torch.empty_like(x)
        mean_t, var_t = torch.from_numpy(mean).to(**kw), torch.from_numpy(var).to(**kw)
        ctx.save_for_backward(x)
        ctx.stats = (w, mean, invstd)
        ctx.comm, ctx.count = comm, count
        ctx.dtypes = (None if weight is None else weight.dtype,
                      None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(mean_t, var_t)
        return y, mean_t, var_t

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _dmean: Any, _dvar: Any) -> tuple[Any, ...]:
        with np.errstate(all="ignore"):
            return _SplitBatchNorm._backward(ctx, dy)

    @staticmethod
    def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        w, mean, invstd = ctx.stats
        count, c = max(ctx.count, 1), x.shape[1]
        acc = _sums_dtype(x)
        sums = np.zeros(2 * c, dtype=mean.dtype)

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(x.device)

        if x.numel():
            # this rank's sum(dy) and sum(dy * xhat), by the global mean and invstd: one pass
            g, xs = dy.to(acc), x.to(acc)
            _, dw_l, db_l = torch.ops.aten.native_batch_norm_backward(
                g, xs, t(w), None, None, t(mean), t(invstd), True, 0.0, [False, True, True])
            sums[:c], sums[c:] = _host(db_l), _host(dw_l)
        db, dw = sums[:c].copy(), sums[c:].copy()  # this rank's parts, for the parameters
        if ctx.comm.Get_size() > 1:
            ctx.comm.Allreduce(MPI.IN_PLACE, sums)
        sum_dy, sum_dy_xhat = sums[:c], sums[c:]
        if x.numel():
            # dx = w invstd (dy - (sum(dy) + xhat sum(dy xhat)) / M) = s dy + a x + b
            s = w * invstd
            a = -s * invstd * sum_dy_xhat / count
            b = -s * sum_dy / count - a * mean
            # in the sums' dtype (the terms cancel: a 16-bit sum of them would not hold it)
            dx = _affine(xs, t(a), t(b))
            dx = dx.addcmul_(g, t(s).view((1, -1) + (1,) * (x.ndim - 2))).to(x.dtype)
        else:
            dx = torch.empty_like(x)
        wt, bt = ctx.dtypes
        return (dx, None if wt is None else torch.from_numpy(dw).to(x.device, wt),
                None if bt is None else torch.from_numpy(db).to(x.device, bt),
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
