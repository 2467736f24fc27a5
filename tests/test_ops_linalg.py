"""Matrix products on DistArrays (SUMMA) against NumPy."""

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor import DistArray, ProcessGrid
from disttensor.ops import implicit_redistribution, matmul_distributions
from disttensor.redistribute import redistribution_plan
from disttensor.testing import assert_allclose, collective_assert
from disttensor.testing.numpy_compare import check_like_numpy, sample

parallel = pytest.mark.parallel([1, 2, 3, 4])

SHAPES = [((4, 3), (3, 5)), ((7, 6), (6, 2)), ((5,), (5, 3)), ((4, 5), (5,)), ((5,), (5,)),
          ((0, 3), (3, 2)), ((3, 0), (0, 2)), ((1, 4), (4, 1))]


@parallel
def test_matmul_every_layout_pair():
    check_like_numpy(lambda a, b: a @ b, shapes=SHAPES, dtypes=[np.float64], mixed=True,
                     name="a @ b")
    check_like_numpy(np.matmul, shapes=SHAPES[:3],
                     dtypes=[np.int64, np.complex128, (np.float32, np.int32), np.bool_],
                     max_layouts=3)


@parallel
def test_matmul_errors():
    check_like_numpy(np.matmul, shapes=[((4, 3), (4, 3)), ((), (3,))], max_layouts=2,
                     name="mismatch")


@parallel
def test_dot_family():
    check_like_numpy(np.dot, shapes=[((4, 3), (3, 5)), ((5,), (5,)), ((), (4,)),
                                     ((3, 4), (4,))], mixed=True)
    check_like_numpy(np.vdot, shapes=[((4, 3), (4, 3)), ((6,), (6,))],
                     dtypes=[np.complex128], mixed=True)
    check_like_numpy(np.inner, shapes=[((6,), (6,))], mixed=True)
    check_like_numpy(np.outer, shapes=[((4,), (3,)), ((2, 2), (3,))], mixed=True)
    check_like_numpy(np.vecdot, shapes=[((4, 3), (4, 3)), ((4, 3), (3,))], mixed=True,
                     dtypes=[np.float64, np.complex128])
    check_like_numpy(lambda a, b: a.dot(b), shapes=[((4, 3), (3, 2))], name="a.dot")


@parallel
def test_summa_layout_and_explicit_mode():
    """Inputs already in the SUMMA layouts: no implicit move, result in the third layout."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(sorted(MPI.Compute_dims(comm.size, 2)))
    ga, gb = sample((9, 7)), sample((7, 8), seed=1)
    a = dt.asarray(ga, grid=grid, axes=(0, 1))
    b = dt.asarray(gb, grid=grid, axes=(None, 0))
    da, db, dc = matmul_distributions(a.dist, b.dist)
    with implicit_redistribution(False):
        try:
            a @ b
            refused = all(redistribution_plan(s, t).local_only
                          for s, t in ((a.dist, da), (b.dist, db)))
        except ValueError:
            refused = True
        c = a.redistribute(da) @ b.redistribute(db)
    collective_assert(refused and c.dist == dc and set(dc.replica_axes) <= {
        x for x in range(grid.ndim) if grid.shape[x] == 1}, f"{dc}", comm)
    assert_allclose(c, ga @ gb, rtol=1e-12)


@parallel
def test_matmul_with_numpy_operand():
    g = sample((5, 4))
    m = sample((4, 3), seed=3)
    check_like_numpy(lambda x: x @ m, shapes=[(5, 4)], name="x @ numpy")
    check_like_numpy(lambda x: m.T @ x.T, shapes=[(5, 4)], name="numpy @ x")
    x = DistArray.from_global(g, dt.Distribution((5, 4), ProcessGrid((MPI.COMM_WORLD.size,))))
    assert_allclose(np.matmul(x, m, out=dt.zeros((5, 3))), g @ m, rtol=1e-12)


@parallel
def test_norms():
    cases = [
        (lambda x: np.linalg.norm(x), "norm"), (lambda x: np.linalg.norm(x, axis=1), "axis=1"),
        (lambda x: np.linalg.norm(x, 1, axis=0), "ord=1"),
        (lambda x: np.linalg.norm(x, np.inf), "matrix inf"),
        (lambda x: np.linalg.norm(x, -1, keepdims=True), "matrix -1"),
        (lambda x: np.linalg.norm(x, 3, axis=0), "ord=3"),
        (lambda x: np.linalg.norm(x, 0, axis=1), "ord=0"),
        (lambda x: np.linalg.vector_norm(x, ord=-np.inf), "vector_norm"),
        (lambda x: np.linalg.matrix_norm(x), "matrix_norm"),
    ]
    for f, name in cases:
        check_like_numpy(f, shapes=[(6, 5)], dtypes=[np.float64, np.complex128, np.int32],
                         max_layouts=4, name=name)
