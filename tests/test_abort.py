"""An exception on one rank must end the whole MPI job instead of leaving the others hanging.

``import disttensor`` installs an excepthook that calls ``MPI_Abort`` when the
job has more than one rank. This serial test starts a 3-rank job in which rank
1 raises while ranks 0 and 2 wait in a barrier that rank 1 never reaches.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from disttensor.testing.launch import mpiexec_path

SCRIPT = textwrap.dedent(
    """
    from mpi4py import MPI

    import disttensor  # noqa: F401  (installs the abort-on-exception hook)

    comm = MPI.COMM_WORLD
    assert comm.Get_size() == 3, comm.Get_size()
    comm.Barrier()  # everybody is up
    if comm.Get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1 (disttensor abort test)")
    comm.Barrier()  # ranks 0 and 2 wait here for rank 1 forever, unless the job aborts
    print(f"rank {comm.Get_rank()} passed the barrier", flush=True)
    """
)

TIMEOUT = 30.0


def _mpiexec() -> str:
    path = mpiexec_path()
    if not os.path.exists(path):
        pytest.skip("no mpiexec found")
    return path


def _clean_env():
    """The environment without the variables of an enclosing MPI job (if any)."""
    drop = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_", "_PYTEST_MPI")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONUNBUFFERED"] = "1"
    env["MPIEXEC_TIMEOUT"] = str(int(3 * TIMEOUT))  # a last resort if everything else fails
    return env


def test_exception_on_one_rank_aborts_the_job(tmp_path):
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(SCRIPT)
    cmd = [_mpiexec(), "-n", "3", sys.executable, str(script)]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=_clean_env(), start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"the job did not end within {TIMEOUT} s: the ranks waiting in the barrier hang\n"
            f"stdout:\n{out}\nstderr:\n{err}"
        )
    elapsed = time.monotonic() - t0
    report = f"exit {proc.returncode} after {elapsed:.1f} s\nstdout:\n{out}\nstderr:\n{err}"
    assert proc.returncode != 0, report
    assert "RuntimeError: deliberate failure on rank 1" in err, report
    assert "uncaught RuntimeError on rank 1" in err, report
    assert "passed the barrier" not in out, report


def _run_job(tmp_path, name: str, script: str, nprocs: int):
    """Run ``script`` on ``nprocs`` ranks; fail the test if the job outlives TIMEOUT."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(script))
    cmd = [_mpiexec(), "-n", str(nprocs), sys.executable, str(path)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=_clean_env(), start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end within {TIMEOUT} s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


EXIT_SCRIPT = """
    import sys
    from mpi4py import MPI

    import disttensor  # noqa: F401

    comm = MPI.COMM_WORLD
    comm.Barrier()
    if comm.Get_rank() == 1:
        sys.exit(3)
    comm.Barrier()  # the others wait here for rank 1 forever, unless the job aborts
    print(f"rank {comm.Get_rank()} passed the barrier", flush=True)
"""

THREAD_SCRIPT = """
    import threading
    import time
    from mpi4py import MPI

    import disttensor  # noqa: F401

    comm = MPI.COMM_WORLD
    comm.Barrier()
    if comm.Get_rank() == 1:
        def work():
            raise RuntimeError("deliberate failure in a worker thread")
        threading.Thread(target=work, name="worker").start()
        time.sleep(3 * TIMEOUT)  # the main thread would go on; the job must end first
    comm.Barrier()
    print(f"rank {comm.Get_rank()} passed the barrier", flush=True)
"""

CAUGHT_SCRIPT = """
    import sys
    import threading
    from mpi4py import MPI

    import disttensor  # noqa: F401

    try:
        sys.exit(2)  # caught and survived: ends nothing
    except SystemExit as exc:
        assert exc.code == 2
    t = threading.Thread(target=sys.exit, args=(5,))  # SystemExit ends the thread only
    t.start()
    t.join()
    MPI.COMM_WORLD.Barrier()
    print(f"rank {MPI.COMM_WORLD.Get_rank()} finished", flush=True)
"""


@pytest.mark.parametrize("nprocs", [2, 4])
def test_sys_exit_on_one_rank_ends_the_job(tmp_path, nprocs):
    rc, out, err = _run_job(tmp_path, "exit.py", EXIT_SCRIPT, nprocs)
    report = f"exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert rc == 3, report
    assert "sys.exit(3) on rank 1; aborting the MPI job" in err, report
    assert "passed the barrier" not in out, report


@pytest.mark.parametrize("nprocs", [2, 4])
def test_exception_in_a_thread_ends_the_job(tmp_path, nprocs):
    script = THREAD_SCRIPT.replace("TIMEOUT", str(TIMEOUT))
    rc, out, err = _run_job(tmp_path, "thread.py", script, nprocs)
    report = f"exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert rc != 0, report
    assert "RuntimeError: deliberate failure in a worker thread" in err, report
    assert "uncaught RuntimeError in thread 'worker' on rank 1" in err, report
    assert "passed the barrier" not in out, report


@pytest.mark.parametrize("nprocs", [2, 4])
def test_caught_exit_and_thread_exit_end_nothing(tmp_path, nprocs):
    rc, out, err = _run_job(tmp_path, "caught.py", CAUGHT_SCRIPT, nprocs)
    report = f"exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert rc == 0, report
    assert out.count("finished") == nprocs, report


ALL_EXIT_SCRIPT = """
    import sys
    from mpi4py import MPI

    import disttensor  # noqa: F401

    if MPI.COMM_WORLD.Get_rank() == 0:
        print("error: a bad argument", file=sys.stderr, flush=True)
    sys.exit(2)  # every rank refuses, as a command-line tool does
"""


@pytest.mark.parametrize("nprocs", [2, 4])
def test_every_rank_exiting_ends_the_job_quietly(tmp_path, nprocs):
    rc, out, err = _run_job(tmp_path, "all_exit.py", ALL_EXIT_SCRIPT, nprocs)
    report = f"exit {rc}\nstdout:\n{out}\nstderr:\n{err}"
    assert rc == 2, report
    assert err.count("error: a bad argument") == 1, report
    assert "abort" not in err.lower(), report
