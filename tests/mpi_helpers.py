"""Small MPI helpers shared by the tests (they compute references, not library results)."""

import shutil
import tempfile

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD


def replica_sum(x):
    """Global array: every rank's block added in place (replicas add up), on every rank."""
    out = np.zeros(x.shape, x.dtype)
    out[x.dist.local_slices()] += x.local
    comm.Allreduce(MPI.IN_PLACE, out, op=MPI.SUM)
    return out


def all_sum(value):
    """Sum of ``value`` over all ranks."""
    return comm.allreduce(value, op=MPI.SUM)


_shared_dirs: list[tuple[str, MPI.Comm]] = []


def shared_tmpdir(prefix: str = "dt-test-", c: MPI.Comm = comm) -> str:
    """A new directory that every rank of ``c`` names (collective); removed after the test
    that made it (:func:`remove_shared_tmpdirs`, called by the tests' conftest, which
    synchronises ``c``'s ranks then: ``c`` must outlive the test)."""
    path = c.bcast(tempfile.mkdtemp(prefix=prefix) if c.Get_rank() == 0 else None, root=0)
    _shared_dirs.append((path, c))
    return path


def remove_shared_tmpdirs() -> None:
    """Remove the directories :func:`shared_tmpdir` made, once every rank is done with them."""
    while _shared_dirs:
        path, c = _shared_dirs.pop()
        c.Barrier()
        if c.Get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
