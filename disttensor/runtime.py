"""Job-level behaviour: an uncaught exception on one rank aborts the whole MPI job."""

from __future__ import annotations

import sys
import traceback
from types import TracebackType

from mpi4py import MPI

__all__ = ["abort_on_exception"]

_previous_hook = None


def _abort_hook(
    etype: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    traceback.print_exception(etype, value, tb)
    sys.stderr.write(
        f"disttensor: uncaught {etype.__name__} on rank {MPI.COMM_WORLD.Get_rank()}; "
        "aborting the MPI job\n"
    )
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


def abort_on_exception(enable: bool = True) -> None:
    """Make an uncaught exception on any rank call ``MPI_Abort`` on ``COMM_WORLD``.

    Without it, a rank that dies of an exception leaves the others waiting in
    their next collective forever. ``import disttensor`` enables this when the
    job has more than one rank and ``sys.excepthook`` is Python's default;
    ``python -m mpi4py script.py`` gives the same guarantee on its own.
    Pass ``enable=False`` to restore the previous hook.
    """
    global _previous_hook
    if enable and sys.excepthook is not _abort_hook:
        _previous_hook = sys.excepthook
        sys.excepthook = _abort_hook
    elif not enable and sys.excepthook is _abort_hook:
        sys.excepthook = _previous_hook or sys.__excepthook__


def _install_default() -> None:
    if MPI.COMM_WORLD.Get_size() > 1 and sys.excepthook is sys.__excepthook__:
        abort_on_exception(True)
