"""Lining operands up: broadcasting, the result's distribution, the mixed-distribution rule.

An element-wise operation on operands of several kinds (DistArrays, NumPy
arrays, scalars) is computed block by block. Every rank needs, of every
operand, exactly the part that broadcasts against its block of the result.

The rule (documented in docs/array_programming.md):

* With ``out=``, the result has ``out``'s distribution.
* Otherwise it takes the distribution of the **first DistArray operand whose
  shape is the result's shape** after broadcasting; when none has it, that of
  the first DistArray operand with the most elements, extended to the result's
  shape (new leading dimensions are not split; a dimension that grows from
  size 1 keeps its grid axes and gets the default block rule).
* Every other DistArray operand is redistributed to the distribution that
  gives each rank the part it needs (:func:`operand_distribution`). When a
  rank's part already lies inside what it holds (a replicated operand, for
  instance) the part is a local view and nothing is sent.
* A NumPy array operand must be the same on every rank; each rank takes the
  slice that matches its block. Scalars are used as they are.

With :func:`disttensor.ops.set_implicit_redistribution` ``(False)``, an
operand that would have to move between ranks raises a ValueError instead.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..array import DistArray
from ..distribution import Distribution
from ..redistribute import redistribution_plan
from ._config import implicit_redistribution_enabled
from ._util import is_dist, make_dist, same_comm

__all__ = [
    "as_operand",
    "broadcast_shape",
    "extend_distribution",
    "operand_distribution",
    "result_distribution",
    "align_locals",
    "aligned",
    "check_move",
]


def as_operand(v: Any) -> Any:
    """DistArrays, arrays and scalars as they are; lists and the like as NumPy arrays."""
    if is_dist(v) or isinstance(v, (np.ndarray, np.generic, numbers.Number)):
        return v
    if hasattr(v, "__array_namespace__") or hasattr(v, "__cuda_array_interface__"):
        return v
    return np.asarray(v)


def is_array(v: Any) -> bool:
    """Whether ``v`` is a (non-distributed) array operand, not a scalar."""
    return not is_dist(v) and hasattr(v, "shape") and not isinstance(v, np.generic)


def shape_of(v: Any) -> tuple[int, ...]:
    """Global shape of an operand (``()`` for scalars)."""
    return tuple(v.shape) if hasattr(v, "shape") else ()


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """The broadcast shape; a ValueError (the same on every rank) when there is none."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(
            "operands could not be broadcast together with shapes "
            + " ".join(str(tuple(s)) for s in shapes)
        ) from None


def extend_distribution(dist: Distribution, shape: Sequence[int]) -> Distribution:
    """``dist`` extended to the broadcast ``shape``.

    New leading dimensions are not split; a dimension that grows from size 1
    keeps its grid axes with the default block rule; the others keep their
    axes and boundaries.
    """
    shape = tuple(shape)
    if dist.global_shape == shape:
        return dist
    off = len(shape) - dist.ndim
    axes: list[tuple[int, ...]] = [()] * off
    bounds: list[Any] = [None] * off
    for d in range(dist.ndim):
        axes.append(dist.dim_axes[d])
        bounds.append(dist.boundaries[d] if dist.global_shape[d] == shape[off + d] else None)
    return make_dist(shape, dist.grid, axes, bounds)


def operand_distribution(target: Distribution, shape: Sequence[int]) -> Distribution:
    """How an operand of ``shape`` must be laid out to broadcast against ``target``.

    Each rank then holds exactly the part of the operand that broadcasts
    against its block of ``target``: dimensions of the target's size are split
    like the target's, size-1 dimensions are whole, and the grid axes of the
    target's extra leading dimensions hold replicas.
    """
    shape = tuple(shape)
    off = target.ndim - len(shape)
    axes, bounds = [], []
    for e, n in enumerate(shape):
        d = off + e
        if n == target.global_shape[d]:
            axes.append(target.dim_axes[d])
            bounds.append(target.boundaries[d])
        else:
            axes.append(())
            bounds.append(None)
    return make_dist(shape, target.grid, axes, bounds)


def result_distribution(operands: Sequence[Any], shape: Sequence[int],
                        out: DistArray | None = None) -> Distribution:
    """The result's distribution by the mixed-distribution rule (see the module docstring)."""
    if out is not None:
        return out.dist
    shape = tuple(shape)
    dists = [o for o in operands if is_dist(o)]
    if not dists:
        raise TypeError("no DistArray operand")  # the callers make sure there is one
    for o in dists:
        if o.shape == shape:
            return o.dist
    leader = dists[0]
    for o in dists[1:]:
        if o.size > leader.size:
            leader = o
    return extend_distribution(leader.dist, shape)


def _inner_box(src: Distribution, dst: Distribution) -> tuple[slice, ...]:
    """Slices of this rank's ``src`` block that select its ``dst`` block (which lies inside)."""
    out = []
    for s, d in zip(src.local_slices(), dst.local_slices()):
        if d.start >= d.stop:
            out.append(slice(0, 0))
        else:
            out.append(slice(d.start - s.start, d.stop - s.start))
    return tuple(out)


def check_move(x: DistArray, need: Distribution, what: str) -> bool:
    """Whether ``x`` must be redistributed to ``need``; raises if that is forbidden.

    Returns False when every rank already holds its ``need`` block (a local
    view does). Pure: the same answer and the same error on every rank.
    """
    if not same_comm(x.dist, need):
        raise ValueError(
            f"{what} lives on {x.grid}, which is not over the communicator of {need.grid}"
        )
    if x.dist == need or redistribution_plan(x.dist, need).local_only:
        return False
    if not implicit_redistribution_enabled():
        raise ValueError(
            f"{what} has {x.dist} but the operation needs it as {need}; implicit "
            "redistribution is disabled (disttensor.ops.set_implicit_redistribution), "
            "so redistribute it explicitly with x.redistribute(...)"
        )
    return True


def aligned(x: DistArray, need: Distribution, move: bool) -> Any:
    """This rank's ``need`` block of ``x``: a view, or (``move``) after a redistribution."""
    if x.dist == need:
        return x.local
    if move:
        return x.redistribute(need).local
    return x.local[_inner_box(x.dist, need)]


def numpy_part(a: Any, target: Distribution, xp: Any) -> Any:
    """The part of a global (non-distributed) array that broadcasts against this block."""
    a = xp.asarray(a)
    off = target.ndim - a.ndim
    sl = target.local_slices()
    key = tuple(
        sl[off + e] if n == target.global_shape[off + e] else slice(None)
        for e, n in enumerate(a.shape)
    )
    return a[key]


def align_locals(operands: Sequence[Any], target: Distribution, xp: Any,
                 what: str = "operand") -> list[Any]:
    """Local parts of ``operands`` that broadcast against this rank's block of ``target``.

    Collective when a DistArray operand has to move. All checks (communicator,
    implicit-redistribution setting) run on every rank before any message.
    """
    needs: list[Any] = []
    for i, o in enumerate(operands):
        if is_dist(o):
            need = operand_distribution(target, o.shape)
            needs.append((need, check_move(o, need, f"{what} {i}")))
        else:
            needs.append(None)
    out = []
    for o, nd in zip(operands, needs):
        if nd is not None:
            out.append(aligned(o, nd[0], nd[1]))
        elif is_array(o):
            out.append(numpy_part(o, target, xp))
        else:
            out.append(o)
    return out
