"""The autograd primitives of ``disttensor_nn.torch``: forward against NumPy, backward against
finite differences (``torch.autograd.gradcheck`` in float64) and the adjoint identity.

Every function under test is made a function of one global tensor that every rank holds
alike: it is scattered to the blocks, moved, and gathered back onto every rank, so every
rank's gradcheck perturbs the same element, calls the same collectives the same number of
times and sees the same output. The reference for each forward is NumPy on the global
array (``numpy.pad`` for halos); gradcheck's finite differences check the backward, and
``<A x, y> == <x, A* y>`` checks it against the NumPy forward.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert, collective_outcome

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402, N812  (after the skip)
from torch.autograd.gradcheck import GradcheckError  # noqa: E402

from disttensor_nn.reduction import split_axes_comm  # noqa: E402
from disttensor_nn.torch import (  # noqa: E402
    all_reduce,
    broadcast,
    extended_distribution,
    gather,
    halo_accumulate,
    halo_exchange,
    redistribute,
    scatter,
)
from disttensor_nn.torch import norm as norm_module  # noqa: E402
from disttensor_nn.torch.norm import split_batch_norm  # noqa: E402

SIZES = [1, 2, 3, 4]
MODES = ("constant", "wrap", "reflect", "symmetric", "edge")
comm = MPI.COMM_WORLD
SHAPE = (2, 1, 4, 3)  # (N, C, H, W)
WIDTHS = ((1, 0), (0, 0), (2, 1), (1, 2))  # wider than a block at 3 and 4 ranks
torch.set_num_threads(1)


def grid_2d():
    p = comm.Get_size()
    return dt.ProcessGrid((2, p // 2) if p % 2 == 0 else (p, 1))


def distribution(name, shape=SHAPE):
    """Splits of an (N, C, H, W) array: each dimension, two at once, one dimension over
    two grid axes, uneven with empty blocks, replicas, and nothing split."""
    p = comm.Get_size()
    g1, g2 = dt.ProcessGrid(p), grid_2d()
    h = shape[2]
    cuts = [min(h, 3 * i) for i in range(p - 1)]  # the first block (and the last ones) empty
    return {
        "N": lambda: dt.Distribution(shape, g1, (0, None, None, None)),
        "H": lambda: dt.Distribution(shape, g1, (None, None, 0, None)),
        "W": lambda: dt.Distribution(shape, g1, (None, None, None, 0)),
        "HW": lambda: dt.Distribution(shape, g2, (None, None, 0, 1)),
        "NW": lambda: dt.Distribution(shape, g2, (0, None, None, 1)),
        "H-two-axes": lambda: dt.Distribution(shape, g2, (None, None, (0, 1), None)),
        "H-uneven-empty": lambda: dt.Distribution(shape, g1, (None, None, 0, None),
                                                  [None, None, cuts, None]),
        "H-replicas": lambda: dt.Distribution(shape, g2, (None, None, 0, None)),
        "replicated": lambda: dt.Distribution(shape, g1, (None,) * 4),
    }[name]()


DISTS = ("N", "H", "W", "HW", "NW", "H-two-axes", "H-uneven-empty", "H-replicas",
         "replicated")


def global_input(shape=SHAPE, seed=0):
    """The same float64 tensor on every rank (from a seeded generator), requiring grad."""
    a = np.random.default_rng(seed).standard_normal(shape)
    return torch.tensor(a, dtype=torch.float64, requires_grad=True)


def gradcheck(f, x):
    """``torch.autograd.gradcheck`` on every rank at once; every rank fails if one does."""
    try:
        ok = torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8, rtol=1e-6)
        msg = ""
    except GradcheckError as exc:
        ok, msg = False, str(exc)[:3000]
    collective_assert(ok, msg)


def close(actual, desired, what=""):
    """Collective comparison of a tensor with a NumPy array."""
    a = actual.detach().numpy()
    ok = a.shape == desired.shape and np.allclose(a, desired, rtol=1e-12, atol=1e-12)
    collective_assert(ok, f"{what}: {a} != {desired}")


def padded_blocks(a, dist, widths, mode, **kwargs):
    """NumPy's reference for the extended blocks laid side by side: ``numpy.pad`` of the
    global array, then every block's extended range of each dimension, in block order."""
    padded = np.pad(a, widths, mode, **kwargs)
    index = []
    for bounds, (lo, hi) in zip(dist.boundaries, widths):
        # block [s, e) extended is [s - lo, e + hi), at positions [s, e + lo + hi) of padded
        index.append(np.concatenate([np.arange(s, e + lo + hi, dtype=np.intp)
                                     for s, e in zip(bounds, bounds[1:])]))
    return padded[np.ix_(*index)]


