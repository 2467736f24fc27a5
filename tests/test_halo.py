"""Halo exchange (``DistArray.exchange_halo``, ``halo_plan``) and its adjoint ``halo_accumulate``.

Every expected value comes from NumPy on the global array, which every rank
builds identically: ``numpy.pad`` for the exchange, and a brute-force
scatter-add over ``numpy.pad``-ed index arrays for the adjoint.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpi_helpers import all_sum, replica_sum

import disttensor as dt
from disttensor.backend import dense_order
from disttensor.testing import assert_allclose, assert_equal, collective_assert
from disttensor.testing.strategies import distributions, process_grids

SIZES = [1, 2, 3, 4]
MODES = ("constant", "wrap", "reflect", "symmetric", "edge")
# Largest global side and halo width per number of dimensions (keeps np.pad cheap).
MAX_SIDE = {1: 9, 2: 6, 3: 4, 4: 3}
MAX_WIDTH = {1: 12, 2: 8, 3: 5, 4: 4}

comm = MPI.COMM_WORLD


# --------------------------------------------------------------------------- references
def pad_kwargs(mode, constant_values):
    return {"constant_values": constant_values} if mode == "constant" else {}


def expected_extended(a, dist, pairs, mode, constant_values=0, rank=None):
    """``np.pad(a, pairs, mode)`` at the positions of ``rank``'s block extended by ``pairs``."""
    padded = np.pad(a, pairs, mode=mode, **pad_kwargs(mode, constant_values))
    return padded[
        tuple(
            slice(s.start, s.stop + lo + hi)
            for s, (lo, hi) in zip(dist.local_slices(rank), pairs)
        )
    ]


def extended_shape(dist, pairs, rank=None):
    return tuple(n + lo + hi for n, (lo, hi) in zip(dist.local_shape(rank), pairs))


def source_indices(n, lo, hi, mode):
    """Global source index of each position of a padded axis; -1 marks constant padding.

    Independent of the library: pad an index array with numpy.pad itself.
    """
    if mode == "constant":
        return np.pad(np.arange(n), (lo, hi), mode="constant", constant_values=-1)
    return np.pad(np.arange(n), (lo, hi), mode=mode)


def brute_force_adjoint(shape, dist, pairs, mode, blocks, dtype):
    """Sum, over every rank's extended block, of each cell added into its global source."""
    idx = [source_indices(n, lo, hi, mode) for n, (lo, hi) in zip(shape, pairs)]
    acc = np.zeros(shape, dtype)
    for r in range(dist.nprocs):
        e = blocks[r]
        srcs = [
            i[s.start : s.stop + lo + hi]
            for i, s, (lo, hi) in zip(idx, dist.local_slices(r), pairs)
        ]
        assert tuple(len(s) for s in srcs) == e.shape
        valid = np.ones(e.shape, bool)
        for d, s in enumerate(srcs):
            valid &= (s >= 0).reshape([-1 if k == d else 1 for k in range(len(shape))])
        grids = np.broadcast_arrays(*np.ix_(*srcs)) if e.size else []
        if valid.any():
            np.add.at(acc, tuple(g[valid] for g in grids), e[valid])
    return acc


def global_array(shape, dtype=np.float64):
    """Distinct, positive values, so that a wrong source index or a constant shows."""
    a = np.arange(1, int(np.prod(shape)) + 1).reshape(shape)
    if np.dtype(dtype).kind == "c":
        return (a + 0.5j * a[::-1].reshape(shape)).astype(dtype)
    return a.astype(dtype)


def random_block(seed, rank, shape, dtype):
    rng = np.random.default_rng([seed, rank])
    e = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        e = e + 1j * rng.standard_normal(shape)
    return e.astype(dtype)


