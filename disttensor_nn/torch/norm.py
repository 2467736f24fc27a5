"""Batch normalization whose statistics span ranks, on PyTorch's kernels.

:func:`split_batch_norm` normalizes a block of ``(N, C, *S)`` whose batch or
spatial dimensions are split over the ranks of ``comm`` by the statistics of
the global array, as ``torch.nn.BatchNorm`` does on the whole of it. Each
pass over the block is one PyTorch kernel: forward, this block's statistics
(ATen's batch-norm statistics kernel on channels-last and small blocks; on
larger C-order ones its sums, the evaluation-mode batch-norm kernel as a
per-channel shift and the squares' sums, a dot product per sample), then the
output as ``x * scale + shift`` per channel (the evaluation-mode kernel again,
in the block's memory format); backward, the local sums of ``dy`` and
``dy * xhat`` in one ``native_batch_norm_backward`` pass and the input gradient
as ``a x + b`` (the affine kernel) plus ``s dy`` in place, per channel.
The ranks share per-channel statistics, taken in float32 for 16-bit blocks
(float64 for float64 ones): forward, one allgather of each rank's count,
mean and variance about its own mean, combined alike on every rank (Chan et
al.: no sum cancels); backward, one all-reduce of ``2 C`` values.
"""
from __future__ import annotations

import contextlib
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


