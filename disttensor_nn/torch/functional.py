"""The library's data movements as autograd functions on this rank's block (a torch tensor).

Each function takes the tensor this rank holds and the
:class:`~disttensor.Distribution` (or the ranks) it belongs to, moves data
with the library's plans, and returns a tensor of the same module, dtype and
device; its backward pass is the movement's adjoint, so a distributed layer
written with them is differentiated by ``loss.backward()`` like any other
PyTorch code.

- :func:`halo_exchange`: block -> the block extended by its halo
  (``numpy.pad`` exact, every mode); backward: the halo accumulation
  (:func:`disttensor.halo_accumulate`).
- :func:`redistribute`: block of ``src`` -> block of ``dst``; backward: the
  redistribution ``dst -> src``.
- :func:`gather`: block -> the global tensor (on every rank, or on root);
  backward: this rank's block of the gradient (scattered from root).
- :func:`scatter`: the global tensor (on every rank, or on root) -> block;
  backward: the block gradients gathered (onto every rank, or onto root).
- :func:`all_reduce`: partial sums -> their sum, on every rank; backward:
  the gradient as it is.
- :func:`broadcast`: a tensor every rank holds alike (or root's) -> the
  same, for this rank's part of the computation; backward: the gradients
  summed over the ranks (onto every rank, or onto root).

**What a gradient is here.** A tensor that several ranks hold alike (a
replica: a block of a distribution with replica axes, the result of
:func:`gather` or :func:`all_reduce`) is *one* value, and its gradient is
one value that each of those ranks holds whole, as the layers of
:mod:`disttensor_nn` keep it (parameters are replicated, their gradients
complete). The adjoints are taken for the inner product of the global
arrays, each element counted once; redistribution's adjoint is therefore the
redistribution back (:meth:`~disttensor.redistribute.RedistributionPlan.adjoint`
is the adjoint for the inner product that counts every rank's copy, and sums
replicas). Two consequences for a layer author:

- A scalar that every rank computes alike from replicated values (a loss
  after :func:`all_reduce`) may be differentiated on every rank: its
  gradient is 1 on each, not the number of ranks.
- Where a replicated tensor enters a computation that each rank does on its
  own part (a parameter applied to this rank's block, a statistic used on
  this rank's samples), the contributions of the ranks must be summed: pass
  it through :func:`broadcast` there, whose backward sums the gradient over
  the ranks. ``broadcast(all_reduce(t, g), g)`` is an all-reduce whose
  backward all-reduces the gradient (the "sum over replicas" form), as
  batch statistics over a split batch need.

**Collective calls.** Every function is collective over the ranks of its
distribution or group, forward and backward, so every rank must make the
same calls in the same order, and their backward passes too: the inputs
must require gradients alike on every rank. Arguments are checked before any
message, alike on every rank (a wrong distribution, block shape or dtype
raises there); in check mode (:func:`disttensor.set_options`) the ranks
also compare every call's metadata, ``requires_grad`` included, and agree
on the outcome of the checks that only a rank can make (its block's shape)
before any of them raises (:class:`disttensor.settings.validating`).

Blocks may live on the CPU, where halo exchange and redistribution work on
the NumPy view of the tensor's memory without a copy, or on a GPU, where
they are staged through host memory by the library's transport (not yet
for the halo modes 'reflect' and 'symmetric', whose views have negative
steps, which PyTorch tensors cannot have).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from disttensor import DistArray, Distribution, ProcessGrid, halo_plan, redistribution_plan
from disttensor.backend import check_movable, contiguous, host_view, numpy_dtype
from disttensor.halo import HaloPlan, normalize_widths
from disttensor.redistribute import RedistributionPlan
from disttensor.settings import validating
from disttensor.transport import allreduce as transport_allreduce

__all__ = [
    "all_reduce",
    "broadcast",
    "extended_distribution",
    "gather",
    "halo_accumulate",
    "halo_exchange",
    "redistribute",
    "scatter",
]

Group = MPI.Intracomm | ProcessGrid


# ------------------------------------------------------------------ checks
def _check_dist(name: str, dist: Any, what: str = "dist") -> Distribution:
    if not isinstance(dist, Distribution):
        raise TypeError(f"{name}: {what} must be a Distribution, got {type(dist).__name__}")
    if dist.grid is None:
        raise ValueError(f"{name}: {what} must be built on a ProcessGrid, not a grid shape")
    return dist


def _check_tensor(name: str, t: Any, what: str = "block") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    try:
        check_movable(numpy_dtype(t.dtype))
    except TypeError as err:
        raise TypeError(f"{name}: {what} of dtype {t.dtype} cannot move between ranks "
                        f"({err})") from None


def _check_block(name: str, block: Any, dist: Distribution, what: str = "block") -> None:
    _check_tensor(name, block, what)
    if tuple(block.shape) != dist.local_shape():
        raise ValueError(
            f"{name}: the {what} has shape {tuple(block.shape)}, but this rank's block of "
            f"{dist} has shape {dist.local_shape()}"
        )


def _check_root(name: str, root: Any, size: int) -> int | None:
    if root is None:
        return None
    if isinstance(root, bool) or not isinstance(root, numbers.Integral):
        raise TypeError(f"{name}: root must be None or an int, got {root!r}")
    if not 0 <= root < size:
        raise ValueError(f"{name}: root must be a rank in [0, {size}), got {root}")
    return int(root)


def _state(t: Any, dtype: bool = True) -> dict[str, Any]:
    """What every rank's tensor must agree on: its dtype, and whether autograd tracks it
    (every rank must run the same backward passes)."""
    if not isinstance(t, torch.Tensor):
        return {"tensor": type(t).__name__}
    out = {"dtype": str(t.dtype)} if dtype else {}
    out["requires_grad"] = bool(t.requires_grad and torch.is_grad_enabled())
    return out


def _comm_of(dist: Any) -> MPI.Comm | None:
    grid = getattr(dist, "grid", None) if isinstance(dist, Distribution) else None
    return None if grid is None else grid.comm


def _group_comm(name: str, group: Any, axes: int | Sequence[int] | None) -> MPI.Intracomm:
    if isinstance(group, ProcessGrid):
        return group.comm if axes is None else group.subcomm(axes)
    if isinstance(group, MPI.Intracomm):
        if axes is not None:
            raise TypeError(f"{name}: axes= selects axes of a ProcessGrid, but group is a "
                            "communicator")
        return group
    raise TypeError(f"{name}: group must be an MPI.Intracomm or a ProcessGrid, "
                    f"got {type(group).__name__}")


def _wrap(t: torch.Tensor, dist: Distribution) -> DistArray:
    """``t`` (detached, contiguous: a copy only where it is not) as a DistArray's block."""
    return DistArray(contiguous(t), dist)


