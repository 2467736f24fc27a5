"""The array API ``linalg`` extension on DistArrays (``xp.linalg``), 2023.12.

What each function does with a distributed input:

* **Products and norms** are distributed: ``matmul`` (SUMMA for 2-D
  operands; stacks are matmuls of local matrices), ``vecdot``, ``outer``,
  ``tensordot`` (axes moved and merged, then SUMMA), ``vector_norm``,
  ``matrix_norm`` (``'fro'``, 1, -1, inf, -inf by reductions; 2, -2 and
  ``'nuc'`` through :func:`svdvals`), ``trace``, ``diagonal``, ``cross``,
  ``matrix_transpose``.
* **Stacks of matrices** (``(..., M, N)``) split along batch dimensions are
  local per matrix: the grid axes that split the last two dimensions move
  onto the batch dimensions (:func:`~disttensor.ops.gathering.whole_axes`,
  one redistribution), then every rank factors its own matrices with the
  array module's ``linalg``. Results keep that batch layout, with whole
  matrix dimensions.
* **Tall-skinny 2-D matrices** (``M >= P * N`` for the ``P`` ranks that
  split the rows) use TSQR (:func:`tsqr`): every rank factors its rows,
  the ``N x N`` triangles are all-gathered and factored again, and each
  rank's ``Q`` rows are its local ``Q`` times its slice of the second
  ``Q``. ``qr`` (mode ``"reduced"``), ``svd`` (``full_matrices=False``),
  ``svdvals``, ``matrix_rank`` and ``pinv`` run on it: ``R``'s singular
  values are ``A``'s, ``U = Q U_R`` stays row-split, ``pinv(A) =
  pinv(R) Q^H`` is column-split like ``A``'s rows. ``R``, ``S``, ``Vh`` are
  replicated.
* **A single split matrix otherwise** (``cholesky``, ``det``, ``slogdet``,
  ``eigh``, ``eigvalsh``, ``inv``, ``solve``, ``matrix_power`` and the
  TSQR functions outside the tall-skinny case) is gathered onto every rank
  of its grid, which then computes the same result, kept replicated. It
  warns with :class:`~disttensor.ops.gathering.GatherWarning` when a rank
  receives at least :data:`~disttensor.ops.gathering.GATHER_WARN_BYTES`.

Data-dependent failures (a singular matrix, one that is not positive
definite) raise :class:`numpy.linalg.LinAlgError` on every rank: the ranks
agree on the outcome in one small allgather. Argument errors raise before any
message. Results are NumPy's, up to the signs of factors that are unique only
up to signs (``qr``, ``svd``, ``eigh``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

import disttensor.ops.linalg as _linalg
import disttensor.ops.reductions as reductions
import disttensor.ops.shape as _shape

from ..array import DistArray
from ..backend import mpi_dtype, to_numpy
from ..distribution import Distribution
from ..redistribute import redistribution_plan
from ..settings import collective
from ._util import axis_index, is_dist, split_grid_axes, wrap
from .gathering import max_block_elements, warn_gather, whole_axes

STANDARD_NAMES = [
    "cholesky", "cross", "det", "diagonal", "eigh", "eigvalsh", "inv", "matmul",
    "matrix_norm", "matrix_power", "matrix_rank", "matrix_transpose", "outer", "pinv", "qr",
    "slogdet", "solve", "svd", "svdvals", "tensordot", "trace", "vecdot", "vector_norm",
]

__all__ = STANDARD_NAMES + ["EighResult", "QRResult", "SlogdetResult", "SVDResult", "tsqr"]


class EighResult(NamedTuple):
    """``eigh``'s result."""

    eigenvalues: DistArray
    eigenvectors: DistArray


class QRResult(NamedTuple):
    """``qr``'s result."""

    Q: DistArray
    R: DistArray


class SlogdetResult(NamedTuple):
    """``slogdet``'s result."""

    sign: DistArray
    logabsdet: DistArray


class SVDResult(NamedTuple):
    """``svd``'s result."""

    U: DistArray
    S: DistArray
    Vh: DistArray


# ------------------------------------------------------------------ the machinery


