"""DistArrays whose blocks are PyTorch tensors: creation, gathering, redistribution, halos,
their adjoint and the allreduce, each against NumPy on the global array.

CPU tensors are worked on as NumPy views of their memory: the tests also check that no
block is copied where a NumPy block would not be.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.backend import array_namespace, host_view, is_torch, to_numpy
from disttensor.testing import collective_assert, collective_outcome
from disttensor.transport import allreduce, iallreduce, transport_for_arrays

torch = pytest.importorskip("torch")

SIZES = [1, 2, 3, 4]
MODES = ("constant", "wrap", "reflect", "symmetric", "edge")
comm = MPI.COMM_WORLD
SHAPE = (7, 5, 4)


def layouts(shape=SHAPE):
    """Splits of a 3-D array: each dimension, two at once, uneven with empty blocks,
    replicas, nothing split."""
    p = comm.Get_size()
    g1 = dt.ProcessGrid(p)
    g2 = dt.ProcessGrid((2, p // 2) if p % 2 == 0 else (p, 1))
    cuts = [min(shape[0], 3 * i) for i in range(p - 1)]  # the first block empty
    return [
        dt.Distribution(shape, g1, (0, None, None)),
        dt.Distribution(shape, g1, (None, 0, None)),
        dt.Distribution(shape, g2, (0, 1, None)),
        dt.Distribution(shape, g2, (None, (0, 1), None)),
        dt.Distribution(shape, g1, (0, None, None), [cuts, None, None]),
        dt.Distribution(shape, g2, (None, None, 1)),  # replicas along grid axis 0
        dt.Distribution(shape, g1, (None, None, None)),
    ]


def global_array(shape=SHAPE, dtype=np.float64):
    return np.arange(np.prod(shape), dtype=dtype).reshape(shape) * 0.5 - 3


def is_block(t, dtype=torch.float64):
    return isinstance(t, torch.Tensor) and t.dtype == dtype


def same_memory(a, b):
    return np.shares_memory(host_view(a), host_view(b))


@pytest.mark.parallel(SIZES)
def test_the_module_of_a_tensor_is_torch():
    t = torch.zeros(3)
    assert array_namespace(t) is torch and is_torch(torch)
    assert array_namespace(torch.nn.Parameter(t)) is torch
    v = host_view(t)
    v[1] = 5  # a view: writes go through
    assert float(t[1]) == 5
    assert host_view(t.requires_grad_()) is not None  # detached: the memory, not the graph
    transport, (w,) = transport_for_arrays(torch, t)
    assert isinstance(w, np.ndarray) and np.shares_memory(w, v) and transport.direct


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("k", range(7))
def test_from_global_to_global(k):
    dist = layouts()[k]
    g = global_array()
    for source in (g, torch.from_numpy(g)):
        x = dt.DistArray.from_global(source, dist, xp=torch)
        collective_assert(is_block(x.local) and x.xp is torch, f"{type(x.local)}")
        collective_assert(np.array_equal(x.local.numpy(), g[dist.local_slices()]))
        whole = x.to_global()
        collective_assert(is_block(whole) and np.array_equal(whole.numpy(), g))
        at_root = x.to_global(root=comm.Get_size() - 1)
        collective_assert((comm.Get_rank() != comm.Get_size() - 1 and at_root is None)
                          or np.array_equal(at_root.numpy(), g))
    # a torch tensor on root alone: its module and dtype reach every rank
    src = torch.from_numpy(g.astype(np.float32)) if comm.Get_rank() == 0 else None
    x = dt.DistArray.from_global(src, dist, root=0)
    collective_assert(is_block(x.local, torch.float32)
                      and np.array_equal(x.local.numpy(), g[dist.local_slices()]))
    # a block: copied into a contiguous buffer of its own, detached from autograd
    t = torch.from_numpy(np.ascontiguousarray(g[dist.local_slices()].transpose()))
    t = t.permute(2, 1, 0).requires_grad_()  # not contiguous
    y = dt.DistArray.from_local(t, dist)
    whole = y.to_global()  # collective: on every rank, whatever the checks find
    collective_assert(y.local.is_contiguous() and not y.local.requires_grad
                      and not same_memory(y.local, t)
                      and np.array_equal(whole.numpy(), g))
    z = y.astype(np.float32)
    collective_assert(is_block(z.local, torch.float32) and z.dtype == np.float32)


@pytest.mark.parallel(SIZES)
def test_redistribute_between_every_pair_of_layouts():
    g = global_array()
    for src in layouts():
        x = dt.DistArray.from_global(g, src, xp=torch)
        for dst in layouts():
            y = x.redistribute(dst)
            collective_assert(is_block(y.local)
                              and np.array_equal(y.local.numpy(), g[dst.local_slices()]),
                              f"{src} -> {dst}")
            out = dt.DistArray.empty(dst, np.float64, xp=torch)
            buffer = out.buffer
            x.redistribute(dst, out=out)  # into the given array's memory
            collective_assert(out.buffer is buffer
                              and np.array_equal(out.local.numpy(), g[dst.local_slices()]))


@pytest.mark.parallel(SIZES)
def test_redistribution_adjoint():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)
    for src, dst in [(layouts()[0], layouts()[1]), (layouts()[4], layouts()[3])]:
        plan = dt.redistribution_plan(src, dst)
        x = dt.DistArray.from_global(a, src, xp=torch)
        y = dt.DistArray.from_global(b, dst, xp=torch)
        back = plan.adjoint(y)
        collective_assert(is_block(back.local))
        # <P x, y> = <x, P* y> for the inner product summing every rank's local vdot
        lhs = comm.allreduce(float(torch.vdot(plan(x).local.flatten(), y.local.flatten())))
        rhs = comm.allreduce(float(torch.vdot(x.local.flatten(), back.local.flatten())))
        collective_assert(np.isclose(lhs, rhs, rtol=1e-12), f"{lhs} != {rhs}")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_exchange_halo_is_numpy_pad_in_place(mode):
    g = global_array()
    widths = ((2, 1), (0, 3), (1, 1))  # wider than the blocks at 3 and 4 ranks
    for dist in layouts():
        x = dt.DistArray.from_global(g, dist, xp=torch)
        ext = x.exchange_halo(widths, mode)
        ref = np.pad(g, widths, mode)[tuple(
            slice(s.start, s.stop + lo + hi) for s, (lo, hi) in zip(dist.local_slices(), widths))]
        collective_assert(is_block(ext) and np.array_equal(ext.numpy(), ref), f"{dist}")
        collective_assert(same_memory(ext, x.buffer), "the halo is not in the array's buffer")
        collective_assert(x.halo_token is not None)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_halo_accumulate_is_the_adjoint_of_numpy_pad(mode):
    g = global_array()
    widths = ((1, 2), (2, 0), (0, 1))
    rng = np.random.default_rng(1)
    for dist in layouts():
        starts = [s.start for s in dist.local_slices()]
        ext_shape = tuple(n + lo + hi for n, (lo, hi) in zip(dist.local_shape(), widths))
        # one random extended block per block (replicas hold the same one)
        e = rng.standard_normal((dist.nprocs,) + ext_shape)[
            dist.ranks_of_block(dist.block_index())[0]]
        acc = dt.halo_accumulate(torch.from_numpy(e), dist, widths, mode)
        collective_assert(is_block(acc.local))
        padded = np.pad(g, widths, mode)[tuple(
            slice(s, s + n) for s, n in zip(starts, ext_shape))]
        # <E x, e> = <x, E* e>, each block counted once (replicas hold equal values)
        lhs = comm.allreduce(float(np.vdot(padded, e))) / dist.nreplicas
        rhs = comm.allreduce(float(np.vdot(g[dist.local_slices()], acc.local.numpy())))
        rhs /= dist.nreplicas
        collective_assert(np.isclose(lhs, rhs, rtol=1e-12), f"{dist}: {lhs} != {rhs}")


@pytest.mark.parallel(SIZES)
def test_allreduce_sums_tensors_in_place():
    p = comm.Get_size()
    t = torch.arange(6, dtype=torch.float64) * (comm.Get_rank() + 1)
    out = allreduce(t, comm)
    total = np.arange(6) * p * (p + 1) / 2
    collective_assert(out is t and np.array_equal(t.numpy(), total))
    strided = torch.ones(4, 3, dtype=torch.float32)[:, ::2]  # not contiguous: a new result
    out = allreduce(strided, comm, MPI.MAX)
    collective_assert(is_block(out, torch.float32) and np.array_equal(out.numpy(),
                                                                     np.ones((4, 2))))
    same = allreduce(strided, comm, in_place=True)
    collective_assert(same is strided and float(strided.sum()) == 8 * p)
    t = torch.ones(5, dtype=torch.int64)
    req = iallreduce(t, comm)
    collective_assert(req.wait() is t and np.array_equal(t.numpy(), [p] * 5))


@pytest.mark.parallel(SIZES)
def test_dlpack_both_ways_without_a_copy():
    dist = layouts()[0]
    g = global_array()
    x = dt.DistArray.from_global(g, dist)  # NumPy blocks, viewed by torch
    t = torch.from_dlpack(x.local)
    t += 1
    collective_assert(np.array_equal(x.local, g[dist.local_slices()] + 1))
    y = dt.DistArray.from_global(g, dist, xp=torch)  # torch blocks, viewed by NumPy
    v = np.from_dlpack(y.local)
    v *= 2
    collective_assert(np.array_equal(to_numpy(y.local), 2 * g[dist.local_slices()]))


@pytest.mark.parallel(SIZES)
def test_numpy_style_operations_refuse_torch_blocks_on_every_rank():
    x = dt.DistArray.from_global(global_array(), layouts()[0], xp=torch)
    for op in (lambda: x + 1, lambda: x.sum(), lambda: np.sin(x)):
        _, exc = collective_outcome(op)
        collective_assert(isinstance(exc, TypeError), repr(exc))


@pytest.mark.parallel(SIZES)
def test_bfloat16_blocks_move_bit_for_bit():
    """bfloat16 tensors (viewed as ml_dtypes' bfloat16) redistribute, exchange halos in every
    mode and accumulate them, as NumPy on the global array: the same bits, 2 bytes each."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    g = global_array().astype(bf16)  # halves up to 70: exact in bfloat16

    def bits(t):
        return to_numpy(t).view(np.uint16)

    for src in layouts():
        x = dt.DistArray.from_global(torch.from_numpy(g.view(np.int16)).view(torch.bfloat16),
                                     src)
        collective_assert(is_block(x.local, torch.bfloat16) and x.dtype == bf16)
        for dst in layouts():
            y = x.redistribute(dst)
            collective_assert(is_block(y.local, torch.bfloat16)
                              and np.array_equal(bits(y.local),
                                                 g[dst.local_slices()].view(np.uint16)),
                              f"{src} -> {dst}")
        widths = ((2, 1), (0, 3), (1, 1))
        for mode in MODES:
            ext = x.exchange_halo(widths, mode)
            ref = np.pad(g, widths, mode)[tuple(
                slice(s.start, s.stop + lo + hi)
                for s, (lo, hi) in zip(src.local_slices(), widths))]
            collective_assert(is_block(ext, torch.bfloat16)
                              and np.array_equal(bits(ext), ref.view(np.uint16)), f"{mode}")
        # the adjoint: every halo element added back into the block it came from (small
        # integers, exact in bfloat16)
        ones = torch.ones(tuple(n + lo + hi for n, (lo, hi) in zip(src.local_shape(), widths)),
                          dtype=torch.bfloat16)
        acc = dt.halo_accumulate(ones, src, widths, "constant")
        expect = np.pad(np.zeros(SHAPE), widths)  # how many extended blocks cover each
        for r in range(src.nprocs):
            sl = src.local_slices(r)
            if src.ranks_of_block(src.block_index(r))[0] != r:
                continue  # a replica: the block is counted once
            expect[tuple(slice(s.start, s.stop + lo + hi)
                         for s, (lo, hi) in zip(sl, widths))] += 1
        core = expect[tuple(slice(lo, lo + n) for n, (lo, _) in zip(SHAPE, widths))]
        collective_assert(is_block(acc.local, torch.bfloat16)
                          and np.array_equal(to_numpy(acc.local).astype(np.float64),
                                             core[src.local_slices()]), f"{src}")


@pytest.mark.parallel(SIZES)
def test_a_bfloat16_allreduce_adds_in_float32():
    """MPI has no bfloat16 sum: it is taken in float32 and rounded once, in place where the
    tensor allows: 256 and a 1 from each other rank sum to float32's total rounded to
    bfloat16, where adding in bfloat16 would round each 1 away (256 + 1 ties to 256)."""
    pytest.importorskip("ml_dtypes")
    p = comm.Get_size()
    t = torch.full((5,), 1.0, dtype=torch.bfloat16) + (comm.Get_rank() + 1)
    out = allreduce(t, comm)
    total = sum(1.0 + r + 1 for r in range(p))
    collective_assert(out.dtype == torch.bfloat16 and torch.equal(
        out, torch.full((5,), total, dtype=torch.float32).to(torch.bfloat16)))
    u = torch.full((3,), 256.0 if comm.Get_rank() == 0 else 1.0, dtype=torch.bfloat16)
    req = iallreduce(u, comm)
    want = torch.tensor(256.0 + (p - 1)).to(torch.bfloat16)
    collective_assert(torch.equal(req.wait(), torch.full((3,), float(want),
                                                        dtype=torch.bfloat16)))


@pytest.mark.parallel(SIZES)
def test_a_dtype_that_cannot_move_is_refused_on_every_rank():
    dist = layouts()[0]
    _, exc = collective_outcome(
        lambda: dt.DistArray.from_global(torch.zeros(SHAPE, dtype=torch.float8_e4m3fn), dist))
    collective_assert(isinstance(exc, TypeError), repr(exc))
