"""Shape functions and element-wise helpers on DistArrays against NumPy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import disttensor as dt
from disttensor import DistArray, ProcessGrid
from disttensor.ops import implicit_redistribution
from disttensor.testing import assert_equal, collective_assert
from disttensor.testing.numpy_compare import check_like_numpy
from disttensor.testing.strategies import distributions, process_grids

parallel = pytest.mark.parallel([1, 2, 3, 4])
DTYPES = [np.float64, np.int32]


@parallel
def test_transpose_family():
    cases = [
        (lambda x: np.transpose(x), "transpose"), (lambda x: x.T, "T"),
        (lambda x: np.transpose(x, (1, 2, 0)), "transpose(1,2,0)"),
        (lambda x: x.transpose(2, 0, 1), "x.transpose(2,0,1)"),
        (lambda x: np.moveaxis(x, 0, -1), "moveaxis"),
        (lambda x: np.moveaxis(x, [0, 1], [2, 0]), "moveaxis lists"),
        (lambda x: np.swapaxes(x, 0, 2), "swapaxes"), (lambda x: x.mT, "mT"),
        (lambda x: np.permute_dims(x, (0, 2, 1)), "permute_dims"),
        (lambda x: np.transpose(x, (0, 1)), "bad axes"),
    ]
    for f, name in cases:
        check_like_numpy(f, shapes=[(3, 4, 5), (2, 0, 3)], dtypes=DTYPES, name=name)


RESHAPES = [
    ((6, 4), (24,)), ((6, 4), (3, 2, 4)), ((6, 4), (4, 6)), ((6, 4), (2, 12)),
    ((6, 4), (-1, 3)), ((2, 3, 4), (6, 4)), ((2, 3, 4), (2, 12)), ((2, 3, 4), (24,)),
    ((24,), (4, 6)), ((24,), (2, 3, 4)), ((1, 6), (6,)), ((6,), (1, 6, 1)),
    ((6, 1, 4), (6, 4)), ((5, 4), (3, 7)), ((0, 4), (2, 0)), ((1,), ()), ((), (1, 1)),
    ((7, 3), (3, 7)), ((4, 1, 1, 5), (2, 10)),
]


@parallel
def test_reshape():
    for src, dst in RESHAPES:
        check_like_numpy(lambda x, dst=dst: np.reshape(x, dst), shapes=[src], dtypes=DTYPES,
                         name=f"reshape {src}->{dst}")
    check_like_numpy(lambda x: x.reshape(4, 6), shapes=[(6, 4)], name="x.reshape(4, 6)")
    check_like_numpy(lambda x: x.ravel(), shapes=[(3, 4, 2)], name="ravel")
    check_like_numpy(lambda x: x.flatten(), shapes=[(3, 4)], name="flatten")


@parallel
def test_reshape_pure_merge_or_split_is_local():
    """Merging dims after a split one, or splitting at block boundaries, moves nothing."""
    comm = MPI.COMM_WORLD
    grid = ProcessGrid((comm.size,))
    x = dt.ones((2 * comm.size, 3, 4), grid=grid, axes=(0, None, None))
    with implicit_redistribution(False):  # would raise if anything had to move
        y = x.reshape(2 * comm.size, 12)
        z = y.reshape(comm.size, 2, 12)
    collective_assert(y.dist.dim_axes == ((0,), ()) and z.dist.replica_axes == (),
                      f"{y.dist} / {z.dist}", comm)
    assert_equal(z, np.ones((comm.size, 2, 12)))


@parallel
def test_concatenate_and_stack():
    shapes = [((3, 4), (2, 4)), ((3, 4), (3, 4)), ((0, 4), (5, 4))]
    for axis in (0, -2):
        check_like_numpy(lambda a, b, axis=axis: np.concatenate([a, b], axis=axis),
                         shapes=shapes, dtypes=DTYPES + [(np.int32, np.float32)], mixed=True,
                         name=f"concatenate axis={axis}")
    check_like_numpy(lambda a, b: np.concatenate([a, b, a], axis=1),
                     shapes=[((4, 3), (4, 2))], mixed=True, name="concatenate axis=1")
    check_like_numpy(lambda a, b: np.concatenate([a, b], axis=None),
                     shapes=[((4, 3), (2, 2))], name="concatenate axis=None")
    check_like_numpy(lambda a, b: np.concatenate([a, b]), shapes=[((4, 3), (4, 2))],
                     name="concatenate mismatch")
    g = np.arange(8.0).reshape(2, 4)
    check_like_numpy(lambda a: np.concatenate([a, g]), shapes=[(3, 4)], name="with numpy")
    for axis in (0, 1, -1):
        check_like_numpy(lambda a, b, axis=axis: np.stack([a, b], axis=axis),
                         shapes=[((3, 4), (3, 4))], mixed=True, name=f"stack axis={axis}")
    check_like_numpy(lambda a, b: np.stack([a, b]), shapes=[((3, 4), (4, 3))],
                     name="stack mismatch")


@parallel
def test_elementwise_functions():
    cases = [
        (lambda c, a, b: np.where(c > 0, a, b), [((5, 4), (5, 4), (5, 4)),
                                                 ((5, 4), (4,), ()), ((5, 1), (1, 4), (5, 4))]),
    ]
    for f, shapes in cases:
        check_like_numpy(f, shapes=shapes, dtypes=DTYPES, mixed=True, name="where")
    one = [
        (lambda x: np.clip(x, -1, 2), "clip"), (lambda x: x.clip(0), "x.clip(0)"),
        (lambda x: np.clip(x, x * 0 - 1, 1), "clip arrays"),
        (lambda x: np.round(x * 3.3, 1), "round"), (lambda x: x.astype(np.int16), "astype"),
        (lambda x: np.astype(x, np.float32), "np.astype"),
        (lambda x: np.real(x * 1j + 1), "real"), (lambda x: (x * 1j).imag, "imag"),
        (lambda x: np.isclose(x, x + 1e-9), "isclose"), (lambda x: np.copy(x), "copy"),
        (lambda x: np.allclose(x, x), "allclose"), (lambda x: np.array_equal(x, x), "equal"),
        (lambda x: np.expand_dims(x, (0, 2)), "expand_dims"), (lambda x: np.flip(x), "flip"),
        (lambda x: np.flip(x, 1), "flip(1)"), (lambda x: np.squeeze(x[:1]), "squeeze"),
        (lambda x: np.broadcast_to(x, (2, 5, 4)), "broadcast_to"),
        (lambda x: np.zeros_like(x), "zeros_like"), (lambda x: np.full_like(x, 7), "full_like"),
        (lambda x: np.ones_like(x, dtype=np.int8), "ones_like"),
        (lambda x: (np.shape(x), np.ndim(x), np.size(x)), "shape/ndim/size"),
        (lambda x: np.logical_and(x > 0, x < 1), "logical_and"),
        (lambda x: ~(x > 0) | (x < -1), "~ and |"),
        (lambda x: np.nan_to_num(np.log(x)), "nan_to_num"),
    ]
    for f, name in one:
        check_like_numpy(f, shapes=[(5, 4)], dtypes=DTYPES, name=name)


@parallel
@settings(max_examples=15)
@given(d=distributions(grid=process_grids(max_ndim=2), max_dims=3, max_side=6),
       data=st.data())
def test_transpose_reshape_roundtrip_any_distribution(d, data):
    """Any layout: transposing is free, reshape(-1) then back gives the array again."""
    g = np.arange(int(np.prod(d.global_shape)), dtype=np.float64).reshape(d.global_shape)
    x = DistArray.from_global(g, d)
    perm = data.draw(st.permutations(range(x.ndim)))
    assert_equal(np.transpose(x, perm), np.transpose(g, perm))
    assert_equal(x.ravel().reshape(x.shape), g)


@parallel
def test_unsupported_function_raises_type_error():
    comm = MPI.COMM_WORLD
    x = dt.ones((4, 3))
    try:
        np.histogram(x)
        raised = False
    except TypeError as exc:
        raised = "no implementation found" in str(exc)
    try:
        np.asarray(x)
        converted = True
    except TypeError:
        converted = False
    collective_assert(raised and not converted, "np.histogram / np.asarray did not raise", comm)


@parallel
def test_functions_built_from_slicing():
    cases = [
        (lambda x: np.roll(x, 2, axis=0), "roll"), (lambda x: np.roll(x, -7), "roll flat"),
        (lambda x: np.roll(x, (1, 3), axis=(0, 1)), "roll 2 axes"),
        (lambda x: np.diff(x), "diff"), (lambda x: np.diff(x, n=2, axis=0), "diff n=2"),
        (lambda x: np.nonzero(x > 0), "nonzero"), (lambda x: np.argwhere(x > 0), "argwhere"),
        (lambda x: np.flatnonzero(x < 0), "flatnonzero"),
        (lambda x: np.atleast_3d(x), "atleast_3d"), (lambda x: np.unstack(x, axis=1), "unstack"),
        (lambda x: np.hstack([x, x]), "hstack"), (lambda x: np.vstack([x, x[:2]]), "vstack"),
    ]
    for f, name in cases:
        check_like_numpy(f, shapes=[(6, 5)], dtypes=[np.float64], max_layouts=4, name=name)
    for f in (np.atleast_1d, np.atleast_2d, np.diff, lambda x: np.roll(x, 3)):
        check_like_numpy(f, shapes=[(), (7,)] if f is not np.diff else [(7,), (0,)],
                         max_layouts=3)
