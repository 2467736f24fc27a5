"""Collective assertions: every rank raises the same AssertionError, or none does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ..array import DistArray
from ..backend import to_numpy

__all__ = ["assert_allclose", "assert_equal", "collective_assert", "collective_outcome"]


def collective_assert(ok: bool, msg: str = "", comm: MPI.Comm | None = None) -> None:
    """Assert ``ok`` on every rank of ``comm`` at once.

    All ranks take part. If ``ok`` is false on any rank, every rank raises an
    AssertionError that names the failing ranks and carries their messages, so
    a failing check never leaves the other ranks waiting.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    results = comm.allgather((bool(ok), "" if ok else str(msg)))
    failed = [(r, m) for r, (good, m) in enumerate(results) if not good]
    if failed:
        lines = [f"rank {r}: {m}" for r, m in failed]
        raise AssertionError(f"failed on ranks {[r for r, _ in failed]}\n" + "\n".join(lines))


def collective_outcome(fn: Callable[..., Any], *args: Any, comm: MPI.Comm | None = None,
                       **kwargs: Any) -> tuple[Any, Exception | None]:
    """Call ``fn(*args, **kwargs)`` and assert that every rank of ``comm`` ends it alike.

    Alike means: every rank returns, or every rank raises an exception of the
    same type with the same message (the library's promise for bad input).
    An exception on some ranks only, or different messages, fails on every
    rank with an AssertionError that shows each rank's outcome.

    Parameters
    ----------
    fn : callable
        The call to make (a collective one: every rank calls it).
    *args, **kwargs
        Its arguments.
    comm : mpi4py.MPI.Comm, optional
        The ranks that must agree; ``COMM_WORLD`` by default.

    Returns
    -------
    (result, exception)
        The call's result and None, or None and the exception it raised.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    try:
        result, error = fn(*args, **kwargs), None
    except Exception as exc:  # compared across ranks below, then handed back
        result, error = None, exc
    mine = None if error is None else (type(error).__qualname__, str(error))
    outcomes = comm.allgather(mine)
    if any(o != outcomes[0] for o in outcomes):
        lines = [f"rank {r}: " + ("returned" if o is None else f"{o[0]}: {o[1]}")
                 for r, o in enumerate(outcomes)]
        raise AssertionError("the ranks ended the call differently\n" + "\n".join(lines))
    return result, error


def _compare(x: Any, desired: Any, check: Any, comm: MPI.Comm | None) -> None:
    if isinstance(x, DistArray):
        comm = x.comm if comm is None else comm
        actual = x.to_global()
    else:
        actual = x
    try:
        check(to_numpy(actual), to_numpy(desired))
        ok, msg = True, ""
    except AssertionError as exc:
        ok, msg = False, str(exc)
    collective_assert(ok, msg, comm)


def assert_allclose(actual: Any, desired: Any, rtol: float = 1e-7, atol: float = 0.0,
                    comm: MPI.Comm | None = None, **kw: Any) -> None:
    """Collective :func:`numpy.testing.assert_allclose` for DistArrays.

    ``actual`` may be a DistArray (it is gathered on every rank) or any array;
    ``desired`` is the reference on every rank. Shapes and dtypes kinds are
    checked. All ranks raise the same AssertionError when any rank fails.
    """
    _compare(actual, desired,
             lambda a, d: np.testing.assert_allclose(a, d, rtol=rtol, atol=atol, **kw), comm)


def assert_equal(actual: Any, desired: Any, comm: MPI.Comm | None = None) -> None:
    """Collective exact comparison (shape, values and dtype) of ``actual`` and ``desired``."""
    def check(a: np.ndarray, d: np.ndarray) -> None:
        np.testing.assert_array_equal(a, d, strict=True)

    _compare(actual, desired, check, comm)
