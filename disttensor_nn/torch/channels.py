"""Channel parallelism's two moves on blocks, as autograd functions: the partial outputs
of a convolution summed over the ranks that split its input's channels, and a block that
those ranks hold alike sliced along its channels.

A convolution whose input channels are split over ranks (the planner's
``"channel"`` mode) convolves each rank's channels with their slice of the weight;
the partial outputs add up to the output, which every one of those ranks then holds
(:func:`sum_partials`: an allreduce in place, whose backward passes the gradient on,
as :func:`~disttensor_nn.torch.all_reduce`'s does). Its input comes from layers
that ran on whole channels, alike on each of the ranks: each takes its channels
(:func:`take_channels`: a view, no message), and backward gathers the channels'
gradients, so that each rank again holds the whole gradient of the value it held
whole. Both are the compiler's fast paths of the general redistribution and
allreduce (:func:`~disttensor_nn.torch.redistribute`, which for these moves
costs some hundred microseconds of Python a call on small blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch.autograd.function import once_differentiable

__all__ = ["sum_partials", "take_channels"]


def _flat(t: torch.Tensor) -> np.ndarray:
    """The memory of a dense CPU tensor (C order or channels-last) as a flat array."""
    if not t.is_contiguous():
        t = t.permute(sorted(range(t.ndim), key=lambda d: -t.stride(d)))  # C order so
    return t.view(-1).numpy()  # a view (never a copy, which the sum would not reach)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` owns its memory and lies in it densely, in C order or channels-last."""
    if t._is_view():
        return False
    if t.is_contiguous():
        return True
    return t.ndim in (4, 5) and t.is_contiguous(
        memory_format=torch.channels_last if t.ndim == 4 else torch.channels_last_3d)


_SUMMED = (torch.float32, torch.float64)  # summed by MPI as they are; others in float32


class _SumPartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, comm: MPI.Intracomm) -> torch.Tensor:
        comm.Allreduce(MPI.IN_PLACE, _flat(y))
        ctx.mark_dirty(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None  # each partial entered the sum with weight one


def sum_partials(y: torch.Tensor, comm: MPI.Intracomm) -> torch.Tensor:
    """``y`` summed over ``comm``, in place: every rank's partial output becomes the whole.

    Parameters
    ----------
    y : torch.Tensor
        This rank's partial output, a dense CPU tensor that nothing else holds (a
        kernel's new output), of the same shape, dtype and memory layout (C order or
        channels-last) on every rank: the sum adds the ranks' memory element by element.
    comm : MPI.Intracomm
        The ranks whose partial outputs add up.

    Returns
    -------
    torch.Tensor
        ``y`` itself, now the sum; its gradient passes to each partial unchanged.
    """
    if comm.Get_size() == 1:
        return y
    if y.dtype not in _SUMMED:  # 16-bit partials added in float32, then rounded once
        return _SumPartials.apply(y.float(), comm).to(y.dtype)
    if not _dense(y):
        y = y.clone(memory_format=torch.contiguous_format)
    return _SumPartials.apply(y, comm)


class _TakeChannels(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: MPI.Intracomm,
                bounds: tuple[int, ...]) -> torch.Tensor:
        ctx.comm, ctx.bounds = comm, bounds
        index = comm.Get_rank()
        return x[:, bounds[index]:bounds[index + 1]]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        bounds = ctx.bounds
        rest = tuple(grad.shape[:1]) + tuple(grad.shape[2:])
        per = int(np.prod(rest))
        mine = grad.transpose(0, 1).contiguous()  # (c, N, *S): the channels outermost
        whole = torch.empty((bounds[-1], *rest), dtype=grad.dtype)
        counts = [(hi - lo) * per for lo, hi in zip(bounds, bounds[1:])]
        displs = [lo * per for lo in bounds[:-1]]
        ctx.comm.Allgatherv(_bits(mine), [_bits(whole), counts, displs, None])
        # (N, C, *S) again, contiguous: the kernels before take a strided gradient slowly
        return whole.transpose(0, 1).contiguous(), None, None


def _bits(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a NumPy array (bfloat16 as its 16 bits)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def take_channels(x: torch.Tensor, comm: MPI.Intracomm, bounds: Sequence[int]
                  ) -> torch.Tensor:
    """This rank's channels of a block that the ranks of ``comm`` hold alike.

    Parameters
    ----------
    x : torch.Tensor
        The whole block, ``(N, C, *S)`` on the CPU, the same on every rank of ``comm``.
    comm : MPI.Intracomm
        The ranks that split the channels; rank ``r`` takes block ``r``.
    bounds : sequence of int
        The channel blocks' boundaries, one more than ``comm`` has ranks, from 0 to
        ``C`` and non-decreasing (blocks may be empty).

    Returns
    -------
    torch.Tensor
        A view of ``x``'s channels ``bounds[r]:bounds[r + 1]``; in backward the
        blocks' gradients are gathered, so that each rank's gradient of ``x`` is the
        whole one.

    Raises
    ------
    ValueError
        For bounds that do not cut ``x``'s channels into a block per rank (alike on
        every rank, where ``x``'s shape and ``bounds`` are the same on each, as they
        must be).
    """
    bounds = tuple(int(b) for b in bounds)
    if x.ndim < 2 or len(bounds) != comm.Get_size() + 1 or bounds[0] != 0 or \
            bounds[-1] != x.shape[1] or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"take_channels: bounds {list(bounds)} do not cut the "
                         f"{x.shape[1] if x.ndim > 1 else 0} channels of a block of shape "
                         f"{tuple(x.shape)} into one block per rank of {comm.Get_size()}")
    return _TakeChannels.apply(x, comm, bounds)