def _check(x: Any, name: str, core: int = 2) -> DistArray:
    if not is_dist(x):
        raise TypeError(f"linalg.{name}: expected a DistArray, got {type(x).__name__}")
    if x.ndim < core:
        raise np.linalg.LinAlgError(
            f"{x.ndim}-dimensional array given. Array must be at least two-dimensional")
    return x


def _square(x: DistArray) -> None:
    if x.shape[-1] != x.shape[-2]:
        raise np.linalg.LinAlgError("Last 2 dimensions of the array must be square")


def _move(x: DistArray, dist: Distribution, name: str) -> DistArray:
    """``x`` in ``dist``, warning when that gathers split dimensions onto ranks."""
    if dist == x.dist:
        return x
    if len(split_grid_axes(dist, range(dist.ndim))) < len(
            split_grid_axes(x.dist, range(x.ndim))):
        warn_gather(f"linalg.{name}", max_block_elements(dist) * x.dtype.itemsize, stacklevel=5)
    return redistribution_plan(x.dist, dist)(x)


def _matrices(x: DistArray, name: str, core: int = 2) -> DistArray:
    """``x`` with its last ``core`` dimensions whole (grid axes moved to batch dimensions)."""
    return _move(x, whole_axes(x.dist, range(x.ndim - core, x.ndim)), name)


def _agree(comm: MPI.Comm, fn: Callable[[], Any]) -> Any:
    """``fn()``, and a LinAlgError on every rank if it raised one on any."""
    try:
        out, bad = fn(), ""
    except np.linalg.LinAlgError as exc:
        out, bad = None, str(exc) or "LinAlgError"
    msgs = comm.allgather(bad) if comm.Get_size() > 1 else [bad]
    failed = [m for m in msgs if m]
    if failed:
        raise np.linalg.LinAlgError(failed[0])
    return out


def _result(local: Any, x: DistArray, core_shape: tuple[int, ...], nbatch: int) -> DistArray:
    """Wrap a local result whose first ``nbatch`` dimensions are ``x``'s batch dimensions."""
    d = x.dist
    shape = d.global_shape[:nbatch] + tuple(core_shape)
    axes = tuple(d.axes[:nbatch]) + (None,) * len(core_shape)
    splits = list(d.splits[:nbatch]) + [None] * len(core_shape)
    dist = Distribution(shape, d.grid_arg, axes, splits)
    return wrap(x.xp.asarray(local), dist, x.xp)


def _dtype_probe(fn: Callable[[np.ndarray], Any], dtype: np.dtype, shape: tuple[int, int]
                 ) -> Any:
    """``fn`` on a small identity-like matrix of ``dtype``: NumPy's dtype errors, result dtypes.

    The probe keeps whether the matrix is square, tall or wide, so NumPy's
    shape errors are raised too, on every rank before any message.
    """
    m, n = min(shape[0], 3), min(shape[1], 3)
    if shape[0] != shape[1] and m == n:
        m, n = (m + 1, n) if shape[0] > shape[1] else (m, n + 1)
    return fn(np.eye(m, n, dtype=dtype) * 2)


def _local(x: DistArray, name: str, fn: Callable[..., Any],
           cores: Sequence[tuple[int, ...]], square: bool = False,
           stack_kw: Callable[[DistArray], dict[str, Any]] | None = None) -> Any:
    """``fn`` on each rank's stack of whole matrices; one DistArray per core shape.

    ``stack_kw``, given the matrices' layout, gives further keywords of ``fn``
    for this rank's stack (its part of a per-matrix ``rtol``, say).
    """
    _check(x, name)
    if square:
        _square(x)
    _dtype_probe(fn, x.dtype, x.shape[-2:])
    x = _matrices(x, name)
    nb = x.ndim - 2
    kw = {} if stack_kw is None else stack_kw(x)
    out = _agree(x.comm, lambda: fn(to_numpy(x.local), **kw))
    if len(cores) == 1:
        return _result(out, x, cores[0], nb)
    return tuple(_result(o, x, c, nb) for o, c in zip(out, cores))


