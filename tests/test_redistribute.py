"""Redistribution between any two Distributions of one global shape, and its adjoint.

References are NumPy on the global array (identical on every rank) and an
independent gather (``allgather`` of every rank's slices and block).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import all_sum, replica_sum

import disttensor as dt
from disttensor.testing import assert_allclose, assert_equal, collective_assert
from disttensor.testing.strategies import distributions, process_grids

SIZES = [1, 2, 3, 4]
MAX_SIDE = {0: 1, 1: 12, 2: 7, 3: 5, 4: 4}
DTYPES = [np.float64, np.complex128, np.bool_, np.int32, np.float32, np.uint8]

comm = MPI.COMM_WORLD


def random_array(seed, key, shape, dtype):
    """Random values of ``dtype`` from a seed, the same on every rank for the same key."""
    rng = np.random.default_rng([seed, key])
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 100, shape).astype(dtype)
    a = rng.standard_normal(shape)
    if dtype.kind == "c":
        a = a + 1j * rng.standard_normal(shape)
    return a.astype(dtype)


def gather_independently(x):
    """The global array rebuilt from every rank's (slices, block), checking replicas agree."""
    pieces = comm.allgather((x.dist.local_slices(), np.array(x.local, copy=True)))
    out = np.zeros(x.shape, x.dtype)
    seen = np.zeros(x.shape, bool)
    consistent = True
    for sl, block in pieces:
        o, s = out[(*sl, ...)], seen[(*sl, ...)]
        consistent &= bool(np.array_equal(o[s], block[s]))
        o[...] = block
        s[...] = True
    collective_assert(bool(seen.all()), "some elements are held by no rank")
    collective_assert(consistent, "replicas hold different values")
    return out


@st.composite
def dist_pairs(draw, min_dims=0):
    ndim = draw(st.integers(min_dims, 4))
    shape = tuple(draw(st.integers(0, MAX_SIDE[ndim])) for _ in range(ndim))
    src = draw(distributions(shape=shape, grid=process_grids()))
    how = draw(st.sampled_from(("any", "same grid", "replicated", "default")))
    if how == "any":  # possibly another grid shape over the same communicator
        dst = draw(distributions(shape=shape, grid=process_grids()))
    elif how == "same grid":
        dst = draw(distributions(shape=shape, grid=src.grid))
    elif how == "replicated":
        dst = src.replicated()
    else:  # balanced blocks on the same axes
        dst = src.with_axes(src.axes)
    if draw(st.booleans()):
        src, dst = dst, src
    return src, dst


