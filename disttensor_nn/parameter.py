"""Parameter: a trainable array, replicated on every rank or sharded over a process grid,
with its gradient and its sharded-weights state (the ``"full"`` stage of
:func:`disttensor_nn.optim.shard_state`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from disttensor import Distribution
from disttensor.backend import (
    array_namespace,
    astype,
    contiguous,
    device_of,
    fill,
    is_c_contiguous,
    reshape,
)

from .layout import full_array, local_block
from .shards import gather_shards, shard_counts, shard_range

__all__ = ["Parameter"]


class Parameter:
    """A trainable array, replicated on every rank or sharded over a process grid.

    ``data`` and ``grad`` are this rank's arrays, of any array module (NumPy,
    CuPy, or another array API namespace such as ``array_api_strict``);
    ``grad`` lives in the module and on the device of ``data``. A replicated
    parameter (``dist`` None) holds the full array on every rank, and after a
    backward pass ``grad`` holds the same values everywhere. A sharded one
    (``dist`` a :class:`~disttensor.Distribution` of the full shape) holds
    its block of ``dist`` (``data.shape == dist.local_shape()``): the layers
    of channel- and filter-parallel convolutions shard their weights so, and
    their gradients are summed only over the ranks that hold the same block.
    Gradients accumulate (``+=``) until :meth:`zero_grad`. :meth:`Layer.to`
    moves both to another array module. Under :func:`no_sync` the layers'
    local gradient parts gather in ``unreduced`` instead (not summed over
    ranks); the next backward outside it adds them to its own parts before
    the one reduction. Under the ``"full"`` stage of
    :func:`disttensor_nn.optim.shard_state` (:attr:`sharded_weights`) a rank
    keeps only ``piece``, its part of the flat local block, between its
    layer's passes: the layer gathers ``data`` for each pass and drops it
    after (``data`` raises in between; :meth:`full` gathers).

    Parameters
    ----------
    data : array
        The initial value (an array of any module; array_likes become NumPy
        arrays): the full array, or this rank's block of ``dist``. Kept
        C-contiguous.
    dist : Distribution, optional
        The distribution of the full array over a process grid (None:
        replicated).
    """

    ever_sharded = False
    """Whether any parameter of this process has kept only its piece of the weights (the
    ``"full"`` stage of :func:`disttensor_nn.optim.shard_state`) since the process began:
    until then no layer has weights to gather or prefetch for a pass (read on the class)."""

    def __init__(self, data: Any, dist: Distribution | None = None):
        data = data if hasattr(data, "shape") else np.asarray(data)
        if dist is not None:
            if not isinstance(dist, Distribution) or dist.grid is None:
                raise TypeError("Parameter: dist must be a Distribution on a ProcessGrid")
            if tuple(data.shape) != dist.local_shape():
                raise ValueError(f"Parameter: data of shape {tuple(data.shape)} is not this "
                                 f"rank's block {dist.local_shape()} of {dist}")
        self._data: Any = contiguous(data)
        # stage "full" of disttensor_nn.optim.shard_state: this rank's flat piece of the
        # local block and where it lies (_Held); ``_data`` is then None, or the block
        # gathered for one forward or backward pass of its layer
        self.piece: Any = None
        self._held: _Held | None = None
        self._pending: tuple[Any, np.ndarray] | None = None  # a gather started ahead
        self._grad: Any = array_namespace(self._data).zeros_like(self._data)
        self._grad_zero = False  # zero_grad() was called: ``_grad`` is zeros, not yet written
        # ``_grad`` is a kernel's own array, given away (add_grad_'s ``owned``): zero_grad
        # drops it then, keeping only what the next one must be like (``_grad`` None)
        self._grad_given = False
        self._grad_like: tuple[tuple[int, ...], Any, type, Any, Any] | None = None
        self.dist = dist
        self.unreduced: Any = None  # this rank's gradient parts kept back by no_sync
        # the communicator the last backward pass summed the gradient over (the ranks
        # that replicate this parameter or its block), and, with reduce_scatter set
        # (disttensor_nn.optim.shard_state's "gradients" stage), the flat range
        # (start, stop) of the local block that ``grad`` holds alone
        self.grad_comm: MPI.Intracomm | None = None
        self.reduce_scatter = False
        # stage "full": after its layer's first backward pass, keep only this rank's piece
        # of the weights (settle_weights_), not until the optimizer's first step
        self.shard_weights = False
        self.grad_range: tuple[int, int] | None = None

    @property
    def data(self) -> Any:
        """This rank's array: the full parameter, or its block of ``dist``.

        Raises
        ------
        RuntimeError
            While the weights are sharded (:attr:`sharded_weights`) outside
            their layer's forward and backward passes: :meth:`full` gathers
            them (collective).
        """
        if self._data is None:
            raise RuntimeError(
                "Parameter.data: the weights are sharded over the ranks that replicate them "
                "(shard_state 'full': this rank holds the piece Parameter.piece); their layer "
                "gathers them for its forward and backward passes, and full() gives the whole "
                "array (collective)")
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        self._finish_prefetch()
        self._data, self.piece, self._held = value, None, None

    @property
    def sharded_weights(self) -> bool:
        """Whether this rank keeps only :attr:`piece` of the weights between passes (the
        ``"full"`` stage of :func:`disttensor_nn.optim.shard_state`)."""
        return self._held is not None

    @property
    def like(self) -> Any:
        """An array of this parameter's module, device and dtype (``data``, or the piece)."""
        return self._data if self._data is not None else self.piece

    @property
    def dtype(self) -> Any:
        """The dtype of the weights."""
        return self.like.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the (full) parameter."""
        return self.local_shape if self.dist is None else self.dist.global_shape

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's ``data`` (its block: also while the weights are sharded)."""
        return self._held.shape if self._held is not None else tuple(self._data.shape)

    @property
    def local_size(self) -> int:
        """Elements of :attr:`local_shape`."""
        return math.prod(self.local_shape)

    def full(self) -> Any:
        """The full array (``data`` itself when replicated; collective when sharded, or when
        the weights are: :attr:`sharded_weights`)."""
        block = self._data
        if block is None:  # the pieces gathered for this call alone
            self.gather_()
            block, self._data = self._data, None
        return full_array(block, self.dist)

    # ------------------------------------------------ sharded weights (stage "full")
    def release_(self, comm: MPI.Intracomm, start: int, stop: int) -> None:
        """Keep only the piece ``[start, stop)`` of the flat local block, which the ranks of
        ``comm`` hold together (:func:`shard_range`'s), and drop the block. Local.

        The piece is copied from ``data`` unless the weights are sharded
        already (then ``data``, gathered for a pass, is merely dropped).
        """
        if self._held is None:
            shape = tuple(self._data.shape)
            self.piece = contiguous(reshape(self._data, (-1,))[start:stop], copy=True)
            self._held = _Held(comm, start, stop, shape)
            Parameter.ever_sharded = True
        self._data = None

    def settle_weights_(self) -> None:
        """Under the ``"full"`` stage (``shard_weights``), keep only this rank's piece of
        whole weights once a backward pass has told the ranks that replicate them
        (``grad_comm``): the piece the optimizer updates (:func:`shard_range`'s over
        them). Nothing otherwise. Local.

        Layers call it after their backward pass, so that the first step holds the
        weights whole only until each layer's backward, as later steps do between
        passes, instead of until the optimizer's first update.
        """
        comm = self.grad_comm
        if not self.shard_weights or self._held is not None or self._data is None or \
                comm is None or comm.Get_size() == 1:
            return
        start, stop = shard_range(self.local_size, comm.Get_size(), comm.Get_rank())
        self.release_(comm, start, stop)

    def gather_(self) -> bool:
        """Gather the local block from the pieces of :meth:`release_` into ``data`` (for a
        pass of the layer; collective over the ranks that hold them); False, doing
        nothing, when ``data`` is there already."""
        if self._data is not None:
            return False
        h = self._held
        if self._pending is not None:  # started ahead by prefetch_
            request, buf = self._pending
            self._pending = None
            request.Wait()
            self._data = reshape(buf, h.shape)
        else:
            self._data = reshape(gather_shards(self.piece, h.comm, math.prod(h.shape)),
                                 h.shape)
        return True

    def prefetch_(self) -> None:
        """Start gathering the weights ahead of :meth:`gather_` (a non-blocking
        ``Iallgatherv``, while the layer before runs); nothing unless the weights are
        sharded, not gathered, and NumPy arrays. Collective over the ranks that hold the
        pieces: every rank starts the same gathers in the same order."""
        if self._held is None or self._data is not None or self._pending is not None or \
                not isinstance(self.piece, np.ndarray):
            return
        h = self._held
        size = math.prod(h.shape)
        counts, displs = shard_counts(size, h.comm.size)
        buf = np.empty(size, dtype=self.piece.dtype)
        self._pending = (h.comm.Iallgatherv(self.piece, [buf, (counts, displs)]), buf)

    def _finish_prefetch(self) -> None:
        if self._pending is not None:
            self._pending[0].Wait()
            self._pending = None

    def drop_(self) -> None:
        """Drop the block that :meth:`gather_` gathered (the piece stays). Local."""
        if self._held is not None:
            self._data = None

    def unshard_weights_(self) -> None:
        """Whole weights again on every rank (collective when they are sharded)."""
        if self._held is not None:
            self.gather_()
            self.piece, self._held = None, None

    def shard_(self, dist: Distribution | None) -> None:
        """Re-split ``data`` and ``grad`` as ``dist`` (None: replicate), in place.

        Collective over the parameter's grid when it is sharded now (its full
        value is gathered); local when it is replicated. Every rank must call
        it alike.
        """
        if dist == self.dist:
            return
        self.unshard_weights_()
        if self.unreduced is not None:
            raise RuntimeError("Parameter.shard_: gradient parts kept back by no_sync are "
                               "not reduced yet; run a backward pass outside no_sync first")
        if dist is not None and tuple(dist.global_shape) != self.shape:
            raise ValueError(f"Parameter.shard_: {dist} is not for shape {self.shape}")
        if self.grad_range is not None:  # the reduced shard back to the local block
            self.grad = reshape(gather_shards(self.grad, self.grad_comm, self.data.size),
                                self.data.shape)
            self.grad_range = None
        self.data = local_block(self.full(), dist)
        self.grad = local_block(full_array(self.grad, self.dist), dist)
        self.dist = dist

    @property
    def grad(self) -> Any:
        """This rank's gradient (its local block, or its shard: ``grad_range``).

        After :meth:`zero_grad` it reads as zeros; the zeros are written
        only when it is read before :meth:`add_grad_` wrote it (the first
        gradient of a step is copied in, where adding it to zeros would take
        another pass over the array), into a new array where
        :meth:`zero_grad` dropped a kernel's.
        """
        if self._grad is None and self._grad_like is not None:  # dropped by zero_grad
            self._grad, self._grad_zero = self._new_grad("zeros"), False  # zeros alike
        elif self._grad_zero:
            fill(self._grad, 0)
            self._grad_zero = False
        return self._grad

    @grad.setter
    def grad(self, value: Any) -> None:
        # the same array back (``p.grad *= c``) stays a kernel's, dropped at zero_grad
        self._grad_given = self._grad_given and value is self._grad
        self._grad, self._grad_zero = value, False
        if value is None:
            self._grad_like = None

    def add_grad_(self, g: Any, owned: bool = False) -> None:
        """``grad += g`` (``g`` of ``grad``'s size, any shape; cast to its dtype); the
        first one after :meth:`zero_grad` is copied in instead.

        With ``owned`` the caller gives ``g`` away (nothing else refers to it
        or writes it later): a first gradient of ``grad``'s dtype, array module
        and memory layout then becomes ``grad`` itself, with no copy (as
        PyTorch's autograd keeps a kernel's weight gradient), and the next
        :meth:`zero_grad` drops it.
        """
        grad = self._grad
        shape, dtype, kind, device, _ = self._grad_like if grad is None else \
            (tuple(grad.shape), grad.dtype, type(grad), None, None)
        g = reshape(g, shape) if tuple(g.shape) != shape else g
        if g.dtype != dtype:
            g = astype(g, dtype)
        if self._grad_zero:
            self._grad_zero = False
            device = device_of(grad) if grad is not None else device
            if owned and type(g) is kind and is_c_contiguous(g) and device_of(g) == device:
                self._grad, self._grad_given = g, True
            elif grad is None:  # dropped: a new array of the same kind, the copy in it
                new = self._new_grad("empty")
                new[...] = g
                self._grad = new
            else:
                grad[...] = g
        else:
            grad += g

    def _new_grad(self, make: str) -> Any:
        """A new gradient array like the one :meth:`zero_grad` dropped (``make``:
        ``"zeros"`` or ``"empty"``), of the array module's own allocation: a gradient
        lives from step to step, not in the block cache of a step's blocks."""
        shape, dtype, _, device, xp = self._grad_like
        return getattr(xp, make)(shape, dtype=dtype, **({} if device is None else
                                                        {"device": device}))

    def zero_grad(self) -> None:
        """Set the gradient to zero (and drop parts kept back by :func:`no_sync`).

        A gradient that a kernel gave away (:meth:`add_grad_`'s ``owned``) is
        dropped, as ``torch.optim.Optimizer.zero_grad`` sets PyTorch's to None:
        its memory is free during the next forward pass, and the kernels' next
        gradient is not made while it still lives. It reads as zeros
        (:attr:`grad`) until the next one arrives.
        """
        self._grad_zero = True
        self.unreduced = None
        grad = self._grad
        if self._grad_given and grad is not None and self._held is None and \
                self.grad_range is None:
            self._grad_like = (tuple(grad.shape), grad.dtype, type(grad), device_of(grad),
                               array_namespace(grad))
            self._grad, self._grad_given = None, False

    def __repr__(self) -> str:
        split = "" if self.dist is None else f", dist={self.dist}"
        return f"Parameter(shape={self.shape}, dtype={self.dtype}{split})"


class _Held(NamedTuple):
    """Where a parameter's piece of sharded weights lies: ``[start, stop)`` of its flat
    local block (of ``shape``), over the ranks of ``comm``."""

    comm: MPI.Intracomm
    start: int
    stop: int
    shape: tuple[int, ...]
