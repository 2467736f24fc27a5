"""The collective-consistency check mode: rank-dependent arguments raise on every rank.

Without the mode each of these calls hangs or returns wrong data (a root, an
integer index, a halo width, a target distribution that differ by rank);
with it every rank raises the same CollectiveMismatchError naming the
argument. Calls with equal arguments still give NumPy's results.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import assert_allclose, assert_equal, collective_assert, collective_outcome

comm = MPI.COMM_WORLD
P = comm.Get_size()
R = comm.Get_rank()
A = np.arange(24.0).reshape(6, 4)


@pytest.fixture
def checking():
    with dt.options(check_collective=True) as now:
        assert now["check_collective"] is True
        yield


def _x():
    g = dt.ProcessGrid(P)
    return dt.DistArray.from_global(A, dt.Distribution(A.shape, g))


def _mismatch(fn, argument):
    _, err = collective_outcome(fn)
    collective_assert(isinstance(err, dt.CollectiveMismatchError), repr(err))
    collective_assert(f"argument {argument!r} differs across ranks" in str(err), str(err))
    collective_assert("rank 0 passes" in str(err) and "rank 1 passes" in str(err), str(err))


CASES = {
    "to_global root": (lambda x: x.to_global(root=R % 2), "root"),
    "from_global root": (lambda x: dt.DistArray.from_global(A, x.dist, root=R % 2), "root"),
    "integer index": (lambda x: x[R % 2], "key"),
    "slice index": (lambda x: x[R % 2:], "key"),
    "setitem index": (lambda x: x.__setitem__(R % 2, 7.0), "key"),
    "halo width": (lambda x: x.exchange_halo(1 + R % 2), "widths"),
    "halo mode": (lambda x: x.exchange_halo(1, ("wrap", "edge")[R % 2]), "mode"),
    "halo fill": (lambda x: x.exchange_halo(1, constant_values=R % 2), "constant_values"),
    "redistribute target": (
        lambda x: x.redistribute(x.dist.replicated() if R % 2 else x.dist.with_axes((None, 0))),
        "dist"),
    "reduction axis": (lambda x: x.sum(axis=R % 2), "axis"),
    "numpy function axis": (lambda x: np.max(x, axis=R % 2), "kwargs"),
    "reshape": (lambda x: x.reshape((4, 6) if R % 2 else (6, 4)), "newshape"),
    "creation shape": (lambda x: dt.zeros((4 + R % 2,), grid=x.grid), "shape"),
    "halo accumulate width": (
        lambda x: dt.halo_accumulate(np.zeros(5), x.dist, ((R % 2, 0), (0, 0))), "widths"),
    "matmul operand": (lambda x, y: x @ y[R % 2], "inputs"),
}


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_dependent_argument_raises_everywhere(checking, case):
    fn, argument = CASES[case]
    x = _x()
    if case == "matmul operand":
        y = (x.T, x.T[:, :3])  # made on every rank, then used by rank
        _mismatch(lambda: fn(x, y), argument)
    else:
        _mismatch(lambda: fn(x), argument)
    assert_equal(x, A)  # nothing moved, nothing was written
    assert_allclose(x.sum(axis=0), A.sum(axis=0))  # and the ranks are still in step


@pytest.mark.parallel([2, 3])
def test_equal_arguments_give_numpys_results(checking):
    x = _x()
    g = x.to_global(root=0)
    collective_assert(np.array_equal(g, A) if R == 0 else g is None)
    assert_equal(x[1], A[1])
    assert_equal(x[1:5, ::2], A[1:5, ::2])
    assert_allclose(x.sum(axis=1), A.sum(axis=1))
    assert_allclose(np.mean(x, axis=0), A.mean(axis=0))
    assert_allclose((x * 2 + 1).reshape(4, 6), (A * 2 + 1).reshape(4, 6))
    assert_allclose(x @ x.T, A @ A.T)
    sl = x.dist.local_slices()
    ext = x.exchange_halo(1, "reflect")
    want = np.pad(A, 1, "reflect")[sl[0].start: sl[0].stop + 2, sl[1].start: sl[1].stop + 2]
    collective_assert(np.array_equal(ext, want))
    y = dt.DistArray.from_global(A if R == 0 else None, x.dist, root=0)
    assert_equal(y.redistribute(x.dist.with_axes((None, 0))), A)


@pytest.mark.parallel([2, 3])
def test_local_arguments_are_not_compared(checking):
    x = _x()
    # the array of non-root ranks and an extended local block differ by rank by design
    y = dt.DistArray.from_global(A if R == 0 else None, x.dist, root=0)
    assert_equal(y, A)
    ext = x.exchange_halo(1)
    back = dt.halo_accumulate(ext.copy(), x.dist, 1)
    collective_assert(back.local_shape == x.local_shape)


@pytest.mark.parallel([1, 2])
def test_options_api():
    before = dt.get_options()
    prev = dt.set_options(check_collective=True)
    assert prev == before and dt.get_options()["check_collective"] is True
    with dt.options(check_collective=False):
        assert dt.get_options()["check_collective"] is False
    assert dt.get_options()["check_collective"] is True
    dt.set_options(**prev)
    assert dt.get_options() == before
    with pytest.raises(TypeError, match="check_collective must be a bool"):
        dt.set_options(check_collective="yes")
    with pytest.raises(TypeError):
        dt.set_options(check_colective=True)  # a misspelt option is refused, not ignored


def _python(code, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA"))}
    base.pop("DISTTENSOR_CHECK_COLLECTIVE", None)
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, text=True,
                          capture_output=True, timeout=120)


def test_environment_switch():
    code = "import disttensor as dt; print(dt.get_options()['check_collective'])"
    assert _python(code).stdout.strip() == "False"
    assert _python(code, DISTTENSOR_CHECK_COLLECTIVE="1").stdout.strip() == "True"
    assert _python(code, DISTTENSOR_CHECK_COLLECTIVE="0").stdout.strip() == "False"
    bad = _python(code, DISTTENSOR_CHECK_COLLECTIVE="maybe")
    assert bad.returncode != 0 and "DISTTENSOR_CHECK_COLLECTIVE='maybe'" in bad.stderr
