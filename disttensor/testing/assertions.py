"""Collective assertions: every rank raises the same AssertionError, or none does."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ..array import DistArray
from ..backend import to_numpy

__all__ = ["assert_allclose", "assert_equal", "collective_assert"]


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
