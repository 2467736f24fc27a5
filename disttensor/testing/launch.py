"""Run a pytest suite at several MPI world sizes and sum up the results.

Usage::

    python -m disttensor.testing.launch [--sizes 1,2,3,4] [--timeout S] [--check-collective]
                                        [PYTEST ARGS...]

Tests are marked with mpi-pytest's ``@pytest.mark.parallel(nprocs=[...])``.
For each world size P the launcher runs ``mpiexec -n P python -m pytest -m
"parallel[P]"`` (P = 1 runs the serial tests and the 1-rank instances without
mpiexec), so one interpreter per rank serves all tests of that size. Each run
is bounded by ``--timeout`` seconds (``MPIEXEC_TIMEOUT``); a rank that fails
alone aborts its job through :mod:`disttensor.testing.pytest_plugin` instead
of hanging. The exit status is non-zero when any run fails.

``--check-collective`` runs the tests in the collective-consistency check
mode (it sets ``DISTTENSOR_CHECK_COLLECTIVE=1``; see :mod:`disttensor.settings`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def mpiexec_path() -> str:
    """The ``mpiexec`` beside this Python (the ``mpich`` wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else (shutil.which("mpiexec") or "mpiexec")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,2,3,4", help="comma-separated world sizes")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per world size")
    parser.add_argument("--check-collective", action="store_true",
                        help="run in check mode (DISTTENSOR_CHECK_COLLECTIVE=1)")
    args, pytest_args = parser.parse_known_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    totals: dict[str, int] = {}
    status = 0
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(args.timeout), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if args.check_collective:
        env["DISTTENSOR_CHECK_COLLECTIVE"] = "1"
    for p in sizes:
        cmd = [sys.executable, "-m", "pytest", "-m", f"parallel[{p}]", *pytest_args]
        if p > 1:
            cmd = [mpiexec_path(), "-n", str(p), *cmd]
        print(f"\n##### world size {p}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        last = ""
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            if line.strip():
                last = line
        rc = proc.wait()
        counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
                  for n, k in _COUNT.findall(last)}
        for k, n in counts.items():
            totals[k] = totals.get(k, 0) + n
        print(f"##### world size {p}: exit {rc} in {time.perf_counter() - t0:.1f} s", flush=True)
        if rc not in (0, 5):  # 5: no tests of this size
            status = 1
            totals["failed"] = totals.get("failed", 0) + (0 if counts.get("failed") else 1)
    summary = ", ".join(f"{totals.get(k, 0)} {k}" for k in ("passed", "failed", "skipped"))
    print(f"\ntotal: {summary}")
    return status


if __name__ == "__main__":
    sys.exit(main())