def _move(plan: RedistributionPlan, t: torch.Tensor) -> torch.Tensor:
    """``plan`` applied to this rank's block ``t``: a new contiguous tensor of its block of
    ``plan.dst``. A tensor in host memory moves as the NumPy views of its memory and of
    the new tensor's, the plan's NumPy path (a 16 x 32 x 32 gather between two ranks: 71
    against 84 us through DistArrays of tensors); others through DistArrays of their
    module."""
    block = contiguous(t.detach())
    src = host_view(block)
    if type(src) is np.ndarray:
        out = torch.empty(plan.dst.local_shape(), dtype=block.dtype, device=block.device)
        dst = host_view(out)
        if type(dst) is np.ndarray:
            plan(DistArray(src, plan.src), DistArray(dst, plan.dst))
            return out
    return plan(DistArray(block, plan.src)).local


def _root_distribution(dist: Distribution, root: int) -> Distribution:
    """``dist``'s global shape held whole by ``root`` (the others hold empty blocks)."""
    shape, grid = dist.global_shape, dist.grid
    if not shape:
        return Distribution((), grid, ())
    cuts = [0] * root + [shape[0]] * (grid.size - 1 - root)
    axes = (tuple(range(grid.ndim)),) + (None,) * (len(shape) - 1)
    return Distribution(shape, grid, axes, [cuts] + [None] * (len(shape) - 1))


