"""The linalg extension (``xp.linalg``) against numpy.linalg and the factorisations' identities."""

import warnings

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
import disttensor.ops.gathering as gathering
import disttensor.ops.linalg_ext as L
from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.testing import assert_allclose, collective_assert, collective_outcome
from disttensor.testing.numpy_compare import check_like_numpy, layouts, sample

parallel = pytest.mark.parallel([1, 2, 3, 4])

NAMES = ["cholesky", "cross", "det", "diagonal", "eigh", "eigvalsh", "inv", "matmul",
         "matrix_norm", "matrix_power", "matrix_rank", "matrix_transpose", "outer", "pinv",
         "qr", "slogdet", "solve", "svd", "svdvals", "tensordot", "trace", "vecdot",
         "vector_norm"]
TOL = {np.float64: 1e-9, np.float32: 2e-3}


def _spd(shape, dtype, seed=0):
    """Well-conditioned Hermitian positive-definite matrices."""
    a = sample(shape, dtype, seed=seed)
    n = shape[-1]
    return (a @ np.swapaxes(a, -1, -2).conj() / n + np.eye(n, dtype=dtype) * 2).astype(dtype)


def _each_layout(a, fn, limit=None, comm=MPI.COMM_WORLD):
    """``fn(x)`` for ``a`` distributed in every layout of the test helper (or the first)."""
    for dist in layouts(a.shape, comm)[:limit]:
        yield dist, fn(DistArray.from_global(a, dist))


@parallel
def test_namespace_holds_exactly_the_standards_names():
    comm = MPI.COMM_WORLD
    xp = dt.zeros(3).__array_namespace__()
    names = sorted(n for n in dir(xp.linalg) if not n.startswith("_"))
    collective_assert(names == NAMES and not hasattr(xp.linalg, "dot"), str(names), comm)


@parallel
def test_local_per_matrix_functions_like_numpy():
    for dtype, shapes, names in (
            (np.float64, ((3, 4, 4), (5, 5)), ("det", "inv", "eigvalsh", "matrix_rank",
                                               "svdvals", "trace")),
            (np.float32, ((3, 4, 4),), ("det", "inv"))):
        tol = TOL[dtype]
        for shape in shapes:
            spd = _spd(shape, dtype)
            for name in names:
                want = getattr(np.linalg, name)(spd)
                for _, got in _each_layout(spd, getattr(L, name), 3):
                    assert_allclose(got, want, rtol=tol, atol=tol)
            for _, (sign, logdet) in _each_layout(spd, L.slogdet):
                assert_allclose(sign, np.linalg.slogdet(spd)[0], rtol=tol)
                assert_allclose(logdet, np.linalg.slogdet(spd)[1], rtol=tol)
    for kw in ({}, {"offset": 1}, {"offset": -2}):
        check_like_numpy(lambda a, kw=kw: np.linalg.diagonal(a, **kw),
                         lambda a, kw=kw: L.diagonal(a, **kw), shapes=[(2, 3, 4), (5, 3)],
                         name=f"diagonal{kw}")
    check_like_numpy(lambda a: np.linalg.trace(a, offset=1), lambda a: L.trace(a, offset=1),
                     shapes=[(3, 4), (2, 3, 3)], dtypes=[np.int64, np.float64])
    check_like_numpy(lambda a: np.linalg.matrix_power(a, 3), lambda a: L.matrix_power(a, 3),
                     shapes=[(2, 3, 3), (4, 4)], rtol=1e-9)
    check_like_numpy(lambda a: np.linalg.matrix_power(a, 0), lambda a: L.matrix_power(a, 0),
                     shapes=[(3, 3)], dtypes=[np.int64])
    check_like_numpy(lambda a: np.linalg.pinv(a, rtol=None), L.pinv,
                     shapes=[(2, 4, 3), (3, 5), (5, 2)], rtol=1e-8, atol=1e-10, name="pinv")


