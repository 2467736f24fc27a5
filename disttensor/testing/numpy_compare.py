"""Check a DistArray function against its NumPy counterpart over many layouts at once.

:func:`check_like_numpy` runs ``np_func`` on global NumPy arrays and
``dt_func`` on the same arrays distributed in several ways (block, uneven
with an empty block, replicated, split over a 2-D grid with replicas, split
over several grid axes), for every shape and dtype it is given, and compares
every result with NumPy's. It is collective: every rank runs the same cases
and one collective assertion reports all failures at the end.

Each rank compares its own block of a DistArray result with the same block
of NumPy's result (and the global shape and dtype), which is the comparison
on the gathered array made on every replica, without the gather.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..array import DistArray
from ..distribution import Distribution, block_boundaries
from ..grid import ProcessGrid
from .assertions import collective_assert

__all__ = ["check_like_numpy", "layouts", "sample"]

_grids: dict[tuple[int, tuple[int, ...]], ProcessGrid] = {}


def _grid(comm: MPI.Comm, shape: tuple[int, ...]) -> ProcessGrid:
    """One ProcessGrid per (communicator, shape), so that its sub-communicators are reused."""
    key = (comm.py2f(), shape)
    if key not in _grids:
        _grids[key] = ProcessGrid(shape, comm)
    return _grids[key]


def layouts(shape: Sequence[int], comm: MPI.Comm | None = None) -> list[Distribution]:
    """Distributions of ``shape`` that exercise the corners of the block rule.

    On ``P`` ranks: the first dimension in blocks over a 1-D grid; the last
    dimension in uneven blocks with an empty first block; replicated; the
    first and last dimensions over a balanced 2-D grid, its shorter axis
    first (for 1-D arrays, one dimension over both grid axes in reversed
    order); the first dimension over the second grid axis of the 2-D grid,
    with a big first block, so that the first grid axis (if longer than 1)
    holds replicas. Layouts that coincide (on one rank, say)
    are listed once.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    shape = tuple(int(s) for s in shape)
    p = comm.Get_size()
    g1 = _grid(comm, (p,))
    g2 = _grid(comm, tuple(sorted(MPI.Compute_dims(p, 2))))  # (1, 3) on 3 ranks
    nd = len(shape)
    if nd == 0:
        return [Distribution((), g1, ())]
    none = (None,) * nd
    out = [Distribution(shape, g1, (0,) + none[1:])]
    n = shape[-1]
    cuts = [0, *block_boundaries(n, p - 1)[1:-1]] if p > 1 else []
    out.append(Distribution(shape, g1, none[:-1] + (0,), [None] * (nd - 1) + [cuts]))
    out.append(Distribution(shape, g1, none))
    if nd >= 2:
        out.append(Distribution(shape, g2, (0,) + none[1:-1] + (1,)))
    else:
        out.append(Distribution(shape, g2, ((1, 0),)))
    q = g2.shape[1]
    m = shape[0]
    uneven = [min(m, -(-m * (i + 1) // q) + 1) for i in range(q - 1)]  # a big first block
    out.append(Distribution(shape, g2, (1,) + none[1:], [uneven] + [None] * (nd - 1)))
    seen, unique = set(), []
    for d in out:
        key = tuple((tuple((s.start, s.stop) for s in d.local_slices(r)), d.block_index(r))
                    for r in range(d.nprocs))
        if key not in seen:
            seen.add(key)
            unique.append(d)
    return unique


def sample(shape: Sequence[int], dtype: Any = np.float64, seed: int = 0,
           domain: str = "any") -> np.ndarray:
    """A deterministic global array (the same on every rank).

    ``domain`` is ``"any"`` (values in [-4, 4], integers in [-9, 9], so
    integers have ties), ``"positive"`` ((0.1, 4], integers in [1, 9]) or
    ``"unit"`` ((-0.9, 0.9), for arcsin and the like).
    """
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    shape = tuple(shape)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        lo = 1 if domain == "positive" or dtype.kind == "u" else -9
        return rng.integers(lo, 10, shape).astype(dtype)
    lo, hi = {"any": (-4, 4), "positive": (0.1, 4), "unit": (-0.9, 0.9)}[domain]
    a = rng.uniform(lo, hi, shape)
    if dtype.kind == "c":
        a = a + 1j * rng.uniform(lo, hi, shape)
    return a.astype(dtype)


def _tolerance(dtype: np.dtype) -> float:
    if dtype.kind not in "fc":
        return 0.0
    return 2e-4 if dtype.itemsize <= (8 if dtype.kind == "c" else 4) else 1e-9


def _compare(got: Any, want: Any, rtol: float | None, atol: float) -> str | None:
    """None when ``got`` (a DistArray or anything else) matches NumPy's ``want``."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"expected a sequence of {len(want)} results, got {type(got).__name__}"
        for g, w in zip(got, want):
            msg = _compare(g, w, rtol, atol)
            if msg:
                return msg
        return None
    want = np.asarray(want)
    if isinstance(got, DistArray):
        if got.shape != want.shape:
            return f"shape {got.shape} != NumPy's {want.shape}"
        if got.dtype != want.dtype:
            return f"dtype {got.dtype} != NumPy's {want.dtype}"
        local = np.asarray(got.local)
        want = want[got.dist.local_slices()]
    else:
        local = np.asarray(got)
        if local.shape != want.shape:
            return f"shape {local.shape} != NumPy's {want.shape}"
        if local.dtype.kind != want.dtype.kind and not (
                local.dtype.kind in "biu" and want.dtype.kind in "biu"):
            return f"dtype {local.dtype} != NumPy's {want.dtype}"
    tol = _tolerance(want.dtype) if rtol is None else rtol
    if want.dtype.kind in "fc":
        ok = np.allclose(local, want, rtol=tol, atol=atol, equal_nan=True)
    else:
        ok = np.array_equal(local, want)
    if not ok:
        return f"values differ:\n got {local.ravel()[:6]}\nwant {want.ravel()[:6]}"
    return None


def _run(func: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, BaseException | None]:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            return func(*args), None
        except Exception as exc:  # noqa: BLE001 - compared with NumPy's below
            return None, exc


def check_like_numpy(
    np_func: Callable[..., Any],
    dt_func: Callable[..., Any] | None = None,
    *,
    shapes: Iterable[Any] = ((5, 4),),
    dtypes: Iterable[Any] = (np.float64,),
    domain: str = "any",
    mixed: bool = False,
    rtol: float | None = None,
    atol: float = 0.0,
    comm: MPI.Comm | None = None,
    max_layouts: int | None = None,
    name: str | None = None,
) -> int:
    """Compare ``dt_func`` on DistArrays with ``np_func`` on NumPy arrays, collectively.

    Parameters
    ----------
    np_func : callable
        Takes NumPy arrays (one per operand) and returns the reference.
    dt_func : callable, optional
        Takes DistArrays; ``np_func`` itself by default (which exercises the
        NumPy protocols).
    shapes : iterable
        Shapes of the operands: a shape per case for one operand, or a tuple
        of shapes per case for several.
    dtypes : iterable
        A dtype per case (for every operand), or a tuple of dtypes per case.
    domain : {"any", "positive", "unit"}
        Value range of the inputs (see :func:`sample`).
    mixed : bool
        Also give the operands different layouts (the i-th operand takes the
        layout i steps further down the list), which exercises implicit
        redistribution.
    rtol, atol : float, optional
        Tolerances for floating results (by default about 1e-9 for double and
        2e-4 for single precision).
    comm : MPI.Comm, optional
        ``COMM_WORLD`` by default.
    max_layouts : int, optional
        Use only the first layouts of :func:`layouts`.
    name : str, optional
        Names the function in failure messages.

    Returns
    -------
    int
        The number of cases run on this rank.

    Raises
    ------
    AssertionError
        On every rank, listing the failing cases, when a result differs from
        NumPy's (shape, dtype or values) or when one side raises and the other
        does not (both must raise the same exception type).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    dt_func = np_func if dt_func is None else dt_func
    label = name or getattr(np_func, "__name__", repr(np_func))
    failures: list[str] = []
    ncases = 0
    for case, (shp, dts) in enumerate(itertools.product(list(shapes), list(dtypes))):
        multi = len(shp) > 0 and all(isinstance(s, (tuple, list)) for s in shp)
        opshapes = [tuple(s) for s in shp] if multi else [tuple(shp)]
        opdtypes = list(dts) if isinstance(dts, (tuple, list)) else [dts] * len(opshapes)
        arrays = [sample(s, d, seed=case * 7 + i, domain=domain)
                  for i, (s, d) in enumerate(zip(opshapes, opdtypes))]
        want, want_exc = _run(np_func, [a.copy() for a in arrays])
        lays = [layouts(s, comm) for s in opshapes]
        if max_layouts is not None:
            lays = [lay[:max_layouts] for lay in lays]
        nlay = max(len(lay) for lay in lays)
        shifts = [0, 1] if mixed and len(opshapes) > 1 else [0]
        for k, shift in itertools.product(range(nlay), shifts):
            dists = [lay[(k + i * shift) % len(lay)] for i, lay in enumerate(lays)]
            dargs = [DistArray.from_global(a, d) for a, d in zip(arrays, dists)]
            got, got_exc = _run(dt_func, dargs)
            ncases += 1
            where = f"{label} shapes={opshapes} dtypes={[str(d) for d in opdtypes]} dists={dists}"
            if want_exc is not None or got_exc is not None:
                if want_exc is None:
                    failures.append(f"{where}: raised {got_exc!r}, NumPy did not")
                elif got_exc is None:
                    failures.append(f"{where}: NumPy raised {want_exc!r}, this did not")
                elif not isinstance(got_exc, type(want_exc)):
                    failures.append(f"{where}: raised {got_exc!r}, NumPy raised {want_exc!r}")
                continue
            msg = _compare(got, want, rtol, atol)
            if msg:
                failures.append(f"{where}: {msg}")
    collective_assert(not failures, f"{len(failures)} of {ncases} cases failed:\n"
                      + "\n".join(failures[:5]), comm)
    return ncases
