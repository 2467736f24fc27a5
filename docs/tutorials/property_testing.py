"""Tutorial: property-testing your own distributed code under MPI with disttensor.testing.

The code under test is ``moving_average``, a small distributed function built
on the halo exchange. The tests draw grids, distributions (uneven and empty
blocks, replicas, several grid axes on one dimension) and arrays with
Hypothesis, and compare with NumPy on the gathered array.

Run the file on any number of ranks; it runs pytest on itself::

    mpiexec -n 4 python -m mpi4py docs/tutorials/property_testing.py

or, the way a test suite runs, at several world sizes::

    python -m disttensor.testing.launch --sizes 1,2,3,4 \\
        -p disttensor.testing.pytest_plugin docs/tutorials/property_testing.py

Run on its own, it ends with ``property testing tutorial: OK on P ranks``.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import disttensor as dt
from disttensor.testing import (
    assert_allclose,
    collective_assert,
    dist_arrays,
    distributions,
    process_grids,
)
from disttensor.testing.strategies import MPI_PROFILE

settings.load_profile(MPI_PROFILE)  # every rank draws the same examples, in the same order


# ----------------------------------------------------------------- the code under test
def moving_average(x: dt.DistArray, axis: int, k: int) -> dt.DistArray:
    """Mean of each cell and its ``k`` neighbours on both sides along ``axis``.

    Beyond the ends of the array the edge value repeats (``numpy.pad``'s
    ``'edge'`` mode). Any distribution; the result has the input's.
    """
    widths = [(0, 0)] * x.ndim
    widths[axis] = (k, k)
    ext = x.exchange_halo(widths, mode="edge")
    n = x.local_shape[axis]
    total = sum(np.take(ext, range(i, i + n), axis=axis) for i in range(2 * k + 1))
    return dt.DistArray.from_local(total / (2 * k + 1), x.dist)


def reference(g: np.ndarray, axis: int, k: int) -> np.ndarray:
    """The same on one process, written independently: a convolution along ``axis``."""
    widths = [(0, 0)] * g.ndim
    widths[axis] = (k, k)
    p = np.pad(g, widths, mode="edge")
    kernel = np.ones(2 * k + 1) / (2 * k + 1)
    return np.apply_along_axis(lambda v: np.convolve(v, kernel, mode="valid"), axis, p)


# ----------------------------------------------------------------- strategies
# Shapes with at least one dimension and no empty dimension ('edge' needs a value to
# repeat), distributed over grids that span all ranks of COMM_WORLD.
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=9)
layouts = distributions(shape=shapes, grid=process_grids())
arrays = dist_arrays(dist=layouts)


# ----------------------------------------------------------------- the tests
@pytest.mark.parallel([1, 2, 3, 4])
@settings(max_examples=20)
@given(x=arrays, data=st.data())
def test_matches_numpy(x, data):
    axis = data.draw(st.integers(0, x.ndim - 1), label="axis")
    k = data.draw(st.integers(0, 4), label="k")      # wider than some blocks
    assert_allclose(moving_average(x, axis, k), reference(x.to_global(), axis, k),
                    rtol=1e-12, atol=1e-9)


@pytest.mark.parallel([1, 2, 3, 4])
@settings(max_examples=15)
@given(x=arrays, data=st.data())
def test_layout_does_not_matter(x, data):
    other = data.draw(distributions(shape=x.shape, grid=x.grid), label="other")
    axis = data.draw(st.integers(0, x.ndim - 1), label="axis")
    a = moving_average(x, axis, 2).redistribute(other)
    b = moving_average(x.redistribute(other), axis, 2)
    assert_allclose(a, b.to_global(), rtol=1e-12, atol=1e-9)


@pytest.mark.parallel([1, 2, 3, 4])
@settings(max_examples=15)
@given(x=arrays)
def test_stays_within_the_input_range(x):
    y = moving_average(x, 0, 1)
    lo, hi = float(x.min()), float(x.max())          # collective reductions
    # Local check: a rank may hold an empty block, where min() would raise on that rank
    # alone, and a plain `assert` would fail on some ranks only. Either leaves the other
    # ranks waiting in their next collective; collective_assert makes all ranks agree.
    ok, msg = True, ""
    if y.local.size:
        a, b = y.local.min(), y.local.max()
        ok, msg = lo - 1e-9 <= a and b <= hi + 1e-9, f"block range [{a}, {b}] not in [{lo}, {hi}]"
    collective_assert(ok, msg)


@given(d=distributions())                             # grid shapes only: pure, no MPI
def test_blocks_tile_the_array(d):
    count = np.zeros(d.global_shape, dtype=int)
    for rank in range(d.nprocs):
        count[d.local_slices(rank)] += 1
    assert (count == d.nreplicas).all()


if __name__ == "__main__":
    import sys

    from mpi4py import MPI

    size = MPI.COMM_WORLD.size
    # What the launcher does for one world size: select the tests of this size (unmarked
    # tests count as size 1), with the plugin that makes the ranks agree on each outcome.
    code = pytest.main([__file__, "-q", "-p", "disttensor.testing.pytest_plugin",
                        "-m", f"parallel[{size}]",
                        "-W", "ignore::pytest.PytestAssertRewriteWarning"])
    if MPI.COMM_WORLD.rank == 0 and code == 0:
        print(f"property testing tutorial: OK on {size} ranks")
    sys.exit(int(code))