# --------------------------------------------------------------------------- forward
@pytest.mark.parallel(SIZES)
@settings(max_examples=45)
@given(pair=dist_pairs(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_redistribute_round_trip(pair, dtype, seed):
    src, dst = pair
    a = random_array(seed, 0, src.shape, dtype)
    x = dt.DistArray.from_global(a, src)
    y = x.redistribute(dst)
    collective_assert(y.dist == dst, f"result has {y.dist}, wanted {dst}")
    assert_equal(y.local, a[dst.local_slices()])
    assert_equal(gather_independently(y), a)
    assert_equal(x.local, a[src.local_slices()])  # the source is left alone

    z = y.redistribute(src)
    assert_equal(z.local, a[src.local_slices()])


@pytest.mark.parallel(SIZES)
@settings(max_examples=10)
@given(pair=dist_pairs(min_dims=1), seed=st.integers(0, 2**16))
def test_redistribute_with_halo_margins(pair, seed):
    # a source whose buffer carries halo margins: only the block moves
    src, dst = pair
    a = random_array(seed, 0, src.shape, np.float64)
    x = dt.DistArray.from_global(a, src)
    x.reserve_halo(2)
    x.exchange_halo(2, "constant", 7.0)
    y = x.redistribute(dst)
    assert_equal(y.local, a[dst.local_slices()])
    y.reserve_halo((1, 3))
    assert_equal(y.redistribute(src).local, a[src.local_slices()])


def _explicit_pairs(P):
    """Hand-made pairs: split <-> replicated, uneven <-> balanced, empty blocks, tuples."""
    g = dt.ProcessGrid((P,))
    g2 = dt.ProcessGrid((1, P))
    shape = (7, 5)
    d = [
        dt.Distribution(shape, g, axes=(0, None)),
        dt.Distribution(shape, g, axes=(None, 0)),
        dt.Distribution(shape, g, axes=(None, None)),
        dt.Distribution(shape, g, axes=(0, None), splits=[[7] * (P - 1), None]),
        dt.Distribution(shape, g, axes=(0, None), splits=[[0] * (P - 1), None]),
        dt.Distribution(shape, g, axes=(None, 0), splits=[None, [1] * (P - 1)]),
        dt.Distribution(shape, g2, axes=((1, 0), None)),
        dt.Distribution(shape, g2, axes=(1, None), splits=[list(range(1, P)), None]),
        dt.Distribution(shape, g2, axes=(None, 0)),  # axis 1 of the grid holds replicas
    ]
    if P == 4:
        g22, g122 = dt.ProcessGrid((2, 2)), dt.ProcessGrid((1, 2, 2))
        d += [
            dt.Distribution(shape, g22, axes=(0, 1), splits=[[1], [5]]),
            dt.Distribution(shape, g22, axes=(1, 0)),
            dt.Distribution(shape, g22, axes=((1, 0), None)),
            dt.Distribution(shape, g22, axes=(1, None)),  # same blocks as below,
            dt.Distribution(shape, g122, axes=(1, None)),  # on other ranks
            dt.Distribution(shape, g122, axes=(2, 1)),
        ]
    return d


@pytest.mark.parallel(SIZES)
def test_redistribute_explicit_pairs():
    dists = _explicit_pairs(comm.Get_size())
    a = random_array(3, 0, dists[0].shape, np.float64)
    for src in dists:
        x = dt.DistArray.from_global(a, src)
        for dst in dists:
            y = x.redistribute(dst)
            collective_assert(np.array_equal(y.local, a[dst.local_slices()]),
                              f"{src} -> {dst}: wrong block")
            collective_assert(np.array_equal(gather_independently(y), a),
                              f"{src} -> {dst}: wrong global array")


# --------------------------------------------------------------------------- adjoint
@pytest.mark.parallel(SIZES)
@settings(max_examples=40)
@given(pair=dist_pairs(), dtype=st.sampled_from([np.float64, np.complex128]),
       seed=st.integers(0, 2**16))
def test_adjoint(pair, dtype, seed):
    src, dst = pair
    rank = comm.Get_rank()
    plan = dt.redistribution_plan(src, dst)
    # Blocks drawn per rank: replicas may differ, so the identity also checks that the
    # adjoint returns each piece to the very replica the forward map read it from.
    x = dt.DistArray.from_local(random_array(seed, 1 + rank, src.local_shape(), dtype), src)
    y = dt.DistArray.from_local(random_array(seed, 100 + rank, dst.local_shape(), dtype), dst)
    y_before = y.local.copy()

    rty = plan.adjoint(y)
    collective_assert(rty.dist == src and rty.dtype == np.dtype(dtype), f"bad result {rty!r}")
    lhs = all_sum(np.vdot(plan(x).local, y.local))
    rhs = all_sum(np.vdot(x.local, rty.local))
    assert_allclose(lhs, rhs, rtol=1e-10, atol=1e-10)
    assert_equal(y.local, y_before)

    # Independent reference: each copy of an element in dst came from exactly one copy
    # in src, so summing over replicas on both sides must agree.
    total = replica_sum(y)
    assert_allclose(replica_sum(rty), total, rtol=1e-12, atol=1e-12)
    if src.nreplicas == 1:  # the one owner of each element receives every copy's value
        assert_allclose(rty.local, total[src.local_slices()], rtol=1e-12, atol=1e-12)
    if src.nreplicas == 1 and dst.nreplicas == 1:  # a permutation: R^T = R^-1
        assert_equal(rty.local, y.redistribute(src).local)


@pytest.mark.parallel(SIZES)
def test_adjoint_explicit_pairs():
    dists = _explicit_pairs(comm.Get_size())
    rank = comm.Get_rank()
    for i, src in enumerate(dists):
        x = dt.DistArray.from_local(random_array(i, 1 + rank, src.local_shape(), float), src)
        for j, dst in enumerate(dists):
            y = dt.DistArray.from_local(
                random_array(j, 100 + rank, dst.local_shape(), float), dst)
            plan = dt.redistribution_plan(src, dst)
            rty = plan.adjoint(y)
            lhs = all_sum(np.vdot(plan(x).local, y.local))
            rhs = all_sum(np.vdot(x.local, rty.local))
            collective_assert(np.isclose(lhs, rhs, rtol=1e-10, atol=1e-10),
                              f"{src} -> {dst}: <Rx, y> = {lhs} but <x, R^T y> = {rhs}")
            collective_assert(np.allclose(replica_sum(rty), replica_sum(y), rtol=1e-12),
                              f"{src} -> {dst}: replica sums differ")


# --------------------------------------------------------------------------- plans, errors
@pytest.mark.parallel(SIZES)
@settings(max_examples=10)
@given(pair=dist_pairs())
def test_plan_cache(pair):
    src, dst = pair
    p = dt.redistribution_plan(src, dst)
    collective_assert(p is dt.redistribution_plan(src, dst), "plan not cached")
    same_src = dt.Distribution(src.shape, src.grid, src.axes,
                               [b[1:-1] for b in src.boundaries])
    collective_assert(same_src == src)
    collective_assert(p is dt.redistribution_plan(same_src, dst),
                      "equal distributions do not share a plan")


@pytest.mark.parallel(SIZES)
def test_plan_rejects_arrays_of_other_distributions():
    g = dt.ProcessGrid((comm.Get_size(),))
    a, b = dt.Distribution((6, 2), g), dt.Distribution((6, 2), g, axes=(None, None))
    plan = dt.redistribution_plan(a, b)
    with pytest.raises(ValueError):
        plan(dt.DistArray.zeros(b))
    with pytest.raises(ValueError):
        plan.adjoint(dt.DistArray.zeros(a))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("other", [(6, 3), (3, 6), (6,), (6, 2, 1), (0, 2), ()])
def test_different_global_shapes(other):
    g = dt.ProcessGrid((comm.Get_size(),))
    src = dt.Distribution((6, 2), g)
    dst = dt.Distribution(other, g)
    x = dt.DistArray.from_global(np.ones((6, 2)), src)
    with pytest.raises(ValueError):
        x.redistribute(dst)
    with pytest.raises(ValueError):
        dt.redistribution_plan(src, dst)
    assert_equal(x.redistribute(src.replicated()).local, np.ones((6, 2)))


@pytest.mark.parallel(SIZES)
def test_distribution_without_grid():
    P = comm.Get_size()
    g = dt.ProcessGrid((P,))
    src = dt.Distribution((6, 2), g)
    x = dt.DistArray.from_global(np.ones((6, 2)), src)
    gridless = dt.Distribution((6, 2), (P,))
    with pytest.raises((ValueError, TypeError)):
        x.redistribute(gridless)
    with pytest.raises((ValueError, TypeError)):
        dt.redistribution_plan(src, gridless)
    with pytest.raises((ValueError, TypeError)):
        dt.redistribution_plan(gridless, src)


@pytest.mark.parallel([2, 3, 4])
def test_grid_over_another_communicator():
    g = dt.ProcessGrid((comm.Get_size(),))
    src = dt.Distribution((6, 2), g)
    other = dt.Distribution((6, 2), dt.ProcessGrid((1,), MPI.COMM_SELF))
    with pytest.raises(ValueError):
        dt.redistribution_plan(src, other)


# --------------------------------------------------------------------------- pack vs datatypes
@pytest.mark.parallel(SIZES)
@settings(max_examples=30)
@given(pair=dist_pairs(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_pack_and_datatype_methods_agree_with_numpy(pair, dtype, seed):
    # both ways of reaching MPI, on the same cases (uneven, empty, replicated blocks)
    src, dst = pair
    a = random_array(seed, 0, src.shape, dtype)
    x = dt.DistArray.from_global(a, src)
    x.reserve_halo(1)  # a source buffer with margins: only the block moves
    for method in ("pack", "datatype"):
        plan = dt.redistribution_plan(src, dst, method)
        collective_assert(plan.method == method, f"plan uses {plan.method}, not {method}")
        out = dt.DistArray.empty(dst, a.dtype)
        for _ in range(2):  # the output and the pooled buffers reused
            y = plan(x, out)
            collective_assert(y is out, "out= was not used")
            assert_equal(y.local, a[dst.local_slices()])
        assert_equal(plan(x).local, a[dst.local_slices()])


def strided_copy(block, order):
    """``block``'s values in new memory that is neither C- nor F-contiguous: its axes laid
    out in ``order`` and every other element of the innermost one."""
    inverse = np.argsort(order)
    shape = tuple(block.shape[i] for i in order)
    base = np.empty(shape[:-1] + (2 * shape[-1],), block.dtype)
    view = base[..., ::2].transpose(inverse)
    view[...] = block
    return view


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("xp_name", ["numpy", "torch"])
@settings(max_examples=20)
@given(pair=dist_pairs(min_dims=2), dtype=st.sampled_from([np.float64, np.int32]),
       seed=st.integers(0, 2**16))
def test_blocks_that_are_not_contiguous_move_by_both_methods(xp_name, pair, dtype, seed):
    # a block that is a permuted view (a transposed layer output, a channels-last
    # tensor) is no single buffer MPI can take: it moves through a contiguous copy,
    # as does a strided out= block, and the adjoint reads one as well
    xp = np if xp_name == "numpy" else pytest.importorskip("torch")
    src, dst = pair
    a = random_array(seed, 0, src.shape, dtype)
    order = (*range(1, a.ndim), 0)
    wrap = (lambda b: b) if xp is np else (lambda b: xp.from_numpy(b))
    host = (lambda b: b) if xp is np else (lambda b: b.numpy())
    x = dt.DistArray(wrap(strided_copy(a[src.local_slices()], order)), src)
    for method in ("pack", "datatype"):
        plan = dt.redistribution_plan(src, dst, method)
        y = plan(x)
        assert_equal(host(y.local), a[dst.local_slices()])
        out = dt.DistArray(wrap(strided_copy(np.zeros(dst.local_shape(), a.dtype), order)),
                           dst)
        collective_assert(plan(x, out) is out, "out= was not used")
        assert_equal(host(out.local), a[dst.local_slices()])
        assert_equal(host(x.local), a[src.local_slices()])  # the source is left alone
        if a.dtype.kind == "f":
            back = plan.adjoint(out)  # every copy of an element returns to its source
            assert_equal(replica_sum(dt.DistArray(host(back.local), src)),
                         replica_sum(dt.DistArray(host(out.local), dst)))
    assert_equal(gather_independently(dt.DistArray(
        strided_copy(a[src.local_slices()], order), src)), a)


@pytest.mark.parallel(SIZES)
def test_explicit_pairs_both_methods_and_auto_choice():
    dists = _explicit_pairs(comm.Get_size())
    a = random_array(5, 0, dists[0].shape, np.float32)
    for src in dists:
        x = dt.DistArray.from_global(a, src)
        for dst in dists:
            for method in ("pack", "datatype"):
                y = dt.redistribution_plan(src, dst, method)(x)
                collective_assert(np.array_equal(y.local, a[dst.local_slices()]),
                                  f"{src} -> {dst} ({method}): wrong block")
    # (7, 5) float32 arrays: every piece's runs are at most 5 elements, 20 bytes: packed
    if comm.Get_size() > 1:
        plan = dt.redistribution_plan(dists[0], dists[1])
        collective_assert(plan.method == "pack", f"short runs planned as {plan.method}")
    # a 1-D array moved between two splits: runs of 1000 elements at least, datatypes
    g = dt.ProcessGrid((comm.Get_size(),))
    n = 4000 * comm.Get_size()
    one = dt.Distribution((n,), g, axes=(0,))
    shifted = dt.Distribution((n,), g, axes=(0,),
                              splits=[[min(n, 4000 * k + 1000) for k in range(1, comm.Get_size())]])
    collective_assert(dt.redistribution_plan(one, shifted).method == "datatype",
                      "long runs not planned with datatypes")


@pytest.mark.parallel(SIZES)
def test_unknown_method_raises_everywhere():
    g = dt.ProcessGrid((comm.Get_size(),))
    d = dt.Distribution((4, 4), g, axes=(0, None))
    with pytest.raises(ValueError, match="unknown redistribution method"):
        dt.redistribution_plan(d, d.with_axes((None, 0)), "mpi")
