"""tile, repeat, meshgrid, tensordot against NumPy; DLPack export and zero-copy blocks."""

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor import DistArray
from disttensor.testing import assert_equal, collective_assert, collective_outcome
from disttensor.testing.numpy_compare import check_like_numpy, layouts

parallel = pytest.mark.parallel([1, 2, 3, 4])


def _xp(x):
    return x.__array_namespace__()


@parallel
def test_tile_and_repeat_like_numpy():
    for reps in [(2,), (2, 3), (1, 2, 1), (0, 2)]:
        check_like_numpy(lambda a, r=reps: np.tile(a, r), lambda x, r=reps: _xp(x).tile(x, r),
                         shapes=[(3, 4), (0, 2)], name=f"tile {reps}")
    for axis in (None, 0, 1):
        check_like_numpy(lambda a, ax=axis: np.repeat(a, 2, axis=ax),
                         lambda x, ax=axis: _xp(x).repeat(x, 2, axis=ax),
                         shapes=[(3, 4)], name=f"repeat axis={axis}")
    check_like_numpy(lambda a: np.repeat(a, [1, 0, 3], axis=0),
                     lambda x: _xp(x).repeat(x, np.array([1, 0, 3]), axis=0),
                     shapes=[(3, 2)], dtypes=[np.int32], name="repeat counts")


@parallel
def test_tensordot_like_numpy():
    for axes in (0, 1, 2, ([1, 0], [0, 1]), ([0], [1])):
        check_like_numpy(lambda a, b, ax=axes: np.tensordot(a, b, axes=ax),
                         lambda x, y, ax=axes: _xp(x).tensordot(x, y, axes=ax),
                         shapes=[((3, 4), (4, 3))], mixed=True, name=f"tensordot {axes}")


@parallel
def test_meshgrid_like_numpy():
    vals = [np.arange(n, dtype=np.float64) for n in (3, 4, 2)]
    for k in range(len(layouts((4,)))):
        xs = [DistArray.from_global(v, layouts(v.shape)[k % len(layouts(v.shape))])
              for v in vals]
        for indexing in ("xy", "ij"):
            for n in (1, 2, 3):
                got = _xp(xs[0]).meshgrid(*xs[:n], indexing=indexing)
                for g, w in zip(got, np.meshgrid(*vals[:n], indexing=indexing)):
                    assert_equal(g, w)


@parallel
def test_dlpack_whole_arrays_export_split_ones_point_to_local():
    comm = MPI.COMM_WORLD
    g = np.arange(12.0).reshape(3, 4)
    rep = DistArray.from_global(g, dt.Distribution(g.shape, dt.ProcessGrid((comm.size,)),
                                                   (None, None)))
    back = np.from_dlpack(rep)
    collective_assert(np.shares_memory(back, rep.local) and np.array_equal(back, g),
                      "a replicated array is exported without a copy")
    collective_assert(rep.__dlpack_device__() == (1, 0), "CPU device")
    split = DistArray.from_global(g, layouts(g.shape)[0])
    _, err = collective_outcome(np.from_dlpack, split) if comm.size > 1 else (None, None)
    collective_assert(comm.size == 1 or (isinstance(err, BufferError) and ".local" in str(err)),
                      f"expected a BufferError naming .local, got {err!r}")
    y = _xp(rep).from_dlpack(np.arange(5.0))
    assert_equal(y, np.arange(5.0))


@parallel
def test_local_blocks_exchange_zero_copy_with_numpy_and_torch():
    torch = pytest.importorskip("torch")
    x = DistArray.from_global(np.arange(24.0).reshape(4, 6), layouts((4, 6))[-1])
    t = torch.from_dlpack(x.local)
    t += 1.0  # writes x's block
    whole = x.to_global()  # collective: before any per-rank condition
    n = np.from_dlpack(x.local)
    back = torch.from_dlpack(x.local).numpy()
    shared = x.local.size == 0 or (np.shares_memory(n, x.local)
                                   and np.shares_memory(back, x.local))
    ok = shared and np.array_equal(whole, np.arange(24.0).reshape(4, 6) + 1)
    collective_assert(ok, "the blocks were copied")
