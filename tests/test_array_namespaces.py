"""The core operations with local blocks from array modules other than NumPy.

``array_api_strict`` stands in for a GPU library on machines without one: its
arrays on ``Device("device1")`` refuse ``numpy.asarray``, refuse to mix with
arrays of another device and expose no buffer to MPI, like CuPy arrays, so
every operation must keep blocks on their device and move them through the
staging transport. Its arrays on the default CPU device check the same code
for NumPy-only calls (methods, dtypes, scalars) that the standard lacks.

Every expected value comes from NumPy on the global array.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_sum

import disttensor as dt
from disttensor.backend import array_namespace, to_numpy
from disttensor.testing import assert_equal, collective_assert
from disttensor.transport import allreduce, transport_for

xps = pytest.importorskip("array_api_strict")

SIZES = [1, 2, 3, 4]
MODES = ("constant", "wrap", "reflect", "symmetric", "edge")
comm = MPI.COMM_WORLD

# (module, device object or None): NumPy, the strict namespace on its CPU device and on a
# device that behaves like an accelerator's memory
PLACES = {
    "numpy": (np, None),
    "strict-cpu": (xps, None),
    "strict-device1": (xps, xps.Device("device1")),
}


@pytest.fixture(params=sorted(PLACES))
def place(request):
    return PLACES[request.param]


def put(a, place):
    """The NumPy array ``a`` as an array of ``place``."""
    xp, device = place
    if xp is np:
        return np.array(a)
    return xp.asarray(a) if device is None else xp.asarray(a, device=device)


def check_place(x, place):
    """Every rank's block lives in ``place``'s module and on its device."""
    xp, device = place
    local = x.local if isinstance(x, dt.DistArray) else x
    ok = array_namespace(local) is xp and (device is None or local.device == device)
    collective_assert(ok, f"block is {type(local)} on {getattr(local, 'device', None)}")


def grid_2d():
    p = comm.Get_size()
    return dt.ProcessGrid((2, p // 2) if p % 2 == 0 else (p, 1))


def layouts(shape):
    """Distributions of ``shape`` (2-D): split rows, columns, both, uneven with empty
    blocks, replicated."""
    p = comm.Get_size()
    g1 = dt.ProcessGrid(p)
    g2 = grid_2d()
    cuts = [min(shape[0], 3 * i) for i in range(p - 1)]  # first block empty
    return [
        dt.Distribution(shape, g1, (0, None)),
        dt.Distribution(shape, g1, (None, 0)),
        dt.Distribution(shape, g2, (0, 1)),
        dt.Distribution(shape, g1, (0, None), [cuts, None]),
        dt.Distribution(shape, g2, (1, 0)),
        dt.Distribution(shape, g1, (None, None)),
    ]


def global_array(shape, dtype=np.float64):
    return (np.arange(np.prod(shape)) * 1.5 - 7).astype(dtype).reshape(shape)


# ------------------------------------------------------------------------ scatter and gather
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex128])
def test_from_global_to_global(place, dtype):
    g = global_array((7, 5), dtype)
    for dist in layouts(g.shape):
        x = dt.DistArray.from_global(put(g, place), dist)
        check_place(x, place)
        assert_equal(to_numpy(x.local), g[dist.local_slices()])
        assert_equal(x.to_global(), g)
        check_place(x.to_global(), place)
        root = comm.Get_size() - 1
        y = dt.DistArray.from_global(put(g, place) if comm.Get_rank() == root else None, dist,
                                     root=root)
        check_place(y, place)
        assert_equal(to_numpy(y.local), g[dist.local_slices()])
        gathered = y.to_global(root=root)
        collective_assert((gathered is None) == (comm.Get_rank() != root))
        if gathered is not None:
            np.testing.assert_array_equal(to_numpy(gathered), g)


@pytest.mark.parallel(SIZES)
def test_from_global_chosen_module(place):
    """``xp=``/``device=`` convert a NumPy global array to the chosen module."""
    xp, device = place
    g = global_array((6, 4))
    dist = layouts(g.shape)[2]
    x = dt.DistArray.from_global(g, dist, xp=xp, device=device)
    check_place(x, place)
    assert_equal(x, g)
    y = dt.asarray(g if comm.Get_rank() == 0 else None, root=0, xp=xp, device=device,
                   grid=dist.grid, axes=dist.axes)
    check_place(y, place)
    assert_equal(y, g)


@pytest.mark.parallel(SIZES)
def test_zero_d(place):
    g = np.array(2.5)
    dist = dt.Distribution((), dt.ProcessGrid(comm.Get_size()), ())
    x = dt.DistArray.from_global(put(g, place) if comm.Get_rank() == 0 else None, dist, root=0)
    check_place(x, place)
    assert_equal(x.to_global(), g)


# ------------------------------------------------------------------------ creation
@pytest.mark.parallel(SIZES)
def test_creation(place):
    xp, device = place
    grid = grid_2d()
    kw = dict(xp=xp, device=device, grid=grid, axes=(0, 1))
    shape = (5, 3)
    cases = [
        (dt.zeros(shape, **kw), np.zeros(shape)),
        (dt.ones(shape, np.int32, **kw), np.ones(shape, np.int32)),
        (dt.full(shape, np.float32(0.25), **kw), np.full(shape, 0.25, np.float32)),
        (dt.full(shape, 3, np.float64, **kw), np.full(shape, 3.0)),
        (dt.zeros(shape, np.int64, **kw).astype(np.float32), np.zeros(shape, np.float32)),
    ]
    for x, want in cases:
        check_place(x, place)
        assert_equal(x, want)
    one = dict(xp=xp, device=device, grid=dt.ProcessGrid(comm.Get_size()))
    for args, dtype in [((10,), None), ((1, 12, 3), None), ((0.5, 4.0, 0.75), None),
                        ((2, 9), np.float32), ((0,), None)]:
        x = dt.arange(*args, dtype=dtype, **one)
        check_place(x, place)
        assert_equal(x, np.arange(*args, dtype=dtype))


@pytest.mark.parallel(SIZES)
def test_random(place):
    """Random arrays do not depend on the module, the device or the distribution."""
    xp, device = place
    shape = (6, 5)
    ref = {}
    for name, call in [("random", lambda r, **k: r.random(shape, **k)),
                       ("random32", lambda r, **k: r.random(shape, np.float32, **k)),
                       ("normal", lambda r, **k: r.normal(1.0, 2.0, shape, **k)),
                       ("uniform", lambda r, **k: r.uniform(-1, 1, shape, **k)),
                       ("integers", lambda r, **k: r.integers(-5, 17, shape, **k))]:
        serial = dt.Distribution(shape, dt.ProcessGrid(comm.Get_size()), (None, None))
        ref[name] = call(dt.random.default_rng(7), dist=serial).to_global()
        for dist in layouts(shape)[:4]:
            x = call(dt.random.default_rng(7), xp=xp, device=device, dist=dist)
            check_place(x, place)
            assert_equal(x, ref[name])


# ------------------------------------------------------------------------ redistribution
@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype", [np.float64, np.int16])
def test_redistribute(place, dtype):
    g = global_array((7, 5), dtype)
    dists = layouts(g.shape)
    for src in dists:
        x = dt.DistArray.from_global(put(g, place), src)
        for dst in dists:
            y = x.redistribute(dst)
            check_place(y, place)
            assert_equal(to_numpy(y.local), g[dst.local_slices()])
        # into an out= array with margins (halo storage) the margins stay out of it
        dst = dists[2]
        out = dt.DistArray.zeros(dst, dtype, xp=place[0], device=place[1])
        out.reserve_halo(1)
        x.redistribute(dst, out=out)
        assert_equal(to_numpy(out.local), g[dst.local_slices()])


@pytest.mark.parallel(SIZES)
def test_redistribute_adjoint(place):
    """``<plan(x), y> == <x, plan.adjoint(y)>`` with blocks of any module."""
    shape = (7, 5)
    dists = layouts(shape)
    rng = np.random.default_rng(1)
    for src in dists[:4]:
        for dst in dists:
            plan = dt.redistribution_plan(src, dst)
            x = dt.DistArray.from_global(put(rng.standard_normal(shape), place), src)
            yl = rng.standard_normal(dst.local_shape())
            y = dt.DistArray.from_local(put(yl, place), dst)
            lhs = all_sum(np.vdot(to_numpy(plan(x).local), yl))
            back = plan.adjoint(y)
            check_place(back, place)
            rhs = all_sum(np.vdot(to_numpy(x.local), to_numpy(back.local)))
            collective_assert(np.isclose(lhs, rhs), f"{lhs} != {rhs} for {src} -> {dst}")


# ------------------------------------------------------------------------ halos
def expected_extended(a, dist, pairs, mode, constant_values):
    kw = {"constant_values": constant_values} if mode == "constant" else {}
    padded = np.pad(a, pairs, mode=mode, **kw)
    return padded[tuple(slice(s.start, s.stop + lo + hi)
                        for s, (lo, hi) in zip(dist.local_slices(), pairs))]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_exchange_halo(place, mode):
    g = global_array((7, 5))
    for dist in layouts(g.shape)[:5]:
        for widths in [((1, 2), (2, 1)), ((3, 0), (0, 4))]:
            x = dt.DistArray.from_global(put(g, place), dist)
            ext = x.exchange_halo(widths, mode, constant_values=(-1.5, 2))
            check_place(ext, place)
            want = expected_extended(g, dist, widths, mode, (-1.5, 2))
            assert_equal(to_numpy(ext), want)
            # a second exchange into the grown margins, and the non-blocking form
            plan = dt.halo_plan(dist, widths, mode)
            again = plan.start(x, (-1.5, 2)).finish()
            assert_equal(to_numpy(again), want)


@pytest.mark.parallel(SIZES)
def test_exchange_halo_int(place):
    g = global_array((6, 4), np.int32)
    dist = layouts(g.shape)[2]
    x = dt.DistArray.from_global(put(g, place), dist)
    ext = x.exchange_halo(2, "constant", constant_values=7)
    assert_equal(to_numpy(ext), expected_extended(g, dist, ((2, 2), (2, 2)), "constant", 7))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_halo_accumulate_adjoint(place, mode):
    """``<exchange(x), e> == <x, accumulate(e)>`` with blocks of any module."""
    shape = (7, 5)
    rng = np.random.default_rng(3)
    widths = ((2, 1), (1, 3))
    for dist in layouts(shape)[:5]:
        x = dt.DistArray.from_global(put(rng.standard_normal(shape), place), dist)
        ext_shape = tuple(n + lo + hi for n, (lo, hi) in zip(dist.local_shape(), widths))
        e = rng.standard_normal(ext_shape)
        lhs = all_sum(np.vdot(to_numpy(x.exchange_halo(widths, mode, copy=True)), e))
        acc = dt.halo_accumulate(put(e, place), dist, widths, mode)
        check_place(acc, place)
        rhs = all_sum(np.vdot(to_numpy(x.local), to_numpy(acc.local)))
        collective_assert(np.isclose(lhs, rhs), f"{lhs} != {rhs} for {dist}")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_exchange_block_and_its_adjoint_of_any_module(place, mode):
    """``HaloPlan.exchange_block`` / ``accumulate_block`` on plain blocks of any module and
    device: new arrays in the block's place, ``numpy.pad``'s values, the adjoint identity."""
    g = global_array((7, 5))
    rng = np.random.default_rng(4)
    widths = ((2, 1), (1, 3))
    for dist in layouts(g.shape)[:5]:
        plan = dt.halo_plan(dist, widths, mode)
        block = put(g[dist.local_slices()], place)
        ext = plan.exchange_block(block, (-1.5, 2))
        check_place(ext, place)
        assert_equal(to_numpy(ext), expected_extended(g, dist, widths, mode, (-1.5, 2)))
        e = rng.standard_normal(ext.shape)
        acc = plan.accumulate_block(put(e, place))
        check_place(acc, place)
        lhs = all_sum(np.vdot(to_numpy(plan.exchange_block(block, 0)), e))
        rhs = all_sum(np.vdot(to_numpy(block), to_numpy(acc)))
        collective_assert(np.isclose(lhs, rhs) and tuple(acc.shape) == dist.local_shape(),
                          f"{lhs} != {rhs} for {dist}")


# ------------------------------------------------------------------------ allreduce
@pytest.mark.parallel(SIZES)
def test_allreduce(place):
    from disttensor_nn.reduction import allreduce_

    base = np.arange(12.0).reshape(3, 4)
    local = base * (comm.Get_rank() + 1)
    total = base * sum(range(1, comm.Get_size() + 1))
    out = allreduce(put(local, place), comm, MPI.SUM)
    check_place(out, place)
    np.testing.assert_array_equal(to_numpy(out), total)
    out = allreduce(put(local, place), comm, MPI.MAX)
    np.testing.assert_array_equal(to_numpy(out), base * comm.Get_size())
    arr = put(local, place)
    assert allreduce_(arr, comm) is arr  # in place, whatever the transport
    np.testing.assert_array_equal(to_numpy(arr), total)


@pytest.mark.parallel(SIZES)
def test_transport_choice(place):
    xp, _ = place
    t = transport_for(xp)
    collective_assert(t.direct == (xp is np) and not t.nccl, repr(t))


# ------------------------------------------------------------------------ NumPy protocol
@pytest.mark.parallel(SIZES)
def test_numpy_protocol_needs_numpy_blocks():
    """The NumPy-style operations refuse blocks of other array API libraries, on every rank."""
    g = global_array((6, 4))
    dist = layouts(g.shape)[0]
    x = dt.DistArray.from_global(xps.asarray(g), dist)
    for op in (lambda: x.sum(), lambda: x + 1, lambda: np.sin(x), lambda: x[1:3],
               lambda: np.concatenate([x, x]), lambda: x.reshape(24), lambda: x.T,
               lambda: x.__array_namespace__()):
        with pytest.raises(TypeError, match="NumPy or CuPy blocks"):
            op()
