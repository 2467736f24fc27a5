"""The collective-consistency check mode: rank-dependent arguments raise on every rank.

Without the mode each of these calls hangs or returns wrong data (a root, an
integer index, a halo width, a target distribution that differ by rank);
with it every rank raises the same CollectiveMismatchError naming the
argument. Calls with equal arguments still give NumPy's results.
"""

import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.ops import implicit_redistribution
from disttensor.testing import assert_allclose, assert_equal, collective_assert, collective_outcome
from disttensor_nn.layers.loss import MSELoss, SoftmaxCrossEntropy

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


# ------------------------------------------------ validation that fails on some ranks only
# Each call is valid on rank 0 and invalid on the others, where it raised before any check
# ran: rank 0 went on into the operation (or the next collective) and the job hung. In
# check mode the argument digest and each rank's verdict travel in one message, so every
# rank raises the same error, naming the argument and both values.
def _implicit_move(x):
    y = x.redistribute(x.dist.with_axes((None, 0)))  # x + y moves y to x's layout
    with implicit_redistribution(R == 0):
        return x + y


DIVERGENT = {
    "ProcessGrid shape": (lambda x: dt.ProcessGrid((P,) if R == 0 else (P + 1,)),
                          "argument 'shape'", (f"({P},)", f"({P + 1},)")),
    "from_global array": (lambda x: dt.DistArray.from_global(A if R == 0 else A[:5], x.dist),
                          "argument 'array'", ("shape=(6, 4)", "shape=(5, 4)")),
    "implicit move": (_implicit_move, "option 'implicit_redistribution'", ("True", "False")),
    "MSELoss target": (lambda x: MSELoss()(x, A if R == 0 else A[:5]), "argument 'target'",
                       ("shape=(6, 4)", "shape=(5, 4)")),
    "SoftmaxCrossEntropy labels": (
        lambda x: SoftmaxCrossEntropy()(x, np.zeros(6 if R == 0 else 5, np.int64)),
        "argument 'labels'", ("shape=(6,)", "shape=(5,)")),
    "random seed": (lambda x: dt.random.default_rng(1 + (R > 0)).random((6, 4), grid=x.grid),
                    "argument 'self'", ("seed=1,", "seed=2,")),
}


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("case", sorted(DIVERGENT))
def test_validation_on_some_ranks_only_raises_everywhere(checking, case):
    fn, what, (mine0, mine1) = DIVERGENT[case]
    x = _x()
    _, err = collective_outcome(lambda: fn(x))  # the same type and message on every rank
    msg = str(err)
    collective_assert(isinstance(err, dt.CollectiveMismatchError), repr(err))
    collective_assert(f"{what} differs across ranks" in msg, msg)
    collective_assert(f"rank 0 {'has' if what.startswith('option') else 'passes'} " in msg
                      and mine0 in msg.split("rank 1")[0] and mine1 in msg.split("rank 1")[1],
                      msg)
    assert_allclose(x.sum(axis=0), A.sum(axis=0))  # the ranks are still in step


def _without_agreement():
    """check_arguments reduced to each rank raising its own error: the mechanism disabled."""
    def local(name, arguments, comm=None, error=None):
        if error is not None:
            raise error
    return mock.patch.object(dt.settings, "check_arguments", local)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("case", ["ProcessGrid shape", "from_global array"])
def test_without_the_agreement_the_ranks_end_differently(checking, case):
    # the mutation that the test above must catch: with each rank left to its own verdict,
    # rank 0 returns and the others raise (these two calls send no message, so nothing hangs;
    # the others would hang here, rank 0 inside the operation)
    fn = DIVERGENT[case][0]
    x = _x()
    with _without_agreement():
        try:
            fn(x)
            raised = False
        except ValueError:
            raised = True
    outcomes = comm.allgather(raised)
    collective_assert(outcomes == [False] + [True] * (P - 1), str(outcomes))


