"""Gradient clipping by the norm of the whole distributed model's gradient."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import ProcessGrid
from disttensor.backend import array_namespace, to_numpy

from ..parameter import Parameter
from .optimizer import check_number

__all__ = ["clip_grad_norm_"]


def _local_power_sum(g: Any, norm_type: float) -> float:
    """``sum(|g| ** norm_type)`` (``max |g|`` for inf) of this rank's array, as a float."""
    if g.size == 0:
        return 0.0
    xp = array_namespace(g)
    if norm_type == math.inf:
        return float(to_numpy(xp.max(xp.abs(g))))
    if norm_type == 2.0:
        return float(to_numpy(xp.sum(g * g)))
    return float(to_numpy(xp.sum(xp.abs(g) ** norm_type)))


def _holds_first_replica(p: Parameter) -> bool:
    """Whether this rank is the lowest of the ranks that hold its block of ``p``."""
    dist = p.dist
    return dist.ranks_of_block(dist.block_index())[0] == dist.grid.rank


def clip_grad_norm_(parameters: Parameter | Iterable[Parameter], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> float:
    """Scale the gradients in place so that their total norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``, with the norm that of the whole
    distributed model's gradient: a sharded parameter (``Parameter.dist``)
    counts each block of its gradient once, whatever ranks hold it and how
    many replicas of it there are, and a replicated parameter counts once; a
    gradient that :func:`~disttensor_nn.optim.shard_state` reduced into
    pieces counts each piece once.
    The gradients are scaled by ``max_norm / (total + 1e-6)`` when that is
    below 1. Collective over the grids of the sharded parameters (one
    allreduce per grid); every rank computes the same norm and applies the
    same factor, so replicated gradients stay identical.

    Parameters
    ----------
    parameters : Parameter or iterable of Parameter
        Their gradients (``grad``), reduced over the ranks (after a backward
        pass outside :func:`~disttensor_nn.no_sync`).
    max_norm : float
        The largest total norm, >= 0.
    norm_type : float
        The p of the p-norm, > 0, or ``math.inf`` for the largest magnitude.
    error_if_nonfinite : bool
        Raise when the total norm is NaN or infinite (on every rank, nothing
        scaled) instead of scaling by it.

    Returns
    -------
    float
        The total norm of the gradients before clipping (the same on every rank).

    Raises
    ------
    ValueError
        For a negative ``max_norm`` or a ``norm_type`` that is not positive
        (before any communication).
    RuntimeError
        When gradient parts kept back by :func:`~disttensor_nn.no_sync` are
        not reduced yet, or (``error_if_nonfinite``) for a non-finite norm.
    """
    params = [parameters] if isinstance(parameters, Parameter) else list(parameters)
    for p in params:
        if not isinstance(p, Parameter):
            raise TypeError(f"clip_grad_norm_: parameters must be Parameters, got a "
                            f"{type(p).__name__}")
    max_norm = check_number("clip_grad_norm_: max_norm", max_norm)
    norm_type = check_number("clip_grad_norm_: norm_type", norm_type, strict=True)
    if any(p.unreduced is not None for p in params):
        raise RuntimeError("clip_grad_norm_: gradients accumulated under no_sync are not "
                           "reduced yet; run the last micro-batch's backward outside no_sync")
    if not params:
        return 0.0
    inf = norm_type == math.inf
    parts = [_local_power_sum(p.grad, norm_type) for p in params]
    # a gradient reduced into pieces (shard_state's "gradients"): each piece's part summed
    # over the ranks holding the pieces, giving the part of the whole local block
    by_comm: dict[int, tuple[Any, list[int]]] = {}
    for i, p in enumerate(params):
        if p.grad_range is not None:
            by_comm.setdefault(id(p.grad_comm), (p.grad_comm, []))[1].append(i)
    for comm, idx in by_comm.values():
        values = np.array([parts[i] for i in idx], dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX if inf else MPI.SUM)
        for i, v in zip(idx, values.tolist()):
            parts[i] = v
    # each sharded parameter's part summed over its grid, once per block
    by_grid: dict[ProcessGrid, list[int]] = {}
    for i, p in enumerate(params):
        if p.dist is not None:
            by_grid.setdefault(p.dist.grid, []).append(i)
            if not inf and not _holds_first_replica(p):
                parts[i] = 0.0
    for g, idx in by_grid.items():
        values = np.array([parts[i] for i in idx], dtype=np.float64)
        g.comm.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX if inf else MPI.SUM)
        for i, v in zip(idx, values.tolist()):
            parts[i] = v
    if inf:
        total = max(parts)
    else:
        total = math.fsum(parts) ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the "
                           f"gradients is {total}; set error_if_nonfinite=False to scale by it")
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad *= coef
    return total