# ------------------------------------------------------------------ autograd functions
class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, plan: HaloPlan,
                constant_values: Any) -> torch.Tensor:
        ctx.plan = plan
        return plan.exchange_block(block.detach(), constant_values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # a new contiguous block, as the gradient PyTorch's kernels give and expect
        # (strided, batch norm's backward and the element-wise ones run several times slower)
        return ctx.plan.accumulate_block(grad), None, None


class _HaloAccumulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, extended: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
        ctx.plan = plan
        return plan.accumulate_block(extended.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.plan.exchange_block(grad.detach(), 0), None  # constant cells: no gradient


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, block: torch.Tensor, plan: RedistributionPlan,
                back: RedistributionPlan) -> torch.Tensor:
        ctx.back = back
        return _move(plan, block)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _move(ctx.back, grad), None, None


class _ScatterFromRoot(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor | None, dist: Distribution,
                root: int) -> torch.Tensor:
        ctx.dist, ctx.root = dist, root
        ctx.like = None if t is None else (t.shape, t.dtype, t.device)
        mine = dist.grid.rank == root
        return DistArray.from_global(t.detach() if mine else None, dist, root=root).local

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        dist, root = ctx.dist, ctx.root
        whole = redistribution_plan(dist, _root_distribution(dist, root))(_wrap(grad, dist))
        if dist.grid.rank == root:
            return whole.local, None, None
        if ctx.like is None:
            return None, None, None
        shape, dtype, device = ctx.like
        return torch.zeros(shape, dtype=dtype, device=device), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, comm: MPI.Intracomm) -> torch.Tensor:
        return transport_allreduce(contiguous(t, copy=True), comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None  # the result is one replicated value: its gradient is whole here


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, comm: MPI.Intracomm,
                root: int | None) -> torch.Tensor:
        ctx.comm, ctx.root = comm, root
        if root is None:
            return t.view_as(t)
        return _from_root(t, comm, root)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        total = transport_allreduce(contiguous(grad, copy=True), ctx.comm)
        if ctx.root is not None and ctx.comm.Get_rank() != ctx.root:
            total = torch.zeros_like(total)
        return total, None, None


