"""What a layer tells the planner's cost model about its work on one rank.

A layer describes, for an input split as a given
:class:`~disttensor.Distribution`, the work of the largest local block: its
local kernels (the block they run on, FLOPs, bytes moved), the bytes it keeps
for backward and its workspace, its halo widths, its allreduces and its
redistributions (:class:`CostSpec`, returned by :meth:`Layer.cost_spec
<disttensor_nn.Layer.cost_spec>`). The cost model
(:class:`disttensor_nn.plan.CostModel`) turns that into seconds and bytes on a
machine profile, with kernel times measured on the layer's 1-process twin
(:meth:`Layer.local_twin <disttensor_nn.Layer.local_twin>`) under its
:meth:`~disttensor_nn.Layer.kernel_signature`. A new layer type is planned
by implementing these three methods; nothing in :mod:`disttensor_nn.plan`
names layer classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from disttensor import Distribution

__all__ = ["CostSpec", "Allreduce", "largest_block"]


@dataclass(frozen=True)
class Allreduce:
    """One allreduce per training iteration.

    Parameters
    ----------
    nbytes : float
        Bytes summed (per rank).
    dims : tuple of int
        The sum runs over the ranks that split these dimensions of the
        layer's input (the communicator
        :func:`~disttensor_nn.reduction.split_axes_comm` gives for them); ranks
        holding replicas take no part.
    gradient : bool
        It sums parameter gradients, which nothing needs before the
        optimizer step: the runtime reduces them in buckets while backward
        goes on, and the cost model overlaps them with backward. Statistics
        (batch norm, pooling sums) are needed at once and block.
    axes : tuple of int
        Grid axes of the input's grid that take part too though they split
        none of the input's dimensions (the replicas over which a
        filter-parallel layer sums its partial input gradients).
    weights : float, optional
        Of a gradient sum: bytes per rank of the parameters it belongs to, as
        they are stored (what the sharded stages all-gather; see
        :class:`disttensor_nn.plan.CostModel`). Default: ``nbytes`` (a
        gradient summed in the parameters' own dtype).
    """

    nbytes: float
    dims: tuple[int, ...]
    gradient: bool = False
    axes: tuple[int, ...] = ()
    weights: float | None = None


@dataclass(frozen=True)
class CostSpec:
    """The work of a layer on the largest local block of its input, per training iteration.

    Parameters
    ----------
    local_shape : tuple of int
        The local array the layer's kernels run on (its halo included): the
        shape under which the kernel timer measures the layer's twin.
    flops : float
        Floating-point operations of the forward kernels on that block (the
        rate model charges backward twice the forward time).
    nbytes : float
        Bytes the forward kernels read and write.
    timed : bool
        Whether the kernels are timed (measured on the twin, or estimated by
        the rate model). ``False``: forward and backward each take
        ``nbytes`` at the memory bandwidth, and are never measured (layers
        whose work is a reduction or nothing at all).
    halo : tuple of (int, int), optional
        Halo widths ``(before, after)`` per dimension of the input: one halo
        exchange forward and its accumulation backward.
    allreduces : tuple of Allreduce
        Allreduces per iteration (parameter gradients, statistics).
    redistributions : tuple of Distribution
        Layouts the input is redistributed to forward (and the gradient back
        from, backward), as pure distributions on grid shapes.
    saved : int
        Bytes of arrays the layer allocates in forward and holds until its
        backward (a mask, normalised values, halo margins grown into its
        input's buffer), its input and output not counted.
    workspace : int
        Bytes of scratch memory the forward or backward pass allocates and
        frees again (the larger of the two), beyond the input, the output,
        the incoming gradient and the returned one.
    forward_workspace : int, optional
        The forward pass's share of that scratch, when it is smaller (what an
        inference pass needs); None: ``workspace``.
    keeps_input : bool
        The layer holds its input until backward (the whole block; halo
        margins grown into it count in ``saved``).
    keeps_output : bool
        The layer holds its output until backward.
    share : float
        The share of its twin's kernel work the layer does on ``local_shape``
        (a convolution whose filters are split computes ``F_slice / F`` of
        the twin's outputs): measured kernel times are scaled by it, and
        ``flops`` and ``nbytes`` describe the twin's whole work.
    twin : Layer, optional
        The layer whose one-process kernels do this rank's work on
        ``local_shape``, where it is not the layer itself (a convolution on a
        slice of its channels or filters runs a narrower convolution); the
        kernel timer measures its twin.

    The planner's memory model (:mod:`disttensor_nn.plan`) adds, per rank,
    what every layer keeps (:meth:`kept`, an activation kept by both of the
    layers it joins counted once) to the largest transient need of one
    layer's pass (:meth:`transient`); the tests check these declarations
    against allocations measured with ``tracemalloc``. For inference
    (``training=False``) nothing is kept: the peak is the largest forward
    pass of one layer plus what the callers hold meanwhile (the network's
    input, the input of every residual block being run and, during a
    block's post-chain, the merged array it reads).
    """

    local_shape: tuple[int, ...]
    flops: float = 0.0
    nbytes: float = 0.0
    timed: bool = True
    halo: tuple[tuple[int, int], ...] | None = None
    allreduces: tuple[Allreduce, ...] = ()
    redistributions: tuple[Distribution, ...] = ()
    saved: int = 0
    workspace: int = 0
    forward_workspace: int | None = None
    keeps_input: bool = False
    keeps_output: bool = False
    share: float = 1.0
    twin: Any = None

    def kept(self, in_bytes: int, out_bytes: int, training: bool = True) -> int:
        """Bytes held from forward to backward, for input and output blocks of these sizes.

        Nothing in inference (``training=False``): the runner drops what a
        layer saves as soon as its forward returns (:meth:`Layer.release_saved
        <disttensor_nn.Layer.release_saved>`).
        """
        if not training:
            return 0
        return self.saved + in_bytes * self.keeps_input + out_bytes * self.keeps_output

    def transient(self, in_bytes: int, out_bytes: int, training: bool = True) -> int:
        """Bytes alive only while a pass runs: output or incoming gradient, returned
        gradient and scratch (the input when the layer does not keep it).

        In inference (``training=False``) the forward pass alone: input, output
        and scratch, and what the layer saves until the pass ends.
        """
        if not training:
            scratch = self.workspace if self.forward_workspace is None else \
                self.forward_workspace
            return in_bytes + out_bytes + scratch + self.saved
        return out_bytes + in_bytes + self.workspace


def largest_block(dist: Distribution) -> tuple[int, ...]:
    """Shape of the largest local block of ``dist`` (per dimension, the longest block)."""
    if dist.grid is None:  # pure metadata, asked about many times while planning
        return _pure_largest_block(dist)
    return _largest_block(dist)


def _largest_block(dist: Distribution) -> tuple[int, ...]:
    return tuple(max(b[i + 1] - b[i] for i in range(len(b) - 1)) for b in dist.boundaries)


_pure_largest_block = lru_cache(maxsize=65536)(_largest_block)