_UNITS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _unit(c: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros and ones per channel, ``(2, c)``, made once per size, dtype and device
    (read only)."""
    key = (c, dtype, device)
    t = _UNITS.get(key)
    if t is None:
        t = _UNITS[key] = torch.stack((torch.zeros(c, dtype=dtype, device=device),
                                       torch.ones(c, dtype=dtype, device=device)))
    return t


def _no_autocast(x: torch.Tensor) -> Any:
    """Autocast off for ``x``'s device where it is on (entering it costs a few
    microseconds a call otherwise)."""
    kind = x.device.type
    return torch.autocast(kind, enabled=False) if torch.is_autocast_enabled(kind) \
        else contextlib.nullcontext()


def _squares(d: torch.Tensor) -> torch.Tensor:
    """Per channel, the sum of ``d * d`` over the samples and space of an ``(n, C, *s)``
    block: a dot product per sample and channel, no temporary block."""
    d3 = d.reshape(d.shape[0], d.shape[1], -1)
    out = torch.linalg.vecdot(d3[0], d3[0])
    for i in range(1, d.shape[0]):  # per sample: faster than one batched call
        out += torch.linalg.vecdot(d3[i], d3[i])
    return out


# elements per channel up to which ATen's statistics kernel is the faster on a C-order block
# (one thread: 64 against 75 us at 2,048, 118 against 94 at 8,192; on channels-last blocks
# it is faster at every size, 2-3x)
_SMALL_C_ORDER = 4096


def _local_moments(xs: torch.Tensor, out: np.ndarray, local: int) -> None:
    """This block's mean and biased variance per channel into ``out[:C]`` and ``out[C:]``.

    A channels-last block, or a C-order block of at most :data:`_SMALL_C_ORDER` values per
    channel, takes one call of ATen's batch-norm statistics kernel (its mean, then the
    squares about it; no block written); a larger C-order block three passes, on which that
    kernel is the slower (2.3x at 32,768 values per channel): the sums, the deviations from
    the mean (the evaluation-mode kernel as a per-channel shift) and their squares' sums
    (:func:`_squares`).
    """
    c = xs.shape[1]
    layout = torch.channels_last if xs.ndim == 4 else torch.channels_last_3d
    if local <= _SMALL_C_ORDER or (xs.ndim in (4, 5) and not xs.is_contiguous()
                                   and xs.is_contiguous(memory_format=layout)):
        mean_t, var_t = torch.ops.aten.batch_norm_update_stats(xs, None, None, 0.0)
        out[:c] = _host(mean_t)
        out[c:] = _host(var_t)
        return
    unit = _unit(c, xs.dtype, xs.device)  # zeros and ones per channel
    mean_l = out[:c]
    np.divide(_host(xs.sum([0, *range(2, xs.ndim)])), local, out=mean_l)
    d = torch.batch_norm(xs, None, torch.from_numpy(-mean_l).to(xs.device),
                         unit[0], unit[1], False, 0.0, 0.0, False)
    np.divide(_host(_squares(d)), local, out=out[c:])


def _combine(rows: np.ndarray, c: int, count: int, out: np.ndarray) -> None:
    """The mean and biased variance per channel over every rank's block into ``out[0]`` and
    ``out[1]``, from each rank's row ``(values, mean, variance)``: the means weighted by the
    values, and the squares about the global mean as each rank's about its own, moved (Chan
    et al.), in rank order (alike on every rank)."""
    n, means = rows[:, 0], rows[:, 1:c + 1]
    whole = max(count, 1)
    mean, var = out[0], out[1]
    np.matmul(n, means, out=mean)
    mean /= whole
    dev = means - mean
    dev *= dev
    dev += rows[:, c + 1:]
    np.matmul(n, dev, out=var)
    var /= whole


def _track(running: tuple[Any, Any, float], mean: np.ndarray, var: np.ndarray,
           count: int) -> None:
    """Move the running mean and (unbiased) variance towards the batch's by ``momentum``,
    in place, as ``torch.nn.functional.batch_norm`` does (NumPy views of CPU buffers)."""
    running_mean, running_var, momentum = running
    for buf, value, weight in ((running_mean, mean, momentum),
                               (running_var, var, momentum * count / max(count - 1, 1))):
        if buf is None:
            continue
        if buf.device.type == "cpu":
            view = buf.detach().numpy()
            view *= 1 - momentum
            view += value * weight
        else:
            with torch.no_grad():
                buf.mul_(1 - momentum).add_(torch.from_numpy(value * weight).to(buf))


class _SplitBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, comm: MPI.Intracomm, count: int,
                eps: float, running: tuple[Any, Any, float]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the statistics in their own dtype: autocast would take them in 16 bits; an
        # infinite or NaN statistic passes silently, as in PyTorch's own batch norm
        with _no_autocast(x), np.errstate(all="ignore"):
            return _SplitBatchNorm._forward(ctx, x, weight, bias, comm, count, eps, running)

    @staticmethod
    def _forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None, comm: MPI.Intracomm, count: int,
                 eps: float, running: tuple[Any, Any, float]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = _sums_dtype(x)
        c = x.shape[1]
        local = x.numel() // max(c, 1)
        size = comm.Get_size()
        rows = np.empty((size, 2 * c + 1), dtype=numpy_dtype(acc))
        row = rows[comm.Get_rank()]
        row[0] = local
        xs = x if x.dtype == acc else x.to(acc)
        if local:  # this block's mean and variance about it
            _local_moments(xs, row[1:], local)
        else:
            row[1:] = 0
        if size > 1:
            comm.Allgather(MPI.IN_PLACE, rows)
        # mean, var, 1 / std, scale, shift: every per-channel vector in one transfer
        out = np.empty((5, c), dtype=rows.dtype)
        _combine(rows, c, count, out)
        mean, var, invstd, scale, shift = out
        np.add(var, eps, out=invstd)
        np.sqrt(invstd, out=invstd)
        np.divide(1.0, invstd, out=invstd)
        _track(running, mean, var, count)
        if weight is None:
            scale[...] = invstd
        else:
            np.multiply(_host(weight.detach().to(acc)), invstd, out=scale)
        # y = (x - mean) * scale + bias = x * scale + shift, as PyTorch's own kernels
        # apply it: one pass of the evaluation-mode kernel (in the block's memory format)
        np.multiply(mean, scale, out=shift)
        np.negative(shift, out=shift)
        if bias is not None:
            shift += _host(bias.detach().to(acc))
        stats = torch.from_numpy(out).to(x.device)
        if local:
            unit = _unit(c, acc, x.device)
            y = torch.batch_norm(xs, stats[3], stats[4], unit[0], unit[1], False, 0.0, 0.0,
                                 False)
        else:
            y = torch.empty_like(x)
        ctx.save_for_backward(x)
        ctx.stats, ctx.host = stats, (mean, invstd, scale)
        ctx.comm, ctx.count = comm, count
        ctx.dtypes = (None if weight is None else weight.dtype,
                      None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(stats[0], stats[1])
        return y.to(x.dtype), stats[0], stats[1]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _dmean: Any, _dvar: Any) -> tuple[Any, ...]:
        with np.errstate(all="ignore"):
            return _SplitBatchNorm._backward(ctx, dy)

    @staticmethod
    def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        stats, (mean, invstd, s) = ctx.stats, ctx.host
        count, c = max(ctx.count, 1), x.shape[1]
        acc = stats.dtype
        wt, bt = ctx.dtypes
        if x.numel():
            # this rank's sum(dy) and sum(dy * xhat), by the global mean and 1 / std: one pass
            g = dy if dy.dtype == acc else dy.to(acc)
            xs = x if x.dtype == acc else x.to(acc)
            _, dw, db = torch.ops.aten.native_batch_norm_backward(
                g, xs, None, None, None, stats[0], stats[2], True, 0.0, [False, True, True])
            sums = np.concatenate((_host(db), _host(dw)))  # its own memory
        else:
            sums = np.zeros(2 * c, dtype=numpy_dtype(acc))
            dw, db = (torch.zeros(c, dtype=acc, device=x.device) for _ in range(2))
        if ctx.comm.Get_size() > 1:
            ctx.comm.Allreduce(MPI.IN_PLACE, sums)
        if x.numel():
            # dx = w invstd (dy - (sum(dy) + xhat sum(dy xhat)) / M) = s dy + a x + b, in the
            # sums' dtype (the terms cancel: a 16-bit sum of them would not hold it)
            coef = np.empty((3, c), dtype=sums.dtype)
            coef[0] = s
            a, b = coef[1], coef[2]
            np.multiply(s, invstd, out=a)
            a *= sums[c:]
            a *= -1.0 / count
            np.multiply(s, sums[:c], out=b)
            b *= -1.0 / count
            b -= a * mean
            coef_t = torch.from_numpy(coef).to(x.device)
            unit = _unit(c, acc, x.device)
            dx = torch.batch_norm(xs, coef_t[1], coef_t[2], unit[0], unit[1], False, 0.0,
                                  0.0, False)  # a x + b: the evaluation-mode kernel, one pass
            dx = dx.addcmul_(g, coef_t[0].view((1, c) + (1,) * (x.ndim - 2))).to(x.dtype)
        else:
            dx = torch.empty_like(x)
        return (dx, None if wt is None else dw.to(wt), None if bt is None else db.to(bt),
                None, None, None, None)


def split_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     comm: MPI.Intracomm, count: int, eps: float = 1e-5, *,
                     running_mean: torch.Tensor | None = None,
                     running_var: torch.Tensor | None = None, momentum: float = 0.1
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
    running_mean, running_var : torch.Tensor, optional
        Buffers ``(C,)`` moved in place towards the batch's mean and
        unbiased variance by ``momentum``, as in
        ``torch.nn.functional.batch_norm`` in training mode (alike on every
        rank: the statistics are the global ones).
    momentum : float
        The weight of the batch's statistics in the running ones, in [0, 1].

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
        weight, bias or running buffer not of shape ``(C,)``, ``comm`` not an
        intracommunicator, ``count`` not a non-negative integer, ``eps``
        negative, ``momentum`` outside [0, 1].
    """
    name = "split_batch_norm"
    arguments = {"count": count, "eps": eps, "momentum": momentum,
                 "ndim": getattr(x, "ndim", None),
                 "channels": x.shape[1] if getattr(x, "ndim", 0) >= 2 else None}
    with validating(name, arguments, comm if isinstance(comm, MPI.Intracomm) else None):
        if not isinstance(x, torch.Tensor) or x.ndim < 2 or not x.dtype.is_floating_point:
            raise TypeError(f"{name}: x must be a floating torch.Tensor (N, C, ...), got "
                            f"{type(x).__name__}")
        for what, p in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                        ("running_var", running_var)):
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
        if not 0 <= momentum <= 1:
            raise ValueError(f"{name}: momentum must be in [0, 1], got {momentum!r}")
    return _SplitBatchNorm.apply(x, weight, bias, comm, count, eps,
                                 (running_mean, running_var, float(momentum)))
