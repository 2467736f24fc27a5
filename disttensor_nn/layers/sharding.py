"""Channel and filter splits of layers whose weight maps input channels to output channels.

A convolution or a fully connected layer computes ``y[:, f] = sum_c w[f, c] x[:, c]``.
Its input may arrive split along the channel dimension (dimension 1) over
grid axes ``a_c``, and its output channels may be split over grid axes
``a_f`` (``filter_axes``). The functions here hold the one rule both layers
follow (see ``docs/channel_filter.md``):

* ``a_f`` equal to ``a_c`` (or both empty): the input is gathered along C and
  the weight is split by rows, ``w[F_slice]`` (filter-parallel); the input
  gradient's partial sums go back by a reduce-scatter;
* otherwise the weight is ``w[F_slice(a_f), C_slice(a_c)]``: partial outputs
  are summed over ``a_c`` (channel-parallel) and partial input gradients over
  ``a_f``.
"""

from __future__ import annotations

import math
from typing import Any

from disttensor import DistArray, Distribution, redistribution_plan

from ..module import Parameter, allreduce_

__all__ = ["normalize_axes", "weight_splits", "shard_parameters", "gather_channels",
           "sum_partial_outputs", "sum_input_grad", "channel_split_axes"]


def normalize_axes(axes: Any, name: str) -> tuple[int, ...]:
    """None, an int or a sequence of distinct ints, as a tuple (TypeError otherwise)."""
    axes = () if axes is None else (axes,) if isinstance(axes, int) else tuple(axes)
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in axes) or \
            len(set(axes)) != len(axes):
        raise TypeError(f"{name} must be an int or a tuple of distinct ints, got {axes!r}")
    return axes


def weight_splits(name: str, dist: Distribution, filter_axes: tuple[int, ...],
                  groups: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Grid axes that split the weight's (rows, columns) for an input split as ``dist``.

    Pure: the same verdict on every rank, before any message.

    Raises
    ------
    ValueError
        For filter axes outside the grid or splitting another dimension of
        the input, filter and channel axes that overlap in part, or a split
        channel or filter dimension with ``groups > 1``.
    """
    ndim = len(dist.grid_shape)
    if any(not -ndim <= a < ndim for a in filter_axes):
        raise ValueError(f"{name}: filter_axes {filter_axes} outside the {ndim}-axis grid")
    a_f = tuple(a % ndim for a in filter_axes)
    a_c = dist.dim_axes[1]
    other = {a for d in range(dist.ndim) if d != 1 for a in dist.dim_axes[d]}
    if set(a_f) & other:
        raise ValueError(f"{name}: filter_axes {a_f} also split the input's sample or "
                         f"spatial dimensions ({dist})")
    if a_c and a_f and set(a_c) != set(a_f) and set(a_c) & set(a_f):
        raise ValueError(f"{name}: the channel axes {a_c} and filter axes {a_f} overlap in "
                         "part; use the same axes or disjoint ones")
    if groups > 1 and (a_c or a_f):
        raise ValueError(f"{name}: groups={groups} with a split channel or filter "
                         "dimension is not supported")
    return (a_f, ()) if set(a_f) == set(a_c) else (a_f, a_c)


def shard_parameters(weight: Parameter, bias: Parameter | None, x: DistArray,
                     a_f: tuple[int, ...], a_c: tuple[int, ...]) -> None:
    """Split ``weight`` (rows over ``a_f``, columns as ``x``'s channels over ``a_c``) and
    ``bias`` (over ``a_f``); a split over grid axes of one rank is none."""
    grid = x.dist.grid_shape
    if math.prod(grid[a] for a in (*a_f, *a_c)) == 1:  # every axis of one rank: replicated
        weight.shard_(None)
        if bias is not None:
            bias.shard_(None)
        return
    rest = (None,) * (len(weight.shape) - 2)
    splits = (None, x.dist.splits[1] if a_c else None) + rest
    wd = Distribution(weight.shape, x.dist.grid, (a_f or None, a_c or None) + rest, splits)
    weight.shard_(wd if math.prod(wd.nblocks) > 1 else None)
    if bias is not None:
        bd = Distribution(bias.shape, x.dist.grid, (a_f or None,))
        bias.shard_(bd if bd.nblocks[0] > 1 else None)


def channel_split_axes(dist: Distribution, axes: Any) -> Distribution:
    """``dist`` with its channels split over ``axes`` (None: whole), by the block rule."""
    ax, splits = list(dist.axes), list(dist.splits)
    ax[1], splits[1] = axes or None, None
    return dist.replace(axes=ax, splits=splits)


def gather_channels(x: DistArray, a_c: tuple[int, ...]) -> DistArray:
    """``x`` itself, or gathered along C when it is split there but the weight's columns
    are not (filter-parallel on a channel-split input: an allgather)."""
    if x.dist.dim_axes[1] and not a_c:
        return x.redistribute(channel_split_axes(x.dist, None))
    return x


def sum_partial_outputs(y: DistArray, a_c: tuple[int, ...], bias: Parameter | None) -> None:
    """Channel-parallel: sum ``y``'s partial outputs over ``a_c`` in place, then add the bias."""
    if not a_c:
        return
    r = allreduce_(y.local, y.grid.subcomm(a_c))
    if r is not y.local:
        y.local[...] = r
    if bias is not None:
        y.local[...] += bias.data.reshape((-1,) + (1,) * (y.ndim - 2))


def sum_input_grad(dx: DistArray, x: DistArray, a_f: tuple[int, ...]) -> DistArray:
    """The input gradient from the kernels' partial sums over the filter group ``a_f``.

    ``dx`` is distributed as the kernels' input: ``x``'s distribution (an
    allreduce over ``a_f``) or ``x`` gathered along C (the adjoint of the
    gather: a reduce-scatter by redistribution; with replicas of ``x`` an
    allreduce and each rank's slice, so that every replica gets the sum).
    """
    if not a_f:
        return dx
    if dx.dist != x.dist and math.prod(x.dist.grid_shape[a] for a in x.dist.replica_axes) == 1:
        return redistribution_plan(x.dist, dx.dist).adjoint(dx)
    r = allreduce_(dx.local, dx.grid.subcomm(a_f))
    if dx.dist == x.dist:
        if r is not dx.local:
            dx.local[...] = r
        return dx
    chans = x.dist.local_slices()[1]
    return DistArray.from_local(r[:, chans], x.dist)
