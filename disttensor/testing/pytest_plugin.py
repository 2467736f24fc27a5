"""A pytest plugin for running one test suite on every rank of an MPI job.

Load it with ``pytest_plugins = ["disttensor.testing.pytest_plugin"]`` in a
``conftest.py``. Under ``mpiexec -n P pytest`` it

* prints the report of rank 0 only;
* after each test, makes the ranks agree on its outcome, so a test that fails
  on some ranks fails on all, with every failing rank's report shown by rank 0;
* aborts the job (``MPI_Abort``) when ranks cannot agree within
  ``--mpi-agree-timeout`` seconds, which means one rank failed while others
  wait in a collective: the job ends instead of hanging.
"""

from __future__ import annotations

import sys
import time

import pytest
from mpi4py import MPI

_agree_comm: MPI.Comm | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mpi-agree-timeout", type=float, default=120.0,
        help="seconds the ranks wait for each other after a test before aborting the job",
    )


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    global _agree_comm
    world = MPI.COMM_WORLD
    if world.Get_size() > 1:
        _agree_comm = world.Dup()
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if world.Get_rank() > 0 and reporter is not None:
            config.pluginmanager.unregister(reporter)


def _wait(request: MPI.Request, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    if _agree_comm is None or call.when != "call":
        return
    report = outcome.get_result()
    comm = _agree_comm
    rank = comm.Get_rank()
    text = str(report.longrepr) if report.failed else ""
    if not _wait(comm.Ibarrier(), item.config.getoption("--mpi-agree-timeout")):
        sys.__stderr__.write(
            f"\n[rank {rank}] {item.nodeid} {report.outcome}; the other ranks did not finish "
            f"it in time (a rank is stuck in a collective), aborting the job\n{text}\n"
        )
        sys.__stderr__.flush()
        MPI.COMM_WORLD.Abort(1)
    results = comm.allgather((report.failed, text))
    failed = [(r, t) for r, (f, t) in enumerate(results) if f]
    if failed and not report.failed:
        report.outcome = "failed"
    if failed and any(r != rank for r, _ in failed):
        report.longrepr = "\n".join(f"---- rank {r} ----\n{t}" for r, t in failed)