def _tall_skinny(x: DistArray) -> bool:
    """Whether TSQR applies: 2-D, rows over ``P`` ranks with ``M >= P * N``, some split."""
    if x.ndim != 2:
        return False
    p = math.prod(x.dist.nblocks)
    return p > 1 and x.shape[0] >= p * x.shape[1]


@collective
def tsqr(x: DistArray) -> QRResult:
    """Reduced QR of a tall-skinny 2-D DistArray by TSQR (Demmel et al.'s one-level tree).

    The columns are made whole (their grid axes join the rows'), every rank
    factors its row block ``A_i = Q_i R_i``, the ``N x N`` triangles
    (zero-padded) are all-gathered over the ranks that split the rows,
    their stack is factored ``[R_1; ...; R_P] = Q' R``, and ``Q``'s rows on
    rank ``i`` are ``Q_i Q'_i``. Messages: one allgather of ``P N^2``
    elements. ``Q`` is row-split, ``R`` replicated.

    Parameters
    ----------
    x : DistArray
        ``M x N`` with ``M >= N``.

    Returns
    -------
    QRResult
        ``Q`` (``M x N``, orthonormal columns) and ``R`` (``N x N``, upper
        triangular); ``Q @ R == x``.
    """
    x = _check(x, "qr")
    if x.ndim != 2 or x.shape[0] < x.shape[1]:
        raise ValueError(f"tsqr needs a 2-D matrix with M >= N, got shape {x.shape}")
    m, n = x.shape
    dtype = _dtype_probe(np.linalg.qr, x.dtype, (m, n)).Q.dtype
    x = _move(x, whole_axes(x.dist, [1]), "qr")
    d = x.dist
    rows = split_grid_axes(d, [0])
    a = to_numpy(x.local).astype(dtype, copy=False)
    q_i, r_i = np.linalg.qr(a)
    k = r_i.shape[0]
    pad = np.zeros((n, n), dtype)
    pad[:k] = r_i
    if rows:
        comm = d.grid.subcomm(rows)
        stack = np.empty((comm.Get_size() * n, n), dtype)
        comm.Allgather([pad, mpi_dtype(dtype)], [stack, mpi_dtype(dtype)])
        me = comm.Get_rank()
    else:
        stack, me = pad, 0
    q2, r = np.linalg.qr(stack)
    q = q_i @ q2[me * n: me * n + k]
    xp = x.xp
    qd = d.replace(global_shape=(m, n), axes=d.axes, splits=[d.splits[0], None])
    rd = Distribution((n, n), d.grid_arg, (None, None))
    return QRResult(wrap(xp.asarray(q), qd, xp), wrap(xp.asarray(r), rd, xp))


def _replicated(a: np.ndarray, like: DistArray) -> DistArray:
    d = Distribution(a.shape, like.dist.grid_arg, (None,) * a.ndim)
    return wrap(like.xp.asarray(a), d, like.xp)


# ------------------------------------------------------------------ factorisations


@collective
def cholesky(x: DistArray, /, *, upper: bool = False) -> DistArray:
    """Cholesky factor of Hermitian positive-definite matrices (``L``, or ``U`` with
    ``upper=True``), like :func:`numpy.linalg.cholesky`; local per matrix (see above)."""
    m = x.shape[-1] if is_dist(x) and x.ndim >= 2 else 0
    return _local(x, "cholesky", lambda a: np.linalg.cholesky(a, upper=upper), [(m, m)],
                  square=True)


@collective
def det(x: DistArray, /) -> DistArray:
    """Determinants, like :func:`numpy.linalg.det`; local per matrix (see above)."""
    return _local(x, "det", np.linalg.det, [()], square=True)


@collective
def slogdet(x: DistArray, /) -> SlogdetResult:
    """Sign and log of the absolute determinant, like :func:`numpy.linalg.slogdet`."""
    return SlogdetResult(*_local(x, "slogdet", lambda a: tuple(np.linalg.slogdet(a)),
                                 [(), ()], square=True))


