"""Sharded parameter state (ZeRO's stages, FSDP): each rank of the ranks that replicate a
parameter keeps and updates 1/R of its optimizer state, and optionally of its gradient and
of its weights."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from ..parameter import Parameter
from .optimizer import STAGES, Optimizer

__all__ = ["STAGES", "BUILT_STAGES", "check_stage", "shard_state"]

BUILT_STAGES = ("none", "optimizer", "gradients", "full")
"""The stages :func:`shard_state` runs (all of :data:`STAGES`)."""


def check_stage(stage: Any) -> str:
    """``stage`` when it is a stage :func:`shard_state` runs, else the one ValueError.

    Local and identical on every rank: call it before any communication.
    """
    if not isinstance(stage, str) or stage not in STAGES:
        raise ValueError(f"shard_state: unknown stage {stage!r}; the stages are "
                         f"{', '.join(STAGES)}")
    return stage


def shard_state(optimizer: Optimizer, stage: str = "optimizer",
                comm: MPI.Intracomm | None = None) -> Optimizer:
    """Shard ``optimizer``'s state over the ranks that replicate each parameter, in place.

    Over the R ranks whose gradients of a parameter are summed together
    (the communicator its layer's backward pass reduced it over, recorded
    as ``Parameter.grad_comm``: the ranks splitting the samples and space,
    which hold the same weights or the same block of sharded weights), each
    rank keeps the optimizer's state (SGD's momentum, Adam's moments) for
    :func:`~disttensor_nn.shards.shard_range` of the parameter's flattened
    (local) elements, about 1/R of them (uneven when R does not divide the
    size, empty when the parameter has fewer than R elements), updates only
    those, and the updated pieces are all-gathered (one ``Allgatherv`` per
    parameter), so the weights stay whole and identical. The optimizer's
    own update runs unchanged on the pieces: this works for every
    element-wise optimizer (:class:`~disttensor_nn.optim.SGD`,
    :class:`~disttensor_nn.optim.Adam`, :class:`~disttensor_nn.optim.AdamW`)
    and gives their unsharded results.

    ``"gradients"`` also sets each parameter's ``reduce_scatter``: the
    backward pass sums its gradient by a ``Reduce_scatter`` into this
    rank's piece instead of an allreduce, so ``grad`` holds the reduced
    piece alone (:func:`~disttensor_nn.optim.clip_grad_norm_` still gives
    the whole model's norm). Gradients that a layer sums itself (a batch
    norm's with the whole batch's statistics) stay whole and are sliced.

    ``"full"`` (ZeRO-3, FSDP) also shards the weights: from its layer's
    first backward pass on (which tells each parameter the ranks that
    replicate it; ``Parameter.settle_weights_``), each rank keeps only its piece
    of each such parameter (``Parameter.piece``; ``Parameter.sharded_weights``),
    which the optimizer updates in place, with nothing all-gathered after
    the step. Every layer gathers its own parameters' weights (one
    ``Allgatherv`` each) just before its forward pass and again before its
    backward pass, and drops the whole arrays after each: between passes,
    ``Parameter.data`` raises, and :meth:`~disttensor_nn.Parameter.full`
    and ``state_dict()`` gather the weights whole (collective), while
    ``load_state_dict`` keeps this rank's piece of what it is given. A
    layer's weights are thus whole only during its own passes.

    ``"none"`` undoes all of it (the state, and the weights, are gathered
    back at the next step).

    :meth:`Optimizer.state_dict` stays whole (keys and shapes of the
    unsharded state: collective), and a whole state loads into a sharded
    optimizer at any rank count (each rank keeps its piece at the next
    step). The memory model counts the same
    (:meth:`disttensor_nn.plan.CostModel.params_memory`).

    Parameters
    ----------
    optimizer : Optimizer
    stage : {"none", "optimizer", "gradients", "full"}
        What each rank keeps 1/R of: the optimizer state; also the reduced
        gradients; also the weights between the layers' passes.
    comm : mpi4py.MPI.Intracomm, optional
        The ranks that replicate the parameters whose gradients no backward
        pass of a layer has reduced (``grad_comm`` None; by default those
        are not sharded).

    Returns
    -------
    Optimizer
        ``optimizer`` itself.

    Raises
    ------
    ValueError
        For an unknown stage: the same on every rank,
        before any communication, nothing changed.
    """
    stage = check_stage(stage)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"shard_state: {type(optimizer).__name__} is not an Optimizer")
    if comm is not None and not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"shard_state: comm must be an mpi4py Intracomm, got "
                        f"{type(comm).__name__}")
    optimizer.shard_stage = stage
    optimizer.shard_comm = comm
    p: Parameter
    for p in optimizer.params:
        p.reduce_scatter = stage in ("gradients", "full")
        p.shard_weights = stage == "full"
    return optimizer