# ------------------------------------------------------------------------ halo exchange
def gradchecked(name, mode):
    """Every mode on two splits and every split in one mode get the full gradcheck; the
    adjoint identity checks the backward pass of every pair."""
    return mode == "reflect" or name in ("HW", "H-uneven-empty")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", DISTS)
def test_halo_exchange(name, mode):
    dist = distribution(name)
    ext = extended_distribution(dist, WIDTHS)

    def f(x):
        return gather(halo_exchange(scatter(x, dist), dist, WIDTHS, mode), ext)

    x = global_input()
    ref = padded_blocks(x.detach().numpy(), dist, WIDTHS, mode)
    close(f(x), ref, "forward")
    block = halo_exchange(scatter(x, dist), dist, WIDTHS, mode)
    collective_assert(tuple(block.shape) == ext.local_shape(), f"{block.shape}")
    if gradchecked(name, mode):
        gradcheck(f, x)
    # <E x, y> = <x, E* y>, with E from NumPy and E* the backward pass
    y = np.random.default_rng(1).standard_normal(ref.shape)
    (adj,) = torch.autograd.grad(f(x), x, torch.from_numpy(y))
    lhs = np.vdot(ref, y)
    rhs = np.vdot(x.detach().numpy(), adj.numpy())
    collective_assert(np.isclose(lhs, rhs, rtol=1e-12, atol=1e-12), f"{lhs} != {rhs}")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["H", "HW", "H-uneven-empty"])
def test_halo_accumulate_is_the_transpose_of_numpy_pad(name, mode):
    """Every rank's extended block summed into the owners' cells: the transpose of the
    matrix of ``numpy.pad`` (built column by column from unit vectors), and its backward
    pass by gradcheck."""
    dist = distribution(name)
    ext = extended_distribution(dist, WIDTHS)
    n = int(np.prod(SHAPE))
    pad = np.stack([padded_blocks(np.eye(n)[i].reshape(SHAPE), dist, WIDTHS, mode).ravel()
                    for i in range(n)], axis=1)  # extended blocks x global cells

    def f(y):
        return gather(halo_accumulate(scatter(y, ext), dist, WIDTHS, mode), dist)

    y = torch.tensor(np.random.default_rng(3).standard_normal(ext.global_shape),
                     requires_grad=True)
    close(f(y), (pad.T @ y.detach().numpy().ravel()).reshape(SHAPE), "forward")
    if name == "H-uneven-empty" or mode == "wrap":
        gradcheck(f, y)


@pytest.mark.parallel([1, 3])
def test_halo_accumulate_refuses_a_block_of_another_shape():
    """The block without its margins, on every rank: each refuses it, naming both shapes
    (a rank-local check, as halo_exchange's of its block; check mode agrees on it)."""
    dist = distribution("H")
    try:
        halo_accumulate(torch.zeros(dist.local_shape()), dist, WIDTHS)
        exc = None
    except ValueError as err:
        exc = err
    collective_assert(exc is not None and "extended block" in str(exc)
                      and str(tuple(dist.local_shape())) in str(exc), repr(exc))


