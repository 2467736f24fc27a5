"""Matrix products: ``matmul`` (``@``) by SUMMA, and ``dot``, ``vdot``, ``vecdot``, ``outer``,
``tensordot``; vector and matrix norms.

SUMMA on the process grid: the grid's axes are split into a row group ``R``
and a column group ``C``. ``A`` (m x k), ``B`` (k x n) and the result (m x n)
are all laid out with rows split over ``R`` and columns over ``C`` (so A's
``k`` is split over ``C`` and B's ``k`` over ``R``). For every panel of
``k`` (the union of both block boundaries along ``k``) the rank that holds
the panel of ``A`` broadcasts it along its grid row (``subcomm(C)``), the
rank that holds the panel of ``B`` broadcasts it along its grid column
(``subcomm(R)``), and every rank adds the product of the two panels to its
block of the result. On a 1-D grid this is "rows of A stay, B is passed
around"; on a square 2-D grid it is the classic SUMMA.

``R`` starts with the grid axes that split A's rows and ``C`` with those that
split B's columns; the remaining grid axes go to whichever group has fewer
processes. Operands that are not laid out like that are redistributed first
(an implicit move: with implicit redistribution disabled, call
:func:`matmul_distributions` and redistribute them yourself).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..array import DistArray
from ..distribution import Distribution
from ..settings import collective
from ._util import (
    axis_index,
    bcast_array,
    block_coords,
    is_dist,
    normalize_axis_index,
    subcomm_index,
    wrap,
)
from .align import aligned, as_operand, check_move
from .reductions import _store, count_nonzero
from .reductions import max as dmax
from .reductions import min as dmin
from .reductions import sum as dsum
from .shape import expand_dims, moveaxis, ravel, reshape, squeeze, transpose

__all__ = ["matmul", "matmul_distributions", "dot", "vdot", "vecdot", "outer", "inner",
           "tensordot"]


def _groups(a: Distribution, b: Distribution) -> tuple[tuple[int, ...], tuple[int, ...]]:
    g = a.grid_shape
    rows = [x for x in a.dim_axes[0] if g[x] > 1]
    same_grid = b.grid_shape == g  # b's grid axes mean something on a's grid
    cols = [x for x in b.dim_axes[-1] if same_grid and g[x] > 1 and x not in rows]
    for x in range(len(g)):
        if g[x] > 1 and x not in rows and x not in cols:
            pr = math.prod(g[y] for y in rows)
            pc = math.prod(g[y] for y in cols)
            (rows if pr <= pc else cols).append(x)
    return tuple(rows), tuple(cols)


def matmul_distributions(a: Distribution, b: Distribution
                         ) -> tuple[Distribution, Distribution, Distribution]:
    """The layouts :func:`matmul` uses for 2-D ``a @ b``: (A's, B's, the result's).

    Pure metadata. Redistribute the operands to the first two yourself to
    avoid an implicit move (or when implicit moves are disabled).
    """
    rows, cols = _groups(a, b)
    m, k = a.global_shape
    n = b.global_shape[-1]
    grid = a.grid_arg
    return (Distribution((m, k), grid, (rows, cols)),
            Distribution((k, n), grid, (rows, cols)),
            Distribution((m, n), grid, (rows, cols)))


def _to_dist(v: Any, like: DistArray) -> DistArray:
    """A NumPy operand as a replicated DistArray on ``like``'s grid (no communication)."""
    a = like.xp.asarray(v)
    return DistArray.from_global(a, Distribution(a.shape, like.grid, (None,) * a.ndim))


def _summa(a: DistArray, b: DistArray, da: Distribution, db: Distribution, dc: Distribution,
           dtype: np.dtype) -> DistArray:
    move_a = check_move(a, da, "the first matmul operand")
    move_b = check_move(b, db, "the second matmul operand")
    al = aligned(a, da, move_a)
    bl = aligned(b, db, move_b)
    xp = a.xp
    grid = dc.grid
    rows, cols = dc.dim_axes
    out = xp.zeros(dc.local_shape(), dtype=dtype)
    kb = sorted(set(da.boundaries[1]) | set(db.boundaries[0]))
    row_comm = grid.subcomm(cols) if cols else None   # ranks of one grid row: A's panels
    col_comm = grid.subcomm(rows) if rows else None   # ranks of one grid column: B's panels
    a_start = da.local_start()[1]
    b_start = db.local_start()[0]
    m_loc, n_loc = dc.local_shape()
    for k0, k1 in zip(kb[:-1], kb[1:]):
        if k1 <= k0:
            continue
        ia, ib = da.block_of(1, k0), db.block_of(0, k0)
        if row_comm is None:
            pa = al[:, k0:k1]
        else:
            root = subcomm_index(grid, cols, block_coords(da, 1, ia, grid.coords))
            if row_comm.Get_rank() == root:
                pa = al[:, k0 - a_start : k1 - a_start].copy()
            else:
                pa = xp.empty((m_loc, k1 - k0), dtype=a.dtype)
            pa = bcast_array(pa, row_comm, root, xp)
        if col_comm is None:
            pb = bl[k0:k1, :]
        else:
            root = subcomm_index(grid, rows, block_coords(db, 0, ib, grid.coords))
            if col_comm.Get_rank() == root:
                pb = bl[k0 - b_start : k1 - b_start, :].copy()
            else:
                pb = xp.empty((k1 - k0, n_loc), dtype=b.dtype)
            pb = bcast_array(pb, col_comm, root, xp)
        out += xp.matmul(pa, pb)
    return wrap(out, dc, xp)


@collective
def matmul(a: Any, b: Any, out: Any = None) -> DistArray:
    """Matrix product of 1-D or 2-D operands, like :func:`numpy.matmul` (SUMMA).

    Parameters
    ----------
    a, b : DistArray or array
        At least one DistArray; a NumPy operand must be the same on every rank.
    out : DistArray, optional
        Receives the result (redistributed into it if its layout differs).

    Returns
    -------
    DistArray
        The product, laid out as in :func:`matmul_distributions`.

    Raises
    ------
    ValueError
        For 0-d operands or mismatched inner dimensions (on every rank).
    TypeError
        For operands of more than 2 dimensions (batched products are not
        supported).
    """
    a, b = as_operand(a), as_operand(b)
    if not is_dist(a) and not is_dist(b):
        return NotImplemented
    like = a if is_dist(a) else b
    if not is_dist(a):
        a = _to_dist(a, like)
    if not is_dist(b):
        b = _to_dist(b, like)
    for i, v in enumerate((a, b)):
        if v.ndim == 0:
            raise ValueError(
                f"matmul: Input operand {i} does not have enough dimensions (has 0, gufunc "
                "core with signature (n?,k),(k,m?)->(n?,m?) requires 1)"
            )
        if v.ndim > 2:
            raise TypeError("matmul of DistArrays supports 1-D and 2-D operands only")
    ka = a.shape[-1]
    kb = b.shape[0]
    if ka != kb:
        raise ValueError(
            "matmul: Input operand 1 has a mismatch in its core dimension 0, with gufunc "
            f"signature (n?,k),(k,m?)->(n?,m?) (size {kb} is different from {ka})"
        )
    dtype = np.matmul(np.empty((0, 0), a.dtype), np.empty((0, 0), b.dtype)).dtype
    a2 = expand_dims(a, 0) if a.ndim == 1 else a
    b2 = expand_dims(b, 1) if b.ndim == 1 else b
    da, db, dc = matmul_distributions(a2.dist, b2.dist)
    c = _summa(a2, b2, da, db, dc, dtype)
    if a.ndim == 1 or b.ndim == 1:
        shape = (() if a.ndim == 1 else (a.shape[0],)) + (() if b.ndim == 1 else (b.shape[1],))
        c = reshape(c, shape)
    if out is not None:
        return _store(c, out)
    return c


def matmul_ufunc(inputs: Any, kwargs: dict[str, Any]) -> Any:
    """``np.matmul`` reached through ``__array_ufunc__`` (``a @ b``)."""
    kw = dict(kwargs)
    out = kw.pop("out", None)
    if isinstance(out, tuple):
        out = out[0]
    for k in ("casting", "order", "subok"):
        kw.pop(k, None)
    dtype = kw.pop("dtype", None)
    if kw:
        raise TypeError(f"matmul on DistArrays does not take {sorted(kw)}")
    c = matmul(*inputs)
    if c is NotImplemented:
        return c
    if dtype is not None:
        c = c.astype(dtype)
    if out is not None:
        return _store(c, out)
    return c


def _reduce_last(prod: DistArray, keepdims: bool = False) -> DistArray:
    return dsum(prod, axis=-1, keepdims=keepdims)


@collective
def dot(a: Any, b: Any, out: Any = None) -> Any:
    """``numpy.dot`` for scalars, vectors and matrices (N-D operands are not supported)."""
    a, b = as_operand(a), as_operand(b)
    na, nb = np.ndim(a) if not is_dist(a) else a.ndim, np.ndim(b) if not is_dist(b) else b.ndim
    if na == 0 or nb == 0:
        r = np.multiply(a, b)
    elif na <= 2 and nb <= 2:
        r = matmul(a, b)
    else:
        raise TypeError("dot of DistArrays supports operands of at most 2 dimensions")
    if out is not None:
        return _store(r, out)
    return r


@collective
def vdot(a: Any, b: Any) -> DistArray:
    """``numpy.vdot``: the flattened, conjugated dot product (a 0-d DistArray)."""
    a = ravel(a) if is_dist(a) else np.ravel(a)
    b = ravel(b) if is_dist(b) else np.ravel(b)
    if a.shape != b.shape:
        raise ValueError(f"vdot: the arrays have {a.shape[0]} and {b.shape[0]} elements")
    return _reduce_last(np.multiply(np.conjugate(a), b))


@collective
def vecdot(x1: Any, x2: Any, /, *, axis: int = -1, out: Any = None, **kwargs: Any) -> DistArray:
    """``sum(conj(x1) * x2)`` over ``axis`` of each operand, like :func:`numpy.vecdot`.

    ``axis`` counts in each operand's own dimensions (for a negative ``axis``,
    as the array API standard has it, from the last one); the other dimensions
    broadcast, the contracted ones must have the same size (not broadcast).
    The result has the operands' result type, as NumPy's: integers wrap
    around rather than widen as :func:`numpy.sum` would.
    """
    for k in ("casting", "order", "subok", "dtype", "signature", "axes"):
        kwargs.pop(k, None)
    if kwargs:
        raise TypeError(f"vecdot on DistArrays does not take {sorted(kwargs)}")
    x1, x2 = as_operand(x1), as_operand(x2)
    nd1 = x1.ndim if is_dist(x1) else np.ndim(x1)
    nd2 = x2.ndim if is_dist(x2) else np.ndim(x2)
    if nd1 == 0 or nd2 == 0:
        raise ValueError("vecdot: both operands need at least one dimension (no scalars)")
    a1, a2 = normalize_axis_index(axis, nd1), normalize_axis_index(axis, nd2)
    if np.shape(x1)[a1] != np.shape(x2)[a2]:
        raise ValueError(f"vecdot: the contracted dimensions must have the same size, got "
                         f"{np.shape(x1)[a1]} and {np.shape(x2)[a2]}")
    x1 = moveaxis(x1, a1, -1) if is_dist(x1) else np.moveaxis(np.asarray(x1), a1, -1)
    x2 = moveaxis(x2, a2, -1) if is_dist(x2) else np.moveaxis(np.asarray(x2), a2, -1)
    products = np.multiply(np.conjugate(x1), x2)
    r = dsum(products, axis=-1, dtype=products.dtype)
    return _store(r, out) if out is not None else r


@collective
def inner(a: Any, b: Any) -> Any:
    """``numpy.inner`` for vectors (and scalars)."""
    if np.ndim(a) == 0 or np.ndim(b) == 0 or (is_dist(a) and a.ndim == 0) or (
            is_dist(b) and b.ndim == 0):
        return np.multiply(a, b)
    if (a.ndim if is_dist(a) else np.ndim(a)) != 1 or (
            b.ndim if is_dist(b) else np.ndim(b)) != 1:
        raise TypeError("inner of DistArrays supports vectors only")
    if a.shape != b.shape:
        raise ValueError(f"shapes {a.shape} and {b.shape} not aligned")
    return _reduce_last(np.multiply(a, b))


@collective
def outer(a: Any, b: Any, out: Any = None) -> DistArray:
    """``numpy.outer``: ``ravel(a)[:, None] * ravel(b)[None, :]``."""
    a = expand_dims(ravel(a), 1) if is_dist(a) else np.ravel(a)[:, None]
    b = expand_dims(ravel(b), 0) if is_dist(b) else np.ravel(b)[None, :]
    return np.multiply(a, b, out=out)


@collective
def tensordot(x1: DistArray, x2: DistArray, /, *, axes: Any = 2) -> DistArray:
    """Sum of products over ``axes``, like :func:`numpy.tensordot`.

    The contracted dimensions are moved last in ``x1`` and first in ``x2``
    (no messages) and merged with the free ones by :func:`reshape` (a
    redistribution where blocks do not line up), then multiplied by SUMMA
    (:func:`matmul`) and reshaped back.
    """
    if not is_dist(x1) or not is_dist(x2):
        raise TypeError("tensordot: expected DistArrays")
    if isinstance(axes, (int, np.integer)) and not isinstance(axes, (bool, np.bool_)):
        if axes < 0 or axes > min(x1.ndim, x2.ndim):
            raise ValueError(f"tensordot: axes={axes} must be in [0, {min(x1.ndim, x2.ndim)}]")
        a1 = list(range(x1.ndim - axes, x1.ndim))
        a2 = list(range(axes))
    else:
        a1, a2 = (list(np.atleast_1d(a)) for a in axes)
        if len(a1) != len(a2):
            raise ValueError("tensordot: the two axes sequences must have the same length")
        a1 = [axis_index(a, x1.ndim) for a in a1]
        a2 = [axis_index(a, x2.ndim) for a in a2]
    if any(x1.shape[i] != x2.shape[j] for i, j in zip(a1, a2)):
        raise ValueError("shape-mismatch for sum")
    free1 = [i for i in range(x1.ndim) if i not in a1]
    free2 = [j for j in range(x2.ndim) if j not in a2]
    k = math.prod(x1.shape[i] for i in a1)
    m = math.prod(x1.shape[i] for i in free1)
    n = math.prod(x2.shape[j] for j in free2)
    p1 = reshape(transpose(x1, free1 + a1), (m, k))
    p2 = reshape(transpose(x2, a2 + free2), (k, n))
    out = matmul(p1, p2)
    return reshape(out, tuple(x1.shape[i] for i in free1)
                          + tuple(x2.shape[j] for j in free2))


# ------------------------------------------------------------------ norms


def _inexact(x: DistArray) -> DistArray:
    if x.dtype.kind in "fc":
        return x
    return x.astype(np.float64)


def vector_norm(x: DistArray, /, *, axis: Any = None, keepdims: bool = False,
                ord: Any = 2) -> DistArray:  # noqa: A002
    """Vector norm over ``axis`` (all elements by default), like
    :func:`numpy.linalg.vector_norm`: reductions of ``abs(x)``."""
    x = _inexact(x)
    a = np.abs(x)
    if ord == np.inf:
        return dmax(a, axis, keepdims=keepdims)
    if ord == -np.inf:
        return dmin(a, axis, keepdims=keepdims)
    if ord == 0:
        return count_nonzero(a, axis, keepdims=keepdims).astype(a.dtype)
    if ord == 1:
        return dsum(a, axis, keepdims=keepdims)
    if ord is None or ord == 2:
        s = dsum(a * a, axis, keepdims=keepdims)
        return np.sqrt(s, out=s)
    s = dsum(a ** ord, axis, keepdims=keepdims)
    return np.power(s, 1.0 / ord, out=s)


def matrix_norm(x: DistArray, /, *, keepdims: bool = False, ord: Any = "fro") -> DistArray:  # noqa: A002
    """Matrix norm over the last two axes, like :func:`numpy.linalg.matrix_norm`
    (``'fro'``, 1, -1, inf and -inf; the others need an SVD and are not supported)."""
    return norm(x, ord, (-2, -1), keepdims)


def norm(x: DistArray, ord: Any = None, axis: Any = None, keepdims: bool = False  # noqa: A002
         ) -> DistArray:
    """Vector and matrix norms, like :func:`numpy.linalg.norm`.

    Vector norms of every order; matrix norms ``None``/``'fro'``, 1, -1, inf
    and -inf. Norms that need an SVD (2, -2, ``'nuc'``) raise a TypeError.
    """
    if not is_dist(x):
        raise TypeError(f"norm: expected a DistArray, got {type(x).__name__}")
    x = _inexact(x)
    if axis is None:
        if ord is None or (ord == "fro" and x.ndim == 2):
            return vector_norm(x, axis=None, keepdims=keepdims)
        if x.ndim == 1:
            return vector_norm(x, axis=0, keepdims=keepdims, ord=ord)
        axis = tuple(range(x.ndim)) if x.ndim == 2 else axis
        if x.ndim != 2:
            raise ValueError("Improper number of dimensions to norm.")
    if isinstance(axis, (int, np.integer)):
        axis = (int(axis),)
    axis = tuple(axis)
    if len(axis) == 1:
        if isinstance(ord, str):
            raise ValueError(f"Invalid norm order '{ord}' for vectors")
        return vector_norm(x, axis=axis[0], keepdims=keepdims, ord=ord)
    if len(axis) != 2:
        raise ValueError("Improper number of dimensions to norm.")
    r, c = (a % x.ndim for a in axis)
    if r == c:
        raise ValueError("Duplicate axes given.")
    if ord is None or ord == "fro":
        return vector_norm(x, axis=(r, c), keepdims=keepdims)
    a = np.abs(x)
    if ord in (1, -1):
        s = dsum(a, r, keepdims=True)
        out = (dmax if ord == 1 else dmin)(s, c, keepdims=True)
    elif ord in (np.inf, -np.inf):
        s = dsum(a, c, keepdims=True)
        out = (dmax if ord == np.inf else dmin)(s, r, keepdims=True)
    else:
        raise TypeError(f"norm(ord={ord!r}) of a DistArray needs an SVD and is not supported")
    if keepdims:
        return out
    return squeeze(out, (r, c))
