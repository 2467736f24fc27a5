"""Small MPI helpers shared by the tests (they compute references, not library results)."""

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