@collective
def eigh(x: DistArray, /) -> EighResult:
    """Eigenvalues (ascending) and eigenvectors of Hermitian matrices, like
    :func:`numpy.linalg.eigh`; local per matrix (see above)."""
    m = x.shape[-1] if is_dist(x) and x.ndim >= 2 else 0
    return EighResult(*_local(x, "eigh", lambda a: tuple(np.linalg.eigh(a)), [(m,), (m, m)],
                              square=True))


@collective
def eigvalsh(x: DistArray, /) -> DistArray:
    """Eigenvalues of Hermitian matrices, like :func:`numpy.linalg.eigvalsh`."""
    m = x.shape[-1] if is_dist(x) and x.ndim >= 2 else 0
    return _local(x, "eigvalsh", np.linalg.eigvalsh, [(m,)], square=True)


@collective
def inv(x: DistArray, /) -> DistArray:
    """Inverses, like :func:`numpy.linalg.inv`; local per matrix (see above)."""
    m = x.shape[-1] if is_dist(x) and x.ndim >= 2 else 0
    return _local(x, "inv", np.linalg.inv, [(m, m)], square=True)


@collective
def matrix_power(x: DistArray, n: int, /) -> DistArray:
    """``x`` to the integer power ``n``, like :func:`numpy.linalg.matrix_power`."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError("exponent must be an integer")
    m = x.shape[-1] if is_dist(x) and x.ndim >= 2 else 0
    return _local(x, "matrix_power", lambda a: np.linalg.matrix_power(a, int(n)), [(m, m)],
                  square=True)


@collective
def qr(x: DistArray, /, *, mode: str = "reduced") -> QRResult:
    """QR factorisation, like :func:`numpy.linalg.qr` (``mode`` ``"reduced"`` or
    ``"complete"``); TSQR for tall-skinny matrices, else local per matrix (see above)."""
    if mode not in ("reduced", "complete"):
        raise ValueError(f"Unrecognized mode '{mode}'")
    _check(x, "qr")
    if mode == "reduced" and _tall_skinny(x):
        return tsqr(x)
    m, n = x.shape[-2:]
    k = m if mode == "complete" else min(m, n)
    return QRResult(*_local(x, "qr", lambda a: tuple(np.linalg.qr(a, mode=mode)),
                            [(m, k), (k, n)]))


def _tsqr_svd(x: DistArray) -> tuple[DistArray, np.ndarray, np.ndarray, np.ndarray, DistArray]:
    q, r = tsqr(x)
    u_r, s, vh = np.linalg.svd(to_numpy(r.local), full_matrices=False)
    return q, u_r, s, vh, r


@collective
def svd(x: DistArray, /, *, full_matrices: bool = True) -> SVDResult:
    """Singular value decomposition, like :func:`numpy.linalg.svd`: TSQR for tall-skinny
    matrices with ``full_matrices=False`` (``U`` row-split), else local per matrix."""
    _check(x, "svd")
    m, n = x.shape[-2:]
    if not full_matrices and _tall_skinny(x):
        q, u_r, s, vh, _ = _tsqr_svd(x)
        u = wrap(q.xp.asarray(to_numpy(q.local) @ u_r.astype(q.dtype)), q.dist, q.xp)
        return SVDResult(u, _replicated(s, x), _replicated(vh, x))
    k = min(m, n)
    cu, cv = (m, k if not full_matrices else m), (k if not full_matrices else n, n)
    return SVDResult(*_local(x, "svd", lambda a: tuple(np.linalg.svd(
        a, full_matrices=full_matrices)), [cu, (k,), cv]))


@collective
def svdvals(x: DistArray, /) -> DistArray:
    """Singular values (descending), like :func:`numpy.linalg.svdvals` (TSQR for
    tall-skinny matrices: those of ``R``)."""
    _check(x, "svdvals")
    if _tall_skinny(x):
        _, r = tsqr(x)
        return _replicated(np.linalg.svdvals(to_numpy(r.local)), x)
    return _local(x, "svdvals", np.linalg.svdvals, [(min(x.shape[-2:]),)])


def _rtols(rtol: Any, x: DistArray, name: str) -> Any:
    """The standard's ``rtol`` for the matrices of ``x``: None, a float, or a NumPy array of
    their stack shape ``x.shape[:-2]`` (one value per matrix), the same on every rank.

    ``rtol`` is None, a real number, or an array (a DistArray, or a global
    array) that broadcasts against ``x[..., 0, 0]``; a DistArray's values are
    gathered (one per matrix).
    """
    if rtol is None:
        return None
    values = (to_numpy(rtol.redistribute(rtol.dist.replicated()).local) if is_dist(rtol)
              else np.asarray(rtol))
    if values.dtype.kind not in "biuf":
        raise TypeError(f"linalg.{name}: rtol must be real, got dtype {values.dtype}")
    if values.ndim == 0:
        return float(values)
    try:
        return np.broadcast_to(values, x.shape[:-2])
    except ValueError:
        raise ValueError(f"linalg.{name}: rtol of shape {values.shape} does not broadcast "
                         f"against the stack shape {x.shape[:-2]}") from None


def _rtol_kw(rtols: Any) -> Callable[[DistArray], dict[str, Any]]:
    """``stack_kw`` for :func:`_local`: this rank's part of ``rtols`` (see :func:`_rtols`)."""
    def kw(xm: DistArray) -> dict[str, Any]:
        if rtols is None or np.ndim(rtols) == 0:
            return {"rtol": rtols}
        return {"rtol": rtols[xm.dist.local_slices()[:xm.ndim - 2]]}
    return kw


