"""Batch normalization whose statistics span ranks, on PyTorch's own kernels.

:func:`split_batch_norm` normalizes a block of ``(N, C, *S)`` whose batch or
spatial dimensions are split over the ranks of ``comm`` by the statistics of
the global array, as ``torch.nn.BatchNorm`` does on the whole of it. The
per-element work is PyTorch's fused batch-norm kernels (the evaluation-mode
forward, which applies given statistics, and its backward, which also gives
the parameters' sums); what the ranks share are per-channel sums, summed in
float32 for 16-bit blocks (float64 blocks in float64): two all-reduces of
``C`` values forward (the mean, then the squares about it, so no sum
cancels), one of ``2 C`` values backward.
"""

from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI

from disttensor.backend import contiguous
from disttensor.transport import allreduce

__all__ = ["split_batch_norm"]


def _sums_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _allreduce(t: torch.Tensor, comm: MPI.Intracomm) -> torch.Tensor:
    return allreduce(contiguous(t, copy=True), comm)


class _SplitBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, comm: MPI.Intracomm, count: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dims = [0, *range(2, x.ndim)]
        acc = _sums_dtype(x)
        local = x.shape[0] * (x[0, 0].numel() if x.shape[0] and x.shape[1] else 0)
        c = x.shape[1]
        if local:
            var_l, mean_l = torch.var_mean(x.to(acc), dims, correction=0)
        else:
            var_l = mean_l = torch.zeros(c, dtype=acc)
        mean = _allreduce(mean_l * local, comm) / max(count, 1)
        # the squares about the global mean: each rank's about its own, moved (Chan et al.)
        m2 = _allreduce(local * (var_l + (mean_l - mean) ** 2), comm)
        var = m2 / max(count, 1)
        invstd = torch.rsqrt(var + eps)
        w = torch.ones(c, dtype=acc) if weight is None else weight
        b = torch.zeros(c, dtype=acc) if bias is None else bias
        if local:  # PyTorch's kernel with the global statistics
            y = torch.batch_norm(x, w, b, mean.to(w.dtype), var.to(w.dtype), False, 0.0, eps,
                                 False)
        else:
            y = torch.empty_like(x)
        ctx.save_for_backward(x, w, mean, var, invstd)
        ctx.comm, ctx.count, ctx.eps = comm, count, eps
        ctx.affine = (weight is not None, bias is not None)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _dmean: Any, _dvar: Any) -> tuple[Any, ...]:
        x, w, mean, var, invstd = ctx.saved_tensors
        count = max(ctx.count, 1)
        if x.numel():
            # evaluation mode: dy * w * invstd, and this rank's sum(dy * xhat) and sum(dy)
            dx, dw, db = torch.ops.aten.native_batch_norm_backward(
                contiguous(dy), x, w, mean.to(w.dtype), var.to(w.dtype), None, None, False,
                ctx.eps, [True, True, True])
        else:
            dx = torch.empty_like(x)
            dw = db = torch.zeros_like(w)
        acc = mean.dtype
        sums = _allreduce(torch.cat([db.to(acc), dw.to(acc)]), ctx.comm)
        sum_dy, sum_dy_xhat = sums[:x.shape[1]], sums[x.shape[1]:]
        if x.numel():
            # the statistics' part: - w invstd / M (sum(dy) + xhat sum(dy xhat)), an affine map
            # of x per channel, applied by the same kernel
            scale = w.to(acc) * invstd / count
            a = -scale * invstd * sum_dy_xhat
            c = -scale * sum_dy - a * mean
            one = torch.ones_like(a)
            dx = dx + torch.batch_norm(x, a.to(w.dtype), c.to(w.dtype),
                                       torch.zeros_like(one).to(w.dtype),
                                       (one - ctx.eps).to(w.dtype), False, 0.0, ctx.eps, False)
        dw_out = dw if ctx.affine[0] else None
        db_out = db if ctx.affine[1] else None
        return dx, dw_out, db_out, None, None, None


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
    """
    return _SplitBatchNorm.apply(x, weight, bias, comm, count, eps)
