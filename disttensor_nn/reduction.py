"""Gradient reductions over ranks: summing the layers' local parameter gradients
(:func:`reduce_gradients_`: blocking, bucketed and overlapped in
:class:`GradientBuckets`, reduce-scattered for sharded optimizer state, or kept back
under :class:`no_sync`), and the communicators and allreduce they use
(:func:`split_axes_comm`, ``allreduce_``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from disttensor import Distribution, backend
from disttensor.backend import astype, concat, contiguous, numpy_dtype, reshape
from disttensor.transport import AllreduceRequest, iallreduce
from disttensor.transport import allreduce as transport_allreduce

from .checks import check_int
from .parameter import Parameter
from .shards import reduce_scatter_, shard_range

__all__ = ["GradientBuckets", "no_sync", "reduce_gradients_", "split_axes_comm"]


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
                      comm: MPI.Intracomm, *, owned: bool = False) -> None:
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

    With ``owned`` the gradient arrays are the caller's to give away (a
    kernel's fresh output that nothing else refers to): where one is the
    first gradient of its parameter in this step and is summed in its own
    memory (over one rank, or alone in place), it becomes the parameter's
    ``grad`` instead of being copied into it (:meth:`Parameter.add_grad_`).
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
        _active_buckets[-1].add(grads, comm, owned=owned)
        return
    if comm.Get_size() == 1:  # the sum over one rank is this rank's part: nothing to copy
        _add(grads, owned)
        return
    large, small = _split_large(grads, DEFAULT_BUCKET_BYTES)
    for p, g in large:  # reduced in place: no copy into a fused buffer
        p.add_grad_(allreduce_(g, comm), owned=owned)
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


def _add(grads: Sequence[tuple[Parameter, Any]], owned: bool = False) -> None:
    """``p.grad +=`` each local gradient (its sum over one rank)."""
    for p, g in grads:
        p.add_grad_(g, owned=owned)


def _concatenate(arrays: Sequence[Any]) -> Any:
    return concat([reshape(a, (-1,)) for a in arrays])


def _unpack(grads: Sequence[tuple[Parameter, Any]], flat: Any) -> None:
    """``p.grad += `` each parameter's slice of the reduced ``flat``."""
    offset = 0
    for p, g in grads:
        p.add_grad_(flat[offset:offset + g.size])
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
        self._started: list[tuple[AllreduceRequest, list, bool]] = []
        # summed over one rank: added at wait (with whether the caller gave the array away)
        self._one_rank: list[tuple[Parameter, Any, bool]] = []

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
            self._one_rank.clear()
            started, self._started = self._started, []
            for request, *_ in started:
                request.wait()

    def add(self, grads: Sequence[tuple[Parameter, Any]], comm: MPI.Intracomm, *,
            owned: bool = False) -> None:
        """Add local gradients to the bucket of ``comm`` and their dtype (see the class).

        A gradient of ``bucket_bytes`` or more is reduced alone, in place (no
        copy into a bucket), at once. Over one rank the sum is the gradient
        itself: it is kept as it is and added at :meth:`wait`. ``owned`` as
        :func:`reduce_gradients_` takes it.
        """
        if comm.Get_size() == 1:
            self._one_rank.extend((p, g, owned) for p, g in grads)
            return
        large, grads = _split_large(grads, self.bucket_bytes)
        for p, g in large:
            self._started.append((iallreduce(reshape(g, (-1,)), comm), [(p, g)], owned))
        for p, g in grads:
            key = (comm.py2f(), numpy_dtype(g.dtype).str)
            _, entries, nbytes = self._open.get(key, (comm, [], 0))
            self._open[key] = (comm, entries, nbytes + backend.nbytes(g))
            entries.append((p, g))
        for key in [k for k, (_, _, nbytes) in self._open.items()
                    if nbytes >= self.bucket_bytes]:
            self._start(key)
        for request, *_ in self._started:
            request.test()

    def _start(self, key: tuple[int, str]) -> None:
        comm, entries, _ = self._open.pop(key)
        self._started.append((iallreduce(_concatenate([g for _, g in entries]), comm),
                              entries, False))

    def wait(self) -> None:
        """Start the open buckets, wait for every reduction and add the sums to the grads."""
        for key in list(self._open):
            self._start(key)
        started, self._started = self._started, []
        for request, entries, owned in started:
            flat = request.wait()
            if owned:  # one gradient, summed in its own memory
                (p, g), = entries
                p.add_grad_(reshape(flat, g.shape), owned=True)
            else:
                _unpack(entries, flat)
        local, self._one_rank = self._one_rank, []
        for p, g, owned in local:
            p.add_grad_(g, owned=owned)