def _default_rtol(rtols: Any, x: DistArray, dtype: Any) -> Any:
    """``rtols``, or the standard's default ``max(M, N) * eps`` of ``dtype``."""
    return max(x.shape[-2:]) * np.finfo(dtype).eps if rtols is None else rtols


@collective
def matrix_rank(x: DistArray, /, *, rtol: Any = None) -> DistArray:
    """Rank by the singular values above ``rtol * max(S)``, like
    :func:`numpy.linalg.matrix_rank` with the standard's ``rtol``: None (the
    default ``max(M, N) * eps``), a number, or an array that broadcasts against
    ``x[..., 0, 0]`` (a tolerance per matrix). TSQR for tall-skinny matrices."""
    _check(x, "matrix_rank")
    r = _rtols(rtol, x, "matrix_rank")
    if _tall_skinny(x):
        _, q = tsqr(x)
        tol = _default_rtol(r, x, q.dtype)
        return _replicated(np.asarray(np.linalg.matrix_rank(to_numpy(q.local), rtol=tol)), x)
    return _local(x, "matrix_rank", lambda a, **kw: np.asarray(np.linalg.matrix_rank(a, **kw)),
                  [()], stack_kw=_rtol_kw(r))


@collective
def pinv(x: DistArray, /, *, rtol: Any = None) -> DistArray:
    """Moore-Penrose pseudo-inverse, like :func:`numpy.linalg.pinv` with the standard's
    ``rtol``: singular values at most ``rtol`` times the largest are taken as zero;
    None (the default ``max(M, N) * eps``), a number, or an array that broadcasts
    against ``x[..., 0, 0]`` (a tolerance per matrix). Tall-skinny matrices:
    ``pinv(R) Q^H`` by TSQR, column-split like ``x``'s rows."""
    _check(x, "pinv")
    r = _rtols(rtol, x, "pinv")
    m, n = x.shape[-2:]
    if _tall_skinny(x):
        q, tri = tsqr(x)
        b = np.linalg.pinv(to_numpy(tri.local), rtol=_default_rtol(r, x, tri.dtype))
        local = b @ np.conjugate(to_numpy(q.local)).T
        d = q.dist
        dist = Distribution((n, m), d.grid_arg, (d.axes[1], d.axes[0]), [None, d.splits[0]])
        return wrap(q.xp.asarray(np.ascontiguousarray(local)), dist, q.xp)
    return _local(x, "pinv", lambda a, **kw: np.linalg.pinv(a, **kw), [(n, m)],
                  stack_kw=_rtol_kw(r))


# ------------------------------------------------------------------ pairs of operands


