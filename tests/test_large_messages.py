"""Messages of more than 2**31 elements move intact (MPI large-count support)."""

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert

N = 2**31 + 11  # int8 elements: one message of just over 2 GiB


@pytest.mark.parallel(2)
def test_redistribute_more_than_2_31_elements():
    comm = MPI.COMM_WORLD
    grid = dt.ProcessGrid((comm.size,))
    holds_all_on = {r: dt.Distribution((N,), grid, splits=[[0] * r + [N] * (comm.size - 1 - r)])
                    for r in range(comm.size)}
    src, dst = holds_all_on[0], holds_all_on[comm.size - 1]
    x = dt.DistArray.empty(src, np.int8)
    probes = np.array([0, 1, 2**31 - 1, 2**31, 2**31 + 1, N - 1])
    if comm.rank == 0:
        x.local[::4096] = 5
        x.local[probes] = np.arange(len(probes), dtype=np.int8) + 1
    y = x.redistribute(dst)
    if comm.rank == comm.size - 1:
        ok = (y.local.shape == (N,)
              and np.array_equal(y.local[probes], np.arange(len(probes)) + 1)
              and int(np.count_nonzero(y.local[8192:2**31 - 8192:4096] == 5)) > 0)
    else:
        ok = y.local.size == 0
    collective_assert(ok, "the 2**31+ element message arrived altered")
