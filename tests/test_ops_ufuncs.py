"""Element-wise ufuncs and operators on DistArrays against NumPy on the gathered arrays.

Every check goes through :func:`disttensor.testing.numpy_compare.check_like_numpy`,
which runs the NumPy function and the DistArray one for several shapes,
dtypes and layouts (block, uneven with an empty block, replicated, 2-D grid
with replicas, multi-axis) and compares the results; errors must match too.
"""

import operator

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor import DistArray, Distribution, ProcessGrid
from disttensor.ops import implicit_redistribution, set_implicit_redistribution
from disttensor.testing import assert_equal, collective_assert
from disttensor.testing.numpy_compare import check_like_numpy, layouts, sample

parallel = pytest.mark.parallel([1, 2, 3, 4])

UNARY = sorted(
    (u for u in vars(np).values() if isinstance(u, np.ufunc) and u.nin == 1 and u.nout == 1
     and u.signature is None),
    key=lambda u: u.__name__,
)
BINARY = sorted(
    (u for u in vars(np).values() if isinstance(u, np.ufunc) and u.nin == 2 and u.nout == 1
     and u.signature is None),
    key=lambda u: u.__name__,
)
UNIT = {"arcsin", "arccos", "arctanh"}
POSITIVE = {"log", "log2", "log10", "sqrt", "arccosh", "reciprocal"}
UNARY_DTYPES = [np.bool_, np.int64, np.float32, np.float64, np.complex128]
SHAPES_1 = [(), (0,), (5, 4), (2, 3, 4)]


def _domain(u):
    return "unit" if u.__name__ in UNIT else "positive" if u.__name__ in POSITIVE else "any"


@parallel
def test_every_unary_ufunc():
    """All unary ufuncs, five dtypes (unsupported ones must raise like NumPy), all layouts."""
    for u in UNARY:
        if u.__name__ in ("isnat",):
            continue
        check_like_numpy(u, shapes=SHAPES_1, dtypes=UNARY_DTYPES, domain=_domain(u),
                         max_layouts=None if u in (np.negative, np.exp) else 2)


@parallel
def test_every_binary_ufunc_with_broadcasting():
    shapes = [((5, 4), (5, 4)), ((5, 4), (4,)), ((5, 1), (1, 4)), ((), (3,)), ((0, 3), (3,))]
    for u in BINARY:
        dom = "positive" if u.__name__ in ("power", "float_power", "ldexp", "gcd",
                                           "lcm") else "any"
        dtypes = [np.float64, np.int64] if u.__name__ != "ldexp" else [(np.float64, np.int64)]
        check_like_numpy(u, shapes=shapes, dtypes=dtypes, domain=dom, max_layouts=2)


@parallel
@pytest.mark.parametrize("ufunc", [np.add, np.multiply, np.less_equal, np.arctan2, np.maximum])
def test_binary_mixed_distributions(ufunc):
    """Operands laid out differently: the second moves to the first's layout."""
    shapes = [((6, 5), (6, 5)), ((6, 5), (5,)), ((6, 1), (1, 5)), ((1, 5), (6, 5))]
    check_like_numpy(ufunc, shapes=shapes, dtypes=[np.float64], mixed=True)


@parallel
def test_mixed_dtypes_and_promotion():
    check_like_numpy(np.add, shapes=[((4, 3), (4, 3))],
                     dtypes=[(np.int32, np.float32), (np.bool_, np.int8), (np.uint8, np.int16),
                             (np.float32, np.complex128)], mixed=True, max_layouts=3)


OPS = [operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
       operator.mod, operator.pow, operator.lt, operator.le, operator.eq, operator.ne,
       operator.gt, operator.ge]
INT_OPS = [operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift]


@parallel
def test_python_operators():
    for op in OPS:
        check_like_numpy(op, shapes=[((5, 4), (5, 4)), ((5, 4), (4,))], dtypes=[np.float64],
                         domain="positive", max_layouts=3, name=op.__name__)
    for op in INT_OPS:
        check_like_numpy(op, shapes=[((5, 4), (5, 4))], dtypes=[np.int64], domain="positive",
                         max_layouts=3, name=op.__name__)
    for op in (operator.neg, operator.pos, abs, operator.invert):
        dtype = np.int64 if op is operator.invert else np.float64
        check_like_numpy(op, shapes=[(5, 4)], dtypes=[dtype], max_layouts=3,
                         name=getattr(op, "__name__", "op"))


@parallel
def test_scalars_and_numpy_operands():
    """Scalars and global NumPy arrays (the same on every rank) on either side."""
    b = sample((4,), seed=9)
    c = sample((5, 1), seed=10)
    cases = [
        (lambda x: x + 2, "x + 2"), (lambda x: 2.5 - x, "2.5 - x"),
        (lambda x: x * np.float32(3), "x * float32"), (lambda x: x ** 2, "x ** 2"),
        (lambda x: x + b, "x + b"), (lambda x: b - x, "b - x"), (lambda x: c * x, "c * x"),
        (lambda x: np.maximum(x, b), "maximum(x, b)"), (lambda x: x > b, "x > b"),
        (lambda x: np.add(x, 1, dtype=np.float32), "add dtype"),
    ]
    for f, name in cases:
        check_like_numpy(f, shapes=[(5, 4)], dtypes=[np.float64, np.int32], name=name)
    # NEP 50: a Python int out of range of the array's dtype raises like NumPy
    check_like_numpy(lambda x: x + 300, shapes=[(5, 4)], dtypes=[np.int8], name="int8 + 300")