class _SplitExtreme(torch.autograd.Function):
    """The largest (or smallest) value over ``dims`` of a tensor whose blocks split some of
    them over ``comm``, NaN where any element is NaN (as in one process); its gradient,
    whole on every rank, shared evenly by the elements equal to it (``torch.amax``'s
    rule), or with ``first`` (max pooling's rule) given to the first of them in the row
    order of the global reduced dimensions (to the last NaN where the value is NaN),
    whose sizes are ``sizes`` and this block's first indices ``starts``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool,
                comm: MPI.Intracomm, largest: bool, first: bool,
                starts: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        boolean = x.dtype == torch.bool
        xs = x.to(torch.uint8) if boolean else x  # MPI compares no booleans
        floating = xs.dtype.is_floating_point
        kept = [1 if d in dims else n for d, n in enumerate(xs.shape)]
        info = torch.finfo(xs.dtype) if floating else torch.iinfo(xs.dtype)
        worst = (-math.inf if largest else math.inf) if floating else \
            (info.min if largest else info.max)
        if all(xs.shape[d] for d in dims):
            m = (xs.amax if largest else xs.amin)(dims, keepdim=True)
        else:  # an empty block: the identity of the comparison
            m = xs.new_full(kept, worst)
        if floating:  # NaN anywhere: NaN (MPI's MAX and MIN do not say how NaN compares)
            nan = torch.isnan(xs).any(dims, keepdim=True) if xs.numel() else \
                torch.zeros(kept, dtype=torch.bool, device=xs.device)
            m = torch.where(nan, torch.full_like(m, worst), m)
            flag = nan.to(m.dtype) if largest else -nan.to(m.dtype)  # one combine
            both = transport_allreduce(torch.cat([m.reshape(-1), flag.reshape(-1)]), comm,
                                       MPI.MAX if largest else MPI.MIN)
            m, nan = both[:m.numel()].reshape(kept), both[m.numel():].reshape(kept) != 0
            m = torch.where(nan, torch.full_like(m, math.nan), m)
        else:
            nan = None
            m = transport_allreduce(contiguous(m, copy=True), comm,
                                    MPI.MAX if largest else MPI.MIN)
        ctx.dims, ctx.keepdim = dims, keepdim
        if ctx.needs_input_grad[0]:  # alike on every rank: the graph is the same
            reach = xs == m if nan is None else torch.where(nan, torch.isnan(xs), xs == m)
            if first:  # the first of them, in the global row order, takes it all; of
                # NaNs, the last (PyTorch's pooling keeps the last NaN it meets): the least
                # negated index, so that one all-reduce finds either
                index = _global_flat_index(xs.shape, dims, starts, sizes, xs.device)
                none = math.prod(sizes)
                signed = index if nan is None else torch.where(nan, -index, index)
                mine = torch.where(reach, signed, torch.full_like(signed, none)).amin(
                    dims, keepdim=True) if xs.numel() else torch.full(
                    kept, none, dtype=torch.int64, device=xs.device)
                winner = transport_allreduce(contiguous(mine, copy=True), comm, MPI.MIN)
                if nan is not None:
                    winner = torch.where(nan, -winner, winner)
                reach = reach & (index == winner)
                count = None
            else:
                wide = torch.float64 if xs.dtype == torch.float64 else torch.float32
                count = transport_allreduce(
                    contiguous(reach.sum(dims, keepdim=True, dtype=wide), copy=True), comm)
            ctx.save_for_backward(reach, count)
        out = m.to(torch.bool) if boolean else m
        return out if keepdim else out.squeeze(dims)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reach, count = ctx.saved_tensors
        if not ctx.keepdim:
            for d in sorted(ctx.dims):
                grad = grad.unsqueeze(d)
        # the result is one replicated value: its gradient is whole on every rank
        share = grad if count is None else (grad / count).to(grad.dtype)
        return reach * share, None, None, None, None, None, None, None


def _global_flat_index(shape: Sequence[int], dims: Sequence[int], starts: Sequence[int],
                       sizes: Sequence[int], device: Any) -> torch.Tensor:
    """Each element's index in the row order of the global reduced dimensions ``dims``
    (of sizes ``sizes``; this block's first indices ``starts``), broadcast over the
    others."""
    index = torch.zeros([1] * len(shape), dtype=torch.int64, device=device)
    for d, start, size in zip(dims, starts, sizes):
        view = [1] * len(shape)
        view[d] = shape[d]
        index = index * size + (torch.arange(shape[d], device=device) + start).view(view)
    return index


def _split_extreme(x: torch.Tensor, dims: Sequence[int], keepdim: bool, comm: MPI.Intracomm,
                   largest: bool = True, first: bool = False,
                   starts: Sequence[int] = (), sizes: Sequence[int] = ()) -> torch.Tensor:
    """``torch.amax`` (``largest``) or ``torch.amin`` over ``dims`` of the global tensor whose
    blocks are ``x`` on the ranks of ``comm`` (those that split ``dims``); collective.

    The result is one value on every rank (NaN where any element is); its gradient,
    whole on every rank, is shared evenly by the elements equal to it, on whichever rank
    they lie, as PyTorch shares it among equal values; with ``first`` (a global max
    pooling, as PyTorch's pooling does) it goes to the first of them in the row order of
    the global reduced dimensions (to the last NaN where the value is NaN, as there),
    ``starts`` and ``sizes`` giving this block's place in them."""
    dims = tuple(sorted(int(d) for d in dims))
    return _SplitExtreme.apply(x, dims, bool(keepdim), comm, bool(largest), bool(first),
                               tuple(starts), tuple(sizes))


def _from_root(t: torch.Tensor, comm: MPI.Intracomm, root: int) -> torch.Tensor:
    """Root's ``t`` on every rank: a sum in which the other ranks add zeros (exact), so that
    it travels through the library's one allreduce, whatever the device."""
    work = contiguous(t, copy=True)
    boolean = work.dtype == torch.bool
    if boolean:  # MPI has no sum of booleans
        work = work.to(torch.uint8)
    if comm.Get_rank() != root:
        work.zero_()
    out = transport_allreduce(work, comm)
    return out.to(torch.bool) if boolean else out


# ------------------------------------------------------------------ public functions
def extended_distribution(dist: Distribution, widths: Any) -> Distribution:
    """The Distribution of the extended blocks of ``dist``, laid side by side.

    Block ``b`` of each dimension grows by the widths ``(lo, hi)``; the
    result's blocks are the blocks that :func:`halo_exchange` returns, on the
    same ranks, so ``gather(halo_exchange(x, dist, w), extended_distribution(dist, w))``
    is the global array of every rank's extended block. Pure metadata, no
    communication.

    Parameters
    ----------
    dist : Distribution
        The distribution of the blocks.
    widths : int, (int, int) or sequence of (int, int)
        The halo widths, as :func:`disttensor.halo.normalize_widths` reads them.

    Returns
    -------
    Distribution
        On ``dist``'s grid (or grid shape) with ``dist``'s axes; its
        dimension ``d`` has ``sum(n_b + lo + hi)`` elements over its blocks.
    """
    if not isinstance(dist, Distribution):
        raise TypeError(f"extended_distribution: dist must be a Distribution, "
                        f"got {type(dist).__name__}")
    widths = normalize_widths(widths, dist.ndim)
    shape, splits = [], []
    for bounds, (lo, hi) in zip(dist.boundaries, widths):
        sizes = [b - a + lo + hi for a, b in zip(bounds, bounds[1:])]
        shape.append(sum(sizes))
        splits.append(None if len(sizes) == 1 else list(itertools.accumulate(sizes))[:-1])
    return Distribution(shape, dist.grid_arg, dist.axes, splits)


def halo_exchange(block: torch.Tensor, dist: Distribution, widths: Any,
                  mode: str = "constant", constant_values: Any = 0) -> torch.Tensor:
    """This rank's block extended by ``widths``, filled as :func:`numpy.pad` fills the global array.

    The autograd form of :meth:`disttensor.DistArray.exchange_halo`; its
    backward pass adds every halo cell's gradient back into the cell it was
    copied from (:func:`disttensor.halo_accumulate`; constant cells get
    none). Collective over ``dist``'s grid.

    Parameters
    ----------
    block : torch.Tensor
        This rank's block, of shape ``dist.local_shape()``.
    dist : Distribution
        The distribution of the global array (on a ProcessGrid).
    widths : int, (int, int) or sequence of (int, int)
        Halo widths before and after the block per dimension, read like
        ``numpy.pad``'s ``pad_width``; they may exceed a neighbour's block.
    mode : {'constant', 'wrap', 'reflect', 'symmetric', 'edge'}
        Values beyond the global edges, with ``numpy.pad``'s meaning.
    constant_values : scalar or pairs
        Fill values for ``mode='constant'``, as ``numpy.pad`` takes them.

    Returns
    -------
    torch.Tensor
        A new tensor of shape ``local_shape[d] + lo + hi`` per dimension
        (block ``b`` of :func:`extended_distribution`), of the block's dtype
        and device.

    Raises
    ------
    TypeError, ValueError
        On every rank alike, before any message: a ``dist`` that is not a
        Distribution on a ProcessGrid, a dtype that cannot move, bad widths
        or mode; a block whose shape is not ``dist.local_shape()`` (checked
        on each rank).
    """
    name = "halo_exchange"
    arguments = {"dist": dist, "widths": widths, "mode": mode, **_state(block)}
    with validating(name, arguments, _comm_of(dist)):
        _check_dist(name, dist)
        plan = halo_plan(dist, widths, mode)  # widths and mode refused here
        _check_block(name, block, dist)
    return _HaloExchange.apply(block, plan, constant_values)


def _exchange_planned(block: torch.Tensor, plan: HaloPlan, constant_values: Any = 0
                      ) -> torch.Tensor:
    """:func:`halo_exchange` by a plan made (and its arguments checked) beforehand, the block
    unchecked: for steps compiled once and run many times (``parallelize``'s)."""
    return _HaloExchange.apply(block, plan, constant_values)


def halo_accumulate(extended: torch.Tensor, dist: Distribution, widths: Any,
                    mode: str = "constant") -> torch.Tensor:
    """This rank's block of the sums of every rank's extended block: the adjoint of
    :func:`halo_exchange`.

    Each cell of ``extended`` (this rank's block grown by ``widths``) is
    added into the cell of the global array that :func:`halo_exchange`
    copies into it (its owner's block, or as ``mode`` maps a cell beyond the
    global edges; those of ``'constant'`` are dropped). A layer that
    scatters into a window reaching past its block (a transposed
    convolution, an unpooling) writes into its extended block and hands the
    margins to their owners with it. Its backward pass is
    :func:`halo_exchange` of the gradient (zeros in constant cells).
    Collective over ``dist``'s grid.

    Parameters
    ----------
    extended : torch.Tensor
        This rank's extended block, of shape ``local_shape[d] + lo + hi``
        per dimension (block ``b`` of :func:`extended_distribution`).
    dist : Distribution
        The distribution of the global array (on a ProcessGrid).
    widths : int, (int, int) or sequence of (int, int)
        The halo widths, as :func:`halo_exchange` takes them.
    mode : {'constant', 'wrap', 'reflect', 'symmetric', 'edge'}
        Where cells beyond the global edges belong, as for :func:`halo_exchange`.

    Returns
    -------
    torch.Tensor
        A new tensor of shape ``dist.local_shape()``, of ``extended``'s
        dtype and device.

    Raises
    ------
    TypeError, ValueError
        On every rank alike, before any message: a ``dist`` that is not a
        Distribution on a ProcessGrid, a dtype that cannot move, bad widths
        or mode; an ``extended`` whose shape is not this rank's extended
        block's (checked on each rank).
    """
    name = "halo_accumulate"
    arguments = {"dist": dist, "widths": widths, "mode": mode, **_state(extended)}
    with validating(name, arguments, _comm_of(dist)):
        _check_dist(name, dist)
        plan = halo_plan(dist, widths, mode)  # widths and mode refused here
        _check_tensor(name, extended, "extended")
        want = tuple(n + lo + hi for n, (lo, hi) in
                     zip(dist.local_shape(), normalize_widths(widths, dist.ndim)))
        if tuple(extended.shape) != want:
            raise ValueError(f"{name}: extended has shape {tuple(extended.shape)}; this "
                             f"rank's extended block is {want}")
    return _HaloAccumulate.apply(extended, plan)


def redistribute(block: torch.Tensor, src: Distribution, dst: Distribution) -> torch.Tensor:
    """This rank's block of ``src`` moved to its block of ``dst`` (same global shape).

    The autograd form of :meth:`disttensor.DistArray.redistribute`: one
    collective forward, and the redistribution back (``dst -> src``)
    backward. Where ``dst`` holds replicas, their gradient is taken to be the
    same on each (see the module's notes on replicas).

    Parameters
    ----------
    block : torch.Tensor
        This rank's block of ``src``, of shape ``src.local_shape()``.
    src, dst : Distribution
        Source and target distributions, on grids of one communicator.

    Returns
    -------
    torch.Tensor
        This rank's block of ``dst``, a new tensor.

    Raises
    ------
    TypeError, ValueError
        On every rank alike, before any message, for distributions data
        cannot move between (:func:`disttensor.redistribute.check_compatible`),
        a dtype that cannot move, or a block of the wrong shape.
    """
    name = "redistribute"
    with validating(name, {"src": src, "dst": dst, **_state(block)}, _comm_of(src)):
        _check_dist(name, src, "src")
        _check_dist(name, dst, "dst")
        plan = redistribution_plan(src, dst)  # refuses incompatible distributions
        back = redistribution_plan(dst, src)
        _check_block(name, block, src)
    return _Redistribute.apply(block, plan, back)


def gather(block: torch.Tensor, dist: Distribution, root: int | None = None) -> torch.Tensor:
    """The global tensor, from every rank's block.

    Backward: this rank's block of the gradient (with ``root``, the root's
    gradient scattered to the blocks; without, a slice of the gradient,
    which every rank holds whole: no message).

    Parameters
    ----------
    block : torch.Tensor
        This rank's block of ``dist``.
    dist : Distribution
        The distribution of the global array.
    root : int, optional
        The rank that gets the global tensor; the others get an empty tensor
        of shape ``(0, *shape[1:])``. By default every rank gets it.

    Returns
    -------
    torch.Tensor
        Of shape ``dist.global_shape`` (on every rank, or on ``root``).

    Raises
    ------
    TypeError, ValueError
        As :func:`redistribute`, and for a root that is not a rank of the grid.
    """
    name = "gather"
    with validating(name, {"dist": dist, "root": root, **_state(block)}, _comm_of(dist)):
        _check_dist(name, dist)
        root = _check_root(name, root, dist.grid.size)
        target = dist.replicated() if root is None else _root_distribution(dist, root)
        plan, back = redistribution_plan(dist, target), redistribution_plan(target, dist)
        _check_block(name, block, dist)
    return _Redistribute.apply(block, plan, back)


def scatter(tensor: torch.Tensor | None, dist: Distribution,
            root: int | None = None) -> torch.Tensor:
    """This rank's block of a global tensor that every rank holds, or that ``root`` holds.

    Backward: the block gradients gathered, onto every rank (without
    ``root``: the global tensor was one replicated value, so each rank gets
    its whole gradient) or onto ``root`` (the other ranks' inputs get zeros).

    Parameters
    ----------
    tensor : torch.Tensor or None
        The global tensor, of shape ``dist.global_shape``: the same on every
        rank, or, with ``root``, read on that rank only (the others may pass
        None, or a tensor that requires gradients exactly when root's does,
        so that every rank runs the backward pass).
    dist : Distribution
        The target distribution.
    root : int, optional
        The rank that holds the data. Its tensor's shape, dtype and device
        decide the blocks, and a wrong shape raises on every rank (after a
        small broadcast).

    Returns
    -------
    torch.Tensor
        This rank's block of ``dist``, a new tensor.

    Raises
    ------
    TypeError, ValueError
        For a bad ``dist`` or root, a tensor that is not a torch.Tensor, of
        a dtype that cannot move, or not of the global shape.
    """
    name = "scatter"
    # with a root, the others' tensors are not read: only whether they require grad counts
    arguments = {"dist": dist, "root": root, **_state(tensor, dtype=root is None)}
    if root is not None and tensor is None:
        arguments["requires_grad"] = False
    with validating(name, arguments, _comm_of(dist)):
        _check_dist(name, dist)
        root = _check_root(name, root, dist.grid.size)
        if root is None:
            _check_block(name, tensor, dist.replicated(), "global tensor")
        elif dist.grid.rank == root:
            _check_tensor(name, tensor, "global tensor")
        elif tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: tensor must be a torch.Tensor or None, "
                            f"got {type(tensor).__name__}")
    if root is None:
        src = dist.replicated()
        return _Redistribute.apply(tensor, redistribution_plan(src, dist),
                                   redistribution_plan(dist, src))
    return _ScatterFromRoot.apply(tensor, dist, root)


def all_reduce(t: torch.Tensor, group: Group, *,
               axes: int | Sequence[int] | None = None) -> torch.Tensor:
    """The sum of every rank's ``t`` over ``group``, on each of its ranks.

    The result is one value that every rank of the group holds (a loss, the
    sum of partial products over split channels), so its gradient is the
    same on every rank, and the backward pass passes it on unchanged: each
    rank's ``t`` contributed to the sum with weight one. Where each rank
    then uses the result in its own part of a computation, follow it by
    :func:`broadcast`, whose backward sums those parts.

    Parameters
    ----------
    t : torch.Tensor
        This rank's contribution; the same shape and dtype on every rank.
    group : MPI.Intracomm or ProcessGrid
        The ranks that sum.
    axes : int or sequence of int, optional
        With a ProcessGrid: sum only over the ranks that differ along these
        grid axes (:meth:`disttensor.ProcessGrid.subcomm`).

    Returns
    -------
    torch.Tensor
        A new tensor, of ``t``'s shape, dtype and device.
    """
    name = "all_reduce"
    comm = _group_comm(name, group, axes)
    shape = tuple(getattr(t, "shape", ()))
    with validating(name, {"shape": shape, **_state(t)}, comm):
        _check_tensor(name, t, "t")
    return _AllReduce.apply(t, comm)


def broadcast(t: torch.Tensor, group: Group, *, axes: int | Sequence[int] | None = None,
              root: int | None = None) -> torch.Tensor:
    """A tensor the ranks of ``group`` hold alike, for use in each rank's own computation.

    Without ``root``, ``t`` is already the same on every rank (a replicated
    parameter) and is returned as it is; with ``root``, root's ``t`` is sent
    to every rank (the others pass a tensor of the same shape and dtype,
    whose values are not read). The backward pass sums the gradients of the
    ranks (each rank's is its own part's contribution) and gives the sum to
    every rank (without ``root``: a replicated parameter's gradient is then
    complete and the same everywhere) or to root (the others get zeros).
    The adjoint of :func:`all_reduce`.

    Parameters
    ----------
    t : torch.Tensor
        The tensor; the same shape and dtype on every rank.
    group : MPI.Intracomm or ProcessGrid
        The ranks that share it.
    axes : int or sequence of int, optional
        With a ProcessGrid: only the ranks that differ along these grid axes.
    root : int, optional
        A rank of the group (its rank in ``group``'s communicator).

    Returns
    -------
    torch.Tensor
        ``t`` (a view of it), or root's values in a new tensor.
    """
    name = "broadcast"
    comm = _group_comm(name, group, axes)
    shape = tuple(getattr(t, "shape", ()))
    with validating(name, {"shape": shape, "root": root, **_state(t)}, comm):
        root = _check_root(name, root, comm.Get_size())
        _check_tensor(name, t, "t")
    return _Broadcast.apply(t, comm, root)
