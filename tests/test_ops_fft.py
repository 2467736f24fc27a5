"""The fft extension on DistArrays against numpy.fft, over every layout of the test helper."""

import warnings

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
import disttensor.ops.fft as F
import disttensor.ops.gathering as gathering
from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.testing import assert_allclose, collective_assert
from disttensor.testing.numpy_compare import check_like_numpy, sample

parallel = pytest.mark.parallel([1, 2, 3, 4])

FFT_NAMES = ["fft", "ifft", "fftn", "ifftn", "rfft", "irfft", "rfftn", "irfftn", "hfft",
             "ihfft", "fftfreq", "rfftfreq", "fftshift", "ifftshift"]


@parallel
def test_one_dimensional_transforms_like_numpy():
    for name in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft"):
        ours, ref = getattr(F, name), getattr(np.fft, name)
        real_in = name in ("rfft", "ihfft")
        dtypes = [np.float64, np.float32] if real_in else [np.complex128, np.complex64]
        for kw in ({}, {"axis": 0}, {"n": 7, "norm": "ortho"}, {"n": 3, "axis": 0,
                                                               "norm": "forward"}):
            check_like_numpy(lambda a, kw=kw, ref=ref: ref(a, **kw),
                             lambda a, kw=kw, ours=ours: ours(a, **kw),
                             shapes=[(6, 5)], dtypes=dtypes[:1] if kw else dtypes,
                             name=f"{name}{kw}")
    # split 1-D arrays: composite lengths by the four-step method, primes gathered
    for ref, ours in ((np.fft.fft, F.fft), (np.fft.ifft, F.ifft)):
        name = ours.__name__
        for norm in ("backward", "ortho"):
            check_like_numpy(lambda a, f=ref, norm=norm: f(a, norm=norm),
                             lambda a, f=ours, norm=norm: f(a, norm=norm),
                             shapes=[(12,), (30,), (7,)], dtypes=[np.complex128],
                             name=f"{name} 1-D {norm}")
    check_like_numpy(np.fft.fft, F.fft, shapes=[(9,), (0, 4)], dtypes=[np.int64, np.complex64],
                     name="fft 1-D")
    check_like_numpy(np.fft.rfft, F.rfft, shapes=[(10,)], name="rfft 1-D")


@parallel
def test_n_dimensional_transforms_like_numpy():
    cases = [({}, (4, 6, 5)), ({"axes": (0, 2)}, (4, 6, 5)), ({"s": (5, 3), "axes": (2, 0)},
                                                             (4, 6, 5)),
             ({"axes": (1, 1)}, (4, 6)), ({"norm": "ortho"}, (7, 3)), ({"axes": ()}, (3, 2))]
    for name in ("fftn", "ifftn", "rfftn", "irfftn"):
        ours, ref = getattr(F, name), getattr(np.fft, name)
        dtype = np.float64 if name == "rfftn" else np.complex128
        for kw, shape in cases:
            if name in ("rfftn", "irfftn") and kw.get("axes") in ((1, 1), ()):
                continue
            check_like_numpy(lambda a, kw=kw, ref=ref: ref(a, **kw),
                             lambda a, kw=kw, ours=ours: ours(a, **kw),
                             shapes=[shape], dtypes=[dtype], name=f"{name}{kw}")
    check_like_numpy(np.fft.fftn, F.fftn, shapes=[(5, 4)], dtypes=[np.complex64, np.float32],
                     max_layouts=3)


@parallel
def test_bad_arguments_raise_numpys_exceptions():
    for kw in ({"norm": "x"}, {"n": 0}, {"axis": 2}, {"n": 2.5}):
        check_like_numpy(lambda a, kw=kw: np.fft.fft(a, **kw),
                         lambda a, kw=kw: F.fft(a, **kw), shapes=[(4, 3)],
                         dtypes=[np.complex128], max_layouts=2, name=f"fft{kw}")
    check_like_numpy(lambda a: np.fft.fftn(a, s=(3,), axes=(0, 1)),
                     lambda a: F.fftn(a, s=(3,), axes=(0, 1)), shapes=[(4, 3)],
                     max_layouts=2, name="fftn s/axes")
    check_like_numpy(np.fft.rfft, F.rfft, shapes=[(4, 3)], dtypes=[np.complex128],
                     max_layouts=2, name="rfft of complex")
    check_like_numpy(np.fft.irfft, F.irfft, shapes=[(4, 1)], dtypes=[np.complex128],
                     max_layouts=2, name="irfft to length 0")
    x = dt.zeros((4, 3), dtype=np.complex128)
    bad = [lambda: F.fft(np.zeros(3)), lambda: F.fft(x, out_dist="natural"),
           lambda: F.fft(x, out_dist=x.dist.replace(global_shape=(4, 4)))]
    raised = []
    for f in bad:
        try:
            f()
            raised.append(None)
        except (TypeError, ValueError) as exc:
            raised.append(type(exc).__name__)
    collective_assert(raised == ["TypeError", "TypeError", "ValueError"], str(raised))


def _grid2(comm):
    return ProcessGrid(sorted(MPI.Compute_dims(comm.size, 2)))