@parallel
def test_out_and_where():
    def with_out(np_mode):
        def f(x, y):
            out = np.full_like(x, -1.0) if np_mode else dt.ops.namespace.full_like(x, -1.0)
            np.add(x, y, out=out, where=(y > 0))
            return out
        return f

    check_like_numpy(with_out(True), with_out(False), shapes=[((5, 4), (5, 4)), ((5, 4), (4,))],
                     mixed=True, name="add(out=, where=)")

    def inplace(x, y):
        x += y
        x *= 2
        return x

    check_like_numpy(inplace, shapes=[((5, 4), (5, 4)), ((5, 4), (4,))], mixed=True,
                     name="in-place")


@parallel
def test_out_in_another_layout_and_numpy_where():
    """``out`` decides the layout; a global NumPy ``where`` mask is sliced per rank."""
    comm = MPI.COMM_WORLD
    g = sample((6, 5))
    lay = layouts((6, 5))
    x = DistArray.from_global(g, lay[0])
    out = DistArray.from_global(np.zeros((6, 5)), lay[-1])
    mask = g > 0
    np.multiply(x, 3.0, out=out, where=mask)
    assert_equal(out, np.where(mask, g * 3.0, 0.0))
    collective_assert(out.dist == lay[-1], "out changed its distribution", comm)


@parallel
def test_multiple_outputs():
    for u in (np.divmod, np.modf, np.frexp):
        check_like_numpy(u, shapes=[(5, 4), (0,)], dtypes=[np.float64], domain="positive",
                         mixed=True, name=u.__name__)
    check_like_numpy(np.divmod, shapes=[((5, 4), (4,))], dtypes=[np.int64], domain="positive",
                     mixed=True)


@parallel
def test_errors_are_numpys_and_collective():
    check_like_numpy(np.add, shapes=[((5, 4), (3,)), ((2, 3), (3, 2))], name="bad broadcast")
    check_like_numpy(lambda x: np.add(x, 1.5, out=x), shapes=[(5, 4)], dtypes=[np.int64],
                     name="bad cast to out")
    check_like_numpy(np.bitwise_and, shapes=[((5, 4), (5, 4))], dtypes=[np.float64],
                     name="unsupported dtype")


@parallel
def test_result_distribution_rule():
    """First full-shape DistArray operand wins; others move to it."""
    comm = MPI.COMM_WORLD
    lay = layouts((6, 5))
    a = DistArray.from_global(sample((6, 5)), lay[0])
    b = DistArray.from_global(sample((6, 5), seed=1), lay[-1])
    v = DistArray.from_global(sample((5,), seed=2), layouts((5,))[0])
    ok = (a + b).dist == a.dist and (b + a).dist == b.dist and (v + a).dist == a.dist
    col = DistArray.from_global(sample((6, 1)), Distribution((6, 1), lay[0].grid, (0, None)))
    row = DistArray.from_global(sample((1, 5)), Distribution((1, 5), lay[0].grid, (None, 0)))
    r = col * row  # no operand has the result shape: the bigger one, extended, decides
    ok = ok and r.dist.dim_axes == ((0,), ()) and r.shape == (6, 5)
    collective_assert(ok, "result distributions do not follow the rule", comm)


@parallel
def test_disabled_implicit_redistribution():
    comm = MPI.COMM_WORLD
    grid = ProcessGrid((comm.size,))
    a = dt.ones((8, 6), grid=grid, axes=(0, None))
    b = dt.ones((8, 6), grid=grid, axes=(None, 0))
    rep = dt.ones((6,), grid=grid, axes=(None,))
    with implicit_redistribution(False):
        c = a + rep  # every rank already holds what it needs: allowed
        try:
            a + b
            raised = comm.size == 1  # on one rank nothing would move
        except ValueError as exc:
            raised = "implicit redistribution is disabled" in str(exc)
    assert_equal(c, np.full((8, 6), 2.0))
    collective_assert(raised, "a move was not refused", comm)
    previous = set_implicit_redistribution(False)
    collective_assert(previous is True and set_implicit_redistribution(True) is False,
                      "set_implicit_redistribution does not return the previous value", comm)


@parallel
def test_unknown_operand_types_defer():
    comm = MPI.COMM_WORLD

    class Other:
        __array_ufunc__ = None

        def __radd__(self, other):
            return "deferred"

    x = dt.ones((4,))
    collective_assert(x + Other() == "deferred", "did not defer to the other operand", comm)
