"""Parameters, the layer interface, and the layout that maps array dims to grid axes."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.transport import allreduce as transport_allreduce

from .costspec import CostSpec, largest_block

__all__ = ["Parameter", "Layer", "Layout", "split_axes_comm", "check_input"]

BUFFER_ATTRS = ("running_mean", "running_var")
"""Layer attributes that hold non-trainable state arrays (batch-norm running statistics)."""


class Parameter:
    """A trainable array, replicated on every rank.

    ``data`` and ``grad`` are NumPy arrays of the full (global) shape; after a
    backward pass ``grad`` holds the same values on every rank. Gradients
    accumulate (``+=``) until :meth:`zero_grad`.
    """

    def __init__(self, data: np.ndarray):
        self.data = np.ascontiguousarray(data)
        self.grad = np.zeros_like(self.data)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the parameter."""
        return self.data.shape

    def zero_grad(self) -> None:
        """Set the gradient to zero."""
        self.grad[...] = 0

    def __repr__(self) -> str:
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype})"


class Layout:
    """Which grid axes split which array dimensions, for arrays of any shape.

    A Layout turns into a :class:`~disttensor.Distribution` once the shape is
    known (``layout.distribution(shape)``), so a layer can be told how its
    input is to be split before the batch size or image size is fixed.

    Parameters
    ----------
    grid : ProcessGrid
    axes : sequence
        As ``Distribution(axes=...)``: per dimension a grid axis, a tuple of
        them, or None.
    """

    def __init__(self, grid: ProcessGrid, axes: Sequence[Any]):
        self.grid = grid
        self.axes = tuple(axes)
        # validates, and gives the axes in the form Distribution.axes reports them
        self._normal_axes = Distribution((0,) * len(self.axes), grid.shape, self.axes).axes

    def distribution(self, shape: Sequence[int]) -> Distribution:
        """The Distribution of an array of ``shape`` under this layout."""
        if len(shape) != len(self.axes):
            raise ValueError(f"layout {self.axes} is for {len(self.axes)}-D arrays, got {shape}")
        return Distribution(tuple(shape), self.grid, self.axes)

    def matches(self, dist: Distribution) -> bool:
        """Whether ``dist`` is split as this layout says (``Layout.of(dist) == self``)."""
        return dist.grid == self.grid and dist.axes == self._normal_axes

    @classmethod
    def of(cls, dist: Distribution) -> Layout:
        """The layout of an existing distribution (its explicit splits are dropped)."""
        return cls(dist.grid, dist.axes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and \
            (self.grid, self._normal_axes) == (other.grid, other._normal_axes)

    def __hash__(self) -> int:
        return hash((self.grid, self._normal_axes))

    def __repr__(self) -> str:
        return f"Layout(grid={self.grid.shape}, axes={self.axes})"


def split_axes_comm(dist: Distribution, dims: Sequence[int] | None = None) -> MPI.Intracomm:
    """Communicator along the grid axes that split ``dims`` (all dims by default).

    Reductions of per-rank partial sums use it: ranks along replica axes hold
    copies and must not be counted twice.
    """
    dims = range(dist.ndim) if dims is None else dims
    axes = [a for d in dims for a in dist.dim_axes[d]]
    return dist.grid.subcomm(axes)


def allreduce_(arr: Any, comm: MPI.Intracomm) -> Any:
    """Sum ``arr`` in place over ``comm`` (nothing to do on one rank).

    ``arr`` may be an array of any module: it travels through that module's
    transport (:func:`disttensor.transport.allreduce`: device memory, host
    staging, or NCCL for GPU gradients).
    """
    if comm.Get_size() > 1:
        out = transport_allreduce(arr, comm, MPI.SUM)
        if out is not arr:
            arr[...] = out
    return arr


def check_input(x: Any, ndim: int, name: str, channels: int | None = None,
                dtype: Any = None) -> None:
    """Validate a layer input identically on every rank (shape and dtype are global facts)."""
    if not isinstance(x, DistArray):
        raise TypeError(f"{name} expects a DistArray, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} expects a {ndim}-D input (N, C, ...), got shape {x.shape}")
    if channels is not None and x.shape[1] != channels:
        raise ValueError(f"{name} expects {channels} channels, got {x.shape[1]}")
    if ndim >= 2 and x.dist.nblocks[1] > 1:
        raise ValueError(f"{name}: the channel dimension must not be split, got {x.dist}")
    if dtype is not None and x.dtype != np.dtype(dtype):
        raise TypeError(f"{name} has {np.dtype(dtype)} parameters but the input is {x.dtype}")


class Layer:
    """Base class of distributed layers: ``forward(x) -> y`` and ``backward(dy) -> dx``.

    Inputs and outputs are DistArrays; a layer keeps what its backward pass
    needs from the last forward call. ``layout`` (optional) asks the
    containers to redistribute the input to that layout first.
    """

    training: bool = True
    layout: Layout | None = None

    def forward(self, x: DistArray) -> DistArray:  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, dy: DistArray) -> DistArray:  # pragma: no cover - interface
        raise NotImplementedError

    def __call__(self, x: DistArray) -> DistArray:
        return self.forward(x)

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Global output shape for a global input shape (element-wise layers keep it)."""
        return tuple(in_shape)

    def children(self) -> Iterator[Layer]:
        """Direct sub-layers."""
        return iter(())

    def layers(self) -> Iterator[Layer]:
        """This layer and all its sub-layers, depth first."""
        yield self
        for child in self.children():
            yield from child.layers()

    def own_parameters(self) -> list[Parameter]:
        """Parameters of this layer itself (not its children)."""
        return []

    def parameters(self) -> Iterator[Parameter]:
        """All parameters of this layer and its sub-layers, in a fixed order."""
        yield from self.own_parameters()
        for child in self.children():
            yield from child.parameters()

    def zero_grad(self) -> None:
        """Zero every parameter's gradient."""
        for p in self.parameters():
            p.zero_grad()

    def train(self, mode: bool = True) -> Layer:
        """Training mode (batch statistics) or, with ``mode=False``, evaluation mode."""
        self.training = mode
        for child in self.children():
            child.train(mode)
        return self

    def eval(self) -> Layer:
        """Evaluation mode."""
        return self.train(False)

    # ------------------------------------------------------------ cost model
    def cost_spec(self, dist: Distribution, itemsize: int = 4) -> CostSpec:
        """What the planner's cost model needs of this layer on an input split as ``dist``.

        The default describes a local element-wise layer: one FLOP per
        element of the largest block, which is read and written once and
        kept for backward; no communication. Layers that do other work
        override it (see :mod:`disttensor_nn.costspec`).

        Parameters
        ----------
        dist : Distribution
            The global input's distribution, pure (built on a grid shape, no
            communicator): the planner asks for every candidate.
        itemsize : int
            Bytes per activation element.

        Returns
        -------
        CostSpec
            The work on the largest local block, per training iteration.
        """
        block = largest_block(dist)
        n = math.prod(block)
        return CostSpec(block, flops=float(n), nbytes=2 * n * itemsize, saved=n * itemsize)

    def kernel_signature(self) -> str:
        """What determines this layer's local kernel time besides the input: the timer's cache key.

        Two layers with the same signature take the same time on the same
        local input shape and dtype. The default is the class name (right for
        layers without parameters or options that change their work).
        """
        return type(self).__name__

    def local_twin(self) -> Layer:
        """A 1-process copy that does the same local work, for timing the kernels.

        The twin runs on the halo-extended local block on a 1-process grid,
        so window layers drop their padding, and it has its own parameters
        and statistics, so timing never changes this layer's. The default, a
        shallow copy, suits layers without parameters or running statistics.
        """
        return copy.copy(self)