# --------------------------------------------------------------------------- strategies
@st.composite
def halo_cases(draw, modes=MODES, constant_values=True):
    """(dist, widths as passed, per-dim pairs, mode, constant_values)."""
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(0, MAX_SIDE[ndim])) for _ in range(ndim))
    dist = draw(distributions(shape=shape, grid=process_grids()))
    mode = draw(st.sampled_from(modes))
    w = st.integers(0, MAX_WIDTH[ndim])
    form = draw(st.sampled_from(("int", "pair", "pairs")))
    if form == "int":
        k = draw(w)
        widths, pairs = k, [(k, k)] * ndim
    elif form == "pair":
        lo, hi = draw(w), draw(w)
        widths, pairs = (lo, hi), [(lo, hi)] * ndim
    else:
        pairs = [(draw(w), draw(w)) for _ in range(ndim)]
        widths = draw(st.sampled_from((tuple(pairs), list(map(list, pairs)))))
    if mode != "constant" and any(n == 0 and (lo or hi) for n, (lo, hi) in zip(shape, pairs)):
        # numpy.pad cannot extend an empty axis with these modes: leave empty dims unpadded
        pairs = [(0, 0) if n == 0 else p for n, p in zip(shape, pairs)]
        widths = tuple(pairs)
    pairs = tuple(pairs)
    cv = 0
    if mode == "constant" and constant_values:
        c = st.integers(-9, 0).map(float)
        kind = draw(st.sampled_from(("scalar", "pair", "pairs")))
        if kind == "scalar":
            cv = draw(c)
        elif kind == "pair":
            cv = (draw(c), draw(c))
        else:
            cv = tuple((draw(c), draw(c)) for _ in range(ndim))
    return dist, widths, pairs, mode, cv


# --------------------------------------------------------------------------- forward
@pytest.mark.parallel(SIZES)
@settings(max_examples=45)
@given(case=halo_cases(), dtype=st.sampled_from([np.float64, np.float32, np.int32,
                                                  np.complex128]))
def test_exchange_matches_numpy_pad(case, dtype):
    dist, widths, pairs, mode, cv = case
    a = global_array(dist.shape, dtype)
    x = dt.DistArray.from_global(a, dist)
    ext = x.exchange_halo(widths, mode, cv)
    assert_equal(ext, expected_extended(a, dist, pairs, mode, cv))
    assert_equal(x.local, a[dist.local_slices()])  # the interior is untouched


@pytest.mark.parallel(SIZES)
@settings(max_examples=20)
@given(case=halo_cases())
def test_nonblocking_equals_blocking(case):
    dist, widths, pairs, mode, cv = case
    a = global_array(dist.shape)
    want = expected_extended(a, dist, pairs, mode, cv)

    blocking = dt.DistArray.from_global(a, dist).exchange_halo(widths, mode, cv, copy=True)

    x = dt.DistArray.from_global(a, dist)
    req = dt.halo_plan(dist, pairs, mode).start(x, cv)
    polls = 0
    while not req.test() and polls < 1_000_000:
        polls += 1
    collective_assert(polls < 1_000_000, "test() never reported completion")
    ext = req.finish()
    collective_assert(req.test(), "test() is False after finish()")
    assert_equal(ext, want)
    assert_equal(ext, blocking)

    # start/finish without polling
    y = dt.DistArray.from_global(a, dist)
    assert_equal(dt.halo_plan(dist, pairs, mode).start(y, cv).finish(), want)
    # the plan's blocking entry point
    z = dt.DistArray.from_global(a, dist)
    assert_equal(dt.halo_plan(dist, pairs, mode).exchange(z, cv), want)


@pytest.mark.parallel(SIZES)
@settings(max_examples=15)
@given(case=halo_cases())
def test_several_exchanges_in_flight(case):
    # three arrays on one plan, started together and finished (by every rank) in another order
    dist, widths, pairs, mode, cv = case
    arrays = [(k + 1.0) * global_array(dist.shape) for k in range(3)]
    plan = dt.halo_plan(dist, pairs, mode)
    reqs = [plan.start(dt.DistArray.from_global(a, dist), cv) for a in arrays]
    done = {k: reqs[k].finish().copy() for k in (2, 0, 1)}
    for k, a in enumerate(arrays):
        assert_equal(done[k], expected_extended(a, dist, pairs, mode, cv))