@parallel
def test_pencil_and_slab_layouts_and_output_distribution():
    """Slab and pencil inputs with uneven blocks: values, result layout, number of moves."""
    comm = MPI.COMM_WORLD
    p = comm.size
    g1, g2 = ProcessGrid((p,)), _grid2(comm)
    a = sample((7, 6, 5), np.complex128)
    slab = Distribution(a.shape, g1, (0, None, None))
    pencil = Distribution(a.shape, g2, (0, 1, None), [[2] * (g2.shape[0] - 1), None, None])
    want = np.fft.fftn(a)
    report = []
    for dist, moves in ((slab, 1 if p > 1 else 0),
                        (pencil, sum(s > 1 for s in g2.shape))):
        x = DistArray.from_global(a, dist)
        y = F.fftn(x)
        plan = F.fft_plan(dist, tuple(F.Transform(ax, "fft", n)
                                      for ax, n in ((2, 5), (1, 6), (0, 7))), "transposed")
        yt = F.fftn(x, out_dist="transposed")
        back = F.ifftn(yt, out_dist=dist)
        target = Distribution(a.shape, g1, (None, 0, None))
        yd = F.fftn(x, out_dist=target)
        report.append((y.dist == dist, plan.redistributions == moves, yt.dist == plan.out_dist,
                       back.dist == dist, yd.dist == target))
        assert_allclose(y, want, rtol=1e-10, atol=1e-10)
        assert_allclose(yt, want, rtol=1e-10, atol=1e-10)
        assert_allclose(yd, want, rtol=1e-10, atol=1e-10)
        assert_allclose(back, a, rtol=1e-10, atol=1e-12)
    collective_assert(all(all(r) for r in report), str(report), comm)


@parallel
def test_round_trip_and_parseval_at_both_precisions():
    comm = MPI.COMM_WORLD
    grid = _grid2(comm)
    for dtype, tol in ((np.complex128, 1e-12), (np.complex64, 1e-5)):
        a = sample((6, 9, 4), dtype)
        x = DistArray.from_global(a, Distribution(a.shape, grid, (1, None, 0)))
        y = F.fftn(x, norm="ortho", out_dist="transposed")
        back = F.ifftn(y, norm="ortho")
        energy_x = float(np.sum(np.abs(x) ** 2))
        energy_y = float(np.sum(np.abs(y) ** 2))
        ok = abs(energy_x - energy_y) <= tol * 10 * energy_x and y.dtype == dtype
        collective_assert(ok, f"Parseval {dtype}: {energy_x} vs {energy_y}", comm)
        assert_allclose(back, a, rtol=tol * 10, atol=tol * 10)
        r = sample((6, 9, 4), np.float64 if dtype == np.complex128 else np.float32)
        xr = DistArray.from_global(r, Distribution(r.shape, grid, (0, 1, None)))
        assert_allclose(F.irfftn(F.rfftn(xr), s=r.shape), r, rtol=tol * 10, atol=tol * 10)


@parallel
def test_frequencies_and_shifts_like_numpy():
    comm = MPI.COMM_WORLD
    grid = ProcessGrid((comm.size,))
    for n, d in ((1, 1.0), (8, 0.5), (9, 2.0)):
        assert_allclose(F.fftfreq(n, d=d), np.fft.fftfreq(n, d), rtol=0)
        assert_allclose(F.rfftfreq(n, d=d, grid=grid, axes=(0,),
                                   splits=[[0] * (comm.size - 1)]),
                        np.fft.rfftfreq(n, d), rtol=0)
    f32 = F.fftfreq(5, dtype=np.float32)
    collective_assert(f32.dtype == np.float32, str(f32.dtype), comm)
    for kw in ({}, {"axes": 0}, {"axes": (1, 0)}, {"axes": ()}):
        check_like_numpy(lambda a, kw=kw: np.fft.fftshift(a, **kw),
                         lambda a, kw=kw: F.fftshift(a, **kw), shapes=[(5, 4), (3,)],
                         name=f"fftshift{kw}")
        check_like_numpy(lambda a, kw=kw: np.fft.ifftshift(a, **kw),
                         lambda a, kw=kw: F.ifftshift(a, **kw), shapes=[(5, 4)],
                         name=f"ifftshift{kw}")


@parallel
def test_namespace_extensions_hold_the_standards_names(monkeypatch):
    comm = MPI.COMM_WORLD
    xp = dt.zeros(4).__array_namespace__()
    fft_names = sorted(n for n in dir(xp.fft) if not n.startswith("_"))
    collective_assert(fft_names == sorted(FFT_NAMES), str(fft_names), comm)
    a = sample((5,), np.complex128)
    x = xp.asarray(a)
    assert_allclose(xp.fft.ifft(xp.fft.fft(x)), a, rtol=1e-12)
    # a split 1-D array of prime length is gathered (warned above the threshold); of
    # composite length it is not, nor is a 2-D one
    monkeypatch.setattr(gathering, "GATHER_WARN_BYTES", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.fft(x)
        F.fft(xp.reshape(x, (5, 1)), axis=0)  # the other axis takes the grid axis
        F.ifft(xp.asarray(sample((6,), np.complex128)))
    kinds = [w.category for w in caught]
    want = [gathering.GatherWarning] if comm.size > 1 else []
    collective_assert(kinds == want, str(kinds), comm)