@pytest.mark.parallel(SIZES)
def test_halo_exchange_constant_values_and_widths_beyond_the_array():
    dist = distribution("H")
    widths = ((0, 0), (0, 0), (5, 6), (4, 0))  # wider than the whole array
    ext = extended_distribution(dist, widths)
    values = ((0, 0), (0, 0), (1.5, -2), (3, 0))

    def f(x, mode="constant"):
        kw = {"constant_values": values} if mode == "constant" else {}
        return gather(halo_exchange(scatter(x, dist), dist, widths, mode, **kw), ext)

    x = global_input()
    a = x.detach().numpy()
    ref = padded_blocks(a, dist, widths, "constant", constant_values=values)
    close(f(x), ref, "forward")
    gradcheck(f, x)
    y = np.random.default_rng(5).standard_normal(ref.shape)
    for mode in ("wrap", "symmetric"):  # forward, and the adjoint identity
        ref = padded_blocks(a, dist, widths, mode)
        close(f(x, mode), ref, mode)
        (adj,) = torch.autograd.grad(f(x, mode), x, torch.from_numpy(y))
        lhs, rhs = np.vdot(ref, y), np.vdot(a, adj.numpy())
        collective_assert(np.isclose(lhs, rhs, rtol=1e-12), f"{mode}: {lhs} != {rhs}")


@pytest.mark.parallel(SIZES)
def test_halo_exchange_of_a_parameter_like_block_in_float32():
    """Float32 blocks keep their dtype forward and backward (no gradcheck in float32)."""
    dist = distribution("HW")
    a = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    block = torch.tensor(a[dist.local_slices()], requires_grad=True)
    out = halo_exchange(block, dist, 1, "reflect")
    ref = np.pad(a, 1, "reflect")[tuple(slice(s.start, s.stop + 2)
                                        for s in dist.local_slices())]
    collective_assert(out.dtype == torch.float32 and np.array_equal(out.detach().numpy(), ref))
    out.sum().backward()
    collective_assert(block.grad.dtype == torch.float32
                      and tuple(block.grad.shape) == dist.local_shape())


# ------------------------------------------------------------------------ redistribution
PAIRS = [("H", "W"), ("N", "HW"), ("H-uneven-empty", "H-two-axes"), ("HW", "H-replicas"),
         ("H-replicas", "NW"), ("replicated", "H-uneven-empty"), ("W", "replicated"),
         ("H", "H")]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("pair", PAIRS, ids="->".join)
def test_redistribute(pair):
    src, dst = distribution(pair[0]), distribution(pair[1])

    def f(x):
        return gather(redistribute(scatter(x, src), src, dst), dst)

    x = global_input()
    a = x.detach().numpy()
    moved = redistribute(scatter(x, src), src, dst)
    close(moved, a[dst.local_slices()], "block of dst")
    close(f(x), a, "forward")
    gradcheck(f, x)
    # adjoint: for the identity on global arrays, <R x, y> = <x, R* y> is R* = R^-1
    y = np.random.default_rng(2).standard_normal(SHAPE)
    (adj,) = torch.autograd.grad(f(x), x, torch.from_numpy(y))
    close(adj, y, "adjoint")


# ------------------------------------------------------------------------ gather and scatter
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("name", ["H", "HW", "H-uneven-empty", "H-replicas"])
def test_gather_and_scatter_with_a_root(name):
    dist = distribution(name)
    x = global_input()
    a = x.detach().numpy()
    p = comm.Get_size()
    for root in sorted({0, p - 1}):
        block = scatter(x, dist, root=root)
        close(block, a[dist.local_slices()], f"scatter from {root}")
        whole = gather(block, dist, root=root)
        if comm.Get_rank() == root:
            close(whole, a, f"gather to {root}")
        else:
            close(whole, np.empty((0,) + SHAPE[1:]), f"gather to {root}, elsewhere")

        def from_root(x, root=root):  # non-roots' x is not read: their gradient is zero
            return gather(scatter(x, dist, root=root), dist)

        def from_shared_root(x, root=root):
            # gradcheck perturbs x on every rank at once, so the output moves on every rank
            # though only root's x is read: x is one value every rank holds (broadcast sums
            # the ranks' parts of its gradient, which root alone has)
            return from_root(broadcast(x, dist.grid))

        def to_root(x, root=root):  # through a tensor that root alone holds
            return gather(scatter(gather(scatter(x, dist), dist, root=root), dist, root=root),
                          dist)

        close(from_root(x), a, "from root")
        close(to_root(x), a, "to root")
        gradcheck(from_shared_root, x)
        gradcheck(to_root, x)
        y = torch.from_numpy(np.random.default_rng(3).standard_normal(SHAPE))
        (adj,) = torch.autograd.grad(from_root(x), x, y)
        close(adj, y.numpy() if comm.Get_rank() == root else np.zeros(SHAPE), "adjoint")