def _pair(x1: DistArray, x2: DistArray, name: str, core2: int) -> tuple[DistArray, DistArray]:
    """Operands with broadcast batch dimensions in one layout, their last dims whole.

    ``x1`` has 2 core dimensions, ``x2`` ``core2`` (1 or 2); the batch
    dimensions of both are broadcast, ``x1``'s matrices made whole, and
    ``x2`` moved to the same batch layout with whole core dimensions.
    """
    b1, b2 = x1.shape[:-2], x2.shape[:x2.ndim - core2]
    batch = tuple(np.broadcast_shapes(b1, b2))
    if b1 != batch:
        x1 = _shape.broadcast_to(x1, batch + x1.shape[-2:])
    if b2 != batch and core2 == 2:
        x2 = _shape.broadcast_to(x2, batch + x2.shape[-2:])
    x1 = _matrices(x1, name)
    d = x1.dist
    nb = len(batch)
    if core2 == 2:
        target = Distribution(x2.shape, d.grid_arg, tuple(d.axes[:nb]) + (None, None),
                              list(d.splits[:nb]) + [None, None])
    else:
        target = Distribution(x2.shape, d.grid_arg, (None,) * x2.ndim)
    return x1, _move(x2, target, name)


@collective
def solve(x1: DistArray, x2: DistArray, /) -> DistArray:
    """Solve ``x1 @ x = x2``, like :func:`numpy.linalg.solve` (``x2`` is a vector only
    when 1-D); local per matrix (see above)."""
    _check(x1, "solve")
    _square(x1)
    if not is_dist(x2):
        raise TypeError(f"linalg.solve: expected a DistArray, got {type(x2).__name__}")
    m = x1.shape[-1]
    core2 = 1 if x2.ndim == 1 else 2
    if x2.ndim == 0 or x2.shape[-core2] != m:
        raise ValueError(f"solve: x2 of shape {x2.shape} does not match x1 of shape {x1.shape}")
    np.linalg.solve(np.eye(1, dtype=x1.dtype), np.ones((1,) * core2, x2.dtype))  # dtypes
    a, b = _pair(x1, x2, "solve", core2)
    nb = a.ndim - 2
    out = _agree(a.comm, lambda: np.linalg.solve(to_numpy(a.local), to_numpy(b.local)))
    core = (m,) if core2 == 1 else (m, x2.shape[-1])
    return _result(out, a, core, nb)


@collective
def matmul(x1: DistArray, x2: DistArray, /) -> DistArray:
    """Matrix product: SUMMA for 1-D and 2-D operands (:func:`disttensor.ops.linalg.matmul`);
    stacks (more than 2 dimensions) multiply whole local matrices per batch."""
    if not is_dist(x1) or not is_dist(x2) or max(x1.ndim, x2.ndim) <= 2:
        return _linalg.matmul(x1, x2)
    if min(x1.ndim, x2.ndim) < 2:
        raise TypeError("linalg.matmul: stacks of matrices need 2-D or more on both sides")
    if x1.shape[-1] != x2.shape[-2]:
        raise ValueError(f"matmul: mismatch in the core dimension ({x1.shape[-1]} is different"
                         f" from {x2.shape[-2]})")
    dtype = np.matmul(np.empty((0, 0), x1.dtype), np.empty((0, 0), x2.dtype)).dtype
    a, b = _pair(x1, x2, "matmul", 2)
    out = a.xp.matmul(a.local, b.local).astype(dtype, copy=False)
    return _result(out, a, (x1.shape[-2], x2.shape[-1]), a.ndim - 2)