@pytest.mark.parallel([2, 3])
def test_a_local_verdict_is_agreed_when_the_arguments_agree(checking):
    # the arguments (the distribution) agree; the local block is wrong on the last rank only
    x = _x()
    block = x.local if R < P - 1 else x.local[:0]
    _, err = collective_outcome(lambda: dt.DistArray.from_local(block, x.dist))
    msg = str(err)
    collective_assert(type(err) is ValueError, repr(err))
    collective_assert(msg.startswith("local block has shape (0, 4)"), msg)
    ranks = ", ".join(map(str, range(P - 1)))
    collective_assert(f"(raised on rank {P - 1} only; rank{'s' if P > 2 else ''} {ranks} "
                      "accepted the same arguments)" in msg, msg)
    # and a rank-local block of halo_accumulate (not compared: it differs by design)
    ext = x.exchange_halo(1)
    bad = ext if R else ext[1:]
    _, err = collective_outcome(lambda: dt.halo_accumulate(bad, x.dist, 1))
    collective_assert(type(err) is ValueError and "extended block has shape" in str(err)
                      and "raised on rank 0 only" in str(err), repr(err))
    back = dt.halo_accumulate(ext.copy(), x.dist, 1)  # every rank valid: it runs
    collective_assert(back.local_shape == x.local_shape)


class _Local(Exception):
    pass


@pytest.mark.parallel([2, 3])
def test_agreed_errors_keep_their_type_and_message(checking):
    # every rank failing alike: the error as it is; an error only some ranks can rebuild:
    # a CollectiveMismatchError naming its class
    def fail(exc):
        with dt.settings.validating("f", {"n": 1}):
            if exc is not None:
                raise exc
    _, err = collective_outcome(lambda: fail(TypeError("bad n")))
    collective_assert(type(err) is TypeError and str(err) == "bad n", repr(err))
    _, err = collective_outcome(lambda: fail(KeyError("k") if R == 1 else None))
    collective_assert(type(err) is dt.CollectiveMismatchError
                      and str(err).startswith("builtins.KeyError: 'k' (raised on rank 1 only"),
                      repr(err))
    _, err = collective_outcome(lambda: fail(_Local("mine") if R == 0 else None))
    collective_assert(type(err) is _Local and str(err).startswith("mine (raised on rank 0"),
                      repr(err))
    _, err = collective_outcome(lambda: fail(ValueError(f"rank {R}")))
    collective_assert(type(err) is ValueError
                      and str(err) == "rank 0 (on rank 0; the ranks' errors differ)", repr(err))


@pytest.mark.parallel([1, 2, 3])
def test_outside_check_mode_validation_stays_local():
    # no agreement and no message: each rank raises its own error, as before
    def refuse(*args, **kwargs):
        raise AssertionError("check_arguments called outside check mode")
    with dt.options(check_collective=False), \
            mock.patch.object(dt.settings, "check_arguments", refuse):
        with pytest.raises(ValueError, match="process grid"):
            dt.ProcessGrid(P + 1)
        g = dt.ProcessGrid(P)
        d = dt.Distribution((5,), g)
        with pytest.raises(ValueError, match="local block has shape"):
            dt.DistArray.from_local(np.zeros(9), d)
        x = dt.DistArray.from_local(np.zeros(d.local_shape()), d)
        with pytest.raises(ValueError, match="target shape"):
            MSELoss()(x, np.zeros(4))
        assert x.shape == (5,)


@pytest.mark.parallel([2, 3])
def test_equal_seeds_and_draws_pass(checking):
    g = dt.ProcessGrid(P)
    rng = dt.random.default_rng(7)
    a = rng.random((6, 4), grid=g)
    b = rng.standard_normal((6, 4), grid=g)
    collective_assert(a.shape == b.shape == (6, 4))
    if R == 0:
        rng.random((2,), grid=dt.ProcessGrid(1, MPI.COMM_SELF))  # an extra draw on rank 0
    _, err = collective_outcome(lambda: rng.random((6, 4), grid=g))
    collective_assert(isinstance(err, dt.CollectiveMismatchError) and "drawn=3" in str(err)
                      and "drawn=2" in str(err), repr(err))
