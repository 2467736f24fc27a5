import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import assert_equal


@pytest.mark.parallel([1, 2, 3])
def test_roundtrip():
    comm = MPI.COMM_WORLD
    g = dt.ProcessGrid((comm.size,))
    a = np.arange(20.0).reshape(4, 5)
    x = dt.DistArray.from_global(a, dt.Distribution(a.shape, g))
    assert_equal(x, a)
