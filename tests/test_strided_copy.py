"""The packing copies of halo faces: backend.copy_view and fill_view against NumPy assignment."""

import numpy as np
import pytest

from disttensor.backend import copy_view, fill_view

DTYPES = [np.float32, np.float64, np.int8, np.int16, np.complex128, np.dtype("U2"),
          np.dtype([("a", "i1"), ("b", "f4")])]


def _views(rng, count=400):
    """Random basic-index views (empty, size-1, reversed and short-run axes included)."""
    for _ in range(count):
        shape = tuple(int(s) for s in rng.integers(0, 6, rng.integers(1, 5)))
        idx = []
        for n in shape:
            lo = int(rng.integers(0, n + 1))
            hi = int(rng.integers(lo, n + 1))
            if rng.random() < 0.8:
                idx.append(slice(lo, hi))
            else:  # reversed
                idx.append(slice(hi - 1 if hi > lo else None, lo - 1 if lo > 0 else None, -1))
        yield shape, tuple(idx)
    # the faces of a halo exchange: width 1-3 across the last axis, inner and outer
    for w in (1, 2, 3):
        yield (2, 3, 5, 9), (slice(None), slice(None), slice(1, 4), slice(w, 2 * w))
        yield (2, 3, 5, 9), (slice(None), slice(None), slice(None), slice(9 - w, 9))
        yield (2, 3, 9, 5), (slice(None), slice(None), slice(w, 2 * w), slice(1, 4))


def _random(rng, shape, dtype):
    dt = np.dtype(dtype)
    raw = rng.integers(1, 100, size=(*shape, dt.itemsize), dtype=np.uint8)
    if dt.kind == "U":
        return np.array(rng.choice(["ab", "c", "xyz"[:2]], size=shape), dtype=dt)
    return raw.view(dt).reshape(shape) if dt.names is None else raw.view(dt)[..., 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_view_matches_assignment(dtype):
    rng = np.random.default_rng(0)
    for shape, idx in _views(rng):
        a = _random(rng, shape, dtype)
        view = a[idx]
        packed = np.empty(view.shape, a.dtype)
        copy_view(packed, view)
        assert packed.tobytes() == view.copy().tobytes(), (shape, idx)
        target, expected = np.zeros_like(a), np.zeros_like(a)
        copy_view(target[idx], packed)
        expected[idx] = view
        assert target.tobytes() == expected.tobytes(), (shape, idx)


@pytest.mark.parametrize("dtype", DTYPES[:5], ids=str)
def test_fill_view_matches_assignment(dtype):
    rng = np.random.default_rng(1)
    value = np.array(7, dtype).item()
    for shape, idx in _views(rng):
        a = _random(rng, shape, dtype)
        filled, expected = a.copy(), a.copy()
        fill_view(filled[idx], value)
        expected[idx] = value
        assert filled.tobytes() == expected.tobytes(), (shape, idx)