@collective
def cross(x1: DistArray, x2: DistArray, /, *, axis: int = -1) -> DistArray:
    """Cross product of 3-vectors along ``axis``, like :func:`numpy.linalg.cross`: the axis
    made whole, the other dimensions kept in ``x1``'s layout."""
    if not is_dist(x1) or not is_dist(x2):
        raise TypeError("linalg.cross: expected DistArrays")
    shape = tuple(np.broadcast_shapes(x1.shape, x2.shape))
    ax = axis_index(axis, len(shape))
    if shape[ax] != 3 or x1.shape[axis] != 3 or x2.shape[axis] != 3:
        raise ValueError("both input arrays must be (arrays of) 3-dimensional vectors")
    dtype = np.linalg.cross(np.ones(3, x1.dtype), np.ones(3, x2.dtype)).dtype
    x1 = x1 if x1.shape == shape else _shape.broadcast_to(x1, shape)
    x2 = x2 if x2.shape == shape else _shape.broadcast_to(x2, shape)
    a = _move(x1, whole_axes(x1.dist, [ax]), "cross")
    b = _move(x2, a.dist, "cross")
    out = np.linalg.cross(to_numpy(a.local), to_numpy(b.local), axis=ax).astype(dtype)
    return wrap(a.xp.asarray(out), a.dist, a.xp)


@collective
def tensordot(x1: DistArray, x2: DistArray, /, *, axes: Any = 2) -> DistArray:
    """Sum of products over ``axes``, like :func:`numpy.tensordot`
    (:func:`disttensor.ops.linalg.tensordot`: contracted axes merged, then SUMMA)."""
    return _linalg.tensordot(x1, x2, axes=axes)


@collective
def vecdot(x1: DistArray, x2: DistArray, /, *, axis: int = -1) -> DistArray:
    """Conjugated dot product along ``axis`` (:func:`disttensor.ops.linalg.vecdot`)."""
    return _linalg.vecdot(x1, x2, axis=axis)


@collective
def outer(x1: DistArray, x2: DistArray, /) -> DistArray:
    """Outer product of two vectors (:func:`disttensor.ops.linalg.outer`)."""
    for v in (x1, x2):
        if not is_dist(v) or v.ndim != 1:
            raise ValueError("linalg.outer: both operands must be 1-D DistArrays")
    return _linalg.outer(x1, x2)


# ------------------------------------------------------------------ norms and parts


@collective
def vector_norm(x: DistArray, /, *, axis: Any = None, keepdims: bool = False,
                ord: Any = 2) -> DistArray:  # noqa: A002
    """Vector norm (reductions; :func:`disttensor.ops.linalg.vector_norm`)."""
    return _linalg.vector_norm(x, axis=axis, keepdims=keepdims, ord=ord)


@collective
def matrix_norm(x: DistArray, /, *, keepdims: bool = False, ord: Any = "fro") -> DistArray:  # noqa: A002
    """Matrix norm over the last two dimensions, like :func:`numpy.linalg.matrix_norm`:
    ``'fro'``, 1, -1, inf, -inf by distributed reductions; 2, -2 and ``'nuc'`` from
    :func:`svdvals` (max, min, sum)."""
    _check(x, "matrix_norm")
    if ord not in (2, -2, "nuc"):
        return _linalg.matrix_norm(x, keepdims=keepdims, ord=ord)
    s = svdvals(x)
    red = {2: reductions.max, -2: reductions.min, "nuc": reductions.sum}[ord]
    r = red(s, axis=-1)
    if keepdims:
        r = _shape.expand_dims(_shape.expand_dims(r, -1), -1)
    return r


@collective
def matrix_transpose(x: DistArray, /) -> DistArray:
    """Swap the last two dimensions (no communication)."""
    _check(x, "matrix_transpose")
    return _shape.matrix_transpose(x)


@collective
def diagonal(x: DistArray, /, *, offset: int = 0) -> DistArray:
    """The ``offset``-th diagonals of the matrices, like :func:`numpy.linalg.diagonal`
    (the matrices made whole per batch; see above)."""
    _check(x, "diagonal")
    m, n = x.shape[-2:]
    k = max(0, min(m, n - offset) if offset >= 0 else min(m + offset, n))
    return _local(x, "diagonal", lambda a: np.linalg.diagonal(a, offset=offset).copy(), [(k,)])


@collective
def trace(x: DistArray, /, *, offset: int = 0, dtype: Any = None) -> DistArray:
    """Sums of the ``offset``-th diagonals, like :func:`numpy.linalg.trace`."""
    return _local(x, "trace", lambda a: np.asarray(np.linalg.trace(a, offset=offset,
                                                                   dtype=dtype)), [()])
