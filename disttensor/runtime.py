"""Job-level behaviour: abort the job on an uncaught exception; BLAS threads per rank."""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType

from mpi4py import MPI

__all__ = ["abort_on_exception", "limit_blas_threads"]

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


_thread_limits = None


def limit_blas_threads(threads: int | None = None, comm: MPI.Comm | None = None) -> int:
    """Limit this rank's BLAS/OpenMP threads; returns the limit. Collective over ``comm``.

    By default each rank gets the cores this process may use divided by the
    number of ranks on its node (at least one). Several ranks that each run a
    full-width BLAS thread pool on the same cores slow each other down by
    large factors, so the command-line tools call this at start-up; library
    users launching several ranks per node should do the same (or set
    ``OMP_NUM_THREADS`` before starting Python).
    """
    global _thread_limits
    from threadpoolctl import threadpool_limits

    if threads is None:
        comm = MPI.COMM_WORLD if comm is None else comm
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local = node.Get_size()
        node.Free()
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        threads = max(1, cores // local)
    _thread_limits = threadpool_limits(limits=int(threads))
    return int(threads)
