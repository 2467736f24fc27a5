"""Array API code on DistArrays, the repr, and the generated coverage table."""

import importlib.util
import pathlib

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import assert_allclose, assert_equal, collective_assert
from disttensor.testing.numpy_compare import check_like_numpy

parallel = pytest.mark.parallel([1, 2, 3, 4])
ROOT = pathlib.Path(__file__).resolve().parents[1]


def standardise(x):
    """Array API code: knows nothing of NumPy or DistArrays."""
    xp = x.__array_namespace__()
    mu = xp.mean(x, axis=0, keepdims=True)
    sd = xp.std(x, axis=0, correction=1, keepdims=True)
    z = (x - mu) / sd
    z = xp.where(xp.abs(z) > 1.5, xp.zeros_like(z), z)
    return xp.concat([z, xp.expand_dims(xp.sum(z ** 2, axis=0), axis=0)], axis=0)


def api_mix(x, y):
    xp = x.__array_namespace__()
    a = xp.matmul(xp.permute_dims(x, (1, 0)), y)
    b = xp.stack([xp.max(x, axis=1), xp.min(y, axis=1)], axis=1)
    c = xp.reshape(xp.astype(x > 0, xp.int32), shape=(-1,))
    d = xp.vecdot(x, y)
    e = xp.clip(xp.flip(x, axis=0), min=-1.0, max=1.0)
    f = xp.argmax(xp.squeeze(xp.expand_dims(y, axis=1), axis=1), axis=0)
    g = xp.cumulative_sum(xp.sum(x, axis=1))
    return a, b, c, d, e, f, g, xp.count_nonzero(c), xp.pow(xp.abs(x), 0.5)


@parallel
def test_array_api_code_runs_on_distarrays():
    check_like_numpy(standardise, shapes=[(6, 4), (9, 3)], name="standardise")
    check_like_numpy(api_mix, shapes=[((6, 4), (6, 4))], mixed=True, name="api_mix")


@parallel
def test_namespace_creation_and_dtypes():
    comm = MPI.COMM_WORLD
    xp = dt.zeros(3).__array_namespace__()
    assert_equal(xp.arange(2, 11, 3), np.arange(2, 11, 3))
    assert_allclose(xp.linspace(0.0, 1.0, num=7), np.linspace(0.0, 1.0, 7), rtol=1e-15)
    assert_allclose(xp.linspace(0.0, 1.0, num=5, endpoint=False),
                    np.linspace(0.0, 1.0, 5, endpoint=False), rtol=1e-15)
    assert_equal(xp.eye(5, 4, k=1), np.eye(5, 4, k=1))
    assert_equal(xp.tril(xp.ones((5, 4)), k=-1), np.tril(np.ones((5, 4)), k=-1))
    assert_equal(xp.triu(xp.ones((5, 4))), np.triu(np.ones((5, 4))))
    assert_equal(xp.full((3, 2), 7), np.full((3, 2), 7))
    assert_equal(xp.asarray([[1, 2], [3, 4]], dtype=xp.float32),
                 np.asarray([[1, 2], [3, 4]], dtype=np.float32))
    info = xp.__array_namespace_info__()
    ok = (xp.isdtype(xp.float32, "real floating") and xp.result_type(xp.ones(2), xp.int8)
          == np.float64 and xp.can_cast(xp.int8, xp.int64) and xp.__array_api_version__
          and info.default_dtypes()["real floating"] == np.float64 and xp.ones(2).device
          == "cpu")
    collective_assert(ok, "namespace metadata", comm)


@parallel
def test_repr_shows_layout_not_data_and_is_the_same_everywhere():
    comm = MPI.COMM_WORLD
    grid = dt.ProcessGrid(sorted(MPI.Compute_dims(comm.size, 2)))
    x = dt.random.default_rng(0).random((5, 7), grid=grid, axes=(1, None))
    text = repr(x)
    same = len(set(comm.allgather(text))) == 1 and str(x) == text
    has = all(s in text for s in ("shape=(5, 7)", "float64", f"grid={grid.shape}",
                                  "axes=(1, None)"))
    collective_assert(same and has and "0." not in text, text, comm)


def _coverage_module():
    spec = importlib.util.spec_from_file_location("gen_coverage", ROOT / "docs" /
                                                  "gen_coverage.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_coverage_table_is_up_to_date():
    text = _coverage_module().render()
    on_disk = (ROOT / "docs" / "coverage.md").read_text()
    assert text == on_disk, "docs/coverage.md is stale: run python docs/gen_coverage.py"


@parallel
def test_array_programming_example_matches_numpy():
    spec = importlib.util.spec_from_file_location("array_programming", ROOT / "examples" /
                                                  "array_programming.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    collective_assert(mod.main() == 0, "the example differs from NumPy", MPI.COMM_WORLD)