@pytest.mark.parallel(SIZES)
@settings(max_examples=15)
@given(case=halo_cases())
def test_repeated_exchange_reuses_buffer(case):
    dist, widths, pairs, mode, cv = case
    a = global_array(dist.shape)
    x = dt.DistArray.from_global(a, dist)
    first = x.exchange_halo(widths, mode, cv)
    assert_equal(first, expected_extended(a, dist, pairs, mode, cv))
    margins = x.margins

    b = -3.0 * a + 1.0
    x.local[...] = b[dist.local_slices()]
    second = x.exchange_halo(widths, mode, cv)
    assert_equal(second, expected_extended(b, dist, pairs, mode, cv))
    assert_equal(x.local, b[dist.local_slices()])
    collective_assert(x.margins == margins, f"margins changed: {margins} -> {x.margins}")
    collective_assert(second.size == 0 or np.shares_memory(first, second),
                      "the second exchange did not reuse the first one's storage")


@st.composite
def exchange_sequences(draw):
    """A distribution and several (widths, pairs, mode, constant_values) to apply in turn."""
    dist, *first = draw(halo_cases())
    steps = [tuple(first)]
    for _ in range(draw(st.integers(1, 3))):
        mode = draw(st.sampled_from(MODES))
        pairs = tuple(
            (0, 0) if n == 0 and mode != "constant" else
            (draw(st.integers(0, MAX_WIDTH[dist.ndim])), draw(st.integers(0, MAX_WIDTH[dist.ndim])))
            for n in dist.shape
        )
        steps.append((pairs, pairs, mode, -5.0))
    return dist, steps


@pytest.mark.parallel(SIZES)
@settings(max_examples=15)
@given(seq=exchange_sequences())
def test_exchanges_with_changing_widths(seq):
    # margins grow as needed and narrower exchanges use a part of wider margins
    dist, steps = seq
    a = global_array(dist.shape)
    x = dt.DistArray.from_global(a, dist)
    for widths, pairs, mode, cv in steps:
        assert_equal(x.exchange_halo(widths, mode, cv),
                     expected_extended(a, dist, pairs, mode, cv))
        assert_equal(x.local, a[dist.local_slices()])
    for step in steps:
        x.reserve_halo(step[0])
    collective_assert(all(m == (max(p[d][0] for _, p, _, _ in steps),
                                max(p[d][1] for _, p, _, _ in steps))
                          for d, m in enumerate(x.margins)), f"margins {x.margins}")


@pytest.mark.parallel(SIZES)
@settings(max_examples=15)
@given(case=halo_cases())
def test_reserve_halo_then_exchange_in_place(case):
    dist, widths, pairs, mode, cv = case
    a = global_array(dist.shape)
    x = dt.DistArray.from_global(a, dist)
    x.reserve_halo(widths)
    collective_assert(
        all(m[0] >= lo and m[1] >= hi for m, (lo, hi) in zip(x.margins, pairs)),
        f"margins {x.margins} smaller than {pairs}",
    )
    assert_equal(x.local, a[dist.local_slices()])
    margins = x.margins
    x.reserve_halo(0)  # never shrinks
    collective_assert(x.margins == margins, "reserve_halo(0) changed the margins")

    interior = x.local
    ext = x.exchange_halo(widths, mode, cv)
    assert_equal(ext, expected_extended(a, dist, pairs, mode, cv))
    collective_assert(x.margins == margins, "exchange after reserve_halo regrew the buffer")
    collective_assert(interior.size == 0 or np.shares_memory(ext, interior),
                      "exchange after reserve_halo copied the interior")
    inner = tuple(slice(lo, lo + n) for (lo, _), n in zip(pairs, dist.local_shape()))
    collective_assert(interior.size == 0 or np.shares_memory(ext[inner], interior))


