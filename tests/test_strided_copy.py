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


@pytest.mark.parametrize("dtype", ["float32", "float64", "int16", "bfloat16"])
def test_copy_view_of_torch_tensors_matches_assignment(dtype):
    """CPU tensors are copied as their NumPy views: every random view of a tensor gets
    what torch's own assignment gives, into strided and reversed destinations alike
    (reversed ones through a flipped view: torch has no negative strides)."""
    torch = pytest.importorskip("torch")
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    tdt = getattr(torch, dtype)
    rng = np.random.default_rng(11)
    for shape, idx in _views(rng, 200):
        if any(s.step == -1 for s in idx):
            continue
        dst = torch.zeros(shape, dtype=tdt)
        view = dst[idx]
        src = torch.from_numpy(rng.integers(1, 100, size=view.shape).astype(np.float64)).to(tdt)
        want = dst.clone()
        want[idx] = src
        copy_view(view, src)
        assert torch.equal(dst, want), (shape, idx)
    # the interior of a halo-extended block, from a transposed (strided) source
    ext = torch.zeros(2, 3, 7, 9, dtype=tdt)
    src = torch.arange(2 * 3 * 7 * 5, dtype=torch.float64).reshape(2, 3, 7, 5).to(tdt)
    src = src.transpose(2, 3)  # (2, 3, 5, 7), not contiguous
    copy_view(ext[:, :, 1:6, 1:8], src)
    assert torch.equal(ext[:, :, 1:6, 1:8], src)
    assert not ext[:, :, 0].any() and not ext[:, :, 6].any()