@parallel
def test_cholesky_eigh_and_solve_identities_at_both_precisions():
    for dtype in (np.float64, np.float32):
        tol = TOL[dtype]
        for shape in ((2, 5, 5), (6, 6)):
            a = _spd(shape, dtype, seed=3)
            for _, low in _each_layout(a, L.cholesky):
                g = low.to_global()
                ok = np.allclose(g @ np.swapaxes(g, -1, -2).conj(), a, rtol=tol, atol=tol) \
                    and np.allclose(np.triu(g, 1), 0) and low.dtype == dtype
                collective_assert(ok, f"L L^H != A {dtype} {shape}")
            for _, up in _each_layout(a, lambda x: L.cholesky(x, upper=True)):
                assert_allclose(up, np.linalg.cholesky(a, upper=True), rtol=tol, atol=tol)
            for _, (w, v) in _each_layout(a, L.eigh):
                gw, gv = w.to_global(), v.to_global()
                ok = np.allclose(a @ gv, gv * gw[..., None, :], rtol=tol, atol=tol * 10)
                collective_assert(ok, f"A V != V diag(w) {dtype} {shape}")
                assert_allclose(w, np.linalg.eigvalsh(a), rtol=tol, atol=tol)
            b = sample(shape[:-1] + (2,), dtype, seed=4)
            bv = sample(shape[-1:], dtype, seed=5)
            for k, dist in enumerate(layouts(shape)):
                x = DistArray.from_global(a, dist)
                for rhs in (b, bv):
                    rl = layouts(rhs.shape)
                    sol = L.solve(x, DistArray.from_global(rhs, rl[k % len(rl)]))
                    assert_allclose(sol, np.linalg.solve(a, rhs), rtol=tol * 10,
                                    atol=tol * 10)


@parallel
def test_qr_svd_identities_tall_skinny_and_general():
    comm = MPI.COMM_WORLD
    p = comm.size
    for dtype in (np.float64, np.float32):
        tol = TOL[dtype]
        shapes = ((4 * p * 3 + 1, 3), (6, 4), (2, 5, 3), (3, 5))
        for shape in shapes if dtype == np.float64 else shapes[:1]:
            a = sample(shape, dtype, seed=7)
            for mode in ("reduced", "complete"):
                for dist, (q, r) in _each_layout(a, lambda x, mode=mode: L.qr(x, mode=mode),
                                                 None if shape == shapes[0] else 2):
                    gq, gr = q.to_global(), r.to_global()
                    eye = np.eye(gq.shape[-1])
                    ok = (np.allclose(np.swapaxes(gq, -1, -2).conj() @ gq, eye, atol=tol * 10)
                          and np.allclose(gq @ gr, a, rtol=tol * 10, atol=tol * 10)
                          and np.allclose(np.tril(gr, -1), 0)
                          and np.allclose(np.abs(gr), np.abs(np.linalg.qr(a, mode)[1]),
                                          rtol=tol * 10, atol=tol * 10)
                          and q.dtype == dtype and q.shape == np.linalg.qr(a, mode)[0].shape)
                    collective_assert(ok, f"qr {mode} {shape} {dtype} {dist}")
            for full in (False, True):
                for dist, (u, s, vh) in _each_layout(a, lambda x, f=full: L.svd(
                        x, full_matrices=f), None if shape == shapes[0] else 2):
                    gu, gs, gvh = u.to_global(), s.to_global(), vh.to_global()
                    k = gs.shape[-1]
                    rec = (gu[..., :k] * gs[..., None, :]) @ gvh[..., :k, :]
                    ok = (np.allclose(rec, a, rtol=tol * 10, atol=tol * 10)
                          and np.allclose(gs, np.linalg.svd(a, compute_uv=False), rtol=tol,
                                          atol=tol)
                          and np.allclose(np.swapaxes(gu, -1, -2) @ gu, np.eye(gu.shape[-1]),
                                          atol=tol * 10)
                          and gu.shape == np.linalg.svd(a, full_matrices=full)[0].shape)
                    collective_assert(ok, f"svd full={full} {shape} {dtype} {dist}")
        # the tall-skinny functions against NumPy on a rank-deficient matrix
        a = sample((4 * p * 3 + 2, 3), dtype, seed=9)
        a[:, 2] = a[:, 0] + a[:, 1]
        for name in ("svdvals", "matrix_rank", "pinv"):
            for _, got in _each_layout(a, getattr(L, name)):
                want = getattr(np.linalg, name)(a, **({"rtol": None} if name == "pinv"
                                                       else {}))
                assert_allclose(got, want, rtol=tol * 100, atol=tol * 100)


