"""Transports: turn local arrays of any array module into MPI message buffers and back.

A :class:`Transport` serves one array module and one way of moving its
memory. NumPy arrays, and device arrays when the MPI library reads device
memory (:func:`disttensor.gpu_aware_mpi`), are *direct*: MPI gets the array
itself, after the device stream is synchronised; strided views are first
packed into a contiguous scratch array of the same module (a copy kernel on
a GPU). Otherwise messages are *staged* through host buffers (page-locked for
CuPy) with an explicit device-to-host copy before sending and host-to-device
after receiving. Arrays of other modules that live in host memory (PyTorch's
CPU tensors: :func:`~disttensor.backend.host_view`) travel as NumPy views of
their memory, through NumPy's transport (:func:`transport_for_arrays`). With
NCCL enabled (:func:`disttensor.nccl_enabled`), GPU point-to-point messages
and sum allreduces go through NCCL on the current stream instead of MPI.

Halo exchange, redistribution and the reductions' allreduce all use this one
mechanism, so they need no knowledge of where an array lives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI

from .backend import (
    array_namespace,
    contiguous,
    copy_from_host,
    copy_to_host,
    copy_view,
    data_address,
    device_of,
    empty,
    from_numpy,
    host_empty,
    host_view,
    is_c_contiguous,
    is_cupy,
    is_numpy,
    mpi_buffer,
    nbytes,
    numpy_dtype,
    reduces_in_mpi,
    synchronize,
    to_numpy,
)
from .device import gpu_aware_mpi, nccl_enabled
from .nccl import allreduce_sum, exchange, supports
from .settings import get_options

__all__ = ["Transport", "AllreduceRequest", "allreduce", "iallreduce", "transport_for",
           "transport_for_arrays"]

_POOL_KEYS = 512  # distinct (shape, dtype, place) scratch shapes kept per transport
_POOL_DEPTH = 8  # buffers kept per shape
# and at most get_options()["buffer_pool_bytes"] bytes in all

Message = tuple[Any, int, int]  # (buffer, peer rank, tag)


class Transport:
    """How the arrays of one module travel through MPI (see the module docstring).

    Obtain one with :func:`transport_for`; its scratch and staging buffers
    are pooled up to a cap (the option ``buffer_pool_bytes`` of
    :func:`~disttensor.set_options`), so steady-state exchanges whose buffers
    fit it allocate nothing, and larger ones hold their buffers only while
    they run.

    Parameters
    ----------
    xp : module
        The array module (numpy, cupy, or another array API namespace).
    direct : bool
        Whether MPI reads and writes the module's memory itself.
    nccl : bool
        Whether point-to-point messages and sum allreduces use NCCL (CuPy only).
    """

    def __init__(self, xp: ModuleType, direct: bool, nccl: bool = False):
        self.xp, self.direct, self.nccl = xp, direct, nccl
        self._device = not is_numpy(xp)
        # point-to-point buffers stay in the module's memory for MPI that reads it, and for NCCL
        self._p2p_direct = direct or nccl
        self._pool: OrderedDict[tuple, list[Any]] = OrderedDict()
        self.pooled = 0
        """Bytes of the buffers kept for reuse now."""

    def __repr__(self) -> str:
        how = "direct" if self.direct else "staged"
        return f"Transport({self.xp.__name__}, {how}{', nccl' if self.nccl else ''})"

    # ------------------------------------------------------------- buffers
    def _take(self, shape: tuple[int, ...], dtype: Any, like: Any | None) -> Any:
        """A pooled buffer: of the module next to ``like``, or on the host when None."""
        if not self._device:  # NumPy: every buffer is a host array
            key = (shape, dtype)
            pool = self._pool.get(key)
            if pool:
                return self._reuse(pool)
            return empty(np, shape, dtype)
        dt = numpy_dtype(dtype)
        place = None if like is None else device_of(like)
        key = (tuple(shape), dt.str, like is None, repr(place))
        pool = self._pool.get(key)
        if pool:
            return self._reuse(pool)
        if like is None:
            return host_empty(tuple(shape), dt, self.xp)
        return empty(self.xp, tuple(shape), dt, place)

    def release(self, buf: Any) -> None:
        """Give a buffer from :meth:`outgoing`/:meth:`incoming`/... back to the pool."""
        if not self._device:
            key = (buf.shape, buf.dtype)
        else:
            host = isinstance(buf, np.ndarray)
            place = None if host else device_of(buf)
            key = (tuple(buf.shape), numpy_dtype(buf.dtype).str, host, repr(place))
        size = nbytes(buf)
        cap = get_options()["buffer_pool_bytes"]
        if size > cap:  # freed now: the pool would have to drop everything else for it
            return
        pool = self._pool.setdefault(key, [])
        self._pool.move_to_end(key)
        if len(pool) < _POOL_DEPTH:
            pool.append(buf)
            self.pooled += size
        while len(self._pool) > _POOL_KEYS or self.pooled > cap:  # least recently used out
            _, old = self._pool.popitem(last=False)
            self.pooled -= sum(nbytes(b) for b in old)

    def _reuse(self, pool: list[Any]) -> Any:
        buf = pool.pop()
        self.pooled -= nbytes(buf)
        return buf

    def ready(self) -> None:
        """Synchronise the device before MPI touches device memory (no-op on the host).

        :meth:`post` and :meth:`allreduce` do it themselves; call it before
        handing buffers from :meth:`region_to_send` to MPI.
        """
        if self.direct and self._device:
            synchronize(self.xp)

    # ------------------------------------------------------------- point to point
    def outgoing(self, view: Any) -> Any:
        """A message buffer holding the values of ``view`` (the view itself when possible).

        A buffer that is not ``view`` goes back with :meth:`release` once sent.
        """
        if self._p2p_direct:
            if is_c_contiguous(view):
                return view
            buf = self._take(view.shape, view.dtype, view)
            copy_view(buf, view)  # one strided copy (a kernel on a GPU)
            return buf
        return copy_to_host(view, self._take(view.shape, view.dtype, None))

    def incoming(self, view: Any) -> Any:
        """A message buffer to receive the values of ``view`` into (``view`` when possible).

        Complete it with :meth:`deliver` after the message has arrived.
        """
        if self._p2p_direct and is_c_contiguous(view):
            return view
        return self.receive_buffer(view)

    def receive_buffer(self, like: Any) -> Any:
        """A message buffer shaped like ``like``, not aliasing it (read it with :meth:`array`)."""
        return self._take(like.shape, like.dtype, like if self._p2p_direct else None)

    def deliver(self, view: Any, buf: Any) -> None:
        """Write a received buffer into ``view`` and release it (nothing when it is ``view``)."""
        if buf is view:
            return
        if self._p2p_direct:
            copy_view(view, buf)
        else:
            copy_from_host(view, buf)
        self.release(buf)

    def array(self, buf: Any, like: Any) -> Any:
        """The received ``buf`` as an array of the module, next to ``like`` (may be ``buf``)."""
        return buf if self._p2p_direct else from_numpy(buf, like)

    def post(self, comm: MPI.Intracomm, recvs: Sequence[Message],
             sends: Sequence[Message]) -> list[MPI.Request]:
        """Start receiving and sending message buffers; returns the requests to wait for.

        Collective over ``comm`` when NCCL is in use (every rank calls it, with
        or without messages); NCCL messages are queued on the current stream
        and leave no request, and between two ranks they match in posting
        order (tags are ignored). Before MPI gets device buffers the stream is
        synchronised; NCCL runs on the stream that filled them and needs no wait.
        """
        if self.nccl:
            exchange(comm, [(b, p) for b, p, _ in recvs], [(b, p) for b, p, _ in sends])
            return []
        if self._p2p_direct and self._device and (recvs or sends):
            synchronize(self.xp)
        reqs = [comm.Irecv(mpi_buffer(b), p, t) for b, p, t in recvs]
        reqs += [comm.Isend(mpi_buffer(b), p, t) for b, p, t in sends]
        return reqs

    # ------------------------------------------------------------- whole blocks
    def region_to_send(self, buffer: Any, local: Any) -> tuple[Any, Any]:
        """``(base, block)``: memory MPI reads ``local`` from, and the block inside it.

        ``local`` is a view into ``buffer``. Direct, with a C-contiguous
        ``buffer``: the pair itself (derived datatypes select the pieces).
        Staged, or a ``buffer`` that is not C-contiguous (a transposed or
        permuted block, which MPI cannot take as one buffer): a contiguous copy
        of the block, which is both (release it after the transfer).
        """
        if self.direct and is_c_contiguous(buffer):
            return buffer, local
        copy = self._take(local.shape, local.dtype, local if self.direct else None)
        if self.direct:
            copy_view(copy, local)
            return copy, copy
        copy = copy_to_host(local, copy)
        return copy, copy

    def region_to_receive(self, buffer: Any, local: Any) -> tuple[Any, Any]:
        """Like :meth:`region_to_send` for receiving (a staged or non-contiguous block gets a
        contiguous buffer); finish with :meth:`deliver_region`."""
        if self.direct and is_c_contiguous(buffer):
            return buffer, local
        copy = self._take(local.shape, local.dtype, local if self.direct else None)
        return copy, copy

    def region_empty(self, like: Any, shape: tuple[int, ...]) -> Any:
        """A contiguous buffer of ``shape`` for MPI collectives, with ``like``'s dtype.

        In the module's memory when direct, on the host when staged; read it
        with :meth:`region_array` and release it afterwards.
        """
        return self._take(shape, like.dtype, like if self.direct else None)

    def region_array(self, buf: Any, like: Any) -> Any:
        """The contents of a :meth:`region_empty` buffer as an array next to ``like``."""
        return buf if self.direct else from_numpy(buf, like)

    def deliver_region(self, local: Any, base: Any) -> None:
        """Copy a region from :meth:`region_to_receive` into ``local`` and release it, where
        it is a buffer of its own (nothing where MPI wrote ``local``'s memory)."""
        if self.direct:
            if not _inside(local, base):  # a contiguous copy of a strided block
                copy_view(local, base)
                self.release(base)
            return
        copy_from_host(local, base)
        self.release(base)

    # ------------------------------------------------------------- collectives
    def allreduce(self, a: Any, comm: MPI.Intracomm, op: MPI.Op = MPI.SUM) -> Any:
        """``a`` combined with ``op`` over ``comm``; ``a``'s memory may be reused for it.

        Returns the result, an array of the module next to ``a`` (``a`` itself
        where it could be reduced in place).
        """
        if comm.Get_size() == 1 or a.size == 0:
            return a
        if not reduces_in_mpi(a.dtype):  # bfloat16: combined in float32, rounded back once
            wide = np.asarray(to_numpy(a), dtype=np.float32)
            comm.Allreduce(MPI.IN_PLACE, wide, op=op)
            if isinstance(a, np.ndarray) and a.flags.writeable:
                a[...] = wide
                return a
            return from_numpy(wide.astype(numpy_dtype(a.dtype)), a)
        if self.nccl and op == MPI.SUM:
            if supports(a.dtype):
                buf = contiguous(a, writeable=True)
                allreduce_sum(buf, comm)
                return buf
        # user-defined operations run on the host: MPI calls them with host pointers
        if self.direct and (not self._device or op.is_predefined):
            buf = contiguous(a, writeable=True)
            self.ready()
            comm.Allreduce(MPI.IN_PLACE, buf, op=op)
            return buf
        host = copy_to_host(a, self._take(a.shape, a.dtype, None))
        comm.Allreduce(MPI.IN_PLACE, host, op=op)
        out = from_numpy(host, a)
        self.release(host)
        return out


_NUMPY = Transport(np, direct=True)
_transports: dict[tuple, Transport] = {}


def transport_for(xp: ModuleType) -> Transport:
    """The transport of the array module ``xp`` under the current options.

    NumPy: always direct. CuPy: direct when :func:`disttensor.gpu_aware_mpi`,
    else staged through page-locked memory; NCCL when
    :func:`disttensor.nccl_enabled`. Other array API namespaces (whose
    arrays expose no buffer to MPI): staged through host memory.
    """
    if is_numpy(xp):
        return _NUMPY
    cupy = is_cupy(xp)
    key = (xp.__name__, cupy and gpu_aware_mpi(), cupy and nccl_enabled())
    t = _transports.get(key)
    if t is None:
        t = _transports[key] = Transport(xp, direct=key[1], nccl=key[2])
    return t


def _inside(view: Any, base: Any) -> bool:
    """Whether ``view``'s first element lies in ``base``'s memory (a view into it)."""
    if view.size == 0:  # nothing to copy either way
        return True
    start = data_address(base)
    return start <= data_address(view) < start + nbytes(base)


def transport_for_arrays(xp: ModuleType, *arrays: Any) -> tuple[Transport, tuple[Any, ...]]:
    """The transport that moves ``arrays`` (of the module ``xp``), and the arrays it works on.

    Where every array lives in host memory that NumPy can address (NumPy
    arrays; PyTorch's CPU tensors, see :func:`disttensor.backend.host_view`)
    the arrays are worked on as NumPy views of that memory, through NumPy's
    direct transport: nothing is copied or staged, and writes to the views
    are writes to the arrays. Otherwise the arrays themselves, through
    :func:`transport_for` of ``xp``.

    Parameters
    ----------
    xp : module
        The module of the arrays.
    *arrays : array
        Arrays of ``xp`` (a buffer and views into it, say).

    Returns
    -------
    (Transport, tuple of arrays)
        The transport, and the views (or the arrays), in the order given.
    """
    if is_numpy(xp):
        return _NUMPY, arrays
    views = tuple(host_view(a) for a in arrays)
    if all(v is not None for v in views):
        return _NUMPY, views
    return transport_for(xp), arrays


def allreduce(a: Any, comm: MPI.Intracomm, op: MPI.Op = MPI.SUM, *,
              in_place: bool = False) -> Any:
    """``a`` combined with ``op`` over ``comm`` through its module's transport.

    The one allreduce helper of the project: reductions, gradient sums and
    layers use it, whatever module and device ``a`` lives on (device memory,
    host staging, or NCCL for sums of GPU arrays). Collective over ``comm``;
    nothing moves on one rank or for an empty ``a``.

    Parameters
    ----------
    a : array
        This rank's contribution.
    comm : MPI.Intracomm
        The ranks to combine over.
    op : MPI.Op
        The operation (``MPI.SUM`` by default).
    in_place : bool
        Write the result into ``a`` (which must be writeable) and return ``a``.

    Returns
    -------
    array
        The result, an array of ``a``'s module and device. Without
        ``in_place``, ``a`` itself may be overwritten with it (and is
        returned) when it is contiguous and writeable.
    """
    t, (work,) = transport_for_arrays(array_namespace(a), a)
    out = t.allreduce(work, comm, op)
    if work is not a:  # a host view of ``a``: reduced in it, or in a NumPy copy of it
        out = a if out is work else from_numpy(out, a)
    if in_place and out is not a:
        a[...] = out
        return a
    return out


class AllreduceRequest:
    """A started :func:`iallreduce`: :meth:`test` whether it is done, :meth:`wait` for it."""

    def __init__(self, result: Any, request: MPI.Request | None = None):
        self._result, self._request = result, request

    def test(self) -> bool:
        """Whether the reduction has completed (drives MPI's progress)."""
        if self._request is None:
            return True
        if self._request.Test():
            self._request = None
        return self._request is None

    def wait(self) -> Any:
        """Wait for the reduction; returns its result (the array given to :func:`iallreduce`
        where it was reduced in place)."""
        if self._request is not None:
            self._request.Wait()
            self._request = None
        return self._result


def iallreduce(a: Any, comm: MPI.Intracomm, op: MPI.Op = MPI.SUM) -> AllreduceRequest:
    """Start combining ``a`` with ``op`` over ``comm``; ``a`` must not be touched until
    :meth:`AllreduceRequest.wait` returns the result.

    Contiguous NumPy arrays (and host arrays of other modules, through their
    NumPy views) are reduced in place by a non-blocking
    ``MPI_Iallreduce``; arrays of other modules, and bfloat16 arrays (which
    MPI cannot combine: they are combined in float32), through :func:`allreduce`
    before this returns (the request is then already complete). Collective
    over ``comm``, started in the same order on every rank.
    """
    _, (work,) = transport_for_arrays(array_namespace(a), a)
    if isinstance(work, np.ndarray) and comm.Get_size() > 1 and work.size \
            and work.flags.c_contiguous and work.flags.writeable \
            and reduces_in_mpi(work.dtype):
        return AllreduceRequest(a, comm.Iallreduce(MPI.IN_PLACE, work, op=op))
    return AllreduceRequest(allreduce(a, comm, op))