@pytest.mark.parallel(SIZES)
def test_scatter_from_root_accepts_none_elsewhere():
    dist = distribution("W")
    a = np.arange(np.prod(SHAPE), dtype=np.float64).reshape(SHAPE)
    mine = torch.from_numpy(a) if comm.Get_rank() == 0 else None
    close(scatter(mine, dist, root=0), a[dist.local_slices()], "blocks")


# ------------------------------------------------------------------------ all-reduce, broadcast
@pytest.mark.parallel(SIZES)
def test_all_reduce_sums_partials_into_one_replicated_value():
    p = comm.Get_size()
    grid = dt.ProcessGrid(p)
    rows = dt.Distribution((p, 3), grid, (0, None))

    def f(x):  # every rank's row summed: one value, held by every rank
        return all_reduce(scatter(x, rows), grid)

    x = global_input((p, 3))
    close(f(x), x.detach().numpy().sum(axis=0, keepdims=True), "forward")
    gradcheck(f, x)
    # a loss that every rank computes alike from the sum: its gradient is 1 on each rank
    loss = f(x).sum()
    loss.backward()
    close(x.grad, np.ones((p, 3)), "gradient of a replicated loss")


@pytest.mark.parallel(SIZES)
def test_all_reduce_over_grid_axes():
    grid = grid_2d()
    a_, b_ = grid.shape
    d_in = dt.Distribution((a_, b_, 3), grid, (0, 1, None))
    d_out = dt.Distribution((a_, 1, 3), grid, (0, None, None))  # replicated along axis 1

    def f(x):
        return gather(all_reduce(scatter(x, d_in), grid, axes=1), d_out)

    x = global_input((a_, b_, 3))
    close(f(x), x.detach().numpy().sum(axis=1, keepdims=True), "forward")
    gradcheck(f, x)
    sub = grid.subcomm(1)

    def g(x):  # the same with the axis' communicator
        return gather(all_reduce(scatter(x, d_in), sub), d_out)

    close(g(x), x.detach().numpy().sum(axis=1, keepdims=True), "communicator")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("root", [None, 0, "last"])
def test_broadcast_sums_the_gradients_of_each_ranks_part(root):
    p = comm.Get_size()
    root = p - 1 if root == "last" else root
    grid = dt.ProcessGrid(p)
    rows = dt.Distribution((p, 3), grid, (0, None))
    scale = torch.tensor([[comm.Get_rank() + 1.0]], dtype=torch.float64)

    def f(w):  # each rank uses the shared w on its own row: row r is (r + 1) w
        return gather(broadcast(w, grid, root=root) * scale, rows)

    def shared(w):  # for gradcheck, which moves w on every rank at once (see test above)
        return f(broadcast(w, grid)) if root is not None else f(w)

    w = global_input((1, 3))
    wn = w.detach().numpy()
    close(f(w), np.arange(1, p + 1)[:, None] * wn, "forward")
    gradcheck(shared, w)
    y = np.random.default_rng(4).standard_normal((p, 3))
    (adj,) = torch.autograd.grad(f(w), w, torch.from_numpy(y))
    whole = (np.arange(1, p + 1)[:, None] * y).sum(axis=0, keepdims=True)
    close(adj, whole if root in (None, comm.Get_rank()) else np.zeros((1, 3)), "adjoint")


@pytest.mark.parallel(SIZES)
def test_broadcast_of_an_all_reduce_is_the_sum_over_replicas():
    """Batch statistics over a split batch: the mean is used on each rank's own rows."""
    p = comm.Get_size()
    grid = dt.ProcessGrid(p)
    rows = dt.Distribution((2 * p + 1, 3), grid, (0, None))  # uneven rows

    def f(x):
        block = scatter(x, rows)
        mean = broadcast(all_reduce(block.sum(0, keepdim=True), grid), grid) / rows.shape[0]
        return gather(block - mean, rows)

    x = global_input(rows.shape)
    a = x.detach().numpy()
    close(f(x), a - a.mean(axis=0, keepdims=True), "forward")
    gradcheck(f, x)


