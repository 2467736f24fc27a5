"""Parameters, the layer interface with its state protocol, and the layout of arrays on grids."""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from disttensor import DistArray, Distribution, ProcessGrid, backend
from disttensor.backend import (
    array_namespace,
    as_module,
    astype,
    concat,
    contiguous,
    device_of,
    fill,
    numpy_dtype,
    reshape,
)
from disttensor.transport import AllreduceRequest, iallreduce
from disttensor.transport import allreduce as transport_allreduce

from .costspec import CostSpec, largest_block
from .kernels import backend_supports, check_backend

__all__ = ["Parameter", "Layer", "Layout", "RemovableHandle", "IncompatibleKeys",
           "GradientBuckets", "no_sync", "reduce_gradients_", "split_axes_comm", "check_input",
           "check_grad", "check_int", "check_kernels", "full_array", "local_block",
           "prefetch_weights"]


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
        self.grad = array_namespace(self._data).zeros_like(self._data)
        self.dist = dist
        self.unreduced: Any = None  # this rank's gradient parts kept back by no_sync
        # the communicator the last backward pass summed the gradient over (the ranks
        # that replicate this parameter or its block), and, with reduce_scatter set
        # (disttensor_nn.optim.shard_state's "gradients" stage), the flat range
        # (start, stop) of the local block that ``grad`` holds alone
        self.grad_comm: MPI.Intracomm | None = None
        self.reduce_scatter = False
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
        self._data = None

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

    def zero_grad(self) -> None:
        """Set the gradient to zero (and drop parts kept back by :func:`no_sync`)."""
        fill(self.grad, 0)
        self.unreduced = None

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


def full_array(local: Any, dist: Distribution | None) -> Any:
    """The full array whose block ``local`` is under ``dist`` (``local`` itself for None).

    Collective over ``dist``'s grid (an allgather by redistribution).
    """
    if dist is None:
        return local
    return DistArray.from_local(local, dist).redistribute(dist.replicated()).local


def local_block(full: Any, dist: Distribution | None) -> Any:
    """A contiguous copy of this rank's block of ``full`` under ``dist`` (all of it for None)."""
    if dist is None:
        return contiguous(full, copy=True)
    return contiguous(full[dist.local_slices()], copy=True)


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


