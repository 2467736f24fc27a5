"""MPI's start-up settings: MPICH's waits yield the core where a node's ranks outnumber
its cores (``disttensor._mpi_check``), set before MPI starts."""

import os
import subprocess
import sys

from disttensor._mpi_check import POLL_YIELD, yield_when_oversubscribed
from disttensor.testing.launch import mpiexec_path


def test_waits_yield_only_where_the_ranks_outnumber_the_cores():
    env = {"MPI_LOCALNRANKS": "4"}
    assert yield_when_oversubscribed(env, cores=2) and env[POLL_YIELD] == "1"
    env = {"MPI_LOCALNRANKS": "2"}
    assert not yield_when_oversubscribed(env, cores=2) and POLL_YIELD not in env
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}  # Open MPI's launcher says it so
    assert yield_when_oversubscribed(env, cores=2) and env[POLL_YIELD] == "1"
    env = {"MPI_LOCALNRANKS": "8", POLL_YIELD: "250"}  # the user's own value is kept
    assert not yield_when_oversubscribed(env, cores=2) and env[POLL_YIELD] == "250"
    for env in ({}, {"MPI_LOCALNRANKS": ""}, {"MPI_LOCALNRANKS": "x"}):  # nothing said
        assert not yield_when_oversubscribed(env, cores=1) and POLL_YIELD not in env


def test_importing_the_layers_sets_it_before_mpi_starts():
    """In a job of 3 ranks, ``import disttensor_nn`` (which imports ``mpi4py.MPI`` in its
    modules) sets the yield where 3 ranks outnumber this machine's cores, before MPI."""
    code = ("import os, sys; import disttensor_nn; from mpi4py import MPI; "
            f"print(os.environ.get('{POLL_YIELD}'), 'mpi4py.MPI' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != POLL_YIELD
           and not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "OMPI_"))}
    out = subprocess.run([mpiexec_path(), "-n", "3", sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    want = "1" if 3 > len(os.sched_getaffinity(0)) else "None"
    said = [line for line in out.stdout.splitlines() if line.endswith(" True")]
    assert said == [f"{want} True"] * 3, out.stdout + out.stderr