# ------------------------------------------------------------------------ batch norm
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("constant", [False, True])
@pytest.mark.parametrize(("layout", "sums"), [(torch.contiguous_format, False),
                                              (torch.channels_last, False),
                                              (torch.contiguous_format, True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_split_batch_norm_is_torchs_on_the_global_array(dtype, layout, constant, sums,
                                                         monkeypatch):
    """Output, statistics, input gradient and the parameters' gradient sums against
    ``F.batch_norm`` on the whole array in one process (float64: 1e-12; bfloat16 within its
    rounding), on every split of N and space, uneven and empty blocks included, on C-order
    and channels-last blocks, with and without a constant channel; each block's statistics
    by ATen's statistics kernel (small and channels-last blocks) or, with ``sums`` (large
    C-order blocks: the size limit set to 0 here), by its sums and the squares of its
    deviations."""
    if sums:
        monkeypatch.setattr(norm_module, "_SMALL_C_ORDER", 0)
    shape = (3, 4, 7, 5)
    rng = np.random.default_rng(3)
    x64 = torch.tensor(rng.standard_normal(shape) * 2 + 3)
    if constant:
        x64[:, 2] = 1.75
    g64 = torch.tensor(rng.standard_normal(shape))
    w64, b64 = torch.tensor(rng.random(4) + 0.5), torch.tensor(rng.standard_normal(4))
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    xr = x64.to(dtype).double().requires_grad_()  # the reference on the rounded input
    wr, br = w64.clone().requires_grad_(), b64.clone().requires_grad_()
    yr = F.batch_norm(xr, None, None, wr, br, True, 0.0, 1e-5)
    yr.backward(g64.to(dtype).double())
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    bad = []
    for name in ("N", "H", "W", "HW", "NW", "H-uneven-empty"):
        dist = distribution(name, shape)
        sl = dist.local_slices()
        group = split_axes_comm(dist, [0, 2, 3])
        x = x64.to(dtype)[sl].detach().clone(memory_format=layout).requires_grad_()
        w = w64.to(pdt).detach().clone().requires_grad_()
        b = b64.to(pdt).detach().clone().requires_grad_()
        y, mean, var = split_batch_norm(x, w, b, group, 3 * 7 * 5)
        y.backward(g64.to(dtype)[sl])
        # the parameters' gradients are this rank's parts: summed over the ranks
        dw = comm.allreduce(w.grad.double().numpy()) / dist.nreplicas
        db = comm.allreduce(b.grad.double().numpy()) / dist.nreplicas
        pairs = [("y", y.double(), yr[sl]), ("dx", x.grad.double(), xr.grad[sl]),
                 ("mean", mean.double(), xr.mean((0, 2, 3))),
                 ("var", var.double(), xr.var((0, 2, 3), unbiased=False)),
                 ("dw", torch.tensor(dw), wr.grad), ("db", torch.tensor(db), br.grad)]
        for what, a, ref in pairs:
            a, ref = a.detach(), ref.detach()
            err = float((a - ref).abs().max() / ref.abs().max()) if a.numel() else 0.0
            if not err <= tol or a.dtype != torch.float64:
                bad.append(f"{name} {what}: {err:.2e}")
        if y.dtype != dtype:
            bad.append(f"{name}: y is {y.dtype}")
    collective_assert(not bad, "; ".join(bad))


@pytest.mark.parallel(SIZES)
def test_split_batch_norm_of_a_bfloat16_model():
    """A bfloat16 model's batch norm (16-bit block, weight and bias) over every split:
    within bfloat16's rounding of ``F.batch_norm`` in float64, its gradients in bfloat16."""
    shape = (3, 4, 7, 5)
    rng = np.random.default_rng(4)
    x64 = torch.tensor(rng.standard_normal(shape) * 2 + 3)
    w64, b64 = torch.tensor(rng.random(4) + 0.5), torch.tensor(rng.standard_normal(4))
    xr = x64.to(torch.bfloat16).double()
    wr, br = w64.to(torch.bfloat16).double(), b64.to(torch.bfloat16).double()
    yr = F.batch_norm(xr, None, None, wr, br, True, 0.0, 1e-5)
    bad = []
    for name in ("N", "H", "HW", "H-uneven-empty"):
        dist = distribution(name, shape)
        sl = dist.local_slices()
        x = x64.to(torch.bfloat16)[sl].clone().requires_grad_()
        w = w64.to(torch.bfloat16).requires_grad_()
        b = b64.to(torch.bfloat16).requires_grad_()
        y = split_batch_norm(x, w, b, split_axes_comm(dist, [0, 2, 3]), 3 * 7 * 5)[0]
        y.backward(torch.ones_like(y))
        err = float((y.double() - yr[sl]).abs().max()) if y.numel() else 0.0
        if not err <= 5e-2 or y.dtype != torch.bfloat16 or w.grad.dtype != torch.bfloat16:
            bad.append(f"{name}: {err:.2e} {y.dtype} {w.grad.dtype}")
    collective_assert(not bad, "; ".join(bad))


@pytest.mark.parallel(SIZES)
def test_split_batch_norm_moves_running_statistics_as_torch():
    """The running mean and unbiased variance after two steps, against ``F.batch_norm``'s
    buffers on the whole array in one process (float64, 1e-12), on every split."""
    shape = (3, 4, 7, 5)
    rng = np.random.default_rng(5)
    xs = [torch.tensor(rng.standard_normal(shape) * 2 + 1) for _ in range(2)]
    ref_mean, ref_var = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    for x in xs:
        F.batch_norm(x, ref_mean, ref_var, None, None, True, 0.3, 1e-5)
    bad = []
    for name in ("N", "H", "HW", "H-uneven-empty"):
        dist = distribution(name, shape)
        group = split_axes_comm(dist, [0, 2, 3])
        mean, var = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
        for x in xs:
            split_batch_norm(x[dist.local_slices()], None, None, group, 3 * 7 * 5,
                             running_mean=mean, running_var=var, momentum=0.3)
        for what, a, ref in (("mean", mean, ref_mean), ("var", var, ref_var)):
            err = float((a - ref).abs().max() / ref.abs().max())
            if not err <= 1e-12:
                bad.append(f"{name} {what}: {err:.2e}")
    collective_assert(not bad, "; ".join(bad))


class _Counting(MPI.Intracomm):
    """A handle on a communicator that counts its collectives."""

    calls: list[str] = []

    def Allgather(self, *args, **kwargs):  # noqa: N802 - mpi4py's name
        _Counting.calls.append("Allgather")
        return super().Allgather(*args, **kwargs)

    def Allreduce(self, *args, **kwargs):  # noqa: N802
        _Counting.calls.append("Allreduce")
        return super().Allreduce(*args, **kwargs)

    def Iallreduce(self, *args, **kwargs):  # noqa: N802
        _Counting.calls.append("Iallreduce")
        return super().Iallreduce(*args, **kwargs)


@pytest.mark.parallel(SIZES)
def test_split_batch_norm_sends_one_message_each_way():
    """Forward: one allgather of every rank's (values, mean, variance), its statistics
    combined alike on every rank; backward: one allreduce of the two sums (neither over
    one rank)."""
    dist = distribution("HW", (2, 3, 6, 5))
    group = _Counting(split_axes_comm(dist, [0, 2, 3]))
    x = torch.randn(dist.local_shape(), dtype=torch.float64, requires_grad=True)
    _Counting.calls.clear()
    y, _, _ = split_batch_norm(x, None, None, group, 2 * 6 * 5)
    forward = list(_Counting.calls)
    y.backward(torch.ones_like(y))
    backward = _Counting.calls[len(forward):]
    several = group.Get_size() > 1
    collective_assert(forward == ["Allgather"] * several and len(backward) == several,
                      f"{forward}, {backward}")
    group.Free()


@pytest.mark.parallel([1, 3])
def test_split_batch_norm_refuses_bad_arguments_on_every_rank():
    x = torch.zeros(2, 3, 4, 4)
    cases = [(TypeError, lambda: split_batch_norm(x.numpy(), None, None, comm, 32)),
             (TypeError, lambda: split_batch_norm(x.long(), None, None, comm, 32)),
             (ValueError, lambda: split_batch_norm(x, torch.ones(4), None, comm, 32)),
             (TypeError, lambda: split_batch_norm(x, None, None, "world", 32)),
             (ValueError, lambda: split_batch_norm(x, None, None, comm, -1)),
             (ValueError, lambda: split_batch_norm(x, None, None, comm, 32, eps=-1.0)),
             (ValueError, lambda: split_batch_norm(x, None, None, comm, 32,
                                                   running_mean=torch.zeros(4))),
             (ValueError, lambda: split_batch_norm(x, None, None, comm, 32, momentum=1.5))]
    for error, call in cases:
        _, exc = collective_outcome(call)
        collective_assert(isinstance(exc, error), repr(exc))


# ------------------------------------------------------------------------ errors
@pytest.mark.parallel(SIZES)
def test_bad_arguments_raise_alike_before_any_message():
    dist = distribution("H")
    x = torch.zeros(dist.local_shape(), dtype=torch.float64)
    cases = [
        (TypeError, lambda: halo_exchange(x, SHAPE, 1)),
        (ValueError, lambda: halo_exchange(x, dt.Distribution(SHAPE, (1,)), 1)),
        (TypeError, lambda: halo_exchange(x.numpy(), dist, 1)),
        (TypeError, lambda: halo_exchange(x.to(torch.float8_e4m3fn), dist, 1)),
        (ValueError, lambda: halo_exchange(x, dist, 1, "nearest")),
        (ValueError, lambda: halo_exchange(x, dist, -1)),
        (ValueError, lambda: redistribute(x, dist, distribution("W", (2, 1, 4, 4)))),
        (ValueError, lambda: gather(x, dist, root=comm.Get_size())),
        (TypeError, lambda: gather(x, dist, root=0.0)),
        (ValueError, lambda: scatter(torch.zeros(3), dist)),
        (TypeError, lambda: all_reduce(x, "world")),
        (TypeError, lambda: all_reduce(x, comm, axes=0)),
        (TypeError, lambda: broadcast(x.numpy(), comm)),
        (ValueError, lambda: broadcast(x, comm, root=-1)),
    ]
    for error, call in cases:
        _, exc = collective_outcome(call)
        collective_assert(isinstance(exc, error), f"{call}: {exc!r}")
    # root's tensor of the wrong shape: every rank raises, after a small broadcast
    wrong = torch.zeros((3, 3)) if comm.Get_rank() == 0 else None
    _, exc = collective_outcome(lambda: scatter(wrong, dist, root=0))
    collective_assert(isinstance(exc, ValueError), repr(exc))


@pytest.mark.parallel(SIZES)
def test_a_block_of_the_wrong_shape_raises_on_every_rank():
    dist = distribution("H")
    try:
        halo_exchange(torch.zeros(SHAPE, dtype=torch.float64), dist, 1)
    except ValueError as exc:
        error = exc
    else:
        error = None
    p = comm.Get_size()
    collective_assert(p == 1 or isinstance(error, ValueError), repr(error))


@pytest.mark.parallel([3])
def test_check_mode_finds_blocks_that_require_grad_on_some_ranks_only():
    dist = distribution("H")
    x = torch.zeros(dist.local_shape(), dtype=torch.float64,
                    requires_grad=comm.Get_rank() == 0)
    with dt.options(check_collective=True):
        _, exc = collective_outcome(lambda: halo_exchange(x, dist, 1))
    collective_assert(isinstance(exc, dt.CollectiveMismatchError) and "requires_grad"
                      in str(exc), repr(exc))


@pytest.mark.parallel([2, 3])
def test_check_mode_agrees_on_a_block_of_the_wrong_shape_on_one_rank():
    dist = distribution("H")
    shape = SHAPE if comm.Get_rank() == 1 else dist.local_shape()  # rank 1's is wrong
    x = torch.zeros(shape, dtype=torch.float64)
    with dt.options(check_collective=True):
        _, exc = collective_outcome(lambda: halo_exchange(x, dist, 1))  # same on every rank
    collective_assert(isinstance(exc, ValueError) and "shape" in str(exc), repr(exc))


def test_importing_the_packages_needs_no_torch():
    code = ("import sys; import disttensor, disttensor_nn, disttensor_nn.layers; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "sys.modules['torch'] = None\n"
            "try:\n    import disttensor_nn.torch\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'pip install "disttensor[torch]"' in out.stdout, out.stdout

