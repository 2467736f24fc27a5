"""The core operations with CuPy blocks on GPUs, through every transport the machine offers.

Skipped without CuPy or without a GPU. Each test runs with host staging
(page-locked buffers) and, where the MPI library reports CUDA support or
``DISTTENSOR_GPU_AWARE_MPI=1`` says so, with device buffers handed to MPI.
Expected values come from NumPy on the global array.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_sum

import disttensor as dt
from disttensor.backend import to_numpy
from disttensor.testing import assert_equal, collective_assert
from disttensor.transport import allreduce, transport_for

cupy = pytest.importorskip("cupy")
try:
    _GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception:  # no driver or no device
    _GPUS = 0
if _GPUS == 0:
    pytest.skip("no GPU visible to CuPy", allow_module_level=True)

SIZES = [1, 2]
MODES = ("constant", "wrap", "reflect", "symmetric", "edge")
comm = MPI.COMM_WORLD


def _transports():
    out = [False]
    dt.set_transport()
    if dt.gpu_aware_mpi():
        out.append(True)
    return out


@pytest.fixture(params=_transports(), ids=lambda v: "gpu-aware" if v else "staged")
def gpu(request):
    """CuPy on this rank's GPU, with the transport forced for the test."""
    xp = dt.use_device("gpu")
    dt.set_transport(gpu_aware_mpi=request.param)
    collective_assert(transport_for(xp).direct == request.param)
    yield xp
    dt.set_transport()


def layouts(shape):
    p = comm.Get_size()
    g1 = dt.ProcessGrid(p)
    cuts = [min(shape[0], 3 * i) for i in range(p - 1)]
    return [
        dt.Distribution(shape, g1, (0, None)),
        dt.Distribution(shape, g1, (None, 0)),
        dt.Distribution(shape, g1, (0, None), [cuts, None]),
        dt.Distribution(shape, g1, (None, None)),
    ]


def global_array(shape, dtype=np.float64):
    return (np.arange(np.prod(shape)) * 1.5 - 7).astype(dtype).reshape(shape)


@pytest.mark.parallel(SIZES)
def test_device_choice():
    xp = dt.use_device("gpu")
    collective_assert(xp is cupy)
    collective_assert(cupy.cuda.Device().id == dt.node_local_rank() % _GPUS)
    x = dt.zeros((5, 3), device="gpu")
    collective_assert(isinstance(x.local, cupy.ndarray))


@pytest.mark.parallel(SIZES)
def test_from_global_to_global(gpu):
    g = global_array((7, 5))
    for dist in layouts(g.shape):
        x = dt.DistArray.from_global(gpu.asarray(g), dist)
        collective_assert(isinstance(x.local, cupy.ndarray))
        assert_equal(x.to_global(), g)
        y = dt.DistArray.from_global(gpu.asarray(g) if comm.Get_rank() == 0 else None, dist,
                                     root=0)
        collective_assert(isinstance(y.local, cupy.ndarray))
        assert_equal(to_numpy(y.local), g[dist.local_slices()])


@pytest.mark.parallel(SIZES)
def test_redistribute(gpu):
    g = global_array((7, 5), np.float32)
    dists = layouts(g.shape)
    for src in dists:
        x = dt.DistArray.from_global(g, src, device="gpu")
        for dst in dists:
            y = x.redistribute(dst)
            collective_assert(isinstance(y.local, cupy.ndarray))
            assert_equal(to_numpy(y.local), g[dst.local_slices()])


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_exchange_halo(gpu, mode):
    g = global_array((7, 5))
    widths = ((2, 1), (1, 3))
    for dist in layouts(g.shape)[:3]:
        x = dt.DistArray.from_global(g, dist, device="gpu")
        ext = x.exchange_halo(widths, mode, constant_values=-2)
        collective_assert(isinstance(ext, cupy.ndarray))
        kw = {"constant_values": -2} if mode == "constant" else {}
        padded = np.pad(g, widths, mode=mode, **kw)
        want = padded[tuple(slice(s.start, s.stop + lo + hi)
                            for s, (lo, hi) in zip(dist.local_slices(), widths))]
        assert_equal(to_numpy(ext), want)
        # adjoint identity
        e = np.random.default_rng(0).standard_normal(ext.shape)
        lhs = all_sum(np.vdot(to_numpy(ext), e))
        acc = dt.halo_accumulate(cupy.asarray(e), dist, widths, mode)
        rhs = all_sum(np.vdot(to_numpy(x.local), to_numpy(acc.local)))
        collective_assert(np.isclose(lhs, rhs), f"{lhs} != {rhs}")


@pytest.mark.parallel(SIZES)
def test_allreduce(gpu):
    from disttensor_nn.reduction import allreduce_

    base = np.arange(12.0).reshape(3, 4)
    total = base * sum(range(1, comm.Get_size() + 1))
    out = allreduce(cupy.asarray(base * (comm.Get_rank() + 1)), comm, MPI.SUM)
    collective_assert(isinstance(out, cupy.ndarray))
    np.testing.assert_array_equal(to_numpy(out), total)
    arr = cupy.asarray(base * (comm.Get_rank() + 1))
    allreduce_(arr, comm)
    np.testing.assert_array_equal(to_numpy(arr), total)
    x = dt.DistArray.from_global(base, layouts(base.shape)[0], device="gpu")
    np.testing.assert_allclose(float(x.sum()), base.sum())