def shard_range(size: int, nranks: int, rank: int) -> tuple[int, int]:
    """The flat range ``(start, stop)`` of ``size`` elements that rank ``rank`` of
    ``nranks`` holds: the first ``size % nranks`` ranks one element more (empty ranges
    when ``size < nranks``)."""
    base, extra = divmod(size, nranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard_counts(size: int, nranks: int) -> tuple[list[int], list[int]]:
    """Every rank's element count and offset under :func:`shard_range`."""
    bounds = [shard_range(size, nranks, r) for r in range(nranks)]
    return [b - a for a, b in bounds], [a for a, _ in bounds]


def _host(a: Any) -> np.ndarray:
    """``a`` as a contiguous NumPy array (itself for NumPy arrays)."""
    return np.ascontiguousarray(backend.to_numpy(a))


def gather_shards(shard: Any, comm: MPI.Intracomm, size: int, out: Any = None) -> Any:
    """The flat array of ``size`` elements whose :func:`shard_range` pieces the ranks of
    ``comm`` hold (``shard`` this rank's), by one Allgatherv; written into ``out``
    (flat, of ``size`` elements, in place) when given. Collective over ``comm``."""
    counts, displs = shard_counts(size, comm.size)
    like = shard if out is None else out
    xp, device = array_namespace(like), device_of(like)
    if out is not None and isinstance(out, np.ndarray):
        lo = displs[comm.rank]
        if comm.size > 1:
            if not np.shares_memory(out[lo:lo + counts[comm.rank]], shard):
                out[lo:lo + counts[comm.rank]] = shard
            comm.Allgatherv(MPI.IN_PLACE, [out, (counts, displs)])
        return out
    host = np.empty(size, dtype=numpy_dtype(shard.dtype))
    comm.Allgatherv(_host(shard), [host, (counts, displs)])
    if out is None:
        return as_module(host, xp, device) if xp is not np else host
    out[...] = as_module(host, xp, device)
    return out


def reduce_scatter_(grad: Any, comm: MPI.Intracomm) -> Any:
    """This rank's :func:`shard_range` piece of the sum over ``comm`` of the flat ``grad``
    (one Reduce_scatter with counts). Collective over ``comm``."""
    counts, _ = shard_counts(grad.size, comm.size)
    send = _host(reshape(grad, (-1,)))
    recv = np.empty(counts[comm.rank], dtype=send.dtype)
    comm.Reduce_scatter(send, recv, counts, op=MPI.SUM)
    xp = array_namespace(grad)
    return recv if xp is np else as_module(recv, xp, device_of(grad))


def _scatter_into(grads: Sequence[tuple[Parameter, Any]], comm: MPI.Intracomm) -> None:
    """``p.grad`` += this rank's piece of each summed gradient; ``grad`` then holds only
    that piece (``grad_range``): the reduce-scatter path of :func:`reduce_gradients_`."""
    for p, g in grads:
        piece = reduce_scatter_(g, comm)
        rng = shard_range(p.local_size, comm.size, comm.rank)
        if p.grad_range != rng:
            if p.grad_range is not None:
                raise RuntimeError("reduce_gradients_: a parameter's gradient is sharded over "
                                   "another communicator; zero_grad() it first")
            # the local block's gradient so far (what the layers added without a
            # reduction, e.g. batch-norm sums, is replicated): keep its piece
            p.grad = contiguous(reshape(p.grad, (-1,))[rng[0]:rng[1]], copy=True)
            p.grad_range = rng
        p.grad += astype(piece, p.grad.dtype) if piece.dtype != p.grad.dtype else piece


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
    return transport_allreduce(arr, comm, MPI.SUM, in_place=True)


DEFAULT_BUCKET_BYTES = 2**20
"""Gradient bytes per bucket of :class:`GradientBuckets` unless given."""

_active_buckets: list[GradientBuckets] = []
_no_sync_depth = [0]


class no_sync:  # noqa: N801 - a context manager named like PyTorch DDP's
    """Gradient accumulation without reduction: a context in which backward passes
    keep each parameter's local gradient part on its rank.

    Inside it, :func:`reduce_gradients_` adds the local parts of the weight
    gradients to ``Parameter.unreduced`` and sends nothing. The first
    backward pass outside it adds those parts to its own before its (one)
    reduction, so K micro-batches cost one gradient reduction instead of K,
    and the sums equal those of K reduced backward passes up to rounding
    (as ``DistributedDataParallel.no_sync``). Batch-norm statistics are
    still reduced in every micro-batch: the forward and backward passes
    need them. An optimiser step while parts are kept back raises
    (:meth:`disttensor_nn.SGD.step`); :meth:`Parameter.zero_grad` drops them.

    Examples
    --------
    >>> for i, (x, y) in enumerate(micro_batches):    # doctest: +SKIP
    ...     with no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
    ...         model.call_backward(loss_fn.backward(loss_fn(model(x), y)))
    >>> opt.step()                                     # doctest: +SKIP
    """

    def __enter__(self) -> no_sync:
        _no_sync_depth[0] += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _no_sync_depth[0] -= 1


def _keep_back(grads: Sequence[tuple[Parameter, Any]]) -> None:
    """Add the local parts to ``unreduced`` (the :func:`no_sync` path)."""
    for p, g in grads:
        if p.unreduced is None:
            p.unreduced = contiguous(g, copy=True)
        else:
            p.unreduced += astype(g, p.unreduced.dtype) if g.dtype != p.unreduced.dtype else g


def _with_kept(grads: Sequence[tuple[Parameter, Any]]) -> list[tuple[Parameter, Any]]:
    """The local parts plus what :func:`no_sync` kept back (which is then released)."""
    out = []
    for p, g in grads:
        if p.unreduced is not None:
            kept, p.unreduced = p.unreduced, None
            g = g + (astype(kept, g.dtype) if kept.dtype != g.dtype else kept)
        out.append((p, g))
    return out


def reduce_gradients_(grads: Sequence[tuple[Parameter | None, Any]],
                      comm: MPI.Intracomm) -> None:
    """Add to each parameter's ``grad`` the sum over ``comm`` of this rank's part of it.

    ``grads`` pairs parameters with this rank's (local) gradients; pairs whose
    parameter is None are skipped. Inside a :class:`GradientBuckets` context the
    sums join its buckets (non-blocking, finished by its ``wait``); otherwise
    one blocking allreduce of all of them. Either way each gradient element is
    summed over the same ranks: the results are the same. A parameter with
    ``reduce_scatter`` set (the ``"gradients"`` stage of
    :func:`disttensor_nn.optim.shard_state`) is summed by a blocking
    Reduce_scatter instead, into the piece of its flat gradient that this
    rank's optimizer shard updates (``grad`` then holds that piece alone,
    ``grad_range`` its place). Every parameter records ``comm`` as its
    ``grad_comm``. Inside a
    :func:`no_sync` context nothing is sent: the parts are kept back on the
    parameters and join the next reduction.
    """
    grads = [(p, g) for p, g in grads if p is not None]
    if not grads:
        return
    if _no_sync_depth[0]:
        _keep_back(grads)
        return
    grads = _with_kept(grads)
    for p, _ in grads:
        p.grad_comm = comm
    if comm.size > 1 and any(p.reduce_scatter for p, _ in grads):
        _scatter_into([(p, g) for p, g in grads if p.reduce_scatter], comm)
        grads = [(p, g) for p, g in grads if not p.reduce_scatter]
        if not grads:
            return
    if _active_buckets:
        _active_buckets[-1].add(grads, comm)
        return
    large, small = _split_large(grads, DEFAULT_BUCKET_BYTES)
    for p, g in large:  # reduced in place: no copy into a fused buffer
        _unpack([(p, g)], allreduce_(g, comm))
    if small:
        _unpack(small, allreduce_(_concatenate([g for _, g in small]), comm))


def _split_large(grads: Sequence[tuple[Parameter, Any]], nbytes: int) -> tuple[list, list]:
    """(gradients of ``nbytes`` or more that can be reduced in place, the others)."""
    large, small = [], []
    for p, g in grads:
        alone = backend.nbytes(g) >= nbytes and getattr(g, "flags", None) is not None and \
            g.flags.c_contiguous and g.flags.writeable
        (large if alone else small).append((p, g))
    return large, small


def _concatenate(arrays: Sequence[Any]) -> Any:
    return concat([reshape(a, (-1,)) for a in arrays])


def _unpack(grads: Sequence[tuple[Parameter, Any]], flat: Any) -> None:
    """``p.grad += `` each parameter's slice of the reduced ``flat``."""
    offset = 0
    for p, g in grads:
        part = reshape(flat[offset:offset + g.size], p.grad.shape)
        p.grad += astype(part, p.grad.dtype) if part.dtype != p.grad.dtype else part
        offset += g.size


class GradientBuckets:
    """Fused, overlapped gradient sums: a context in which layers' gradient allreduces
    are bucketed and run non-blocking.

    Inside the context, every layer's :func:`reduce_gradients_` (convolutions,
    Linear) adds its local parameter gradients to an open bucket of its
    communicator and dtype; a bucket whose size reaches ``bucket_bytes`` is
    reduced at once by a non-blocking allreduce
    (:func:`disttensor.transport.iallreduce`) while backward goes on, and
    every later addition tests the started ones so MPI progresses between
    layers. Leaving the context (or :meth:`wait`) starts the partly filled
    buckets, waits for all and adds the sums to the parameters' ``grad``:
    the optimiser step comes after it. Small models' gradients thus travel in
    one message per communicator and dtype; large ones overlap their
    reductions with the rest of backward (as PyTorch DDP's buckets).

    Every rank must run the same layers in the same order (as in any
    backward pass), so the buckets are started in the same order everywhere.
    The sums are those of the blocking path (each element summed over the
    same ranks; with two ranks bit for bit). Batch-norm statistics stay
    blocking: the input gradient needs them at once.

    Parameters
    ----------
    bucket_bytes : int
        Size at which a bucket's reduction starts.

    Examples
    --------
    >>> with GradientBuckets():          # doctest: +SKIP
    ...     model.call_backward(loss.backward())
    >>> opt.step()                        # doctest: +SKIP
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.bucket_bytes = check_int(bucket_bytes, "bucket_bytes")
        self._open: dict[tuple[int, str], tuple[MPI.Intracomm, list, int]] = {}
        self._started: list[tuple[AllreduceRequest, list]] = []

    def __enter__(self) -> GradientBuckets:
        _active_buckets.append(self)
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        _active_buckets.remove(self)
        if exc_type is None:
            self.wait()
        else:
            # an error raised alike on every rank (a layer's argument check, a memory
            # budget) left the same reductions in flight everywhere: finish them, so no
            # request or buffer outlives the context, and keep the gradients unchanged.
            # An error on some ranks only ends the job (disttensor.runtime) instead.
            self._open.clear()
            started, self._started = self._started, []
            for request, _ in started:
                request.wait()

    def add(self, grads: Sequence[tuple[Parameter, Any]], comm: MPI.Intracomm) -> None:
        """Add local gradients to the bucket of ``comm`` and their dtype (see the class).

        A gradient of ``bucket_bytes`` or more is reduced alone, in place (no
        copy into a bucket), at once.
        """
        large, grads = _split_large(grads, self.bucket_bytes)
        for p, g in large:
            self._started.append((iallreduce(reshape(g, (-1,)), comm), [(p, g)]))
        for p, g in grads:
            key = (comm.py2f(), numpy_dtype(g.dtype).str)
            _, entries, nbytes = self._open.get(key, (comm, [], 0))
            self._open[key] = (comm, entries, nbytes + backend.nbytes(g))
            entries.append((p, g))
        for key in [k for k, (_, _, nbytes) in self._open.items()
                    if nbytes >= self.bucket_bytes]:
            self._start(key)
        for request, _ in self._started:
            request.test()

    def _start(self, key: tuple[int, str]) -> None:
        comm, entries, _ = self._open.pop(key)
        self._started.append((iallreduce(_concatenate([g for _, g in entries]), comm),
                              entries))

    def wait(self) -> None:
        """Start the open buckets, wait for every reduction and add the sums to the grads."""
        for key in list(self._open):
            self._start(key)
        started, self._started = self._started, []
        for request, entries in started:
            _unpack(entries, request.wait())


def check_input(x: Any, ndim: int, name: str, channels: int | None = None,
                dtype: Any = None, *, split_channels: bool = False) -> None:
    """Validate a layer input identically on every rank (shape and dtype are global facts).

    The channel dimension may be split only where ``split_channels`` is True
    (layers that handle channel slices: convolution, pooling, batch norm).
    """
    if not isinstance(x, DistArray):
        raise TypeError(f"{name} expects a DistArray, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} expects a {ndim}-D input (N, C, ...), got shape {x.shape}")
    if channels is not None and x.shape[1] != channels:
        raise ValueError(f"{name} expects {channels} channels, got {x.shape[1]}")
    if ndim >= 2 and x.dist.nblocks[1] > 1 and not split_channels:
        raise ValueError(f"{name}: the channel dimension must not be split, got {x.dist}")
    if dtype is not None and x.dtype != np.dtype(dtype):
        raise TypeError(f"{name} has {np.dtype(dtype)} parameters but the input is {x.dtype}")


def check_grad(dy: Any, out: tuple[Distribution, Any] | None, name: str) -> DistArray:
    """Validate the gradient ``dy`` of an output made by ``forward`` (identically on every rank).

    The shape, dtype and grid are global facts, so every rank reaches the same
    verdict before any communication.

    Parameters
    ----------
    dy : DistArray
        The gradient given to ``backward``.
    out : (Distribution, dtype) or None
        The distribution and dtype of the forward output, None when there is
        no forward output to take the gradient of.
    name : str
        What is called, for the messages (``"Conv2d.backward"``).

    Returns
    -------
    DistArray
        ``dy`` itself, or ``dy`` redistributed to the output's distribution
        when it has the right shape and dtype in another distribution over
        the same processes (collective then).

    Raises
    ------
    RuntimeError
        When there is no forward output (``backward`` before ``forward``, or
        after a forward call that raised).
    TypeError
        When ``dy`` is not a DistArray or has another dtype than the output.
    ValueError
        When ``dy`` has another shape than the output, or lives on other
        processes.
    """
    if out is None:
        raise RuntimeError(f"{name} called before a successful forward call: there is no "
                           "output to take the gradient of")
    dist, dtype = out
    if not isinstance(dy, DistArray):
        raise TypeError(f"{name} expects the output gradient as a DistArray, got "
                        f"{type(dy).__name__}")
    if dy.shape != dist.global_shape:
        raise ValueError(f"{name}: the gradient has shape {dy.shape} but the output of forward "
                         f"has shape {dist.global_shape}")
    if numpy_dtype(dy.dtype) != numpy_dtype(dtype):
        raise TypeError(f"{name}: the gradient is {numpy_dtype(dy.dtype)} but the output of "
                        f"forward is {numpy_dtype(dtype)}")
    if dy.dist == dist:
        return dy
    if not dy.grid.same_processes(dist.grid.comm):
        raise ValueError(f"{name}: the gradient lives on other processes than the output "
                         f"of forward ({dy.grid} vs {dist.grid})")
    return dy.redistribute(dist)


def check_int(value: Any, name: str, low: int = 1) -> int:
    """``value`` as an int if it is an integer (not a bool) ``>= low``; otherwise a clear error.

    Raises
    ------
    TypeError
        For a bool, a float or anything else that is not an integer.
    ValueError
        For an integer below ``low``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


_UNCHECKED = ()
"""What a forward call that returned something other than a DistArray records: its
backward gets ``dy`` unchecked."""


def check_kernels(layer: Layer, x: DistArray) -> None:
    """Refuse an input that ``layer``'s kernel backend cannot run (before any message).

    Raises
    ------
    TypeError
        Naming the layer, the backend, the dtype and the device, e.g. a
        float16 convolution with the torch kernels on a CPU.
    ImportError
        For a backend whose library is not installed, naming the extra.
    """
    name = check_backend(layer.kernel_backend)
    device = "cpu" if backend.is_numpy(x.xp) else "gpu"
    if not backend_supports(name, x.dtype, device):
        raise TypeError(f"{type(layer).__name__}: the {name} kernels do not run {x.dtype} "
                        f"arrays on the {device}; use kernel_backend='numpy' for this layer")


def prefetch_weights(layer: Layer | None, last: bool = False) -> None:
    """Start gathering the sharded weights (stage ``"full"``) of the first layer of
    ``layer`` that has parameters of its own (the last with ``last``: the next one of a
    backward pass), to overlap with the layer running now (:meth:`Parameter.prefetch_`).
    Containers call it before each of their layers; collective as the passes are."""
    while layer is not None:
        own = [p for p in layer.__dict__["_parameters"].values() if p is not None]
        if own:
            for p in own:
                p.prefetch_()
            return
        children = [c for c in layer.__dict__["_modules"].values() if c is not None]
        layer = (children[-1] if last else children[0]) if children else None


def _gather_weights(layer: Layer) -> list[Parameter]:
    """Gather the sharded weights of ``layer``'s own parameters for one pass (the
    ``"full"`` stage of :func:`disttensor_nn.optim.shard_state`); those gathered, to drop
    after it. Collective over the ranks that hold their pieces, as every pass."""
    return [p for p in layer.__dict__["_parameters"].values()
            if p is not None and p._held is not None and p.gather_()]


def _recording_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` that remembers its output's distribution and dtype for :func:`check_grad`."""

    @functools.wraps(forward)
    def wrapper(self: Layer, x: Any, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        if d.get("_in_forward"):  # a subclass's forward calling super().forward
            return forward(self, x, *args, **kwargs)
        if d.get("kernel_backend") not in (None, "numpy") and isinstance(x, DistArray):
            check_kernels(self, x)
        d["_output"], d["_in_forward"] = None, True
        gathered = _gather_weights(self)
        try:
            y = forward(self, x, *args, **kwargs)
        finally:
            d["_in_forward"] = False
            for p in gathered:
                p.drop_()
        d["_output"] = (y.dist, y.dtype) if isinstance(y, DistArray) else _UNCHECKED
        return y

    return wrapper


def _checked_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    """``backward`` that validates ``dy`` with :func:`check_grad` first."""

    @functools.wraps(backward)
    def wrapper(self: Layer, dy: Any, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        out = d.get("_output")
        if d.get("_in_backward"):
            return backward(self, dy, *args, **kwargs)
        if out is not _UNCHECKED:
            dy = check_grad(dy, out, f"{type(self).__name__}.backward")
        d["_in_backward"] = True
        gathered = _gather_weights(self)
        try:
            return backward(self, dy, *args, **kwargs)
        finally:
            d["_in_backward"] = False
            for p in gathered:
                p.drop_()

    return wrapper


class RemovableHandle:
    """What the ``register_*_hook`` methods of :class:`Layer` return: :meth:`remove` undoes it.

    Also a context manager that removes the hook on exit (as PyTorch's handle).
    """

    _ids = itertools.count()

    def __init__(self, hooks: dict[int, Callable[..., Any]]):
        self._hooks = hooks
        self.id = next(self._ids)

    def remove(self) -> None:
        """Unregister the hook (nothing happens the second time)."""
        self._hooks.pop(self.id, None)

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class IncompatibleKeys(NamedTuple):
    """Keys that :meth:`Layer.load_state_dict` with ``strict=False`` did not match."""

    missing_keys: list[str]
    """Keys of the layer's state that the given state lacks (left unchanged)."""
    unexpected_keys: list[str]
    """Keys of the given state that the layer does not have (ignored)."""


_REGISTRIES = ("_parameters", "_buffers", "_modules", "_forward_pre_hooks", "_forward_hooks",
               "_backward_pre_hooks", "_backward_hooks")
"""The per-layer dictionaries that :meth:`Layer.__new__` creates."""


_RESERVED = frozenset((
    "forward", "backward", "call_backward", "output_shape", "children", "named_children",
    "modules", "named_modules", "layers", "parameters", "named_parameters", "own_parameters",
    "buffers", "named_buffers", "state_dict", "load_state_dict", "to", "zero_grad", "train",
    "eval", "register_parameter", "register_buffer", "add_module", "register_module",
    "register_forward_pre_hook", "register_forward_hook", "register_full_backward_pre_hook",
    "register_full_backward_hook", "release_saved"))
"""Layer methods of the calling and state protocol: no attribute, parameter, buffer or
sub-layer may take their names (an attribute ``layers`` would hide ``layers()``)."""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_name(owner: Layer, name: Any, kind: str, registry: dict[str, Any]) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{kind} name must be a str, got {type(name).__name__}")
    if not name or "." in name:
        raise KeyError(f"{kind} name must be non-empty and contain no '.', got {name!r}")
    if name in _RESERVED:
        raise KeyError(f"{kind} name {name!r} would hide the Layer method {name}()")
    if hasattr(owner, name) and name not in registry:
        raise KeyError(f"attribute {name!r} already exists on {type(owner).__name__}")


def _copy_into(dst: Any, src: Any) -> None:
    """Write ``src`` (an array of any module) into ``dst``, in ``dst``'s module and dtype."""
    src = as_module(src, array_namespace(dst), device_of(dst))
    if numpy_dtype(src.dtype) != numpy_dtype(dst.dtype):
        src = astype(src, dst.dtype)
    dst[...] = src


class Layer:
    """Base class of distributed layers: ``forward(x) -> y`` and ``backward(dy) -> dx``.

    Inputs and outputs are DistArrays; a layer keeps what its backward pass
    needs from the last forward call. ``layout`` (optional) asks the
    containers to redistribute the input to that layout first.

    The state protocol follows ``torch.nn.Module``. Assigning a
    :class:`Parameter` or a Layer to an attribute registers it (in that
    order) as a parameter or a sub-layer; arrays that are state but not
    trained (batch-norm running statistics) are registered with
    :meth:`register_buffer`. From these registries come
    :meth:`named_parameters`, :meth:`named_buffers`, :meth:`named_children`,
    :meth:`named_modules`, :meth:`state_dict` and :meth:`load_state_dict`,
    :meth:`to` and :meth:`train`. A layer author writes only ``__init__``,
    ``forward`` and ``backward`` (and ``output_shape`` where the shape
    changes); calling ``super().__init__()`` is not needed.

    Calling a layer (``layer(x)``) runs :meth:`forward` between the forward
    hooks; :meth:`call_backward` runs :meth:`backward` between the backward
    hooks. Containers call their sub-layers these two ways, so hooks fire for
    every layer of a model.

    Every subclass's ``backward`` checks its ``dy`` first (:func:`check_grad`),
    identically on every rank and before any communication: when the last
    forward call returned a DistArray, ``dy`` must be a DistArray of its
    shape and dtype (else ValueError or TypeError), and one in another
    distribution over the same processes is redistributed to the output's
    distribution. ``backward`` before any successful ``forward`` raises
    RuntimeError. Layer authors get
    this without writing it: the base class wraps the ``forward`` and
    ``backward`` a subclass defines.

    ``input_grad`` (default True) says whether the input gradient is
    wanted. A layer fed data needs none (PyTorch skips the gradient of an
    input that does not require one); with ``input_grad = False`` a layer
    may skip computing it, and its ``backward`` then returns None
    (convolution and pooling layers do; the others ignore the attribute).

    ``kernel_backend`` names the local kernels a layer runs (``"numpy"``,
    ``"torch"``; None: those of its arrays' module, see
    :func:`disttensor_nn.kernels.kernels_for`); ``kernel_backends`` lists
    the backends a layer has kernels in (empty: its arithmetic is the
    array module's whatever the backend). A plan sets it per layer.
    """

    training: bool = True
    layout: Layout | None = None
    input_grad: bool = True
    kernel_backend: str | None = None
    kernel_backends: tuple[str, ...] = ()
    saved_for_backward: tuple[str, ...] = ()
    """Attributes that ``forward`` sets for ``backward`` (see :meth:`release_saved`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if inspect.isfunction(cls.__dict__.get("forward")):
            cls.forward = _recording_forward(cls.__dict__["forward"])
        if inspect.isfunction(cls.__dict__.get("backward")):
            cls.backward = _checked_backward(cls.__dict__["backward"])

    def __new__(cls, *args: Any, **kwargs: Any) -> Layer:
        self = super().__new__(cls)
        d = self.__dict__
        for name in _REGISTRIES:
            d[name] = {}
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _RESERVED:
            raise AttributeError(f"{type(self).__name__}.{name} is a Layer method; an "
                                 f"attribute of that name would hide it")
        d = self.__dict__
        params, buffers, modules = d["_parameters"], d["_buffers"], d["_modules"]
        if isinstance(value, Parameter):
            buffers.pop(name, None)
            modules.pop(name, None)
            params[name] = value
        elif isinstance(value, Layer):
            params.pop(name, None)
            buffers.pop(name, None)
            modules[name] = value
        elif name in params or name in modules:
            if value is not None:
                kind = "Parameter" if name in params else "Layer"
                raise TypeError(f"cannot assign a {type(value).__name__} to {name!r} of "
                                f"{type(self).__name__}: a {kind} or None is expected")
            (params if name in params else modules)[name] = None
        elif name in buffers:
            if value is not None and not hasattr(value, "shape"):
                raise TypeError(f"buffer {name!r} must be an array or None, got "
                                f"{type(value).__name__}")
            buffers[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        for registry in (self._parameters, self._buffers, self._modules):
            registry.pop(name, None)
        object.__delattr__(self, name)

    def __copy__(self) -> Layer:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        for name in _REGISTRIES:  # a copy registers and hooks on its own
            new.__dict__[name] = dict(self.__dict__[name])
        return new

    # ------------------------------------------------------------ calling
    def forward(self, x: DistArray) -> DistArray:  # pragma: no cover - interface
        """The layer's output for the input ``x``."""
        raise NotImplementedError

    def backward(self, dy: DistArray) -> DistArray:  # pragma: no cover - interface
        """The input gradient for the output gradient ``dy`` (after :meth:`forward`)."""
        raise NotImplementedError

    def release_saved(self) -> None:
        """Drop what :meth:`forward` kept for :meth:`backward` (the activations it saved).

        Only that per-pass state goes; the mode (``training``), ``input_grad``,
        hooks, parameters and buffers stay. :meth:`backward` then needs another
        :meth:`forward` first (what :mod:`disttensor_nn.recompute` runs).
        """
        for name in type(self).saved_for_backward:
            self.__dict__.pop(name, None)

    def __call__(self, x: DistArray) -> DistArray:
        """:meth:`forward` with the forward pre-hooks before and the forward hooks after."""
        for hook in tuple(self._forward_pre_hooks.values()):
            result = hook(self, x)
            if result is not None:
                x = result
        y = self.forward(x)
        for hook in tuple(self._forward_hooks.values()):
            result = hook(self, x, y)
            if result is not None:
                y = result
        return y

    def call_backward(self, dy: DistArray) -> DistArray:
        """:meth:`backward` with the backward pre-hooks before and the backward hooks after.

        Containers call their sub-layers' backward passes this way; a training
        loop may call ``model.backward(dy)`` (no hooks of the model itself) or
        ``model.call_backward(dy)``.
        """
        for hook in tuple(self._backward_pre_hooks.values()):
            result = hook(self, dy)
            if result is not None:
                dy = result
        dx = self.backward(dy)
        for hook in tuple(self._backward_hooks.values()):
            result = hook(self, dx, dy)
            if result is not None:
                dx = result
        return dx

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Global output shape for a global input shape (element-wise layers keep it)."""
        return tuple(in_shape)

    # ------------------------------------------------------------ hooks
    def register_forward_pre_hook(self, hook: Callable[[Layer, Any], Any]) -> RemovableHandle:
        """Call ``hook(layer, input)`` before every call of the layer.

        A result other than None replaces the input. Returns a handle whose
        ``remove()`` unregisters the hook.
        """
        return self._add_hook(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook: Callable[[Layer, Any, Any], Any]) -> RemovableHandle:
        """Call ``hook(layer, input, output)`` after every call of the layer.

        A result other than None replaces the output. Returns a handle whose
        ``remove()`` unregisters the hook.
        """
        return self._add_hook(self._forward_hooks, hook)

    def register_full_backward_pre_hook(self, hook: Callable[[Layer, Any], Any]
                                        ) -> RemovableHandle:
        """Call ``hook(layer, grad_output)`` before every :meth:`call_backward`.

        A result other than None replaces ``grad_output``. Returns a handle
        whose ``remove()`` unregisters the hook.
        """
        return self._add_hook(self._backward_pre_hooks, hook)

    def register_full_backward_hook(self, hook: Callable[[Layer, Any, Any], Any]
                                    ) -> RemovableHandle:
        """Call ``hook(layer, grad_input, grad_output)`` after every :meth:`call_backward`.

        ``grad_input`` is the gradient with respect to the layer's input (what
        :meth:`backward` returned), ``grad_output`` the one it was given. A
        result other than None replaces ``grad_input``. Returns a handle
        whose ``remove()`` unregisters the hook.
        """
        return self._add_hook(self._backward_hooks, hook)

    @staticmethod
    def _add_hook(hooks: dict[int, Callable[..., Any]], hook: Callable[..., Any]
                  ) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"a hook must be callable, got {type(hook).__name__}")
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------ registration
    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register ``param`` as the parameter ``name`` (None: registered, but no state)."""
        _check_name(self, name, "parameter", self._parameters)
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"parameter {name!r} must be a Parameter or None, got "
                            f"{type(param).__name__}")
        self._parameters[name] = param
        setattr(self, name, param)

    def register_buffer(self, name: str, value: Any) -> None:
        """Register the array ``value`` (any array module, or None) as the buffer ``name``.

        Buffers are state that is not trained, such as batch-norm running
        statistics: they are in :meth:`state_dict` and move with :meth:`to`.
        Later assignments to the attribute ``name`` replace the buffer.
        """
        _check_name(self, name, "buffer", self._buffers)
        if value is not None and not hasattr(value, "shape"):
            raise TypeError(f"buffer {name!r} must be an array or None, got "
                            f"{type(value).__name__}")
        self._buffers[name] = value
        setattr(self, name, value)

    def add_module(self, name: str, module: Layer | None) -> None:
        """Register ``module`` as the sub-layer ``name`` (None: registered, but empty)."""
        _check_name(self, name, "sub-layer", self._modules)
        if module is not None and not isinstance(module, Layer):
            raise TypeError(f"sub-layer {name!r} must be a Layer or None, got "
                            f"{type(module).__name__}")
        self._modules[name] = module
        setattr(self, name, module)

    register_module = add_module

    # ------------------------------------------------------------ walking
    def named_children(self) -> Iterator[tuple[str, Layer]]:
        """(name, layer) of the direct sub-layers, in registration order, each once."""
        seen: set[int] = set()
        for name, child in self._modules.items():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                yield name, child

    def children(self) -> Iterator[Layer]:
        """Direct sub-layers."""
        for _, child in self.named_children():
            yield child

    def named_modules(self, memo: set[int] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Layer]]:
        """(dotted name, layer) of this layer (named ``prefix``) and all its sub-layers.

        Depth first, in registration order; a layer reachable twice is given
        once unless ``remove_duplicate`` is False.
        """
        memo = set() if memo is None else memo
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, child in self._modules.items():
            if child is not None:
                yield from child.named_modules(memo, _join(prefix, name), remove_duplicate)

    def modules(self) -> Iterator[Layer]:
        """This layer and all its sub-layers, depth first, each once."""
        for _, layer in self.named_modules():
            yield layer

    layers = modules

    def _named_members(self, registry: str, prefix: str, recurse: bool,
                       remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        seen: set[int] = set()
        modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) \
            if recurse else iter([(prefix, self)])
        for path, layer in modules:
            for name, value in getattr(layer, registry).items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield _join(path, name), value

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter) of every parameter, such as ``("3.branch.0.weight", p)``.

        A layer's own parameters come before its sub-layers', each layer in
        :meth:`named_modules` order; a shared parameter is given once (under
        its first name) unless ``remove_duplicate`` is False. With
        ``recurse=False`` only this layer's own parameters.
        """
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """The parameters of :meth:`named_parameters`, in the same fixed order."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def own_parameters(self) -> list[Parameter]:
        """Parameters of this layer itself (not its children)."""
        return list(self.parameters(recurse=False))

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
        """(dotted name, array) of every buffer, such as ``("1.running_mean", a)``."""
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Any]:
        """The arrays of :meth:`named_buffers`, in the same order."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    # ------------------------------------------------------------ state
    def _state_entries(self) -> Iterator[tuple[str, Layer, str, Any]]:
        """(key, owner, attribute, value) of every state_dict entry, in state_dict order."""
        for path, layer in self.named_modules(remove_duplicate=False):
            for registry in (layer._parameters, layer._buffers):
                for name, value in registry.items():
                    if value is not None:
                        yield _join(path, name), layer, name, value

    def state_dict(self, *, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """Every parameter's and buffer's array under its dotted name, in a fixed order.

        The keys are those of :meth:`named_parameters` and :meth:`named_buffers`
        (a layer's parameters, then its buffers, then its sub-layers'), and a
        shared parameter appears under each of its names, as in PyTorch. The
        values are the arrays themselves, not copies (``Parameter.data``, or
        the Parameter with ``keep_vars=True``); copy them to keep a snapshot.
        A sharded parameter (``Parameter.dist``) is given as its full array,
        gathered from its shards: the call is then collective, and the
        result loads under any other split.

        Parameters
        ----------
        prefix : str
            Put before every key (``prefix + key``).
        keep_vars : bool
            Give parameters as :class:`Parameter` objects instead of their data.

        Returns
        -------
        dict
            Ordered name -> array.
        """
        out: dict[str, Any] = {}
        for key, _, _, value in self._state_entries():
            if isinstance(value, Parameter) and not keep_vars:
                value = value.full()
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True
                        ) -> IncompatibleKeys:
        """Copy arrays (of any array module) into the parameters and buffers, in place.

        Every value is moved to its target's array module and device and cast
        to its dtype. Nothing is changed unless the whole ``state_dict`` is
        accepted: a missing or unexpected key (with ``strict``), a value that is
        not an array or one of another shape raise one ValueError that lists
        them all.

        Parameters
        ----------
        state_dict : mapping of str to array
            As :meth:`state_dict` returns (its values may be Parameters too):
            full arrays, also for sharded parameters, which keep their block
            of it (so a state saved under one split loads under another).
        strict : bool
            Require exactly this layer's keys. With False, missing keys are
            left unchanged and unexpected keys ignored (shapes are still
            checked).

        Returns
        -------
        IncompatibleKeys
            ``(missing_keys, unexpected_keys)``; both empty when ``strict``.

        Raises
        ------
        ValueError
            On a refused ``state_dict``; the layer is then unchanged.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        targets: dict[str, Any] = {}
        for key, _, _, value in self._state_entries():
            targets.setdefault(key, value)
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        problems = []
        if strict and missing:
            problems.append(f"missing keys {missing}")
        if strict and unexpected:
            problems.append(f"unexpected keys {unexpected}")
        for key, dst in targets.items():
            if key not in state_dict:
                continue
            src = state_dict[key]
            if not hasattr(src, "shape"):
                problems.append(f"{key!r} is a {type(src).__name__}, not an array")
            elif tuple(src.shape) != tuple(dst.shape):  # a Parameter's full shape
                problems.append(f"{key!r} has shape {tuple(src.shape)}, the layer's "
                                f"{tuple(dst.shape)}")
        if problems:
            raise ValueError(f"load_state_dict refused for {type(self).__name__} (nothing "
                             f"changed): " + "; ".join(problems))
        for key, dst in targets.items():
            if key in state_dict:
                src = state_dict[key]
                src = src.full() if isinstance(src, Parameter) else src
                if isinstance(dst, Parameter):
                    if dst.dist is not None:  # this rank's block of the full value
                        src = src[dst.dist.local_slices()]
                    if dst.sharded_weights and dst._data is None:  # this rank's piece of it
                        dst._finish_prefetch()
                        h = dst._held
                        src = reshape(as_module(src, array_namespace(dst.piece),
                                                device_of(dst.piece)), (-1,))[h.start:h.stop]
                        dst = dst.piece
                    else:
                        dst = dst.data
                _copy_into(dst, src)
        return IncompatibleKeys(missing if not strict else [],
                                unexpected if not strict else [])

    def to(self, xp: ModuleType, device: Any = None) -> Layer:
        """Move every parameter (data and gradient) and buffer to the array module ``xp``.

        Layers compute with their input's array module, and their parameters
        must live there too: call ``model.to(cupy)`` before feeding the model
        DistArrays whose blocks are CuPy arrays (``model.to(numpy)`` brings it
        back). Arrays already there are kept as they are. An optimiser's
        momentum buffers follow on its next step only if it has none yet, so
        move the model before creating the optimiser.

        Parameters
        ----------
        xp : module
            The target array module (``numpy``, ``cupy``, ``array_api_strict``...).
        device : optional
            The device of array API namespaces that have several (None: the
            module's default).

        Returns
        -------
        Layer
            This layer itself.
        """
        for p in self.parameters():
            if p.sharded_weights:
                p._finish_prefetch()
                p.piece = as_module(p.piece, xp, device)
                if p._data is not None:
                    p._data = as_module(p._data, xp, device)
            else:
                p.data = as_module(p.data, xp, device)
            p.grad = as_module(p.grad, xp, device)
            if p.unreduced is not None:
                p.unreduced = as_module(p.unreduced, xp, device)
        for layer in self.modules():
            for name, value in layer._buffers.items():
                if value is not None:
                    setattr(layer, name, as_module(value, xp, device))
        return self

    def zero_grad(self) -> None:
        """Zero every parameter's gradient."""
        for p in self.parameters():
            p.zero_grad()

    def train(self, mode: bool = True) -> Layer:
        """Training mode (batch statistics) or, with ``mode=False``, evaluation mode."""
        if not isinstance(mode, bool):
            raise TypeError(f"train(mode) takes a bool, got {type(mode).__name__}")
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
        element of the largest block, which is read and written once; the
        input is kept for backward; no communication. Layers that do other
        work or keep something else override it (see
        :mod:`disttensor_nn.costspec`).

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
        return CostSpec(block, flops=float(n), nbytes=2 * n * itemsize, keeps_input=True)

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
        and statistics, so timing never changes this layer's. The default is
        a shallow copy with copies of this layer's own parameters and buffers,
        and twins of its sub-layers.
        """
        twin = copy.copy(self)
        for name, child in self._modules.items():
            if child is not None:
                setattr(twin, name, child.local_twin())
        for name, p in self._parameters.items():
            if p is not None:
                setattr(twin, name, Parameter(contiguous(p.data, copy=True)))
        for name, b in self._buffers.items():
            if b is not None:
                setattr(twin, name, contiguous(b, copy=True))
        return twin