@parallel
def test_tsqr_keeps_rows_in_place_and_gathers_nothing(monkeypatch):
    comm = MPI.COMM_WORLD
    grid = ProcessGrid((comm.size,))
    a = sample((7 * comm.size + 5, 4), seed=2)
    cuts = [min(a.shape[0], 3 + 7 * i) for i in range(1, comm.size)]
    x = DistArray.from_global(a, Distribution(a.shape, grid, (0, None), [cuts, None]))
    monkeypatch.setattr(gathering, "GATHER_WARN_BYTES", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q, r = L.qr(x)
        L.svd(x, full_matrices=False)
        batched = DistArray.from_global(_spd((comm.size + 1, 3, 3), np.float64),
                                        Distribution((comm.size + 1, 3, 3), grid))
        L.inv(batched)
    quiet = [w for w in caught if w.category is gathering.GatherWarning] == []
    in_place = comm.size == 1 or q.dist == x.dist
    collective_assert(quiet and in_place and r.dist.axes == (None, None),
                      f"{[str(w.message) for w in caught]} {q.dist}", comm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.inv(DistArray.from_global(_spd((5, 5), np.float64), Distribution((5, 5), grid)))
    kinds = [w.category for w in caught]
    collective_assert(kinds == ([gathering.GatherWarning] if comm.size > 1 else []),
                      str(kinds), comm)


@parallel
def test_errors_alike_on_every_rank():
    comm = MPI.COMM_WORLD
    sing = np.ones((2, 4, 4))
    sing[0] = np.eye(4)
    grid = ProcessGrid((comm.size,))
    x = DistArray.from_global(sing, Distribution(sing.shape, grid))  # one rank singular
    for fn in (L.inv, L.cholesky, lambda v: L.solve(v, v)):
        _, exc = collective_outcome(fn, x)
        collective_assert(isinstance(exc, np.linalg.LinAlgError), repr(exc), comm)
    rect = dt.zeros((4, 2))
    for fn, kind in ((L.det, np.linalg.LinAlgError), (lambda v: L.qr(v, mode="r"), ValueError),
                     (lambda v: L.matrix_power(v, 1.5), TypeError),
                     (lambda v: L.tensordot(v, v, axes=3), ValueError),
                     (lambda v: L.cross(v, v), ValueError), (L.cholesky, np.linalg.LinAlgError),
                     (lambda v: L.solve(dt.zeros((3, 3)), v), ValueError),
                     (lambda v: L.matmul(dt.zeros((2, 3, 4)), dt.zeros((2, 3, 4))),
                      ValueError)):
        _, exc = collective_outcome(fn, rect)
        collective_assert(isinstance(exc, kind), f"{fn}: {exc!r}", comm)


@parallel
def test_products_norms_and_parts_like_numpy():
    check_like_numpy(np.linalg.matmul, L.matmul, shapes=[((2, 3, 4), (2, 4, 5)),
                                                         ((3, 4), (1, 4, 2)), ((4, 3), (3,))],
                     mixed=True)
    for axes in (2, 1, 0, ((0, 2), (1, 0))):
        check_like_numpy(lambda a, b, axes=axes: np.tensordot(a, b, axes=axes),
                         lambda a, b, axes=axes: L.tensordot(a, b, axes=axes),
                         shapes=[((3, 2, 4), (2, 4, 3))] if axes != ((0, 2), (1, 0)) else
                         [((3, 2, 4), (4, 3, 2))], mixed=True, name=f"tensordot {axes}")
    check_like_numpy(np.linalg.cross, L.cross, shapes=[((4, 3), (4, 3)), ((3,), (2, 3))],
                     dtypes=[np.float64, np.int64], mixed=True)
    check_like_numpy(lambda a, b: np.linalg.cross(a, b, axis=0),
                     lambda a, b: L.cross(a, b, axis=0), shapes=[((3, 5), (3, 5))], mixed=True)
    check_like_numpy(np.linalg.outer, L.outer, shapes=[((4,), (3,))], mixed=True)
    check_like_numpy(np.linalg.vecdot, L.vecdot, shapes=[((4, 3), (4, 3))], mixed=True)
    check_like_numpy(np.linalg.matrix_transpose, L.matrix_transpose, shapes=[(2, 3, 4)])
    for ord_ in ("fro", 1, -1, np.inf, 2, -2, "nuc"):
        check_like_numpy(lambda a, o=ord_: np.linalg.matrix_norm(a, ord=o, keepdims=True),
                         lambda a, o=ord_: L.matrix_norm(a, ord=o, keepdims=True),
                         shapes=[(2, 4, 3), (5, 3)], rtol=1e-9, name=f"matrix_norm {ord_}")
    for ord_ in (2, 1, np.inf, 0, 3):
        check_like_numpy(lambda a, o=ord_: np.linalg.vector_norm(a, ord=o, axis=1),
                         lambda a, o=ord_: L.vector_norm(a, ord=o, axis=1),
                         shapes=[(4, 5)], rtol=1e-9, name=f"vector_norm {ord_}")