@pytest.mark.parallel(SIZES)
@settings(max_examples=15)
@given(case=halo_cases())
def test_exchange_copy(case):
    dist, widths, pairs, mode, cv = case
    a = global_array(dist.shape)
    x = dt.DistArray.from_global(a, dist)
    want = expected_extended(a, dist, pairs, mode, cv)
    view = x.exchange_halo(widths, mode, cv)
    copy = x.exchange_halo(widths, mode, cv, copy=True)
    assert_equal(copy, want)
    collective_assert(not np.shares_memory(copy, view), "copy=True returned a view")
    copy[...] = -1234.0
    assert_equal(x.local, a[dist.local_slices()])
    assert_equal(view, want)


def _explicit_dists(P):
    """Hand-made layouts that every world size can build: empty blocks, tuples, replicas."""
    out = []
    g1 = dt.ProcessGrid((P,))
    # rank 0 holds 1 element, ranks 1..P-2 nothing, the last rank the rest
    out.append(dt.Distribution((7,), g1, splits=[[1] * (P - 1)]))
    # everything on the last rank
    out.append(dt.Distribution((5, 3), g1, axes=(0, None), splits=[[0] * (P - 1), None]))
    # fully replicated
    out.append(dt.Distribution((4, 3), g1, axes=(None, None)))
    g2 = dt.ProcessGrid((1, P))
    # a dim split over a tuple of grid axes, in reversed order
    out.append(dt.Distribution((6, 2), g2, axes=((1, 0), None)))
    if P == 4:
        g3 = dt.ProcessGrid((2, 2))
        out.append(dt.Distribution((3, 5), g3, axes=(1, 0), splits=[[0], [4]]))
        out.append(dt.Distribution((5, 4), g3, axes=(None, 1)))  # axis 0 holds replicas
        out.append(dt.Distribution((9,), g3, axes=((1, 0),), splits=[[1, 1, 2]]))
    return out


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_exchange_explicit_layouts(mode):
    widths_list = [1, (0, 3), (7, 2), 11, ((2, 5),)]
    for dist in _explicit_dists(comm.Get_size()):
        a = global_array(dist.shape)
        for widths in widths_list:
            pairs = tuple(np.broadcast_to(np.asarray(widths), (dist.ndim, 2)).tolist())
            pairs = tuple(tuple(p) for p in pairs)
            x = dt.DistArray.from_global(a, dist)
            cv = ((-1.0, -2.0),) * dist.ndim
            assert_equal(x.exchange_halo(widths, mode, cv), expected_extended(a, dist, pairs,
                                                                              mode, cv))
            e = random_block(7, comm.Get_rank(), extended_shape(dist, pairs), np.float64)
            acc = dt.halo_accumulate(e, dist, widths, mode)
            blocks = {r: random_block(7, r, extended_shape(dist, pairs, r), np.float64)
                      for r in range(dist.nprocs)}
            assert_allclose(replica_sum(acc),
                            brute_force_adjoint(dist.shape, dist, pairs, mode, blocks,
                                                np.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parallel(SIZES)
def test_empty_dimension_unpadded_with_reflect():
    g = dt.ProcessGrid((comm.Get_size(),))
    dist = dt.Distribution((0, 4), g, axes=(None, 0))
    a = np.zeros((0, 4))
    x = dt.DistArray.from_global(a, dist)
    ext = x.exchange_halo(((0, 0), (2, 1)), "reflect")
    assert_equal(ext, expected_extended(a, dist, ((0, 0), (2, 1)), "reflect"))
    ext = x.exchange_halo(((1, 2), (2, 1)), "constant", 5.0)  # constant may pad it
    assert_equal(ext, expected_extended(a, dist, ((1, 2), (2, 1)), "constant", 5.0))


# --------------------------------------------------------------------------- adjoint
@pytest.mark.parallel(SIZES)
@settings(max_examples=30)
@given(case=halo_cases(constant_values=False), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([np.float64, np.complex128]))
def test_accumulate_is_adjoint(case, seed, dtype):
    dist, widths, pairs, mode, _ = case
    rank = comm.Get_rank()
    a = random_block(seed, 1 << 20, dist.shape, dtype)
    x = dt.DistArray.from_global(a, dist)
    e = random_block(seed, rank, extended_shape(dist, pairs), dtype)
    e_before = e.copy()

    lhs = all_sum(np.vdot(x.exchange_halo(widths, mode, 0, copy=True), e))
    acc = dt.halo_accumulate(e, dist, widths, mode)
    rhs = all_sum(np.vdot(x.local, acc.local))
    assert_allclose(lhs, rhs, rtol=1e-10, atol=1e-10)
    assert_equal(e, e_before)  # input left alone without overwrite_input
    collective_assert(acc.dist == dist and acc.local.shape == dist.local_shape()
                      and acc.dtype == np.dtype(dtype), f"bad result {acc!r}")

    # against the brute-force global adjoint (replicas compared through their sum)
    blocks = {r: random_block(seed, r, extended_shape(dist, pairs, r), dtype)
              for r in range(dist.nprocs)}
    want = brute_force_adjoint(dist.shape, dist, pairs, mode, blocks, dtype)
    assert_allclose(replica_sum(acc), want, rtol=1e-12, atol=1e-12)
    if dist.nreplicas == 1:
        assert_allclose(acc.local, want[dist.local_slices()], rtol=1e-12, atol=1e-12)

    again = dt.halo_accumulate(e.copy(), dist, widths, mode, overwrite_input=True)
    assert_allclose(again.local, acc.local, rtol=1e-14, atol=1e-14)

    # a strided extended block (a view into a wider buffer) is accepted, with either setting
    wide = np.zeros(tuple(2 * n + 1 for n in e.shape), e.dtype)
    strided = wide[tuple(slice(1, None, 2) for _ in e.shape)]
    strided[...] = e
    for overwrite in (False, True):
        got = dt.halo_accumulate(strided, dist, widths, mode, overwrite_input=overwrite)
        assert_allclose(got.local, acc.local, rtol=1e-14, atol=1e-14)


# --------------------------------------------------------------------------- blocks
@pytest.mark.parallel(SIZES)
@settings(max_examples=40)
@given(case=halo_cases(), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([np.float64, np.float32, np.int32, np.complex128]),
       layout=st.sampled_from(["c", "strided", "permuted"]))
def test_exchange_block_and_its_adjoint_on_plain_blocks(case, seed, dtype, layout):
    """``exchange_block`` returns a new array that is ``numpy.pad``'s at this rank's extended
    block; ``accumulate_block`` a new block that is the brute-force global scatter-add of
    every rank's extended block, leaving its input alone (strided inputs accepted). A block
    dense in another order of its axes (a channels-last block) gives results laid out in
    that order; any other gives C-contiguous ones."""
    dist, widths, pairs, mode, cv = case
    plan = dt.halo_plan(dist, widths, mode)
    a = global_array(dist.shape, dtype)
    block = in_layout(a[dist.local_slices()], layout)
    ext = plan.exchange_block(block, cv)
    assert_equal(ext, expected_extended(a, dist, pairs, mode, cv))
    collective_assert(same_layout(ext, block, layout) and not np.shares_memory(ext, block)
                      and ext.dtype == np.dtype(dtype), "a new extended block, laid out as "
                      "the block")

    e = random_block(seed, comm.Get_rank(), extended_shape(dist, pairs), dtype)
    e_before = e.copy()
    got = plan.accumulate_block(e)
    blocks = {r: random_block(seed, r, extended_shape(dist, pairs, r), dtype)
              for r in range(dist.nprocs)}
    want = brute_force_adjoint(dist.shape, dist, pairs, mode, blocks, dtype)
    collective_assert(got.shape == dist.local_shape() and got.flags.c_contiguous
                      and got.dtype == np.dtype(dtype), f"bad result {got.shape}")
    tol = 1e-5 if dtype == np.float32 else 1e-12  # sums in another order
    assert_allclose(replica_sum(dt.DistArray(got, dist)), want, rtol=tol, atol=tol)
    if dist.nreplicas == 1:
        assert_allclose(got, want[dist.local_slices()], rtol=tol, atol=tol)
    assert_equal(e, e_before)
    if layout != "c":
        view = in_layout(e, layout)
        again = plan.accumulate_block(view)
        assert_equal(again, got)
        collective_assert(same_layout(again, view, layout), "the block laid out as its input")


def in_layout(block, layout):
    """``block``'s values in new memory: C order, a view into a wider buffer (every other
    element), or dense with the axes in rotated order (the first innermost, as a
    channels-last block's channels)."""
    if layout == "c":
        return block.copy()
    if layout == "strided":
        wide = np.zeros(tuple(2 * n + 1 for n in block.shape), block.dtype)
        view = wide[tuple(slice(1, None, 2) for _ in block.shape)]
    else:
        order = (*range(1, block.ndim), 0)
        view = np.empty(tuple(block.shape[d] for d in order), block.dtype) \
            .transpose(np.argsort(order))
    view[...] = block
    return view


def same_layout(result, block, layout):
    """Whether ``result`` lies in memory as :func:`exchange_block` promises for ``block``."""
    if result.size == 0:  # no memory to lay out
        return True
    if layout == "permuted" and not block.flags.c_contiguous:
        longer = {d for d, n in enumerate(result.shape) if n > 1}  # axes of 1 lie anywhere
        return [d for d in dense_order(result) if d in longer] == \
            [d for d in dense_order(block) if d in longer]
    return result.flags.c_contiguous


@pytest.mark.parallel(SIZES)
def test_exchange_block_refuses_wrong_shapes_on_every_rank():
    dist = _small_dist()
    plan = dt.halo_plan(dist, ((1, 2), (0, 1)))
    for call in (lambda: plan.exchange_block(np.zeros((dist.local_shape()[0] + 1, 4))),
                 lambda: plan.accumulate_block(np.zeros(dist.local_shape()))):
        with pytest.raises(ValueError, match="block has shape"):
            call()
    ext = plan.exchange_block(np.ones(dist.local_shape()))  # nothing left in flight
    collective_assert(ext.shape == (dist.local_shape()[0] + 3, 5), "the extended shape")


# --------------------------------------------------------------------------- faces
@pytest.mark.parallel(SIZES)
@settings(max_examples=30)
@given(case=halo_cases(), which=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_faces_are_the_exchanged_halo_and_their_adjoint(case, which, seed):
    """``start_faces`` of a plan along one dimension gives the halo that ``exchange_halo``
    puts before and after the block; ``start_accumulate_faces`` adds faces into their
    sources as ``halo_accumulate`` does an extended block with a zero interior."""
    dist, _, pairs, mode, cv = case
    d = which % dist.ndim
    pairs = tuple(p if e == d else (0, 0) for e, p in enumerate(pairs))
    a = global_array(dist.shape)
    x = dt.DistArray.from_global(a, dist)
    plan = dt.halo_plan(dist, pairs, mode)
    if not any(pairs[d]):
        with pytest.raises(ValueError, match="one dimension"):
            plan.start_faces(x.local)
        return
    lo, hi = pairs[d]
    n = x.local.shape[d]
    before, after = plan.start_faces(x.local, cv).finish()
    ext = expected_extended(a, dist, pairs, mode, cv)
    cut = lambda start, stop: ext[(slice(None),) * d + (slice(start, stop),)]  # noqa: E731
    assert_equal(before, cut(0, lo))
    assert_equal(after, cut(lo + n, lo + n + hi))
    assert_equal(x.local, a[dist.local_slices()])  # the block is untouched

    def faces_of(r):
        shape = list(dist.local_shape(r))
        e = random_block(seed, r, extended_shape(dist, pairs, r), np.float64)
        e[(slice(None),) * d + (slice(lo, lo + shape[d]),)] = 0  # the interior is not a face
        return e

    mine = faces_of(comm.Get_rank())
    face = lambda start, stop: np.ascontiguousarray(  # noqa: E731
        mine[(slice(None),) * d + (slice(start, stop),)])
    target = random_block(seed + 1, comm.Get_rank(), dist.local_shape(), np.float64)
    start = target.copy()
    got = plan.start_accumulate_faces(face(0, lo), face(lo + n, lo + n + hi)).finish(target)
    blocks = {r: faces_of(r) for r in range(dist.nprocs)}
    added = brute_force_adjoint(dist.shape, dist, pairs, mode, blocks, np.float64)
    if dist.nreplicas == 1:
        assert_allclose(got, start + added[dist.local_slices()], rtol=1e-12, atol=1e-12)
    collective_assert(got is target, "the faces are added into the target in place")


@pytest.mark.parallel(SIZES)
def test_faces_refuse_bad_blocks_and_plans_on_every_rank():
    dist = dt.Distribution((7, 3), dt.ProcessGrid((comm.Get_size(),)), axes=(0, None))
    plan = dt.halo_plan(dist, ((1, 2), (0, 0)))
    block = np.zeros(dist.local_shape())
    cases = [lambda: plan.start_faces(np.zeros((dist.local_shape()[0] + 1, 3))),
             lambda: dt.halo_plan(dist, 1).start_faces(block),
             lambda: plan.start_accumulate_faces(np.zeros((2, 3)), np.zeros((2, 3)))]
    for case in cases:
        with pytest.raises(ValueError, match="halo faces"):
            case()
    before, after = plan.start_faces(block).finish()  # nothing left in flight
    collective_assert(before.shape == (1, 3) and after.shape == (2, 3), "faces' shapes")


# --------------------------------------------------------------------------- bad input
def _small_dist():
    return dt.Distribution((5, 4), dt.ProcessGrid((comm.Get_size(),)), axes=(0, None))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize(
    "widths",
    [-1, (1, -1), ((0, 1), (-2, 0)), ((1, 1), (1, 1), (1, 1)), (1, 2, 3), 1.5, "ab",
     ((1, 1, 1), (1, 1, 1))],
)
def test_bad_widths(widths):
    dist = _small_dist()
    x = dt.DistArray.from_global(global_array(dist.shape), dist)
    with pytest.raises(ValueError):
        x.exchange_halo(widths)
    with pytest.raises(ValueError):
        x.reserve_halo(widths)
    with pytest.raises(ValueError):
        dt.halo_accumulate(np.zeros(dist.local_shape()), dist, widths)
    # the array still works afterwards (no rank is left in a collective)
    assert_equal(x.exchange_halo(1, "wrap"), expected_extended(
        global_array(dist.shape), dist, ((1, 1), (1, 1)), "wrap"))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", ["periodic", "", "CONSTANT", "mean"])
def test_unknown_mode(mode):
    dist = _small_dist()
    x = dt.DistArray.from_global(global_array(dist.shape), dist)
    with pytest.raises(ValueError):
        x.exchange_halo(1, mode)
    with pytest.raises(ValueError):
        dt.halo_plan(dist, ((1, 1), (1, 1)), mode)
    with pytest.raises(ValueError):
        dt.halo_accumulate(np.zeros((dist.local_shape()[0] + 2, 6)), dist, 1, mode)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", [m for m in MODES if m != "constant"])
def test_nonconstant_mode_on_empty_dimension(mode):
    g = dt.ProcessGrid((comm.Get_size(),))
    dist = dt.Distribution((3, 0), g, axes=(0, None))
    x = dt.DistArray.from_global(np.zeros((3, 0)), dist)
    with pytest.raises(ValueError):
        np.pad(np.zeros((3, 0)), ((0, 0), (1, 0)), mode=mode)  # the reference agrees
    with pytest.raises(ValueError):
        x.exchange_halo(((0, 0), (1, 0)), mode)
    with pytest.raises(ValueError):
        dt.halo_plan(dist, ((1, 1), (0, 2)), mode)
    with pytest.raises(ValueError):
        dt.halo_accumulate(np.zeros((dist.local_shape()[0], 1)), dist, ((0, 0), (1, 0)),
                           mode)


@pytest.mark.parallel(SIZES)
def test_bad_constant_values_and_extended_shape():
    dist = _small_dist()
    x = dt.DistArray.from_global(global_array(dist.shape), dist)
    with pytest.raises(ValueError):
        x.exchange_halo(1, "constant", ((1.0, 2.0, 3.0),) * 2)
    with pytest.raises(ValueError):
        x.exchange_halo(1, "constant", ((1.0, 2.0),) * 3)
    with pytest.raises(ValueError):  # extended block of the wrong shape
        dt.halo_accumulate(np.zeros(dist.local_shape()), dist, 1, "wrap")
    assert_equal(x.exchange_halo(1, "constant", ((1.0, 2.0), (3.0, 4.0))),
                 expected_extended(global_array(dist.shape), dist, ((1, 1), (1, 1)),
                                   "constant", ((1.0, 2.0), (3.0, 4.0))))


@pytest.mark.parallel([1, 2, 3, 4])
def test_exchanges_in_flight_progressed_in_different_orders():
    comm = MPI.COMM_WORLD
    dist = dt.Distribution((4, 4 * comm.size), dt.ProcessGrid((1, comm.size)), axes=(0, 1))
    arrays = [s * np.arange(16.0 * comm.size).reshape(4, -1) for s in (1, -1, 2)]
    xs = [dt.DistArray.from_global(a, dist) for a in arrays]
    plan = dt.halo_plan(dist, ((1, 1), (1, 1)), "wrap")
    reqs = [plan.start(x) for x in xs]
    order = reqs if comm.rank % 2 == 0 else reqs[::-1]
    for r in order:
        r.test()
    for r in order:
        r.finish()
    sl = tuple(slice(s.start, s.stop + 2) for s in dist.local_slices())
    ok = all(np.array_equal(r.ext, np.pad(a, 1, "wrap")[sl]) for r, a in zip(reqs, arrays))
    collective_assert(ok, "concurrent halo exchanges mixed up their messages")


@pytest.mark.parallel([1, 2, 3, 4])
def test_non_blocking_accumulate_equals_blocking():
    comm = MPI.COMM_WORLD
    dist = dt.Distribution((5, 3 * comm.size + 1), dt.ProcessGrid((1, comm.size)), axes=(0, 1))
    widths = ((1, 2), (2, 1))
    plan = dt.halo_plan(dist, widths, "reflect")
    rng = np.random.default_rng(comm.rank)
    ext = rng.standard_normal(tuple(n + lo + hi for n, (lo, hi)
                                    in zip(dist.local_shape(), widths)))
    blocking = plan.accumulate(ext)
    reqs = [plan.start_accumulate(ext), plan.start_accumulate(2 * ext)]
    for r in reqs[::-1] if comm.rank % 2 else reqs:
        r.test()
    a, b = (r.finish() for r in reqs)
    collective_assert(np.allclose(a.local, blocking.local) and np.allclose(b.local,
                                                                          2 * blocking.local),
                      "non-blocking accumulate differs from the blocking one")
