"""Job-level behaviour: one rank's end ends the job; BLAS threads per rank.

A rank that ends while the others still run leaves them waiting in their next
collective forever. With :func:`abort_on_exception` (on by default in jobs of
more than one rank) these call ``MPI_Abort`` on ``COMM_WORLD``, which ends
every rank:

* an uncaught exception in the main thread (``sys.excepthook``);
* an uncaught exception in any other thread (``threading.excepthook``);
  ``SystemExit`` in a thread ends only that thread, as in Python;
* ``sys.exit(status)`` with a non-zero status that ends the interpreter
  (a ``SystemExit`` that the program catches and survives ends nothing);
  the job's exit status is then ``status``. When every rank exits so
  within a few seconds of each other (a command-line tool refusing its
  arguments on all ranks, say), the job ends normally with that status,
  without the abort and its messages.

A rank that ends with status 0 while others still wait is a normal end to
MPI, so it is not covered; neither are ``os._exit`` nor a signal (the MPI
launcher ends the job when a rank dies of a signal).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any

from mpi4py import MPI
from threadpoolctl import threadpool_limits

__all__ = ["abort_on_exception", "limit_blas_threads", "node_share"]

_previous_hook = None
_previous_thread_hook = None
_previous_exit = None
_exit_status: int | None = None  # set when sys.exit(non-zero) ends the interpreter
_EXIT_GRACE_S = 5.0  # how long an exiting rank waits for the others to exit too
_FORWARD_S = 0.3  # how long an aborting rank waits for its last output to reach the launcher


def _abort(status: int, why: str) -> None:
    sys.stderr.write(
        f"disttensor: {why} on rank {MPI.COMM_WORLD.Get_rank()}; aborting the MPI job\n"
    )
    sys.stderr.flush()
    time.sleep(_FORWARD_S)  # let the launcher forward what this rank printed before it ends
    MPI.COMM_WORLD.Abort(status)


def _abort_hook(
    etype: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    traceback.print_exception(etype, value, tb)
    _abort(1, f"uncaught {etype.__name__}")


def _thread_abort_hook(args: Any) -> None:
    if issubclass(args.exc_type, SystemExit):  # ends the thread only, as in Python
        return
    traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback)
    name = getattr(args.thread, "name", "?")
    _abort(1, f"uncaught {args.exc_type.__name__} in thread {name!r}")


class _RankExit(SystemExit):
    """The SystemExit of ``sys.exit`` while the abort hooks are installed.

    When it reaches the top level, the interpreter drops it with no Python
    frame left on the stack; that is when the status is recorded for the
    exit handler. One that the program catches dies inside a Python frame
    and records nothing.
    """

    def __del__(self) -> None:
        global _exit_status
        try:
            sys._getframe(1)
        except ValueError:  # no caller: the interpreter is handling this exit
            code = self.code
            if code is not None and code != 0:
                _exit_status = code if isinstance(code, int) else 1


def _recording_exit(status: Any = None) -> None:
    raise _RankExit(status)


def _all_exiting(comm: MPI.Comm, seconds: float) -> bool:
    """Whether every rank reaches this point within ``seconds`` (a non-blocking barrier).

    A non-blocking barrier matches no blocking collective that the other
    ranks may be waiting in, so it completes only if they all exit too.
    """
    request = comm.Ibarrier()
    deadline = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _at_exit() -> None:
    if not (_exit_status and sys.exit is _recording_exit):
        return
    world = MPI.COMM_WORLD
    if MPI.Is_finalized() or world.Get_size() == 1 or _all_exiting(world, _EXIT_GRACE_S):
        return
    _abort(_exit_status, f"sys.exit({_exit_status})")


def abort_on_exception(enable: bool = True) -> None:
    """End the whole MPI job (``MPI_Abort``) when one rank ends abnormally.

    Covers an uncaught exception in the main thread or any other thread,
    and ``sys.exit`` with a non-zero status (see the module docstring for
    what is not covered). Without it, a rank that ends so leaves the others
    waiting in their next collective forever. ``import disttensor`` enables
    this when the job has more than one rank and ``sys.excepthook`` is
    Python's default; ``python -m mpi4py script.py`` gives the same
    guarantee on its own.

    Parameters
    ----------
    enable : bool
        ``False`` restores the previous hooks and ``sys.exit``.
    """
    global _previous_hook, _previous_thread_hook, _previous_exit
    if enable and sys.excepthook is not _abort_hook:
        _previous_hook = sys.excepthook
        sys.excepthook = _abort_hook
    elif not enable and sys.excepthook is _abort_hook:
        sys.excepthook = _previous_hook or sys.__excepthook__
    if enable and threading.excepthook is not _thread_abort_hook:
        _previous_thread_hook = threading.excepthook
        threading.excepthook = _thread_abort_hook
    elif not enable and threading.excepthook is _thread_abort_hook:
        threading.excepthook = _previous_thread_hook or threading.__excepthook__
    if enable and sys.exit is not _recording_exit:
        _previous_exit = sys.exit
        sys.exit = _recording_exit
    elif not enable and sys.exit is _recording_exit:
        sys.exit = _previous_exit or sys.__dict__["exit"]


# registered after mpi4py's own exit handler (which finalizes MPI), so it runs before it
atexit.register(_at_exit)


def _install_default() -> None:
    if MPI.COMM_WORLD.Get_size() > 1 and sys.excepthook is sys.__excepthook__:
        abort_on_exception(True)


_thread_limits = None


def node_share(comm: MPI.Comm | None = None) -> tuple[int, int]:
    """``(ranks, cores)``: this node's ranks of ``comm`` and the cores this process may use.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): the ranks that share
    memory with this one are counted by ``MPI_Comm_split_type``.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size()
    node.Free()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return local, cores


def limit_blas_threads(threads: int | None = None, comm: MPI.Comm | None = None) -> int:
    """Limit this rank's BLAS/OpenMP threads; returns the limit. Collective over ``comm``.

    By default each rank gets the cores this process may use divided by the
    number of ranks on its node (at least one; :func:`node_share`). Several
    ranks that each run a full-width BLAS thread pool on the same cores slow
    each other down by large factors, so the command-line tools call this at
    start-up; library users launching several ranks per node should do the
    same (or set ``OMP_NUM_THREADS`` before starting Python).
    """
    global _thread_limits
    if threads is None:
        local, cores = node_share(comm)
        threads = max(1, cores // local)
    _thread_limits = threadpool_limits(limits=int(threads))
    return int(threads)
